"""The numbers of a run: the per-request phase timeline, as percentiles.

Phases, from the prefill's and the decode's timelines (their clocks are the
same ``time.monotonic()``, and the data planes stamp on it too) and the
supervisor's dispatch time. Each starts where the one before ends, so per request
compute + handoff preparation + transfer + ready is TTFT (``phase_sum_error``
is the largest relative gap over the run; a stamp that is missing is counted
in ``unstamped``):

* registration: decode reserved -> prefill received the registration (it
  overlaps compute: not part of the sum)
* compute: dispatch -> ``kv_ready`` (the simulated prefill, pattern written)
* handoff prep: ``kv_ready`` -> the mover's data plane has the plan of its
  last op (push: the prefill's writes; pull: the decode's reads). Waiting for a
  late registration, the core's decision, the hop to the data-plane thread
  and planning (pull: also the Announce's trip and the decode's decision).
  ``planning`` is the longest single plan, part of this phase
* transfer: that -> the data is there: the decode's data plane polled the last
  completion notice (push) or saw the last read settle (pull). ``posting`` is
  the longest single transport call, part of this phase (the shared-memory
  transport copies inside it)
* ready: that -> the runtime handed ``Ready`` to the decode's caller (the hop
  from the data-plane thread to the event loop, the core settling every rank
  pair, the event queue)
* ttft: dispatch -> ``Ready`` delivered

``handoff_overhead`` is ``(Ready delivered - kv_ready)`` minus a raw copy of
the request's bytes: what the handoff costs on top of moving them.
``source_held`` is ``kv_ready`` -> the prefill released the source blocks, and
``held_for_ack`` the part of it after the last write settled: the prefill
keeps delivered KV until the decode acknowledges it (docs/protocol.md, "Hold
until acknowledged"). Only completed requests count.

``instances`` has, for every instance, its side, TP, the completed requests
it ``served`` and its ``leaked_blocks``; ``pairs`` counts the completed
requests of each ``"prefill -> decode"`` pair.

``bytes`` is the KV of the completed requests (whole blocks, every layer and
head: what crossed between the instances); ``gbps`` is that in gigabits per
second over the run's wall time (first dispatch to last request settled), so
with ``--qps`` it follows the arrival rate. ``leaked_blocks`` adds, at the
end, over every instance, the prefill endpoints' ``held_blocks``, the decode
endpoints' ``reserved_blocks`` and the blocks each leader's own pool still
has out.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._model import ModelShape
from ._supervisor import DemoConfig, RequestRecord, RunResult

__all__ = ("CHAIN", "PHASES", "percentiles", "problems", "render", "sum_error", "summarize")

#: (key, label) of each phase, in timeline order ("of which": part of the row above).
PHASES: tuple[tuple[str, str], ...] = (
    ("registration", "registration"),
    ("compute", "compute (prefill)"),
    ("handoff_prep", "handoff preparation"),
    ("planning", "  of which planning"),
    ("transfer", "transfer"),
    ("posting", "  of which posting"),
    ("ready", "ready"),
    ("ttft", "TTFT (dispatch -> Ready delivered)"),
    ("handoff_overhead", "handoff overhead"),
    ("source_held", "source KV held (prefill)"),
    ("held_for_ack", "  of which after the writes"),
)

#: The phases that follow each other from dispatch to Ready delivered.
CHAIN = ("compute", "handoff_prep", "transfer", "ready")


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99 (linear interpolation), ``None`` without values."""
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    xs = sorted(values)

    def at(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 4)

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99)}


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (b - a) * 1e3


def raw_copy_ms(nbytes: int, repeats: int = 5) -> float:
    """Median time of one plain memory copy of ``nbytes`` (the pure transfer
    time the handoff overhead is measured against), taken in the same run."""
    src = np.ones(max(nbytes, 1), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _phases(rec: RequestRecord, raw_ms: float) -> dict[str, float | None]:
    p, c = rec.producer, rec.consumer
    assert p is not None and c is not None
    ops = c.ops if c.ops is not None else p.ops  # pull: the decode reads
    moving = None if ops is None else ops.planned
    landed = c.notice_seen if c.notice_seen is not None else (c.ops.done if c.ops else None)
    end_to_end = _ms(p.kv_ready, c.delivered)
    return {
        "registration": _ms(c.reserved, p.registration_received),
        "compute": _ms(rec.dispatched, p.kv_ready),
        "handoff_prep": _ms(p.kv_ready, moving),
        "planning": None if ops is None else ops.planning * 1e3,
        "transfer": _ms(moving, landed),
        "posting": None if ops is None else ops.posting * 1e3,
        "ready": _ms(landed, c.delivered),
        "ttft": _ms(rec.dispatched, c.delivered),
        # KV ready at prefill -> Ready delivered at decode, minus a raw copy.
        "handoff_overhead": None if end_to_end is None else end_to_end - raw_ms,
        # Off the chain: kv_ready -> the source released, and the part of it
        # after the last write settled (the hold until the decode's ack).
        "source_held": _ms(p.kv_ready, p.released),
        "held_for_ack": _ms(p.write_done, p.released),
    }


def sum_error(phases: dict[str, float | None]) -> float | None:
    """``|sum of the chained phases - TTFT| / TTFT`` (``None``: a stamp is missing)."""
    parts = [phases[k] for k in CHAIN]
    ttft = phases["ttft"]
    if ttft is None or not ttft > 0 or any(v is None for v in parts):
        return None
    return abs(sum(v for v in parts if v is not None) - ttft) / ttft


def summarize(cfg: DemoConfig, model: ModelShape, result: RunResult) -> dict[str, Any]:
    """The run as one JSON-able object."""
    done = [r for r in result.records if r.producer and r.consumer]
    ok = [r for r in done if r.consumer and r.consumer.ok]
    reasons: Counter[str] = Counter()
    for r in done:
        assert r.producer is not None and r.consumer is not None
        if not r.consumer.ok:
            reasons[f"decode: {r.consumer.reason}"] += 1
        if r.producer.outcome != "delivered":
            reasons[f"prefill: {r.producer.outcome}"] += 1
    samples: dict[str, list[float]] = {key: [] for key, _ in PHASES}
    per_request = result.plan.blocks_per_request * model.block_bytes
    raw_ms = raw_copy_ms(per_request)
    errors: list[float] = []
    unstamped = 0
    for r in ok:
        phases = _phases(r, raw_ms)
        for key, value in phases.items():
            if value is not None:
                samples[key].append(value)
        error = sum_error(phases)
        if error is None:
            unstamped += 1
        else:
            errors.append(error)
    nbytes = len(ok) * result.plan.blocks_per_request * model.block_bytes
    leaked = sum(s.endpoint_blocks + s.pool_blocks for s in result.stats.values())
    instances, pairs = _instances(result, ok)
    return {
        "mode": cfg.mode.value,
        "progressive": cfg.progressive,
        # Progressive push: requests whose first write started before the
        # prompt was done (0 in one-shot push, where writes wait for kv_ready).
        "written_before_kv_ready": sum(
            1
            for r in ok
            if r.producer
            and r.producer.write_started is not None
            and r.producer.kv_ready is not None
            and r.producer.write_started < r.producer.kv_ready
        ),
        "transport": cfg.transport,
        "model": model.name,
        "kv_bytes_per_token": model.token_bytes,
        "prompt_tokens": cfg.prompt_tokens,
        "tp_prefill": cfg.tp_prefill,
        "tp_decode": cfg.tp_decode,
        "prefills": cfg.prefills,
        "decodes": cfg.decodes,
        "qps": cfg.qps,
        "seed": cfg.seed,
        "requests": cfg.requests,
        "completed": len(ok),
        "failed": cfg.requests - len(ok),
        "failure_reasons": dict(sorted(reasons.items())),
        "corrupt_blocks": sum(r.consumer.corrupt_blocks for r in ok if r.consumer),
        "ttft_ms": percentiles(samples["ttft"]),
        "handoff_overhead_ms": percentiles(samples["handoff_overhead"]),
        "phases_ms": {key: percentiles(samples[key]) for key, _ in PHASES},
        "phase_sum_error": round(max(errors), 6) if errors else None,
        "unstamped": unstamped,
        "bytes": nbytes,
        "wall_s": round(result.wall, 4),
        "gbps": round(nbytes * 8 / 1e9 / result.wall, 4) if result.wall > 0 else 0.0,
        "leaked_blocks": leaked,
        "instances": instances,
        "pairs": pairs,
        "leftover_segments": len(result.leftovers),
        "pool_blocks": result.plan.num_blocks,
        "max_in_flight": result.plan.slots,
        "frames_dropped": sum(s.frames_dropped for s in result.stats.values()),
        "decode_caller_us_per_request": _caller_us(result),
        "raw_copy_ms_per_request": round(raw_ms, 4),
    }


def _instances(
    result: RunResult, ok: list[RequestRecord]
) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """Per instance: side, TP, requests served, blocks leaked; per pair: requests."""
    served = Counter(name for r in ok for name in (r.prefill, r.decode))
    pairs = Counter(f"{r.prefill} -> {r.decode}" for r in ok)
    instances: dict[str, dict[str, Any]] = {}
    for side, members in (("prefill", result.prefills), ("decode", result.decodes)):
        for name, tp in members.items():
            st = result.stats.get(name)
            leaked = st.endpoint_blocks + st.pool_blocks if st is not None else None
            instances[name] = {
                "side": side,
                "tp": tp,
                "served": served[name],
                "leaked_blocks": leaked,
            }
    every = [f"{p} -> {d}" for p in result.prefills for d in result.decodes]
    return instances, {pair: pairs[pair] for pair in every}


def _caller_us(result: RunResult) -> float | None:
    """Decode loop time in protocol calls per request: the median reserve call
    plus the median Ready handling (medians: the first request also pays for
    the handshake, once per peer)."""
    reserve = [t for s in result.stats.values() for t in s.caller_reserve]
    ready = [t for s in result.stats.values() for t in s.caller_ready]
    if not reserve:
        return None
    total = statistics.median(reserve) + (statistics.median(ready) if ready else 0.0)
    return round(total * 1e6, 2)


def problems(summary: dict[str, Any]) -> list[str]:
    """What makes the run a failure (empty: it passed its own checks)."""
    out = []
    if summary["completed"] != summary["requests"]:
        out.append(f"{summary['failed']} of {summary['requests']} requests failed")
    error = summary["phase_sum_error"]
    if error is not None and error > 0.01:
        out.append(f"the phases miss TTFT by {error:.1%} in a request")
    for key, what in (
        ("unstamped", "completed requests without every timeline stamp"),
        ("corrupt_blocks", "corrupt blocks"),
        ("leaked_blocks", "leaked blocks"),
        ("leftover_segments", "leftover shared-memory segments"),
    ):
        if summary[key]:
            out.append(f"{summary[key]} {what}")
    leaky = [
        f"{k} {v['leaked_blocks']}" for k, v in summary["instances"].items() if v["leaked_blocks"]
    ]
    if leaky:
        out.append(f"leaked blocks by instance: {', '.join(leaky)}")
    return out


def render(summary: dict[str, Any]) -> Any:
    """A rich renderable: the phase table and the totals."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    tp = f"TP {summary['tp_prefill']} -> {summary['tp_decode']}"
    many = summary["prefills"] * summary["decodes"] > 1
    if many:
        tp = (
            f"{summary['prefills']} prefill x TP {summary['tp_prefill']} -> "
            f"{summary['decodes']} decode x TP {summary['tp_decode']}"
        )
    title = Text(
        f"kvpush demo: {summary['mode']} over {summary['transport']}, {summary['model']} "
        f"({summary['kv_bytes_per_token'] / 1024:,.0f} KiB of KV per token), "
        f"{tp}, {summary['prompt_tokens']} tokens per request",
        style="bold",
    )
    table = Table()
    table.add_column("phase (ms)")
    for q in ("p50", "p95", "p99"):
        table.add_column(q, justify="right")
    for key, label in PHASES:
        row = summary["phases_ms"][key]
        table.add_row(label, *(_fmt(row[q]) for q in ("p50", "p95", "p99")))
    totals = Table.grid(padding=(0, 2))
    totals.add_column()
    totals.add_column(justify="right")
    mib = summary["bytes"] / (1 << 20)
    reasons = ", ".join(f"{k} x{v}" for k, v in summary["failure_reasons"].items())
    rows = [
        ("requests", f"{summary['completed']} / {summary['requests']} completed"),
        ("failed", f"{summary['failed']}" + (f" ({reasons})" if reasons else "")),
        ("corrupt blocks", str(summary["corrupt_blocks"])),
        ("phases vs TTFT", _gap(summary["phase_sum_error"], summary["unstamped"])),
        ("leaked blocks", str(summary["leaked_blocks"])),
        ("bytes moved", f"{mib:,.1f} MiB"),
        ("throughput", f"{summary['gbps']:.3f} Gbit/s over {summary['wall_s']:.2f} s"),
        (
            "in flight at most",
            f"{summary['max_in_flight']} ({summary['pool_blocks']} blocks/instance)",
        ),
    ]
    if many:
        for side in ("prefill", "decode"):
            counts = [
                f"{name} {i['served']} (leaked {i['leaked_blocks']})"
                for name, i in summary["instances"].items()
                if i["side"] == side
            ]
            rows.append((f"served by {side}", ", ".join(counts)))
        rows.append(("served by pair", "\n".join(f"{k} {v}" for k, v in summary["pairs"].items())))
    for k, v in rows:
        totals.add_row(k, v)
    return Group(title, table, totals)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _gap(error: float | None, unstamped: int) -> str:
    """The phase check as a totals row."""
    text = "-" if error is None else f"sum within {error:.3%} per request"
    return text + (f" ({unstamped} unstamped)" if unstamped else "")
