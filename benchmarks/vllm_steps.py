"""Engine-side figures for ``vllm_peer.py``: engine TPOT from vLLM's own
histogram, and the connector's cost per engine step from ``step_profile_file``.

* **Engine TPOT**: vLLM's ``vllm:inter_token_latency_seconds`` histogram
  (every engine runs with the fine buckets of :data:`ITL_BUCKETS`), read
  before and after a window: the mean and the median (interpolated inside
  its bucket) of the inter-token latencies the engine recorded meanwhile.
  For a disaggregated mode it is the decode engine's: its decode steps.
* **Per-step cost** (``kvpush_vllm/_steps.py`` writes one line per step
  cycle per connector instance): for each side (prefill, decode) and role
  (scheduler, worker), the time in all of vLLM's calls per step (p50, p95,
  mean), each method's mean, and the round trips to the runtime's thread per
  step, over the steps that scheduled at least ``min_scheduled`` requests
  (and over every busy step). ``in_all_mean_us`` adds the scheduler's mean
  to each worker's: what one step pays in the connector in all.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = (
    "ITL",
    "ITL_BUCKETS",
    "by_window",
    "histogram",
    "itl_delta",
    "kvpush_threads",
    "step_summary",
)

ITL = "vllm:inter_token_latency_seconds"
#: 0.25 ms to 10 s, x1.25 apart (a median good to a few percent).
ITL_BUCKETS = [round(0.00025 * 1.25**i, 7) for i in range(48)]


def histogram(page: Mapping[str, float], name: str = ITL) -> dict[str, Any]:
    """``{"buckets": {le: cumulative count}, "sum": s, "count": n}`` of a
    Prometheus page (``cluster.metrics``), summed over label sets."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for key, value in page.items():
        metric, _, rest = key.partition("{")
        if metric == f"{name}_bucket":
            le = rest.split('le="', 1)[1].split('"', 1)[0]
            bound = math.inf if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + value
        elif metric == f"{name}_sum":
            total += value
        elif metric == f"{name}_count":
            count += value
    return {"buckets": buckets, "sum": total, "count": count}


def itl_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What was observed between two :func:`histogram` reads."""
    buckets = {
        le: after["buckets"].get(le, 0.0) - before["buckets"].get(le, 0.0)
        for le in after["buckets"]
    }
    return {
        "buckets": buckets,
        "sum": after["sum"] - before["sum"],
        "count": after["count"] - before["count"],
    }


def merge(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    if a is None:
        return b
    les = set(a["buckets"]) | set(b["buckets"])
    return {
        "buckets": {le: a["buckets"].get(le, 0.0) + b["buckets"].get(le, 0.0) for le in les},
        "sum": a["sum"] + b["sum"],
        "count": a["count"] + b["count"],
    }


def itl_figures(h: dict[str, Any] | None) -> dict[str, Any]:
    """Mean and interpolated median (ms) of a :func:`itl_delta`."""
    if h is None or h["count"] <= 0:
        return {"count": 0, "mean_ms": None, "p50_ms": None}
    n = h["count"]
    half = n / 2
    lo, below = 0.0, 0.0
    p50 = None
    for le in sorted(h["buckets"]):
        c = h["buckets"][le]
        if c >= half:
            if math.isinf(le):
                p50 = lo
            else:
                inside = c - below
                p50 = lo + (le - lo) * ((half - below) / inside if inside > 0 else 0.0)
            break
        lo, below = le, c
    return {
        "count": int(n),
        "mean_ms": round(1000 * h["sum"] / n, 3),
        "p50_ms": None if p50 is None else round(1000 * p50, 3),
    }


def kvpush_threads(paths: Iterable[Path]) -> dict[str, tuple[int, int]]:
    """``"side:role:thread"`` -> (pid, OS thread id) of kvpush's threads, from
    the profiles' ``threads`` lines (the latest per process)."""
    out: dict[str, tuple[int, int]] = {}
    for line in _read(paths, kind="threads"):
        for name, tid in line["threads"].items():
            out[f"{line['side']}:{line['role']}:{name}"] = (line["pid"], tid)
    return out


def _read(paths: Iterable[Path], kind: str | None = None) -> list[dict[str, Any]]:
    """The profiles' step lines (``kind`` None), or their lines of ``kind``."""
    lines = []
    for path in paths:
        if not path.exists():
            continue
        for raw in path.read_text().splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if line.get("kind") == kind:
                lines.append(line)
    return lines


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _figures(steps: list[dict[str, Any]]) -> dict[str, Any]:
    totals = [sum(s["ns"].values()) / 1000 for s in steps]
    methods: dict[str, float] = {}
    calls: dict[str, float] = {}
    for s in steps:
        for m, ns in s["ns"].items():
            methods[m] = methods.get(m, 0.0) + ns / 1000
            calls[m] = calls.get(m, 0.0) + s["calls"].get(m, 0)
    n = len(steps)
    return {
        "steps": n,
        "scheduled_p50": statistics.median(s["scheduled"] for s in steps),
        "per_step_us": {
            "p50": round(_pct(totals, 0.5), 1),
            "p95": round(_pct(totals, 0.95), 1),
            "mean": round(sum(totals) / n, 1),
        },
        "hops_per_step": round(sum(s["hops"] for s in steps) / n, 3),
        "method_mean_us": {
            m: round(v / n, 2) for m, v in sorted(methods.items(), key=lambda kv: -kv[1])
        },
        "calls_per_step": {m: round(v / n, 2) for m, v in sorted(calls.items())},
    }


def by_window(
    paths: Iterable[Path], windows: Mapping[str, list[tuple[float, float]]]
) -> dict[str, Any]:
    """Per window label (a load and a mode): per side and role, the busy
    steps that ended inside its windows (``time.monotonic()``), with the
    engine's step cadence (``step_interval_ms``: the p50 gap between two
    consecutive busy steps of one process)."""
    lines = _read(paths)
    out: dict[str, Any] = {}
    for label, spans in windows.items():
        inside = [ln for ln in lines if any(a <= ln["t"] <= b for a, b in spans)]
        by: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for line in inside:
            if line["scheduled"] > 0:
                by.setdefault((line["side"], line["role"]), []).append(line)
        for (side, role), steps in sorted(by.items()):
            entry = _figures(steps)
            gaps = [
                (b["t"] - a["t"]) * 1000
                for a, b in itertools.pairwise(steps)
                if a["pid"] == b["pid"]
            ]
            if gaps:
                entry["step_interval_ms"] = round(_pct(gaps, 0.5), 3)
            out.setdefault(label, {}).setdefault(side, {})[role] = entry
    return out


def step_summary(paths: Iterable[Path], min_scheduled: int = 32) -> dict[str, Any]:
    """Per side and role, the connector's cost per step (see the module docs)."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for line in _read(paths):
        by.setdefault((line["side"], line["role"]), []).append(line)
    out: dict[str, Any] = {}
    for (side, role), steps in sorted(by.items()):
        busy = [s for s in steps if s["scheduled"] > 0]
        full = [s for s in steps if s["scheduled"] >= min_scheduled]
        entry: dict[str, Any] = {"pids": len({s["pid"] for s in steps})}
        if busy:
            entry["busy"] = _figures(busy)
        if full:
            entry[f"scheduled_ge_{min_scheduled}"] = _figures(full)
        out.setdefault(side, {})[role] = entry
    for roles in out.values():
        # One scheduler, and every worker (TP ranks) each step.
        sched, work = roles.get("scheduler", {}), roles.get("worker", {})
        for key in ("busy", f"scheduled_ge_{min_scheduled}"):
            if key not in sched and key not in work:
                continue
            s_us = sched.get(key, {}).get("per_step_us", {}).get("mean", 0.0)
            w_us = work.get(key, {}).get("per_step_us", {}).get("mean", 0.0)
            total = s_us + w_us * work.get("pids", 1)
            roles.setdefault("in_all_mean_us", {})[key] = round(total, 1)
    return out
