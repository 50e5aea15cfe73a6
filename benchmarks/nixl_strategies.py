"""Compare NixlTransport's two ways to post a plan, and its progress-thread choice.

Every transfer is planned by :class:`~kvpush.runtime.TransferPlanner` over
layouts with split K and V regions per layer, so ``pieces = 2 * layers *
blocks``; destination blocks are *contiguous* (merged to one row per region),
in *runs of 2*, or *fragmented* (every other block, shuffled: nothing merges).

``request_cost`` (this process, two raw NIXL agents, nothing posted): the CPU
cost of turning a plan into a NIXL request either way, kvpush's checks
included: ``check_rows`` + ``initialize_xfer`` (rows), or ``plan.indices()`` +
index checks + ``make_prepped_xfer`` (prepared lists), for 16 KiB / 256 KiB /
2 MiB blocks and a 64-layer (128-region) model. On an RDMA host, where
``transfer`` returns at once, this is what the data-plane thread pays per
request; ``prefers_prepped`` encodes the rule derived from it.

``strategies`` (two processes on loopback, UCX, ``UCX_NET_DEVICES=lo``): a
spawned target polls its transport and checks bytes by CRC on request; this
process posts WRITEs both ways (alternating, so drift hits both) for 16 KiB,
256 KiB and 2 MiB blocks, two block counts each. Medians of ``post_us`` (the
call; over loopback UCX copies inside it) and ``total_ms`` (until the
initiator's poll reports it done), GB/s.

``progress_thread``: NIXL's progress thread off (kvpush's default) or on, on
both sides, with the target polling in a tight loop (``spin``) or like the
data plane (``sleep``: 0.5 ms naps when a poll brings nothing); a 32 KiB write
(latency) and 32 MiB contiguous / fragmented (throughput).

Prints one JSON object with the rule and, per case, which way was cheaper and
which the rule picks. The host's load average is recorded: on a shared 2-core
host compare runs of similar load. Run:
``UCX_NET_DEVICES=lo .venv/bin/python benchmarks/nixl_strategies.py [--reps N]
[--only cost|strategies|progress]`` (about a minute).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import zlib
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvpush.protocol import (
    HeadSlice,
    KVLayout,
    MemoryType,
    Role,
    Route,
    Source,
    layer_regions,
)
from kvpush.runtime import TransferPlanner
from kvpush_nixl import NixlTransport

KIB = 1024
HEAD_BYTES = 256
TOKENS = 16
DEADLINE_S = 30.0
STRATEGY_SIZES = {16 * KIB: (64, 1024), 256 * KIB: (64, 512), 2048 * KIB: (16, 64)}


def layout(buf: np.ndarray, block: int, blocks: int) -> KVLayout:
    heads = block // (TOKENS * HEAD_BYTES)
    regions = layer_regions(
        [buf.ctypes.data],
        num_blocks=blocks,
        tokens_per_block=TOKENS,
        num_heads=heads,
        head_bytes=HEAD_BYTES,
        memory=MemoryType.DRAM,
    )
    return KVLayout(regions)


def buffer(block: int, blocks: int) -> np.ndarray:
    return np.zeros(2 * block * blocks, dtype=np.uint8)


# --- the target process ------------------------------------------------------------


def target_main(conn: Connection, block: int, blocks: int, progress: bool, mode: str) -> None:
    mem = buffer(block, 2 * blocks)
    t = NixlTransport("target", progress_thread=progress)
    t.register(layout(mem, block, 2 * blocks))
    conn.send((t.metadata(), mem.ctypes.data))
    notices = 0
    while True:
        _, got = t.poll()
        notices += len(got)
        if conn.poll():
            cmd, arg = conn.recv()
            if cmd == "peer":
                t.add_peer(arg)
            elif cmd == "crc":
                crc = 0
                for addr, n, _ in arg:
                    off = addr - mem.ctypes.data
                    crc = zlib.crc32(mem[off : off + n], crc)
                conn.send(crc)
            else:
                conn.send(notices)
                t.close()
                return
        elif mode == "sleep" and not got:
            time.sleep(0.0005)


# --- the initiator -----------------------------------------------------------------


class Pair:
    """This process's transport plus a target process, for one block size."""

    def __init__(self, block: int, blocks: int, progress: bool, mode: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=target_main, args=(child, block, blocks, progress, mode), daemon=True
        )
        self.proc.start()
        self.block, self.blocks = block, blocks
        self.mem = buffer(block, blocks)
        self.mem[:] = np.random.default_rng(1).integers(0, 256, self.mem.size, dtype=np.uint8)
        self.t = NixlTransport("init", progress_thread=progress)
        mine = layout(self.mem, block, blocks)
        self.t.register(mine)
        if not self.conn.poll(DEADLINE_S):
            raise RuntimeError("the target process did not start")
        md, self.target_base = self.conn.recv()
        self.peer = self.t.add_peer(md)
        self.conn.send(("peer", self.t.metadata()))
        heads = block // (TOKENS * HEAD_BYTES)
        self.route = Route(Source(0), 0, HeadSlice(0, heads))
        self.mine = mine

    def planner(self) -> TransferPlanner:
        """The target's layout: same geometry, twice the blocks."""
        theirs = KVLayout(
            layer_regions(
                [self.target_base],
                num_blocks=2 * self.blocks,
                tokens_per_block=TOKENS,
                num_heads=self.block // (TOKENS * HEAD_BYTES),
                head_bytes=HEAD_BYTES,
                memory=MemoryType.DRAM,
            )
        )
        return TransferPlanner(self.mine, theirs, self.route)

    def wait(self, handle: int) -> None:
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            for c in self.t.poll()[0]:
                if c.handle == handle:
                    if c.error:
                        raise RuntimeError(c.error)
                    return
        raise RuntimeError("transfer did not complete in time")

    def crc(self, rows: np.ndarray) -> int:
        self.conn.send(("crc", rows.tolist()))
        return int(self.conn.recv())

    def close(self) -> int:
        self.conn.send(("stop", None))
        notices = int(self.conn.recv()) if self.conn.poll(DEADLINE_S) else -1
        self.proc.join(DEADLINE_S)
        self.t.close()
        return notices


def src_crc(mem: np.ndarray, rows: np.ndarray) -> int:
    crc = 0
    for addr, n, _ in rows.tolist():
        off = addr - mem.ctypes.data
        crc = zlib.crc32(mem[off : off + n], crc)
    return crc


def time_case(
    pair: Pair,
    planner: TransferPlanner,
    dst: list[int],
    reps: int,
    ways: tuple[str, ...] = ("rows", "prepped"),
) -> dict[str, Any]:
    n = len(dst)
    plan = planner.plan([list(range(n))], [dst])
    out: dict[str, Any] = {
        "merged_rows": plan.num_descriptors,
        "pieces": plan.num_pieces,
        "mib": plan.nbytes / (1 << 20),
    }
    post: dict[str, list[float]] = {way: [] for way in ways}
    total: dict[str, list[float]] = {way: [] for way in ways}
    for rep in range(reps + 1):
        for way in ways if rep % 2 else ways[::-1]:  # alternate, so drift hits both
            notice = b"n%d" % rep
            t0 = time.perf_counter()
            if way == "rows":
                h = pair.t.write(pair.peer, plan.src, plan.dst, notice)
            else:
                si, di = plan.indices()
                h = pair.t.write_prepped(pair.peer, "route", si, di, notice)
            t1 = time.perf_counter()
            pair.wait(h)
            t2 = time.perf_counter()
            if rep:  # the first round warms up
                post[way].append((t1 - t0) * 1e6)
                total[way].append((t2 - t0) * 1e3)
    for way in ways:
        ms = statistics.median(total[way])
        out[way] = {
            "post_us": round(statistics.median(post[way]), 1),
            "total_ms": round(ms, 3),
            "gbps": round(plan.nbytes / ms / 1e6, 2),
        }
    out["verified"] = pair.crc(plan.dst) == src_crc(pair.mem, plan.src)
    return out


def strategies(reps: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    results = []
    for block, counts in STRATEGY_SIZES.items():
        pair = Pair(block, max(counts), progress=False, mode="spin")
        try:
            planner = pair.planner()
            t0 = time.perf_counter()
            pair.t.prep(
                pair.peer, "route", planner.prepped(Role.PRODUCER), planner.prepped(Role.CONSUMER)
            )
            prep_ms = (time.perf_counter() - t0) * 1e3
            for n in counts:
                for kind in ("contiguous", "fragmented"):
                    dst = list(range(n)) if kind == "contiguous" else list(rng.permutation(n) * 2)
                    case = {"block_kib": block // KIB, "blocks": n, "dst": kind}
                    case.update(time_case(pair, planner, [int(d) for d in dst], reps))
                    case["prep_ms"] = round(prep_ms, 2)
                    results.append(case)
                    print(json.dumps(case), file=sys.stderr)
        finally:
            pair.close()
    return results


def progress_thread(reps: int) -> list[dict[str, Any]]:
    block, n = 16 * KIB, 1024
    rng = np.random.default_rng(0)
    frag = [int(d) for d in rng.permutation(n) * 2]
    results = []
    for progress in (False, True):
        for mode in ("spin", "sleep"):
            pair = Pair(block, n, progress=progress, mode=mode)
            try:
                planner = pair.planner()
                row: dict[str, Any] = {"progress_thread": progress, "target": mode}
                small = time_case(pair, planner, [0], reps * 4, ("rows",))["rows"]
                row["latency_32k_us"] = round(small["total_ms"] * 1e3, 1)
                for kind, dst in (("contiguous", list(range(n))), ("fragmented", frag)):
                    got = time_case(pair, planner, dst, reps, ("rows",))["rows"]
                    row[f"{kind}_32m_gbps"] = got["gbps"]
                results.append(row)
                print(json.dumps(row), file=sys.stderr)
            finally:
                pair.close()
    return results


# --- request cost (in process, nothing posted) ---------------------------------------

#: (block bytes, layers, blocks per transfer): the strategy sizes plus a 64-layer model.
COST_CASES = (
    (16 * KIB, 1, (64, 1024, 4096)),
    (256 * KIB, 1, (64, 512)),
    (2048 * KIB, 1, (16, 64)),
    (16 * KIB, 64, (32, 256)),
)


def dst_blocks(kind: str, n: int, rng: np.random.Generator) -> list[int]:
    """Destination block ids in a pool of 2n: one run, runs of 2, or no runs."""
    if kind == "contiguous":
        return list(range(n))
    if kind == "runs_of_2":  # pairs of blocks, shuffled, a gap between pairs
        return [int(4 * r + k) for r in rng.permutation(n // 2) for k in (0, 1)]
    return [int(d) for d in rng.permutation(n) * 2]


def _median_us(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


class CostRig:
    """Two raw NIXL agents in this process with one layout each, prepared lists
    of the whole layout, and kvpush's own checks, for :func:`request_cost`."""

    def __init__(self, block: int, layers: int, blocks: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        from kvpush_nixl._memory import MemoryMap, layout_spans
        from kvpush_nixl._prepped import Prepped

        def agent(name: str) -> Any:
            sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            conf = nixl_agent_config(enable_prog_thread=False, backends=["UCX"], sync_mode=sync)
            return nixl_agent(name, conf)

        self.a, self.b = agent("cost-a"), agent("cost-b")
        self.heads = block // (TOKENS * HEAD_BYTES)
        self.layers = layers
        layer_bytes = 2 * blocks * block
        self.mem_a = np.empty(layers * layer_bytes, dtype=np.uint8)  # never touched
        self.mem_b = np.empty(2 * layers * layer_bytes, dtype=np.uint8)
        la = self.layout(self.mem_a, blocks, layer_bytes)
        lb = self.layout(self.mem_b, 2 * blocks, 2 * layer_bytes)
        self.regs = []
        for ag, lo in ((self.a, la), (self.b, lb)):
            descs = [(s.base, s.length, 0, "") for s in layout_spans(lo)]
            self.regs.append((ag, ag.register_memory(descs, "DRAM")))
        self.a.add_remote_agent(self.b.get_agent_metadata())
        self.map_a, self.map_b = MemoryMap(layout_spans(la)), MemoryMap(layout_spans(lb))
        self.planner = TransferPlanner(la, lb, Route(Source(0), 0, HeadSlice(0, self.heads)))
        src, dst = self.planner.prepped(Role.PRODUCER), self.planner.prepped(Role.CONSUMER)
        self.lh = self.a.prep_xfer_dlist("NIXL_INIT_AGENT", src, "DRAM")
        self.rh = self.a.prep_xfer_dlist("cost-b", dst, "DRAM")
        self.prepped = Prepped(self.lh, self.rh, src[:, 1].copy(), dst[:, 1].copy())

    def layout(self, mem: np.ndarray, blocks: int, nbytes: int) -> KVLayout:
        bases = [mem.ctypes.data + i * nbytes for i in range(self.layers)]
        return KVLayout(
            layer_regions(
                bases,
                num_blocks=blocks,
                tokens_per_block=TOKENS,
                num_heads=self.heads,
                head_bytes=HEAD_BYTES,
                memory=MemoryType.DRAM,
            )
        )

    def case(self, plan: Any, reps: int) -> dict[str, float]:
        """Median microseconds of each step, both ways."""
        from kvpush_nixl._memory import check_rows
        from kvpush_nixl._prepped import check_indices

        a, si, di = self.a, *plan.indices()
        li, ri = check_indices(self.prepped, si, di)

        def rows_checks() -> None:
            s, d = check_rows(plan.src, "l"), check_rows(plan.dst, "r")
            np.array_equal(s[:, 1], d[:, 1])
            self.map_a.classify(s, "l")
            self.map_b.classify(d, "r")

        def rows_nixl() -> None:
            descs = a.get_xfer_descs(plan.src, "DRAM"), a.get_xfer_descs(plan.dst, "DRAM")
            a.initialize_xfer("WRITE", *descs, "cost-b", b"n").release()

        def prepped_nixl() -> None:
            a.make_prepped_xfer("WRITE", self.lh, li, self.rh, ri, b"n").release()

        return {
            "rows_checks": _median_us(rows_checks, reps),
            "rows_nixl": _median_us(rows_nixl, reps),
            "indices": _median_us(plan.indices, reps),
            "prepped_checks": _median_us(lambda: check_indices(self.prepped, si, di), reps),
            "prepped_nixl": _median_us(prepped_nixl, reps),
        }

    def close(self) -> None:
        self.lh.release()
        self.rh.release()
        self.a.remove_remote_agent("cost-b")
        for ag, reg in self.regs:
            ag.deregister_memory(reg)


def request_cost(reps: int) -> list[dict[str, Any]]:
    """CPU cost of turning one plan into a NIXL request, both ways, with
    kvpush's checks; NIXL's own request calls, released without posting."""
    rng = np.random.default_rng(0)
    results = []
    for block, layers, counts in COST_CASES:
        rig = CostRig(block, layers, max(counts))
        try:
            for count in counts:
                for kind in ("contiguous", "runs_of_2", "fragmented"):
                    dst = dst_blocks(kind, count, rng)
                    plan = rig.planner.plan([list(range(count))], [dst])
                    figures = rig.case(plan, reps)
                    row: dict[str, Any] = {
                        "block_kib": block // KIB,
                        "regions": 2 * layers,
                        "blocks": count,
                        "dst": kind,
                        "merged_rows": plan.num_descriptors,
                        "pieces": plan.num_pieces,
                    }
                    row.update({k: round(v, 1) for k, v in figures.items()})
                    row["rows_us"] = round(figures["rows_checks"] + figures["rows_nixl"], 1)
                    row["prepped_us"] = round(
                        figures["indices"] + figures["prepped_checks"] + figures["prepped_nixl"], 1
                    )
                    results.append(row)
                    print(json.dumps(row), file=sys.stderr)
        finally:
            rig.close()
    return results


def fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``."""
    slope, intercept = np.polyfit(np.array(xs, dtype=float), np.array(ys, dtype=float), 1)
    return round(float(intercept), 2), round(float(slope), 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--only", choices=("cost", "strategies", "progress"), default=None)
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before any agent; children inherit it
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO lines to stdout
    probe = NixlTransport("probe")
    rule = probe.prefers_prepped
    probe.close()
    out: dict[str, Any] = {
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_start": os.getloadavg()[0],
        },
        "env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "reps": args.reps,
    }
    if args.only in (None, "cost"):
        costs = request_cost(args.reps * 3)
        for c in costs:
            c["cheaper"] = "prepped" if c["prepped_us"] < c["rows_us"] else "rows"
            c["rule_says"] = "prepped" if rule(c["merged_rows"], c["pieces"]) else "rows"
        out["request_cost"] = costs
        out["request_cost_fit_us"] = {
            "rows": fit([c["merged_rows"] for c in costs], [c["rows_us"] for c in costs]),
            "prepped": fit([c["pieces"] for c in costs], [c["prepped_us"] for c in costs]),
        }
    if args.only in (None, "strategies"):
        cases = strategies(args.reps)
        for c in cases:
            faster = "prepped" if c["prepped"]["total_ms"] < c["rows"]["total_ms"] else "rows"
            c["faster"] = faster
            c["rule_says"] = "prepped" if rule(c["merged_rows"], c["pieces"]) else "rows"
        out["strategies"] = cases
    if args.only in (None, "progress"):
        out["progress_thread"] = progress_thread(args.reps)
    out["host"]["loadavg_end"] = os.getloadavg()[0]
    out["rule"] = (
        "prefers_prepped(merged_rows, pieces) = merged_rows >= 4096 and "
        "pieces <= 2 * merged_rows (kvpush_nixl._options.PrepRule)"
    )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
