"""Issue 13, item 7: no call may hand back events that its caller can drop.

In real vLLM engines requests hung past every deadline: ``SchedulerSide.reserve``
called ``SyncRuntime.call(channel.add_route, ...)`` and ignored its result, which
also carried every event drained so far. Another transfer's ``Ready`` queued at
that moment was lost; the core had finished that transfer, so no deadline fired,
and vLLM never heard that its KV had arrived. Events now have one sink, drained
only by the owner (``SchedulerSide.step`` and ``SchedulerSide.results``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed (make test installs it)")

from test_vllm_sides import Instance, free_port, run_until

from kvpush.protocol import Mode, Ready, Role
from kvpush_vllm._params import TransferParams


def worker_results(inst: Instance) -> list[Any]:
    """The workers' half of an engine step: their results."""
    out = inst.sched.bridge.take()
    results = []
    for w in inst.workers:
        w.step(out.actions, out.peers, inst.sched.expecting(), inst.sched.doorbell)
        results += w.take_results()
    return results


def step_workers(inst: Instance) -> None:
    """The workers' half of an engine step and ``update_connector_output``
    (what vLLM's engine does between two scheduler steps)."""
    heard = inst.sched.results(worker_results(inst))  # what vLLM hears in this step
    inst.seen.recving |= heard.recving
    inst.seen.sending |= heard.sending


def test_a_ready_queued_during_another_reservation_reaches_vllm() -> None:
    prefill = Instance(Role.PRODUCER, 1, port=free_port())
    decode = Instance(Role.CONSUMER, 1)
    try:
        peer = prefill.config.engine_id
        first = TransferParams("kvp-first", "decode", Mode.PUSH, peer)
        decode.sched.reserve("d-1", first, [1, 2], 0)
        source = TransferParams("kvp-first", "prefill", Mode.PUSH, "d")
        prefill.sched.kv_ready("p-1", source, [3, 4])
        core = decode.sched._sync.runtime.endpoint  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        # Move the KV without a scheduler step on the decode: its Ready waits
        # in the runtime's queue, as it does between two vLLM steps.
        while core.reservations():
            assert time.monotonic() < deadline, core.reservations()
            prefill.step()
            step_workers(decode)
            time.sleep(0.002)
        # Another request is scheduled: its reservation must not swallow the
        # first one's Ready.
        second = TransferParams("kvp-second", "decode", Mode.PUSH, peer)
        decode.sched.reserve("d-2", second, [5], 0)
        run_until([prefill, decode], lambda: "d-1" in decode.seen.recving, timeout=5.0)
        assert decode.seen.failed == {}
        assert "d-2" not in decode.seen.recving  # its KV never became ready
    finally:
        prefill.close()
        decode.close()


def test_the_facade_hands_events_only_to_its_drain() -> None:
    """``SyncRuntime.call`` returns the call's result alone; the events wait
    for ``events()``, in order, however many calls came between."""
    prefill = Instance(Role.PRODUCER, 1, port=free_port())
    decode = Instance(Role.CONSUMER, 1)
    try:
        sync = decode.sched._sync
        assert sync is not None
        peer = prefill.config.engine_id
        decode.sched.reserve("d-1", TransferParams("kvp-a", "decode", Mode.PUSH, peer), [1], 0)
        prefill.sched.kv_ready("p-1", TransferParams("kvp-a", "prefill", Mode.PUSH, "d"), [2])
        core = sync.runtime.endpoint
        deadline = time.monotonic() + 10
        while core.reservations():
            assert time.monotonic() < deadline
            prefill.step()
            sync.runtime.feed(worker_results(decode))  # fed, not drained
            time.sleep(0.002)
        assert sync.call(lambda: 42) == 42  # a plain result, no events tuple
        events = sync.events()
        assert [type(e) for e in events if isinstance(e, Ready)] == [Ready]
        assert sync.events() == []
    finally:
        prefill.close()
        decode.close()
