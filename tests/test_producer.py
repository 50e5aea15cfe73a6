"""The prefill-side endpoint, driven by hand (the consumer's messages are typed in)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpush.protocol import (
    Abort,
    Announce,
    Cancel,
    Completion,
    ControlMessage,
    Extend,
    Heartbeat,
    Identity,
    LocalProtocolError,
    Mode,
    PeerReady,
    Producer,
    ProducerConfig,
    PState,
    ReadDone,
    Register,
    Rejected,
    RejectReason,
    ReleaseOutcome,
    Renew,
    Role,
    Send,
    Settled,
    Source,
    SourceReleased,
    StartWrite,
    Timing,
    Withdraw,
    WriteFailed,
)
from kvpush.protocol._tables import PRODUCER, PInput
from kvpush.protocol._timeline import TimelineBuilder
from kvpush.protocol._transfer import Reg, Transfer

P, D = "prefill", "decode"
#: The consumer's op bound, learned at handshake.
C_OP_BOUND = 4.0
TIMING = Timing(max_transit=1.5, op_bound=6.0)
SRC = ((1, 2, 3),)
DST = ((7, 8, 9),)
PART = ((1, 2),)  # SRC's first increment (progressive push)


def make(*, p_tp: int = 1, c_tp: int = 1, pp: int = 1, **cfg: Any) -> Producer:
    """A producer whose handshake with consumer ``D`` is done."""
    p = Producer(ProducerConfig(Identity(P, 1, tp=p_tp, pp=pp), timing=TIMING, **cfg))
    p.receive(0.0, D, Identity(D, 1, tp=c_tp).hello(Role.CONSUMER, C_OP_BOUND, TIMING.max_transit))
    assert [type(o) for o in p.drain()] == [Send, PeerReady]
    return p


def register(
    epoch: int, lease: float = 30.0, blocks: Any = DST, tid: str = "t1", mode: Mode = Mode.PUSH
) -> Register:
    return Register(tid, epoch, D, blocks, lease, mode)


def writes(out: list[Any]) -> list[StartWrite]:
    return [o for o in out if isinstance(o, StartWrite)]


def sent(out: list[Any]) -> list[ControlMessage]:
    return [o.message for o in out if isinstance(o, Send)]


def released(out: list[Any]) -> list[ReleaseOutcome]:
    return [o.outcome for o in out if isinstance(o, SourceReleased)]


def finish(p: Producer, ws: list[StartWrite], now: float, fail: bool = False) -> None:
    for w in ws:
        if fail:
            p.write_failed(now, w.transfer_id, w.epoch, w.route.source, w.route.consumer_rank)
        else:
            p.write_done(now, w.transfer_id, w.epoch, w.route.source, w.route.consumer_rank)


def writing(p: Producer, epoch: int = 1, now: float = 0.0, lease: float = 30.0) -> list[StartWrite]:
    p.receive(now, D, register(epoch, lease))
    p.kv_ready(now, "t1", SRC)
    ws = writes(p.drain())
    assert ws
    return ws


@pytest.mark.parametrize("order", ["register_first", "kv_first"])
def test_rendezvous_in_either_order_with_duplicates(order: str) -> None:
    p = make(p_tp=2)
    reg = register(1)
    steps = [("reg", reg), ("reg", reg), ("kv", None), ("kv", None), ("reg", reg)]
    if order == "kv_first":
        steps = [("kv", None), ("kv", None), ("reg", reg), ("reg", reg), ("kv", None)]
    out: list[Any] = []
    for i, (what, msg) in enumerate(steps):
        if what == "reg":
            assert msg is not None
            p.receive(float(i), D, msg)
        else:
            p.kv_ready(float(i), "t1", SRC)
        out += p.drain()
    ws = writes(out)
    assert [(w.route.source, w.route.consumer_rank) for w in ws] == [(Source(0), 0), (Source(1), 0)]
    for w in ws:
        assert (w.transfer_id, w.epoch, w.peer) == ("t1", 1, D)
        assert (w.src_blocks, w.dst_blocks) == (SRC, DST)
        assert w.notice == Completion("t1", 1, w.route.source, w.route.consumer_rank)
    assert sent(out) == []
    assert p.stats()["register_duplicate"] >= 1
    assert p.stats()["kv_ready_duplicate"] >= 1
    assert p.transfers() == [("t1", PState.WRITING)]
    assert p.held_blocks == 3


def test_kv_ready_with_other_blocks_is_misuse() -> None:
    p = make()
    p.kv_ready(0.0, "t1", SRC)
    with pytest.raises(LocalProtocolError, match="other blocks"):
        p.kv_ready(0.0, "t1", ((4,),))


def test_not_after_is_receipt_plus_lease() -> None:
    p = make()
    p.receive(3.0, D, register(1, lease=10.0))
    assert p.next_deadline() == 8.0  # the lease timer, half the lease: time to renew
    p.kv_ready(5.0, "t1", SRC)
    (w,) = writes(p.drain())
    assert w.not_after == 13.0
    # The only timer left bounds the write: op_bound after it was handed over.
    assert p.next_deadline() == 5.0 + TIMING.op_bound
    tl = p.timeline("t1")
    assert tl is not None
    assert (tl.registration_received, tl.kv_ready, tl.write_started) == (3.0, 5.0, 5.0)


def test_lower_epoch_registration_is_rejected() -> None:
    p = make()
    p.receive(0.0, D, register(5))
    p.receive(0.1, D, register(3))
    assert sent(p.drain()) == [Rejected("t1", 3, RejectReason.SUPERSEDED)]
    p.receive(0.2, D, register(5))
    assert p.drain() == []
    p.kv_ready(1.0, "t1", SRC)
    assert [w.epoch for w in writes(p.drain())] == [5]
    p.receive(1.1, D, register(4))
    assert sent(p.drain()) == [Rejected("t1", 4, RejectReason.SUPERSEDED)]
    assert p.stats()["register_stale"] == 2
    assert p.transfers() == [("t1", PState.WRITING)]


def test_newer_epoch_before_kv_supersedes() -> None:
    p = make()
    p.receive(0.0, D, register(1))
    p.receive(0.1, D, register(2, blocks=((4,),)))
    assert sent(p.drain()) == [Rejected("t1", 1, RejectReason.SUPERSEDED)]
    p.kv_ready(1.0, "t1", SRC)
    assert [(w.epoch, w.dst_blocks) for w in writes(p.drain())] == [(2, ((4,),))]


def test_newer_epoch_waits_for_every_write_of_the_old_one() -> None:
    p = make(p_tp=2)
    old = writing(p)
    p.receive(1.0, D, register(2, lease=10.0, blocks=((4, 5, 6),)))
    assert p.drain() == []
    finish(p, old[:1], 2.0)
    assert p.drain() == []  # a sibling of epoch 1 may still land
    finish(p, old[1:], 3.0, fail=True)
    out = p.drain()
    assert sent(out) == [
        WriteFailed("t1", 1, Source(1), 0, "write failed"),
        Settled("t1", 1),
    ]
    new = writes(out)
    assert [(w.epoch, w.dst_blocks, w.not_after) for w in new] == [(2, ((4, 5, 6),), 11.0)] * 2
    assert released(out) == []
    finish(p, new, 4.0)
    out = p.drain()
    assert released(out) == []  # delivered, held until the consumer acknowledges
    assert sent(out) == []
    assert p.transfers() == [("t1", PState.DELIVERED)]
    assert p.held_blocks == 3
    p.receive(5.0, D, ReadDone("t1", 2, True))
    assert released(p.drain()) == [ReleaseOutcome.DELIVERED]
    assert p.held_blocks == 0


def test_withdraw_then_newer_epoch_is_written_after_settle() -> None:
    p = make()
    old = writing(p)
    p.receive(1.0, D, Withdraw("t1", 1))
    p.receive(1.0, D, Withdraw("t1", 1))
    p.receive(1.5, D, register(2))
    assert p.drain() == []
    assert p.stats()["withdraw_duplicate"] == 1
    finish(p, old, 2.0)
    out = p.drain()
    assert sent(out) == [Settled("t1", 1)]
    assert [w.epoch for w in writes(out)] == [2]


def test_withdraw_during_writes_settles_then_holds() -> None:
    p = make(kv_hold_timeout=20.0)
    old = writing(p)
    p.receive(1.0, D, Withdraw("t1", 1))
    assert p.drain() == []
    finish(p, old, 2.0)
    assert sent(p.drain()) == [Settled("t1", 1)]
    assert p.transfers() == [("t1", PState.HOLDING)]
    assert p.held_blocks == 3
    assert p.next_deadline() == 22.0
    p.receive(3.0, D, register(2))
    assert [w.epoch for w in writes(p.drain())] == [2]


def test_withdraw_before_kv_settles_at_once() -> None:
    p = make()
    p.receive(0.0, D, register(1))
    p.receive(1.0, D, Withdraw("t1", 1))
    assert sent(p.drain()) == [Settled("t1", 1)]
    assert p.transfers() == [("t1", PState.IDLE)]
    p.kv_ready(2.0, "t1", SRC)
    assert p.drain() == []
    assert p.transfers() == [("t1", PState.HOLDING)]
    p.receive(2.5, D, register(1))  # a delayed duplicate of the withdrawn epoch
    assert sent(p.drain()) == [Rejected("t1", 1, RejectReason.SUPERSEDED)]


def test_withdraw_overtaking_its_registration_blocks_it() -> None:
    p = make()
    p.receive(0.0, D, Withdraw("t1", 1))
    assert sent(p.drain()) == [Settled("t1", 1)]
    p.receive(0.5, D, register(1))
    assert sent(p.drain()) == [Rejected("t1", 1, RejectReason.SUPERSEDED)]


def test_no_write_starts_after_the_lease() -> None:
    p = make()
    p.receive(0.0, D, register(1, lease=10.0))
    p.kv_ready(10.5, "t1", SRC)  # the lease timer has not even run
    out = p.drain()
    assert writes(out) == []
    assert sent(out) == [Rejected("t1", 1, RejectReason.LEASE_EXPIRED)]
    assert p.transfers() == [("t1", PState.HOLDING)]


def test_lease_timer_rejects_a_waiting_registration() -> None:
    p = make()
    p.receive(0.0, D, register(1, lease=10.0))
    p.handle_timer(10.0)
    assert sent(p.drain()) == [Rejected("t1", 1, RejectReason.LEASE_EXPIRED)]
    assert p.transfers() == [("t1", PState.IDLE)]
    p.kv_ready(11.0, "t1", SRC)
    assert p.drain() == []


def test_write_may_start_exactly_at_the_lease_end() -> None:
    p = make()
    p.receive(0.0, D, register(1, lease=10.0))
    p.kv_ready(10.0, "t1", SRC)
    assert [w.not_after for w in writes(p.drain())] == [10.0]


def test_pending_epoch_whose_lease_ran_out_is_rejected() -> None:
    p = make()
    old = writing(p)
    p.receive(1.0, D, register(2, lease=5.0))
    finish(p, old, 7.0)
    out = p.drain()
    assert writes(out) == []
    assert sent(out) == [Rejected("t1", 2, RejectReason.LEASE_EXPIRED), Settled("t1", 1)]
    assert p.transfers() == [("t1", PState.HOLDING)]
    assert released(out) == []


def test_pending_pull_registration_is_lent_not_written() -> None:
    p = make()
    old = writing(p)
    p.receive(1.0, D, register(2, lease=20.0, mode=Mode.PULL))
    finish(p, old, 2.0)
    out = p.drain()
    assert writes(out) == []
    assert sent(out) == [Settled("t1", 1), Announce("t1", 2, SRC, 19.0)]
    assert p.transfers() == [("t1", PState.LENT)]


def test_source_release_waits_for_every_sibling_write() -> None:
    # vLLM #56104: the first error must not free blocks sibling writes still read.
    p = make(p_tp=4)
    ws = writing(p)
    assert len(ws) == 4
    finish(p, ws[:1], 1.0, fail=True)
    out = p.drain()
    assert sent(out) == [WriteFailed("t1", 1, Source(0), 0, "write failed")]
    assert released(out) == []
    assert p.held_blocks == 3
    finish(p, ws[1:3], 2.0)
    assert p.drain() == []
    finish(p, ws[3:], 3.0)
    out = p.drain()
    assert sent(out) == [Settled("t1", 1)]
    assert released(out) == [ReleaseOutcome.FAILED]
    assert isinstance(out[-1], SourceReleased)
    assert p.held_blocks == 0
    assert p.transfers() == [("t1", PState.RELEASED)]


def test_hold_timeout_then_tombstone_then_forgotten() -> None:
    p = make(kv_hold_timeout=30.0, tombstone_ttl=60.0)
    p.kv_ready(0.0, "t1", SRC)
    assert p.next_deadline() == 30.0
    p.handle_timer(29.9)
    assert p.drain() == []
    p.handle_timer(30.0)
    (rel,) = p.drain()
    assert isinstance(rel, SourceReleased)
    assert (rel.outcome, rel.blocks, rel.timeline.released) == (
        ReleaseOutcome.EXPIRED,
        SRC,
        30.0,
    )
    assert p.held_blocks == 0
    p.receive(31.0, D, register(1))
    assert sent(p.drain()) == [Rejected("t1", 1, RejectReason.RELEASED)]
    assert p.stats()["register_after_release"] == 1
    assert p.next_deadline() == 90.0
    p.handle_timer(89.9)
    assert p.transfers() == [("t1", PState.RELEASED)]
    p.handle_timer(90.0)
    assert p.transfers() == []
    assert p.next_deadline() is None
    assert p.drain() == []


def test_unused_idle_record_expires() -> None:
    p = make(tombstone_ttl=5.0)
    p.receive(0.0, D, register(1, lease=2.0))
    p.handle_timer(2.0)
    p.drain()
    assert p.transfers() == [("t1", PState.IDLE)]
    p.handle_timer(7.0)
    assert p.transfers() == []


def test_consumer_abort_is_acknowledged_after_writes_settle() -> None:
    p = make()
    ws = writing(p)
    p.receive(1.0, D, Abort("t1", 1))
    assert p.drain() == []
    assert p.transfers() == [("t1", PState.DRAINING)]
    p.receive(1.5, D, register(2))
    assert sent(p.drain()) == [Rejected("t1", 2, RejectReason.RELEASED)]
    finish(p, ws, 2.0)
    out = p.drain()
    assert sent(out) == [Settled("t1", 1)]
    assert released(out) == [ReleaseOutcome.ABORTED]


def test_consumer_abort_before_kv_settles_at_once() -> None:
    p = make()
    p.receive(0.0, D, register(1))
    p.receive(1.0, D, Abort("t1", 1))
    assert sent(p.drain()) == [Settled("t1", 1)]
    p.kv_ready(2.0, "t1", SRC)
    assert released(p.drain()) == [ReleaseOutcome.ABORTED]
    assert p.held_blocks == 0


def test_local_abort_tells_consumer_and_waits_for_writes() -> None:
    p = make()
    ws = writing(p)
    assert p.abort(1.0, "t1") is True
    assert sent(p.drain()) == [Abort("t1", 1)]
    assert p.held_blocks == 3
    finish(p, ws, 2.0)
    out = p.drain()
    assert sent(out) == [Settled("t1", 1)]
    assert released(out) == [ReleaseOutcome.ABORTED]


def test_local_abort_of_held_kv_releases_at_once() -> None:
    p = make()
    p.kv_ready(0.0, "t1", SRC)
    assert p.abort(1.0, "t1") is True
    assert released(p.drain()) == [ReleaseOutcome.ABORTED]


def test_kv_ready_after_abort_releases_immediately() -> None:
    p = make()
    assert p.abort(0.0, "t1") is False
    assert p.drain() == []
    p.kv_ready(1.0, "t1", SRC)
    out = p.drain()
    assert released(out) == [ReleaseOutcome.ABORTED]
    assert p.held_blocks == 0
    p.receive(2.0, D, register(1))
    assert sent(p.drain()) == [Rejected("t1", 1, RejectReason.RELEASED)]


@pytest.mark.parametrize("late", ["write_failed", "write_done"])
def test_no_timer_declares_a_write_dead(late: str) -> None:
    """A write that never completes stays in flight until the transport says
    so: however long that takes, no timer fails it, the source stays held and
    nothing is sent; the late report settles it as reported. (Its bound only
    asks the adapter to cancel it, once.)"""
    p = make(p_tp=2)
    ws = writing(p, lease=10.0)
    assert p.next_deadline() == TIMING.op_bound
    finish(p, ws[:1], 2.0)
    p.handle_timer(10.0 + TIMING.op_bound)
    assert p.drain() == [Cancel("t1", 1, D, Source(1), 0)]
    p.handle_timer(1e6)
    assert p.drain() == []
    assert p.transfers() == [("t1", PState.WRITING)]
    assert p.held_blocks == 3
    assert "write_timeout" not in p.stats()
    finish(p, ws[1:], 1e6 + 1, fail=late == "write_failed")
    out = p.drain()
    if late == "write_failed":
        assert sent(out) == [WriteFailed("t1", 1, Source(1), 0, "write failed"), Settled("t1", 1)]
        assert released(out) == [ReleaseOutcome.FAILED]
        assert p.held_blocks == 0
    else:
        assert out == []
        assert p.transfers() == [("t1", PState.DELIVERED)]
        assert p.held_blocks == 3
    assert "write_result_unknown" not in p.stats()


def test_no_timer_declares_a_draining_write_dead() -> None:
    """Aborted (or the consumer lost) with a write in flight: the source is
    held until the transport reports that write, never released by a timer."""
    p = make()
    ws = writing(p, lease=10.0)
    p.peer_lost(1.0, D)
    assert p.transfers() == [("t1", PState.DRAINING)]
    assert p.next_deadline() == TIMING.op_bound  # the write's bound: a cancel, no more
    p.handle_timer(1e6)
    assert p.drain() == [Cancel("t1", 1, D, Source(0), 0)]
    assert p.held_blocks == 3
    finish(p, ws, 1e6 + 1)
    assert released(p.drain()) == [ReleaseOutcome.PEER_LOST]
    assert p.held_blocks == 0


# --- hold until acknowledged ------------------------------------------------------------


def delivered(p: Producer, now: float = 1.0) -> None:
    """Epoch 1 written and every write reported done: DELIVERED."""
    ws = writing(p)
    finish(p, ws, now)
    assert p.drain() == []
    assert p.transfers() == [("t1", PState.DELIVERED)]


def test_delivered_kv_is_held_until_the_consumers_ack() -> None:
    p = make(p_tp=2, kv_hold_timeout=20.0)
    delivered(p, now=1.0)
    assert p.held_blocks == 3
    assert p.next_deadline() == 21.0  # the hold, from the last write's report
    p.receive(2.0, D, ReadDone("t1", 0, True))  # an older epoch's ack ends nothing
    assert p.drain() == []
    assert p.stats()["ack_stale"] == 1
    p.receive(3.0, D, ReadDone("t1", 1, True))
    out = p.drain()
    assert sent(out) == []
    (rel,) = [o for o in out if isinstance(o, SourceReleased)]
    assert (rel.outcome, rel.blocks, rel.timeline.released) == (ReleaseOutcome.DELIVERED, SRC, 3.0)
    assert p.stats()["acked"] == 1
    assert p.held_blocks == 0
    assert p.transfers() == [("t1", PState.RELEASED)]
    p.receive(3.5, D, ReadDone("t1", 1, True))  # a copy of the ack changes nothing
    p.receive(3.5, D, register(1))  # nor does a copy of the delivered registration
    assert p.drain() == []
    assert p.stats()["register_duplicate"] == 1


def test_an_ack_of_a_later_epoch_also_ends_the_hold() -> None:
    p = make()
    delivered(p)
    p.receive(2.0, D, ReadDone("t1", 5, True))
    assert released(p.drain()) == [ReleaseOutcome.DELIVERED]


def test_a_local_abort_of_delivered_kv_releases_without_an_abort() -> None:
    """The writes landed and Ready is on its way: the prefill request ending
    now only gives the source back. An Abort would fail KV the consumer may
    not have polled yet."""
    p = make()
    delivered(p)
    assert p.abort(2.0, "t1")
    out = p.drain()
    assert sent(out) == []
    assert released(out) == [ReleaseOutcome.DELIVERED]
    assert p.held_blocks == 0


def test_delivered_hold_expiry_releases_as_delivered() -> None:
    p = make(kv_hold_timeout=20.0, tombstone_ttl=60.0)
    delivered(p, now=1.0)
    p.peer_lost(5.0, D)  # the ack may never come: the hold still ends
    assert p.drain() == []
    assert p.transfers() == [("t1", PState.DELIVERED)]
    p.handle_timer(20.999)
    assert p.drain() == []
    p.handle_timer(21.0)
    (rel,) = p.drain()
    assert isinstance(rel, SourceReleased)
    assert (rel.outcome, rel.timeline.released) == (ReleaseOutcome.DELIVERED, 21.0)
    assert p.held_blocks == 0
    assert p.next_deadline() == 81.0  # the tombstone


def test_ack_before_the_transports_report_releases_at_the_last_write() -> None:
    """The consumer's completion notices (and so its ReadDone) can overtake
    the producer's own transport's report of the writes: remembered, the ack
    releases the source at once when the last write is reported."""
    p = make(p_tp=2)
    ws = writing(p)
    finish(p, ws[:1], 1.0)
    p.receive(1.5, D, ReadDone("t1", 1, True))
    assert p.drain() == []
    assert p.stats()["acked_early"] == 1
    assert p.transfers() == [("t1", PState.WRITING)]
    assert p.held_blocks == 3  # the other write still reads the source
    finish(p, ws[1:], 2.0)
    out = p.drain()
    assert sent(out) == []
    (rel,) = [o for o in out if isinstance(o, SourceReleased)]
    assert (rel.outcome, rel.timeline.released) == (ReleaseOutcome.DELIVERED, 2.0)
    assert p.transfers() == [("t1", PState.RELEASED)]
    assert p.held_blocks == 0


def test_early_ack_of_an_older_epoch_does_not_release_the_live_one() -> None:
    p = make()
    old = writing(p)
    p.receive(1.0, D, Withdraw("t1", 1))
    p.receive(1.0, D, register(2))
    finish(p, old, 2.0)
    (new,) = writes(p.drain())
    p.receive(2.5, D, ReadDone("t1", 1, True))  # not an ack of epoch 2
    finish(p, [new], 3.0)
    assert p.drain() == []
    assert p.transfers() == [("t1", PState.DELIVERED)]


def test_newer_epoch_registered_while_delivered_is_written() -> None:
    """The consumer preempted the delivered epoch before it saw the notices
    (its Withdraw and the new Register crossed the writes' reports): the KV
    is still held, so the newer epoch is written, not refused."""
    p = make(p_tp=2)
    delivered(p)
    p.receive(2.0, D, Withdraw("t1", 1))
    assert sent(p.drain()) == [Settled("t1", 1)]  # nothing of epoch 1 in flight
    p.receive(2.5, D, register(2, lease=10.0, blocks=((4, 5, 6),)))
    new = writes(p.drain())
    assert [(w.epoch, w.dst_blocks, w.not_after) for w in new] == [(2, ((4, 5, 6),), 12.5)] * 2
    assert p.transfers() == [("t1", PState.WRITING)]
    finish(p, new, 3.0)
    assert p.drain() == []
    assert p.transfers() == [("t1", PState.DELIVERED)]
    p.receive(3.5, D, ReadDone("t1", 1, True))  # the old epoch's ack is stale now
    assert p.drain() == []
    p.receive(4.0, D, ReadDone("t1", 2, True))
    out = p.drain()
    assert released(out) == [ReleaseOutcome.DELIVERED]
    (rel,) = [o for o in out if isinstance(o, SourceReleased)]
    assert rel.timeline.epoch == 2


def test_consumer_abort_while_delivered_releases_at_once() -> None:
    p = make()
    delivered(p)
    p.receive(2.0, D, Abort("t1", 1))
    out = p.drain()
    assert sent(out) == [Settled("t1", 1)]
    assert released(out) == [ReleaseOutcome.ABORTED]
    assert p.held_blocks == 0


def test_peer_lost_while_writing_releases_without_messages() -> None:
    p = make()
    ws = writing(p)
    p.peer_lost(1.0, D)
    assert p.drain() == []
    finish(p, ws, 2.0, fail=True)
    out = p.drain()
    assert sent(out) == []
    assert released(out) == [ReleaseOutcome.PEER_LOST]


def test_register_from_peer_without_handshake_is_rejected() -> None:
    p = Producer(ProducerConfig(Identity(P, 1)))
    p.receive(0.0, D, register(1))
    assert p.drain() == [Send(D, Rejected("t1", 1, RejectReason.UNKNOWN_PEER))]
    # The consumer frees the blocks on that answer: a tombstone of the epoch
    # refuses a copy of the registration once the handshake is redone.
    assert p.transfers() == [("t1", PState.IDLE)]
    p.receive(1.0, D, Identity(D, 1).hello(Role.CONSUMER, C_OP_BOUND))
    p.drain()
    p.receive(1.5, D, register(1))
    assert p.drain() == [Send(D, Rejected("t1", 1, RejectReason.SUPERSEDED))]
    p.receive(1.5, D, register(2))  # a newer epoch is served
    assert p.transfers() == [("t1", PState.WAIT_KV)]


@pytest.mark.parametrize(
    "msg",
    [
        Register("t1", 1, D, ((1,), (2,)), 5.0),
        Register("t1", 1, "someone-else", DST, 5.0),
        Register("t1", 1, D, DST, 0.0),
    ],
)
def test_invalid_registration_is_rejected(msg: Register) -> None:
    p = make()
    p.receive(0.0, D, msg)
    assert p.drain() == [Send(D, Rejected("t1", 1, RejectReason.INVALID))]
    assert p.transfers() == []


def test_registration_from_second_consumer_is_rejected() -> None:
    p = make()
    p.receive(0.0, "d2", Identity("d2", 1).hello(Role.CONSUMER, 1.0, TIMING.max_transit))
    p.drain()
    p.receive(0.0, D, register(1))
    p.receive(0.0, "d2", Register("t1", 2, "d2", DST, 5.0))
    assert p.drain() == [Send("d2", Rejected("t1", 2, RejectReason.PEER_MISMATCH))]
    p.receive(0.0, "d2", Withdraw("t1", 1))
    assert p.drain() == []
    assert p.stats()["message_from_wrong_peer"] == 1


# --- every (state, input) pair --------------------------------------------------------

REMOTE = (
    PInput.REGISTER,
    PInput.WITHDRAW,
    PInput.EXTEND,
    PInput.KEEP,
    PInput.READ_DONE,
    PInput.PEER_ABORT,
    PInput.PEER_ABORT_NEWER,
    PInput.PEER_DOWN,
)
LOCAL = tuple(i for i in PInput if i not in REMOTE)


def _record(state: PState) -> Transfer:
    rec = Transfer("t1", TimelineBuilder("t1"), state=state, peer=D, src=SRC)
    rec.reg = Reg(1, D, DST, 30.0, Mode.PUSH)
    return rec


def test_remote_inputs_missing_from_table_are_counted() -> None:
    missing = [(s, i) for s in PState for i in REMOTE if (s, i) not in PRODUCER]
    assert len(missing) > 5
    p = make()
    for state, inp in missing:
        rec = _record(state)
        p._step(1.0, rec, inp, remote=True)
        assert rec.state is state
        assert p.stats()[f"ignored_{inp.value}_in_{state.value}"] == 1
    assert p.drain() == []


def test_local_inputs_missing_from_table_raise() -> None:
    missing = [(s, i) for s in PState for i in LOCAL if (s, i) not in PRODUCER]
    assert len(missing) > 20
    p = make()
    for state, inp in missing:
        rec = _record(state)
        with pytest.raises(LocalProtocolError, match=f"{inp.name} is not allowed"):
            p._step(1.0, rec, inp)
        assert rec.state is state
    assert p.drain() == []


def _producer_in(state: PState) -> tuple[Producer, list[StartWrite]]:
    """A producer (TP 2) with transfer t1 in ``state``, and the writes it started."""
    p = make(p_tp=2)
    pull = Mode.PULL if state in (PState.LENT, PState.WAIT_REST) else Mode.PUSH
    if state in (PState.STREAMING, PState.WAIT_REST):  # a partial source
        p.receive(0.0, D, register(1, mode=pull))
        p.kv_ready(0.0, "t1", PART, final=False)
        finish(p, writes(p.drain()), 0.5)
    elif state is PState.IDLE:
        p.receive(0.0, D, Withdraw("t1", 1))
    elif state is PState.HOLDING:
        p.kv_ready(0.0, "t1", SRC)
    elif state is PState.RELEASED:
        p.abort(0.0, "t1")
    else:
        p.receive(0.0, D, register(1, mode=pull))
        if state is not PState.WAIT_KV:
            p.kv_ready(0.0, "t1", SRC)
        if state is PState.DRAINING:
            p.abort(0.5, "t1")
    out = p.drain()
    ws = writes(out)
    if state is PState.DELIVERED:
        finish(p, ws, 0.5)
        p.drain()
    assert p.transfers() == [("t1", state)]
    return p, ws


def _inputs() -> list[Any]:
    return [
        register(2),
        register(1),
        register(2, mode=Mode.PULL),
        Withdraw("t1", 1),
        Withdraw("t1", 2),
        Abort("t1", 1),
        Abort("t1", 0),
        ReadDone("t1", 1, True),
        ReadDone("t1", 1, False),
        ReadDone("t1", 9, True),
        ReadDone("t1", 0, True),
        Settled("t1", 1),
        Announce("t1", 1, SRC, 1.0),
        Renew("t1", 0),
        Renew("t1", 1),
        Extend("t1", 1, 0, 60.0),
        Extend("t1", 1, 3, 60.0),
        Heartbeat(1),
        Identity(D, 1, tp=1).hello(Role.CONSUMER, C_OP_BOUND, TIMING.max_transit),
        "peer_lost",
        "kv_ready",
        "abort",
        "write_done",
        "write_failed",
    ]


_STATES = [s for s in PState if s is not PState.GONE]


def _in_flight(p: Producer) -> bool:
    rec = p._tx.get("t1")
    return rec is not None and bool(rec.inflight)


def _run_timers_out(p: Producer, now: float) -> tuple[float, list[StartWrite]]:
    """Fire every timer, in order, until none is armed: the time then, and
    the writes started."""
    started: list[StartWrite] = []
    for _ in range(40):
        deadline = p.next_deadline()
        if deadline is None:
            return now, started
        now = max(now, deadline)
        p.handle_timer(now)
        started += writes(p.drain())
    raise AssertionError("timers keep firing")


@pytest.mark.parametrize("state", _STATES)
@pytest.mark.parametrize("index", range(len(_inputs())))
def test_every_input_in_every_state_is_safe(state: PState, index: int) -> None:
    p, ws = _producer_in(state)
    item = _inputs()[index]
    if item == "peer_lost":
        p.peer_lost(1.0, D)
    elif item == "kv_ready":
        p.kv_ready(1.0, "t1", SRC)
    elif item == "abort":
        p.abort(1.0, "t1")
    elif item == "write_done":
        p.write_done(1.0, "t1", 1, Source(0), 0)
    elif item == "write_failed":
        p.write_failed(1.0, "t1", 1, Source(1), 0)
    else:
        p.receive(1.0, D, item)
    out = p.drain()
    for w in writes(out):
        assert w.not_after >= 1.0
    ws += writes(out)
    # Run every timer out. No timer ends a write in flight: while one is, the
    # source stays held, whatever fired.
    now, started = _run_timers_out(p, 1.0)
    ws += started
    if _in_flight(p):
        assert p.held_blocks == sum(map(len, p._tx["t1"].src or ()))
        assert p.transfers() in ([("t1", PState.WRITING)], [("t1", PState.DRAINING)])
    # A partial source ends by its owner only (its last increment): no timer
    # gives back the blocks of a prefill that still computes.
    if "t1" in p._tx and p._tx["t1"].partial:
        assert p.held_blocks == 2
        p.kv_ready(now, "t1", SRC)
        ws += writes(p.drain())
        now, started = _run_timers_out(p, now)
        ws += started
    # The transport reports every write still in flight (failed; a report of
    # a settled one is harmless), then the timers run out: the record must
    # end, its source blocks must come back.
    for _ in range(5):
        if not _in_flight(p):
            break
        finish(p, ws, now, fail=True)
        ws += writes(p.drain())
        now, started = _run_timers_out(p, now)
        ws += started
    assert not _in_flight(p)
    assert p.next_deadline() is None
    assert p.transfers() == []
    assert p.held_blocks == 0


def test_the_data_planes_stamps_of_each_write_reach_the_timeline() -> None:
    """The core reads no clock: the moments the data plane measured (planned,
    posted, settled) come in with ``write_done`` and end up in the timeline,
    apart from ``write_started`` (when the core asked for the writes)."""
    from kvpush.protocol import OpStamps

    p = make(p_tp=2)
    (w0, w1) = writing(p, now=1.0)
    with pytest.raises(LocalProtocolError, match="out of order"):
        p.write_done(2.0, "t1", 1, w0.route.source, 0, stamps=OpStamps(1.2, 1.1, 1.3, 1.4))
    p.write_done(2.0, "t1", 1, w0.route.source, 0, stamps=OpStamps(1.1, 1.2, 1.3, 1.4))
    p.write_done(2.5, "t1", 1, w1.route.source, 0)  # an adapter that measures nothing
    assert p.drain() == []  # delivered: held until the consumer acknowledges
    p.receive(3.0, D, ReadDone("t1", 1, True))
    (rel,) = [o for o in p.drain() if isinstance(o, SourceReleased)]
    tl = rel.timeline
    assert (tl.kv_ready, tl.write_started, tl.released) == (1.0, 1.0, 3.0)
    assert tl.ops == (((w0.route.source, 0), OpStamps(1.1, 1.2, 1.3, 1.4)),)
    assert dict(tl.write_done) == {(w0.route.source, 0): 2.0, (w1.route.source, 0): 2.5}


# --- ops that never report (issue 28) ------------------------------------------


def cancels(out: list[Any]) -> list[Cancel]:
    return [o for o in out if isinstance(o, Cancel)]


def test_a_write_in_flight_past_op_bound_is_cancelled_and_settles_on_its_report() -> None:
    """Issue 28: a write whose transport never reported kept the source and
    the consumer's blocks for ever. The producer now asks its adapter to
    cancel it op_bound after the StartWrite, once, and settles the epoch as
    for any failed write when the adapter reports the cancel confirmed."""
    p = make(p_tp=2)
    ws = writing(p, now=1.0)
    assert len(ws) == 2
    finish(p, ws[:1], 2.0)  # one lands; the other never reports
    assert sent(p.drain()) == []
    p.handle_timer(1.0 + TIMING.op_bound - 0.001)
    assert p.drain() == []
    p.handle_timer(1.0 + TIMING.op_bound)
    (cancel,) = cancels(p.drain())
    w = ws[1]
    assert cancel == Cancel("t1", 1, D, w.route.source, w.route.consumer_rank)
    assert p.stats()["write_cancel"] == 1
    assert p.next_deadline() is None  # asked once: the adapter owns it now
    p.handle_timer(100.0)
    assert cancels(p.drain()) == []
    assert p.held_blocks == len(SRC[0])  # held until the transport confirms
    finish(p, [w], 101.0, fail=True)  # confirmed: nothing of it moves any more
    out = p.drain()
    assert [type(m) for m in sent(out)] == [WriteFailed, Settled]
    assert released(out) == [ReleaseOutcome.FAILED]
    assert p.held_blocks == 0


def test_a_write_that_finishes_first_is_not_cancelled() -> None:
    p = make()
    (w,) = writing(p, now=1.0)
    finish(p, [w], 1.0 + TIMING.op_bound - 0.5)
    p.drain()
    p.handle_timer(1.0 + TIMING.op_bound)
    assert cancels(p.drain()) == []
    assert "write_cancel" not in p.stats()


def test_a_cancelled_write_that_finished_after_all_counts_as_done() -> None:
    """A cancel races the write: the transport may report it done instead."""
    p = make()
    (w,) = writing(p, now=0.0)
    p.handle_timer(TIMING.op_bound)
    assert len(cancels(p.drain())) == 1
    finish(p, [w], TIMING.op_bound + 1.0)
    assert p.transfers() == [("t1", PState.DELIVERED)]


@pytest.mark.parametrize("proof", ["restart", "peer_gone"])
def test_delivered_kv_of_a_consumer_proven_gone_is_released_at_once(proof: str) -> None:
    """Issue 28: DELIVERED with its consumer lost held the KV for the whole
    kv_hold_timeout, waiting for a re-registration. A lost connection still
    holds it (the decode may come back); proof that its process is gone (a
    new instance of it, or the caller's peer_gone) releases it at once."""
    p = make()
    delivered(p)
    p.peer_lost(2.0, D)
    assert p.drain() == []
    assert p.transfers() == [("t1", PState.DELIVERED)]
    if proof == "restart":
        p.receive(3.0, D, Identity(D, 2).hello(Role.CONSUMER, C_OP_BOUND, TIMING.max_transit))
    else:
        assert p.peer_gone(3.0, D) == 1
    assert released(p.drain()) == [ReleaseOutcome.DELIVERED]
    assert p.held_blocks == 0
    assert p.stats()["delivered_released_peer_gone"] == 1
