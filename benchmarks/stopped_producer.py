"""A prefill stopped (SIGSTOP) *with a write posted*, resumed long after the
decode's quarantine: does the rest of the write land in reused blocks?

    .venv/bin/python benchmarks/stopped_producer.py            # loopback's defaults
    .venv/bin/python benchmarks/stopped_producer.py --tls tcp  # UCX over TCP

Prints JSON: whether the decode released the victim's blocks while the
prefill was stopped (``released_while_stopped``: false is right), how many it
held as suspect meanwhile, when it released them, and the blocks of the victim
request that hold neither the reusing request's bytes nor were left alone
(``corrupt_blocks``: 0 is right). The decode reuses the blocks the moment it
releases them. Over UCX's TCP transport the rest of the write sits in the
stopped prefill's UCX and lands when it resumes; a decode that released at
its quarantine (the timing assumption A2, before the suspect hold) had reused
the blocks by then: 48 of 48 corrupt. Now the quarantine finds the prefill
connected and silent, the blocks are held as suspect, and only the write's
completion, after SIGCONT, releases them (docs/protocol.md, "Timing").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from nixl_procs import sides, spec

from kvpush.protocol import Role

REUSED = 9
#: How long the prefill stays stopped after the decode's quarantine.
STOPPED_AFTER_S = 2.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tls", default=None, help="UCX_TLS for both processes (e.g. tcp)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per block")
    args = parser.parse_args(argv)
    if args.tls:
        os.environ["UCX_TLS"] = args.tls
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    prod = spec(Role.PRODUCER, 1, args.tokens)
    cons = spec(Role.CONSUMER, 1, args.tokens, ready_timeout=3.0)
    with sides(prod, cons) as (p, d):
        src = dst = list(range(10, 58))
        assert p("fill", src, 6) == ("ok",)
        assert d("reserve", "victim", dst, "push", 0)[0] == "reserved"
        assert d("pause", True) == ("ok",)  # the write stalls at the target
        assert p("kv_ready", "victim", src) == ("ok",)
        time.sleep(0.5)
        landed_before = 48 - len(d("bad_blocks", dst, 6, 0)[1])
        os.kill(p.proc.pid, signal.SIGSTOP)
        try:
            assert d("pause", False) == ("ok",)
            d.wait(("Failed",), "victim", 30)
            # Past the quarantine (ready_timeout 3 + max_transit 0.5 + op_bound 1).
            suspect = 0
            give_up = time.monotonic() + 15
            while time.monotonic() < give_up:
                counts = d("counts")
                suspect = counts[7] if len(counts) > 7 else 0
                if suspect or d("wait", ("Released",), "victim", 0.05, 1)[0] == "event":
                    break
            time.sleep(STOPPED_AFTER_S)  # the prefill stays stopped a while longer
            released_early = d("wait", ("Released",), "victim", 0.1, 1)[0] == "event"
            if released_early:
                assert d("fill", dst, REUSED) == ("ok",)  # reused at once
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)
        released = d.wait(("Released",), "victim", 30)[0]
        if not released_early:
            assert d("fill", dst, REUSED) == ("ok",)  # reused once released
        time.sleep(1.0)
        corrupt = d("bad_blocks", dst, REUSED, 0)[1]
    print(
        json.dumps(
            {
                "ucx_tls": args.tls or "default",
                "write_bytes": 48 * 2 * 2 * args.tokens * 4 * 64,
                "blocks_landed_before_the_stop": landed_before,
                "released_while_stopped": released_early,
                "suspect_blocks_while_stopped": suspect,
                "released_after_reserve_s": round(released["released_after_reserve"], 3),
                "corrupt_blocks": len(corrupt),
            }
        )
    )
    return 0 if not corrupt else 1


if __name__ == "__main__":
    sys.exit(main())
