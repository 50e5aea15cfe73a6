"""Frame-level fuzz against a live runtime pair, for a long time.

The long run of ``tests/test_frame_fuzz.py`` (its fuzzer, live pair and exact
accounting are used as they are): a producer and a consumer pump real
transfers over the TCP control channel and the shared-memory data plane
(bytes checked), while raw connections to both control ports carry random
bytes, bad preambles, random frames, edited real frames and well-formed
messages naming live transfers from a peer that does not own them. It runs
with a secret and without, alternating rounds of ``--round-frames``, until
``--frames`` frames (handshakes included) were sent or ``--seconds`` passed.
Every round checks that the channels counted exactly what they had to.

Prints one JSON object: frames sent by connection kind, frames counted as
garbage, handshakes refused, connections dropped for framing errors, crashes
(must be 0), transfers completed and failed, and wall time. Everything runs in
one event loop: on a loaded machine it can stall past the pumps' limits, and
then frames between the pair are dropped as they must be (by a StallWatch, or
as too old in a channel's queue) and their transfers fail by their deadlines.
Those are counted apart (``stalls``, ``transfers_that_lost_a_frame``, the
frames dropped): a transfer that failed without losing a frame so is a crash.

    python benchmarks/fuzz_frames.py --frames 1000000 [--seconds 600] [--seed 1]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_frame_fuzz import DELIVERED, SECRET, run_fuzz


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--round-frames", type=int, default=50_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=6, help="fuzz connections at once")
    ap.add_argument("--burst", type=int, default=200, help="most edited frames a connection")
    args = ap.parse_args()
    # The channels log every rejection (that is checked by the tests): quiet here.
    logging.getLogger("kvpush").setLevel(logging.CRITICAL)

    started = time.monotonic()
    kinds: Counter[str] = Counter()
    totals: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    crashes = rounds = 0
    stalls: Counter[str] = Counter()
    while True:
        elapsed = time.monotonic() - started
        frames = sum(kinds.values())
        if frames >= args.frames or elapsed >= args.seconds:
            break
        secret = SECRET if rounds % 2 else None
        budget = min(args.round_frames, args.frames - frames)
        try:
            result = anyio.run(
                functools.partial(
                    run_fuzz,
                    secret,
                    args.seed * 100_000 + rounds,
                    seconds=args.seconds - elapsed,
                    max_frames=budget,
                    workers=args.workers,
                    burst=args.burst,
                )
            )
        except BaseException:  # a crash, a hang, or a miscount: all count, and stop
            crashes += 1
            traceback.print_exc()
            break
        rounds += 1
        for tally in result.report.tallies.values():
            kinds += tally.sent_frames
            totals["frames"] += tally.frames
            totals["handshake_failures"] += tally.handshake_failures
            totals["garbage"] += tally.garbage
            totals["delivered"] += tally.delivered
            totals["dropped"] += tally.dropped
        totals["connections"] += result.report.connections
        outcomes.update(result.outcomes.values())
        stalls["stalls"] += result.stalls
        stalls["frames_dropped_by_stall_watch"] += result.watch_dropped
        stalls["frames_dropped_as_too_old"] += result.dropped_old
        stalls["transfers_that_lost_a_frame"] += len(result.lost_frames)
        if any(e is not None for e in result.dataplane_errors):
            crashes += 1
            break
    completed = outcomes[DELIVERED]
    print(
        json.dumps(
            {
                "frames_sent": sum(kinds.values()),
                "frames_sent_by_kind": dict(sorted(kinds.items())),
                "frames_after_a_handshake": totals["frames"],
                "connections": totals["connections"],
                "garbage_counted": totals["garbage"],
                "handshakes_refused": totals["handshake_failures"],
                "frames_delivered_to_the_core": totals["delivered"],
                "connections_dropped": totals["dropped"],
                "crashes": crashes,
                "rounds": rounds,
                "transfers_completed": completed,
                "transfers_failed": sum(outcomes.values()) - completed,
                "failures_by_outcome": {o: n for o, n in outcomes.items() if o != DELIVERED},
                **stalls,
                "wall_s": round(time.monotonic() - started, 1),
            },
            indent=1,
        )
    )
    # run_fuzz checked that every failed transfer lost a frame to a stall.
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
