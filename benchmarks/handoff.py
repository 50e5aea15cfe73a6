"""Push against pull, side by side in one run, through the real demo.

Runs ``kvpush demo --json`` once per mode with the same settings and seed and
prints one JSON object: ``push_overhead_ms_p50``, ``pull_overhead_ms_p50``
(KV ready at prefill -> ready at decode, minus a raw copy of the same bytes
measured in the same run), their ratio, and ``decode_caller_us_per_request``
(wall time the decode loop spends in protocol calls per request, push, in
the demo's processes), plus the same cost
measured without I/O in one process (``decode_caller_us_isolated``: the best
of five rounds' medians, since a shared machine only ever adds time).

It also prices the pull flow the way vLLM runs it, with the descriptor work
on the decode's own loop (``pull_on_caller_us``: per request, plan the
transfer and post the READ on a real NIXL agent, as a decode caller thread
would; the transfer itself is waited for outside the timing), next to push's
decode caller cost.

    python benchmarks/handoff.py [--requests 64] [--rounds 3] [--transport nixl]
"""

from __future__ import annotations

import argparse
import json
import os
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
            rt._feed_one(rt.now(), NoticeIn(Completion(tid, epoch, Source(0, 0), 0), "P"))
            rt.kick()
            ready.append(time.perf_counter() - started)
            rt.events_nowait()
        r, d = statistics.median(reserve) * 1e6, statistics.median(ready) * 1e6
        return {"reserve_us": round(r, 2), "ready_us": round(d, 2), "total_us": round(r + d, 2)}

    return anyio.run(run)


def pull_on_caller_cost(n: int = 300, prompt_tokens: int = 512) -> dict[str, Any]:
    """Median caller-thread time to plan and post one pull READ over NIXL (two
    agents in this process, the demo's small model, fragmented blocks)."""
    import numpy as np

    from kvpush.demo._model import MODELS, SideGeometry
    from kvpush.protocol import HeadSlice, Role, Route
    from kvpush.runtime import TransferPlanner
    from kvpush_nixl import NixlTransport

    model = MODELS["small"]
    blocks = -(-prompt_tokens // model.tokens_per_block)
    geo = SideGeometry(model, 1, 4 * blocks)
    mem = [np.zeros(geo.segment_bytes, dtype=np.uint8) for _ in range(2)]
    lay = [geo.layout(0, base=m.ctypes.data) for m in mem]
    route = Route(Source(0, 0), 0, HeadSlice(0, model.num_kv_heads))
    planner = TransferPlanner(lay[0], lay[1], route)
    rng = np.random.default_rng(0)
    with NixlTransport("bench-p") as prod, NixlTransport("bench-d") as cons:
        prod.register(lay[0])
        cons.register(lay[1])
        agent = cons.add_peer(prod.metadata(), lay[0])
        prod.add_peer(cons.metadata(), lay[1])
        prepped = cons.prefers_prepped(*_plan_shape(planner, blocks))
        if prepped:
            cons.prep(agent, route, planner.prepped(Role.CONSUMER), planner.prepped(Role.PRODUCER))
        times = []
        for _ in range(n):
            src = rng.permutation(4 * blocks)[:blocks].tolist()
            dst = rng.permutation(4 * blocks)[:blocks].tolist()
            started = time.perf_counter()
            plan = planner.plan([src], [dst])
            if prepped:
                s_idx, d_idx = plan.indices()
                handle = cons.read_prepped(agent, route, d_idx, s_idx)
            else:
                handle = cons.read(agent, plan.dst, plan.src)
            times.append(time.perf_counter() - started)
            deadline = time.monotonic() + 10
            while True:
                done, _ = cons.poll()
                prod.poll()
                if any(c.handle == handle for c in done):
                    break
                if time.monotonic() > deadline:
                    raise SystemExit("a pull READ did not complete in 10 s")
    return {
        "pull_on_caller_us": round(statistics.median(times) * 1e6, 2),
        "path": "prepped" if prepped else "rows",
        "blocks": blocks,
    }


def _plan_shape(planner: Any, blocks: int) -> tuple[int, int]:
    plan = planner.plan([list(range(0, 2 * blocks, 2))], [list(range(0, 2 * blocks, 2))])
    return plan.num_descriptors, plan.num_pieces


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
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback only, as the demo
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--qps", type=float, default=50.0)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--transport", default="nixl", choices=["nixl", "memory"])
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
    on_caller = pull_on_caller_cost(prompt_tokens=args.prompt_tokens)
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
                "pull_on_caller": on_caller,
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
