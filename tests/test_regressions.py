"""Interleavings that once broke an invariant, replayed move by move."""

from __future__ import annotations

from kvpush.protocol import (
    Abort,
    Announce,
    Mode,
    PeerState,
    Register,
    Rejected,
    ReleaseOutcome,
    Settled,
)
from kvpush.testing import World, WorldConfig


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
    """The network duplicates a Register; the copy arrives after the producer
    delivered every write and released, but before the consumer polled the
    notices. The tombstone must not answer Rejected (it would fail a transfer
    whose data already landed)."""
    w = World(WorldConfig(producer_tp=2, consumer_tp=1))
    assert w.reserve("t")
    w.net.duplicate(_index(w, Register))
    w.deliver(_index(w, Register))
    assert w.kv_ready("t")
    for k in range(len(w.ops)):
        w.post(k)
        w.land(k)
    while w.ops:
        w.ack(0)
    assert w.producer.held_blocks == 0  # released, tombstone kept
    w.deliver(_index(w, Register))  # the duplicate
    assert not any(isinstance(m.message, Rejected) for m in w.net.queue)
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
