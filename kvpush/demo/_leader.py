"""What the two leader processes share: setup, the pipes, the event loop.

A leader builds its side's runtime: a :class:`ControlChannel` on 127.0.0.1
(HMAC codec, the run's secret), the endpoint's pump and a :class:`DataPlane`
whose ranks are the instance's rank segments, attached here: the rank
processes own the memory, the leader's data-plane thread moves the bytes.
With ``--transport memory`` each rank is a ``ShmTransport(create=False,
name=...)`` (addresses are offsets into the segment); with ``--transport
nixl`` the leader maps the segment (:class:`~kvpush.shm.Segment`), registers
it with one NIXL transport (one NIXL agent) per rank, found in the
``kvpush.transports`` registry (:func:`~kvpush.runtime.transport_kind`: the
demo never imports ``kvpush_nixl``), and the layouts it announces carry the
mapping's real addresses. Supervisor commands arrive over a
pipe, read by a thread that hands them to the event loop; a closed pipe means
the supervisor died, and the leader exits. SIGTERM cancels everything cleanly.
Work on the KV itself (fill, check) goes to the rank processes through a
:class:`RankClient` each, every call bounded by a timeout.
"""

from __future__ import annotations

import contextlib
import math
import random
import secrets
import signal
import sys
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectSendStream

from kvpush.protocol import Codec, Event, Identity, KVLayout, Mode, Role, Timeline, Timing
from kvpush.runtime import (
    ControlChannel,
    DataPlane,
    EndpointMetrics,
    EndpointRuntime,
    Rank,
    Transport,
    encode_rank,
    transport_kind,
)
from kvpush.shm import Segment, ShmTransport

from ._model import DemoError, SideGeometry
from ._pattern import request_seed
from ._wire import Check, Dispatch, Fill, Finish, LeaderUp, OpsSummary, RankReply, Stats, Stop

__all__ = (
    "BlockPool",
    "Leader",
    "LeaderSpec",
    "RankClient",
    "last_write_done",
    "leader_channel",
    "ops_summary",
)

#: Each (writer, target) notice mailbox: thousands of notices, little memory.
_MAILBOX_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class LeaderSpec:
    """Everything a leader process needs (pickled to it)."""

    role: Role
    #: Engine id and channel name of this instance.
    name: str
    geometry: SideGeometry
    #: The rank processes' segment names, rank order.
    segments: tuple[str, ...]
    secret: bytes
    mode: Mode
    compute_us_per_token: float
    seed: int
    #: Longest wait for a rank's answer.
    rank_timeout: float
    #: Serve Prometheus metrics on 127.0.0.1 at this port (None: off).
    metrics_port: int | None = None
    #: "memory" (ShmTransport) or "nixl" (NixlTransport over the same segments).
    transport: str = "memory"
    #: The endpoint's timing bounds; its channel's ``max_age`` is derived from them.
    timing: Timing = field(default_factory=Timing)
    #: Prefill: progressive push in chunks of this many tokens (0: one kv_ready).
    chunk_tokens: int = 0
    #: Memory transport: each rank's link modelled at this rate (None: memory speed).
    link_gbps: float | None = None


def leader_channel(spec: LeaderSpec, codec: Codec) -> ControlChannel:
    """The leader's control channel: frames older than half the endpoint's
    ``max_transit`` are dropped (the pump's default ``stall_limit`` is the
    other half; docs/runtime.md, "The transit budget")."""
    return ControlChannel(spec.name, codec, max_age=spec.timing.max_transit / 2)


class BlockPool:
    """Free block ids, shuffled once so that requests get fragmented blocks."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self._free = list(range(num_blocks))
        random.Random(seed).shuffle(self._free)
        self._size = num_blocks

    def take(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        taken = self._free[-n:]
        del self._free[-n:]
        return taken

    def give(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)

    @property
    def outstanding(self) -> int:
        return self._size - len(self._free)


class _ParentGone:
    """The supervisor's end of the pipe closed."""


def last_write_done(timeline: Timeline) -> float | None:
    """When the last rank pair's data landed (``None``: none did)."""
    return max((t for _, t in timeline.write_done), default=None)


def ops_summary(timeline: Timeline) -> OpsSummary | None:
    """The data plane's stamps of the timeline's ops (``None``: none)."""
    stamps = [st for _, st in timeline.ops]
    if not stamps:
        return None
    return OpsSummary(
        max(st.planned for st in stamps),
        max(st.planned - st.plan_started for st in stamps),
        max(st.posted - st.planned for st in stamps),
        max(st.done for st in stamps),
    )


class _Call:
    __slots__ = ("done", "reply")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.reply: RankReply | None = None


class RankClient:
    """Calls to one rank process. The rank answers one call at a time, in
    order, so replies match the oldest pending call; a reader thread hands
    each to the event loop."""

    def __init__(self, label: str, conn: Connection, timeout: float) -> None:
        self.label = label
        self._conn = conn
        self._timeout = timeout
        self._pending: deque[_Call] = deque()
        self._lock = threading.Lock()
        self._gone = False

    def start(self, token: Any) -> None:
        threading.Thread(target=self._read, args=(token,), name=self.label, daemon=True).start()

    async def call(self, msg: Fill | Check) -> RankReply:
        """Send ``msg`` (event-loop thread) and wait for the answer."""
        call = _Call()
        with self._lock:
            if self._gone:
                raise DemoError(f"{self.label} is gone")
            self._pending.append(call)
            self._conn.send(msg)
        try:
            with anyio.fail_after(self._timeout):
                await call.done.wait()
        except TimeoutError:
            raise DemoError(f"{self.label} did not answer in {self._timeout:.0f} s") from None
        if call.reply is None:
            raise DemoError(f"{self.label} is gone")
        return call.reply

    def _read(self, token: Any) -> None:
        while True:
            try:
                reply: RankReply | None = self._conn.recv()
            except (EOFError, OSError):
                reply = None
            with self._lock:
                if reply is None:
                    self._gone = True
                    calls = list(self._pending)
                    self._pending.clear()
                else:
                    calls = [self._pending.popleft()] if self._pending else []
            for call in calls:
                call.reply = reply
                with contextlib.suppress(RuntimeError):  # the loop is gone
                    anyio.from_thread.run_sync(call.done.set, token=token)
            if reply is None:
                return


class Leader:
    """What both sides share: setup, the command pipe, the event loop."""

    def __init__(
        self, spec: LeaderSpec, rank_conns: Sequence[Connection], conn: Connection
    ) -> None:
        self.spec = spec
        self.conn = conn
        self.ranks = [
            RankClient(f"{spec.name} rank {r}", c, spec.rank_timeout)
            for r, c in enumerate(rank_conns)
        ]
        geo = spec.geometry
        self.layouts: list[KVLayout] = [geo.layout(r) for r in range(geo.tp)]
        self.transports: list[Transport] = []
        self.pool = BlockPool(geo.num_blocks, spec.seed * 2 + (spec.role is Role.PRODUCER))
        self.blocks: dict[str, list[int]] = {}
        self.channel: ControlChannel | None = None

        # --- to override ---------------------------------------------------------------
        self.metrics: EndpointMetrics | None = None
        self.caller_reserve: list[float] = []
        self.caller_ready: list[float] = []
        #: The running runtime and task group, once :meth:`serve` has both.
        self._live: tuple[EndpointRuntime[Any], anyio.abc.TaskGroup] | None = None

    def make_runtime(
        self, identity: Identity, channel: ControlChannel, dataplane: DataPlane
    ) -> EndpointRuntime[Any]:
        raise NotImplementedError

    def on_dispatch(self, d: Dispatch, tg: anyio.abc.TaskGroup) -> None:
        raise NotImplementedError

    def on_event(self, ev: Event, tg: anyio.abc.TaskGroup) -> None:
        raise NotImplementedError

    def on_other(self, msg: object) -> None:
        raise TypeError(f"unexpected command {msg!r}")

    def endpoint_blocks(self) -> int:
        raise NotImplementedError

    # --- shared --------------------------------------------------------------------

    def send(self, msg: object) -> None:
        """To the supervisor (event-loop thread only)."""
        self.conn.send(msg)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.spec.geometry.model.tokens_per_block)

    async def on_ranks(self, msg: Fill | Check) -> list[RankReply]:
        """Ask every rank at once; their answers in rank order."""
        replies: list[RankReply | None] = [None] * len(self.ranks)

        async def one(i: int) -> None:
            replies[i] = await self.ranks[i].call(msg)

        async with anyio.create_task_group() as tg:
            for i in range(len(self.ranks)):
                tg.start_soon(one, i)
        return [r for r in replies if r is not None]

    def request_seed(self, transfer_id: str) -> int:
        return request_seed(self.spec.seed, transfer_id)

    async def serve(self) -> None:
        """Run until the supervisor says Stop, goes away, or SIGTERM."""
        async with contextlib.AsyncExitStack() as stack:
            runtime, port = await self._build(stack)
            send, receive = anyio.create_memory_object_stream[object](256)
            async with anyio.create_task_group() as tg:
                await tg.start(runtime.run)
                tg.start_soon(self._events, runtime, tg)
                self._live = (runtime, tg)
                tg.start_soon(self._signals, tg.cancel_scope)
                token = anyio.lowlevel.current_token()
                for rank in self.ranks:
                    rank.start(token)
                threading.Thread(
                    target=self._read_pipe, args=(send, token), name="router-pipe", daemon=True
                ).start()
                self.send(LeaderUp(port))
                async with receive:
                    async for msg in receive:
                        if isinstance(msg, _ParentGone):
                            name = self.spec.name
                            print(
                                f"kvpush demo: {name} leader: router gone, exiting", file=sys.stderr
                            )
                        if isinstance(msg, (Stop, _ParentGone)):
                            break
                        self._command(msg, runtime, tg)
                tg.cancel_scope.cancel()

    async def _build(self, stack: contextlib.AsyncExitStack) -> tuple[EndpointRuntime[Any], int]:
        """Attach the ranks' segments, open the channel; the runtime and its port."""
        spec, geo = self.spec, self.spec.geometry
        codec = Codec(secret=spec.secret)
        for r, segment in enumerate(spec.segments):
            self.transports.append(self._transport(stack, r, segment))
        ranks = {r: Rank(t, self.layouts[r]) for r, t in enumerate(self.transports)}
        dataplane = DataPlane(spec.role, ranks, geo.tp, codec)
        blobs = tuple(
            encode_rank(t.metadata(), lay)
            for t, lay in zip(self.transports, self.layouts, strict=True)
        )
        identity = Identity(
            spec.name,
            secrets.randbits(63),
            tp=geo.tp,
            num_kv_heads=geo.model.num_kv_heads,
            layout=self.layouts[0],
            ranks=blobs,
        )
        self.channel = await stack.enter_async_context(leader_channel(spec, codec))
        port = await self.channel.listen("127.0.0.1", 0)
        runtime = self.make_runtime(identity, self.channel, dataplane)
        if spec.metrics_port is not None:
            import prometheus_client

            self.metrics = EndpointMetrics(runtime.endpoint, dataplane)
            prometheus_client.start_http_server(spec.metrics_port, addr="127.0.0.1")
        return runtime, port

    def _transport(self, stack: contextlib.AsyncExitStack, r: int, segment: str) -> Transport:
        """Rank ``r``'s transport over its segment (closed by ``stack``)."""
        geo, name = self.spec.geometry, f"{self.spec.name}-r{r}"
        t: Transport
        if self.spec.transport == "memory":
            shm = ShmTransport(
                name,
                geo.segment_bytes,
                create=False,
                name=segment,
                mailbox_bytes=_MAILBOX_BYTES,
                link_gbps=self.spec.link_gbps,
            )
            stack.callback(shm.close)
            memory, t = shm.memory, shm
        else:  # NIXL: registers memory we map, at its real addresses
            seg = Segment.attach(segment, geo.segment_bytes)
            stack.callback(seg.close)  # after the transport deregisters it
            memory = seg.array
            t = transport_kind(self.spec.transport).factory(name)
            stack.callback(t.close)
            self.layouts[r] = geo.layout(r, base=memory.ctypes.data)
        int(memory[::4096].sum())  # map every page now (the rank faulted them in)
        return t

    def _command(self, msg: object, runtime: EndpointRuntime[Any], tg: anyio.abc.TaskGroup) -> None:
        if isinstance(msg, Dispatch):
            self.on_dispatch(msg, tg)
        elif isinstance(msg, Finish):
            stats = Stats(
                self.endpoint_blocks(),
                self.pool.outstanding,
                runtime.frames_dropped,
                tuple(self.caller_reserve),
                tuple(self.caller_ready),
            )
            self.send(stats)
        else:
            self.on_other(msg)

    def _read_pipe(self, stream: MemoryObjectSendStream[object], token: Any) -> None:
        """Thread: supervisor commands into the loop until Stop or a closed pipe."""
        while True:
            msg: object
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = _ParentGone()
            try:
                anyio.from_thread.run(stream.send, msg, token=token)
            except (RuntimeError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the loop is gone
            if isinstance(msg, (Stop, _ParentGone)):
                return

    def deliver(self, _: Event) -> None:
        """The runtime's ``on_event`` (called inside its pump, on the loop's
        thread): take every event now rather than a loop turn later in
        :meth:`_events` (about 0.2 ms per handoff on a loaded 2-core host).
        The handlers only touch the leader's own state, never the runtime."""
        if self._live is not None:
            runtime, tg = self._live
            self._handle(runtime.events_nowait(), tg)

    def _handle(self, events: list[Event], tg: anyio.abc.TaskGroup) -> None:
        for ev in events:
            if self.metrics is not None:
                self.metrics.observe(ev)
            self.on_event(ev, tg)

    async def _events(self, runtime: EndpointRuntime[Any], tg: anyio.abc.TaskGroup) -> None:
        """Events that came before :meth:`deliver` could take them."""
        while True:
            self._handle(await runtime.next_events(1.0), tg)

    async def _signals(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                scope.cancel()
                return
