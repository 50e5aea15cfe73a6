"""``kvpush simulate``: arguments, the sweep, the table, ``--json``, ``--plot``."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable

from kvpush.protocol import ConfigError

from ._fleet import MODES
from ._params import Scenario, ScenarioError, load_scenario
from ._run import Row, simulate

__all__ = ("DESCRIPTION", "HELP", "add_arguments", "parse_list", "parse_tokens", "run")

# The ``simulate`` entry of the ``kvpush.commands`` registry (pyproject.toml).
HELP = "simulate a P/D fleet (pull, push, bg-pull, progressive) on the real protocol core"
DESCRIPTION = (
    "Discrete-event model of prefill and decode instances, links and a "
    "router, with the real kvpush producer and consumer on a simulated clock; prints "
    "TTFT and TPOT per mode, QPS and input length (docs/simulation.md)."
)


def parse_tokens(text: str) -> int:
    """``"16k"`` -> 16384, ``"1000"`` -> 1000; anything else is an error."""
    t = text.strip().lower()
    scale = 1
    if t.endswith("k"):
        t, scale = t[:-1], 1024
    if not t.isdigit() or int(t) * scale < 1:
        raise ScenarioError(f"bad token count {text!r} (use e.g. 1000, 1k or 16k)")
    return int(t) * scale


def parse_qps(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ScenarioError(f"bad QPS {text!r} (use e.g. 1,2,4,8)") from None
    if not math.isfinite(value) or value <= 0:
        raise ScenarioError(f"bad QPS {text!r}: must be a positive number")
    return value


def parse_list(text: str, item: Callable[[str], object], what: str) -> list[object]:
    parts = text.split(",")
    if not text.strip() or any(not p.strip() for p in parts):
        raise ScenarioError(f"bad {what} list {text!r}: empty item")
    return [item(p.strip()) for p in parts]


def _mode(text: str) -> str:
    if text not in MODES:
        raise ScenarioError(f"unknown mode {text!r} (known: {', '.join(MODES)})")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default="seed", help="scenario name or JSON file (default: seed)")
    p.add_argument("--qps", default="1,2,4,8", help="request rates, comma-separated")
    p.add_argument("--input-tokens", default="1k,4k,16k", help="input lengths, e.g. 1k,4k,16k")
    p.add_argument(
        "--modes", default="pull,push,bg-pull", help="modes: pull, push, bg-pull, progressive"
    )
    p.add_argument("--requests", type=int, default=None, help="requests per run (default 1000)")
    p.add_argument("--duration", type=float, default=None, help="simulated seconds of arrivals")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--prefill", type=int, default=None, help="prefill instances (overrides)")
    p.add_argument("--decode", type=int, default=None, help="decode instances (overrides)")
    p.add_argument("--router", choices=("auto", "sequential", "concurrent"), default=None)
    p.add_argument("--preempt-rate", type=float, default=None, help="preemptions/s per decode")
    p.add_argument("--kill-prefill-at", type=float, default=None, help="kill p0 at this time (s)")
    p.add_argument("--slow-link-at", type=float, default=None, help="slow p0's link at (s)")
    p.add_argument("--json", action="store_true", help="print a JSON list of rows")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="write a PNG grid")


def _scenario(args: argparse.Namespace) -> Scenario:
    """The scenario with the overrides given (each checked by its section)."""
    fleet = {"prefill": args.prefill, "decode": args.decode, "router": args.router}
    faults = {
        "preempt_per_s": args.preempt_rate,
        "kill_prefill_at_s": args.kill_prefill_at,
        "slow_link_at_s": args.slow_link_at,
    }
    s = load_scenario(args.scenario).with_fleet(**{k: v for k, v in fleet.items() if v is not None})
    return s.with_faults(**{k: v for k, v in faults.items() if v is not None})


def _progress(total: int, quiet: bool) -> tuple[Callable[[str], None], Callable[[], None]]:
    """A rich progress bar on stderr when it is a terminal, else nothing."""
    if quiet or total < 2 or not sys.stderr.isatty():
        return (lambda _: None), (lambda: None)
    try:
        from rich.progress import Progress
    except ImportError:
        return (lambda _: None), (lambda: None)
    bar = Progress(transient=True)
    task = bar.add_task("simulating", total=total)
    bar.start()
    return (lambda label: bar.update(task, advance=1, description=label)), bar.stop


def _table(rows: list[Row]) -> str:
    head = (
        f"{'mode':11} {'qps':>6} {'input':>6} {'done':>5} {'fail':>4} {'TTFT mean':>10} "
        f"{'p50':>8} {'p99':>8} {'TPOT':>7} {'P queue':>8} {'prefill':>8} "
        f"{'handoff':>8} {'join':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.mode:11} {r.qps:>6g} {r.input_tokens:>6} {r.completed:>5} {r.failed:>4} "
            f"{r.ttft_ms_mean:>10.1f} {r.ttft_ms_p50:>8.1f} {r.ttft_ms_p99:>8.1f} "
            f"{r.tpot_ms_mean:>7.2f} {r.prefill_queue_ms:>8.1f} {r.prefill_ms:>8.1f} "
            f"{r.handoff_ms:>8.1f} {r.join_ms:>6.1f}"
        )
    lines.append("times in ms; handoff = KV ready on P -> KV ready on D; join = -> first token")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the sweep; returns the exit status (2 for bad input)."""
    try:
        qps = [float(str(q)) for q in parse_list(args.qps, parse_qps, "QPS")]
        tokens = [int(str(t)) for t in parse_list(args.input_tokens, parse_tokens, "input-tokens")]
        modes = [str(m) for m in parse_list(args.modes, _mode, "modes")]
        if args.requests is not None and args.requests < 1:
            raise ScenarioError("--requests must be >= 1")
        if args.duration is not None and not (math.isfinite(args.duration) and args.duration > 0):
            raise ScenarioError("--duration must be a positive number of seconds")
        scenario = _scenario(args)
    except (ScenarioError, ConfigError) as exc:
        print(f"kvpush simulate: {exc}", file=sys.stderr)
        return 2
    requests = args.requests
    if requests is None and args.duration is None:
        requests = 1000
    points = [(n, q, m) for n in tokens for q in qps for m in modes]
    advance, stop = _progress(len(points), args.json)
    rows: list[Row] = []
    started = time.perf_counter()
    try:
        for n, q, m in points:
            result = simulate(
                scenario, m, q, n, requests=requests, duration=args.duration, seed=args.seed
            )
            rows.append(result.row)
            advance(f"{m} {q:g} QPS {n} tokens")
    finally:
        stop()
    wall = time.perf_counter() - started
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=1))
    else:
        f = scenario.fleet
        print(
            f"scenario {scenario.name}: {f.prefill}P + {f.decode}D, TP{scenario.hardware.tp}, "
            f"{scenario.model.name}, output {f.output_tokens} tokens, seed {args.seed}"
        )
        print(_table(rows))
        faulty = [r for r in rows if r.failed or r.preemptions or r.recovery_s is not None]
        for r in faulty:
            print(
                f"{r.mode} {r.qps:g} QPS {r.input_tokens}: failed {r.failed} {r.failures}, "
                f"preemptions {r.preemptions}, recovery {r.recovery_s} s, "
                f"stale pairings {r.stale_pairings}, corrupt writes {r.corrupt_writes}"
            )
        print(f"wall time {wall:.1f} s for {len(rows)} runs")
    if args.plot:
        from ._plot import plot

        try:
            plot(rows, args.plot)
        except OSError as exc:
            print(f"kvpush simulate: cannot write {args.plot!r}: {exc}", file=sys.stderr)
            return 2
    return 0
