"""The leader process of one instance: a prefill's or a decode's engine.

Each runs its side's anyio runtime (see :mod:`._leader`) and plays the engine.
The prefill "computes" (sleeps in proportion to the prompt), writes the
pattern into its blocks, calls ``kv_ready`` and frees the blocks on
``SourceReleased``; it learns its decode instances from their handshakes. A
decode dials every prefill the supervisor names (:class:`Dial`), reserves blocks
and registers them with the request's prefill (the runtime sends the
registration once the handshake is up), checks
every block when ``Ready`` arrives, then frees them; ``Failed`` is remembered
and reported with the ``Released`` that returns the blocks. SIGINT is the
supervisor's business: a leader ignores it.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

import anyio
import anyio.abc

from kvpush.protocol import (
    Consumer,
    ConsumerConfig,
    Event,
    Failed,
    Identity,
    PeerFailed,
    PeerReady,
    Producer,
    ProducerConfig,
    Ready,
    Refused,
    Released,
    Role,
    SourceReleased,
)
from kvpush.runtime import (
    ConsumerRuntime,
    ControlChannel,
    DataPlane,
    EndpointRuntime,
    ProducerRuntime,
)

from ._children import ignore_sigint
from ._leader import Leader, LeaderSpec, last_write_done, ops_summary
from ._wire import (
    Check,
    ConsumerResult,
    Dial,
    Dispatch,
    Drop,
    Fill,
    LeaderError,
    PeerUp,
    ProducerResult,
)

__all__ = ("DecodeLeader", "PrefillLeader", "leader_main")


class PrefillLeader(Leader):
    """Computes (sleeps), fills its blocks with the pattern, hands them off."""

    def __init__(
        self, spec: LeaderSpec, rank_conns: Sequence[Connection], conn: Connection
    ) -> None:
        super().__init__(spec, rank_conns, conn)
        self.runtime: ProducerRuntime | None = None
        self.computing: set[str] = set()
        self.aborted: set[str] = set()

    def make_runtime(
        self, identity: Identity, channel: ControlChannel, dataplane: DataPlane
    ) -> EndpointRuntime[Any]:
        config = ProducerConfig(identity, self.spec.timing)
        self.runtime = ProducerRuntime(Producer(config), channel, dataplane, on_event=self.deliver)
        return self.runtime

    def endpoint_blocks(self) -> int:
        return self.runtime.endpoint.held_blocks if self.runtime else 0

    def on_dispatch(self, d: Dispatch, tg: anyio.abc.TaskGroup) -> None:
        tid = d.transfer_id
        blocks = self.pool.take(self.blocks_for(d.tokens))
        if blocks is None:
            self.send(ProducerResult(tid, "no_blocks", None, None, None, None))
            return
        self.computing.add(tid)  # now: a Drop may come before the task runs
        tg.start_soon(self._compute, tid, d.tokens, blocks)

    def on_other(self, msg: object) -> None:
        if not isinstance(msg, Drop):
            super().on_other(msg)
        elif msg.transfer_id in self.computing:
            self.aborted.add(msg.transfer_id)
        elif msg.transfer_id in self.blocks and self.runtime is not None:
            self.runtime.abort(msg.transfer_id)

    async def _compute(self, tid: str, tokens: int, blocks: list[int]) -> None:
        """The "forward pass": the prompt's time, then the KV on every rank.
        Progressive (``chunk_tokens``): chunk by chunk, each chunk's whole
        blocks handed to the core as an increment once every rank wrote them."""
        chunk = self.spec.chunk_tokens or tokens
        per_block = self.spec.geometry.model.tokens_per_block
        seed, done, given = self.request_seed(tid), 0, 0
        try:
            while done < tokens and tid not in self.aborted:
                step = min(chunk, tokens - done)
                await anyio.sleep(step * self.spec.compute_us_per_token * 1e-6)
                first, done = done // per_block, done + step
                end = -(-done // per_block)  # the chunk's blocks, the last maybe partly
                await self.on_ranks(Fill(tuple(blocks[first:end]), seed, first))
                whole = done // per_block
                if done < tokens and whole > given and self.runtime is not None:
                    self.blocks[tid] = blocks
                    self.runtime.kv_ready(tid, [blocks[:whole]], final=False)
                    given = whole
        finally:
            self.computing.discard(tid)
        if tid in self.aborted or self.runtime is None:
            self.aborted.discard(tid)
            if given and self.runtime is not None:
                self.runtime.abort(tid)  # the core holds the source: SourceReleased frees it
                return
            self.pool.give(blocks)
            self.send(ProducerResult(tid, "aborted", None, None, None, None))
            return
        self.blocks[tid] = blocks
        self.runtime.kv_ready(tid, [blocks])

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
                    last_write_done(tl),
                    ops_summary(tl),
                    tl.released,
                )
            )
        elif isinstance(ev, PeerFailed):
            name = self.spec.name
            self.send(LeaderError(f"{name}: handshake with {ev.peer} failed: {ev.detail}"))


class DecodeLeader(Leader):
    """Reserves and registers blocks, checks the KV that lands, frees it."""

    def __init__(
        self, spec: LeaderSpec, rank_conns: Sequence[Connection], conn: Connection
    ) -> None:
        super().__init__(spec, rank_conns, conn)
        self.runtime: ConsumerRuntime | None = None
        self.failures: dict[str, str] = {}

    def make_runtime(
        self, identity: Identity, channel: ControlChannel, dataplane: DataPlane
    ) -> EndpointRuntime[Any]:
        geo = self.spec.geometry
        config = ConsumerConfig(identity, self.spec.timing, max_reserved_blocks=geo.num_blocks)
        self.runtime = ConsumerRuntime(Consumer(config), channel, dataplane, on_event=self.deliver)
        return self.runtime

    def endpoint_blocks(self) -> int:
        return self.runtime.endpoint.reserved_blocks if self.runtime else 0

    def on_other(self, msg: object) -> None:
        if not isinstance(msg, Dial):
            super().on_other(msg)
        elif self.channel is not None and self.runtime is not None:
            self.channel.add_route(msg.peer, msg.host, msg.port)
            self.runtime.connect(msg.peer)

    def on_dispatch(self, d: Dispatch, tg: anyio.abc.TaskGroup) -> None:
        tid = d.transfer_id
        blocks = self.pool.take(self.blocks_for(d.tokens))
        if blocks is None or self.runtime is None:
            self.send(ConsumerResult(tid, False, "no free blocks", 0, None, None, None))
            return
        started = time.perf_counter()
        result = self.runtime.reserve(tid, d.peer, [blocks], mode=self.spec.mode)
        self.caller_reserve.append(time.perf_counter() - started)
        if isinstance(result, Refused):
            self.pool.give(blocks)
            reason = f"refused: {result.reason.value}"
            self.send(ConsumerResult(tid, False, reason, 0, None, None, None))
            return
        self.blocks[tid] = blocks

    def on_event(self, ev: Event, tg: anyio.abc.TaskGroup) -> None:
        if isinstance(ev, Ready):
            started = time.perf_counter()
            tg.start_soon(self._check, ev)  # verification is the demo's, not protocol cost
            self.caller_ready.append(time.perf_counter() - started)
        elif isinstance(ev, Failed):
            detail = f": {ev.detail}" if ev.detail else ""
            self.failures[ev.transfer_id] = f"{ev.reason.value}{detail}"
        elif isinstance(ev, Released):
            self.pool.give(self.blocks.pop(ev.transfer_id, []))
            reason = self.failures.pop(ev.transfer_id, "released")
            tl = ev.timeline
            self.send(
                ConsumerResult(
                    ev.transfer_id, False, reason, 0, tl.reserved, last_write_done(tl), None
                )
            )
        elif isinstance(ev, PeerReady):
            self.send(PeerUp(ev.peer))
        elif isinstance(ev, PeerFailed):
            name = self.spec.name
            self.send(LeaderError(f"{name}: handshake with {ev.peer} failed: {ev.detail}"))

    async def _check(self, ev: Ready) -> None:
        blocks = self.blocks.pop(ev.transfer_id)
        replies = await self.on_ranks(Check(tuple(blocks), self.request_seed(ev.transfer_id)))
        self.pool.give(blocks)
        bad = len({i for reply in replies for i in reply.corrupt})
        tl = ev.timeline
        seen = max((t for _, t in tl.notice_seen), default=None)
        self.send(
            ConsumerResult(
                ev.transfer_id,
                True,
                "",
                bad,
                tl.reserved,
                last_write_done(tl),
                tl.ready,
                seen,
                ops_summary(tl),
                tl.delivered,
            )
        )


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _describe(exc: BaseException) -> str:
    """The first real error inside (possibly nested) exception groups."""
    while True:
        inner = getattr(exc, "exceptions", None)
        if not inner:
            return f"{type(exc).__name__}: {exc}"
        exc = inner[0]


def leader_main(spec: LeaderSpec, rank_conns: list[Connection], conn: Connection) -> None:
    """Process entry point (``multiprocessing`` spawn target): ``rank_conns``
    lead to the instance's ranks, ``conn`` to the supervisor."""
    ignore_sigint()  # the supervisor handles Ctrl-C
    signal.signal(signal.SIGTERM, _terminate)  # until the loop's own handler is up
    leader: Leader
    side = PrefillLeader if spec.role is Role.PRODUCER else DecodeLeader
    leader = side(spec, rank_conns, conn)
    try:
        anyio.run(leader.serve)
    except SystemExit:
        raise
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send(LeaderError(f"{spec.name} leader: {_describe(exc)}"))
        raise SystemExit(1) from None
