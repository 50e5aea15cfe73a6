"""Push against pull, side by side in one run, through the real demo.

Runs ``kvpush demo --json`` once per mode with the same settings and seed and
prints one JSON object: ``push_overhead_ms_p50``, ``pull_overhead_ms_p50``
(KV ready at prefill -> ready at decode, minus a raw copy of the same bytes
measured in the same run), their ratio, and ``decode_caller_us_per_request``
(wall time the decode loop spends in protocol calls per request, push, in
the demo's processes), plus the same cost
measured without I/O in one process (``decode_caller_us_isolated``: the best
of five rounds' medians, since a shared machine only ever adds time).

    python benchmarks/handoff.py [--requests 64] [--rounds 3] [--transport memory]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio

from kvpush.protocol import (
    Completion,
    Consumer,
    ConsumerConfig,
    ControlMessage,
    Identity,
    Producer,
    ProducerConfig,
    Send,
    Source,
)
from kvpush.runtime import ConsumerRuntime, NoticeIn


class _NullChannel:
    """A channel that drops frames: isolates the pump's own cost."""

    def send_nowait(self, peer: str, message: ControlMessage) -> None:
        pass

    async def _none(self) -> AsyncIterator[object]:
        return
        yield

    def events(self) -> AsyncIterator[object]:
        return self._none()


def isolated_caller_cost(n: int = 20_000, rounds: int = 5) -> dict[str, float]:
    """:func:`isolated_round` ``rounds`` times; each figure is the lowest of
    the rounds' medians (noise on a shared host only adds)."""
    results = [isolated_round(n // rounds) for _ in range(rounds)]
    return {k: min(r[k] for r in results) for k in results[0]}


def isolated_round(n: int) -> dict[str, float]:
    """Decode-side loop cost per push request without I/O: reserve (core +
    drain) and turning the last completion into Ready (core + drain)."""

    async def run() -> dict[str, float]:
        p = Producer(ProducerConfig(Identity("P", 1)))
        c = Consumer(ConsumerConfig(Identity("D", 2)))
        c.connect(0.0, "P")
        for _ in range(3):
            for o in c.drain():
                if isinstance(o, Send):
                    p.receive(0.0, "D", o.message)
            for o in p.drain():
                if isinstance(o, Send):
                    c.receive(0.0, "P", o.message)
        rt = ConsumerRuntime(c, _NullChannel())
        reserve, ready = [], []
        for i in range(n):
            tid = f"t{i}"
            started = time.perf_counter()
            result = rt.reserve(tid, "P", [[1, 2]])
            reserve.append(time.perf_counter() - started)
            epoch = result.epoch  # type: ignore[attr-defined]
            started = time.perf_counter()
            rt._feed_one(rt.now(), NoticeIn(Completion(tid, epoch, Source(0, 0), 0)))
            rt.kick()
            ready.append(time.perf_counter() - started)
            rt.events_nowait()
        r, d = statistics.median(reserve) * 1e6, statistics.median(ready) * 1e6
        return {"reserve_us": round(r, 2), "ready_us": round(d, 2), "total_us": round(r + d, 2)}

    return anyio.run(run)


def run_demo(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "kvpush",
        "demo",
        "--json",
        "--mode",
        mode,
        "--transport",
        args.transport,
        "--requests",
        str(args.requests),
        "--qps",
        str(args.qps),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--seed",
        "7",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if out.returncode != 0:
        raise SystemExit(f"demo failed ({mode}): {out.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--qps", type=float, default=50.0)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--transport", default="memory")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"push": [], "pull": []}
    for _ in range(args.rounds):  # interleaved, so both modes see the same noise
        for mode in ("push", "pull"):
            runs[mode].append(run_demo(mode, args))

    def med(mode: str, *path: str) -> float:
        values = []
        for r in runs[mode]:
            v: Any = r
            for key in path:
                v = v[key]
            values.append(float(v))
        return round(statistics.median(values), 4)

    isolated = isolated_caller_cost()
    push = med("push", "handoff_overhead_ms", "p50")
    pull = med("pull", "handoff_overhead_ms", "p50")
    print(
        json.dumps(
            {
                "push_overhead_ms_p50": push,
                "pull_overhead_ms_p50": pull,
                "push_over_pull": round(push / pull, 3) if pull else None,
                "decode_caller_us_per_request": med("push", "decode_caller_us_per_request"),
                "decode_caller_us_isolated": isolated,
                "pull_decode_caller_us_per_request": med("pull", "decode_caller_us_per_request"),
                "push_ttft_ms_p50": med("push", "ttft_ms", "p50"),
                "pull_ttft_ms_p50": med("pull", "ttft_ms", "p50"),
                "raw_copy_ms_per_request": med("push", "raw_copy_ms_per_request"),
                "corrupt_blocks": sum(r["corrupt_blocks"] for rs in runs.values() for r in rs),
                "leaked_blocks": sum(r["leaked_blocks"] for rs in runs.values() for r in rs),
                "rounds": args.rounds,
                "requests": args.requests,
                "transport": args.transport,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
