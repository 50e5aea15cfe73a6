"""Handshake liveness on the real runtime (issue 13, 2): two pumps over the TCP
control channel and shared memory, in the two sequences seen live where one
lost hello wedged the pair until every reservation timed out."""

from __future__ import annotations

import logging
import socket
from contextlib import AsyncExitStack
from dataclasses import dataclass

import anyio
import pytest
from test_runtime import HEADS, check, fill, rank_layout

from kvpush.protocol import (
    Codec,
    Consumer,
    ConsumerConfig,
    Event,
    Failed,
    Identity,
    KVLayout,
    PeerState,
    Producer,
    ProducerConfig,
    Ready,
    Role,
    Timing,
)
from kvpush.runtime import (
    Backoff,
    ConsumerRuntime,
    ControlChannel,
    DataPlane,
    ProducerRuntime,
    Rank,
    encode_rank,
)
from kvpush.shm import ShmTransport

pytestmark = pytest.mark.anyio

TOKENS = 16
#: Short channel timers, so an outage outlasts them quickly.
MAX_AGE, PEER_LOST_AFTER = 0.2, 0.5
CODEC = Codec(secret=b"handshake-live-test-secret-012345")
#: A loaded test machine misses a second now and then; a stall limit of
#: max_transit / 2 = 5 s keeps the pumps' stall rule out of these tests.
TIMING = Timing(max_transit=10.0)


@dataclass
class Live:
    runtime: ProducerRuntime | ConsumerRuntime
    transport: ShmTransport
    channel: ControlChannel

    # what test_runtime's fill() and check() read
    @property
    def transports(self) -> list[ShmTransport]:
        return [self.transport]

    @property
    def layouts(self) -> list[KVLayout]:
        return [rank_layout(1, 0, TOKENS)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start(
    stack: AsyncExitStack, role: Role, name: str, shm: str, instance: int, port: int = 0
) -> Live:
    """One side (TP 1, verifying shared memory), pumping; its channel listens on ``port``."""
    layout = rank_layout(1, 0, TOKENS)
    size = max(r.base + r.num_blocks * r.stride for r in layout.regions)
    transport = ShmTransport(shm, size, verify=True)
    stack.callback(transport.close)
    dataplane = DataPlane(role, {0: Rank(transport, layout)}, 1, CODEC)
    blob = encode_rank(transport.metadata(), layout)
    identity = Identity(name, instance, tp=1, num_kv_heads=HEADS, layout=layout, ranks=(blob,))
    channel = await stack.enter_async_context(
        ControlChannel(
            name,
            CODEC,
            max_age=MAX_AGE,
            peer_lost_after=PEER_LOST_AFTER,
            backoff=Backoff(initial=0.05, maximum=0.2),
        )
    )
    await channel.listen("127.0.0.1", port)
    runtime: ProducerRuntime | ConsumerRuntime
    if role is Role.PRODUCER:
        pconfig = ProducerConfig(identity, TIMING, tombstone_ttl=60.0)
        runtime = ProducerRuntime(Producer(pconfig), channel, dataplane)
    else:
        config = ConsumerConfig(identity, TIMING, ready_timeout=20.0)
        runtime = ConsumerRuntime(Consumer(config), channel, dataplane)
    tg = await stack.enter_async_context(anyio.create_task_group())
    await tg.start(runtime.run)
    stack.callback(tg.cancel_scope.cancel)
    return Live(runtime, transport, channel)


class Events:
    """Every event a runtime emitted, gathered as they come."""

    def __init__(self, live: Live) -> None:
        self.live = live
        self.seen: list[Event] = []

    async def ready(self, tids: set[str], timeout: float) -> None:
        with anyio.fail_after(timeout):
            while not tids <= {e.transfer_id for e in self.seen if isinstance(e, Ready)}:
                self.seen += await self.live.runtime.next_events(0.5)

    def failed(self) -> list[Event]:
        return [e for e in self.seen if isinstance(e, Failed)]


def one(live: Live, tid: str, blocks: list[int]) -> None:
    """The prefill computed ``tid``'s KV into ``blocks``."""
    assert isinstance(live.runtime, ProducerRuntime)
    fill(live, blocks)  # type: ignore[arg-type]
    live.runtime.kv_ready(tid, [blocks])


async def test_a_decode_that_reserves_before_its_prefill_listens_still_transfers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The decode reserves first: its hello waits in the channel's queue for a
    prefill that does not listen yet and expires there (``max_age``). The
    prefill comes up; the connection with it sends the hello again, and the
    transfer completes. (Before: nothing was ever sent again; the request
    failed at its deadline with no log line.)"""
    caplog.set_level(logging.INFO, logger="kvpush.runtime")
    port = free_port()
    async with AsyncExitStack() as stack:
        cons = await start(stack, Role.CONSUMER, "decode", "hs-a-decode-r0", 20)
        assert isinstance(cons.runtime, ConsumerRuntime)
        cons.channel.add_route("prefill", "127.0.0.1", port)
        cons.runtime.reserve("req-1", "prefill", [[3, 4]])
        await anyio.sleep(3 * MAX_AGE)  # the hello is too old to send now
        assert cons.runtime.endpoint.peer("prefill").state is PeerState.HELLO_SENT
        prod = await start(stack, Role.PRODUCER, "prefill", "hs-a-prefill-r0", 10, port)
        one(prod, "req-1", [5, 6])  # type: ignore[arg-type]
        events = Events(cons)
        await events.ready({"req-1"}, timeout=8.0)
        check(cons, [3, 4])  # type: ignore[arg-type]
        assert events.failed() == []
        # the first hello died in the queue, unsent
        assert cons.channel.statistics().peers["prefill"].dropped_old >= 1
        stats = cons.runtime.endpoint.stats()
        assert stats.get("hello_resent_on_connect", 0) + stats.get("hello_retry", 0) >= 1
        # The decode's Ready can come before the prefill's pump has seen its
        # own write finish; the source is released soon after, not never.
        with anyio.fail_after(5):
            while prod.runtime.endpoint.held_blocks:
                await anyio.sleep(0.02)


async def test_a_prefill_restart_outlasting_the_loss_timer_with_requests_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The prefill stops and comes back (a new instance on the same port) after
    more than ``peer_lost_after + max_age``; requests arrive meanwhile, and
    their hellos die in the queue. Once the new prefill is up, those requests
    and later ones transfer. (Before: 3 of 3 later requests timed out.)"""
    caplog.set_level(logging.WARNING, logger="kvpush.runtime")
    port = free_port()
    async with AsyncExitStack() as stack:
        cons = await start(stack, Role.CONSUMER, "decode", "hs-b-decode-r0", 20)
        assert isinstance(cons.runtime, ConsumerRuntime)
        cons.channel.add_route("prefill", "127.0.0.1", port)
        events = Events(cons)
        async with AsyncExitStack() as first:
            prod = await start(first, Role.PRODUCER, "prefill", "hs-b-prefill1-r0", 10, port)
            cons.runtime.reserve("before", "prefill", [[1, 2]])
            one(prod, "before", [1, 2])  # type: ignore[arg-type]
            await events.ready({"before"}, timeout=8.0)
        # The prefill is gone; once the channel gives it up (peer_lost_after),
        # requests keep coming, each hello dying in the queue (max_age).
        with anyio.fail_after(5):
            while cons.runtime.endpoint.peer("prefill").state is PeerState.READY:
                await anyio.sleep(0.05)
        during = {"during-1": [3, 4], "during-2": [5, 6], "during-3": [7, 8]}
        for tid, blocks in during.items():
            cons.runtime.reserve(tid, "prefill", [blocks])
            await anyio.sleep(2 * MAX_AGE)
        await anyio.sleep(PEER_LOST_AFTER + MAX_AGE)
        assert cons.runtime.endpoint.peer("prefill").state is PeerState.HELLO_SENT
        prod = await start(stack, Role.PRODUCER, "prefill", "hs-b-prefill2-r0", 11, port)
        for tid, blocks in during.items():
            one(prod, tid, [b + 10 for b in blocks])  # type: ignore[arg-type]
        await events.ready(set(during), timeout=10.0)
        cons.runtime.reserve("after", "prefill", [[9, 10]])
        one(prod, "after", [20, 21])  # type: ignore[arg-type]
        await events.ready({"after"}, timeout=8.0)
        check(cons, [9, 10])  # type: ignore[arg-type]
        assert events.failed() == []
        hello = cons.runtime.endpoint.peer("prefill").hello
        assert hello is not None and hello.instance == 11
