"""Push against progressive push: handoff latency in a model driven by the real core.

A discrete-event simulation (simulated clock, no network, no GPU) drives the
real :class:`~kvpush.protocol.Producer` and :class:`~kvpush.protocol.Consumer`
(handshake included, every control message delivered with a fixed latency):

* the decode reserves its blocks when the request arrives (push registration);
* the prefill computes the prompt in chunks of ``--chunk-tokens`` at
  ``--prefill-tps`` tokens/s, one request at a time (FIFO); after each chunk
  it calls ``kv_ready(final=False)`` with the whole blocks so far
  (progressive), or only ``kv_ready(final=True)`` after the last chunk (push);
* every ``StartWrite`` becomes a flow of ``(new blocks) x (block bytes)`` on
  one link of ``--gbps`` that serves flows FIFO; when the flow ends the
  producer is told ``write_done`` and, for the commit, the consumer gets the
  completion notice.

Handoff = request arrival -> the consumer's ``Ready``; TTFT-like = handoff +
``--decode-step-ms``. The run asserts integrity: every destination block was
written exactly once, by flows that all ended before ``Ready``. It prints one
JSON object (one request alone per case, and ``--requests`` Poisson arrivals
at ``--qps`` sharing the prefill and the link, p50).

    python benchmarks/progressive.py [--gbps 25,200] [--prompts 4096,32768]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpush.protocol import (
    Consumer,
    ConsumerConfig,
    Identity,
    Mode,
    Output,
    Producer,
    ProducerConfig,
    Ready,
    Reserved,
    Send,
    StartWrite,
    Timing,
)

P, D = "prefill", "decode"


@dataclass(frozen=True)
class Shape:
    layers: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    tokens_per_block: int = 16

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.tokens_per_block


@dataclass(frozen=True)
class Params:
    gbps: float
    prefill_tps: float
    chunk_tokens: int
    ctrl_latency: float
    shape: Shape


@dataclass
class Req:
    tid: str
    arrival: float
    tokens: int
    src: list[int]
    dst: list[int]
    ready_at: float | None = None
    increments: int = 0
    flows_open: int = 0
    last_flow_end: float = 0.0
    written: dict[int, int] = field(default_factory=dict)  # dst block -> src block
    bytes_landed: int = 0


class Sim:
    """One prefill, one decode, one link, one simulated clock."""

    def __init__(self, params: Params, progressive: bool) -> None:
        self.p = params
        self.progressive = progressive
        timing = Timing(max_transit=0.5, op_bound=120.0)
        self.producer = Producer(
            ProducerConfig(
                Identity(P, 1, num_kv_heads=params.shape.kv_heads),
                timing,
                kv_hold_timeout=600.0,
            )
        )
        self.consumer = Consumer(
            ConsumerConfig(
                Identity(D, 2, num_kv_heads=params.shape.kv_heads),
                timing,
                ready_timeout=600.0,
            )
        )
        self.now = 0.0
        self._q: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.link_free = 0.0
        self.prefill_free = 0.0
        self.reqs: dict[str, Req] = {}
        self._next_block = 0
        self.consumer.connect(0.0, P)
        self._route()
        self.run()
        if self.consumer.peer(P).state.name != "READY":
            raise AssertionError(f"handshake did not finish: {self.consumer.peer(P).state}")

    # --- event queue --------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._q, (t, self._seq, fn))

    def _deadline(self) -> float | None:
        ds = [d for d in (self.producer.next_deadline(), self.consumer.next_deadline()) if d]
        return min(ds) if ds else None

    def run(self, until: float | None = None) -> None:
        while self._q:
            t = self._q[0][0]
            dl = self._deadline()
            if dl is not None and dl < t:
                self.now = max(self.now, dl)
                self.producer.handle_timer(self.now)
                self.consumer.handle_timer(self.now)
                self._route()
                continue
            _, _, fn = heapq.heappop(self._q)
            self.now = t
            fn()
            self._route()

    # --- routing the endpoints' outputs ---------------------------------------
    def _route(self) -> None:
        for o in self.producer.drain():
            self._producer_out(o)
        for o in self.consumer.drain():
            self._consumer_out(o)

    def _producer_out(self, o: Output) -> None:
        if isinstance(o, Send):
            msg = o.message
            self.at(self.now + self.p.ctrl_latency, lambda: self.consumer.receive(self.now, P, msg))
        elif isinstance(o, StartWrite):
            self._flow(o)

    def _consumer_out(self, o: Output) -> None:
        if isinstance(o, Send):
            msg = o.message
            self.at(self.now + self.p.ctrl_latency, lambda: self.producer.receive(self.now, D, msg))
        elif isinstance(o, Ready):
            r = self.reqs[o.transfer_id]
            assert r.ready_at is None, "Ready twice"
            # Integrity: Ready only after every byte landed, each block once.
            assert r.flows_open == 0, f"{r.tid}: Ready with {r.flows_open} flows in flight"
            assert r.last_flow_end <= self.now
            assert r.written == dict(zip(r.dst, r.src, strict=True)), f"{r.tid}: KV incomplete"
            assert r.bytes_landed == len(r.src) * self.p.shape.block_bytes
            r.ready_at = self.now

    def _flow(self, w: StartWrite) -> None:
        r = self.reqs[w.transfer_id]
        first = w.first[0] if w.first else 0
        # dst_blocks: the whole registration; src_blocks: the source so far.
        end_blk = len(w.src_blocks[0])
        src, dst = w.src_blocks[0][first:end_blk], w.dst_blocks[0][first:end_blk]
        assert len(src) == len(dst) and (w.notice is None or end_blk == len(w.dst_blocks[0]))
        nbytes = len(src) * self.p.shape.block_bytes
        start = max(self.now, self.link_free)
        end = start + nbytes * 8 / (self.p.gbps * 1e9)
        self.link_free = end
        r.increments += 1
        r.flows_open += 1

        def done() -> None:
            for s, d in zip(src, dst, strict=True):
                assert d not in r.written, f"{r.tid}: block {d} written twice"
                r.written[d] = s
            r.bytes_landed += nbytes
            r.flows_open -= 1
            r.last_flow_end = self.now
            self.producer.write_done(
                self.now, w.transfer_id, w.epoch, w.route.source, w.route.consumer_rank
            )
            if w.notice is not None:
                self.consumer.completion_received(self.now, P, w.notice)

        self.at(end, done)

    # --- a request ------------------------------------------------------------
    def submit(self, tid: str, arrival: float, tokens: int) -> None:
        bt = self.p.shape.tokens_per_block
        n = -(-tokens // bt)
        src = list(range(self._next_block, self._next_block + n))
        dst = list(range(self._next_block + 7, self._next_block + 7 + n))
        self._next_block += n + 16
        r = Req(tid, arrival, tokens, src, dst)
        self.reqs[tid] = r
        self.at(arrival, lambda: self._arrive(r))

    def _arrive(self, r: Req) -> None:
        res = self.consumer.reserve(self.now, r.tid, P, [r.dst], mode=Mode.PUSH)
        assert isinstance(res, Reserved), res
        start = max(self.now, self.prefill_free)
        chunk_s = self.p.chunk_tokens / self.p.prefill_tps
        done_tokens, t = 0, start
        bt = self.p.shape.tokens_per_block
        while done_tokens < r.tokens:
            step = min(self.p.chunk_tokens, r.tokens - done_tokens)
            t += step / self.p.prefill_tps if step < self.p.chunk_tokens else chunk_s
            done_tokens += step
            final = done_tokens >= r.tokens
            blocks = r.src if final else r.src[: done_tokens // bt]
            if final or (self.progressive and blocks):
                self.at(t, self._kv_ready_cb(r.tid, list(blocks), final))
        self.prefill_free = t

    def _kv_ready_cb(self, tid: str, blocks: list[int], final: bool) -> Callable[[], None]:
        return lambda: self.producer.kv_ready(self.now, tid, [blocks], final=final)


def one_case(params: Params, progressive: bool, arrivals: list[float], tokens: int) -> list[Req]:
    sim = Sim(params, progressive)
    for i, a in enumerate(arrivals):
        sim.submit(f"r{i}", a, tokens)
    sim.run()
    for r in sim.reqs.values():
        assert r.ready_at is not None, f"{r.tid} never Ready"
    return list(sim.reqs.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gbps", default="25,200", help="link rates, Gb/s, comma separated")
    ap.add_argument("--prompts", default="4096,32768", help="prompt lengths, tokens")
    ap.add_argument("--prefill-tps", type=float, default=20_000.0, help="prefill tokens/s")
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--decode-step-ms", type=float, default=30.0)
    ap.add_argument("--ctrl-latency-us", type=float, default=50.0, help="control message latency")
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--requests", type=int, default=20, help="requests of the Poisson run")
    ap.add_argument("--qps", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shape = Shape(args.layers, args.kv_heads, args.head_dim, 2, args.tokens_per_block)
    step = args.decode_step_ms
    started = time.perf_counter()
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    for _ in range(args.requests):
        arrivals.append(t)
        t += rng.expovariate(args.qps)
    cases = []
    for gbps in (float(x) for x in args.gbps.split(",")):
        for tokens in (int(x) for x in args.prompts.split(",")):
            params = Params(
                gbps, args.prefill_tps, args.chunk_tokens, args.ctrl_latency_us / 1e6, shape
            )
            row: dict[str, Any] = {"gbps": gbps, "prompt_tokens": tokens}
            alone = {}
            for name, prog in (("push", False), ("progressive", True)):
                (r,) = one_case(params, prog, [0.0], tokens)
                assert r.ready_at is not None
                alone[name] = r
            push_h = alone["push"].ready_at * 1e3  # type: ignore[operator]
            prog_h = alone["progressive"].ready_at * 1e3  # type: ignore[operator]
            row.update(
                kv_bytes=alone["push"].bytes_landed,
                prefill_ms=round(tokens / args.prefill_tps * 1e3, 2),
                wire_ms=round(alone["push"].bytes_landed * 8 / (gbps * 1e9) * 1e3, 2),
                push_handoff_ms=round(push_h, 2),
                progressive_handoff_ms=round(prog_h, 2),
                push_ms=round(push_h + step, 2),
                progressive_ms=round(prog_h + step, 2),
                ratio=round((prog_h + step) / (push_h + step), 3),
                increments_push=alone["push"].increments,
                increments_progressive=alone["progressive"].increments,
            )
            p50: dict[str, float] = {}
            for name, prog in (("push", False), ("progressive", True)):
                reqs = one_case(params, prog, arrivals, tokens)
                ttft = [(r.ready_at - r.arrival) * 1e3 + step for r in reqs]  # type: ignore[operator]
                p50[name] = statistics.median(ttft)
                row[f"poisson_{name}_p50_ms"] = round(p50[name], 2)
                row[f"poisson_{name}_p95_ms"] = round(statistics.quantiles(ttft, n=20)[-1], 2)
            row["poisson_ratio_p50"] = round(p50["progressive"] / p50["push"], 3)
            # Offered load of the Poisson run: over 1, a queue grows without end.
            row["poisson_link_load"] = round(args.qps * row["wire_ms"] / 1e3, 3)
            row["poisson_prefill_load"] = round(args.qps * row["prefill_ms"] / 1e3, 3)
            cases.append(row)
    out = {
        "model": {
            "shape": "Qwen3-32B-like",
            "layers": shape.layers,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "dtype": "bf16",
            "bytes_per_token": shape.bytes_per_token,
            "tokens_per_block": shape.tokens_per_block,
        },
        "prefill_tps": args.prefill_tps,
        "chunk_tokens": args.chunk_tokens,
        "decode_step_ms": step,
        "ctrl_latency_us": args.ctrl_latency_us,
        "link": "one link, flows served FIFO",
        "requests": args.requests,
        "qps": args.qps,
        "seed": args.seed,
        "integrity": "checked: every block written once, Ready after the last byte",
        "cases": cases,
        "runtime_s": round(time.perf_counter() - started, 2),
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
