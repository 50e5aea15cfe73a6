"""How long a real peer takes to connect while slowloris clients flood the
listening channel from its own address (loopback).

    .venv/bin/python benchmarks/handshake_flood.py                 # 0, 100, 300, 600 clients
    .venv/bin/python benchmarks/handshake_flood.py --attackers 300 --tries 5

Each client (a separate process runs them all) sends one byte of a preamble,
waits for the channel to close it, and redials at once. Meanwhile fresh
decode channels with the right secret dial the prefill's, one after another.
Prints one JSON line per attacker count: each connect time (seconds, ``inf``
if none within its share of the run), the refusal warnings the prefill logged
and the refusals they add up to, the channel's counters, and the attackers'
connections.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_channel_flood import legit_connects_under_flood


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attackers", type=int, nargs="*", default=[0, 100, 300, 600])
    parser.add_argument("--tries", type=int, default=5, help="real peers dialled, one by one")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each flood")
    args = parser.parse_args(argv)
    for n in args.attackers:

        async def run(n: int = n) -> object:
            return await legit_connects_under_flood(n, args.tries, seconds=args.seconds)

        result = anyio.run(run)
        print(json.dumps(dataclasses.asdict(result)), flush=True)  # type: ignore[call-overload]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
