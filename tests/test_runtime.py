"""The runtime end to end in one process: two pumps, a real TCP control
channel on loopback and the shared-memory transport; bytes verified."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass

import anyio
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvpush.protocol import (
    Codec,
    Completion,
    Consumer,
    ConsumerConfig,
    Event,
    HeadOrder,
    Identity,
    KVLayout,
    KvpushError,
    MemoryType,
    Mode,
    Producer,
    ProducerConfig,
    Ready,
    Released,
    Role,
    Source,
    SourceReleased,
    Timeline,
    Timing,
    layer_regions,
)
from kvpush.runtime import (
    Completed,
    ConsumerRuntime,
    ControlChannel,
    DataPlane,
    EndpointMetrics,
    Notice,
    NoticeIn,
    PeerRanks,
    ProducerRuntime,
    Rank,
    encode_rank,
)
from kvpush.shm import ShmTransport
from kvpush.testing import LoopbackConfig, loopback_pair

pytestmark = pytest.mark.anyio

HEADS, HEAD_BYTES, LAYERS, BLOCKS = 4, 16, 2, 32
SECRET = b"runtime-test-shared-secret-0123456"


def rank_layout(tp: int, rank: int, tokens: int) -> KVLayout:
    heads = HEADS // tp
    block_len = tokens * heads * HEAD_BYTES
    span = 2 * BLOCKS * block_len
    return KVLayout(
        layer_regions(
            [i * span for i in range(LAYERS)],
            num_blocks=BLOCKS,
            tokens_per_block=tokens,
            num_heads=heads,
            head_bytes=HEAD_BYTES,
            head_start=rank * heads,
            order=HeadOrder.HND,
            memory=MemoryType.DRAM,
        )
    )


def region_view(mem: np.ndarray, r: object) -> np.ndarray:
    """(blocks, heads, tokens, head_bytes) view of an HND region."""
    base, stride, n = r.base, r.stride, r.num_blocks  # type: ignore[attr-defined]
    rows = mem[base : base + n * stride].reshape(n, stride)[:, : r.block_len]  # type: ignore[attr-defined]
    return rows.reshape(n, r.num_heads, r.tokens_per_block, r.head_bytes)  # type: ignore[attr-defined]


def value(layer: int, kind: str, token: np.ndarray, head: np.ndarray) -> np.ndarray:
    """The KV byte of (layer, kind, absolute token, global head): any mix works."""
    return ((layer * 31 + (kind == "V") * 17 + token * 7 + head * 13) % 251).astype(np.uint8)


class PreppedShm(ShmTransport):
    """Shared memory posted by index: drives the data plane's prepped path
    (the one NIXL takes) with data verified by the same checks."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lists: dict[tuple[str, object], tuple[np.ndarray, np.ndarray]] = {}
        self.prepped_posts = 0

    def prefers_prepped(self, merged_rows: int, pieces: int) -> bool:
        return True

    def prep(self, agent: str, key: object, local: np.ndarray, remote: np.ndarray) -> None:
        assert (agent, key) not in self.lists, "prepared twice"
        self.lists[(agent, key)] = (local, remote)

    def write_prepped(
        self, agent: str, key: object, local: np.ndarray, remote: np.ndarray, notice: bytes
    ) -> int:
        mine, theirs = self.lists[(agent, key)]
        self.prepped_posts += 1
        return self.write(agent, mine[local], theirs[remote], notice)

    def read_prepped(self, agent: str, key: object, local: np.ndarray, remote: np.ndarray) -> int:
        mine, theirs = self.lists[(agent, key)]
        self.prepped_posts += 1
        return self.read(agent, mine[local], theirs[remote])


@dataclass
class Side:
    runtime: ProducerRuntime | ConsumerRuntime
    transports: list[ShmTransport]
    layouts: list[KVLayout]
    port: int


def fill(s: Side, blocks: list[int]) -> None:
    """Producer KV: every block of ``blocks`` holds tokens from 0 upwards."""
    for t, layout in zip(s.transports, s.layouts, strict=True):
        for r in layout.regions:
            view = region_view(t.memory, r)
            tok = np.arange(r.tokens_per_block)
            for i, b in enumerate(blocks):
                heads = r.head_start + np.arange(r.num_heads)
                v = value(r.layer, r.kind, (i * r.tokens_per_block + tok)[None, :], heads[:, None])
                view[b] = v[:, :, None]


def check(s: Side, blocks: list[int], skip_tokens: int = 0) -> None:
    for t, layout in zip(s.transports, s.layouts, strict=True):
        for r in layout.regions:
            view = region_view(t.memory, r)
            tok = np.arange(r.tokens_per_block)
            for i, b in enumerate(blocks):
                heads = r.head_start + np.arange(r.num_heads)
                first = skip_tokens + i * r.tokens_per_block
                want = value(r.layer, r.kind, (first + tok)[None, :], heads[:, None])
                assert np.array_equal(view[b], np.broadcast_to(want[:, :, None], view[b].shape))


def check_stamps(mode: Mode, p: Timeline, c: Timeline) -> None:
    """The moments between KV ready and Ready, each where its name says, in
    order: the mover's data plane planned, posted and saw each op settle;
    the consumer's data plane saw each notice (push) after its write was
    posted; the caller got the Ready after all of it."""
    pairs = {pair for pair, _ in c.write_done}
    assert pairs and c.ready is not None and c.delivered is not None
    assert p.kv_ready is not None and p.write_started is not None
    ops = dict(p.ops if mode is Mode.PUSH else c.ops)
    assert set(ops) == pairs
    for st in ops.values():
        assert p.write_started <= st.plan_started <= st.planned <= st.posted <= st.done
    if mode is Mode.PUSH:
        seen = dict(c.notice_seen)
        assert set(seen) == pairs
        assert all(ops[pair].posted <= t <= c.ready for pair, t in seen.items())
    else:
        assert not c.notice_seen
        assert all(st.done <= c.ready for st in ops.values())
    assert p.kv_ready <= p.write_started <= c.ready <= c.delivered


@pytest.mark.parametrize("prepped", [False, True], ids=["rows", "prepped"])
@pytest.mark.parametrize(
    ("p_tp", "d_tp", "p_tokens", "d_tokens", "mode"),
    [
        (1, 1, 16, 16, Mode.PUSH),
        (2, 1, 16, 16, Mode.PUSH),
        (1, 2, 16, 16, Mode.PUSH),
        (1, 1, 16, 8, Mode.PUSH),
        (2, 1, 16, 16, Mode.PULL),
        (1, 2, 8, 16, Mode.PULL),
    ],
)
async def test_transfers_over_tcp_and_shared_memory(
    p_tp: int, d_tp: int, p_tokens: int, d_tokens: int, mode: Mode, prepped: bool
) -> None:
    """The kit's loopback pair (kvpush.testing.loopback_pair, what its
    pytest-asyncio fixtures serve), without the handshake up front: the
    first reservation shakes hands."""
    config = LoopbackConfig(
        producer_tp=p_tp,
        consumer_tp=d_tp,
        producer_tokens_per_block=p_tokens,
        consumer_tokens_per_block=d_tokens,
        num_blocks=BLOCKS,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_bytes=HEAD_BYTES,
        secret=SECRET,
        timing=Timing(),
        transport=PreppedShm if prepped else ShmTransport,
        handshake=False,
    )
    async with loopback_pair(config) as pair:
        prod, cons = pair.producer, pair.consumer
        tokens = 64
        src_blocks = [5, 9, 10, 11, 0, 1, 2, 30][: tokens // p_tokens]  # fragmented
        dst_blocks = [20, 3, 4, 17, 30, 31, 1, 2][: tokens // d_tokens]
        prod.fill(src_blocks)
        # Reserve first (decode registers while prefill still computes) ...
        cons.runtime.reserve("req-1", prod.name, [dst_blocks], mode=mode)
        await anyio.sleep(0.05)
        # ... then the KV becomes ready.
        prod.runtime.kv_ready("req-1", [src_blocks])
        (ready,) = await cons.wait_for(Ready)
        cons.check(dst_blocks)
        (released,) = await prod.wait_for(SourceReleased)
        seen, pseen = cons.events, prod.events
        assert isinstance(released, SourceReleased) and isinstance(ready, Ready)
        assert released.outcome.value == "delivered"
        assert ready.timeline.ready is not None and ready.timeline.registration_sent is not None
        check_stamps(mode, released.timeline, ready.timeline)
        assert cons.runtime.endpoint.reserved_blocks == 0
        assert prod.runtime.endpoint.held_blocks == 0
        assert not [e for e in seen if isinstance(e, Released)]
        # The same events feed Prometheus metrics named like vLLM's.
        registry = CollectorRegistry()
        metrics = EndpointMetrics(prod.runtime.endpoint, prod.dataplane, registry=registry)
        for e in pseen:
            metrics.observe(e)
        text = generate_latest(registry).decode()
        assert (
            'kvpush:transfers_total{engine="prefill",outcome="delivered",role="producer"} 1.0'
            in text
        )
        assert 'kvpush:blocks{engine="prefill",kind="held",role="producer"} 0.0' in text
        decode = CollectorRegistry()
        EndpointMetrics(cons.runtime.endpoint, cons.dataplane, registry=decode)
        for kind in ("reserved", "suspect"):
            labels = {"role": "consumer", "engine": cons.runtime.endpoint.identity.engine_id}
            assert decode.get_sample_value("kvpush:blocks", {**labels, "kind": kind}) == 0
        moved = registry.get_sample_value(
            "kvpush:transfer_bytes_total", {"role": "producer", "engine": "prefill"}
        )
        assert moved is not None
        assert (moved > 0) == (mode is Mode.PUSH)  # in pull the consumer moves the bytes
        # Shared memory has no copier, so nothing is staged: every write in place.
        labels = {"role": "producer", "engine": "prefill"}
        writes = registry.get_sample_value("kvpush:writes_total", {**labels, "path": "direct"})
        assert writes == (prod.dataplane.posted if mode is Mode.PUSH else 0)
        assert registry.get_sample_value("kvpush:writes_total", {**labels, "path": "staged"}) == 0
        assert registry.get_sample_value("kvpush:staging_bytes", labels) == 0
        # Prepped: every transfer went by index, each route's lists prepared once.
        mover = prod if mode is Mode.PUSH else cons
        posts = [t.prepped_posts for t in mover.transports if isinstance(t, PreppedShm)]
        dp = mover.dataplane
        assert dp.posted_prepped == (dp.posted if prepped else 0)
        assert sum(posts) == (dp.posted if prepped else 0)
        assert dp.posted > 0


async def build(
    stack: AsyncExitStack,
    role: Role,
    name: str,
    tp: int,
    tokens: int = 16,
    verify: bool = False,
    prepped: bool = False,
) -> tuple[object, Side]:
    """A side's parts, its pump not yet started (the caller or the facade starts it)."""
    codec = Codec(secret=SECRET)
    layouts = [rank_layout(tp, r, tokens) for r in range(tp)]
    size = max(r.base + r.num_blocks * r.stride for r in layouts[0].regions)
    kind = PreppedShm if prepped else ShmTransport
    transports = [kind(f"{name}-r{r}", size, verify=verify) for r in range(tp)]
    for t in transports:
        stack.callback(t.close)
    dataplane = DataPlane(role, {r: Rank(transports[r], layouts[r]) for r in range(tp)}, tp, codec)
    blobs = tuple(encode_rank(transports[r].metadata(), layouts[r]) for r in range(tp))
    identity = Identity(name, 9, tp=tp, num_kv_heads=HEADS, layout=layouts[0], ranks=blobs)
    channel = await stack.enter_async_context(ControlChannel(name, codec))
    port = await channel.listen("127.0.0.1", 0)
    runtime: ProducerRuntime | ConsumerRuntime
    if role is Role.PRODUCER:
        runtime = ProducerRuntime(Producer(ProducerConfig(identity)), channel, dataplane)
    else:
        runtime = ConsumerRuntime(Consumer(ConsumerConfig(identity)), channel, dataplane)
    return runtime, Side(runtime, transports, layouts, port)


def test_sync_facade_from_several_threads() -> None:
    """Engines with their own loops: each side's loop runs in a background
    thread; eight caller threads reserve and publish KV concurrently."""
    import threading

    from kvpush.runtime import SyncRuntime

    sides: dict[str, Side] = {}

    def setup(role: Role, name: str, tp: int):  # type: ignore[no-untyped-def]
        async def make(stack: AsyncExitStack) -> object:
            runtime, s = await build(stack, role, name, tp)
            sides[name] = s
            return runtime

        return make

    with (
        SyncRuntime(setup(Role.PRODUCER, "prefill", 2)) as prod,
        SyncRuntime(setup(Role.CONSUMER, "decode", 1)) as cons,
    ):
        consumer, producer = sides["decode"].runtime, sides["prefill"].runtime
        cons.call(consumer.channel.add_route, "prefill", "127.0.0.1", sides["prefill"].port)  # type: ignore[attr-defined]
        n = 8
        src = {i: [2 * i, 2 * i + 1] for i in range(n)}
        dst = {i: [31 - 2 * i, 30 - 2 * i] for i in range(n)}
        fill(sides["prefill"], [b for i in range(n) for b in src[i]])  # 2 blocks each
        errors: list[BaseException] = []

        def client(i: int) -> None:
            try:
                cons.call(consumer.reserve, f"req-{i}", "prefill", [dst[i]])  # type: ignore[attr-defined]
                prod.call(producer.kv_ready, f"req-{i}", [src[i]])  # type: ignore[attr-defined]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not errors
        ready: set[str] = set()
        deadline = 200
        while len(ready) < n and deadline:
            ready |= {e.transfer_id for e in cons.wait_events(0.05) if isinstance(e, Ready)}
            deadline -= 1
        assert ready == {f"req-{i}" for i in range(n)}
        # fill() numbered tokens across the concatenated source blocks, so
        # block k of request i holds tokens (2 i + k) * 16 onwards.
        for t, layout in zip(sides["decode"].transports, sides["decode"].layouts, strict=True):
            for r in layout.regions:
                view = region_view(t.memory, r)
                heads = r.head_start + np.arange(r.num_heads)
                tok = np.arange(r.tokens_per_block)
                for i in range(n):
                    for k, b in enumerate(dst[i]):
                        first = (2 * i + k) * r.tokens_per_block
                        want = value(r.layer, r.kind, (first + tok)[None, :], heads[:, None])
                        assert np.array_equal(
                            view[b], np.broadcast_to(want[:, :, None], view[b].shape)
                        )


class _SilentChannel:
    """A channel that accepts frames and never delivers any."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def send_nowait(self, peer: str, message: object) -> None:
        self.sent.append(message)

    async def events(self) -> AsyncIterator[object]:
        await anyio.sleep_forever()
        yield  # pragma: no cover


async def test_the_pump_sleeps_until_its_deadline_and_never_spins() -> None:
    """Inputs wake the timer task only when they bring the deadline forward;
    the timer fires on time; results posted from another thread wake the loop
    without waiting for it."""
    channel = _SilentChannel()
    config = ConsumerConfig(Identity("decode", 1), ready_timeout=0.3)
    runtime = ConsumerRuntime(Consumer(config), channel)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(runtime.run)
        runtime.connect("prefill")  # a Hello that is never answered
        for i in range(50):  # each with a deadline later than the first
            runtime.reserve(f"t{i}", "prefill", [[i]])
            await anyio.sleep(0.001)
        await anyio.sleep(0.1)
        assert runtime.timer_wakeups <= 2, runtime.timer_wakeups  # spinning: thousands
        with anyio.fail_after(5):
            seen: list[Event] = []
            while sum(isinstance(e, Released) for e in seen) < 50:
                seen += await runtime.next_events(1.0)
        assert runtime.endpoint.reserved_blocks == 0
        assert runtime.timer_wakeups < 120  # about one per distinct deadline
        # A result from another thread is fed without the thread waiting.
        results = []
        runtime._feed_one = lambda now, r: results.append(r)  # type: ignore[method-assign]
        started = time.perf_counter()
        await anyio.to_thread.run_sync(runtime.post_results, ["x"])  # type: ignore[list-item]
        assert time.perf_counter() - started < 1.0
        with anyio.fail_after(5):
            while not results:
                await anyio.sleep(0.001)
        assert results == ["x"]
        tg.cancel_scope.cancel()


def test_the_stall_watch_only_measures_and_reports_each_gap_to_the_core() -> None:
    """A frame that sat in the kernel while the process was stopped is read
    late; its lease would be measured from then (tests/incidents scenario 4).
    The watch measures the gap and reports it; the core decides (its
    ``stalled()`` input, tests/test_stall.py)."""
    from kvpush.runtime._runtime import StallWatch

    clock = [100.0]
    reported: list[tuple[float, float]] = []
    watch = StallWatch(0.25, lambda: clock[0], lambda now, gap: reported.append((now, gap)))
    for _ in range(10):  # the ticker beats every limit / 5: no stall
        clock[0] += 0.05
        watch.check()
    assert reported == []
    clock[0] += 4.0  # stopped for 4 s
    watch.check()  # the pump checks before it feeds the frame it read
    assert watch.stalls == 1
    assert reported == [(clock[0], pytest.approx(4.0))]
    for _ in range(6):
        clock[0] += 0.05
        watch.check()
    assert watch.stalls == 1 and len(reported) == 1


def test_the_stall_limit_must_be_positive() -> None:
    ident = Identity("p", 1)
    with pytest.raises(KvpushError, match="stall_limit"):
        ProducerRuntime(Producer(ProducerConfig(ident)), _SilentChannel(), stall_limit=0.0)


def test_a_peer_whose_metadata_the_transport_refuses_does_not_end_the_data_plane() -> None:
    """A hello can carry rank descriptions that decode but that the transport
    cannot load (found by the frame fuzz): the peer is logged and left without
    ranks, and the data-plane thread goes on."""
    layout = rank_layout(1, 0, 16)
    size = max(r.base + r.num_blocks * r.stride for r in layout.regions)
    with ShmTransport("dp-r0", size) as transport:
        dataplane = DataPlane(Role.PRODUCER, {0: Rank(transport, layout)}, 1, Codec())
        dataplane.bind(lambda results: None)
        dataplane.start()
        try:
            dataplane.add_peer(PeerRanks("forged", {0: (b"not shm metadata", layout)}, 1))
            time.sleep(0.2)
            assert dataplane.error is None
            assert "forged" not in dataplane._peers
        finally:
            dataplane.stop()


class _NoticesOnly:
    """A consumer rank's transport that only receives the notices typed in."""

    agent = "decode-r0"

    def __init__(self) -> None:
        self.inbox: list[Notice] = []

    def register(self, layout: KVLayout) -> None:
        pass

    def metadata(self) -> bytes:
        return self.agent.encode()

    def add_peer(self, metadata: bytes, layout: KVLayout | None = None) -> str:
        return metadata.decode()

    def remove_peer(self, agent: str) -> None:
        pass

    def write(self, agent: str, src: object, dst: object, notice: bytes) -> int:
        raise AssertionError("not used")

    def read(self, agent: str, local: object, remote: object) -> int:
        raise AssertionError("not used")

    def poll(self) -> tuple[list[Completed], list[Notice]]:
        out, self.inbox = self.inbox, []
        return [], out

    def close(self) -> None:
        pass


def test_the_data_plane_names_the_peer_that_sent_each_notice() -> None:
    """xPyD: a notice is bound to the peer whose handshake introduced the
    agent that delivered it (the core checks it against the reservation); an
    agent nobody introduced is named ``None``, and a second peer claiming an
    agent another peer owns is refused."""
    codec = Codec(secret=SECRET)
    layout = rank_layout(1, 0, 16)
    transport = _NoticesOnly()
    results: list[object] = []
    dataplane = DataPlane(Role.CONSUMER, {0: Rank(transport, layout)}, 1, codec)
    dataplane.bind(results.extend)
    dataplane.add_peer(PeerRanks("prefill-a", {0: (b"a-r0", layout)}, 1))
    dataplane.add_peer(PeerRanks("prefill-b", {0: (b"b-r0", layout)}, 1))
    dataplane.add_peer(PeerRanks("prefill-c", {0: (b"a-r0", layout)}, 1))  # a's agent
    dataplane.start()
    try:
        time.sleep(0.05)
        notice = codec.encode_notice(Completion("t1", 1, Source(0), 0))
        before = time.monotonic()
        transport.inbox = [Notice(a, notice) for a in ("a-r0", "b-r0", "nobody-r0")]
        deadline = time.monotonic() + 5
        while len(results) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        dataplane.stop()
    assert [r.peer for r in results] == ["prefill-a", "prefill-b", None]  # type: ignore[attr-defined]
    assert all(isinstance(r, NoticeIn) and r.seen is not None and r.seen >= before for r in results)
    assert "prefill-c" not in dataplane._peers
