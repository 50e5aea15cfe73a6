"""The prefill-side endpoint, driven by hand (the consumer's messages are typed in)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpush.protocol import (
    Abort,
    Announce,
    Completion,
    ControlMessage,
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
from kvpush.protocol._producer import _Reg, _Transfer
from kvpush.protocol._tables import PRODUCER, PInput
from kvpush.protocol._timeline import TimelineBuilder

P, D = "prefill", "decode"
#: The consumer's op bound, learned at handshake.
C_OP_BOUND = 4.0
TIMING = Timing(max_transit=1.5, op_bound=6.0)
SRC = ((1, 2, 3),)
DST = ((7, 8, 9),)


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
    assert p.next_deadline() == 13.0  # the lease timer
    p.kv_ready(5.0, "t1", SRC)
    (w,) = writes(p.drain())
    assert w.not_after == 13.0
    assert p.next_deadline() == 13.0 + TIMING.op_bound  # the op bound of the writes
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
    assert released(out) == [ReleaseOutcome.DELIVERED]
    assert sent(out) == []
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


def test_write_that_never_completes_fails_after_its_bound() -> None:
    p = make(p_tp=2)
    ws = writing(p, lease=10.0)
    deadline = 10.0 + TIMING.op_bound
    assert p.next_deadline() == deadline
    finish(p, ws[:1], 2.0)
    p.handle_timer(deadline - 0.01)
    assert p.drain() == []
    p.handle_timer(deadline)
    out = p.drain()
    assert sent(out) == [WriteFailed("t1", 1, Source(1), 0, "timeout"), Settled("t1", 1)]
    assert released(out) == [ReleaseOutcome.FAILED]
    assert p.stats()["write_timeout"] == 1
    finish(p, ws[1:], deadline + 1)  # the transport's late report is harmless
    assert p.drain() == []
    assert p.stats()["write_result_unknown"] == 1


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
    PInput.READ_DONE,
    PInput.PEER_ABORT,
    PInput.PEER_ABORT_NEWER,
    PInput.PEER_DOWN,
)
LOCAL = tuple(i for i in PInput if i not in REMOTE)


def _record(state: PState) -> _Transfer:
    rec = _Transfer("t1", TimelineBuilder("t1"), state=state, peer=D, src=SRC)
    rec.reg = _Reg(1, D, DST, 30.0, Mode.PUSH)
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


def _producer_in(state: PState) -> Producer:
    p = make(p_tp=2)
    pull = Mode.PULL if state is PState.LENT else Mode.PUSH
    if state is PState.IDLE:
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
    p.drain()
    assert p.transfers() == [("t1", state)]
    return p


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
        Settled("t1", 1),
        Announce("t1", 1, SRC, 1.0),
        Heartbeat(1),
        Identity(D, 1, tp=1).hello(Role.CONSUMER, C_OP_BOUND, TIMING.max_transit),
        "peer_lost",
        "kv_ready",
        "abort",
        "write_done",
    ]


_STATES = [s for s in PState if s is not PState.GONE]


@pytest.mark.parametrize("state", _STATES)
@pytest.mark.parametrize("index", range(18))
def test_every_input_in_every_state_is_safe(state: PState, index: int) -> None:
    p = _producer_in(state)
    item = _inputs()[index]
    if item == "peer_lost":
        p.peer_lost(1.0, D)
    elif item == "kv_ready":
        p.kv_ready(1.0, "t1", SRC)
    elif item == "abort":
        p.abort(1.0, "t1")
    elif item == "write_done":
        p.write_done(1.0, "t1", 1, Source(0), 0)
    else:
        p.receive(1.0, D, item)
    out = p.drain()
    for w in writes(out):
        assert w.not_after >= 1.0
    # run every timer out: the record must end, its source blocks must come back
    for _ in range(10):
        deadline = p.next_deadline()
        if deadline is None:
            break
        p.handle_timer(deadline)
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
    (rel,) = [o for o in p.drain() if isinstance(o, SourceReleased)]
    tl = rel.timeline
    assert (tl.kv_ready, tl.write_started) == (1.0, 1.0)
    assert tl.ops == (((w0.route.source, 0), OpStamps(1.1, 1.2, 1.3, 1.4)),)
    assert dict(tl.write_done) == {(w0.route.source, 0): 2.0, (w1.route.source, 0): 2.5}
