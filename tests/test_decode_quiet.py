"""A decode's own threads cost its engine nothing while nothing is in flight.

The worker's data-plane thread shares its process, the GIL and (on CPU) the
core with the engine's forward. It used to poll NIXL every 0.2 ms forever;
now it polls only while a transfer of its instance is open (a registration
waiting for its bytes, a source a peer may read) and sleeps on its command
queue otherwise. Real NIXL (UCX on loopback), the connector's two halves
stepped the way vLLM steps them (``test_vllm_sides.Instance``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed (make test installs it)")

from test_vllm_sides import Instance, blocks_of, free_port, run_until

from kvpush.protocol import (
    Codec,
    HeadSlice,
    Mode,
    Role,
    Route,
    Source,
    StartRead,
    StartWrite,
)
from kvpush.runtime import DataPlane, OpResult, Rank
from kvpush_nixl import NixlTransport
from kvpush_vllm._params import TransferParams

#: The engine's step cadence in these tests, and how long each quiet window is.
STEP, WINDOW = 0.005, 0.4


class CountingTransport:
    """A NixlTransport whose polls are counted (every other call passes through)."""

    def __init__(self, agent: str) -> None:
        self._inner = NixlTransport(agent)
        self._lock = threading.Lock()
        self.polls = 0

    def poll(self) -> Any:
        with self._lock:
            self.polls += 1
        return self._inner.poll()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def polls_over(inst: Instance, transport: CountingTransport, seconds: float) -> int:
    """Step ``inst`` like an engine for ``seconds``; the polls meanwhile."""
    before = transport.polls
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        inst.step()
        time.sleep(STEP)
    return transport.polls - before


def test_a_decode_worker_polls_only_while_a_transfer_is_open() -> None:
    made: list[CountingTransport] = []

    def counting(agent: str) -> CountingTransport:
        made.append(CountingTransport(agent))
        return made[-1]

    prefill = Instance(Role.PRODUCER, 1, port=free_port())
    decode = Instance(Role.CONSUMER, 1, transport=counting)
    (transport,) = made
    try:
        polls_over(decode, transport, 0.1)  # start-up settles
        # Nothing open: not one poll (before, one every 0.2 ms: ~2,000 here).
        idle = polls_over(decode, transport, WINDOW)
        assert idle == 0, f"{idle} polls in {WINDOW} s with no transfer open"

        # A registration whose prefill is still computing: bytes may come.
        peer = prefill.config.engine_id
        params = TransferParams("kvp-quiet", "decode", Mode.PUSH, peer)
        decode.sched.reserve("d-quiet", params, [3, 4], 0)
        waiting = polls_over(decode, transport, WINDOW)
        # Every 0.5 ms at most (a late poll only lowers it); a margin for the
        # 50 us polls right after the metadata's command.
        assert 0 < waiting <= WINDOW / 0.0005 * 1.25 + 40, waiting

        # The KV lands; once the transfer is closed the thread sleeps again.
        prefill_leg = TransferParams("kvp-quiet", "prefill", Mode.PUSH, "decode")
        src = [1, 2]
        for t in prefill.tensors:
            for layer_tensor in t.values():
                layer_tensor.arr[:, src] = 1.5
        assert prefill.sched.kv_ready("p-quiet", prefill_leg, src)
        run_until([prefill, decode], lambda: "d-quiet" in decode.seen.recving)
        assert "d-quiet" not in decode.seen.failed
        assert (blocks_of(decode, 0, [3, 4]) == 1.5).all()
        polls_over(decode, transport, 0.05)  # the closing step and the busy window
        after = polls_over(decode, transport, WINDOW)
        assert after == 0, f"{after} polls in {WINDOW} s after the transfer closed"
    finally:
        prefill.close()
        decode.close()


def test_an_idle_decode_step_ends_when_its_worker_has_the_notice() -> None:
    """A decode that only waits for its KV waits in its empty steps (idle_wait,
    0.5 s here). The push notice lands in the *worker*, which reaches the
    scheduler only with the step's output: the worker rings the scheduler
    side's doorbell, so the wait ends when the notice is in, and the load is
    heard in that step. Before, the step waited out the whole idle_wait."""
    prefill = Instance(Role.PRODUCER, 1, port=free_port())
    decode = Instance(Role.CONSUMER, 1, idle_wait=0.5)
    try:
        peer = prefill.config.engine_id
        decode.sched.reserve(
            "d-bell", TransferParams("kvp-bell", "decode", Mode.PUSH, peer), [5], 0
        )
        run_until([prefill, decode], lambda: bool(decode.sched._sync and decode.sched._key_of))
        time.sleep(0.2)  # the registration is at the prefill; the decode's worker expects
        decode.step()
        assert prefill.sched.kv_ready(
            "p-bell", TransferParams("kvp-bell", "prefill", Mode.PUSH, "decode"), [6]
        )
        stop = threading.Event()

        def prefill_engine() -> None:  # the prefill steps on, in its own process
            while not stop.is_set():
                prefill.step()
                time.sleep(0.002)

        t = threading.Thread(target=prefill_engine, daemon=True)
        t.start()
        try:
            t0 = time.monotonic()
            decode.sched.step(idle=True)  # waits: the notice is not in yet
            waited = time.monotonic() - t0
        finally:
            stop.set()
            t.join(5)
        assert waited < 0.4, f"the idle step waited {waited:.3f} s of its 0.5 s"
        decode.step()  # the workers' output: the load is heard in this step
        assert "d-bell" in decode.seen.recving and "d-bell" not in decode.seen.failed
    finally:
        prefill.close()
        decode.close()


class _IdleTransport:
    """Just enough of a transport for a data plane that posts nothing itself."""

    def register(self, layout: object) -> None:
        pass

    def poll(self) -> tuple[list[object], list[object]]:
        return [], []


def test_an_op_posted_as_the_data_plane_stops_is_reported_failed_once() -> None:
    """``stop()`` lands while the thread posts an op. The thread then leaves
    without polling (it may be sleeping on its queue otherwise), and the op
    is reported failed exactly once: before, the thread handed the op it had
    just posted back to its queue, and ``stop()`` reported it twice (once as
    posted, once as queued)."""
    reported: list[Any] = []
    dp = DataPlane(Role.PRODUCER, {0: Rank(_IdleTransport(), None)}, 1, Codec())  # type: ignore[arg-type]
    dp.bind(reported.extend)
    posting, release = threading.Event(), threading.Event()

    def post(action: StartWrite | StartRead) -> None:
        dp._posted[(0, 1)] = (action, 0.0, 0.0, 0.0)  # posted: the transport has it
        posting.set()
        release.wait(5)

    dp._post = post  # type: ignore[method-assign]
    dp.start()
    route = Route(Source(0), 0, HeadSlice(0, 1))
    op = StartWrite("kvp-stop", 1, "decode", route, ((1,),), ((2,),), float("inf"), None)
    dp.submit(op)
    assert posting.wait(5)
    stopper = threading.Thread(target=dp.stop)
    stopper.start()
    while not dp._stop.is_set():
        time.sleep(0.001)
    release.set()  # the post returns with stop() under way
    stopper.join(5)
    assert [r.action for r in reported if isinstance(r, OpResult)] == [op]
    assert reported[0].error == "data plane stopped"
