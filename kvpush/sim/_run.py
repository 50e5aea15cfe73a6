"""One simulated run: Poisson arrivals into a fleet, then a summary row."""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from ._faults import FaultInjector
from ._fleet import MODES, Fleet
from ._params import Scenario, ScenarioError
from ._request import Request

__all__ = ("Result", "Row", "simulate")


@dataclass(frozen=True, slots=True)
class Row:
    """One point of a sweep: what ``--json`` prints per run."""

    mode: str
    qps: float
    input_tokens: int
    requests: int
    completed: int
    failed: int
    ttft_ms_mean: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    tpot_ms_mean: float
    tpot_ms_p50: float
    #: Where the time goes (means over completed requests, ms).
    prefill_queue_ms: float
    prefill_ms: float
    handoff_ms: float
    join_ms: float
    #: Push: source KV held per delivered transfer (KV ready to released), and
    #: the part of it after the last write, waiting for the decode's ack (ms).
    source_held_ms: float | None
    held_for_ack_ms: float | None
    preemptions: int
    stale_pairings: int
    corrupt_writes: int
    recovery_s: float | None
    failures: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Result:
    """A run's row plus the fleet, for checks (conservation, determinism)."""

    row: Row
    fleet: Fleet
    requests: list[Request]
    events: int


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _mean_ms(seconds: list[float]) -> float | None:
    """The mean in ms, ``None`` without samples (JSON-safe, and equal to itself)."""
    return round(statistics.fmean(seconds) * 1e3, 2) if seconds else None


def simulate(
    scenario: Scenario,
    mode: str,
    qps: float,
    input_tokens: int,
    *,
    requests: int | None = None,
    duration: float | None = None,
    seed: int = 0,
) -> Result:
    """Simulate ``mode`` at ``qps`` with ``input_tokens`` per request until
    ``requests`` have arrived (or ``duration`` simulated seconds passed), then
    until every request ended and every protocol timer ran out."""
    if mode not in MODES:
        raise ScenarioError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    if not qps > 0 or input_tokens < 1:
        raise ScenarioError("qps must be > 0 and input tokens >= 1")
    if requests is None and duration is None:
        requests = 200
    fleet = Fleet(scenario, mode, seed)
    faults = FaultInjector(fleet)
    out_tokens = scenario.fleet.output_tokens
    arrivals = random.Random(seed)  # its own stream: every mode sees the same arrivals
    t = 0.0
    made: list[Request] = fleet.requests

    def next_arrival() -> None:
        r = Request(len(made), f"r{len(made)}", fleet.loop.now, input_tokens, out_tokens)
        made.append(r)
        fleet.arrive(r)
        schedule()

    def schedule() -> None:
        nonlocal t
        t += arrivals.expovariate(qps)
        if (requests is None or len(made) < requests) and (duration is None or t < duration):
            fleet.loop.at(t, next_arrival)
        else:
            faults.active = False

    schedule()
    fleet.loop.run()
    if fleet.ended != len(made):
        raise RuntimeError(f"{len(made) - fleet.ended} requests never ended")
    return Result(_row(fleet, faults, mode, qps, input_tokens), fleet, made, fleet.loop.events)


def _row(fleet: Fleet, faults: FaultInjector, mode: str, qps: float, n: int) -> Row:
    done = [r for r in fleet.requests if not r.failed]
    ttft = [r.ttft * 1e3 + fleet.hop * 1e3 for r in done]
    tpot = [r.tpot * 1e3 for r in done]
    failures: dict[str, int] = {}
    for r in fleet.requests:
        if r.failed:
            failures[r.failed] = failures.get(r.failed, 0) + 1
    return Row(
        mode=mode,
        qps=qps,
        input_tokens=n,
        requests=len(fleet.requests),
        completed=len(done),
        failed=len(fleet.requests) - len(done),
        ttft_ms_mean=round(_mean(ttft), 2),
        ttft_ms_p50=round(_pct(ttft, 0.5), 2),
        ttft_ms_p99=round(_pct(ttft, 0.99), 2),
        tpot_ms_mean=round(_mean(tpot), 3),
        tpot_ms_p50=round(_pct(tpot, 0.5), 3),
        prefill_queue_ms=round(_mean([(r.prefill_start - r.arrival) * 1e3 for r in done]), 2),
        prefill_ms=round(_mean([(r.kv_ready - r.prefill_start) * 1e3 for r in done]), 2),
        handoff_ms=round(_mean([(r.ready - r.kv_ready) * 1e3 for r in done]), 2),
        join_ms=round(_mean([(r.first_token - r.ready) * 1e3 for r in done]), 2),
        source_held_ms=_mean_ms([h for h, _ in fleet.source_holds]),
        held_for_ack_ms=_mean_ms([a for _, a in fleet.source_holds]),
        preemptions=fleet.stats.get("preemptions", 0),
        stale_pairings=fleet.stats.get("stale_pairings", 0),
        corrupt_writes=fleet.stats.get("corrupt_writes", 0),
        recovery_s=_recovery(fleet, faults),
        failures=failures,
    )


def _recovery(fleet: Fleet, faults: FaultInjector) -> float | None:
    """Seconds from the first fault's onset until requests arriving after it
    stop failing and their TTFT is back under twice the pre-fault median."""
    if not faults.onsets:
        return None
    onset = faults.onsets[0][1]
    before = [r.ttft for r in fleet.requests if r.arrival < onset and not r.failed]
    if not before:
        before = [r.ttft for r in fleet.requests if not r.failed] or [0.0]
    limit = 2 * statistics.median(before)
    last_bad = onset
    for r in fleet.requests:
        if r.arrival < onset:
            continue
        if r.failed or r.ttft > limit:
            last_bad = max(last_bad, r.arrival + (0.0 if r.failed else r.ttft))
    return round(last_bad - onset, 3)
