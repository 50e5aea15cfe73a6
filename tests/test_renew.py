"""Lease renewal: a prefill still computing keeps the decode's reservation
alive, a silent one still fails at the original bounds (docs/protocol.md,
"Renewal"). The model world, with its fake clock and invariant checker, runs
every case; ``test_a_real_prefill_computing_three_ready_timeouts_completes``
runs the same over real NIXL in two processes."""

from __future__ import annotations

import pytest

from kvpush.protocol import (
    CState,
    Extend,
    Failed,
    FailureReason,
    PState,
    Ready,
    Renew,
    Role,
    Send,
    SourceReleased,
)
from kvpush.testing import World, WorldConfig

READY_TIMEOUT = 5.0


def world(ready_timeout: float = READY_TIMEOUT, **kw: float) -> World:
    cfg = WorldConfig(ready_timeout=ready_timeout, kv_hold_timeout=100.0, tombstone_ttl=200.0)
    w = World(cfg)
    for name, value in kw.items():  # consumer settings the world does not expose
        object.__setattr__(w.consumer.config, name, value)
    return w


def flow(w: World, until: float) -> None:
    """Deliver every frame as it comes and let time pass up to ``until``."""
    while w.clock.now < until:
        while w.net.queue:
            w.deliver(0)
        nxt = w.next_event_time()
        step = until - w.clock.now if nxt is None else min(until, nxt) - w.clock.now
        w.advance(max(step, 0.0) + 1e-6)
    while w.net.queue:
        w.deliver(0)


def test_a_prefill_computing_three_ready_timeouts_completes() -> None:
    w = world()
    assert w.reserve("t0")
    flow(w, 3 * READY_TIMEOUT)  # the prefill is still computing
    assert w.consumer.reservations() == [("t0", 1, CState.AWAITING)]
    assert w.kv_ready("t0")
    w.quiesce()
    assert w.ready == {"t0"}
    ready = next(e for e in w.events if isinstance(e, Ready))
    renewals = ready.timeline.renewed
    # Half the lease (2.5 s), then at each renewal's half again: about every 2.5 s.
    assert len(renewals) >= 5 and renewals[0] == pytest.approx(READY_TIMEOUT / 2, abs=0.01)
    assert w.consumer.stats()["renewed"] == len(renewals)
    assert w.producer.stats()["extended"] == len(renewals)
    sent = [e for e in w.events if isinstance(e, Send) and isinstance(e.message, Renew)]
    assert len(sent) == w.producer.stats()["renew_sent"] >= len(renewals)


def test_without_renewal_the_same_prefill_fails_at_its_deadline() -> None:
    """The control: with the producer's Renew taken away (lost in the
    network), the reservation fails at ``ready_timeout``."""
    w = world()
    assert w.reserve("t0")
    while w.clock.now < 3 * READY_TIMEOUT:
        for k in reversed(range(len(w.net.queue))):
            if isinstance(w.net.queue[k].message, Renew):
                w.net.drop(k)
        while w.net.queue:
            w.deliver(0)
        w.advance(0.25)
    failed = [e for e in w.events if isinstance(e, Failed)]
    assert [(f.transfer_id, f.reason) for f in failed] == [("t0", FailureReason.TIMEOUT)]
    assert w.consumer.stats().get("renewed", 0) == 0
    # It asked at 2.5 s; halfway to the lease's end again (3.75 s) an answer
    # could not come back in time (a round trip is up to 2 x max_transit).
    assert w.producer.stats()["renew_sent"] == 1
    w.kv_ready("t0")
    w.quiesce()
    assert w.ready == set()


def test_a_prefill_that_stops_renewing_fails_by_its_last_renewal_plus_ready_timeout() -> None:
    w = world()
    assert w.reserve("t0")
    flow(w, 2 * READY_TIMEOUT)
    renewed = w.consumer.timeline("t0")
    assert renewed is not None and renewed.renewed
    last = renewed.renewed[-1]
    w.stall("prefill", 4 * READY_TIMEOUT)  # silent: it renews nothing
    failed = [e for e in w.events if isinstance(e, Failed)]
    assert [f.reason for f in failed] == [FailureReason.TIMEOUT]
    # The checker's I5 held at every tick: failed by the (renewed) deadline.
    assert w.checker.res[("t0", 1)].deadline == pytest.approx(last + READY_TIMEOUT)
    w.quiesce()
    assert w.consumer.reserved_blocks == 0


def test_renewal_stops_at_max_ready_timeout() -> None:
    limit = 2 * READY_TIMEOUT
    w = world(max_ready_timeout=limit)
    assert w.reserve("t0")
    flow(w, 4 * READY_TIMEOUT)
    failed = [e for e in w.events if isinstance(e, Failed)]
    assert [f.reason for f in failed] == [FailureReason.TIMEOUT]
    assert w.checker.res[("t0", 1)].deadline == pytest.approx(limit)
    assert w.consumer.stats()["renew_at_limit"] >= 1
    w.quiesce()
    assert w.consumer.reserved_blocks == 0


def test_an_extend_read_just_after_a_stall_is_dropped_and_asked_again() -> None:
    """Extend carries a lease, so the stall rule drops it like a Register; the
    producer's next Renew (halfway through what is left) gets a fresh one."""
    w = world(ready_timeout=2 * READY_TIMEOUT)  # room for a second Renew
    assert w.reserve("t0")
    w.deliver(0)  # the Register
    w.advance(READY_TIMEOUT + 0.01)  # the first Renew goes out
    assert [type(m.message) for m in w.net.queue] == [Renew]
    w.deliver(0)  # Renew reaches the consumer, its Extend is queued
    assert [type(m.message) for m in w.net.queue] == [Extend]
    w.producer.stalled(w.clock.now, 1.0)
    while w.net.queue:
        w.deliver(0)
    assert w.producer.stats()["dropped_after_stall"] == 1
    assert w.producer.stats().get("extended", 0) == 0
    flow(w, 3 * READY_TIMEOUT)
    assert w.producer.stats()["extended"] >= 1
    assert w.kv_ready("t0")
    w.quiesce()
    assert w.ready == {"t0"}


def test_a_waiting_decode_keeps_the_ready_kv_and_a_silent_one_does_not() -> None:
    cfg = WorldConfig(ready_timeout=READY_TIMEOUT, kv_hold_timeout=4.0, tombstone_ttl=200.0)
    kept, dropped = World(cfg), World(cfg)
    for w in (kept, dropped):
        assert w.kv_ready("t0")
    for _ in range(5):  # 10 s: the decode has no blocks yet, asks every 2 s
        assert kept.consumer.keep(kept.clock.now, "t0", "prefill")
        kept.pump()
        while kept.net.queue:
            kept.deliver(0)
        kept.advance(2.0)
        dropped.advance(2.0)
    assert kept.producer.transfers() == [("t0", PState.HOLDING)]
    assert kept.producer.stats()["kept"] == 4  # the first came before any was needed
    assert kept.producer.stats()["keep_not_needed"] == 1
    assert dropped.producer.transfers() == [("t0", PState.RELEASED)]
    assert kept.reserve("t0")
    kept.quiesce()
    assert kept.ready == {"t0"}
    out = [e for e in dropped.events if isinstance(e, SourceReleased)]
    assert [e.outcome.value for e in out] == ["expired"]


@pytest.mark.nixl
def test_a_real_prefill_computing_three_ready_timeouts_completes() -> None:
    pytest.importorskip("nixl._api", reason="NIXL is not installed (make test installs it)")
    import time

    from nixl_procs import sides, spec

    ready_timeout = 2.5  # over 4 x max_transit (0.5): room for a renewal's round trip
    with sides(
        spec(Role.PRODUCER, 1, 16), spec(Role.CONSUMER, 1, 16, ready_timeout=ready_timeout)
    ) as (p, d):
        src = dst = [3, 4, 5]
        assert p("fill", src, 4) == ("ok",)
        assert d("reserve", "long", dst, "push", 0)[0] == "reserved"
        time.sleep(3 * ready_timeout)  # computing
        assert d("wait", ("Failed",), "long", 0.1, 1)[0] == "timeout"
        assert p("kv_ready", "long", src) == ("ok",)
        ready, _ = d.wait(("Ready", "Failed"), "long", 10)
        assert ready["type"] == "Ready", ready
        assert ready["ready_after_reserve"] > 3 * ready_timeout
        assert d("bad_blocks", dst, 4, 0) == ("bad", [])
        out, _ = p.wait(("SourceReleased",), "long", 10)
        assert out["outcome"] == "delivered", out
