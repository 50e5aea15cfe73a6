"""A producer and a consumer runtime on loopback, for an integrator's tests.

:func:`loopback_pair` builds both sides of a real handoff in one process: the
pumps (:class:`~kvpush.runtime.ProducerRuntime`,
:class:`~kvpush.runtime.ConsumerRuntime`), a TCP control channel each on
127.0.0.1 (free ports the OS picks), one shared-memory transport per rank
(:class:`~kvpush.shm.ShmTransport`, checked writes by default) and the data
planes, shaken hands and pumping. It is an anyio context manager (any
backend); ``kvpush.testing.pytest_plugin`` serves it as pytest-asyncio
fixtures. See docs/testing.md, "A runtime pair on loopback".
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import numpy as np

from kvpush.protocol import (
    Codec,
    ConfigError,
    Consumer,
    ConsumerConfig,
    Event,
    HeadOrder,
    Identity,
    KVLayout,
    MemoryType,
    PeerReady,
    Producer,
    ProducerConfig,
    Region,
    Role,
    Timing,
    layer_regions,
)
from kvpush.runtime import (
    ConsumerRuntime,
    ControlChannel,
    DataPlane,
    EndpointRuntime,
    ProducerRuntime,
    Rank,
    encode_rank,
)
from kvpush.shm import ShmTransport

__all__ = ("LoopbackConfig", "LoopbackPair", "LoopbackSide", "kv_pattern", "loopback_pair")

R = TypeVar("R", bound=EndpointRuntime[Any])

#: The control channels listen here, on ports the OS picks.
HOST = "127.0.0.1"

#: A ``max_transit`` that a loaded test machine's pauses stay far below.
_TIMING = Timing(max_transit=10.0)


@dataclass(frozen=True, slots=True)
class LoopbackConfig:
    """The shape of a loopback pair. Each side has ``*_tp`` ranks, one
    shared-memory segment each, holding ``num_layers`` K and V regions of
    ``num_blocks`` blocks of ``*_tokens_per_block`` tokens (HND, DRAM), its share
    of ``num_kv_heads`` heads of ``head_bytes`` bytes per token.

    ``timing`` and ``ready_timeout`` go to both endpoints' configs, and each
    channel's ``max_age`` is ``timing.max_transit / 2`` (the default
    ``max_transit`` of 10 s keeps the pumps' stall rule, at
    ``max_transit / 2``, out of a test on a loaded machine); ``secret``
    authenticates the control frames (``None``: a random one per pair);
    ``verify`` checks every write's CRC on both ends; ``transport`` is the
    transport class (a subclass of :class:`ShmTransport`, called as
    ``transport(agent, size, verify=verify)``); ``handshake``: connect and
    wait for both sides' :class:`~kvpush.protocol.PeerReady` before the pair
    is handed out (``False``: the first reservation shakes hands).
    """

    producer_tp: int = 1
    consumer_tp: int = 1
    producer_tokens_per_block: int = 16
    consumer_tokens_per_block: int = 16
    num_blocks: int = 32
    num_layers: int = 2
    num_kv_heads: int = 4
    head_bytes: int = 16
    producer_name: str = "prefill"
    consumer_name: str = "decode"
    timing: Timing = _TIMING
    ready_timeout: float = 30.0
    secret: bytes | None = None
    verify: bool = True
    transport: type[ShmTransport] = ShmTransport
    handshake: bool = True

    def __post_init__(self) -> None:
        for name in (
            "producer_tp",
            "consumer_tp",
            "producer_tokens_per_block",
            "consumer_tokens_per_block",
            "num_blocks",
            "num_layers",
            "num_kv_heads",
            "head_bytes",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        for tp in (self.producer_tp, self.consumer_tp):
            if self.num_kv_heads % tp:
                raise ConfigError(f"num_kv_heads {self.num_kv_heads} is not divisible by TP {tp}")
        if self.producer_name == self.consumer_name:
            raise ConfigError("the two sides need different names")
        if not (isinstance(self.transport, type) and issubclass(self.transport, ShmTransport)):
            raise ConfigError(f"transport must be ShmTransport or a subclass: {self.transport!r}")

    def tp(self, role: Role) -> int:
        return self.producer_tp if role is Role.PRODUCER else self.consumer_tp

    def tokens_per_block(self, role: Role) -> int:
        return (
            self.producer_tokens_per_block
            if role is Role.PRODUCER
            else self.consumer_tokens_per_block
        )

    def rank_layout(self, role: Role, rank: int) -> KVLayout:
        """Rank ``rank``'s KV layout on ``role``'s side (its heads only)."""
        tp, tokens = self.tp(role), self.tokens_per_block(role)
        heads = self.num_kv_heads // tp
        block_len = tokens * heads * self.head_bytes
        span = 2 * self.num_blocks * block_len
        return KVLayout(
            layer_regions(
                [i * span for i in range(self.num_layers)],
                num_blocks=self.num_blocks,
                tokens_per_block=tokens,
                num_heads=heads,
                head_bytes=self.head_bytes,
                head_start=rank * heads,
                order=HeadOrder.HND,
                memory=MemoryType.DRAM,
            )
        )


def kv_pattern(layer: int, kind: str, token: np.ndarray, head: np.ndarray) -> np.ndarray:
    """The byte :meth:`LoopbackSide.fill` writes for (layer, K or V, absolute
    token, global head): the same on both sides whatever their TP and block
    size, so a consumer's blocks can be checked after any re-layout."""
    out: np.ndarray = ((layer * 31 + (kind == "V") * 17 + token * 7 + head * 13) % 251).astype(
        np.uint8
    )
    return out


def _region_view(memory: np.ndarray, region: Region) -> np.ndarray:
    """(blocks, heads, tokens, head_bytes) view of an HND region."""
    base, stride, n = region.base, region.stride, region.num_blocks
    rows = memory[base : base + n * stride].reshape(n, stride)[:, : region.block_len]
    return rows.reshape(n, region.num_heads, region.tokens_per_block, region.head_bytes)


@dataclass(eq=False)
class LoopbackSide(Generic[R]):
    """One side of a pair: its pump, channel, port, data plane, transports
    (rank order) and layouts, and the events :meth:`wait_for` has gathered."""

    name: str
    runtime: R
    channel: ControlChannel
    port: int
    dataplane: DataPlane
    transports: tuple[ShmTransport, ...]
    layouts: tuple[KVLayout, ...]
    #: Every event :meth:`wait_for` took from the runtime, oldest first.
    events: list[Event] = field(default_factory=list)

    async def wait_for(
        self, kinds: type | tuple[type, ...], n: int = 1, *, timeout: float = 10.0
    ) -> list[Event]:
        """Take the runtime's events into :attr:`events` until ``n`` of them
        are instances of ``kinds`` (counting those already there); return
        those. Raises :class:`TimeoutError` after ``timeout`` seconds."""
        with anyio.fail_after(timeout):
            while sum(isinstance(e, kinds) for e in self.events) < n:
                self.events += await self.runtime.next_events(1.0)
        return [e for e in self.events if isinstance(e, kinds)]

    def fill(self, blocks: Sequence[int]) -> None:
        """Write :func:`kv_pattern` into ``blocks`` of every rank, as one
        request's KV: tokens numbered from 0 across the blocks in order."""
        for transport, layout in zip(self.transports, self.layouts, strict=True):
            for r in layout.regions:
                view = _region_view(transport.memory, r)
                heads = r.head_start + np.arange(r.num_heads)
                tok = np.arange(r.tokens_per_block)
                for i, b in enumerate(blocks):
                    v = kv_pattern(
                        r.layer, r.kind, (i * r.tokens_per_block + tok)[None, :], heads[:, None]
                    )
                    view[b] = v[:, :, None]

    def check(self, blocks: Sequence[int], skip_tokens: int = 0) -> None:
        """Assert that ``blocks`` of every rank hold :func:`kv_pattern` for
        one request's tokens from ``skip_tokens`` on (what the other side's
        :meth:`fill` wrote, moved). Raises :class:`AssertionError` naming the
        first rank, region and block that differ."""
        for rank, (transport, layout) in enumerate(zip(self.transports, self.layouts, strict=True)):
            for r in layout.regions:
                view = _region_view(transport.memory, r)
                heads = r.head_start + np.arange(r.num_heads)
                tok = np.arange(r.tokens_per_block)
                for i, b in enumerate(blocks):
                    first = skip_tokens + i * r.tokens_per_block
                    want = kv_pattern(r.layer, r.kind, (first + tok)[None, :], heads[:, None])
                    if not np.array_equal(
                        view[b], np.broadcast_to(want[:, :, None], view[b].shape)
                    ):
                        raise AssertionError(
                            f"{self.name} rank {rank}: layer {r.layer} {r.kind} block {b} "
                            f"does not hold tokens {first}.. of the request"
                        )


@dataclass(eq=False)
class LoopbackPair:
    """Both sides; the consumer's channel routes :attr:`producer`'s name to
    its port. ``producer.runtime.kv_ready(...)`` and
    ``consumer.runtime.reserve(pair.producer.name, ...)`` drive a transfer."""

    config: LoopbackConfig
    producer: LoopbackSide[ProducerRuntime]
    consumer: LoopbackSide[ConsumerRuntime]


async def _parts(
    stack: AsyncExitStack, config: LoopbackConfig, role: Role, codec: Codec
) -> tuple[str, ControlChannel, int, tuple[ShmTransport, ...], tuple[KVLayout, ...], DataPlane]:
    name = config.producer_name if role is Role.PRODUCER else config.consumer_name
    tp = config.tp(role)
    layouts = tuple(config.rank_layout(role, r) for r in range(tp))
    size = max(r.base + r.num_blocks * r.stride for r in layouts[0].regions)
    transports = []
    for r in range(tp):
        transport = config.transport(f"{name}-r{r}", size, verify=config.verify)
        stack.callback(transport.close)
        transports.append(transport)
    ranks = {r: Rank(transports[r], layouts[r]) for r in range(tp)}
    dataplane = DataPlane(role, ranks, tp, codec)
    # Half the budget ages out in the sender's queue; the pump's stall_limit is the rest.
    max_age = config.timing.max_transit / 2
    channel = await stack.enter_async_context(ControlChannel(name, codec, max_age=max_age))
    port = await channel.listen(HOST, 0)
    return name, channel, port, tuple(transports), layouts, dataplane


def _identity(
    config: LoopbackConfig,
    role: Role,
    name: str,
    transports: tuple[ShmTransport, ...],
    layouts: tuple[KVLayout, ...],
) -> Identity:
    blobs = tuple(
        encode_rank(t.metadata(), lay) for t, lay in zip(transports, layouts, strict=True)
    )
    instance = 1 if role is Role.PRODUCER else 2
    return Identity(
        name,
        instance,
        tp=config.tp(role),
        num_kv_heads=config.num_kv_heads,
        layout=layouts[0],
        ranks=blobs,
    )


@asynccontextmanager
async def loopback_pair(config: LoopbackConfig | None = None) -> AsyncIterator[LoopbackPair]:
    """Build, start and (with ``config.handshake``) connect a pair; stop it
    and free its memory on exit. The pumps run in a task group this context
    owns: enter and exit it in one task (an anyio fixture or ``async with``
    in the test; the pytest-asyncio fixtures hold it in a task of their own)."""
    config = LoopbackConfig() if config is None else config
    codec = Codec(secret=config.secret if config.secret is not None else secrets.token_bytes(32))
    async with AsyncExitStack() as stack:
        pname, pchannel, pport, ptransports, playouts, pdata = await _parts(
            stack, config, Role.PRODUCER, codec
        )
        cname, cchannel, cport, ctransports, clayouts, cdata = await _parts(
            stack, config, Role.CONSUMER, codec
        )
        pident = _identity(config, Role.PRODUCER, pname, ptransports, playouts)
        cident = _identity(config, Role.CONSUMER, cname, ctransports, clayouts)
        producer = ProducerRuntime(
            Producer(ProducerConfig(pident, config.timing, kv_hold_timeout=config.ready_timeout)),
            pchannel,
            pdata,
        )
        consumer = ConsumerRuntime(
            Consumer(ConsumerConfig(cident, config.timing, ready_timeout=config.ready_timeout)),
            cchannel,
            cdata,
        )
        pair = LoopbackPair(
            config,
            LoopbackSide(pname, producer, pchannel, pport, pdata, ptransports, playouts),
            LoopbackSide(cname, consumer, cchannel, cport, cdata, ctransports, clayouts),
        )
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        await tg.start(producer.run)
        await tg.start(consumer.run)
        cchannel.add_route(pname, HOST, pport)
        if config.handshake:
            consumer.connect(pname)
            await pair.consumer.wait_for(PeerReady)
            await pair.producer.wait_for(PeerReady)
        yield pair
