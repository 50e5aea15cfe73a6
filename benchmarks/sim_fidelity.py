"""The simulator's fidelity targets (issue 8), averaged over seeds.

Seed scenario, 1,000 requests per run (vLLM's benchmark default), seeds 0..4:

* 8 QPS, 16k input: TTFT pull/push ~1,744/540 ms, TPOT ~10.4/7.0 ms, each
  within +-15%;
* 1 QPS, 1k input: TTFT and TPOT of pull and bg-pull within 10% of push.

Prints a table and exits 1 if a target is missed.

    python benchmarks/sim_fidelity.py [--seeds 5] [--requests 1000]
"""

from __future__ import annotations

import argparse
import statistics

from kvpush.sim import load_scenario, simulate

TARGETS = {
    ("pull", "ttft"): 1744.0,
    ("push", "ttft"): 540.0,
    ("pull", "tpot"): 10.4,
    ("push", "tpot"): 7.0,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=1000)
    args = ap.parse_args()
    s = load_scenario("seed")
    ok = True
    print("8 QPS x 16k      measured   target   error   per-seed")
    for mode in ("pull", "push", "bg-pull"):
        rows = [
            simulate(s, mode, 8, 16384, requests=args.requests, seed=k).row
            for k in range(args.seeds)
        ]
        for metric, key in (("ttft", "ttft_ms_mean"), ("tpot", "tpot_ms_mean")):
            values = [getattr(r, key) for r in rows]
            mean = statistics.fmean(values)
            target = TARGETS.get((mode, metric))
            err = "" if target is None else f"{(mean - target) / target:+.0%}"
            if target is not None and abs(mean - target) > 0.15 * target:
                ok = False
            shown = " ".join(f"{v:.0f}" if metric == "ttft" else f"{v:.2f}" for v in values)
            print(
                f"{mode:8} {metric}  {mean:9.1f} {target or float('nan'):8.1f} {err:>7}   {shown}"
            )
    print("1 QPS x 1k       TTFT     TPOT    vs push")
    light = {
        m: [simulate(s, m, 1, 1024, requests=args.requests, seed=k).row for k in range(args.seeds)]
        for m in ("push", "pull", "bg-pull")
    }
    push_ttft = statistics.fmean(r.ttft_ms_mean for r in light["push"])
    push_tpot = statistics.fmean(r.tpot_ms_mean for r in light["push"])
    for mode, rows in light.items():
        ttft = statistics.fmean(r.ttft_ms_mean for r in rows)
        tpot = statistics.fmean(r.tpot_ms_mean for r in rows)
        d1, d2 = (ttft - push_ttft) / push_ttft, (tpot - push_tpot) / push_tpot
        ok = ok and abs(d1) <= 0.10 and abs(d2) <= 0.10
        print(f"{mode:8}      {ttft:8.1f} {tpot:8.2f}   {d1:+.1%} / {d2:+.1%}")
    print("all targets met" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
