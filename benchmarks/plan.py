"""Benchmark the transfer planner: one 16k-token transfer, 64 layers (K and V).

Prints one JSON object. The transfer: 1,024 blocks of 16 tokens on both sides,
64 layers with separate K and V regions (128 regions, vLLM's FlashAttention
layout), same TP, 50% fragmentation on *each* side independently (half of the
blocks do not follow their predecessor in memory; a descriptor needs contiguity
on both sides, so about a quarter of the blocks continue a run). The goal is
<= 2 ms per plan. Extras: the same plan with one shared break pattern (exactly
half the blocks start a run), the cost of the unmerged index form, and the
same transfer planned as 8 increments (progressive push).

Run: ``.venv/bin/python benchmarks/plan.py``
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from kvpush.protocol import KVLayout, compute_topology, layer_regions
from kvpush.runtime import TransferPlanner

LAYERS = 64
BLOCKS = 1024
TOKENS_PER_BLOCK = 16
POOL = 32_768  # blocks in each side's KV pool
HEADS = 8
HEAD_BYTES = 128 * 2  # head size 128, bf16
REPEATS = 200
INCREMENTS = 8  # progressive push: 2,048-token chunks of the 16k prompt


def fragmented(rng: np.random.Generator, n: int, breaks: float) -> tuple[int, ...]:
    """``n`` distinct block ids where a fraction ``breaks`` start a new run."""
    is_break = np.zeros(n, dtype=bool)
    is_break[0] = True
    is_break[1 + rng.choice(n - 1, round(n * breaks) - 1, replace=False)] = True
    n_runs = int(is_break.sum())
    run_lengths = np.diff(np.append(np.flatnonzero(is_break), n))
    # Runs go to disjoint, shuffled slots of the pool, one gap apart at least.
    slot = POOL // n_runs
    assert run_lengths.max() < slot
    slots = rng.permutation(n_runs) * slot
    ids = np.concatenate([np.arange(s, s + k) for s, k in zip(slots, run_lengths, strict=True)])
    return tuple(int(i) for i in ids)


def main() -> None:
    rng = np.random.default_rng(0)
    topo = compute_topology(1, 1, 1, HEADS)
    route = topo.routes[0]
    tensor = 2 * POOL * TOKENS_PER_BLOCK * HEADS * HEAD_BYTES

    def layout(base: int) -> KVLayout:
        return KVLayout(
            layer_regions(
                [base + i * tensor for i in range(LAYERS)],
                num_blocks=POOL,
                tokens_per_block=TOKENS_PER_BLOCK,
                num_heads=HEADS,
                head_bytes=HEAD_BYTES,
            )
        )

    producer, consumer = layout(1 << 40), layout(1 << 44)
    t0 = time.perf_counter()
    planner = TransferPlanner(producer, consumer, route)
    build_ms = (time.perf_counter() - t0) * 1e3
    src = (fragmented(rng, BLOCKS, 0.5),)
    dst = (fragmented(rng, BLOCKS, 0.5),)
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        plan = planner.plan(src, dst)
        times.append((time.perf_counter() - t0) * 1e3)
    index_times = []
    for _ in range(REPEATS // 4):
        t0 = time.perf_counter()
        plan.indices()
        index_times.append((time.perf_counter() - t0) * 1e3)
    # The same break pattern on both sides: exactly half of the blocks start a run.
    same = planner.plan(src, tuple(tuple(i + 1 for i in g) for g in src))
    regions = len(producer.regions)
    # Progressive push: the same transfer as INCREMENTS increments of whole
    # blocks (chunked prefill), each planned from where the last one ended.
    step = BLOCKS // INCREMENTS
    inc_times, inc_desc = [], 0
    for _ in range(REPEATS // 4):
        t0 = time.perf_counter()
        inc_desc = 0
        for k in range(INCREMENTS):
            last = k == INCREMENTS - 1
            part = src if last else (src[0][: (k + 1) * step],)
            inc = planner.plan(part, dst, first=(k * step,) if k else (), partial=not last)
            inc_desc += inc.num_descriptors
        inc_times.append((time.perf_counter() - t0) * 1e3)
    s_ids, d_ids = np.array(src[0]), np.array(dst[0])
    joint = ((s_ids[1:] == s_ids[:-1] + 1) & (d_ids[1:] == d_ids[:-1] + 1)).mean()
    result = {
        "plan_ms_p50": round(statistics.median(times), 4),
        "plan_ms_p90": round(float(np.percentile(times, 90)), 4),
        "descriptors_merged": plan.num_descriptors,
        "descriptors_per_block": round(plan.num_descriptors / (BLOCKS * regions), 4),
        "descriptors_unmerged": plan.num_pieces,
        "regions": regions,
        "blocks": BLOCKS,
        "bytes": plan.nbytes,
        "joint_contiguous_fraction": round(float(joint), 4),
        "descriptors_per_block_same_pattern": round(same.num_descriptors / (BLOCKS * regions), 4),
        "indices_ms_p50": round(statistics.median(index_times), 4),
        "increments": INCREMENTS,
        "increments_plan_ms_p50": round(statistics.median(inc_times), 4),
        "increments_descriptors": inc_desc,
        # Whole-block increments: at most a block less one token per layer and
        # kind waits for the next increment (a chunk that ends mid-block).
        "increment_tail_bytes_max": (TOKENS_PER_BLOCK - 1) * HEADS * HEAD_BYTES * regions,
        "planner_build_ms": round(build_ms, 3),
        "numpy": np.__version__,
        "python": sys.version.split()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
