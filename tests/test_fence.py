"""The GPU ordering rule, on CPU with a fake stream that completes late (issue 26 item 3).

A GPU forward only queues the kernels that write a step's KV; vLLM calls
``wait_for_save`` before they have run. The worker records an event there
(:func:`kvpush_vllm._worker._stream_event`) and every write submitted after it is
posted by the data-plane thread only once the event reports done, polled without
blocking; the forward's thread never synchronizes. Here the "stream" is a counter
the test advances, and its events are :class:`kvpush.runtime.Fence` objects.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvpush.protocol import Cancel, Codec, HeadSlice, Role, Route, Source, StartRead, StartWrite
from kvpush.runtime import DataPlane, OpResult, Rank
from kvpush_vllm import _worker
from kvpush_vllm._worker import WorkerSide

ROUTE = Route(Source(0), 0, HeadSlice(0, 1))


class LateStream:
    """A stream whose kernels finish only when the test says so, in order."""

    def __init__(self) -> None:
        self.queued = 0
        self.finished = 0

    def record(self) -> Event:
        self.queued += 1
        return Event(self, self.queued)

    def run(self, n: int = 1) -> None:
        self.finished = min(self.queued, self.finished + n)


class Event:
    def __init__(self, stream: LateStream, seq: int) -> None:
        self.stream, self.seq = stream, seq
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.stream.finished >= self.seq


class _Idle:
    def register(self, layout: object) -> None:
        pass

    def poll(self) -> tuple[list[object], list[object]]:
        return [], []


def write(tid: str, not_after: float = float("inf")) -> StartWrite:
    return StartWrite(tid, 1, "decode", ROUTE, ((1,),), ((2,),), not_after, None)


@pytest.fixture
def dataplane() -> Any:
    """A data plane whose posts are recorded (with the time) instead of sent."""
    reported: list[Any] = []
    posted: list[tuple[str, float]] = []
    dp = DataPlane(Role.PRODUCER, {0: Rank(_Idle(), None)}, 1, Codec())  # type: ignore[arg-type]
    dp.bind(reported.extend)

    def post(action: StartWrite | StartRead) -> None:
        posted.append((action.transfer_id, time.monotonic()))

    dp._post = post  # type: ignore[method-assign]
    dp.start()
    yield dp, posted, reported
    dp.stop()


def wait_for(cond: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def test_a_write_is_posted_only_after_the_forward_that_computes_its_source(dataplane: Any) -> None:
    dp, posted, reported = dataplane
    stream = LateStream()
    first, second = stream.record(), stream.record()
    dp.submit(write("a"), first)
    dp.submit(write("b"), second)
    dp.submit(write("c"))  # no fence: a CPU write, posted at once
    wait_for(lambda: [t for t, _ in posted] == ["c"])
    wait_for(lambda: first.queries > 10)  # the thread polls the event, without blocking
    assert [t for t, _ in posted] == ["c"]
    stream.run()
    wait_for(lambda: len(posted) == 2)
    time.sleep(0.02)
    assert [t for t, _ in posted] == ["c", "a"]  # b's kernels still run
    stream.run()
    wait_for(lambda: len(posted) == 3)
    assert [t for t, _ in posted] == ["c", "a", "b"] and reported == []


def test_a_fence_that_never_completes_fails_the_write_at_its_lease(dataplane: Any) -> None:
    dp, posted, reported = dataplane
    dp.submit(write("hung", time.monotonic() + 0.05), LateStream().record())
    wait_for(lambda: reported)
    (result,) = reported
    assert isinstance(result, OpResult) and result.action.transfer_id == "hung"
    assert result.error is not None and "waiting for the forward" in result.error
    assert posted == [] and dp.failed_posts == 1


def test_stop_reports_a_write_still_waiting_for_its_fence_once() -> None:
    reported: list[Any] = []
    dp = DataPlane(Role.PRODUCER, {0: Rank(_Idle(), None)}, 1, Codec())  # type: ignore[arg-type]
    dp.bind(reported.extend)
    dp.start()
    event = LateStream().record()
    dp.submit(write("w"), event)
    wait_for(lambda: event.queries > 0)
    dp.stop()
    assert [(r.action.transfer_id, r.error) for r in reported] == [("w", "data plane stopped")]


class _Recorder:
    """Stands in for the worker's data plane: what was submitted, after what."""

    def __init__(self) -> None:
        self.submitted: list[tuple[str, object]] = []

    def expect(self, expecting: bool) -> None:
        pass

    def add_peer(self, peer: object) -> None:
        pass

    def submit(self, action: StartWrite | StartRead, after: object = None) -> None:
        self.submitted.append((action.transfer_id, after))


def test_the_worker_fences_writes_on_the_event_recorded_where_the_forward_was_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``computed`` (vLLM's ``wait_for_save``) records an event on the forward's
    stream and returns at once (the old code synchronized the stream there);
    writes submitted after it wait for the latest event, reads never do."""
    stream = LateStream()
    monkeypatch.setattr(_worker, "_stream_event", stream.record)
    worker = WorkerSide(Role.PRODUCER, 0, 1, Codec(), _Idle())  # type: ignore[arg-type]
    dp = _Recorder()
    worker._dataplane = dp  # type: ignore[assignment]
    worker._cuda = True
    worker.step([write("before")], [], True)
    worker.computed([("req", 16)])  # returns: nothing waits on the forward's thread
    worker.step([write("w1")], [], True)
    worker.computed([])
    read = StartRead("r", 1, "prefill", ROUTE, ((1,),), ((2,),), float("inf"))
    worker.step([write("w2"), read], [], True)
    (_, none), (_, e1), (_, e2), (_, r) = dp.submitted
    assert none is None and r is None
    assert isinstance(e1, Event) and isinstance(e2, Event) and (e1.seq, e2.seq) == (1, 2)
    assert stream.finished == 0 and worker.take_computed() == [(0, "req", 16)]


# --- the core's Cancel (issue 28) ------------------------------------------------


def test_a_cancel_drops_a_write_still_waiting_for_its_fence(dataplane: Any) -> None:
    """Past its bound and never posted (its forward never finished): dropped,
    and reported failed, since nothing of it ever moved."""
    dp, posted, reported = dataplane
    stream = LateStream()
    dp.submit(write("a"), stream.record())
    dp.cancel(Cancel("a", 1, "decode", Source(0), 0))
    wait_for(lambda: len(reported) == 1)
    (result,) = reported
    assert isinstance(result, OpResult) and result.error == "cancelled before it was posted"
    stream.run()
    time.sleep(0.02)
    assert posted == []  # never posted after the cancel


class _Stuck(_Idle):
    """A transport whose posted ops never report on their own."""

    def __init__(self, confirms: bool) -> None:
        self.confirms = confirms
        self.cancelled: list[int] = []

    def cancel(self, handle: int) -> bool:
        self.cancelled.append(handle)
        return self.confirms


@pytest.mark.parametrize("confirms", [True, False])
def test_a_cancel_of_a_posted_op_goes_to_its_transport(confirms: bool) -> None:
    """The data plane never reports a posted op failed on its own: it asks the
    transport, whose poll reports the op; one that cannot confirm leaves it
    posted (counted, logged)."""
    t = _Stuck(confirms)
    dp = DataPlane(Role.PRODUCER, {0: Rank(t, None)}, 1, Codec())  # type: ignore[arg-type]
    results: list[Any] = []
    dp._posted[(0, 7)] = (write("a"), 0.0, 0.0, 0.0)
    dp._cancel(Cancel("b", 1, "decode", Source(0), 0), results)  # another op: untouched
    assert t.cancelled == [] and dp.cancels == 0
    dp._cancel(Cancel("a", 1, "decode", Source(0), 0), results)
    assert t.cancelled == [7] and dp.cancels == 1
    assert results == []  # the transport's poll reports it, not a guess here
    assert dp.cancels_unconfirmed == (0 if confirms else 1)
    assert (0, 7) in dp._posted
