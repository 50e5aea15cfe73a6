"""The leader process of one instance (prefill or decode).

A leader runs the anyio runtime of its side: a :class:`ControlChannel` on
127.0.0.1 (HMAC codec, the run's secret), the endpoint's pump
(:class:`ProducerRuntime` / :class:`ConsumerRuntime`) and a :class:`DataPlane`
whose ranks are the instance's rank segments, attached here with
``ShmTransport(create=False, name=...)``: the rank processes own the memory,
the leader's data-plane thread moves the bytes. It also plays the engine: the
prefill "computes" (sleeps in proportion to the prompt, then writes the
pattern into its blocks and calls ``kv_ready``); the decode reserves blocks,
registers them with the prefill, checks every block when ``Ready`` arrives
and frees them.

Commands come from the router over a pipe, read by a thread that hands them
to the event loop; a closed pipe means the router died, and the leader exits.
SIGTERM shuts it down cleanly; SIGINT is the router's business.
"""

from __future__ import annotations

import contextlib
import math
import random
import secrets
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectSendStream

from kvpush.protocol import (
    Codec,
    Consumer,
    ConsumerConfig,
    Event,
    Failed,
    Identity,
    KVLayout,
    Mode,
    PeerFailed,
    PeerReady,
    Producer,
    ProducerConfig,
    Ready,
    Refused,
    Released,
    Role,
    SourceReleased,
    Timeline,
)
from kvpush.runtime import (
    ConsumerRuntime,
    ControlChannel,
    DataPlane,
    EndpointRuntime,
    ProducerRuntime,
    Rank,
    ShmTransport,
    encode_rank,
)

from ._model import SideGeometry
from ._pattern import corrupt_blocks, fill, request_seed
from ._wire import (
    Abort,
    ConsumerResult,
    Dispatch,
    Finish,
    LeaderError,
    LeaderUp,
    PeerUp,
    ProducerResult,
    Route,
    Stats,
    Stop,
)

__all__ = ("BlockPool", "LeaderSpec", "leader_main")

#: Each (writer, target) notice mailbox: thousands of notices, little memory.
_MAILBOX_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class LeaderSpec:
    """Everything a leader process needs (pickled to it)."""

    role: Role
    #: Engine id and channel name of this side, and of the other side.
    name: str
    peer: str
    geometry: SideGeometry
    #: The rank processes' segment names, rank order.
    segments: tuple[str, ...]
    secret: bytes
    mode: Mode
    compute_us_per_token: float
    seed: int


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
    """The router's end of the pipe closed."""


def _last(timeline: Timeline) -> float | None:
    return max((t for _, t in timeline.write_done), default=None)


class _Leader:
    """What both sides share: setup, the command pipe, the event loop."""

    def __init__(self, spec: LeaderSpec, conn: Connection) -> None:
        self.spec = spec
        self.conn = conn
        geo = spec.geometry
        self.layouts: list[KVLayout] = [geo.layout(r) for r in range(geo.tp)]
        self.transports: list[ShmTransport] = []
        self.pool = BlockPool(geo.num_blocks, spec.seed * 2 + (spec.role is Role.PRODUCER))
        self.blocks: dict[str, list[int]] = {}
        self.channel: ControlChannel | None = None

    # --- to override ---------------------------------------------------------------

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
        """To the router (event-loop thread only)."""
        self.conn.send(msg)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.spec.geometry.model.tokens_per_block)

    def request_seed(self, transfer_id: str) -> int:
        return request_seed(self.spec.seed, transfer_id)

    async def serve(self) -> None:
        spec, geo = self.spec, self.spec.geometry
        codec = Codec(secret=spec.secret)
        async with contextlib.AsyncExitStack() as stack:
            for r, segment in enumerate(spec.segments):
                t = ShmTransport(
                    f"{spec.name}-r{r}",
                    geo.segment_bytes,
                    create=False,
                    name=segment,
                    mailbox_bytes=_MAILBOX_BYTES,
                )
                stack.callback(t.close)
                self.transports.append(t)
            ranks = {r: Rank(t, self.layouts[r]) for r, t in enumerate(self.transports)}
            dataplane = DataPlane(spec.role, ranks, geo.tp, codec)
            blobs = tuple(encode_rank(t.metadata(), l) for t, l in zip(self.transports, self.layouts))
            identity = Identity(
                spec.name,
                secrets.randbits(63),
                tp=geo.tp,
                num_kv_heads=geo.model.num_kv_heads,
                layout=self.layouts[0],
                ranks=blobs,
            )
            self.channel = await stack.enter_async_context(ControlChannel(spec.name, codec))
            port = await self.channel.listen("127.0.0.1", 0)
            runtime = self.make_runtime(identity, self.channel, dataplane)
            send, receive = anyio.create_memory_object_stream[object](256)
            async with anyio.create_task_group() as tg:
                await tg.start(runtime.run)
                tg.start_soon(self._events, runtime, tg)
                tg.start_soon(self._signals, tg.cancel_scope)
                token = anyio.lowlevel.current_token()
                reader = threading.Thread(
                    target=self._read_pipe, args=(send, token), name="router-pipe", daemon=True
                )
                reader.start()
                self.send(LeaderUp(port))
                async with receive:
                    async for msg in receive:
                        if isinstance(msg, Stop):
                            break
                        if isinstance(msg, _ParentGone):
                            print(f"kvpush demo: {spec.name} leader: router gone, exiting",
                                  file=sys.stderr)
                            break
                        if isinstance(msg, Dispatch):
                            self.on_dispatch(msg, tg)
                        elif isinstance(msg, Finish):
                            self.send(Stats(self.endpoint_blocks(), self.pool.outstanding,
                                            runtime.frames_dropped))
                        else:
                            self.on_other(msg)
                tg.cancel_scope.cancel()

    def _read_pipe(self, stream: MemoryObjectSendStream[object], token: object) -> None:
        """Thread: router commands into the loop until Stop or a closed pipe."""
        while True:
            msg: object
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = _ParentGone()
            try:
                anyio.from_thread.run(stream.send, msg, token=token)  # type: ignore[arg-type]
            except (RuntimeError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the loop is gone
            if isinstance(msg, (Stop, _ParentGone)):
                return

    async def _events(self, runtime: EndpointRuntime[Any], tg: anyio.abc.TaskGroup) -> None:
        while True:
            for ev in await runtime.next_events(1.0):
                self.on_event(ev, tg)

    async def _signals(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                scope.cancel()
                return


class PrefillLeader(_Leader):
    """Computes (sleeps), fills its blocks with the pattern, hands them off."""

    def __init__(self, spec: LeaderSpec, conn: Connection) -> None:
        super().__init__(spec, conn)
        self.runtime: ProducerRuntime | None = None
        self.computing: set[str] = set()
        self.aborted: set[str] = set()

    def make_runtime(
        self, identity: Identity, channel: ControlChannel, dataplane: DataPlane
    ) -> EndpointRuntime[Any]:
        self.runtime = ProducerRuntime(Producer(ProducerConfig(identity)), channel, dataplane)
        return self.runtime

    def endpoint_blocks(self) -> int:
        return self.runtime.endpoint.held_blocks if self.runtime else 0

    def on_dispatch(self, d: Dispatch, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self._compute, d)

    def on_other(self, msg: object) -> None:
        if not isinstance(msg, Abort):
            super().on_other(msg)
        elif msg.transfer_id in self.computing:
            self.aborted.add(msg.transfer_id)
        elif msg.transfer_id in self.blocks and self.runtime is not None:
            self.runtime.abort(msg.transfer_id)

    async def _compute(self, d: Dispatch) -> None:
        tid = d.transfer_id
        blocks = self.pool.take(self.blocks_for(d.tokens))
        if blocks is None:
            self.send(ProducerResult(tid, "no_blocks", None, None, None, None))
            return
        self.computing.add(tid)
        try:
            await anyio.sleep(d.tokens * self.spec.compute_us_per_token * 1e-6)
            await anyio.to_thread.run_sync(self._fill, blocks, self.request_seed(tid))
        finally:
            self.computing.discard(tid)
        if tid in self.aborted or self.runtime is None:
            self.aborted.discard(tid)
            self.pool.give(blocks)
            self.send(ProducerResult(tid, "aborted", None, None, None, None))
            return
        self.blocks[tid] = blocks
        self.runtime.kv_ready(tid, [blocks])

    def _fill(self, blocks: list[int], seed: int) -> None:
        for t, layout in zip(self.transports, self.layouts, strict=True):
            fill(t.memory, layout, blocks, seed)

    def on_event(self, ev: Event, tg: anyio.abc.TaskGroup) -> None:
        if isinstance(ev, SourceReleased):
            self.pool.give(self.blocks.pop(ev.transfer_id, []))
            tl = ev.timeline
            self.send(
                ProducerResult(
                    ev.transfer_id,
                    ev.outcome.value,
                    tl.registration_received,
                    tl.kv_ready,
                    tl.write_started,
                    _last(tl),
                )
            )
        elif isinstance(ev, PeerFailed):
            self.send(LeaderError(f"prefill: handshake with {ev.peer} failed: {ev.detail}"))


class DecodeLeader(_Leader):
    """Reserves and registers blocks, checks the KV that lands, frees it."""

    def __init__(self, spec: LeaderSpec, conn: Connection) -> None:
        super().__init__(spec, conn)
        self.runtime: ConsumerRuntime | None = None
        self.failures: dict[str, str] = {}

    def make_runtime(
        self, identity: Identity, channel: ControlChannel, dataplane: DataPlane
    ) -> EndpointRuntime[Any]:
        config = ConsumerConfig(identity, max_reserved_blocks=self.spec.geometry.num_blocks)
        self.runtime = ConsumerRuntime(Consumer(config), channel, dataplane)
        return self.runtime

    def endpoint_blocks(self) -> int:
        return self.runtime.endpoint.reserved_blocks if self.runtime else 0

    def on_other(self, msg: object) -> None:
        if not isinstance(msg, Route):
            super().on_other(msg)
        elif self.channel is not None and self.runtime is not None:
            self.channel.add_route(self.spec.peer, msg.host, msg.port)
            self.runtime.connect(self.spec.peer)

    def on_dispatch(self, d: Dispatch, tg: anyio.abc.TaskGroup) -> None:
        tid = d.transfer_id
        blocks = self.pool.take(self.blocks_for(d.tokens))
        if blocks is None or self.runtime is None:
            self.send(ConsumerResult(tid, False, "decode: no free blocks", 0, None, None, None))
            return
        result = self.runtime.reserve(tid, self.spec.peer, [blocks], mode=self.spec.mode)
        if isinstance(result, Refused):
            self.pool.give(blocks)
            reason = f"refused: {result.reason.value}"
            self.send(ConsumerResult(tid, False, reason, 0, None, None, None))
            return
        self.blocks[tid] = blocks

    def on_event(self, ev: Event, tg: anyio.abc.TaskGroup) -> None:
        if isinstance(ev, Ready):
            tg.start_soon(self._check, ev)
        elif isinstance(ev, Failed):
            detail = f": {ev.detail}" if ev.detail else ""
            self.failures[ev.transfer_id] = f"{ev.reason.value}{detail}"
        elif isinstance(ev, Released):
            self.pool.give(self.blocks.pop(ev.transfer_id, []))
            reason = self.failures.pop(ev.transfer_id, "released")
            tl = ev.timeline
            self.send(
                ConsumerResult(ev.transfer_id, False, reason, 0, tl.reserved, _last(tl), None)
            )
        elif isinstance(ev, PeerReady):
            self.send(PeerUp())
        elif isinstance(ev, PeerFailed):
            self.send(LeaderError(f"decode: handshake with {ev.peer} failed: {ev.detail}"))

    async def _check(self, ev: Ready) -> None:
        blocks = self.blocks.pop(ev.transfer_id)
        seed = self.request_seed(ev.transfer_id)
        bad = await anyio.to_thread.run_sync(self._verify, blocks, seed)
        self.pool.give(blocks)
        tl = ev.timeline
        self.send(
            ConsumerResult(ev.transfer_id, True, "", bad, tl.reserved, _last(tl), tl.ready)
        )

    def _verify(self, blocks: list[int], seed: int) -> int:
        bad: set[int] = set()
        for t, layout in zip(self.transports, self.layouts, strict=True):
            bad |= corrupt_blocks(t.memory, layout, blocks, seed)
        return len(bad)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _describe(exc: BaseException) -> str:
    """The first real error inside (possibly nested) exception groups."""
    while True:
        inner = getattr(exc, "exceptions", None)
        if not inner:
            return f"{type(exc).__name__}: {exc}"
        exc = inner[0]


def leader_main(spec: LeaderSpec, conn: Connection) -> None:
    """Process entry point (``multiprocessing`` spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the router handles Ctrl-C
    signal.signal(signal.SIGTERM, _terminate)  # until the loop's own handler is up
    leader: _Leader
    leader = PrefillLeader(spec, conn) if spec.role is Role.PRODUCER else DecodeLeader(spec, conn)
    try:
        anyio.run(leader.serve)
    except SystemExit:
        raise
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send(LeaderError(f"{spec.name} leader: {_describe(exc)}"))
        raise SystemExit(1) from None
