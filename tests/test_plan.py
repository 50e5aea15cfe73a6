"""The transfer planner: executed plans against a naive per-token copy, and refusals.

Each side's memory is a numpy byte buffer at a fake base address; a plan is
executed by copying every descriptor, the reference by copying every
(region, token, head) cell. Both must leave the destination byte-identical,
which also checks that nothing outside the target cells is written.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvpush.protocol import (
    HeadOrder,
    HeadSlice,
    IncompatiblePeerError,
    KVLayout,
    LocalProtocolError,
    Region,
    Role,
    Route,
    Source,
    compute_topology,
    layer_regions,
)
from kvpush.runtime import TransferPlan, TransferPlanner, plan_transfer

SRC_BASE = 1 << 36
DST_BASE = 1 << 40
_EXAMPLES = int(os.environ.get("KVPUSH_PLAN_EXAMPLES", "0"))
_settings = settings(deadline=None, **({"max_examples": _EXAMPLES} if _EXAMPLES else {}))


# --- memory, execution and the reference copy --------------------------------------


@dataclass(frozen=True)
class Side:
    layout: KVLayout
    base: int
    size: int


def build_side(
    base: int,
    groups: list[tuple[int, int]],
    *,
    layers: int,
    packing: str,
    heads: tuple[int, int],
    head_bytes: int,
    order: HeadOrder,
    device: int,
    stage: tuple[int, int] = (0, 1),
    gap: int = 8,
) -> Side:
    """Regions for ``groups`` = [(tokens_per_block, num_blocks)], packed with gaps.

    Each group has ``layers`` layers; ``stage`` = (PP stage, PP size) keeps the
    stage's contiguous share of them.
    """
    start, count = heads
    per_stage = layers // stage[1]
    regions: list[Region] = []
    offset = 0
    for g, (tpb, blocks) in enumerate(groups):
        block_len = tpb * count * head_bytes
        per_layer = (1 if packing == "mla" else 2) * blocks * block_len + gap
        bases = [base + offset + i * per_layer for i in range(per_stage)]
        regions += layer_regions(
            bases,
            num_blocks=blocks,
            tokens_per_block=tpb,
            num_heads=count,
            head_bytes=head_bytes,
            head_start=start,
            packing=packing,  # type: ignore[arg-type]
            order=order,
            device=device,
            group=g,
            first_layer=g * layers + stage[0] * per_stage,
        )
        offset += per_stage * per_layer
    return Side(KVLayout(tuple(regions)), base, offset)


def memory(side: Side, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, side.size, dtype=np.uint8)


def copy_rows(
    src_rows: np.ndarray,
    dst_rows: np.ndarray,
    src: Side,
    src_mem: np.ndarray,
    dst: Side,
    dst_mem: np.ndarray,
) -> None:
    """Execute descriptor pairs; refuse anything outside a buffer or written twice."""
    written = np.zeros(dst_mem.size, dtype=np.int32)
    for (sa, sl, _), (da, dl, _) in zip(src_rows.tolist(), dst_rows.tolist(), strict=True):
        assert sl == dl > 0
        so, do = sa - src.base, da - dst.base
        assert so >= 0 and so + sl <= src_mem.size
        assert do >= 0 and do + dl <= dst_mem.size
        dst_mem[do : do + dl] = src_mem[so : so + sl]
        written[do : do + dl] += 1
    assert written.max(initial=0) <= 1, "a destination byte was written twice"


def cell(r: Region, token: int, head: int) -> int:
    local = head - r.head_start
    assert 0 <= local < r.num_heads and 0 <= token < r.tokens_per_block
    if r.order is HeadOrder.NHD:
        return (token * r.num_heads + local) * r.head_bytes
    return (local * r.tokens_per_block + token) * r.head_bytes


def reference(
    src: Side,
    src_mem: np.ndarray,
    dst: Side,
    dst_mem: np.ndarray,
    heads: HeadSlice,
    src_ids: list[list[int]],
    dst_ids: list[list[int]],
    skip: int,
) -> int:
    """Naive copy, one (region, token, head) cell at a time; returns bytes copied.

    The tokens copied are ``[skip, end)`` with ``end`` the end of the shorter
    side (whole chunks; the tail past the real token count is harmless).
    """
    moved = 0
    for p in src.layout.regions:
        (c,) = (r for r in dst.layout.regions if (r.layer, r.kind) == (p.layer, p.kind))
        s_ids, d_ids = src_ids[p.group], dst_ids[p.group]
        bp, bc = p.tokens_per_block, c.tokens_per_block
        end = min(len(s_ids) * bp, skip + len(d_ids) * bc)
        for t in range(skip, end):
            for h in range(heads.start, heads.start + heads.count):
                so = p.base - src.base + s_ids[t // bp] * p.stride + cell(p, t % bp, h)
                do = c.base - dst.base + d_ids[(t - skip) // bc] * c.stride + cell(c, t % bc, h)
                dst_mem[do : do + p.head_bytes] = src_mem[so : so + p.head_bytes]
                moved += p.head_bytes
    return moved


def heads_of(tp: int, heads: int, rank: int) -> tuple[int, int]:
    if tp <= heads:
        per = heads // tp
        return rank * per, per
    return rank // (tp // heads), 1


# --- the property -------------------------------------------------------------------


@st.composite
def block_ids(draw: st.DrawFn, n: int, pool: int) -> list[int]:
    """``n`` distinct ids of ``pool``: shuffled segments of ``range(pool)``."""
    cuts = sorted(draw(st.sets(st.integers(1, max(1, pool - 1)), max_size=pool)))
    bounds = [0, *[c for c in cuts if c < pool], pool]
    segments = [list(range(a, b)) for a, b in itertools.pairwise(bounds) if b > a]
    order = draw(st.permutations(range(len(segments))))
    flat = [i for k in order for i in segments[k]]
    return flat[:n]


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, object]:
    mla = draw(st.integers(0, 3)) == 0
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8]))
    p_tp = draw(st.sampled_from([1, 2, 4, 8]))
    p_pp = draw(st.sampled_from([1, 2]))
    c_tp = draw(st.sampled_from([1, 2, 4, 8]))
    topo = compute_topology(p_tp, p_pp, c_tp, heads, mla=mla)
    route = draw(st.sampled_from(topo.routes))
    n_groups = draw(st.integers(1, 2))
    sizes = []
    for _ in range(n_groups):
        chunk = draw(st.sampled_from([1, 2, 4]))
        ratio = draw(st.sampled_from([1, 2, 3]))
        sizes.append((chunk * ratio, chunk) if draw(st.booleans()) else (chunk, chunk * ratio))
    tokens = draw(st.integers(1, 40))
    step = math.lcm(*(bc for _, bc in sizes))
    skip = step * draw(st.integers(0, tokens // step))
    src_ids, dst_ids, src_groups, dst_groups = [], [], [], []
    for bp, bc in sizes:
        n_s, n_d = -(-tokens // bp), -(-(tokens - skip) // bc)
        pool_s = n_s + draw(st.integers(0, 4))
        pool_d = max(1, n_d + draw(st.integers(0, 4)))
        src_ids.append(draw(block_ids(n_s, pool_s)))
        dst_ids.append(draw(block_ids(n_d, pool_d)))
        src_groups.append((bp, pool_s))
        dst_groups.append((bc, pool_d))
    packings = ["mla"] if mla else ["split", "interleaved"]
    common = {
        "layers": p_pp * draw(st.integers(1, 2)),
        "packing": draw(st.sampled_from(packings)),
        "head_bytes": draw(st.sampled_from([1, 2, 4])),
    }
    p_heads = (0, 1) if mla else heads_of(p_tp, heads, route.source.tp)
    c_heads = (0, 1) if mla else heads_of(c_tp, heads, route.consumer_rank)
    src = build_side(
        SRC_BASE,
        src_groups,
        heads=p_heads,
        order=draw(st.sampled_from(HeadOrder)),
        device=route.source.tp,
        stage=(route.source.pp, p_pp),
        **common,
    )  # type: ignore[arg-type]
    dst = build_side(
        DST_BASE,
        dst_groups,
        heads=c_heads,
        order=draw(st.sampled_from(HeadOrder)),
        device=route.consumer_rank,
        **common,
    )  # type: ignore[arg-type]
    # The consumer's region order is its own business: regions pair by (layer, kind).
    shuffled = draw(st.permutations(dst.layout.regions))
    dst = Side(KVLayout(tuple(shuffled)), dst.base, dst.size)
    return {
        "route": route,
        "src": src,
        "dst": dst,
        "src_ids": src_ids,
        "dst_ids": dst_ids,
        "skip": skip,
        "tokens": tokens,
    }


def make_planner(src: Side, dst: Side, route: Route) -> TransferPlanner:
    """The default planner, or the strided one where (and only where) it must be."""
    try:
        return TransferPlanner(src.layout, dst.layout, route)
    except IncompatiblePeerError as exc:
        refusal = exc
    assert refusal.field == "kv.strided"
    assert "HND" in refusal.detail and "allow_strided=True" in refusal.detail
    orders = {r.order for r in (*src.layout.regions, *dst.layout.regions)}
    assert orders != {HeadOrder.HND}, "head-major layouts never need strided pieces"
    return TransferPlanner(src.layout, dst.layout, route, allow_strided=True)


def check_maximal(plan: TransferPlan) -> None:
    """No two consecutive rows of a region could have been merged."""
    for r in range(plan.region_rows.size - 1):
        lo, hi = int(plan.region_rows[r]), int(plan.region_rows[r + 1])
        s, d = plan.src[lo:hi].tolist(), plan.dst[lo:hi].tolist()
        for i in range(1, hi - lo):
            joins_src = s[i][0] == s[i - 1][0] + s[i - 1][1]
            joins_dst = d[i][0] == d[i - 1][0] + d[i - 1][1]
            assert not (joins_src and joins_dst), f"rows {lo + i - 1} and {lo + i} could merge"


@_settings
@given(scenarios())
def test_merged_plan_moves_exactly_the_reference_bytes(case: dict[str, object]) -> None:
    route, src, dst = case["route"], case["src"], case["dst"]
    assert isinstance(route, Route) and isinstance(src, Side) and isinstance(dst, Side)
    src_ids, dst_ids, skip = case["src_ids"], case["dst_ids"], case["skip"]
    assert isinstance(skip, int) and isinstance(src_ids, list) and isinstance(dst_ids, list)
    planner = make_planner(src, dst, route)
    event(f"producer PP stage {route.source.pp}")
    event("strided" if planner.allow_strided else "not strided")
    event("prefix hit" if skip else "no prefix hit")
    ratios = {(p.tokens_per_block, c.tokens_per_block) for p, c in planner.pairs}
    event("block ratio" if any(a != b for a, b in ratios) else "equal blocks")
    plan = planner.plan(tuple(map(tuple, src_ids)), tuple(map(tuple, dst_ids)), skip_tokens=skip)

    src_mem = memory(src, 1)
    expected = memory(dst, 2)
    moved = reference(src, src_mem, dst, expected, route.heads, src_ids, dst_ids, skip)
    got = memory(dst, 2)
    copy_rows(plan.src, plan.dst, src, src_mem, dst, got)
    assert np.array_equal(got, expected)
    assert plan.nbytes == moved == int(plan.src[:, 1].sum())
    assert np.array_equal(src_mem, memory(src, 1))

    # The index form, through the prepped lists, does the same.
    src_index, dst_index = plan.indices()
    assert src_index.size == dst_index.size == plan.num_pieces >= plan.num_descriptors
    via_index = memory(dst, 2)
    copy_rows(
        planner.prepped(Role.PRODUCER)[src_index],
        planner.prepped(Role.CONSUMER)[dst_index],
        src,
        src_mem,
        dst,
        via_index,
    )
    assert np.array_equal(via_index, expected)

    check_maximal(plan)
    for r, p in enumerate(src.layout.regions):
        rows = slice(int(plan.region_rows[r]), int(plan.region_rows[r + 1]))
        assert set(plan.src[rows, 2].tolist()) <= {p.device}
        assert set(plan.dst[rows, 2].tolist()) <= {dst.layout.regions[0].device}


# --- fixed cases --------------------------------------------------------------------

ROUTE = Route(Source(0), 0, HeadSlice(0, 2))


def layout(
    base: int = 0,
    *,
    blocks: int = 32,
    tpb: int = 16,
    heads: int = 2,
    start: int = 0,
    layers: int = 2,
    order: HeadOrder = HeadOrder.NHD,
    head_bytes: int = 4,
) -> KVLayout:
    block_len = tpb * heads * head_bytes
    return KVLayout(
        layer_regions(
            [base + i * 2 * blocks * block_len for i in range(layers)],
            num_blocks=blocks,
            tokens_per_block=tpb,
            num_heads=heads,
            head_start=start,
            head_bytes=head_bytes,
            order=order,
        )
    )


def test_contiguous_blocks_merge_to_one_descriptor_per_region() -> None:
    plan = plan_transfer(
        layout(),
        layout(1 << 20),
        ROUTE,
        ((0, 1, 2, 3, 4, 5, 6, 7),),
        ((8, 9, 10, 11, 12, 13, 14, 15),),
    )
    assert plan.num_pieces == 8 * 4
    assert plan.num_descriptors == 4  # 2 layers x (K, V)
    assert plan.src[:, 1].tolist() == [8 * 128] * 4
    assert plan.region_rows.tolist() == [0, 1, 2, 3, 4]


def test_merging_needs_contiguity_on_both_sides() -> None:
    # Source runs 0-3 | 10-13, destination runs 0-1 | 5-10: breaks after 2 and 4.
    plan = plan_transfer(
        layout(layers=1),
        layout(1 << 20, layers=1),
        ROUTE,
        ((0, 1, 2, 3, 10, 11, 12, 13),),
        ((0, 1, 5, 6, 7, 8, 9, 10),),
    )
    assert plan.num_descriptors == 2 * 3
    assert plan.src[:3, 1].tolist() == [2 * 128, 2 * 128, 4 * 128]


def test_non_integral_block_ratio_is_refused() -> None:
    with pytest.raises(IncompatiblePeerError, match="whole multiple") as err:
        TransferPlanner(layout(tpb=16), layout(tpb=24), ROUTE)
    assert err.value.field == "kv.tokens_per_block"


@pytest.mark.parametrize("bad", [32, 10_000, -1])
def test_destination_block_outside_the_region_is_refused(bad: int) -> None:
    planner = TransferPlanner(layout(), layout(blocks=32), ROUTE)
    with pytest.raises(LocalProtocolError, match=rf"destination block id {bad} .* 32 blocks"):
        planner.plan(((0, 1),), ((0, bad),))


def test_source_block_outside_the_region_is_refused() -> None:
    planner = TransferPlanner(layout(blocks=8), layout(), ROUTE)
    with pytest.raises(LocalProtocolError, match=r"source block id 8 .* 8 blocks"):
        planner.plan(((7, 8),), ((0, 1),))


def test_duplicate_destination_block_is_refused_but_source_may_repeat() -> None:
    planner = TransferPlanner(layout(), layout(), ROUTE)
    with pytest.raises(LocalProtocolError, match="listed twice"):
        planner.plan(((0, 1),), ((3, 3),))
    assert planner.plan(((5, 5),), ((3, 4),)).num_descriptors == 2 * 4


@pytest.mark.parametrize(
    ("src", "dst", "skip"),
    [
        (((0, 1),), ((0, 1, 2),), 0),  # destination lists a block too many
        (((0, 1, 2),), ((0,),), 0),  # destination lists a block too few
        (((0, 1),), ((0, 1),), 16),  # the skip pushes the destination past the source
        (((0,), (1,)), ((0,),), 0),  # wrong number of groups
        ([[0.0]], ((0,),), 0),  # float ids
        (((True,),), ((0,),), 0),  # bool ids
        ((((0, 1),),), ((0,),), 0),  # nested ids
        (((0,),), ((0,),), -16),  # negative skip
        (((0,),), ((0,),), 16.0),  # non-int skip
    ],
)
def test_malformed_transfer_inputs_are_refused(src: object, dst: object, skip: object) -> None:
    planner = TransferPlanner(layout(), layout(), ROUTE)
    with pytest.raises(LocalProtocolError):
        planner.plan(src, dst, skip_tokens=skip)  # type: ignore[arg-type]


def test_misaligned_prefix_hit_is_refused() -> None:
    planner = TransferPlanner(layout(tpb=8), layout(tpb=16), ROUTE)
    with pytest.raises(LocalProtocolError, match="not a multiple of the consumer's 16"):
        planner.plan(((0, 1, 2, 3),), ((0,),), skip_tokens=8)


def test_prefix_hit_with_a_block_ratio_trims_the_source_front() -> None:
    # Producer blocks of 8 tokens, consumer blocks of 16; the consumer holds tokens
    # 0..15 and registers one block for tokens 16..31: producer blocks 2 and 3
    # (not the last block only, nor blocks 0 and 1).
    p, c = layout(tpb=8, layers=1), layout(1 << 20, tpb=16, layers=1)
    plan = plan_transfer(p, c, ROUTE, ((10, 11, 12, 13),), ((5,),), skip_tokens=16)
    k_src, k_dst = p.regions[0], c.regions[0]
    assert plan.src[0].tolist() == [k_src.base + 12 * k_src.block_len, 2 * k_src.block_len, 0]
    assert plan.dst[0].tolist() == [k_dst.base + 5 * k_dst.block_len, k_dst.block_len, 0]


def test_full_prefix_hit_plans_nothing() -> None:
    plan = plan_transfer(layout(), layout(), ROUTE, ((0, 1),), ((),), skip_tokens=32)
    assert plan.num_descriptors == plan.nbytes == 0
    assert plan.indices()[0].size == 0


def test_token_major_head_slice_is_refused_unless_strided_is_allowed() -> None:
    # Producer TP1 with 4 heads -> consumer rank 1 of TP2 (heads 2, 3).
    route = Route(Source(0), 1, HeadSlice(2, 2))
    p, c = layout(heads=4), layout(heads=2, start=2)
    with pytest.raises(IncompatiblePeerError, match=r"head-major \(HND\)") as err:
        TransferPlanner(p, c, route)
    assert err.value.field == "kv.strided"
    plan = plan_transfer(p, c, route, ((0,),), ((0,),), allow_strided=True)
    assert plan.num_descriptors == 16 * 4  # one per token per region


def test_head_major_head_slice_is_one_descriptor_per_block() -> None:
    route = Route(Source(0), 1, HeadSlice(2, 2))
    p, c = layout(heads=4, order=HeadOrder.HND), layout(heads=2, start=2, order=HeadOrder.HND)
    plan = plan_transfer(p, c, route, ((0, 1, 2),), ((4, 6, 9),))
    assert plan.num_descriptors == 3 * 4
    k = p.regions[0]
    assert plan.src[0].tolist() == [k.base + 2 * 16 * 4, 2 * 16 * 4, 0]


@pytest.mark.parametrize(
    ("producer", "consumer", "route", "fld"),
    [
        (layout(layers=3), layout(), ROUTE, "kv.region_map"),
        (
            KVLayout(tuple(replace(r, group=r.layer) for r in layout().regions)),
            KVLayout(tuple(replace(r, group=1 - r.layer) for r in layout().regions)),
            ROUTE,
            "kv.region_map",
        ),
        (layout(tpb=16), layout(tpb=24), ROUTE, "kv.tokens_per_block"),
        (layout(), layout(head_bytes=8), ROUTE, "kv.head_bytes"),
        (layout(), layout(start=2), ROUTE, "kv.heads"),
        (layout(), layout(), Route(Source(0), 0, HeadSlice(1, 2)), "kv.heads"),
        (layout(), layout(), Route(Source(0), 0, HeadSlice(0, 0)), "kv.heads"),
    ],
)
def test_incompatible_layouts_are_refused_naming_the_field(
    producer: KVLayout, consumer: KVLayout, route: Route, fld: str
) -> None:
    with pytest.raises(IncompatiblePeerError) as err:
        TransferPlanner(producer, consumer, route)
    assert err.value.field == fld


def test_plan_arrays_are_read_only() -> None:
    plan = plan_transfer(layout(), layout(), ROUTE, ((0, 1),), ((2, 3),))
    for a in (plan.src, plan.dst, plan.region_rows, *plan.indices()):
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 0
    assert plan.src.dtype == plan.dst.dtype == np.uint64 and plan.src.shape[1] == 3


def test_prepped_lists_have_one_entry_per_block_and_chunk() -> None:
    planner = TransferPlanner(layout(tpb=32, blocks=4), layout(tpb=16, blocks=6), ROUTE)
    src, dst = planner.prepped(Role.PRODUCER), planner.prepped(Role.CONSUMER)
    assert src.shape == (4 * 4 * 2, 3)  # 4 regions x 4 blocks x 2 chunks of 16 tokens
    assert dst.shape == (4 * 6, 3)
    assert set(src[:, 1].tolist()) == set(dst[:, 1].tolist()) == {16 * 2 * 4}


def test_mla_producer_tp4_to_consumer_tp2() -> None:
    topo = compute_topology(4, 1, 2, 1, mla=True)
    mla = KVLayout(
        layer_regions(
            [0, 1 << 20],
            num_blocks=16,
            tokens_per_block=16,
            num_heads=1,
            head_bytes=1152,
            packing="mla",
        )
    )
    for route in topo.routes:
        plan = plan_transfer(mla, mla, route, ((0, 1, 2),), ((3, 4, 7),))
        assert plan.num_descriptors == 2 * 2  # (3, 4) and (7) per layer


@_settings
@given(scenarios())
def test_small_plan_path_agrees_with_the_numpy_path(case: dict[str, object]) -> None:
    """Small transfers take a plain-Python path (``_small_plan``); it must make
    exactly the plan the numpy path makes, arrays, counts and index form."""
    from kvpush.runtime import _plan

    route, src, dst = case["route"], case["src"], case["dst"]
    assert isinstance(route, Route) and isinstance(src, Side) and isinstance(dst, Side)
    src_ids, dst_ids, skip = case["src_ids"], case["dst_ids"], case["skip"]
    assert isinstance(skip, int) and isinstance(src_ids, list) and isinstance(dst_ids, list)
    planner = make_planner(src, dst, route)
    args = (tuple(map(tuple, src_ids)), tuple(map(tuple, dst_ids)))
    small = _plan._small_plan(planner, *args, skip)
    event("small path" if small is not None else "numpy path (too large)")
    if small is None:
        return
    groups = range(len(src_ids))
    chunks = [planner._chunks(g, args[0][g], args[1][g], skip) for g in groups]
    full = planner._assemble(chunks)
    for name in ("src", "dst", "region_rows"):
        a, b = getattr(small, name), getattr(full, name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
        assert not a.flags.writeable
    assert (small.nbytes, small.num_pieces) == (full.nbytes, full.num_pieces)
    for a, b in zip(small.indices(), full.indices(), strict=True):
        assert np.array_equal(a, b)


def test_small_plan_path_leaves_refusals_to_the_numpy_path() -> None:
    """Bad input never takes the small path: the numpy path's checks and
    messages apply (duplicates, out of range, non-int ids, long lists)."""
    from kvpush.runtime import _plan

    planner = TransferPlanner(layout(), layout(), ROUTE)
    assert _plan._small_plan(planner, ((0, 1),), ((2, 3),), 0) is not None
    for src, dst in (
        (((0, 1),), ((2, 2),)),
        (((0, 32),), ((2, 3),)),
        (((0, 1),), ((2, -1),)),
        (((0, True),), ((2, 3),)),
        (((0, np.int64(1)),), ((2, 3),)),
        (((0, 1),), ((2, 3, 4),)),
    ):
        assert _plan._small_plan(planner, src, dst, 0) is None
    big = TransferPlanner(layout(blocks=1024), layout(blocks=1024), ROUTE)
    ids = (tuple(range(0, 2 * _plan.SMALL_PLAN_BLOCKS + 2, 2)),)
    assert _plan._small_plan(big, ids, ids, 0) is None


def _byte_map(plan: TransferPlan) -> dict[int, int]:
    """Destination byte -> source byte, over every row of ``plan``."""
    out: dict[int, int] = {}
    for (s, n, _), (d, _, _) in zip(plan.src.tolist(), plan.dst.tolist(), strict=True):
        for i in range(n):
            assert d + i not in out, "a destination byte written twice"
            out[d + i] = s + i
    return out


@_settings
@given(scenarios(), st.data())
def test_increments_compose_to_the_whole_transfer(case: dict[str, object], data: Any) -> None:
    """Progressive push: a first increment of whole source blocks (``partial``)
    and then the rest (``first``: where it ended) write exactly the bytes the
    single-shot plan writes, each once, whatever the block-size ratio (a
    destination block may be filled by both increments) and prefix hit."""
    route, src, dst = case["route"], case["src"], case["dst"]
    assert isinstance(route, Route) and isinstance(src, Side) and isinstance(dst, Side)
    src_ids, dst_ids, skip = case["src_ids"], case["dst_ids"], case["skip"]
    assert isinstance(skip, int) and isinstance(src_ids, list) and isinstance(dst_ids, list)
    planner = make_planner(src, dst, route)
    s, d = tuple(map(tuple, src_ids)), tuple(map(tuple, dst_ids))
    whole = _byte_map(planner.plan(s, d, skip_tokens=skip))
    cut = [data.draw(st.integers(0, len(g) - 1)) for g in s]
    head = tuple(g[:k] for g, k in zip(s, cut, strict=True))
    one = _byte_map(planner.plan(head, d, skip_tokens=skip, partial=True))
    two = _byte_map(planner.plan(s, d, skip_tokens=skip, first=cut))
    assert not one.keys() & two.keys()
    assert {**one, **two} == whole


def test_an_increment_that_overruns_the_destination_is_refused() -> None:
    planner = TransferPlanner(layout(), layout(), ROUTE)
    with pytest.raises(LocalProtocolError, match="does not fit"):
        planner.plan(((0, 1, 2),), ((5, 6),), partial=True)
    with pytest.raises(LocalProtocolError, match="first must list"):
        planner.plan(((0, 1),), ((5, 6),), first=(1, 1))
    with pytest.raises(LocalProtocolError, match="written before"):
        planner.plan(((0, 1),), ((5, 6),), first=(3,))
