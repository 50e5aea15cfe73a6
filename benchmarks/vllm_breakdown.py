"""Per-request breakdown of kvpush inside real vLLM engines.

``benchmarks/vllm_peer.py`` runs the kvpush engines and the router with
``timeline_file`` set: each writes one JSON line per transfer
(``kvpush_vllm/_breakdown.py``), every moment on ``time.monotonic()``, which
is one clock for every process of a host. This module joins the lines of the
router, the prefill and the decode with the client's own stamps by transfer
id, and splits each request's TTFT into consecutive phases: the chain below
runs from the client's send to the first token it read, so a request's
phases sum to its TTFT exactly (``sum_error_max`` checks it).
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ("CHAINS", "join", "phases", "read_lines", "summary")

#: The moments of one request, in order, per mode ("side.field"). Push: the
#: prefill's data plane plans and posts the write, the decode's polls its
#: notice. Pull: the prefill announces, the decode's data plane reads.
CHAINS: dict[str, tuple[str, ...]] = {
    "push": (
        "client.sent", "router.received", "router.dispatched", "prefill.scheduled",
        "prefill.kv_ready", "prefill.write_started", "prefill.op_plan_started",
        "prefill.op_planned", "prefill.op_posted", "decode.notice_seen", "decode.ready",
        "decode.delivered", "decode.recving_seen", "decode.first_step", "client.first_token",
    ),
    "pull": (
        "client.sent", "router.received", "router.dispatched", "prefill.scheduled",
        "prefill.kv_ready", "prefill.write_started", "decode.op_plan_started",
        "decode.op_planned", "decode.op_posted", "decode.op_done", "decode.ready",
        "decode.delivered", "decode.recving_seen", "decode.first_step", "client.first_token",
    ),
}  # fmt: skip

#: What each step of a chain is, for the table (keyed by its end moment).
MEANING = {
    "router.received": "client -> router (HTTP)",
    "router.dispatched": "router picks and splits",
    "prefill.scheduled": "router -> prefill scheduler (HTTP, API server, engine input)",
    "prefill.kv_ready": "prefill computes (steps until the request finished)",
    "prefill.write_started": "rendezvous: KV ready -> writes asked (push) / Announce sent (pull)",
    "prefill.op_plan_started": "push: core -> prefill worker (next step's metadata)",
    "decode.op_plan_started": "pull: Announce -> decode core -> decode worker (next step)",
    "prefill.op_planned": "plan the write",
    "decode.op_planned": "plan the read",
    "prefill.op_posted": "post on NIXL",
    "decode.op_posted": "post on NIXL",
    "decode.notice_seen": "wire + notice polled by the decode worker",
    "decode.op_done": "wire (read settled)",
    "decode.ready": "decode worker -> scheduler (worker metadata at step end) -> core Ready",
    "decode.delivered": "core Ready -> connector (the scheduler's next drain)",
    "decode.recving_seen": "connector -> workers -> vLLM hears finished_recving",
    "decode.first_step": "vLLM schedules the request",
    "client.first_token": "decode step, detokenize, HTTP, router relay",
}


def read_lines(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every JSON line of ``paths`` (missing files are skipped)."""
    out = []
    for path in paths:
        if path.exists():
            out += [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return out


def join(
    lines: Sequence[Mapping[str, Any]], clients: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, float]]:
    """transfer id -> {"side.field": time}: the client's stamps (``sent``,
    ``first_token``) and every side's line (the last line of a side wins)."""
    out: dict[str, dict[str, float]] = {
        tid: {f"client.{k}": v for k, v in c.items()} for tid, c in clients.items()
    }
    for line in lines:
        tid = line.get("transfer_id")
        if tid not in out:
            continue
        side = line["side"]
        for key, value in line.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[tid][f"{side}.{key}"] = float(value)
    return out


def phases(stamps: Mapping[str, float], chain: Sequence[str]) -> list[float] | None:
    """The seconds between consecutive moments of ``chain``; None if one is missing."""
    if any(m not in stamps for m in chain):
        return None
    return [stamps[b] - stamps[a] for a, b in itertools.pairwise(chain)]


def summary(joined: Mapping[str, Mapping[str, float]], mode: str) -> dict[str, Any]:
    """Per phase of ``mode``'s chain: p50 and p90 in ms over complete requests;
    how many were incomplete (a missing moment: a failed or recomputed request)
    and the largest relative gap between a request's phase sum and its TTFT."""
    chain = CHAINS[mode]
    per: list[list[float]] = []
    worst = 0.0
    incomplete = 0
    for stamps in joined.values():
        ph = phases(stamps, chain)
        if ph is None:
            incomplete += 1
            continue
        ttft = stamps["client.first_token"] - stamps["client.sent"]
        worst = max(worst, abs(sum(ph) - ttft) / ttft if ttft > 0 else 0.0)
        per.append(ph)
    rows = []
    for i, end in enumerate(chain[1:]):
        xs = sorted(p[i] for p in per)
        rows.append(
            {
                "phase": f"{chain[i]} -> {end}",
                "what": MEANING.get(end, ""),
                "p50_ms": round(statistics.median(xs) * 1e3, 2) if xs else None,
                "p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 2) if xs else None,
            }
        )
    lead = [
        s["prefill.kv_ready"] - s["prefill.registration_received"]
        for s in joined.values()
        if "prefill.kv_ready" in s and "prefill.registration_received" in s
    ]
    return {
        "requests": len(per),
        "incomplete": incomplete,
        "sum_error_max": round(worst, 6),
        "phases": rows,
        # > 0: the registration was at the prefill before its KV was ready (the overlap push wants)
        "registration_lead_ms_p50": round(statistics.median(lead) * 1e3, 2) if lead else None,
    }


def table(mode: str, s: Mapping[str, Any]) -> str:
    rows = [
        f"{mode}: {s['requests']} complete, {s['incomplete']} incomplete, "
        f"phase sum vs TTFT within {s['sum_error_max']:.2%}",
        "| phase | p50 ms | p90 ms | what |",
        "|---|---|---|---|",
    ]
    rows += [f"| {r['phase']} | {r['p50_ms']} | {r['p90_ms']} | {r['what']} |" for r in s["phases"]]
    return "\n".join(rows)
