"""The decode-side endpoint, driven by hand (the producer's messages are typed in)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from kvpush.protocol import (
    Abort,
    Announce,
    Completion,
    ConfigError,
    Consumer,
    ConsumerConfig,
    ControlMessage,
    CState,
    Extend,
    Failed,
    FailureReason,
    Heartbeat,
    Hello,
    Identity,
    LocalProtocolError,
    Mode,
    OpStamps,
    PeerReady,
    ReadDone,
    Ready,
    Refused,
    RefuseReason,
    Register,
    Rejected,
    RejectReason,
    Released,
    Renew,
    Reserved,
    Role,
    Send,
    Settled,
    Source,
    StartRead,
    Timeline,
    Timing,
    Withdraw,
    WriteFailed,
)
from kvpush.protocol._consumer import _Reservation
from kvpush.protocol._tables import CONSUMER_PULL, CONSUMER_PUSH, CInput
from kvpush.protocol._timeline import TimelineBuilder

P, D = "prefill", "decode"
#: The producer's op bound, learned at handshake (part of the quarantine).
P_OP_BOUND = 7.0
TIMING = Timing(max_transit=1.5, op_bound=3.0)


def make(*, p_tp: int = 1, c_tp: int = 1, pp: int = 1, now: float = 0.0, **cfg: Any) -> Consumer:
    """A consumer whose handshake with producer ``P`` is done."""
    c = Consumer(ConsumerConfig(Identity(D, 1, tp=c_tp), timing=TIMING, **cfg))
    c.connect(now, P)
    c.receive(
        now, P, Identity(P, 1, tp=p_tp, pp=pp).hello(Role.PRODUCER, P_OP_BOUND, TIMING.max_transit)
    )
    assert [type(o) for o in c.drain()] == [Send, PeerReady]
    return c


def reserve(
    c: Consumer, tid: str = "t1", blocks: Any = ((1, 2),), now: float = 0.0, **kw: Any
) -> int:
    reply = c.reserve(now, tid, P, blocks, **kw)
    assert isinstance(reply, Reserved), reply
    return reply.epoch


def notice(epoch: int, tp: int = 0, rank: int = 0, pp: int = 0, tid: str = "t1") -> Completion:
    return Completion(tid, epoch, Source(tp, pp), rank)


def kinds(outputs: list[Any]) -> list[type]:
    return [type(o) for o in outputs]


def test_registration_carries_the_lease() -> None:
    c = make()
    e = reserve(c, now=2.0)
    assert c.drain() == [Send(P, Register("t1", e, D, ((1, 2),), 30.0, Mode.PUSH))]
    e2 = reserve(c, "t2", ((3,),), now=2.0, deadline=12.0)
    assert c.drain() == [Send(P, Register("t2", e2, D, ((3,),), 10.0, Mode.PUSH))]
    assert e2 > e
    assert c.reserved_blocks == 3


def test_ready_exactly_once_after_exact_set() -> None:
    c = make(p_tp=2)  # TP 2 -> 1: one consumer rank waits for both producer ranks
    e = reserve(c)
    c.drain()
    c.completion_received(1.0, P, notice(e, tp=0))
    assert c.drain() == []
    assert c.reservations() == [("t1", e, CState.AWAITING)]
    c.completion_received(1.5, P, notice(e, tp=0))
    assert c.drain() == []
    c.completion_received(2.0, P, notice(e, tp=1))
    ack, ready = c.drain()
    assert ack == Send(P, ReadDone("t1", e, True))  # ends the producer's hold of the KV
    assert isinstance(ready, Ready)
    assert (ready.transfer_id, ready.epoch, ready.blocks) == ("t1", e, ((1, 2),))
    c.completion_received(2.5, P, notice(e, tp=1))
    c.completion_received(2.5, P, notice(e, tp=0))
    assert c.drain() == []
    assert c.reservations() == []
    assert c.reserved_blocks == 0
    assert c.stats()["completion_duplicate"] == 1
    assert c.stats()["completion_unknown"] == 2


@pytest.mark.parametrize(
    ("p_tp", "c_tp", "pp", "pairs"),
    [
        (1, 2, 1, [(0, 0, 0), (0, 1, 0)]),
        (1, 1, 2, [(0, 0, 0), (0, 0, 1)]),
        (4, 2, 1, [(0, 0, 0), (1, 0, 0), (2, 1, 0), (3, 1, 0)]),
    ],
)
def test_ready_needs_every_expected_pair(
    p_tp: int, c_tp: int, pp: int, pairs: list[tuple[int, int, int]]
) -> None:
    c = make(p_tp=p_tp, c_tp=c_tp, pp=pp)
    e = reserve(c)
    c.drain()
    for tp, rank, stage in pairs[:-1]:
        c.completion_received(1.0, P, notice(e, tp=tp, rank=rank, pp=stage))
        assert c.drain() == []
    tp, rank, stage = pairs[-1]
    c.completion_received(1.0, P, notice(e, tp=tp, rank=rank, pp=stage))
    out = c.drain()
    assert kinds(out) == [Send, Ready]
    assert out[0] == Send(P, ReadDone("t1", e, True))


@pytest.mark.parametrize(
    ("case", "counter"),
    [
        ("unexpected rank", "completion_unexpected_source"),
        ("unexpected source", "completion_unexpected_source"),
        ("unexpected stage", "completion_unexpected_source"),
        ("old epoch", "completion_unknown"),
        ("future epoch", "completion_unknown"),
        ("unknown transfer", "completion_unknown"),
        ("duplicate", "completion_duplicate"),
    ],
)
def test_unexpected_completion_ignored_and_counted(case: str, counter: str) -> None:
    c = make(p_tp=2)
    old = reserve(c)
    c.preempt(0.0, "t1")
    c.receive(0.0, P, Settled("t1", old))
    e = reserve(c, now=0.5)
    c.drain()
    c.completion_received(1.0, P, notice(e, tp=0))
    before = c.reservations()
    stats = dict(c.stats())
    bad = {
        "unexpected rank": notice(e, tp=1, rank=1),
        "unexpected source": notice(e, tp=2),
        "unexpected stage": notice(e, tp=1, pp=1),
        "old epoch": notice(old, tp=1),
        "future epoch": notice(e + 1, tp=1),
        "unknown transfer": notice(e, tp=1, tid="t9"),
        "duplicate": notice(e, tp=0),
    }[case]
    c.completion_received(2.0, P, bad)
    assert c.drain() == []
    assert c.reservations() == before == [("t1", e, CState.AWAITING)]
    assert c.stats()[counter] == stats.get(counter, 0) + 1
    # the legitimate last completion still makes it ready
    c.completion_received(3.0, P, notice(e, tp=1))
    out = c.drain()
    assert kinds(out) == [Send, Ready]
    assert out[0] == Send(P, ReadDone("t1", e, True))


def test_deadline_fails_then_releases_after_quarantine() -> None:
    """With the producer lost meanwhile (see the SUSPECT tests for a producer
    still connected at the quarantine)."""
    c = make(ready_timeout=30.0)
    e = reserve(c)
    c.drain()
    assert c.next_deadline() == 30.0
    c.handle_timer(29.999)
    assert c.drain() == []
    c.handle_timer(30.0)
    assert c.drain() == [
        Failed("t1", e, FailureReason.TIMEOUT, ""),
        Send(P, Abort("t1", e)),
    ]
    assert c.reservations() == [("t1", e, CState.DRAINING)]
    assert c.reserved_blocks == 2
    c.peer_lost(31.0, P)
    assert c.drain() == []  # failed already; the quarantine still runs
    assert c.reservations() == [("t1", e, CState.DRAINING)]
    # deadline + our max transit + the producer's op bound
    quarantine = 30.0 + TIMING.max_transit + P_OP_BOUND
    assert c.next_deadline() == quarantine
    c.handle_timer(quarantine - 0.001)
    assert c.drain() == []
    c.handle_timer(quarantine)
    (released,) = c.drain()
    assert isinstance(released, Released)
    assert (released.transfer_id, released.epoch, released.blocks) == ("t1", e, ((1, 2),))
    assert released.timeline.failed == 30.0
    assert released.timeline.released == quarantine
    assert released.timeline.suspect is None
    assert c.reservations() == []
    assert c.reserved_blocks == 0
    assert c.next_deadline() is None


def test_quarantine_counts_from_the_deadline_not_the_registration() -> None:
    c = Consumer(ConsumerConfig(Identity(D, 1), timing=TIMING))
    e = reserve(c, deadline=20.0)  # before the handshake
    c.drain()
    c.receive(5.0, P, Identity(P, 1).hello(Role.PRODUCER, P_OP_BOUND, TIMING.max_transit))
    register = [o.message for o in c.drain() if isinstance(o, Send)]
    assert register == [Register("t1", e, D, ((1, 2),), 15.0, Mode.PUSH)]
    c.handle_timer(20.0)
    c.drain()
    assert c.next_deadline() == 20.0 + TIMING.max_transit + P_OP_BOUND


def test_deadline_then_settled_releases_early() -> None:
    c = make()
    e = reserve(c)
    c.handle_timer(30.0)
    c.drain()
    c.receive(31.0, P, Settled("t1", e))
    assert kinds(c.drain()) == [Released]
    assert c.reserved_blocks == 0
    c.handle_timer(100.0)
    assert c.drain() == []


def test_draining_releases_once_every_pair_settled() -> None:
    c = make(p_tp=2)
    e = reserve(c)
    c.handle_timer(30.0)
    c.drain()
    c.completion_received(31.0, P, notice(e, tp=0))
    assert c.drain() == []
    c.completion_received(31.5, P, notice(e, tp=1))
    assert kinds(c.drain()) == [Released]  # never Ready once failed


def test_preempt_withdraws_and_old_epoch_never_readies_new_one() -> None:
    c = make(p_tp=2)
    e1 = reserve(c)
    c.drain()
    c.completion_received(0.5, P, notice(e1, tp=0))
    assert c.preempt(1.0, "t1") is True
    assert c.drain() == [Send(P, Withdraw("t1", e1))]
    assert c.reservations() == [("t1", e1, CState.DRAINING)]
    assert c.preempt(1.0, "t1") is False
    assert c.stats()["preempt_without_reservation"] == 1
    e2 = reserve(c, blocks=((3, 4),), now=2.0)
    assert e2 > e1
    assert c.drain() == [Send(P, Register("t1", e2, D, ((3, 4),), 30.0, Mode.PUSH))]
    assert c.reserved_blocks == 4  # the draining epoch still holds its blocks
    # the old epoch's other completion settles the old epoch only
    c.completion_received(3.0, P, notice(e1, tp=1))
    out = c.drain()
    assert not any(isinstance(o, (Ready, Failed)) for o in out)
    assert [(o.epoch, o.blocks) for o in out if isinstance(o, Released)] == [(e1, ((1, 2),))]
    assert c.reservations() == [("t1", e2, CState.AWAITING)]
    c.completion_received(4.0, P, notice(e2, tp=0))
    assert c.drain() == []
    c.completion_received(4.0, P, notice(e2, tp=1))
    ack, ready = c.drain()
    assert ack == Send(P, ReadDone("t1", e2, True))
    assert isinstance(ready, Ready)
    assert (ready.epoch, ready.blocks) == (e2, ((3, 4),))


def test_preempted_epoch_released_on_settled_without_failure() -> None:
    c = make()
    e = reserve(c)
    c.preempt(1.0, "t1")
    c.drain()
    c.receive(2.0, P, Settled("t1", e))
    assert kinds(c.drain()) == [Released]


def test_preempt_before_handshake_releases_at_once() -> None:
    c = Consumer(ConsumerConfig(Identity(D, 1)))
    reserve(c)
    c.drain()
    assert c.preempt(1.0, "t1") is True
    assert kinds(c.drain()) == [Released]  # nothing was registered: no Withdraw
    assert c.reserved_blocks == 0


def test_budget_refusal_is_a_value_and_budget_frees_on_release() -> None:
    c = make(max_reserved_blocks=4)
    e = reserve(c, blocks=((1, 2, 3),))
    c.drain()
    reply = c.reserve(0.0, "t2", P, ((4, 5),))
    assert reply == Refused("t2", RefuseReason.BUDGET)
    assert c.drain() == []
    assert c.stats()["refused_budget"] == 1
    assert c.reservations() == [("t1", e, CState.AWAITING)]
    assert c.reserved_blocks == 3
    reserve(c, "t3", ((6,),))  # what still fits is accepted
    c.preempt(0.5, "t3")
    c.drain()
    assert c.reserve(0.5, "t2", P, ((4, 5),)) == Refused("t2", RefuseReason.BUDGET)
    c.receive(1.0, P, Rejected("t1", e, RejectReason.RELEASED))
    c.drain()
    assert c.reserved_blocks == 1  # the draining t3 still counts
    reserve(c, "t2", ((4, 5),), now=1.0)


def test_abort_of_unknown_transfer_is_harmless() -> None:
    c = make()
    assert c.abort(0.0, "nope") is False
    assert c.drain() == []
    assert c.stats()["abort_without_reservation"] == 1
    assert c.reservations() == []


def test_abort_withdraws_and_waits_for_settled() -> None:
    c = make()
    e = reserve(c)
    c.drain()
    assert c.abort(1.0, "t1") is True
    assert c.drain() == [Send(P, Abort("t1", e))]
    assert c.reservations() == [("t1", e, CState.DRAINING)]
    assert c.abort(1.0, "t1") is False
    c.receive(2.0, P, Settled("t1", e))
    assert kinds(c.drain()) == [Released]


def test_write_failed_fails_at_once() -> None:
    # vLLM C2 (#50754): a write that fails to post must not leave D waiting for a
    # notice that never comes until some lease expires.
    c = make(p_tp=2)
    e = reserve(c)
    c.drain()
    c.receive(1.0, P, WriteFailed("t1", e, Source(0), 0, "post failed"))
    assert c.drain() == [Failed("t1", e, FailureReason.TRANSFER_FAILED, "post failed")]
    assert c.reservations() == [("t1", e, CState.DRAINING)]
    assert c.reserved_blocks == 2  # the sibling write may still land
    c.receive(1.0, P, WriteFailed("t1", e, Source(0), 0, "post failed"))
    assert c.drain() == []
    assert c.stats()["write_failed_duplicate"] == 1
    c.completion_received(2.0, P, notice(e, tp=1))
    (released,) = c.drain()
    assert isinstance(released, Released)
    assert released.timeline.failed == 1.0
    assert c.reserved_blocks == 0


def test_write_failed_for_every_pair_releases() -> None:
    c = make()
    e = reserve(c)
    c.drain()
    c.receive(1.0, P, WriteFailed("t1", e, Source(0), 0, "boom"))
    assert kinds(c.drain()) == [Failed, Released]


def test_rejected_releases_at_once() -> None:
    c = make()
    e = reserve(c)
    c.drain()
    c.receive(1.0, P, Rejected("t1", e, RejectReason.LEASE_EXPIRED))
    failed, released = c.drain()
    assert failed == Failed("t1", e, FailureReason.REJECTED, "lease_expired")
    assert isinstance(released, Released)
    assert c.reserved_blocks == 0
    assert c.reservations() == []


def test_peer_abort_drains_until_settled() -> None:
    c = make()
    e = reserve(c)
    c.drain()
    c.receive(1.0, P, Abort("t1", e))
    assert c.drain() == [Failed("t1", e, FailureReason.PEER_ABORTED, "")]
    c.receive(2.0, P, Settled("t1", e))
    assert kinds(c.drain()) == [Released]


def test_peer_lost_drains_until_quarantine() -> None:
    c = make()
    e = reserve(c)
    c.drain()
    c.peer_lost(1.0, P)
    assert c.drain() == [Failed("t1", e, FailureReason.PEER_LOST, "connection lost")]
    c.handle_timer(30.0 + TIMING.max_transit + P_OP_BOUND)
    assert kinds(c.drain()) == [Released]


def test_messages_from_another_peer_are_ignored() -> None:
    c = make()
    e = reserve(c)
    c.drain()
    c.connect(0.0, "other")
    c.receive(
        0.0, "other", Identity("other", 1).hello(Role.PRODUCER, P_OP_BOUND, TIMING.max_transit)
    )
    c.drain()
    for msg in (Settled("t1", e), Rejected("t1", e, RejectReason.RELEASED), Abort("t1", e)):
        c.receive(1.0, "other", msg)
    assert c.drain() == []
    assert c.reservations() == [("t1", e, CState.AWAITING)]
    assert c.stats()["stale_Settled"] == 1
    assert c.stats()["abort_stale"] == 1


def test_timeline_fields_come_from_the_given_times() -> None:
    c = make(p_tp=2)
    e = reserve(c, now=1.0)
    live = c.timeline("t1")
    assert live == Timeline("t1", e, reserved=1.0, registration_sent=1.0)
    c.completion_received(2.0, P, notice(e, tp=0, tid="t1"))
    c.completion_received(3.5, P, notice(e, tp=1, tid="t1"))
    ready = next(o for o in c.drain() if isinstance(o, Ready))
    assert ready.timeline == Timeline(
        "t1",
        e,
        reserved=1.0,
        registration_sent=1.0,
        write_done=(((Source(0), 0), 2.0), ((Source(1), 0), 3.5)),
        ready=3.5,
    )
    assert c.timeline("t1") is None


def test_reserve_misuse_raises_local_errors() -> None:
    c = make()
    reserve(c)
    with pytest.raises(LocalProtocolError, match="live reservation"):
        c.reserve(0.0, "t1", P, ((9,),))
    with pytest.raises(LocalProtocolError, match="deadline"):
        c.reserve(5.0, "t2", P, ((9,),), deadline=5.0)
    with pytest.raises(LocalProtocolError):
        c.reserve(0.0, "", P, ((9,),))
    with pytest.raises(LocalProtocolError):
        c.reserve(0.0, "t3", P, ((9, 9),))
    with pytest.raises(LocalProtocolError):
        c.reserve(0.0, "t3", P, ((9,), (10,)))


def test_mode_unsupported_is_refused() -> None:
    c = Consumer(ConsumerConfig(Identity(D, 1)))
    c.connect(0.0, P)
    c.receive(0.0, P, Identity(P, 1, modes=(Mode.PUSH,)).hello(Role.PRODUCER, 1.0))
    c.drain()
    reply = c.reserve(0.0, "t1", P, ((1,),), mode=Mode.PULL)
    assert reply == Refused("t1", RefuseReason.MODE_UNSUPPORTED)


# --- SUSPECT: the quarantine passed with the producer connected ---------------------

#: When a reservation failed at its deadline (30.0) can no longer be written to,
#: by the timing bounds alone.
QUARANTINE = 30.0 + TIMING.max_transit + P_OP_BOUND


def suspect(c: Consumer, tid: str = "t1") -> int:
    """Reserve ``tid`` at 0.0, let its deadline fail it and its quarantine pass
    with the producer connected: the reservation is SUSPECT."""
    e = reserve(c, tid)
    c.handle_timer(30.0)
    c.drain()
    c.handle_timer(QUARANTINE)
    assert c.drain() == [Send(P, Withdraw(tid, e))]  # the first probe
    assert (tid, e, CState.SUSPECT) in c.reservations()
    return e


def test_quarantine_with_the_producer_connected_holds_the_blocks_as_suspect() -> None:
    c = make()
    e = reserve(c)
    c.handle_timer(30.0)
    c.drain()
    c.handle_timer(QUARANTINE - 0.001)
    assert c.drain() == []
    c.handle_timer(QUARANTINE)
    # No Released: the producer is connected and has not settled the epoch, so
    # one of its writes may still land (it may be stopped, not dead).
    assert c.drain() == [Send(P, Withdraw("t1", e))]
    assert c.reservations() == [("t1", e, CState.SUSPECT)]
    assert c.reserved_blocks == 2
    assert c.suspect_blocks == c.suspect_blocks_of(P) == 2
    assert c.suspect_blocks_of("another-prefill") == 0
    assert c.stats()["suspect"] == 1
    for _ in range(20):  # the probes; no timer ends it
        when = c.next_deadline()
        assert when is not None
        c.handle_timer(when)
    assert [type(o.message) for o in c.drain() if isinstance(o, Send)] == [Hello, Withdraw] * 20
    assert c.reservations() == [("t1", e, CState.SUSPECT)]
    assert c.reserved_blocks == 2


@pytest.mark.parametrize("how", ["lost", "restarted"])
def test_quarantine_with_the_producer_gone_releases(how: str) -> None:
    """Lost, or back as another instance (which speaks for none of the old
    one's writes): the quarantine releases, as it always did."""
    c = make()
    e = reserve(c)
    c.handle_timer(30.0)
    c.drain()
    if how == "lost":
        c.peer_lost(31.0, P)
    else:
        c.receive(31.0, P, Identity(P, 2).hello(Role.PRODUCER, P_OP_BOUND, TIMING.max_transit))
        assert PeerReady in kinds(c.drain())
    c.drain()
    c.handle_timer(QUARANTINE)
    (released,) = c.drain()
    assert isinstance(released, Released)
    assert (released.epoch, released.timeline.released) == (e, QUARANTINE)
    assert released.timeline.suspect is None
    assert c.suspect_blocks == c.reserved_blocks == 0
    assert "suspect" not in c.stats()


@pytest.mark.parametrize(
    "proof",
    [
        "settled",
        "rejected",
        "every pair completed",
        "every pair settled",
    ],
)
def test_suspect_is_released_by_a_proof_from_the_producer(proof: str) -> None:
    c = make(p_tp=2)
    e = suspect(c)
    # another epoch's answer proves nothing about this one
    c.receive(40.0, P, Settled("t1", e + 1))
    assert c.drain() == []
    if proof == "settled":
        c.receive(40.0, P, Settled("t1", e))
    elif proof == "rejected":
        c.receive(40.0, P, Rejected("t1", e, RejectReason.RELEASED))
    else:
        c.completion_received(40.0, P, notice(e, tp=0))
        assert c.drain() == []  # the other pair may still land
        assert c.reservations() == [("t1", e, CState.SUSPECT)]
        if proof == "every pair completed":
            c.completion_received(40.0, P, notice(e, tp=1))
        else:
            c.receive(40.0, P, WriteFailed("t1", e, Source(1), 0, "late"))
    (released,) = c.drain()  # no second Failed, no message to the producer
    assert isinstance(released, Released)
    assert (released.epoch, released.blocks) == (e, ((1, 2),))
    assert (released.timeline.suspect, released.timeline.released) == (QUARANTINE, 40.0)
    assert c.reservations() == []
    assert c.suspect_blocks == c.suspect_blocks_of(P) == 0
    assert c.reserved_blocks == 0
    assert c.next_deadline() is None


def test_suspect_probes_with_backoff_until_answered() -> None:
    """Every probe may be lost, and so may its answer: the probes go on, after
    2, 4, then every 8 ``max_transit``, until one is answered."""
    c = make()
    e = suspect(c)  # the first probe, at the quarantine
    at = QUARANTINE
    for gap in (2, 4, 8, 8, 8):
        nxt = at + gap * TIMING.max_transit
        assert c.next_deadline() == nxt
        c.handle_timer(nxt - 0.001)
        assert c.drain() == []
        c.handle_timer(nxt)
        hello, probe = c.drain()  # our hello first: the producer may have lost it
        assert isinstance(hello, Send) and isinstance(hello.message, Hello)
        assert probe == Send(P, Withdraw("t1", e))
        at = nxt
    assert c.stats()["suspect_probe"] == 6
    assert c.reservations() == [("t1", e, CState.SUSPECT)]
    # the answer to any of them, however late, ends it
    c.receive(at + 1e6, P, Settled("t1", e))
    assert kinds(c.drain()) == [Released]
    assert c.next_deadline() is None


def test_a_lost_connection_is_no_proof_for_suspect_blocks() -> None:
    """Silent past its quarantine while connected, then the connection goes:
    the process may be stopped, not dead, and its queued write lands when it
    runs again. The blocks stay suspect; the same instance back is probed at
    once, and its answer releases them."""
    c = make()
    e = suspect(c)
    c.peer_lost(50.0, P)
    assert c.drain() == []
    assert c.reservations() == [("t1", e, CState.SUSPECT)]
    assert c.suspect_blocks == 2
    assert c.stats()["suspect_peer_lost"] == 1
    c.connect(60.0, P)
    c.drain()
    c.receive(60.0, P, Identity(P, 1).hello(Role.PRODUCER, P_OP_BOUND, TIMING.max_transit))
    out = c.drain()
    assert Send(P, Withdraw("t1", e)) in out  # probed again at once
    assert c.next_deadline() == 60.0 + 2 * TIMING.max_transit
    c.receive(61.0, P, Settled("t1", e))
    assert kinds(c.drain()) == [Released]
    assert c.suspect_blocks == c.reserved_blocks == 0


@pytest.mark.parametrize("proof", ["restarted", "gone"])
def test_suspect_blocks_drain_for_a_fresh_quarantine_once_the_producer_is_gone(
    proof: str,
) -> None:
    """Proof the process is gone: another instance of it completed a
    handshake, or the caller said so (``peer_gone``). A write it had queued
    may still be placed meanwhile: released after a fresh quarantine."""
    c = make()
    e = suspect(c)
    if proof == "restarted":
        c.peer_lost(49.0, P)
        c.connect(50.0, P)
        c.drain()
        c.receive(50.0, P, Identity(P, 2).hello(Role.PRODUCER, P_OP_BOUND, TIMING.max_transit))
    else:
        assert c.peer_gone(50.0, P) == 1
    c.drain()
    assert c.reservations() == [("t1", e, CState.DRAINING)]
    assert c.suspect_blocks == 0  # no longer suspect, but still held
    assert c.reserved_blocks == 2
    fresh = 50.0 + TIMING.max_transit + P_OP_BOUND
    assert c.next_deadline() == fresh
    c.handle_timer(fresh - 0.001)
    assert c.drain() == []
    c.handle_timer(fresh)
    (released,) = c.drain()
    assert isinstance(released, Released)
    assert (released.timeline.suspect, released.timeline.released) == (QUARANTINE, fresh)
    assert c.reserved_blocks == 0


def test_reserve_is_refused_while_the_producer_has_suspect_blocks() -> None:
    c = make(max_suspect_blocks=0)
    c.connect(0.0, "prefill-q")
    c.receive(
        0.0, "prefill-q", Identity("prefill-q", 1).hello(Role.PRODUCER, 1.0, TIMING.max_transit)
    )
    c.drain()
    e = suspect(c)
    assert c.reserve(40.0, "t2", P, ((5,),)) == Refused("t2", RefuseReason.PEER_SUSPECT)
    assert c.drain() == []
    assert c.stats()["refused_suspect"] == 1
    # another producer is not suspect
    assert isinstance(c.reserve(40.0, "t3", "prefill-q", ((6,),)), Reserved)
    c.drain()
    c.receive(41.0, P, Settled("t1", e))
    assert kinds(c.drain()) == [Released]
    assert isinstance(c.reserve(42.0, "t2", P, ((5,),)), Reserved)
    assert c.stats()["refused_suspect"] == 1


def test_max_suspect_blocks_is_a_cap() -> None:
    c = make(max_suspect_blocks=2)
    e1 = reserve(c, "t1")
    reserve(c, "t2", ((3, 4),))
    c.handle_timer(30.0)
    c.handle_timer(QUARANTINE)
    c.drain()
    assert c.suspect_blocks_of(P) == 4
    assert c.reserve(40.0, "t3", P, ((5,),)) == Refused("t3", RefuseReason.PEER_SUSPECT)
    c.receive(41.0, P, Settled("t1", e1))
    c.drain()
    assert c.suspect_blocks_of(P) == 2  # at the cap, not over it
    assert isinstance(c.reserve(42.0, "t3", P, ((5,),)), Reserved)


def test_suspect_blocks_are_capped_by_default_at_a_quarter_of_the_budget() -> None:
    """Issue 28: the default cap was 0, so one suspect transfer (an op that
    never reported) turned every later reservation from that producer away.
    Now the default lets a decode go on serving: a quarter of its budget, and
    no cap without one."""
    assert ConsumerConfig(Identity(D, 1)).suspect_cap == math.inf
    assert ConsumerConfig(Identity(D, 1), max_reserved_blocks=9).suspect_cap == 2
    c = make(max_reserved_blocks=16)  # cap 4
    reserve(c, "t1")
    c.handle_timer(30.0)
    c.handle_timer(QUARANTINE)
    c.drain()
    assert c.suspect_blocks_of(P) == 2
    assert isinstance(c.reserve(40.0, "t2", P, ((5, 6, 7),)), Reserved)  # other work goes on
    c = make()  # no budget: no cap
    reserve(c, "t1")
    c.handle_timer(30.0)
    c.handle_timer(QUARANTINE)
    c.drain()
    assert c.suspect_blocks_of(P) == 2
    assert isinstance(c.reserve(40.0, "t2", P, ((5,),)), Reserved)


def test_max_suspect_blocks_is_validated() -> None:
    bad_values: tuple[Any, ...] = (-1, 1.0, True)
    for bad in bad_values:
        with pytest.raises(ConfigError, match="max_suspect_blocks"):
            ConsumerConfig(Identity(D, 1), max_suspect_blocks=bad)


def test_messages_from_another_instance_of_the_producer_are_ignored() -> None:
    """The producer restarted: the new instance speaks for none of the old
    one's writes, so its Settled cannot end the old drain (nor its Rejected,
    Abort or WriteFailed); a reservation registered with the new instance
    takes its messages."""
    c = make()
    e = reserve(c)
    c.preempt(1.0, "t1")
    c.drain()
    c.receive(3.0, P, Identity(P, 2).hello(Role.PRODUCER, P_OP_BOUND, TIMING.max_transit))
    c.drain()
    for msg in (
        Settled("t1", e),
        Rejected("t1", e, RejectReason.RELEASED),
        WriteFailed("t1", e, Source(0), 0, "x"),
    ):
        c.receive(4.0, P, msg)
    assert c.drain() == []
    assert c.stats()["message_from_other_instance"] == 3
    assert c.reservations() == [("t1", e, CState.DRAINING)]
    assert c.reserved_blocks == 2
    e2 = reserve(c, "t2", ((3,),), now=5.0)  # registered with instance 2
    c.drain()
    c.receive(6.0, P, Rejected("t2", e2, RejectReason.RELEASED))
    assert kinds(c.drain()) == [Failed, Released]
    assert c.stats()["message_from_other_instance"] == 3
    # the old drain ends at its quarantine (the old instance is gone), never suspect
    c.handle_timer(QUARANTINE)
    (released,) = c.drain()
    assert isinstance(released, Released)
    assert released.epoch == e
    assert c.suspect_blocks == 0


def test_messages_from_the_same_instance_after_a_reconnect_count() -> None:
    c = make()
    e = reserve(c)
    c.preempt(1.0, "t1")
    c.drain()
    c.peer_lost(2.0, P)
    c.connect(3.0, P)
    c.receive(3.0, P, Identity(P, 1).hello(Role.PRODUCER, P_OP_BOUND, TIMING.max_transit))
    c.drain()
    c.receive(4.0, P, Settled("t1", e))
    assert kinds(c.drain()) == [Released]
    assert "message_from_other_instance" not in c.stats()


# --- every (state, input) pair --------------------------------------------------------

#: Inputs caused by the producer or the transport: never an exception.
REMOTE = (
    CInput.COMPLETION,
    CInput.COMPLETION_LAST,
    CInput.WRITE_FAILED,
    CInput.PAIRS_SETTLED,
    CInput.SETTLED,
    CInput.REJECTED,
    CInput.PEER_ABORT,
    CInput.ANNOUNCE,
    CInput.RENEW,
    CInput.PEER_DOWN,
)
#: Inputs caused by the caller (or its timers).
LOCAL = tuple(i for i in CInput if i not in REMOTE)


def _record(state: CState, mode: Mode) -> _Reservation:
    rec = _Reservation("t1", 1, P, mode, ((1,),), 1, 30.0, TimelineBuilder("t1", 1))
    rec.state = state
    return rec


@pytest.mark.parametrize("mode", [Mode.PUSH, Mode.PULL])
def test_remote_inputs_missing_from_table_are_counted(mode: Mode) -> None:
    table = CONSUMER_PUSH if mode is Mode.PUSH else CONSUMER_PULL
    missing = [(s, i) for s in CState for i in REMOTE if (s, i) not in table]
    assert len(missing) > 10
    c = make()
    for state, inp in missing:
        rec = _record(state, mode)
        assert c._step(1.0, rec, inp, remote=True) is False
        assert rec.state is state
        assert c.stats()[f"ignored_{inp.value}_in_{state.value}"] == 1
    assert c.drain() == []


@pytest.mark.parametrize("mode", [Mode.PUSH, Mode.PULL])
def test_local_inputs_missing_from_table_raise(mode: Mode) -> None:
    table = CONSUMER_PUSH if mode is Mode.PUSH else CONSUMER_PULL
    missing = [(s, i) for s in CState for i in LOCAL if (s, i) not in table]
    assert len(missing) > 10
    c = make()
    for state, inp in missing:
        rec = _record(state, mode)
        with pytest.raises(LocalProtocolError, match=f"{inp.name} is not allowed"):
            c._step(1.0, rec, inp)
        assert rec.state is state
    assert c.drain() == []


def _consumer_in(state: CState, mode: Mode) -> tuple[Consumer, int]:
    c = make(p_tp=2)
    e = reserve(c, mode=mode)
    if state is CState.DRAINING:
        c.preempt(1.0, "t1")
    elif state is CState.SUSPECT:
        c.preempt(1.0, "t1")
        c.handle_timer(QUARANTINE)  # the preempted epoch's quarantine, P connected
    elif state in (CState.READING, CState.READ_DRAIN):
        c.receive(1.0, P, Announce("t1", e, ((5, 6),), 10.0))
        if state is CState.READ_DRAIN:
            c.read_done(1.0, "t1", e, Source(0), 0, False)
    c.drain()
    assert c.reservations() == [("t1", e, state)]
    return c, e


def _messages(e: int) -> list[ControlMessage | Completion]:
    return [
        Settled("t1", e),
        Rejected("t1", e, RejectReason.SUPERSEDED),
        WriteFailed("t1", e, Source(1), 0, "x"),
        Announce("t1", e, ((5, 6),), 10.0),
        Announce("t1", e, ((5, 6), (7,)), 10.0),
        Abort("t1", e),
        ReadDone("t1", e, True),
        Withdraw("t1", e),
        Register("t1", e, D, ((1,),), 1.0),
        Heartbeat(3),
        Settled("t1", e + 7),
        notice(e, tp=1),
        notice(e, tp=5),
        Renew("t1", e),
        Extend("t1", e, 0, 5.0),
        Renew("t1", e + 7),
    ]


@pytest.mark.parametrize(
    ("state", "mode"),
    [
        (CState.AWAITING, Mode.PUSH),
        (CState.DRAINING, Mode.PUSH),
        (CState.SUSPECT, Mode.PUSH),
        (CState.AWAITING, Mode.PULL),
        (CState.READING, Mode.PULL),
        (CState.READ_DRAIN, Mode.PULL),
    ],
)
@pytest.mark.parametrize("index", range(16))
def test_every_remote_message_in_every_state_is_safe(state: CState, mode: Mode, index: int) -> None:
    c, e = _consumer_in(state, mode)
    msg = _messages(e)[index]
    stats = sum(c.stats().values())
    if isinstance(msg, Completion):
        c.completion_received(2.0, P, msg)
    else:
        c.receive(2.0, P, msg)
    out = c.drain()
    after = {s for _, _, s in c.reservations()}
    assert after <= {state, CState.DRAINING, CState.READ_DRAIN, CState.READING}
    pointless = {4, 6, 7, 8, 9, 10, 12, 14, 15}  # never meaningful to this reservation
    if state is not CState.AWAITING:
        pointless.add(13)  # a renewal of a reservation no longer waiting
    if mode is Mode.PULL:
        pointless |= {2, 11}  # write results in pull mode
    if mode is Mode.PUSH or state is not CState.AWAITING:
        pointless.add(3)  # an announce it does not wait for
    if index in pointless:
        assert out == []
        assert after == {state}
        assert sum(c.stats().values()) > stats, "ignored without being counted"
    # nothing the peer says makes a consumer read unless it waits for an announce
    if any(isinstance(o, StartRead) for o in out):
        assert (mode, state, index) == (Mode.PULL, CState.AWAITING, 3)
    # a renewal is answered with the lease left, the deadline moved (renewed at 2.0)
    if index == 13 and state is CState.AWAITING:
        assert out == [Send(P, Extend("t1", e, 0, 30.0))]
        tl = c.timeline("t1")
        assert tl is not None and tl.renewed == (2.0,)
    # suspect blocks are counted while, and only while, the reservation is suspect
    assert c.suspect_blocks == (2 if CState.SUSPECT in after else 0)


def test_timeline_builder_freezes_every_field() -> None:
    names = list(Timeline._fields)
    assert names == [f.name for f in dataclasses.fields(TimelineBuilder)]
    b = TimelineBuilder("t", 3)
    pairs = ("write_done", "ops", "notice_seen")
    floats = [n for n in names if n not in ("transfer_id", "epoch", "renewed", *pairs)]
    for i, name in enumerate(floats):
        setattr(b, name, float(i + 1))
    b.renewed += [5.0, 2.0]
    b.write_done[(Source(1), 0)] = 9.0
    b.write_done[(Source(0, 1), 0)] = 8.0
    b.write_done[(Source(0), 1)] = 7.0
    frozen = b.freeze()
    for i, name in enumerate(floats):
        assert getattr(frozen, name) == float(i + 1), name
    assert (frozen.transfer_id, frozen.epoch) == ("t", 3)
    assert frozen.renewed == (5.0, 2.0)  # in the order they happened
    # ordered by (source, consumer rank), not by arrival
    assert frozen.write_done == (
        ((Source(0), 1), 7.0),
        ((Source(0, 1), 0), 8.0),
        ((Source(1), 0), 9.0),
    )
    b.ops[(Source(1), 0)] = OpStamps(1.0, 2.0, 3.0, 4.0)
    b.ops[(Source(0), 0)] = OpStamps(0.5, 0.6, 0.7, 0.8)
    b.notice_seen[(Source(1), 0)] = 5.0
    b.notice_seen[(Source(0), 0)] = 6.0
    frozen = b.freeze()
    assert frozen.ops == (
        ((Source(0), 0), OpStamps(0.5, 0.6, 0.7, 0.8)),
        ((Source(1), 0), OpStamps(1.0, 2.0, 3.0, 4.0)),
    )
    assert frozen.notice_seen == (((Source(0), 0), 6.0), ((Source(1), 0), 5.0))


def test_a_completion_counts_only_from_the_reservations_producer() -> None:
    """xPyD: a notice from another producer (whose MAC verifies: same fleet
    secret) never counts toward this producer's transfer, nor does one from a
    transport agent no handshake introduced; the reservation's own producer's
    notice still does."""
    q = "prefill-q"
    c = make()
    c.connect(0.0, q)
    c.receive(0.0, q, Identity(q, 1).hello(Role.PRODUCER, P_OP_BOUND, TIMING.max_transit))
    c.drain()
    e = reserve(c)
    c.drain()
    c.completion_received(1.0, q, notice(e))
    c.completion_received(1.0, None, notice(e))
    assert c.drain() == []
    assert c.reservations() == [("t1", e, CState.AWAITING)]
    assert c.stats()["completion_wrong_sender"] == 2
    c.completion_received(2.0, P, notice(e), seen=1.5)
    ack, ready = c.drain()
    assert ack == Send(P, ReadDone("t1", e, True))
    assert isinstance(ready, Ready)
    assert ready.timeline.notice_seen == (((Source(0), 0), 1.5),)
    assert ready.timeline.write_done == (((Source(0), 0), 2.0),)
