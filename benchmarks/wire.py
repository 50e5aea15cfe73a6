"""The wire, in isolation: four figures side by side in one run (issue 15, item 4).

Runs the measurement functions of the existing benchmarks (imported, not
copied) in one process, one after the other, interleaved over ``--rounds``
rounds so that a noisy host's drift hits every figure alike, and prints one
JSON object with each figure's median over the rounds, its goal and whether
the goal is met:

* ``nixl_kvpush_over_raw_best``: ``benchmarks/nixl_throughput.py``'s
  ``measure`` at every block size (two processes on loopback UCX, 64 MiB per
  transfer, 50% fragmented): kvpush (planner + ``NixlTransport``) over raw
  NIXL with the minimal descriptor set. Goal: >= 0.95 at every block size
  (the figure is the worst block size).
* ``handoff_overhead_us_p50``: ``benchmarks/handoff.py``'s ``run_demo``, push
  over NIXL through ``kvpush demo`` (a router, a leader and a rank process per
  side): KV ready at the prefill to ``Ready`` delivered at the decode, minus a
  raw copy of the same bytes, at 64-token prompts by default (512 KiB of KV:
  the fixed part, which the goal is about; ``--prompt-tokens 512`` is
  ``handoff.py``'s size). Goal: <= 100 us.
* ``decode_caller_us_per_request``: the same demo run, the decode leader's
  wall time in protocol calls per request (inside the running process). Goal:
  <= 20 us. ``decode_caller_us_isolated`` (``handoff.isolated_caller_cost``,
  no I/O) rides along.
* ``lifecycle_us_tp1``: ``benchmarks/core_lifecycle.py``'s ``lifecycles`` at
  TP 1 -> 1 (the sans-IO core alone). Goal: <= 50 us.

Each round also keeps the demo's phase table (p50, ms) so that a missed
handoff goal shows where its time went.

    UCX_NET_DEVICES=lo .venv/bin/python benchmarks/wire.py [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import core_lifecycle
import handoff
import nixl_throughput

GOALS: dict[str, tuple[str, float]] = {
    "nixl_kvpush_over_raw_best": (">=", 0.95),
    "handoff_overhead_us_p50": ("<=", 100.0),
    "decode_caller_us_per_request": ("<=", 20.0),
    "lifecycle_us_tp1": ("<=", 50.0),
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def nixl_round(reps: int, total_mib: int, nap_us: float) -> dict[str, Any]:
    total = total_mib * nixl_throughput.MIB
    per_block = {}
    for block in nixl_throughput.BLOCK_SIZES:
        entry = nixl_throughput.measure(block, total, reps, 0, nap_us / 1e6)
        if not all(entry["verified"].values()):
            raise SystemExit(f"nixl: a transfer delivered the wrong bytes at {block} B blocks")
        per_block[str(block)] = {
            "kvpush_over_best": entry["kvpush_over_best"],
            "kvpush_plan_ms": entry["kvpush_plan_ms"],
            "kvpush_excl_plan_over_best": entry["kvpush_excl_plan_over_best"],
            "total_ms": entry["total_ms"],
        }
    return per_block


def demo_round(args: argparse.Namespace) -> dict[str, Any]:
    demo = argparse.Namespace(
        transport="nixl",
        requests=args.requests,
        qps=args.qps,
        prompt_tokens=args.prompt_tokens,
    )
    result = handoff.run_demo("push", demo)
    if result["failed"] or result["corrupt_blocks"] or result["leaked_blocks"]:
        raise SystemExit(f"demo: {result['failed']} failed, {result['corrupt_blocks']} corrupt")
    return {
        "handoff_overhead_us_p50": result["handoff_overhead_ms"]["p50"] * 1e3,
        "decode_caller_us_per_request": result["decode_caller_us_per_request"],
        "phases_ms_p50": {k: v["p50"] for k, v in result["phases_ms"].items()},
        "raw_copy_ms_per_request": result["raw_copy_ms_per_request"],
    }


def lifecycle_round(n: int) -> float:
    seconds, _ = core_lifecycle.lifecycles(1, n)
    return seconds / n * 1e6


def met(name: str, value: float) -> bool:
    op, goal = GOALS[name]
    return value >= goal if op == ">=" else value <= goal


def _med(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def _figures(
    rounds: list[dict[str, Any]], wanted: set[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The figures (medians over the rounds) and their detail."""
    figures: dict[str, Any] = {}
    detail: dict[str, Any] = {}
    if "nixl" in rounds[0]:
        blocks = list(rounds[0]["nixl"])
        ratio = {b: _med([r["nixl"][b]["kvpush_over_best"] for r in rounds]) for b in blocks}
        figures["nixl_kvpush_over_raw_best"] = min(ratio.values())
        detail["nixl_per_block"] = {
            b: {
                "kvpush_over_best": ratio[b],
                "kvpush_excl_plan_over_best": _med(
                    [r["nixl"][b]["kvpush_excl_plan_over_best"] for r in rounds]
                ),
                "kvpush_plan_ms": _med([r["nixl"][b]["kvpush_plan_ms"] for r in rounds]),
            }
            for b in blocks
        }
    if "demo" in rounds[0]:
        for key in ("handoff_overhead_us_p50", "decode_caller_us_per_request"):
            if key in wanted:
                figures[key] = _med([r["demo"][key] for r in rounds])
        phases = rounds[0]["demo"]["phases_ms_p50"]
        detail["demo_phases_ms_p50"] = {
            k: _med([r["demo"]["phases_ms_p50"][k] for r in rounds]) for k in phases
        }
        detail["raw_copy_ms_per_request"] = _med(
            [r["demo"]["raw_copy_ms_per_request"] for r in rounds]
        )
        if "decode_caller_us_per_request" in wanted:
            detail["decode_caller_us_isolated"] = handoff.isolated_caller_cost()
    if "lifecycle_us_tp1" in rounds[0]:
        figures["lifecycle_us_tp1"] = _med([r["lifecycle_us_tp1"] for r in rounds])
    return figures, detail


def main() -> int:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds (medians are reported)")
    ap.add_argument("--reps", type=int, default=5, help="nixl_throughput rounds per block size")
    ap.add_argument("--total-mib", type=int, default=64)
    ap.add_argument("--target-nap-us", type=float, default=200.0)
    ap.add_argument("--requests", type=int, default=64, help="demo requests per round")
    ap.add_argument("--qps", type=float, default=50.0)
    ap.add_argument(
        "--prompt-tokens", type=int, default=64, help="demo prompt (default 64: the fixed part)"
    )
    ap.add_argument("--lifecycles", type=int, default=20_000, help="core lifecycles per round")
    ap.add_argument("--only", choices=sorted(GOALS), action="append", default=None)
    ap.add_argument("--quick", action="store_true", help="1 round, 3 reps, 32 requests")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.reps, args.requests, args.lifecycles = 1, 3, 32, 5_000
    wanted = set(args.only or GOALS)
    started = time.monotonic()
    rounds: list[dict[str, Any]] = []
    for k in range(args.rounds):
        log(f"round {k + 1} of {args.rounds}")
        rnd: dict[str, Any] = {}
        if "lifecycle_us_tp1" in wanted:
            rnd["lifecycle_us_tp1"] = lifecycle_round(args.lifecycles)
        if wanted & {"handoff_overhead_us_p50", "decode_caller_us_per_request"}:
            rnd["demo"] = demo_round(args)
        if "nixl_kvpush_over_raw_best" in wanted:
            rnd["nixl"] = nixl_round(args.reps, args.total_mib, args.target_nap_us)
        log(json.dumps(rnd))
        rounds.append(rnd)

    figures, detail = _figures(rounds, wanted)
    out = {
        "figures": figures,
        "goals": {k: f"{GOALS[k][0]} {GOALS[k][1]:g}" for k in figures},
        "met": {k: met(k, v) for k, v in figures.items()},
        "detail": detail,
        "rounds": args.rounds,
        "settings": {
            "nixl_reps": args.reps,
            "total_mib": args.total_mib,
            "target_nap_us": args.target_nap_us,
            "demo_requests": args.requests,
            "demo_qps": args.qps,
            "prompt_tokens": args.prompt_tokens,
            "lifecycles": args.lifecycles,
        },
        "calibration_sum1000_us": round(core_lifecycle.calibration_us(), 2),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "elapsed_s": round(time.monotonic() - started, 1),
        "per_round": rounds,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
