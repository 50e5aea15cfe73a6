"""Soak: a prefill and a decode process over real NIXL, random faults, for a
given time; prints one JSON object and exits 1 on any corrupt block, leaked
block or hung request.

    .venv/bin/python benchmarks/soak.py --seconds 600

Each round runs two requests at once: a *bystander*, which must complete with
the right bytes unless the round's fault hits the whole pair (a stalled or
restarted prefill), and a *victim* that gets the round's fault:

* ``abort``: the decode aborts after registering, before the KV is ready;
* ``abort-in-flight``: the decode aborts with the write in flight;
* ``preempt``: the decode preempts and re-reserves (new epoch, new blocks);
* ``slow-decode``: the decode stops polling for 0.2 to 1 s;
* ``stall-prefill``: the prefill is SIGSTOPped for 0.1 to 0.6 s;
* ``restart-prefill``: the prefill is killed and restarted on its port;
* ``none``.

Throughout, each side duplicates or reorders ``CHAOS`` of the control frames
it sends (``tests/nixl_side.py``'s ``Chaos``).

Blocks a victim gave back are refilled with another request's pattern at
once and checked again at the end of the next round: a late write would show.
It reuses the two-process harness of the test suite (``tests/nixl_procs.py``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import resource
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from nixl_procs import Proc, spec

from kvpush.protocol import Role

FAULTS = (
    "none",
    "abort",
    "abort-in-flight",
    "preempt",
    "slow-decode",
    "stall-prefill",
    "restart-prefill",
)
WEIGHTS = (30, 12, 12, 12, 12, 12, 4)
#: Throughout: each control frame either side sends is duplicated, or held
#: back and sent after the next one, with this probability.
CHAOS = 0.05
#: The sides' StallWatch limit: half the harness's max_transit.
STALL_LIMIT = 0.25
REUSED = 9
BLOCKS = 64  # per side (the harness's pool)
N = 4  # blocks per request


class Soak:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.prod = spec(Role.PRODUCER, 1, 16)
        self.p = Proc(self.prod)
        self.d = Proc(spec(Role.CONSUMER, 1, 16, ready_timeout=3.0))
        assert self.d("route", "127.0.0.1", self.p.port) == ("ok",)
        self.peer_ready = 1
        self.d.wait(("PeerReady",), "", 20, nth=self.peer_ready)
        self.chaos_frames = collections.Counter[str]()
        for proc in (self.p, self.d):
            assert proc("chaos", CHAOS, CHAOS) == ("ok",)
        self.rounds = 0
        self.completed = 0
        self.failures: collections.Counter[str] = collections.Counter()
        self.faults: collections.Counter[str] = collections.Counter()
        self.corrupt = 0
        self.hung = 0
        #: (round freed, blocks) refilled with another request's pattern.
        self.resting: list[tuple[int, list[int]]] = []
        self.released: collections.Counter[str] = collections.Counter()
        self.checked_reused = 0
        self.fault = "none"
        #: Rounds in which a process noticed it had not run for its stall limit
        #: without an injected stall (a loaded machine): both requests may fail.
        self.machine_stalls = 0
        self.peak_rss_kib: dict[str, int] = {}

    def close(self) -> None:
        self.p.stop()
        self.d.stop()

    # --- one round ---------------------------------------------------------------

    def round(self) -> None:
        self.rounds += 1
        self._recheck()
        fault = self.rng.choices(FAULTS, WEIGHTS)[0]
        self.faults[fault] += 1
        self.fault = fault
        resting = {b for _, blocks in self.resting for b in blocks}
        pool = [b for b in range(BLOCKS) if b not in resting]
        free = self.rng.sample(pool, 5 * N)
        vsrc, bsrc = free[:N], free[N : 2 * N]
        vdst, bdst, vnew = free[2 * N : 3 * N], free[3 * N : 4 * N], free[4 * N :]
        victim, bystander = f"v{self.rounds}", f"b{self.rounds}"
        vsalt, bsalt = 10 + self.rounds % 200, 11 + self.rounds % 200
        if fault == "restart-prefill":
            self._restart_prefill()
        p, d = self.p, self.d
        started = time.monotonic()
        assert p("fill", vsrc, vsalt) == ("ok",) and p("fill", bsrc, bsalt) == ("ok",)
        dst_of = {t: dst for t, dst in ((victim, vdst), (bystander, bdst)) if self._reserve(t, dst)}
        pair_hit = fault in ("stall-prefill", "restart-prefill")
        self._before_kv_ready(fault, victim, dst_of)
        p("kv_ready", victim, vsrc)
        p("kv_ready", bystander, bsrc)
        if fault == "abort-in-flight":
            time.sleep(0.05)
            aborted = victim in dst_of and d("abort", victim) == ("aborted", True)
            d("pause", False)
            if aborted:
                self._settle(victim, dst_of.pop(victim), released=True)
        if fault == "slow-decode":
            d("pause", True)
            time.sleep(self.rng.uniform(0.2, 1.0))
            d("pause", False)
        if fault == "preempt" and victim in dst_of and d("preempt", victim) == ("preempted", True):
            self._settle(victim, dst_of.pop(victim), released=True)
            if self._reserve(victim, vnew):  # the new epoch
                dst_of[victim] = vnew
        outcomes = {tid: self._wait(tid, ("Ready", "Failed")) for tid in dst_of}
        # A process that noticed it had not run (for longer than its stall
        # limit) during the round, or just before it, drops the lease-bearing
        # frames it read then: both requests may fail; a pair fault.
        if self._quiet() < time.monotonic() - started + 2 * STALL_LIMIT:
            self.machine_stalls += fault != "stall-prefill"
            pair_hit = True
        for tid, dst in dst_of.items():
            salt = vsalt if tid == victim else bsalt
            self._outcome(tid, dst, outcomes[tid], salt, tid == bystander and not pair_hit)

    def _outcome(
        self, tid: str, dst: list[int], ev: dict[str, Any], salt: int, alone: bool
    ) -> None:
        """Check and count one request's outcome (``alone``: a bystander that
        no pair fault touched), then settle its blocks."""
        fault = self.fault
        if ev["type"] == "Ready":
            if self.d("bad_blocks", dst, salt, 0) != ("bad", []):
                self.corrupt += 1
                print(f"corrupt: {tid} ({fault})", file=sys.stderr)
            self.completed += 1
        else:
            self.failures[f"{fault}: {ev.get('reason', '?')}"] += 1
            if alone:
                print(f"bystander {tid} failed under {fault}: {ev}", file=sys.stderr)
                self.failures["bystander-affected"] += 1
        self._settle(tid, dst, released=ev["type"] != "Ready")

    # --- helpers -------------------------------------------------------------------

    def _before_kv_ready(self, fault: str, victim: str, dst_of: dict[str, list[int]]) -> None:
        """The faults injected before the producer has the KV."""
        p, d = self.p, self.d
        if fault == "abort" and victim in dst_of and d("abort", victim) == ("aborted", True):
            self._settle(victim, dst_of.pop(victim), released=True)
        if fault == "abort-in-flight":
            d("pause", True)
        if fault == "stall-prefill":
            os.kill(p.proc.pid, signal.SIGSTOP)
            time.sleep(self.rng.uniform(0.1, 0.6))
            os.kill(p.proc.pid, signal.SIGCONT)

    def _reserve(self, tid: str, dst: list[int]) -> bool:
        out = self.d("reserve", tid, dst, "push", 0)
        if out[0] != "reserved":
            self.failures[f"refused: {out[1]}"] += 1
        return bool(out[0] == "reserved")

    def _quiet(self) -> float:
        """Seconds since either process last noticed a stall."""
        return float(min(self.p("counts")[5], self.d("counts")[5]))

    def _wait(self, tid: str, kinds: tuple[str, ...], nth: int = 1) -> dict[str, Any]:
        out = self.d("wait", kinds, tid, 15.0, nth, timeout=60)
        if out[0] != "event":
            self.hung += 1
            raise RuntimeError(f"{tid} ({self.fault}): no {kinds} in 15 s: {out[1][-6:]}")
        return dict(out[1])

    def _settle(self, tid: str, blocks: list[int], *, released: bool) -> None:
        """Once the blocks are free (a failed or withdrawn reservation: its
        ``Released``; a ready one: the engine is done with them), hand them to
        "another request": refill them and leave them untouched for two
        rounds, after which they must still hold that pattern."""
        if released:
            self.released[tid] += 1
            self._wait(tid, ("Released",), self.released[tid])
        assert self.d("fill", blocks, REUSED) == ("ok",)
        self.resting.append((self.rounds, list(blocks)))

    def _recheck(self, final: bool = False) -> None:
        keep = []
        for freed, blocks in self.resting:
            if final or self.rounds - freed > 2:
                if self.d("bad_blocks", blocks, REUSED, 0) != ("bad", []):
                    self.corrupt += 1
                    print(f"late write into blocks freed in round {freed}", file=sys.stderr)
                self.checked_reused += 1
            else:
                keep.append((freed, blocks))
        self.resting = keep

    def _chaos(self, proc: Proc) -> None:
        dup, reordered = proc("counts")[6]
        self.chaos_frames["duplicated"] += dup
        self.chaos_frames["reordered"] += reordered

    def _restart_prefill(self) -> None:
        port = self.p.port
        self._rss(self.p, "prefill")
        self._chaos(self.p)
        self.p.kill()
        self.p = Proc(replace(self.prod, port=port))
        assert self.p("chaos", CHAOS, CHAOS) == ("ok",)
        self.peer_ready += 1
        self._wait("", ("PeerReady",), nth=self.peer_ready)

    def _rss(self, proc: Proc, name: str) -> None:
        try:
            status = Path(f"/proc/{proc.proc.pid}/status").read_text()
        except OSError:
            return
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                kib = int(line.split()[1])
                self.peak_rss_kib[name] = max(self.peak_rss_kib.get(name, 0), kib)

    def leaked(self) -> tuple[int, int]:
        deadline = time.monotonic() + 15
        while True:
            reserved, held = self.d("counts")[1], self.p("counts")[2]
            if (reserved, held) == (0, 0) or time.monotonic() > deadline:
                return reserved, held
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    soak = Soak(random.Random(args.seed))
    started = time.monotonic()
    error = None
    try:
        while time.monotonic() - started < args.seconds:
            soak.round()
        time.sleep(1.0)  # then every freed block must still hold its new pattern
        soak._recheck(final=True)
        reserved, held = soak.leaked()
        soak._rss(soak.p, "prefill")
        soak._rss(soak.d, "decode")
        soak._chaos(soak.p)
        soak._chaos(soak.d)
    except (RuntimeError, TimeoutError, AssertionError) as exc:
        error = repr(exc)
        reserved = held = -1
    finally:
        soak.close()
    report = {
        "seconds": round(time.monotonic() - started, 1),
        "rounds": soak.rounds,
        "requests": 2 * soak.rounds,
        "completed": soak.completed,
        "failures": dict(sorted(soak.failures.items())),
        "faults": dict(sorted(soak.faults.items())),
        "control_frames": dict(soak.chaos_frames),
        "rounds_with_a_machine_stall": soak.machine_stalls,
        "corrupt": soak.corrupt,
        "reused_block_sets_checked": soak.checked_reused,
        "leaked_blocks": {"decode_reserved": reserved, "prefill_held": held},
        "hung": soak.hung,
        "error": error,
        "peak_rss_mib": {k: round(v / 1024, 1) for k, v in soak.peak_rss_kib.items()},
        "driver_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    print(json.dumps(report, indent=2))
    ok = (
        error is None
        and soak.corrupt == 0
        and soak.hung == 0
        and (reserved, held) == (0, 0)
        and "bystander-affected" not in soak.failures
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
