"""One side (prefill or decode) of a two-process kvpush run over real NIXL,
driven by the test process through a pipe (``tests/test_nixl_runtime.py``).

The child builds what a serving engine would: one numpy "KV cache" per rank,
one :class:`~kvpush_nixl.NixlTransport` (a NIXL agent over UCX) per rank, a
:class:`DataPlane`, a TCP :class:`ControlChannel` and the endpoint's pump. It
answers commands (tuples, see :func:`_command`) with one reply each, and
keeps every event the pump reports so that ``wait`` can look for one.

``Paused`` wraps the real transport only to stop *calling* its ``poll`` on
command: NIXL underneath is real, and a target that stops polling stalls the
writes to it (the reference's trap #1), which is how the tests hold a write in
flight at a known moment.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import anyio
import numpy as np

from kvpush.protocol import (
    Codec,
    Consumer,
    ConsumerConfig,
    Event,
    Failed,
    HeadOrder,
    Identity,
    KVLayout,
    KvpushError,
    MemoryType,
    Mode,
    Producer,
    ProducerConfig,
    Ready,
    Refused,
    Released,
    Role,
    SourceReleased,
    Staging,
    Timing,
    layer_regions,
)
from kvpush.runtime import (
    Completed,
    ConsumerRuntime,
    ControlChannel,
    CostModel,
    DataPlane,
    HostCopier,
    Notice,
    ProducerRuntime,
    Rank,
    encode_rank,
)
from kvpush_nixl import NixlTransport, PrepRule

HEADS, HEAD_BYTES, LAYERS = 4, 64, 2
SECRET = b"nixl-runtime-test-secret-0123456789"


#: Short bounds, so that deadlines and quarantines run out within a test.
FAST = Timing(max_transit=0.5, op_bound=1.0)


@dataclass(frozen=True)
class SideSpec:
    role: Role
    name: str
    peer: str
    tp: int
    tokens: int  # per block
    blocks: int
    port: int = 0
    ready_timeout: float = 20.0
    kv_hold_timeout: float = 20.0
    timing: Timing = FAST
    peer_lost_after: float = 1.0
    #: Post every transfer by index into prepared lists (else NIXL's measured rule).
    prepped: bool = False
    #: The model's KV heads (a different count on the two sides: incompatible).
    heads: int = HEADS
    #: Consumer: the reservation budget in blocks (None: unlimited).
    max_reserved_blocks: int | None = None
    #: Bytes of each rank's staging pool (0: none); with one, every write that
    #: can be staged is (no cost model), gathered and scattered by HostCopier.
    staging: int = 0


def rank_layout(spec: SideSpec, rank: int, base: int) -> KVLayout:
    heads = spec.heads // spec.tp
    block_len = spec.tokens * heads * HEAD_BYTES
    span = 2 * spec.blocks * block_len
    pool = (
        Staging(base=base + LAYERS * span, nbytes=spec.staging, memory=MemoryType.DRAM)
        if spec.staging
        else None
    )
    return KVLayout(
        layer_regions(
            [base + i * span for i in range(LAYERS)],
            num_blocks=spec.blocks,
            tokens_per_block=spec.tokens,
            num_heads=heads,
            head_bytes=HEAD_BYTES,
            head_start=rank * heads,
            order=HeadOrder.HND,
            memory=MemoryType.DRAM,
        ),
        pool,
    )


def value(layer: int, kind: str, token: np.ndarray, head: np.ndarray, salt: int) -> np.ndarray:
    """The KV byte of (layer, kind, absolute token, global head) for a request."""
    mix = layer * 31 + (kind == "V") * 17 + token * 7 + head * 13 + salt * 101
    return (mix % 251).astype(np.uint8)


class Paused:
    """A real NixlTransport whose poll the test can suspend (see module docs)."""

    def __init__(self, inner: NixlTransport) -> None:
        self.inner = inner
        self.paused = False

    def poll(self) -> tuple[list[Completed], list[Notice]]:
        return ([], []) if self.paused else self.inner.poll()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Chaos:
    """The real control channel, except that on command (``chaos``) a frame
    the pump sends is duplicated, or held back and sent after the next one to
    the same peer (reordered). A held frame goes out within ``hold`` seconds
    even if no other follows, well inside ``max_transit``: reordering, not
    delay (a frame late past ``max_transit`` would break assumption A1, which
    the real channel enforces)."""

    def __init__(self, inner: ControlChannel, hold: float = 0.02) -> None:
        self.inner = inner
        self.hold = hold
        self.dup = self.reorder = 0.0
        self.rng = random.Random(0)
        self.held: dict[str, tuple[float, Any]] = {}
        self.duplicated = self.reordered = 0

    def send_nowait(self, peer: str, message: Any) -> None:
        held = self.held.pop(peer, None)
        if held is None and self.rng.random() < self.reorder:
            self.held[peer] = (time.monotonic(), message)
            return
        self.inner.send_nowait(peer, message)
        if held is not None:
            self.reordered += 1
            self.inner.send_nowait(peer, held[1])
        if self.rng.random() < self.dup:
            self.duplicated += 1
            self.inner.send_nowait(peer, message)

    def events(self) -> Any:
        return self.inner.events()

    async def flush(self) -> None:
        while True:
            await anyio.sleep(self.hold / 2)
            now = time.monotonic()
            for peer, (since, message) in list(self.held.items()):
                if now - since >= self.hold:
                    del self.held[peer]
                    with contextlib.suppress(KvpushError):
                        self.inner.send_nowait(peer, message)


class Side:
    def __init__(self, spec: SideSpec) -> None:
        self.spec = spec
        self.memory: list[np.ndarray] = []
        self.layouts: list[KVLayout] = []
        self.transports: list[Paused] = []
        self.events: list[Event] = []

    # --- the KV pattern ------------------------------------------------------

    def _views(self, rank: int) -> list[tuple[Any, np.ndarray]]:
        mem, layout = self.memory[rank], self.layouts[rank]
        base = mem.ctypes.data
        out = []
        for r in layout.regions:
            off = r.base - base
            rows = mem[off : off + r.num_blocks * r.stride].reshape(r.num_blocks, r.stride)
            view = rows[:, : r.block_len].reshape(
                r.num_blocks, r.num_heads, r.tokens_per_block, r.head_bytes
            )
            out.append((r, view))
        return out

    def _want(self, r: Any, first_token: int, salt: int) -> np.ndarray:
        tok = first_token + np.arange(r.tokens_per_block)
        heads = r.head_start + np.arange(r.num_heads)
        return value(r.layer, r.kind, tok[None, :], heads[:, None], salt)[:, :, None]

    def fill(self, blocks: list[int], salt: int) -> None:
        for rank in range(self.spec.tp):
            for r, view in self._views(rank):
                for i, b in enumerate(blocks):
                    view[b] = self._want(r, i * r.tokens_per_block, salt)

    def bad_blocks(self, blocks: list[int], salt: int, skip_tokens: int) -> list[int]:
        bad = set()
        for rank in range(self.spec.tp):
            for r, view in self._views(rank):
                for i, b in enumerate(blocks):
                    want = self._want(r, skip_tokens + i * r.tokens_per_block, salt)
                    if not np.array_equal(view[b], np.broadcast_to(want, view[b].shape)):
                        bad.add(b)
        return sorted(bad)

    # --- running -------------------------------------------------------------

    async def serve(self, conn: Connection) -> None:
        spec = self.spec
        codec = Codec(secret=SECRET)
        ranks = {}
        for r in range(spec.tp):
            size = LAYERS * 2 * spec.blocks * spec.tokens * (spec.heads // spec.tp) * HEAD_BYTES
            size += spec.staging
            mem = np.zeros(size, dtype=np.uint8)
            layout = rank_layout(spec, r, mem.ctypes.data)
            rule = PrepRule(min_merge_ratio=0.0, min_rows=0) if spec.prepped else None
            t = Paused(NixlTransport(f"{spec.name}-r{r}", prep_rule=rule))
            self.memory.append(mem)
            self.layouts.append(layout)
            self.transports.append(t)
            ranks[r] = Rank(t, layout)  # type: ignore[arg-type]
        copier = HostCopier() if spec.staging else None
        # margin 0: staging always wins (the cost model would write DRAM in place).
        always = CostModel(0.0, 1.0, 0.0, 0.0, 0.0, margin=0.0) if spec.staging else None
        dataplane = DataPlane(spec.role, ranks, spec.tp, codec, copier=copier, costs=always)
        blobs = tuple(
            encode_rank(t.metadata(), lay)
            for t, lay in zip(self.transports, self.layouts, strict=True)
        )
        identity = Identity(
            spec.name,
            secrets.randbits(63),
            tp=spec.tp,
            num_kv_heads=spec.heads,
            layout=self.layouts[0],
            ranks=blobs,
        )
        channel_cm = ControlChannel(
            spec.name,
            codec,
            max_age=spec.timing.max_transit / 2,
            peer_lost_after=spec.peer_lost_after,
        )
        async with channel_cm as real:
            port = await real.listen("127.0.0.1", spec.port)
            channel = self.chaos = Chaos(real)
            runtime: ProducerRuntime | ConsumerRuntime
            if spec.role is Role.PRODUCER:
                config = ProducerConfig(
                    identity, timing=spec.timing, kv_hold_timeout=spec.kv_hold_timeout
                )
                runtime = ProducerRuntime(Producer(config), channel, dataplane)
            else:
                cconfig = ConsumerConfig(
                    identity,
                    timing=spec.timing,
                    ready_timeout=spec.ready_timeout,
                    max_reserved_blocks=spec.max_reserved_blocks,
                    staging_bytes=spec.staging,
                    staging_page=4096,
                )
                runtime = ConsumerRuntime(Consumer(cconfig), channel, dataplane)
            async with anyio.create_task_group() as tg:
                await tg.start(runtime.run)
                tg.start_soon(self._collect, runtime)
                tg.start_soon(self.chaos.flush)
                conn.send(("up", port, os.getpid()))
                while True:
                    msg = await anyio.to_thread.run_sync(_recv, conn)
                    if msg is None:
                        continue
                    if msg[0] == "stop":
                        break
                    conn.send(await self._command(runtime, real, msg))
                tg.cancel_scope.cancel()
        for t in self.transports:
            t.inner.close()
        conn.send(("stopped",))

    async def _collect(self, runtime: ProducerRuntime | ConsumerRuntime) -> None:
        while True:
            self.events += await runtime.next_events(1.0)

    async def _command(self, runtime: Any, channel: ControlChannel, msg: tuple[Any, ...]) -> Any:
        kind, *args = msg
        if kind == "route":  # ("route", host, port[, peer name])
            host, port, *name = args
            peer = name[0] if name else self.spec.peer
            channel.add_route(peer, host, port)
            runtime.connect(peer)
            return ("ok",)
        if kind == "fill":
            self.fill(*args)
            return ("ok",)
        if kind == "bad_blocks":
            return ("bad", self.bad_blocks(*args))
        if kind == "reserve":  # ("reserve", tid, blocks, mode, skip[, peer name])
            tid, blocks, mode, skip, *name = args
            peer = name[0] if name else self.spec.peer
            result = runtime.reserve(tid, peer, [blocks], mode=Mode(mode), skip_tokens=skip)
            if isinstance(result, Refused):
                return ("refused", result.reason.value)
            return ("reserved", result.epoch)
        if kind == "kv_ready":
            tid, blocks = args
            runtime.kv_ready(tid, [blocks])
            return ("ok",)
        if kind == "abort":
            return ("aborted", runtime.abort(args[0]))
        if kind == "preempt":
            return ("preempted", runtime.preempt(args[0]))
        if kind == "drop_agents":  # ("drop_agents"[, rank])
            # The next post to the peer fails (its NIXL agent is gone): as a
            # post that fails on a real fabric.
            ranks = [args[0]] if args else range(len(self.transports))
            for r in ranks:
                t = self.transports[r]
                for agent in t.inner.peers:
                    t.inner.remove_peer(agent)
            return ("ok",)
        if kind == "chaos":  # ("chaos", duplicate probability, reorder probability)
            self.chaos.dup, self.chaos.reorder = float(args[0]), float(args[1])
            return ("ok",)
        if kind == "pause":
            for t in self.transports:
                t.paused = bool(args[0])
            return ("ok",)
        if kind == "wait":
            return await self._wait(*args)
        if kind == "counts":
            ep = runtime.endpoint
            held = getattr(ep, "held_blocks", 0)
            reserved = getattr(ep, "reserved_blocks", 0)
            dp = runtime.dataplane
            # Seconds since this process last noticed it had stalled (inf: never).
            quiet = time.monotonic() - runtime.watch.gap_ended
            chaos = (self.chaos.duplicated, self.chaos.reordered)
            suspect = getattr(ep, "suspect_blocks", 0)
            st = dp.stager
            staged = (st.staged_writes, st.scatters, st.pool_used(), st.dropped_notices)
            return (
                "counts",
                reserved,
                held,
                dp.posted,
                dp.posted_prepped,
                quiet,
                chaos,
                suspect,
                staged,
            )
        raise ValueError(f"unknown command {kind!r}")

    async def _wait(self, kinds: tuple[str, ...], tid: str, timeout: float, nth: int = 1) -> Any:
        """The ``nth`` event of one of ``kinds`` for ``tid`` (``""``: any), as a
        dict, with the time it took, or ``("timeout", [events seen])``."""
        started = time.monotonic()
        with anyio.move_on_after(timeout):
            while True:
                found = [
                    ev
                    for ev in self.events
                    if type(ev).__name__ in kinds
                    and (not tid or getattr(ev, "transfer_id", None) == tid)
                ]
                if len(found) >= nth:
                    return ("event", _describe(found[nth - 1]), time.monotonic() - started)
                await anyio.sleep(0.005)
        return ("timeout", [_describe(e) for e in self.events])


def _describe(ev: Event) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(ev).__name__, "tid": getattr(ev, "transfer_id", None)}
    if isinstance(ev, Failed):
        out["reason"] = ev.reason.value
        out["detail"] = ev.detail
    elif isinstance(ev, SourceReleased):
        out["outcome"] = ev.outcome.value
    elif isinstance(ev, (Ready, Released)):
        out["epoch"] = ev.epoch
    timeline = getattr(ev, "timeline", None)
    if timeline is not None and timeline.reserved is not None:  # the consumer's
        for stamp in ("failed", "ready", "released"):
            at = getattr(timeline, stamp)
            out[f"{stamp}_after_reserve"] = None if at is None else at - timeline.reserved
    return out


def _recv(conn: Connection) -> Any:
    if not conn.poll(0.1):
        return None
    try:
        return conn.recv()
    except EOFError:  # the test process is gone
        return ("stop",)


def side_main(spec: SideSpec, conn: Connection) -> None:
    """Process entry point (``multiprocessing`` spawn target)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    anyio.run(Side(spec).serve, conn)
