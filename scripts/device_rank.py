"""One worker rank of the model check: a process like one vLLM worker.

It holds the model (:mod:`device_model`), one packed KV cache per case
(:mod:`device_kv`, vLLM 0.33's GPU layout, in VRAM on a GPU) and the
connector's worker half, :class:`kvpush_vllm._worker.WorkerSide` (its NIXL
agent and data plane), and does what vLLM's worker does in a step, in vLLM's
order: ``bind_connector_metadata`` (:meth:`WorkerSide.step`), the forward (a
prefill chunk: the HF model computes it and its K and V are written into this
rank's heads of the packed blocks), ``wait_for_save``
(:meth:`WorkerSide.computed`: on a GPU it records the CUDA event the writes
wait for) and ``build_connector_worker_meta`` (results and computed chunks go
back). A decode rank also generates from the KV it received.

Commands (a tuple: a sequence number, the name, the arguments) come on a
pipe from the driver (:mod:`device_handoff`); each has one reply, with the
same number first (the driver drops a late one): ``setup`` -> ``blob``,
``step`` -> ``stepped``, ``generate`` -> ``generated``, ``teardown`` ->
``ok``, ``stop`` -> ``stopped``; a failure -> ``error`` with the reason. The
process ends after ``IDLE_S`` without a command, or when the driver is gone.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
from device_kv import CacheShape, allocate_packed, layer_name, read_tokens, slots_zero_elsewhere
from device_kv import write_tokens as write_kv
from device_model import (
    ModelSpec,
    build_model,
    cache_from_kv,
    chunk_kv,
    greedy,
    last_token,
    new_cache,
    prefill,
    reference,
)

from kvpush.protocol import Codec, Role
from kvpush_nixl import NixlTransport
from kvpush_vllm._tensors import layout_from_tensors
from kvpush_vllm._worker import WorkerSide

__all__ = ("IDLE_S", "Chunk", "Generate", "RankSetup", "rank_main")

IDLE_S = 300.0  # no command for this long: the driver is stuck or gone


@dataclass(frozen=True, slots=True)
class RankSetup:
    """One case's rank: its KV cache, its agent, the prompt (prefill)."""

    role: Role
    rank: int
    tp: int
    agent: str
    layout: str
    block_size: int
    num_blocks: int
    heads: int
    head_start: int
    prompt: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Chunk:
    """A prefill step's forward: prompt tokens ``start .. end`` into ``blocks``
    (the request's blocks so far); ``progress`` is what ``wait_for_save``
    echoes (progressive push)."""

    start: int
    end: int
    blocks: tuple[int, ...]
    progress: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Generate:
    """The decode: generate from the KV received in ``blocks``."""

    prompt: tuple[int, ...]
    blocks: tuple[int, ...]
    first: int
    chunk: int


@dataclass
class _Case:
    setup: RankSetup
    caches: dict[str, Any]
    worker: WorkerSide
    #: The prefill's transformers cache: the model's own working copy.
    hf_cache: Any = None


class _Rank:
    """The process's state: the model, and the case in progress."""

    def __init__(self, spec: ModelSpec, device: str) -> None:
        self.spec, self.device = spec, device
        self.model = build_model(spec, device)
        self.case: _Case | None = None

    def setup(self, s: RankSetup) -> bytes:
        self.teardown()
        spec = self.spec
        shape = CacheShape(spec.layers, s.num_blocks, s.heads, s.block_size, spec.head_size)
        caches = allocate_packed(shape, spec.torch_dtype, s.layout, self.device)
        # vLLM's GPU layout, wherever it lives: "cuda" reads it as packed [k | v] rows.
        layout = layout_from_tensors(
            caches,
            tokens_per_block=s.block_size,
            num_kv_heads=s.heads,
            head_size=spec.head_size,
            head_start=s.head_start,
            platform="cuda",
        )
        transport = NixlTransport(s.agent, vram=self.device != "cpu")
        worker = WorkerSide(s.role, s.rank, s.tp, Codec(), transport)
        try:
            blob = worker.register(layout)
        except BaseException:
            worker.close()
            raise
        self.case = _Case(s, caches, worker)
        return blob

    def step(
        self, actions: Any, peers: Any, expecting: bool, bell: Any, chunk: Chunk | None
    ) -> Any:
        case = self._case()
        case.worker.step(actions, peers, expecting, bell)
        first = None
        progress: list[tuple[str, int]] = []
        if chunk is not None:
            first = self._forward(case, chunk)
            progress = list(chunk.progress)
        case.worker.computed(progress)  # wait_for_save, every step
        results, computed = case.worker.take_results(), case.worker.take_computed()
        return ("stepped", results, computed, case.worker.stats(), first)

    def _forward(self, case: _Case, chunk: Chunk) -> int | None:
        s = case.setup
        if chunk.start == 0:
            case.hf_cache = new_cache(self.model)
        logits = prefill(self.model, list(s.prompt), chunk.start, chunk.end, case.hf_cache)
        kv = chunk_kv(case.hf_cache, chunk.start, chunk.end, s.head_start, s.heads)
        for layer, (k, v) in enumerate(kv):
            write_kv(case.caches[layer_name(layer)], list(chunk.blocks), s.block_size,
                     chunk.start, k, v)  # fmt: skip
        # The last chunk samples, which waits for the forward and its KV writes
        # (as vLLM's sampling does); an earlier chunk leaves its kernels queued
        # on a GPU: its writes wait for the event computed() records.
        return last_token(logits) if chunk.end == len(s.prompt) else None

    def generate(self, g: Generate) -> dict[str, Any]:
        case, spec = self._case(), self.spec
        s, ids, n = case.setup, list(g.prompt), spec.new_tokens
        t0 = time.monotonic()
        blocks = list(g.blocks)
        kv = [
            read_tokens(case.caches[layer_name(i)], blocks, s.block_size, len(ids), spec.head_size)
            for i in range(spec.layers)
        ]
        tokens = greedy(self.model, cache_from_kv(self.model, kv), g.first, n)
        want, want_kv = reference(self.model, ids, g.chunk, n)
        zeros = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in kv]
        zero_tokens = greedy(self.model, cache_from_kv(self.model, zeros), g.first, n)
        pairs = [(x, y) for (k, v), (rk, rv) in zip(kv, want_kv, strict=True)
                 for x, y in ((k, rk), (v, rv))]  # fmt: skip
        kv_equal = all(torch.equal(x, y) for x, y in pairs)
        diff = max(float((x.float() - y.float()).abs().max()) for x, y in pairs)
        return {
            "tokens": tokens,
            "reference": want,
            "zero_kv_tokens": zero_tokens,
            "kv_equal": kv_equal,
            "kv_max_abs_diff": diff,
            "elsewhere_zero": slots_zero_elsewhere(
                case.caches, blocks, s.block_size, len(ids), spec.head_size
            ),
            "generate_s": round(time.monotonic() - t0, 3),
        }

    def teardown(self) -> None:
        case, self.case = self.case, None
        if case is not None:
            case.worker.close()

    def _case(self) -> _Case:
        if self.case is None:
            raise RuntimeError("no case set up in this rank")
        return self.case


def _serve(rank: _Rank, cmd: tuple[Any, ...]) -> tuple[Any, ...]:
    name = cmd[0]
    if name == "setup":
        return ("blob", rank.setup(cmd[1]))
    if name == "step":
        return tuple(rank.step(*cmd[1:]))
    if name == "generate":
        return ("generated", rank.generate(cmd[1]))
    if name == "teardown":
        rank.teardown()
        return ("ok",)
    raise RuntimeError(f"unknown command {name!r}")


def rank_main(conn: Connection, spec: ModelSpec, device: str, threads: int) -> None:
    """The rank process: build the model, then serve commands until ``stop``."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    torch.set_num_threads(threads)
    rank: _Rank | None = None
    try:
        rank = _Rank(spec, device)
        conn.send((0, "ready", os.getpid()))
        while conn.poll(IDLE_S):
            seq, *cmd = conn.recv()
            if cmd[0] == "stop":
                conn.send((seq, "stopped"))
                return
            try:
                reply = _serve(rank, tuple(cmd))
            except Exception as exc:
                tb = traceback.format_exc(limit=6)
                reply = ("error", f"{type(exc).__name__}: {exc}\n{tb}")
            conn.send((seq, *reply))
    except (EOFError, BrokenPipeError):  # the driver is gone
        return
    except Exception as exc:  # the model could not be built: say why
        with contextlib.suppress(OSError):
            conn.send((0, "error", f"{type(exc).__name__}: {exc}"))
    finally:
        if rank is not None:
            rank.teardown()
