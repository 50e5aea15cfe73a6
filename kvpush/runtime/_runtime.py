"""The pump: one per endpoint, after aioquic's asyncio adapter; it makes no
protocol decision itself (docs/runtime.md, "Pieces"). ``now`` is
:func:`time.monotonic`, the clock of the data plane's ``not_after`` checks.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import queue
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar

import anyio
import msgpack
from anyio.from_thread import BlockingPortal, start_blocking_portal

from kvpush.protocol import (
    Cancel,
    ConfigError,
    Consumer,
    ControlMessage,
    Event,
    Hello,
    KVLayout,
    KvpushError,
    Mode,
    PeerReady,
    PeerState,
    Producer,
    Ready,
    Refused,
    Released,
    RemoteProtocolError,
    Reserved,
    Send,
    StartRead,
    StartWrite,
)

from ._channel_types import PeerConnected, PeerLost, Received
from ._dataplane import NoticeIn, OpResult, PeerRanks, Result

__all__ = (
    "ChannelLike",
    "ConsumerRuntime",
    "DataPlaneLike",
    "EndpointRuntime",
    "ProducerRuntime",
    "SyncRuntime",
    "decode_rank",
    "encode_rank",
)

log = logging.getLogger("kvpush.runtime")

E = TypeVar("E", Producer, Consumer)
T = TypeVar("T")


class ChannelLike(Protocol):
    """What the pump needs of the control channel."""

    def send_nowait(self, peer: str, message: ControlMessage) -> None: ...
    def events(self) -> AsyncIterator[object]: ...


class DataPlaneLike(Protocol):
    """What the pump needs of a data plane: :class:`DataPlane`, or a stand-in
    that carries the actions to where the memory is (the vLLM connector's
    scheduler side hands them to its worker processes)."""

    error: BaseException | None

    def bind(self, on_results: Callable[[list[Result]], None]) -> None: ...
    def start(self) -> None: ...
    def stop(self, timeout: float = 5.0) -> None: ...
    def submit(self, action: StartWrite | StartRead) -> None: ...
    def cancel(self, cancel: Cancel) -> None: ...
    def add_peer(self, peer: PeerRanks) -> None: ...
    def stage_need(self, blocks: list[list[int]]) -> int: ...
    def stage(
        self, transfer_id: str, epoch: int, blocks: list[list[int]], slot: tuple[int, ...]
    ) -> None: ...
    def unstage(self, transfer_id: str, epoch: int) -> None: ...


def encode_rank(metadata: bytes, layout: KVLayout) -> bytes:
    """One rank's data-plane description for :attr:`Hello.ranks`."""
    packed: bytes = msgpack.packb({"md": metadata, "layout": layout.to_wire()})
    return packed


def decode_rank(blob: bytes) -> tuple[bytes, KVLayout]:
    """Inverse of :func:`encode_rank`; :class:`RemoteProtocolError` if malformed."""
    try:
        obj = msgpack.unpackb(blob, max_map_len=4096, max_array_len=8192, max_str_len=4096)
    except Exception as exc:  # msgpack raises several types
        raise RemoteProtocolError(f"malformed rank description: {exc}") from None
    if not isinstance(obj, dict) or set(obj) != {"md", "layout"} or type(obj["md"]) is not bytes:
        raise RemoteProtocolError("rank description must be {md: bytes, layout: {...}}")
    return obj["md"], KVLayout.from_wire(obj["layout"])


class _Wakeup:
    """Wakes the event loop from another thread without waiting for it: a
    self-pipe (backend-neutral), at most one byte in flight. The waker queues
    its item, then writes a byte unless one is pending; the loop reads the
    bytes, clears ``pending`` and only then drains the queue, so no item is
    ever left behind with no byte."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._pending = False

    def set(self) -> None:
        """Any thread: make the next (or current) :meth:`wait` return."""
        if not self._pending:
            self._pending = True
            # Full buffer: a byte is already there. Closed: the loop is gone.
            with contextlib.suppress(OSError):
                self._w.send(b"\0")

    async def wait(self) -> None:
        """The loop's thread: wait for :meth:`set`; the caller drains after."""
        await anyio.wait_readable(self._r)
        with contextlib.suppress(BlockingIOError):
            self._r.recv(4096)
        self._pending = False

    def close(self) -> None:
        self._r.close()
        self._w.close()


class StallWatch:
    """Reports each gap of more than ``limit`` in this process's running to
    the core (``on_stall(now, gap)``: the endpoint's ``stalled()``; docs/runtime.md,
    "Stalls"). A ticker beats every ``limit / 5``; the pump also calls
    :meth:`check` before it feeds each frame, so a frame read during a gap
    comes after its report. ``dropped``: frames the core dropped for a stall."""

    def __init__(
        self, limit: float, clock: Callable[[], float], on_stall: Callable[[float, float], None]
    ) -> None:
        self.limit = limit
        self._clock = clock
        self._on_stall = on_stall
        self.beat = clock()
        #: When the last stall was noticed (``-inf``: never).
        self.gap_ended = -math.inf
        self.stalls = 0
        self.dropped = 0

    async def run(self) -> None:
        while True:
            await anyio.sleep(self.limit / 5)
            self.check()

    def check(self) -> None:
        now = self._clock()
        gap = now - self.beat
        self.beat = now
        if gap > self.limit:
            self.stalls += 1
            self.gap_ended = now
            log.warning("this process did not run for %.3f s (stall limit %g s)", gap, self.limit)
            self._on_stall(now, gap)


def _check_transit_budget(channel: object, stall_limit: float, max_transit: float) -> None:
    """Raise :class:`ConfigError` unless the channel's ``max_age`` and
    ``stall_limit`` are each at most ``max_transit / 2``: one side's
    ``max_age`` and the *other* side's ``stall_limit`` add up (docs/runtime.md,
    "The transit budget"). A channel without ``max_age`` is not checked."""
    max_age = getattr(channel, "max_age", None)
    half = max_transit / 2
    if isinstance(max_age, (int, float)) and (max_age > half or stall_limit > half):
        raise ConfigError(
            f"the control channel's max_age ({max_age:g} s) and stall_limit ({stall_limit:g} s) "
            f"must each be at most half the endpoint's Timing.max_transit ({max_transit:g} s): "
            "a frame's age in one side's queue and the other side's stall add up"
        )


class EndpointRuntime(Generic[E]):
    """Runs one core endpoint on anyio. Call :meth:`run` in a task group;
    feed inputs through the role's methods, from any thread: such a call runs
    and drains the core on the caller's thread under :attr:`lock`, and only
    its control frames wait for the loop (docs/runtime.md, "How the pump
    keeps time and wakes up").

    ``stall_limit`` (default ``timing.max_transit / 2``) and the channel's
    ``max_age`` share the endpoint's ``max_transit``: either over its half
    raises :class:`ConfigError`."""

    def __init__(
        self,
        endpoint: E,
        channel: ChannelLike,
        dataplane: DataPlaneLike | None = None,
        *,
        on_event: Callable[[Event], None] | None = None,
        stall_limit: float | None = None,
    ) -> None:
        max_transit = endpoint.config.timing.max_transit
        limit = max_transit / 2 if stall_limit is None else stall_limit
        if not limit > 0:
            raise KvpushError(f"stall_limit must be > 0 seconds, got {stall_limit!r}")
        _check_transit_budget(channel, limit, max_transit)
        self.endpoint: E = endpoint
        self.channel = channel
        self.dataplane = dataplane
        self._on_event = on_event
        self._events: collections.deque[Event] = collections.deque()
        self._have_events = anyio.Event()
        #: Held around every use of the endpoint (see the class docs).
        self.lock = threading.RLock()
        #: Set while an event waits (:meth:`wait_events`, any thread).
        self._events_waiting = threading.Event()
        self._loop_thread: int | None = None
        #: The loop thread's OS id (``threading.get_native_id``), once it runs.
        self.native_id: int | None = None
        #: Frames the core emitted, in order, for the loop to hand the channel.
        self._sends: collections.deque[Send] = collections.deque()
        #: Tasks waiting in :meth:`next_events`.
        self._async_waiters = 0
        self._rearm = anyio.Event()
        self._armed = math.inf  # the deadline the timer task sleeps towards
        self.timer_wakeups = 0
        self._results: queue.SimpleQueue[list[Result]] = queue.SimpleQueue()
        self._wakeup: _Wakeup | None = None  # open while run() runs
        self.frames_dropped = 0
        self.bad_hellos = 0
        self.watch = StallWatch(limit, self.now, self._stalled)
        if dataplane is not None:
            dataplane.bind(self.post_results)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Pump until cancelled."""
        self._loop_thread = threading.get_ident()
        self.native_id = threading.get_native_id()
        with contextlib.closing(_Wakeup()) as wakeup:
            self._wakeup = wakeup
            wakeup.set()  # results (and core calls) queued before we ran
            if self.dataplane is not None:
                self.dataplane.start()
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._channel_loop)
                    tg.start_soon(self._timer_loop)
                    tg.start_soon(self._results_loop)
                    tg.start_soon(self.watch.run)
                    self.kick()
                    task_status.started()
            finally:
                self._wakeup = None
                if self.dataplane is not None:
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(self.dataplane.stop)
                    self._feed_results()

    def now(self) -> float:
        return time.monotonic()

    def _stalled(self, now: float, gap: float) -> None:
        with self.lock:
            self.endpoint.stalled(now, gap)

    def kick(self) -> None:
        """After any input: drain the endpoint's outputs; wake the timer task
        only for an earlier deadline, and off the loop's thread wake the loop
        only if it has work (a wake-up for nothing costs a GIL handoff)."""
        with self.lock:
            self._drain()
            deadline = self.endpoint.next_deadline()
            work = bool(self._sends) or (self._events and self._async_waiters > 0)
        if threading.get_ident() != self._loop_thread:
            wakeup = self._wakeup
            earlier = deadline is not None and deadline < self._armed
            if wakeup is not None and (work or earlier):  # not running: run() kicks
                wakeup.set()
            return
        self._flush()
        if deadline is not None and deadline < self._armed:
            self._armed = deadline
            self._rearm.set()

    def _drain(self) -> None:
        """The core's outputs (under :attr:`lock`, any thread): frames queued
        for the loop, transfers to the data plane, events to the queue."""
        for out in self.endpoint.drain():
            if isinstance(out, Send):
                if isinstance(out.message, Hello):
                    self._hello_sent(out.peer)
                self._sends.append(out)
            elif isinstance(out, (StartWrite, StartRead)):
                if self.dataplane is None:
                    raise KvpushError("a transfer was planned but there is no data plane")
                self.dataplane.submit(out)
            elif isinstance(out, Cancel):
                if self.dataplane is not None:
                    self.dataplane.cancel(out)
            else:
                self._event(out)

    def _event(self, event: Event) -> None:
        dp = self.dataplane
        if isinstance(event, PeerReady) and dp is not None:
            hello = self.endpoint.peer(event.peer).hello
            assert hello is not None
            ranks = {i: decode_rank(blob) for i, blob in enumerate(hello.ranks)}
            dp.add_peer(PeerRanks(event.peer, ranks, hello.tp))
        if isinstance(event, (Ready, Released)) and dp is not None:
            # Before anyone hears of it: no scatter into its blocks after.
            dp.unstage(event.transfer_id, event.epoch)
        self._events.append(event)
        if self._on_event is not None:
            self._on_event(event)
        self._events_waiting.set()

    def _flush(self) -> None:
        """The loop's thread: hand the queued frames to the channel, in order."""
        while self._sends:
            out = self._sends.popleft()
            try:
                self.channel.send_nowait(out.peer, out.message)
            except KvpushError as exc:
                # A lost frame is something the protocol already survives.
                self.frames_dropped += 1
                log.warning("dropped %s to %s: %s", type(out.message).__name__, out.peer, exc)
        if self._events:
            self._have_events.set()

    def _hello_sent(self, peer: str) -> None:
        """Log a hello the core sends again (``stats()`` counts them)."""
        attempts = self.endpoint.peer(peer).attempts
        if attempts > 1:
            log.warning(
                "handshake with %s unanswered: hello sent again (attempt %d)", peer, attempts
            )

    def _usable(self, peer: str, hello: Hello) -> bool:
        """Whether a hello's rank descriptions decode (one whose do not is
        dropped before the core sees it: docs/runtime.md, "Trust")."""
        try:
            for blob in hello.ranks:
                decode_rank(blob)
        except KvpushError as exc:
            self.bad_hellos += 1
            log.warning("dropped a hello from %s: %s", peer, exc)
            return False
        return True

    def events_nowait(self) -> list[Event]:
        """Every event so far, oldest first (and forget them); any thread. A
        :class:`Ready` comes with its timeline's ``delivered`` set to now: the
        moment its caller got it."""
        with self.lock:
            out = list(self._events)
            self._events.clear()
            self._events_waiting.clear()
        now = None
        for i, ev in enumerate(out):
            if isinstance(ev, Ready):
                now = self.now() if now is None else now
                out[i] = dataclasses.replace(ev, timeline=ev.timeline._replace(delivered=now))
        return out

    async def next_events(self, timeout: float) -> list[Event]:
        """Wait up to ``timeout`` seconds for at least one event."""
        self._async_waiters += 1
        try:
            with anyio.move_on_after(timeout):
                while not self._events:
                    self._have_events = anyio.Event()
                    await self._have_events.wait()
        finally:
            self._async_waiters -= 1
        return self.events_nowait()

    def wait_events(self, timeout: float) -> list[Event]:
        """Another thread's :meth:`next_events`: block it (not the loop) up to
        ``timeout`` seconds for at least one event."""
        self._events_waiting.wait(timeout)
        return self.events_nowait()

    async def _channel_loop(self) -> None:
        async for ev in self.channel.events():
            if isinstance(ev, Received):
                self._received(ev)
            elif isinstance(ev, PeerLost):
                self._input(self.endpoint.peer_lost, ev.peer)
            elif isinstance(ev, PeerConnected):
                self._input(self.endpoint.connection_up, ev.peer)
            # else Garbage: the channel counted and logged it

    def _received(self, ev: Received) -> None:
        self.watch.check()  # a gap ending now reaches the core first
        msg = ev.message
        if isinstance(msg, Hello) and not self._usable(ev.peer, msg):
            return
        with self.lock:
            before = self.endpoint.stall_dropped
            self.endpoint.receive(self.now(), ev.peer, msg)
            dropped = self.endpoint.stall_dropped != before
        if dropped:  # the core's stall rule
            self.watch.dropped += 1
            log.warning(
                "dropped %s of %s epoch %d from %s: this process was stalled, the "
                "frame may be older than its lease (max_transit)",
                type(msg).__name__,
                getattr(msg, "transfer_id", "?"),
                getattr(msg, "epoch", -1),
                ev.peer,
            )
        self.kick()

    async def _timer_loop(self) -> None:
        while True:
            with self.lock:
                deadline = self.endpoint.next_deadline()
            self._armed = math.inf if deadline is None else deadline
            self._rearm = anyio.Event()
            with anyio.move_on_after(max(0.0, self._armed - self.now())):
                await self._rearm.wait()
            self.timer_wakeups += 1
            with self.lock:
                self.endpoint.handle_timer(self.now())
                self._drain()  # not kick(): the loop re-reads the deadline itself
            self._flush()

    async def _results_loop(self) -> None:
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._feed_results()
            if self.dataplane is not None and self.dataplane.error is not None:
                raise KvpushError("the data-plane thread failed") from self.dataplane.error

    def feed(self, results: list[Result]) -> None:
        """Feed data-plane results into the core now, on the caller's thread
        (a stand-in data plane whose results reach its owner's thread, like
        the vLLM connector's workers at the end of an engine step)."""
        self._feed_batch(results)
        self.kick()

    def post_results(self, results: list[Result]) -> None:
        """Called from the data-plane thread: queue results, wake the loop.
        Never waits for the loop (the data plane keeps polling meanwhile)."""
        self._results.put(results)
        wakeup = self._wakeup
        if wakeup is not None:
            wakeup.set()

    def _feed_results(self) -> None:
        while True:
            try:
                batch = self._results.get_nowait()
            except queue.Empty:
                break
            self._feed_batch(batch)
        self.kick()

    def _feed_batch(self, results: list[Result]) -> None:
        with self.lock:
            now = self.now()
            for r in results:
                self._feed_one(now, r)

    def _feed_one(self, now: float, r: Result) -> None:
        raise NotImplementedError

    def _input(self, method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call a role method of the endpoint (``now`` first) under the lock, then kick."""
        with self.lock:
            result = method(self.now(), *args, **kwargs)
        self.kick()
        return result

    def abort(self, transfer_id: str) -> bool:
        return self._input(self.endpoint.abort, transfer_id)


class ProducerRuntime(EndpointRuntime[Producer]):
    """A producer endpoint on anyio."""

    def kv_ready(self, transfer_id: str, blocks: list[list[int]], *, final: bool = True) -> None:
        """``final=False``: an increment (progressive push, see ``Producer.kv_ready``)."""
        self._input(self.endpoint.kv_ready, transfer_id, blocks, final=final)

    def _feed_one(self, now: float, r: Result) -> None:
        if isinstance(r, OpResult) and isinstance(r.action, StartWrite):
            a = r.action
            src, rank = a.route.source, a.route.consumer_rank
            if r.error is None:
                self.endpoint.write_done(now, a.transfer_id, a.epoch, src, rank, stamps=r.stamps)
            else:
                self.endpoint.write_failed(now, a.transfer_id, a.epoch, src, rank, r.error)


class ConsumerRuntime(EndpointRuntime[Consumer]):
    """A consumer endpoint on anyio."""

    def connect(self, peer: str) -> None:
        self._input(self.endpoint.connect, peer)

    def reserve(
        self,
        transfer_id: str,
        peer: str,
        blocks: list[list[int]],
        *,
        mode: Mode = Mode.PUSH,
        skip_tokens: int = 0,
    ) -> Reserved | Refused:
        """Reserve ``blocks`` (``Consumer.reserve``); a push reservation takes a
        staging slot when the data plane stages and the pool has room."""
        dp = self.dataplane
        need = dp.stage_need(blocks) if dp is not None and mode is Mode.PUSH else 0
        with self.lock:
            result = self.endpoint.reserve(
                self.now(),
                transfer_id,
                peer,
                blocks,
                mode=mode,
                skip_tokens=skip_tokens,
                stage_bytes=need,
            )
            if isinstance(result, Reserved) and result.stage and dp is not None:
                # Under the lock, before kick() lets the registration out.
                dp.stage(transfer_id, result.epoch, blocks, result.stage)
        self.kick()
        return result

    def preempt(self, transfer_id: str) -> bool:
        return self._input(self.endpoint.preempt, transfer_id)

    def keep(self, transfer_id: str, peer: str) -> bool:
        """Ask producer ``peer`` to keep the ready KV of ``transfer_id``
        (:meth:`Consumer.keep`). With no handshake yet, starts one and returns
        False: the next call can be sent."""
        with self.lock:
            now = self.now()
            if self.endpoint.peer(peer).state is PeerState.DISCONNECTED:
                self.endpoint.connect(now, peer)
            sent = self.endpoint.keep(now, transfer_id, peer)
        self.kick()
        return sent

    def decline(self, transfer_id: str, peer: str) -> bool:
        """Tell producer ``peer`` to release the ready KV of ``transfer_id`` now
        (:meth:`Consumer.decline`); False, nothing sent, without a handshake."""
        return self._input(self.endpoint.decline, transfer_id, peer)

    def peer_gone(self, peer: str) -> int:
        """The caller knows producer ``peer``'s process is gone
        (:meth:`Consumer.peer_gone`)."""
        return self._input(self.endpoint.peer_gone, peer)

    def _feed_one(self, now: float, r: Result) -> None:
        if isinstance(r, NoticeIn):
            self.endpoint.completion_received(now, r.peer, r.notice, seen=r.seen)
        elif isinstance(r.action, StartRead):
            a = r.action
            src, rank, ok = a.route.source, a.route.consumer_rank, r.error is None
            self.endpoint.read_done(
                now, a.transfer_id, a.epoch, src, rank, ok, stamps=r.stamps if ok else None
            )


R = TypeVar("R", bound=EndpointRuntime[Any])
#: Seconds the runtime may take to start (once built), and to stop.
_START_TIMEOUT = 10.0


class SyncRuntime(Generic[R]):
    """Owns a background event loop (anyio's blocking portal) that runs one
    :class:`EndpointRuntime`, for engines that run their own loops (vLLM's
    scheduler and workers). Only :meth:`call` waits for the loop
    (docs/runtime.md, "Pieces").

    ``setup`` is a coroutine function run on the loop that builds the runtime
    (and enters whatever it needs, e.g. a channel) inside ``stack``.
    """

    def __init__(
        self, setup: Callable[[contextlib.AsyncExitStack], Coroutine[Any, Any, R]]
    ) -> None:
        self._cm = start_blocking_portal()
        self._portal: BlockingPortal = self._cm.__enter__()
        self._stop: anyio.Event | None = None
        try:
            self._future, runtime = self._portal.start_task(self._serve, setup)
        except BaseException:
            self._cm.__exit__(None, None, None)
            raise
        self.runtime: R = runtime
        self._closed = False
        #: Calls that waited for the loop's thread (:meth:`call`).
        self.round_trips = 0

    async def _serve(
        self,
        setup: Callable[[contextlib.AsyncExitStack], Coroutine[Any, Any, R]],
        *,
        task_status: anyio.abc.TaskStatus[R],
    ) -> None:
        """One task owns everything the runtime entered, from start to stop."""
        async with contextlib.AsyncExitStack() as stack:
            # No timeout scope around setup: it enters contexts (task groups)
            # that must outlive it.
            runtime = await setup(stack)
            async with anyio.create_task_group() as tg:
                with anyio.fail_after(_START_TIMEOUT):
                    await tg.start(runtime.run)
                self._stop = anyio.Event()
                task_status.started(runtime)
                await self._stop.wait()
                tg.cancel_scope.cancel()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop (e.g. ``runtime.reserve``) and return
        its result. Events it causes wait in the queue for :meth:`events`."""
        if self._closed:
            raise KvpushError("the runtime is closed")
        self.round_trips += 1
        return self._portal.call(fn, *args)

    def events(self) -> list[Event]:
        """:meth:`EndpointRuntime.events_nowait` (no hop onto the loop)."""
        return self.runtime.events_nowait()

    def wait_events(self, timeout: float) -> list[Event]:
        """:meth:`EndpointRuntime.wait_events` (the loop goes on meanwhile)."""
        if self._closed:
            raise KvpushError("the runtime is closed")
        return self.runtime.wait_events(timeout)

    def close(self) -> None:
        """Stop the runtime and the loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._stop is not None:
                self._portal.call(self._stop.set)
            self._future.result(_START_TIMEOUT)
        finally:
            self._cm.__exit__(None, None, None)

    def __enter__(self) -> SyncRuntime[R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
