"""What the sans-IO core costs per transfer, for one full push lifecycle.

Both endpoints are handshaken up front. Each transfer then goes: consumer.reserve
-> Register delivered to the producer -> kv_ready -> one StartWrite per route ->
write_done + completion_received per route -> Ready and SourceReleased, with both
endpoints' timers run as time advances (so deadlines and tombstones really expire
and no per-transfer record outlives its tombstone).

Prints one JSON object: ``lifecycle_us_tp1`` (microseconds per transfer at TP 1->1),
``per_extra_rank_us`` (least-squares slope of that cost over the number of routes,
TP 1->1 ... 8->8), the per-TP figures and the record counts left behind.

    python benchmarks/core_lifecycle.py [--n 20000] [--reps 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from time import perf_counter

from kvpush.protocol import (
    Consumer,
    ConsumerConfig,
    Identity,
    Producer,
    ProducerConfig,
    Ready,
    Send,
    SourceReleased,
    StartWrite,
)

P, D = "prefill", "decode"
TPS = (1, 2, 4, 8)
#: Simulated time between two transfers: 20,000 transfers span 200 s, well past
#: the 30 s ready deadline and the 60 s tombstone.
STEP = 0.01


def handshaken(tp: int) -> tuple[Producer, Consumer]:
    p = Producer(ProducerConfig(Identity(P, 1, tp=tp)))
    c = Consumer(ConsumerConfig(Identity(D, 1, tp=tp)))
    c.connect(0.0, P)
    pending: list[tuple[Producer | Consumer, str, object]] = []
    for _ in range(4):
        for end, peer, other in ((c, P, p), (p, D, c)):
            for out in end.drain():
                if isinstance(out, Send):
                    pending.append((other, peer, out.message))
        while pending:
            dst, src_name, msg = pending.pop(0)
            src = D if src_name == P else P
            dst.receive(0.0, src, msg)  # type: ignore[arg-type]
    assert p.peer(D).topology is not None and c.peer(P).topology is not None
    return p, c


def lifecycles(tp: int, n: int) -> tuple[float, dict[str, int]]:
    """Seconds for ``n`` lifecycles at TP tp->tp, and what is left afterwards."""
    p, c = handshaken(tp)
    tids = [f"req-{i}" for i in range(n)]
    dst = ((1, 2, 3, 4),)
    src = ((5, 6, 7, 8),)
    ready = released = 0
    now = 1.0
    gc.collect()
    start = perf_counter()
    for tid in tids:
        c.reserve(now, tid, P, dst)
        for out in c.drain():
            p.receive(now, D, out.message)  # type: ignore[union-attr]
        p.kv_ready(now, tid, src)
        for out in p.drain():
            if type(out) is StartWrite:
                route = out.route
                p.write_done(now, tid, out.epoch, route.source, route.consumer_rank)
                c.completion_received(now, P, out.notice)
        for out in p.drain():
            released += type(out) is SourceReleased
        for out in c.drain():
            ready += type(out) is Ready
        now += STEP
        p.handle_timer(now)
        c.handle_timer(now)
    elapsed = perf_counter() - start
    if ready != n or released != n:
        raise SystemExit(f"tp {tp}: {ready} Ready and {released} SourceReleased of {n}")
    left = {
        "producer_records": len(p.transfers()),
        "producer_timers": len(p._heap),
        "consumer_records": len(c.reservations()),
        "consumer_timers": len(c._heap),
    }
    # run the clock out: every tombstone expires, nothing is left
    end = now + p.config.tombstone_ttl + c.config.ready_timeout + 1.0
    p.handle_timer(end)
    c.handle_timer(end)
    left["producer_records_after_ttl"] = len(p.transfers())
    left["producer_timers_after_ttl"] = len(p._heap)
    left["consumer_timers_after_ttl"] = len(c._heap)
    return elapsed, left


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    covariance = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    return covariance / sum((x - mx) ** 2 for x in xs)


def calibration_us() -> float:
    """Best-of-5 time of ``sum(range(1000))``: how fast this machine runs Python
    right now (about 8-10 us on an idle modern core), to compare runs."""
    best = float("inf")
    for _ in range(5):
        start = perf_counter()
        for _ in range(200):
            sum(range(1000))
        best = min(best, (perf_counter() - start) / 200 * 1e6)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000, help="transfers per repetition")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (median is reported)")
    args = ap.parse_args(argv)
    result: dict[str, object] = {"n": args.n, "reps": args.reps}
    runs: dict[int, list[float]] = {tp: [] for tp in TPS}
    left: dict[str, int] = {}
    calibration = [calibration_us()]
    for _ in range(args.reps):  # interleaved, so drift in machine speed hits every TP alike
        for tp in TPS:
            seconds, left = lifecycles(tp, args.n)
            runs[tp].append(seconds / args.n * 1e6)
    calibration.append(calibration_us())
    per_tp = {tp: statistics.median(r) for tp, r in runs.items()}
    result["lifecycle_us_tp1"] = round(per_tp[1], 2)
    result["per_extra_rank_us"] = round(slope([float(t) for t in TPS], list(per_tp.values())), 2)
    for tp in TPS[1:]:
        result[f"lifecycle_us_tp{tp}"] = round(per_tp[tp], 2)
    result["min_us"] = {f"tp{tp}": round(min(r), 2) for tp, r in runs.items()}
    result["transfers_per_sim_second"] = round(1 / STEP)
    result["left_after_tp8"] = left
    result["calibration_sum1000_us"] = [round(c, 2) for c in calibration]
    result["python"] = sys.version.split()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
