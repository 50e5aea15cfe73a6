"""A prefill stopped (SIGSTOP) *with a write posted*, then resumed after the
decode's quarantine: does the rest of the write land in the reused blocks?

    .venv/bin/python benchmarks/stopped_producer.py            # loopback's defaults
    .venv/bin/python benchmarks/stopped_producer.py --tls tcp  # UCX over TCP

Prints JSON: the blocks of the victim request that hold neither the reusing
request's bytes nor were left alone (``corrupt_blocks``, 0 is right). This
measures assumption A2 of docs/protocol.md ("Timing"): a posted write settles
within ``op_bound``. On loopback's default UCX transports the write is copied
while it is posted, so nothing is left to land late. Over TCP the rest of the
write sits in UCX until the process runs again and lands then, after the
decode reused the blocks: a known limitation (docs/runtime.md, "Open work").
A real RDMA fabric executes posted work requests whatever the process does.
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
            released = d.wait(("Released",), "victim", 30)[0]
            assert d("fill", dst, REUSED) == ("ok",)  # another request's KV
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)
        time.sleep(1.0)
        corrupt = d("bad_blocks", dst, REUSED, 0)[1]
    print(
        json.dumps(
            {
                "ucx_tls": args.tls or "default",
                "write_bytes": 48 * 2 * 2 * args.tokens * 4 * 64,
                "blocks_landed_before_the_stop": landed_before,
                "released_after_reserve_s": round(released["released_after_reserve"], 3),
                "corrupt_blocks": len(corrupt),
            }
        )
    )
    return 0 if not corrupt else 1


if __name__ == "__main__":
    sys.exit(main())
