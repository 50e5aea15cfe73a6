"""Availability under ops that never report (issue 28): a seeded random driver
of the public core through the model :class:`~kvpush.testing.World`.

    .venv/bin/python benchmarks/hung_ops.py --transfers 10000 --hang 0.005 --seed 1

One producer (TP 2) and one consumer (TP 1) move ``--transfers`` transfers,
``--window`` at a time, over a network that drops, duplicates and reorders
control frames, with preemptions and aborts on both sides; a fraction
``--hang`` of the posted ops never report (neither land nor fail) until their
initiator's ``Cancel`` is confirmed. The invariant checker runs on every move
(a stale write raises). Prints one JSON object: transfers ready (of those
with no injected fault), refused, hung ops, blocks held at the end on each
side, and whether every timer was quiet at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from kvpush.protocol import Mode, Ready
from kvpush.testing import World, WorldConfig


def run(transfers: int, hang: float, window: int, seed: int, faults: float) -> dict[str, object]:
    rng = random.Random(seed)
    w = World(
        WorldConfig(
            producer_tp=2,
            ready_timeout=5.0,
            kv_hold_timeout=5.0,
            tombstone_ttl=10.0,
            pool_blocks=4 * window,
            max_reserved_blocks=4 * window,
        )
    )
    faulted: set[str] = set()
    started = 0
    refused = 0
    t0 = time.perf_counter()
    steps = 0
    n = w.config.blocks_per_transfer
    while started < transfers or w.live or w.ops or w.net.queue or w.notices:
        steps += 1
        if steps > 200 * transfers + 10_000:
            raise AssertionError(f"the driver does not converge: {len(w.live)} live")
        if started < transfers and len(w.live) < window and len(w.free_dst) >= n:
            tid = f"t{started}"
            started += 1
            mode = Mode.PULL if rng.random() < 0.2 else Mode.PUSH
            if not w.reserve(tid, mode):
                refused += 1
                faulted.add(tid)
            w.kv_ready(tid)
        _step(w, rng, hang, faults, faulted)
        for e in w.events:
            if isinstance(e, Ready):  # the request decodes, then frees its blocks
                w.free_dst.extend(b for g in e.blocks for b in g)
        w.events.clear()
    w.quiesce()
    clean = transfers - len(faulted)
    ready_clean = len(w.ready - faulted)
    return {
        "seed": seed,
        "transfers": transfers,
        "hang": hang,
        "hung_ops": len(w.hung),
        "faulted_transfers": len(faulted),
        "ready": len(w.ready),
        "ready_without_fault": ready_clean,
        "without_fault": clean,
        "ready_without_fault_ratio": round(ready_clean / clean, 4) if clean else None,
        "refused": refused,
        "consumer_blocks_held": w.consumer.reserved_blocks,
        "producer_blocks_held": w.producer.held_blocks,
        "timers_quiet": w.consumer.next_deadline() is None and w.producer.next_deadline() is None,
        "write_cancel": w.producer.stats().get("write_cancel", 0),
        "read_cancel": w.consumer.stats().get("read_cancel", 0),
        "steps": steps,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _step(w: World, rng: random.Random, hang: float, faults: float, faulted: set[str]) -> None:
    """One random move of the driver: a frame, an op, a notice, a fault or time."""
    live = sorted(w.live)
    r = rng.random()
    if w.net.queue and r < 0.45:
        i = rng.randrange(len(w.net.queue))
        f = rng.random()
        if f < faults:
            faulted.add(getattr(w.net.queue[i].message, "transfer_id", ""))
            w.net.drop(i)
        elif f < 2 * faults:
            w.net.duplicate(i)
        else:
            w.deliver(i)
    elif w.ops and r < 0.8:
        _op_step(w, rng, rng.randrange(len(w.ops)), hang, faulted)
    elif w.notices and r < 0.9:
        w.notify(rng.randrange(len(w.notices)))
    elif live and r < 0.905:
        tid = rng.choice(live)
        faulted.add(tid)
        if rng.random() < 0.5 and w.preempt(tid):
            w.reserve(tid)
        else:
            w.abort_consumer(tid)
    else:
        w.advance(rng.choice((0.001, 0.01, 0.05)))


def _op_step(w: World, rng: random.Random, i: int, hang: float, faulted: set[str]) -> None:
    """Move op ``i`` on: cancel, post (maybe hang), land or acknowledge it."""
    op = w.ops[i]
    if op.cancel and not op.landed and (op.hung or rng.random() < 0.5):
        w.cancel(i)
    elif op.hung:
        w.advance(0.05)
    elif op.posted_at is None:
        w.post(i)
        if i < len(w.ops) and w.ops[i].posted_at is not None and rng.random() < hang:
            faulted.add(op.action.transfer_id)
            w.hang(i)
    elif op.landed:
        w.ack(i)
    else:
        w.land(i)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transfers", type=int, default=10_000)
    ap.add_argument("--hang", type=float, default=0.005)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--faults", type=float, default=0.02, help="drop / duplicate rate per frame")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    print(json.dumps(run(a.transfers, a.hang, a.window, a.seed, a.faults)))


if __name__ == "__main__":
    main()
