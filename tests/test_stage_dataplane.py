"""Staged writes through two real data planes over a transport that moves bytes late.

The fabric here copies a write's rows only when the test says so, reading the
source *then*, as a DMA engine or a remote GET does, and delivers the notice
after the bytes. So a producer slot handed back before its write settled is
overwritten by the next gather before the fabric reads it, and a notice passed
on before its scatter reaches the core while the blocks still hold old bytes.
Both tests fail on such code (shown by patching it in).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvpush.protocol import (
    Codec,
    Completion,
    HeadOrder,
    HeadSlice,
    KVLayout,
    MemoryType,
    Role,
    Route,
    Source,
    Staging,
    StartWrite,
    layer_regions,
)
from kvpush.runtime import (
    Completed,
    CostModel,
    DataPlane,
    HostCopier,
    Notice,
    NoticeIn,
    OpResult,
    PeerRanks,
    Rank,
    Result,
    stage_bytes,
)

HEADS, HEAD_BYTES, TOKENS, BLOCKS, LAYERS = 4, 64, 16, 32, 2
BLOCK = TOKENS * HEADS * HEAD_BYTES
POOL = 1 << 20


class Fabric:
    """Writes wait here until :meth:`deliver` copies them (source read then)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: list[tuple[str, int, np.ndarray, np.ndarray, bytes, str]] = []
        self.transports: dict[str, FabricTransport] = {}

    def deliver(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for src_agent, handle, src, dst, notice, dst_agent in pending:
            for (s, n, _), (d, _, _) in zip(src.tolist(), dst.tolist(), strict=True):
                ctypes.memmove(d, s, n)
            with self.lock:
                if notice:
                    self.transports[dst_agent].notices.append(Notice(src_agent, notice))
                self.transports[src_agent].done.append(Completed(handle))


class FabricTransport:
    def __init__(self, fabric: Fabric, name: str) -> None:
        self.fabric, self.name = fabric, name
        self.notices: list[Notice] = []
        self.done: list[Completed] = []
        self.handles = 0
        fabric.transports[name] = self

    @property
    def agent(self) -> str:
        return self.name

    def register(self, layout: KVLayout) -> None:
        pass

    def metadata(self) -> bytes:
        return self.name.encode()

    def add_peer(self, metadata: bytes, layout: KVLayout | None = None) -> str:
        return metadata.decode()

    def remove_peer(self, agent: str) -> None:
        pass

    def write(self, agent: str, src: np.ndarray, dst: np.ndarray, notice: bytes) -> int:
        self.handles += 1
        with self.fabric.lock:
            self.fabric.pending.append(
                (self.name, self.handles, src.copy(), dst.copy(), notice, agent)
            )
        return self.handles

    def read(self, agent: str, local: np.ndarray, remote: np.ndarray) -> int:
        raise NotImplementedError

    def poll(self) -> tuple[list[Completed], list[Notice]]:
        with self.fabric.lock:
            done, self.done = self.done, []
            notices, self.notices = self.notices, []
        return done, notices

    def close(self) -> None:
        pass


def side(mem: np.ndarray) -> KVLayout:
    base = mem.ctypes.data
    span = 2 * BLOCKS * BLOCK
    regions = layer_regions(
        [base + i * span for i in range(LAYERS)],
        num_blocks=BLOCKS,
        tokens_per_block=TOKENS,
        num_heads=HEADS,
        head_bytes=HEAD_BYTES,
        order=HeadOrder.HND,
        memory=MemoryType.DRAM,
        packing="interleaved",
    )
    return KVLayout(
        regions, Staging(base=base + LAYERS * span, nbytes=POOL, memory=MemoryType.DRAM)
    )


def block_bytes(mem: np.ndarray, layout: KVLayout, blocks: list[int]) -> np.ndarray:
    base = mem.ctypes.data
    out = []
    for r in layout.regions:
        for b in blocks:
            at = r.base - base + b * r.stride
            out.append(mem[at : at + r.block_len])
    return np.concatenate(out)


class Pair:
    def __init__(self) -> None:
        size = LAYERS * 2 * BLOCKS * BLOCK + POOL
        self.pmem = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        self.dmem = np.zeros(size, dtype=np.uint8)
        self.play, self.dlay = side(self.pmem), side(self.dmem)
        self.fabric = Fabric()
        codec = Codec()
        tp, td = FabricTransport(self.fabric, "p0"), FabricTransport(self.fabric, "d0")
        always = CostModel(0.0, 1.0, 0.0, 0.0, 0.0, margin=0.0)  # stage whatever it costs
        self.prod = DataPlane(
            Role.PRODUCER, {0: Rank(tp, self.play)}, 1, codec, copier=HostCopier(), costs=always
        )
        self.cons = DataPlane(
            Role.CONSUMER, {0: Rank(td, self.dlay)}, 1, codec, copier=HostCopier()
        )
        self.results: list[Result] = []
        self.on_notice: Callable[[NoticeIn], None] = lambda n: None
        self.lock = threading.Lock()

        def got(batch: list[Result]) -> None:
            for r in batch:
                if isinstance(r, NoticeIn):
                    self.on_notice(r)
            with self.lock:
                self.results += batch

        self.prod.bind(got)
        self.cons.bind(got)
        self.prod.add_peer(PeerRanks("decode", {0: (b"d0", self.dlay)}, 1))
        self.cons.add_peer(PeerRanks("prefill", {0: (b"p0", self.play)}, 1))
        self.prod.start()
        self.cons.start()

    def write(self, tid: str, src: list[int], dst: list[int], slot: tuple[int, int]) -> None:
        self.cons.stage(tid, 1, [dst], slot)
        route = Route(Source(0), 0, HeadSlice(0, HEADS))
        notice = Completion(tid, 1, Source(0), 0)
        self.prod.submit(
            StartWrite(tid, 1, "decode", route, (tuple(src),), (tuple(dst),),
                       time.monotonic() + 30, notice, stage=slot)
        )  # fmt: skip

    def wait(self, count: int, kind: type) -> list[Result]:
        until = time.monotonic() + 10
        while time.monotonic() < until:
            with self.lock:
                got = [r for r in self.results if isinstance(r, kind)]
            if len(got) >= count:
                return got
            time.sleep(0.002)
        raise AssertionError(f"only {len(got)} {kind.__name__} in time: {self.results}")

    def close(self) -> None:
        self.prod.stop()
        self.cons.stop()


SRC_A, DST_A = [3, 4, 9, 1, 2, 20], [7, 8, 0, 30, 31, 5]
SRC_B, DST_B = [10, 11, 12, 25, 26, 27], [12, 13, 14, 20, 21, 22]


def two_staged_writes(pair: Pair) -> None:
    """Both gathered and posted before the fabric reads either."""
    need = stage_bytes(pair.dlay, [DST_A])
    pair.write("a", SRC_A, DST_A, (0, need))
    pair.write("b", SRC_B, DST_B, (need, need))
    until = time.monotonic() + 10
    while len(pair.fabric.pending) < 2 and time.monotonic() < until:
        time.sleep(0.002)
    assert len(pair.fabric.pending) == 2
    pair.fabric.deliver()
    pair.wait(2, NoticeIn)
    pair.wait(2, OpResult)


def check_landed(pair: Pair) -> None:
    for src, dst in ((SRC_A, DST_A), (SRC_B, DST_B)):
        want = block_bytes(pair.pmem, pair.play, src)
        assert np.array_equal(block_bytes(pair.dmem, pair.dlay, dst), want), "corrupt blocks"


def test_a_producer_slot_is_held_until_its_write_settles() -> None:
    pair = Pair()
    try:
        two_staged_writes(pair)
        check_landed(pair)
        assert pair.prod.stager.staged_writes == 2 and pair.prod.stager.pool_used() == 0
        stamps = [r.stamps for r in pair.results if isinstance(r, OpResult)]
        assert all(s is not None and s.staged == 2 * LAYERS * 6 * BLOCK for s in stamps)
    finally:
        pair.close()


def test_a_slot_released_when_posted_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run with the slot handed back as soon as the write is posted:
    the second gather overwrites the first write's bytes before they move."""
    from kvpush.runtime import _dataplane

    original = _dataplane.DataPlane._post

    def early(self: DataPlane, action: object) -> str | None:
        out = original(self, action)  # type: ignore[arg-type]
        for key, (slot, _) in list(self._borrowed.items()):
            self.stager.settled(slot)
            del self._borrowed[key]
        return out

    monkeypatch.setattr(_dataplane.DataPlane, "_post", early)
    pair = Pair()
    try:
        two_staged_writes(pair)
        with pytest.raises(AssertionError, match="corrupt"):
            check_landed(pair)
    finally:
        pair.close()


@pytest.mark.parametrize("hasty", [False, True], ids=["as-built", "notice-first"])
def test_the_core_hears_a_staged_notice_only_once_its_blocks_hold_the_bytes(
    hasty: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``notice-first`` patches in a data plane that hands the notice on before
    it scatters: the check sees the blocks still empty then."""
    if hasty:
        from kvpush.runtime import _dataplane

        def first(self: DataPlane, item: NoticeIn, results: list[Result]) -> None:
            self._on_results([item])  # the core hears first ...
            self._scatter(item)  # ... and the bytes follow

        monkeypatch.setattr(_dataplane.DataPlane, "_arrived", first)
    pair = Pair()
    seen: list[bool] = []
    want = block_bytes(pair.pmem, pair.play, SRC_A)
    pair.on_notice = lambda n: seen.append(
        bool(np.array_equal(block_bytes(pair.dmem, pair.dlay, DST_A), want))
    )
    try:
        pair.write("a", SRC_A, DST_A, (0, stage_bytes(pair.dlay, [DST_A])))
        until = time.monotonic() + 10
        while not pair.fabric.pending and time.monotonic() < until:
            time.sleep(0.002)
        pair.fabric.deliver()
        (notice,) = pair.wait(1, NoticeIn)
        assert isinstance(notice, NoticeIn) and notice.notice.staged == (6 * TOKENS,)
        assert seen == [not hasty], "the notice reached the core before the scatter"
        assert pair.cons.stager.scatters == 1
    finally:
        pair.close()


def test_a_notice_for_an_unstaged_reservation_is_never_scattered() -> None:
    """Unstaged (its reservation ended) before the notice came: the notice
    waits for a record that never comes, and the blocks are not touched."""
    pair = Pair()
    pair.cons.stager.park_for = 0.05
    try:
        pair.write("a", SRC_A, DST_A, (0, stage_bytes(pair.dlay, [DST_A])))
        pair.cons.unstage("a", 1)
        until = time.monotonic() + 10
        while not pair.fabric.pending and time.monotonic() < until:
            time.sleep(0.002)
        pair.fabric.deliver()
        pair.wait(1, OpResult)
        until = time.monotonic() + 5
        while pair.cons.stager.dropped_notices == 0 and time.monotonic() < until:
            time.sleep(0.01)
        assert pair.cons.stager.dropped_notices == 1 and pair.cons.stager.scatters == 0
        assert not block_bytes(pair.dmem, pair.dlay, DST_A).any()
        assert not [r for r in pair.results if isinstance(r, NoticeIn)]
    finally:
        pair.close()


def test_the_cost_model_measures_the_copier_and_writes_dram_in_place() -> None:
    """No model given: the data plane measures its copier on its own pool at
    start and pairs it with the DRAM transport's figures; on host memory a
    write of whole 48 KiB runs is cheaper in place, so it goes direct."""
    pair = Pair()
    pair.prod.stop()
    codec = Codec()
    tp = FabricTransport(pair.fabric, "p1")
    dp = DataPlane(Role.PRODUCER, {0: Rank(tp, pair.play)}, 1, codec, copier=HostCopier())
    try:
        dp.bind(pair.results.extend)
        dp.add_peer(PeerRanks("decode", {0: (b"d0", pair.dlay)}, 1))
        dp.start()
        until = time.monotonic() + 10
        while dp.stager.costs is None and time.monotonic() < until:
            time.sleep(0.005)
        costs = dp.stager.costs
        assert costs is not None and costs.copy_byte > 0 and costs.row == 0.9e-6
        pair.cons.stage("a", 1, [DST_A], (0, stage_bytes(pair.dlay, [DST_A])))
        route = Route(Source(0), 0, HeadSlice(0, HEADS))
        dp.submit(StartWrite("a", 1, "decode", route, ((3, 4, 5),), ((7, 8, 9),),
                             time.monotonic() + 30, Completion("a", 1, Source(0), 0),
                             stage=(0, 1 << 16)))  # fmt: skip
        until = time.monotonic() + 10
        while not pair.fabric.pending and time.monotonic() < until:
            time.sleep(0.002)
        pair.fabric.deliver()
        pair.wait(1, NoticeIn)
        assert dp.stager.direct_writes == 1 and dp.stager.staged_writes == 0
    finally:
        dp.stop()
        pair.cons.stop()


def _increments(pair: Pair, squeeze: bool) -> None:
    """A progressive source in two increments (its first three blocks, then the
    rest with the notice); ``squeeze``: the producer's pool is full when the
    second comes, so it goes in place and the notice names the staged prefix."""
    slot = (0, stage_bytes(pair.dlay, [DST_A]))
    pair.cons.stage("p", 1, [DST_A], slot)
    route = Route(Source(0), 0, HeadSlice(0, HEADS))
    until = time.monotonic() + 30
    first = StartWrite("p", 1, "decode", route, (tuple(SRC_A[:3]),), (tuple(DST_A),), until,
                       None, stage=slot)  # fmt: skip
    pair.prod.submit(first)
    deadline = time.monotonic() + 10
    while not pair.fabric.pending and time.monotonic() < deadline:
        time.sleep(0.002)
    pair.fabric.deliver()  # the first lands (no notice: an increment)
    pair.wait(1, OpResult)
    pool = pair.prod.stager._pools[0]
    if squeeze:  # other writes hold the whole pool now
        assert pool.take(pool.pages * pool.page) is not None
    last = StartWrite("p", 1, "decode", route, (tuple(SRC_A),), (tuple(DST_A),), until,
                      Completion("p", 1, Source(0), 0), first=(3,), stage=slot)  # fmt: skip
    pair.prod.submit(last)
    while len(pair.fabric.pending) < 1 and time.monotonic() < deadline:
        time.sleep(0.002)
    pair.fabric.deliver()
    (notice,) = pair.wait(1, NoticeIn)
    assert isinstance(notice, NoticeIn)
    got = block_bytes(pair.dmem, pair.dlay, DST_A)
    assert np.array_equal(got, block_bytes(pair.pmem, pair.play, SRC_A)), "corrupt blocks"
    prefix = 3 * TOKENS if squeeze else 6 * TOKENS
    assert notice.notice.staged == (prefix,)
    assert pair.prod.stager.staged_writes == (1 if squeeze else 2)


@pytest.mark.parametrize("squeeze", [False, True], ids=["both-staged", "second-in-place"])
def test_a_progressive_source_goes_staged_or_keeps_its_staged_prefix(squeeze: bool) -> None:
    pair = Pair()
    try:
        _increments(pair, squeeze)
    finally:
        pair.close()
