"""The stall rule in the core (issue 13, 8): the runtime only measures a gap
in its own running and reports it (``stalled(now, gap)``); the endpoint drops
the lease-bearing messages it receives within ``Timing.stall_guard`` after."""

from __future__ import annotations

import pytest

from kvpush.protocol import (
    Announce,
    Consumer,
    ConsumerConfig,
    CState,
    Identity,
    LocalProtocolError,
    Mode,
    Producer,
    ProducerConfig,
    PState,
    Register,
    Rejected,
    RejectReason,
    Reserved,
    Role,
    Send,
    Source,
    StartRead,
    StartWrite,
    Timing,
)
from kvpush.protocol._consumer import STALL_RETRIES
from kvpush.testing import World, WorldConfig

P, D = "prefill", "decode"
TIMING = Timing(max_transit=1.0, op_bound=2.0)  # stall_guard 0.5 s


def ready_producer() -> Producer:
    p = Producer(ProducerConfig(Identity(P, 1), TIMING))
    p.receive(0.0, D, Identity(D, 1).hello(Role.CONSUMER, 2.0, TIMING.max_transit))
    p.drain()
    return p


def test_the_producer_drops_a_registration_read_just_after_a_stall() -> None:
    p = ready_producer()
    assert TIMING.stall_guard == 0.5
    p.stalled(10.0, 4.0)
    p.receive(10.2, D, Register("t1", 1, D, ((7,),), 30.0))
    # Dropped unread, and refused: nothing is or will be written for it.
    assert p.transfers() == [("t1", PState.IDLE)]
    assert p.drain() == [Send(D, Rejected("t1", 1, RejectReason.STALLED))]
    assert p.stats()["dropped_after_stall"] == 1
    assert p.stats()["stalls"] == 1
    assert p.stall_dropped == 1
    p.receive(10.6, D, Register("t2", 1, D, ((8,),), 30.0))  # past the window
    assert p.transfers() == [("t1", PState.IDLE), ("t2", PState.WAIT_KV)]


def _registered(c: Consumer) -> Register:
    (register,) = [
        o.message for o in c.drain() if isinstance(o, Send) and isinstance(o.message, Register)
    ]
    return register


def _pair(ready_timeout: float = 30.0) -> tuple[Consumer, Producer, Register]:
    c = Consumer(ConsumerConfig(Identity(D, 1), TIMING, ready_timeout=ready_timeout))
    assert isinstance(c.reserve(0.0, "t1", P, [[1, 2]]), Reserved)
    c.receive(0.0, P, Identity(P, 1).hello(Role.PRODUCER, 2.0, TIMING.max_transit))
    return c, ready_producer(), _registered(c)


def _answer(p: Producer) -> Rejected:
    (answer,) = p.drain()
    assert isinstance(answer, Send) and isinstance(answer.message, Rejected)
    return answer.message


def test_a_registration_dropped_by_the_stall_rule_is_sent_again_and_served() -> None:
    """Regression (benchmarks/vllm_peer.py, a CPU-starved prefill): a Register
    dropped after the prefill's stall failed its request, though nothing was
    wrong but the load (first at its 30 s deadline, then at once with
    Rejected(STALLED)). Now the consumer registers the same epoch again, as
    attempt 1, once the producer's stall guard has passed, and it is served;
    a late copy of attempt 0 is never taken."""
    c, p, register = _pair()
    assert register.attempt == 0
    p.stalled(1.0, 2.0)
    p.receive(1.1, D, register)
    rejected = _answer(p)
    assert (rejected.reason, rejected.attempt) == (RejectReason.STALLED, 0)
    c.receive(1.2, P, rejected)
    assert c.reservations() == [("t1", register.epoch, CState.RETRY_WAIT)]
    assert c.reserved_blocks == 2 and c.drain() == []  # no Failed, blocks kept
    c.handle_timer(1.2 + TIMING.stall_guard - 0.01)
    assert c.drain() == []
    c.handle_timer(1.2 + TIMING.stall_guard)
    again = _registered(c)
    assert (again.epoch, again.attempt) == (register.epoch, 1)
    assert again.lease == pytest.approx(30.0 - 1.7)  # the same deadline
    assert c.stats()["register_retry_after_stall"] == 1
    p.receive(1.8, D, again)  # past the producer's window
    assert p.transfers() == [("t1", PState.WAIT_KV)] and p.drain() == []
    p.receive(1.9, D, register)  # a late copy of attempt 0: a duplicate, not taken
    assert p.drain() == [] and p.stats()["register_duplicate"] == 1
    c.receive(2.0, P, Rejected("t1", register.epoch, RejectReason.SUPERSEDED, 0))
    assert c.reservations() == [("t1", register.epoch, CState.AWAITING)]  # stale: ignored
    p.kv_ready(2.0, "t1", [[3, 4]])
    (write,) = [o for o in p.drain() if isinstance(o, StartWrite)]
    assert write.dst_blocks == ((1, 2),) and write.epoch == register.epoch


def test_a_stalled_registration_fails_once_retries_or_time_run_out() -> None:
    """Each retry is bounded: STALL_RETRIES attempts, and one only if the
    deadline is further than the stall guard; then Failed(REJECTED) and the
    blocks come back at once (nothing was taken)."""
    c, p, register = _pair()
    now = 1.0
    for attempt in range(STALL_RETRIES + 1):
        assert register.attempt == attempt
        p.stalled(now, 2.0)
        p.receive(now, D, register)
        c.receive(now, P, _answer(p))
        now += TIMING.stall_guard
        c.handle_timer(now)
        if attempt < STALL_RETRIES:
            register = _registered(c)
    assert c.reservations() == [] and c.reserved_blocks == 0
    (failed,) = [e for e in c.drain() if type(e).__name__ == "Failed"]
    assert failed.reason.value == "rejected"  # type: ignore[attr-defined]
    c2, p2, register2 = _pair(ready_timeout=1.0)  # the deadline is too close for a retry
    p2.stalled(0.7, 2.0)
    p2.receive(0.7, D, register2)
    c2.receive(0.7, P, _answer(p2))
    assert c2.reservations() == [] and c2.reserved_blocks == 0


def test_a_reservation_waiting_to_register_again_ends_at_once_on_abort() -> None:
    c, p, register = _pair()
    p.stalled(1.0, 2.0)
    p.receive(1.0, D, register)
    c.receive(1.0, P, _answer(p))
    assert c.abort(1.1, "t1")
    assert c.reservations() == [] and c.reserved_blocks == 0  # nothing can land
    c.handle_timer(5.0)
    assert not [o for o in c.drain() if isinstance(o, Send) and isinstance(o.message, Register)]


def test_a_late_copy_of_a_registration_refused_after_a_stall_is_never_taken() -> None:
    """The consumer released the blocks on Rejected(STALLED): a copy of the
    same Register read after the window must not be written into them."""
    p = ready_producer()
    register = Register("t1", 1, D, ((7,),), 30.0)
    p.stalled(1.0, 1.0)
    p.receive(1.1, D, register)
    assert p.drain() == [Send(D, Rejected("t1", 1, RejectReason.STALLED))]
    p.receive(5.0, D, register)  # past the window
    assert p.drain() == [Send(D, Rejected("t1", 1, RejectReason.SUPERSEDED))]
    assert p.transfers() == [("t1", PState.IDLE)]
    p.kv_ready(5.1, "t1", [[3]])
    assert not [o for o in p.drain() if isinstance(o, StartWrite)]


def test_a_duplicate_of_a_taken_registration_is_not_refused_by_the_stall_rule() -> None:
    p = ready_producer()
    register = Register("t1", 1, D, ((7,),), 30.0)
    p.receive(1.0, D, register)
    p.drain()
    p.stalled(2.0, 1.0)
    p.receive(2.1, D, register)  # the same epoch again: it was taken, no Rejected
    assert p.drain() == []
    assert p.transfers() == [("t1", PState.WAIT_KV)]


def test_the_consumer_drops_an_announce_read_just_after_a_stall() -> None:
    c = Consumer(ConsumerConfig(Identity(D, 1), TIMING))
    r = c.reserve(0.0, "t1", P, [[1]], mode=Mode.PULL)
    assert isinstance(r, Reserved)
    c.receive(0.0, P, Identity(P, 1).hello(Role.PRODUCER, 2.0, TIMING.max_transit))
    c.drain()
    c.stalled(5.0, 3.0)
    c.receive(5.0, P, Announce("t1", r.epoch, ((3,),), 20.0))
    assert not any(isinstance(o, StartRead) for o in c.drain())
    assert c.reservations() == [("t1", r.epoch, CState.AWAITING)]
    assert c.stats()["dropped_after_stall"] == 1
    c.receive(5.0, P, Identity(P, 1).hello(Role.PRODUCER, 2.0, TIMING.max_transit))  # others pass
    assert c.stats()["hello_duplicate"] == 1


def test_stalled_needs_a_gap() -> None:
    p = ready_producer()
    with pytest.raises(LocalProtocolError, match="gap"):
        p.stalled(1.0, 0.0)
    with pytest.raises(LocalProtocolError, match="gap"):
        p.stalled(1.0, float("inf"))


def test_the_stall_window_is_configurable() -> None:
    assert Timing(max_transit=4.0).stall_guard == 2.0
    assert Timing(stall_window=0.1).stall_guard == 0.1


def _late_registration(world: World) -> None:
    """The consumer reserves; the prefill, its KV ready, stops before it reads
    the Register; the consumer's deadline and quarantine pass and it reuses
    the blocks; the prefill resumes and reads the Register late."""
    assert world.kv_ready("t0")
    assert world.reserve("t0")
    world.stall(P, 20.0)  # ready_timeout 5: deadline, quarantine, released
    while world.ops and not world.ops[0].landed:
        world.post(0)
        if world.ops and world.ops[0].posted_at is not None:
            world.land(0)


def test_the_model_shows_what_the_rule_prevents(monkeypatch: pytest.MonkeyPatch) -> None:
    """The world's stall move. With the rule, the late Register is dropped.
    With the rule taken away, the late registration is taken and its write
    lands, but I1 still holds: the quarantine passed while the producer was
    connected, so the blocks were held as suspect, not reused, and come back
    only once the write's completion proves nothing more can land. (Before
    the suspect hold, this raised I1: the write landed in reused blocks.)"""
    cfg = WorldConfig(ready_timeout=5.0, kv_hold_timeout=100.0, tombstone_ttl=200.0)
    world = World(cfg)
    _late_registration(world)
    assert world.stall_losses == {"t0"}
    assert world.producer.stats()["dropped_after_stall"] == 1
    world.quiesce()
    assert world.ready == set()
    monkeypatch.setattr(Producer, "stalled", lambda self, now, gap: None)
    world = World(cfg)
    _late_registration(world)
    assert world.consumer.stats()["suspect"] == 1
    assert world.checker.content[0] == {("t0", 1, Source(0), 0)}  # it landed, held
    world.quiesce()
    assert world.consumer.reserved_blocks == 0 and world.consumer.suspect_blocks == 0


def test_a_stall_shorter_than_the_frames_age_changes_nothing_else() -> None:
    w = World(WorldConfig())
    assert w.reserve("t0")
    assert w.kv_ready("t0")
    w.stall(D, 0.6)
    w.quiesce()
    assert w.ready == {"t0"}
    assert not any(isinstance(o, Send) for o in w.consumer.drain())
