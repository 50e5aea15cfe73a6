"""Interleavings that once broke an invariant, replayed move by move."""

from __future__ import annotations

from kvpush.protocol import (
    Abort,
    Announce,
    CState,
    Mode,
    PeerState,
    PState,
    Register,
    Rejected,
    ReleaseOutcome,
    Settled,
    StartRead,
)
from kvpush.testing import ProtocolMachine, World, WorldConfig


def _index(world: World, kind: type, epoch: int | None = None) -> int:
    for i, m in enumerate(world.net.queue):
        if isinstance(m.message, kind) and (epoch is None or m.message.epoch == epoch):
            return i
    raise AssertionError(f"no {kind.__name__} in flight")


def test_stale_abort_overtaken_by_a_newer_pull_epoch_does_not_free_lent_kv() -> None:
    """A pull reservation times out (its Abort(e1) is sent), the caller reserves
    again (e2), Register(e2) overtakes Abort(e1), the producer lends e2 and the
    consumer starts reading. Abort(e1) must then end only e1: the producer must
    not free the KV under the running read (the checker would see the read land
    from freed source blocks, and the consumer would report Ready on it)."""
    w = World(WorldConfig(ready_timeout=5.0, kv_hold_timeout=100.0, tombstone_ttl=200.0))
    assert w.reserve("t", Mode.PULL)
    w.deliver(_index(w, Register))
    w.advance(5.5)  # deadline: Failed(TIMEOUT), Abort(e1) queued
    abort = w.net.queue[_index(w, Abort)].message
    assert w.reserve("t", Mode.PULL)
    e2 = w.live["t"]
    assert e2 > abort.epoch
    w.deliver(_index(w, Register, e2))
    assert w.kv_ready("t")
    w.deliver(_index(w, Announce, e2))
    (read,) = [k for k, op in enumerate(w.ops)]
    w.post(read)
    w.deliver(_index(w, Abort))  # the stale Abort(e1) arrives now
    assert w.producer.stats()["abort_of_older_epoch"] == 1
    w.land(read)  # the checker verifies the source is still held
    w.quiesce()
    assert w.ready == {"t"}


def test_stale_abort_overtaken_by_a_newer_push_epoch_lets_it_complete() -> None:
    w = World(WorldConfig(ready_timeout=5.0, kv_hold_timeout=100.0, tombstone_ttl=200.0))
    assert w.reserve("t")
    w.deliver(_index(w, Register))
    w.advance(5.5)
    assert w.reserve("t")
    w.deliver(_index(w, Register, w.live["t"]))
    w.deliver(_index(w, Abort))  # before the KV is ready: e2 must survive it
    assert w.kv_ready("t")
    w.quiesce()
    assert w.ready == {"t"}


def test_duplicate_register_after_delivery_does_not_fail_the_transfer() -> None:
    """The network duplicates a Register; the copies arrive after the producer
    delivered every write, but before the consumer polled the notices: one
    while the producer holds the delivered KV (waiting for the consumer's
    acknowledgment), one after that hold expired and left a tombstone.
    Neither may answer Rejected (it would fail a transfer whose data already
    landed)."""
    w = World(WorldConfig(producer_tp=2, consumer_tp=1, kv_hold_timeout=0.5, ready_timeout=30.0))
    assert w.reserve("t")
    w.net.duplicate(_index(w, Register))
    w.net.duplicate(_index(w, Register))
    w.deliver(_index(w, Register))
    assert w.kv_ready("t")
    for k in range(len(w.ops)):
        w.post(k)
        w.land(k)
    while w.ops:
        w.ack(0)
    # Delivered, not yet acknowledged: the source is held.
    assert w.producer.transfers() == [("t", PState.DELIVERED)]
    assert w.producer.held_blocks == 2
    w.deliver(_index(w, Register))  # the first copy
    assert not any(isinstance(m.message, Rejected) for m in w.net.queue)
    assert w.producer.transfers() == [("t", PState.DELIVERED)]
    w.advance(0.6)  # within max_transit of the send: the last copy is still in flight
    assert w.source_outcomes["t"] is ReleaseOutcome.DELIVERED  # the hold expired
    assert w.producer.held_blocks == 0
    assert w.producer.transfers() == [("t", PState.RELEASED)]
    w.deliver(_index(w, Register))  # the second copy reaches the tombstone
    assert not any(isinstance(m.message, Rejected) for m in w.net.queue)
    assert w.producer.stats()["register_duplicate"] == 2
    w.quiesce()
    assert w.ready == {"t"}
    assert not w.failed


def test_abort_reaching_a_tombstone_is_acknowledged() -> None:
    w = World(WorldConfig(kv_hold_timeout=1.0, tombstone_ttl=50.0, ready_timeout=30.0))
    assert w.kv_ready("t")
    w.advance(1.5)  # hold expired: released, tombstone
    w.producer.receive(w.clock.now, "decode", Abort("t", 3))
    w.pump()
    assert any(isinstance(m.message, Settled) and m.message.epoch == 3 for m in w.net.queue)


def test_abort_of_a_newer_pull_epoch_does_not_free_kv_under_an_older_read() -> None:
    """Issue 13 (3), found by a seeded random driver: Register(e1), Announce(e1),
    the read of e1 posted, preempt (READING -> READ_DRAIN), reserve again
    (Register(e2)), abort (Abort(e2)). The producer took Abort(e2) as the end of
    the whole transfer and released the source while read e1 still ran; the
    checker now fails any such release, whether or not the read lands late."""
    w = World(WorldConfig(kv_hold_timeout=100.0, tombstone_ttl=200.0))
    assert w.reserve("t", Mode.PULL)
    e1 = w.live["t"]
    w.deliver(_index(w, Register))
    assert w.kv_ready("t")
    w.deliver(_index(w, Announce, e1))
    (read,) = range(len(w.ops))
    w.post(read)
    assert w.preempt("t")
    assert w.reserve("t", Mode.PULL)
    e2 = w.live["t"]
    w.deliver(_index(w, Register, e2))
    assert w.abort_consumer("t")
    w.deliver(_index(w, Abort, e2))  # before the fix: SourceReleased here (I1)
    assert "t" not in w.source_outcomes
    w.land(read)  # the checker verifies the source is still held
    w.quiesce()
    assert w.source_outcomes["t"] is ReleaseOutcome.ABORTED


def test_a_registration_copy_after_unknown_peer_is_not_served() -> None:
    """Found by the machines once handshake frames joined the fault model: the
    producer lost the handshake (it saw the connection die, the consumer did
    not) and answered Register(e) with Rejected(UNKNOWN_PEER), on which the
    consumer released the blocks. A copy of Register(e), duplicated or delayed
    within max_transit, reached the producer after the handshake was redone and
    was served: its write landed in released blocks. Now the rejection leaves a
    tombstone of that epoch, and the copy is refused."""
    w = World(WorldConfig(kv_hold_timeout=100.0, tombstone_ttl=200.0))
    w.producer.peer_lost(w.clock.now, "decode")  # the consumer did not notice
    assert w.reserve("t")
    w.net.duplicate(_index(w, Register))
    w.deliver(_index(w, Register))  # Rejected(UNKNOWN_PEER)
    w.deliver(_index(w, Rejected))  # the consumer releases, says hello again
    assert ("t", 1) in w.failed
    assert w.consumer.reserved_blocks == 0
    # the handshake is redone (the hello the consumer now resends, or any)
    w.producer.receive(w.clock.now, "decode", w.consumer._hello)
    w.pump()
    assert w.producer.peer("decode").state is PeerState.READY
    assert w.kv_ready("t")
    w.deliver(_index(w, Register))  # the copy of Register(e1)
    assert w.ops == []
    w.quiesce()
    assert w.producer.stats()["register_stale"] == 1


def test_a_hung_write_is_cancelled_and_every_block_comes_back() -> None:
    """A write that never completes, with its producer connected. Before
    issue 28 no one ended it: the decode's blocks stayed suspect, probed for
    ever, and the producer's source held for ever (I3 excused them). Now the
    producer asks for its cancel op_bound after the StartWrite; once the
    transport confirms, the epoch settles as for any failed write, and the
    world quiesces with nothing held on either side."""
    w = World(WorldConfig(ready_timeout=5.0, kv_hold_timeout=3.0, tombstone_ttl=5.0))
    assert w.reserve("t0") and w.kv_ready("t0")
    while w.net.queue:
        w.deliver(0)
    w.post(0)
    w.hang(0)
    for tid in ("t1", "t2"):
        assert w.reserve(tid) and w.kv_ready(tid)
    w.quiesce()
    assert w.hung == {("t0", 1)}
    assert w.ready == {"t1", "t2"}
    assert ("t0", 1) in w.failed
    assert w.consumer.reservations() == []
    assert w.consumer.reserved_blocks == w.consumer.suspect_blocks == 0
    assert w.producer.held_blocks == 0
    assert w.producer.stats()["write_cancel"] == 1
    assert w.consumer.next_deadline() is None and w.producer.next_deadline() is None


def test_the_long_runs_seed_with_a_hung_op_in_a_pull_reservation_quiesces() -> None:
    """``make long`` failed "the world did not quiesce" on a run with hung
    ops, a pull reservation, a progressive increment and TP 1 -> 3 (issue
    28's seed): a hung read held its reservation in ``READ_DRAIN`` for ever.
    The consumer now cancels its own reads past their bound."""
    w = World(WorldConfig(consumer_tp=3, num_kv_heads=3, ready_timeout=5.0, kv_hold_timeout=3.0))
    assert w.reserve("t0", Mode.PULL) and w.kv_ready("t0")
    assert w.kv_increment("t1") and w.reserve("t1")
    while w.net.queue:
        w.deliver(0)
    reads = [i for i, op in enumerate(w.ops) if isinstance(op.action, StartRead)]
    assert len(reads) == 3
    w.post(reads[0])
    w.hang(reads[0])
    assert w.kv_ready("t1")  # the rest of t1's source
    w.quiesce()
    assert "t0" in {t for t, _ in w.failed} and "t0" not in w.ready
    assert w.consumer.reserved_blocks == w.producer.held_blocks == 0
    assert w.consumer.stats()["read_cancel"] == 1


def test_a_copy_of_a_taken_registration_reaching_a_producer_that_lost_the_decode() -> None:
    """Only the prefill saw the connection go; a duplicate of the Register it
    took (its write in flight) then arrives from the now unknown decode. It
    must not be answered Rejected(UNKNOWN_PEER): the decode would free the
    blocks and the write land in them (found while reviewing issue 16)."""
    w = World(WorldConfig(ready_timeout=5.0, kv_hold_timeout=100.0, tombstone_ttl=200.0))
    assert w.reserve("t0")
    i = _index(w, Register)
    w.net.duplicate(i)
    w.deliver(i)
    assert w.kv_ready("t0")
    w.post(0)
    w.producer.peer_lost(w.clock.now, "decode")
    w.pump()
    w.deliver(_index(w, Register))  # the copy
    assert not any(isinstance(m.message, Rejected) for m in w.net.queue)
    assert w.producer.stats()["register_copy_from_unready_peer"] == 1
    w.land(0)  # the checker fails here if the blocks were freed
    assert [(t, st) for t, _, st in w.consumer.reservations()] == [("t0", CState.AWAITING)]


def test_suspect_probes_heal_a_handshake_only_the_producer_lost() -> None:
    """The prefill took the registration, then saw the connection go and come
    back and redid its side of the handshake; the decode saw nothing and,
    being ready, answered none of its hellos. The reservation failed at its
    deadline and became suspect at its quarantine; its probes reached a
    producer that ignores an unknown peer, for ever (the property machine
    found the world never quiescing). The probes now carry our hello: the
    handshake heals and the probe is answered."""
    w = World(WorldConfig(ready_timeout=5.0, kv_hold_timeout=3.0, tombstone_ttl=5.0))
    assert w.reserve("t0")
    w.deliver(_index(w, Register))
    w.producer.peer_lost(w.clock.now, "decode")
    w.producer.connection_up(w.clock.now, "decode")
    w.pump()
    while w.net.queue:  # the producer's hellos, which the ready decode ignores
        w.deliver(0)
    w.advance(5.0 + 1.0 + 2.0 + 0.01)  # deadline, quarantine: suspect
    assert [(t, st) for t, _, st in w.consumer.reservations()] == [("t0", CState.SUSPECT)]
    w.quiesce()
    assert w.consumer.reservations() == []
    assert w.producer.peer("decode").state is PeerState.READY


def test_a_stall_of_a_restarted_prefill_does_not_resume_the_dead_ones_writes() -> None:
    """The model's own bug, found by the long property run: a prefill died
    with a write posted and was restarted; a stall of the *new* process made
    the dead one's write unbounded, so it landed after the decode had
    released its blocks; so did one the dead process's own stall had made
    unbounded before it died. A dead process's write lands within its bound
    (from its death) or never; only the live process's posted writes wait
    for it to run."""
    w = World(WorldConfig(ready_timeout=5.0, kv_hold_timeout=3.0, tombstone_ttl=5.0))
    assert w.kv_ready("t2") and w.reserve("t2")
    w.deliver(_index(w, Register))
    w.post(0)
    assert w.stall("prefill", 0.6) and w.ops[0].unbounded
    assert w.kill_producer(detected=False) and w.restart_producer()
    assert w.stall("prefill", 20.0)
    assert not any(op.unbounded for op in w.ops)
    for k in reversed(range(len(w.ops))):  # whatever is left may still land
        w.land(k)
    w.quiesce()


def test_a_pull_read_resumed_past_the_lent_quarantine_is_never_ready() -> None:
    """Found by the long property run once a stalled decode's reads became
    unbounded: the producer's lent quarantine (a timer) released the source,
    then the decode, stalled with its read posted, resumed and the read moved
    reused bytes. Safe only because it lands past the deadline, where the
    consumer steps the deadline first: the checker now accepts such a read
    exactly then, and fails a Ready built on it."""
    from kvpush.testing._machine import ProtocolMachine

    m = ProtocolMachine()
    m.setup(config=WorldConfig(ready_timeout=20.0, kv_hold_timeout=3.0, tombstone_ttl=5.0))
    m.kv_ready(tid="t0")
    m.reserve(mode=Mode.PUSH, tid="t0")
    for _ in range(3):
        m.advance(dt=0.001)
    m.reconnect(coin=0, detected=True)
    m.progress(picks=[0, 0])
    for _ in range(7):
        m.advance(dt=0.001)
    m.reserve(mode=Mode.PULL, tid="t0")
    m.deliver(i=0)
    m.deliver(i=0)
    m.stall(coin=0, gap=20.0, who="prefill")
    m.kv_ready(tid="t0")
    m.progress(picks=[0])
    m.stall(coin=0, gap=3.0, who="decode")
    m.progress(picks=[0])
    m.teardown()
    w = m.world
    assert w.checker.res[("t0", 2)].tainted
    assert "t0" not in w.ready


def _replay_stop_after_a_lost_connection(producer_pp: int, cancel: bool) -> None:
    """The two cases ``make long`` drew (2026-12-06): a push write posted, the
    connection lost and seen, then the prefill stopped 20 s before its hello
    was answered. The decode, not seeing it connected, took it as gone at the
    quarantine (the documented A2 case); the model had made the write unbounded
    all the same, and landed it in the released blocks (I1)."""
    m = ProtocolMachine()
    m.setup(
        config=WorldConfig(
            producer_pp=producer_pp, num_kv_heads=12, max_transit=1.0, op_bound=2.0,
            ready_timeout=5.0, kv_hold_timeout=3.0, tombstone_ttl=5.0,
            blocks_per_transfer=2, pool_blocks=64,
        )
    )  # fmt: skip
    for _ in range(4):
        m.ack(i=0)  # before any op: nothing to land
    m.reserve(mode=Mode.PUSH, tid="t0")
    m.deliver(i=0)
    m.kv_increment(tid="t0")
    m.reconnect(coin=0, detected=True)
    m.progress(picks=[producer_pp + 1])  # posts the write
    m.stall(coin=0, gap=20.0, who="prefill")
    if cancel:
        m.cancel(i=1)
    m.ack(i=0)
    m.teardown()


def test_a_prefill_stopped_after_losing_its_connection_is_not_unbounded() -> None:
    _replay_stop_after_a_lost_connection(producer_pp=1, cancel=False)
    _replay_stop_after_a_lost_connection(producer_pp=2, cancel=True)
