"""Staged transfers: the gather, the spans and the scatter against the reference copy.

Every scenario of the planner's property (tests/test_plan.py: TP and PP shapes,
MLA, both head orders, block ratios, prefix hits, fragmented block tables)
is executed staged: the producer's pieces are gathered into a compact buffer,
its spans copied into the consumer's slot image, and the image scattered into
the consumer's blocks. The result must equal the naive per-cell copy, and
every route into one consumer rank must own disjoint bytes of its slot.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_plan import (
    DST_BASE,
    SRC_BASE,
    Side,
    _settings,
    build_side,
    heads_of,
    make_planner,
    memory,
    reference,
    scenarios,
)

from kvpush.protocol import HeadOrder, Role, compute_topology
from kvpush.runtime import TransferPlanner
from kvpush.runtime._stage import (
    CostModel,
    HostCopier,
    Staged,
    scatter_chunks,
    stage_bytes,
    staged_pieces,
    write_chunks,
)


def gather(staged: Staged, side: Side, mem: np.ndarray) -> np.ndarray:
    """The compact buffer: the pieces back to back, in image order."""
    out = []
    for addr, length, _ in staged.kv.tolist():
        out.append(mem[addr - side.base : addr - side.base + length])
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint8)


def run_staged(
    planner: TransferPlanner,
    src: Side,
    src_mem: np.ndarray,
    dst: Side,
    dst_mem: np.ndarray,
    slot: np.ndarray,
    src_ids: list[list[int]],
    dst_ids: list[list[int]],
    skip: int,
    increments: list[tuple[list[list[int]], tuple[int, ...], bool]] | None = None,
) -> tuple[int, ...]:
    """Producer writes (one, or the increments given), then the consumer's
    scatter of what the last one reports staged."""
    counts = [len(ids) for ids in dst_ids]
    steps = increments or [(src_ids, (), False)]
    reach: tuple[int, ...] = ()
    for blocks, first, partial in steps:
        chunks, reach = write_chunks(planner, blocks, dst_ids, skip, first, partial)
        pieces = staged_pieces(planner, Role.PRODUCER, counts, chunks)
        buffer = gather(pieces, src, src_mem)
        assert buffer.size == pieces.nbytes
        for at, compact, length in zip(*(a.tolist() for a in pieces.spans()), strict=True):
            assert at >= 0 and at + length <= slot.size, "a span leaves the slot"
            slot[at : at + length] = buffer[compact : compact + length]
    chunks_d = scatter_chunks(planner, dst_ids, reach)
    assert not isinstance(chunks_d, str), chunks_d
    landing = staged_pieces(planner, Role.CONSUMER, counts, chunks_d)
    for (addr, length, _), at in zip(landing.kv.tolist(), landing.image.tolist(), strict=True):
        dst_mem[addr - dst.base : addr - dst.base + length] = slot[at : at + length]
    return reach


@_settings
@given(scenarios())
def test_staged_transfer_moves_exactly_the_reference_bytes(case: dict[str, Any]) -> None:
    route, src, dst = case["route"], case["src"], case["dst"]
    src_ids, dst_ids, skip = case["src_ids"], case["dst_ids"], case["skip"]
    planner = make_planner(src, dst, route)
    src_mem = memory(src, 1)
    expected = memory(dst, 2)
    reference(src, src_mem, dst, expected, route.heads, src_ids, dst_ids, skip)
    got = memory(dst, 2)
    slot = np.zeros(stage_bytes(dst.layout, dst_ids), dtype=np.uint8)
    run_staged(planner, src, src_mem, dst, got, slot, src_ids, dst_ids, skip)
    assert np.array_equal(got, expected)


@_settings
@given(scenarios(), st.data())
def test_staged_increments_compose_to_the_whole_transfer(case: dict[str, Any], data: Any) -> None:
    route, src, dst = case["route"], case["src"], case["dst"]
    src_ids, dst_ids, skip = case["src_ids"], case["dst_ids"], case["skip"]
    planner = make_planner(src, dst, route)
    # A progressive source: a whole-block prefix first, the rest last.
    cut = [data.draw(st.integers(0, len(ids)), label=f"cut{g}") for g, ids in enumerate(src_ids)]
    steps = []
    try:
        planner.plan(
            [ids[:c] for ids, c in zip(src_ids, cut, strict=True)],
            dst_ids,
            skip_tokens=skip,
            partial=True,
        )
        steps.append(([ids[:c] for ids, c in zip(src_ids, cut, strict=True)], (), True))
        steps.append((src_ids, tuple(cut), False))
    except Exception:
        steps = [(src_ids, (), False)]
    src_mem = memory(src, 1)
    expected = memory(dst, 2)
    reference(src, src_mem, dst, expected, route.heads, src_ids, dst_ids, skip)
    got = memory(dst, 2)
    slot = np.zeros(stage_bytes(dst.layout, dst_ids), dtype=np.uint8)
    run_staged(planner, src, src_mem, dst, got, slot, src_ids, dst_ids, skip, steps)
    assert np.array_equal(got, expected)


@pytest.mark.parametrize(
    ("p_tp", "p_pp", "c_tp", "heads"),
    [
        (1, 1, 1, 8),
        (2, 1, 1, 8),
        (4, 2, 1, 8),
        (1, 1, 4, 8),
        (2, 2, 4, 8),
        (8, 1, 2, 4),
    ],
)
def test_every_route_into_a_rank_owns_its_own_bytes_of_the_slot(
    p_tp: int, p_pp: int, c_tp: int, heads: int
) -> None:
    topo = compute_topology(p_tp, p_pp, c_tp, heads)
    dst_ids = [[5, 2, 3, 7]]
    for rank in range(c_tp):
        dst = build_side(
            DST_BASE,
            [(16, 8)],
            layers=2 * p_pp,
            packing="interleaved",
            heads=heads_of(c_tp, heads, rank),
            head_bytes=4,
            order=HeadOrder.HND,
            device=rank,
        )
        need = stage_bytes(dst.layout, dst_ids)
        owner = np.full(need, -1)
        routes = [r for r in topo.routes if r.consumer_rank == rank]
        for k, route in enumerate(routes):
            src = build_side(
                SRC_BASE,
                [(16, 8)],
                layers=2 * p_pp,
                packing="interleaved",
                heads=heads_of(p_tp, heads, route.source.tp),
                head_bytes=4,
                order=HeadOrder.HND,
                device=route.source.tp,
                stage=(route.source.pp, p_pp),
            )
            planner = TransferPlanner(src.layout, dst.layout, route)
            chunks, _ = write_chunks(planner, [[0, 1, 2, 3]], dst_ids, 0, (), False)
            pieces = staged_pieces(planner, Role.PRODUCER, [4], chunks)
            for at, _, length in zip(*(a.tolist() for a in pieces.spans()), strict=True):
                assert at + length <= need
                assert (owner[at : at + length] == -1).all(), f"{route} overlaps another route"
                owner[at : at + length] = k
            if p_pp == 1 and len(routes) == 1:
                assert len(pieces.spans()[0]) == 1, "a whole route is one span"
        # Routes of the rank cover its slot exactly: no byte unwritten.
        assert (owner >= 0).all()


def _two_heads(base: int) -> Side:
    return build_side(base, [(16, 8)], layers=1, packing="interleaved", heads=(0, 2),
                      head_bytes=4, order=HeadOrder.HND, device=0)  # fmt: skip


def test_scatter_refuses_a_notice_that_overruns_the_registration() -> None:
    src, dst = _two_heads(SRC_BASE), _two_heads(DST_BASE)
    planner = TransferPlanner(src.layout, dst.layout, compute_topology(1, 1, 1, 2).routes[0])
    assert isinstance(scatter_chunks(planner, [[1, 2]], (48,)), str)
    assert isinstance(scatter_chunks(planner, [[1, 2]], (8,)), str)  # not whole chunks
    assert isinstance(scatter_chunks(planner, [[1, 2]], (16, 16)), str)
    assert not isinstance(scatter_chunks(planner, [[1, 2]], (32,)), str)


# --- the host copier ------------------------------------------------------------------


def rows_of(buf: np.ndarray, offsets: list[int], length: int) -> np.ndarray:
    base = buf.ctypes.data
    return np.array([[base + o, length, 0] for o in offsets], dtype=np.uint64)


@pytest.mark.parametrize("length", [1, 7, 8, 24, 4096, 1 << 18])
@pytest.mark.parametrize("count", [3, 200])
def test_host_copier_copies_every_row_and_nothing_else(length: int, count: int) -> None:
    rng = np.random.default_rng(length + count)
    src = rng.integers(0, 256, length * count * 3, dtype=np.uint8)
    dst = np.zeros(length * count * 2 + 16, dtype=np.uint8)
    s_off = (rng.permutation(count * 3)[:count] * length).tolist()
    d_off = (rng.permutation(count * 2)[:count] * length + 8 * (length % 8 == 0)).tolist()
    d_off = [min(o, dst.size - length) for o in d_off]
    d_off = sorted(set(d_off))[:count] if len(set(d_off)) < count else d_off
    n = len(d_off)
    expected = dst.copy()
    for s, d in zip(s_off[:n], d_off, strict=True):
        expected[d : d + length] = src[s : s + length]
    HostCopier().copy(rows_of(src, s_off[:n], length), rows_of(dst, d_off, length))
    assert np.array_equal(dst, expected)


@pytest.mark.parametrize("length", [8, 24, 4096])
def test_host_copier_scatters_out_of_one_buffer(length: int) -> None:
    """The scatter path: source rows back to back, destinations anywhere."""
    count = 100
    rng = np.random.default_rng(length)
    src = rng.integers(0, 256, length * count, dtype=np.uint8)
    dst = np.zeros(length * count * 3, dtype=np.uint8)
    d_off = (rng.permutation(count * 3)[:count] * length).tolist()
    expected = dst.copy()
    for i, d in enumerate(d_off):
        expected[d : d + length] = src[i * length : (i + 1) * length]
    HostCopier().copy(rows_of(src, [i * length for i in range(count)], length),
                      rows_of(dst, d_off, length))  # fmt: skip
    assert np.array_equal(dst, expected)


def test_host_copier_handles_mixed_lengths_and_unaligned_rows() -> None:
    src = np.arange(1000, dtype=np.uint8)
    dst = np.zeros(1000, dtype=np.uint8)
    rows_s = [(3, 5), (100, 16), (200, 16), (300, 5), *[(400 + 17 * i, 9) for i in range(30)]]
    rows_d = [(1, 5), (40, 16), (60, 16), (90, 5), *[(500 + 11 * i, 9) for i in range(30)]]
    expected = dst.copy()
    for (s, n), (d, _) in zip(rows_s, rows_d, strict=True):
        expected[d : d + n] = src[s : s + n]
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    s_rows = np.array([[base_s + s, n, 0] for s, n in rows_s], dtype=np.uint64)
    d_rows = np.array([[base_d + d, n, 0] for d, n in rows_d], dtype=np.uint64)
    HostCopier().copy(s_rows, d_rows)
    assert np.array_equal(dst, expected)
    assert ctypes.sizeof(ctypes.c_void_p) == 8


def test_cost_model_stages_small_pieces_and_writes_large_ones_in_place() -> None:
    # The H200's figures: 8.6 us per put, ~1.7 TB/s per byte both ways.
    gpu = CostModel(post=20e-6, row=8.6e-6, wire_byte=0.6e-12, copy_row=0.0, copy_byte=0.6e-12)
    gib = 1 << 30
    assert gpu.prefers_staged(
        rows=gib // (16 << 10), spans=1, copy_rows=2 * (gib >> 14), nbytes=gib
    )
    assert not gpu.prefers_staged(rows=1, spans=1, copy_rows=2, nbytes=gib)
    # A host whose copy costs what its wire does never gains from staging large runs.
    host = CostModel(post=30e-6, row=0.9e-6, wire_byte=0.12e-9, copy_row=0.3e-6, copy_byte=0.12e-9)
    assert not host.prefers_staged(rows=64, spans=1, copy_rows=128, nbytes=64 << 21)
