"""The model check: a real model's KV from prefill ranks to a decode rank, by kvpush.

This process plays vLLM's two engine cores: a prefill and a decode instance,
each a :class:`~kvpush_vllm._scheduler.SchedulerSide` (the connector's
scheduler half: endpoint and control channel), pumping each step's metadata
to its worker ranks and their results back as vLLM's engine does. The ranks
are processes (:mod:`device_rank`: model, packed KV cache in vLLM 0.33's GPU
layout, :class:`~kvpush_vllm._worker.WorkerSide` with its NIXL agent); two
prefill ranks hold half the KV heads each (TP 2), the decode rank all of them.

Per case (:class:`Case`): the decode registers for the transfer (parallel
dispatch: before the prefill starts); the prefill computes the prompt in
chunks, each chunk's KV written into its scattered blocks, and with
progressive push every chunk's whole blocks go to the core as an increment
(:class:`~kvpush_vllm._progressive.Progress`, as the connector does); then
``kv_ready`` (vLLM's ``request_finished``), and the instances step until the
decode hears the load finished and the prefill its blocks released. The
decode rank then reads K and V from its blocks into a transformers cache and
generates greedily. A case passes when its tokens equal one process's alone
(computed in the decode rank with the same chunking), the KV it read equals
that process's bit for bit, nothing else in its cache was written, the
posting side posted at least the prompt's KV bytes (and, progressive, some
before ``kv_ready``), and the sanity holds: the same decode from zeroed KV
generates other tokens (so the check would fail if the KV never came).

Every wait is bounded (``DEADLINE_S``; ``START_S`` for a rank to start);
every rank process is stopped and reaped, on failure too.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import random
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import SimpleNamespace, TracebackType
from typing import Any

from device_model import ModelSpec
from device_rank import Chunk, Generate, RankSetup, rank_main

from kvpush.protocol import Mode, PState, Role
from kvpush.runtime import decode_rank
from kvpush_vllm._config import ConnectorConfig
from kvpush_vllm._params import TransferParams
from kvpush_vllm._progressive import Progress
from kvpush_vllm._proven import Facts, check_proven, handshake_fingerprint, kv_layout_kind
from kvpush_vllm._scheduler import Reports, SchedulerSide

__all__ = ("CASES", "CPU_CASES", "DEADLINE_S", "Case", "run_model_check")

DEADLINE_S = 60.0  # any one wait: a reply, a transfer
START_S = 180.0  # a rank's start: spawn, imports (torch, transformers), model, CUDA
SPARE = 5  # blocks in each cache beyond the request's (its blocks are scattered)
NAP_S = 0.001  # between two engine steps while a transfer is in flight


@dataclass(frozen=True, slots=True)
class Case:
    """One handoff: prefill TP ``p_tp`` -> decode TP 1."""

    p_tp: int
    mode: Mode
    p_block: int
    d_block: int
    #: vLLM's KVCacheLayout on both sides (LBHNC: head-major, LBNHC: token-major).
    layout: str
    progressive: bool = False
    #: Prompt tokens per prefill forward (0: the whole prompt in one).
    chunk: int = 0

    @property
    def name(self) -> str:
        extra = f"-chunk{self.chunk}" if self.chunk else ""
        extra += "-progressive" if self.progressive else ""
        blocks = f"{self.p_block}to{self.d_block}"
        return f"tp{self.p_tp}to1-{self.mode.value}-{blocks}-{self.layout}{extra}"


def _matrix() -> tuple[Case, ...]:
    """The GPU's cases: TP 1 -> 1 (token-major) and 2 -> 1 (head-major: a head
    slice is one run per block), push and pull, block sizes equal and not,
    and progressive push in chunks of 64 tokens."""
    out = []
    for tp, layout in ((1, "LBNHC"), (2, "LBHNC")):
        for mode in (Mode.PUSH, Mode.PULL):
            out += [Case(tp, mode, p, d, layout) for p, d in ((16, 16), (16, 32), (32, 16))]
        out += [Case(tp, Mode.PUSH, p, d, layout, True, 64) for p, d in ((16, 16), (32, 16))]
    return tuple(out)


CASES = _matrix()
#: The CPU path (CI): the fewest cases that still cover TP 1 and 2, push and
#: pull, both layouts, block sizes equal and both ways unequal, progressive.
CPU_CASES = (
    Case(1, Mode.PUSH, 16, 16, "LBNHC"),
    Case(2, Mode.PUSH, 16, 32, "LBHNC", progressive=True, chunk=32),
    Case(2, Mode.PULL, 32, 16, "LBHNC"),
)


class RankProc:
    """One rank process and its pipe: every wait bounded, always reaped.
    Commands carry a number, replies echo it: a reply to a command whose wait
    timed out is dropped when it comes late."""

    def __init__(self, name: str, spec: ModelSpec, device: str, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.name, self.seq = name, 0
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=rank_main, args=(child, spec, device, threads), name=name, daemon=True
        )
        self.proc.start()
        child.close()

    def send(self, msg: tuple[Any, ...]) -> None:
        self.seq += 1
        try:
            self.conn.send((self.seq, *msg))
        except OSError:
            raise self._gone() from None

    def expect(self, kind: str, timeout: float = DEADLINE_S) -> tuple[Any, ...]:
        """The reply to the latest command (``kind``, or ``error``: raised)."""
        end = time.monotonic() + timeout
        while True:
            if not self.conn.poll(max(0.0, end - time.monotonic())):
                alive = "alive" if self.proc.is_alive() else f"exited ({self.proc.exitcode})"
                raise TimeoutError(
                    f"no {kind!r} from rank {self.name} in {timeout:.0f} s ({alive})"
                )
            try:
                seq, *msg = self.conn.recv()
            except (EOFError, OSError):
                raise self._gone() from None
            if seq < self.seq:
                continue  # the late reply to a command given up on
            if msg[0] == "error":
                raise RuntimeError(f"rank {self.name}: {msg[1]}")
            if msg[0] != kind:
                raise RuntimeError(f"rank {self.name}: expected {kind!r}, got {msg[0]!r}")
            return tuple(msg)

    def call(self, msg: tuple[Any, ...], reply: str) -> tuple[Any, ...]:
        self.send(msg)
        return self.expect(reply)

    def _gone(self) -> RuntimeError:
        self.proc.join(1.0)
        return RuntimeError(f"rank {self.name} died (exit code {self.proc.exitcode})")

    def close(self) -> None:
        """Stop it (bounded), else kill it; reap it either way."""
        try:
            if self.proc.is_alive():
                self.send(("stop",))
                self.expect("stopped", 10.0)
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        finally:
            self.proc.join(10.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10.0)
            self.conn.close()


class Ranks:
    """The rank processes of the whole check (``p0``, ``p1``: prefill; ``d0``)."""

    def __init__(self, spec: ModelSpec, device: str, prefill_ranks: int) -> None:
        threads = 1 if device == "cpu" else 4
        names = [f"p{i}" for i in range(prefill_ranks)] + ["d0"]
        self.procs: dict[str, RankProc] = {}
        try:
            for name in names:
                self.procs[name] = RankProc(name, spec, device, threads)
            for proc in self.procs.values():
                proc.expect("ready", START_S)
        except BaseException:
            self.close()
            raise

    def prefill(self, tp: int) -> list[RankProc]:
        return [self.procs[f"p{i}"] for i in range(tp)]

    def decode(self) -> list[RankProc]:
        return [self.procs["d0"]]

    def __enter__(self) -> Ranks:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for proc in self.procs.values():
            proc.close()


class Instance:
    """One vLLM instance as its engine core drives the connector: the
    scheduler side here, each step's metadata down to the ranks and their
    results up (``update_connector_output``)."""

    def __init__(
        self, role: Role, block_size: int, heads: int, ranks: list[RankProc], port: int
    ) -> None:
        self.role, self.block_size, self.ranks = role, block_size, ranks
        self.config = ConnectorConfig.from_extra({"port": port})
        self.sched = SchedulerSide(role, self.config, len(ranks), heads, block_size)
        self.seen = Reports()
        self.stats: dict[str, int] = {}
        self.set_up = False

    def start(self, setups: list[RankSetup], dtype: str, head_size: int) -> None:
        """``register_kv_caches`` on every rank, vLLM's start-up check, the handshake."""
        for proc, setup in zip(self.ranks, setups, strict=True):
            proc.send(("setup", setup))
        self.set_up = True
        blobs = {i: proc.expect("blob")[1] for i, proc in enumerate(self.ranks)}
        facts = Facts(
            platform="cuda", kv_dtype=dtype, block_size=self.block_size, head_size=head_size,
            tensor_parallel_size=len(self.ranks), pipeline_parallel_size=1, use_mla=False,
            kv_cache_groups=("FullAttentionSpec",), cpu_attn_isa="",
        )  # fmt: skip
        side = "prefill" if self.role is Role.PRODUCER else "decode"
        check_proven("cuda", facts.values(), (), side)
        layouts = [decode_rank(blob)[1] for blob in blobs.values()]
        for rank, layout in enumerate(layouts):
            check_proven("cuda", {"kv_layout": kv_layout_kind(layout)}, (), f"{side} rank {rank}")
        self.sched.start(blobs, fingerprint=handshake_fingerprint(facts, layouts[0]))

    def step(self, chunk: Chunk | None = None) -> tuple[list[tuple[int, str, int]], int | None]:
        """One engine step; (the ranks' computed chunks, the first token if
        this step finished the prompt)."""
        out, reports = self.sched.step()
        self._heard(reports)
        expecting, bell = self.sched.expecting(), self.sched.doorbell
        for proc in self.ranks:
            proc.send(("step", out.actions, out.peers, expecting, bell, chunk))
        results: list[Any] = []
        computed: list[tuple[int, str, int]] = []
        first = None
        for proc in self.ranks:
            _, res, comp, stats, token = proc.expect("stepped")
            results += res
            computed += comp
            first = first if token is None else token
            for key, n in stats.items():
                self.stats[key] = self.stats.get(key, 0) + n
        self._heard(self.sched.results(results))  # vLLM hears these in this step
        return computed, first

    def _heard(self, reports: Reports) -> None:
        self.seen.sending |= reports.sending
        self.seen.recving |= reports.recving
        self.seen.failed.update(reports.failed)

    def close(self) -> None:
        self.sched.close()
        if self.set_up:
            for proc in self.ranks:
                with contextlib.suppress(Exception):
                    proc.call(("teardown",), "ok")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pump(instances: Sequence[Instance], done: Callable[[], bool], what: str) -> None:
    """Step every instance until ``done()``, for at most ``DEADLINE_S``."""
    end = time.monotonic() + DEADLINE_S
    while not done():
        if time.monotonic() > end:
            seen = {i.role.value: i.seen for i in instances}
            raise TimeoutError(f"{what}: not in {DEADLINE_S:.0f} s ({seen})")
        for inst in instances:
            inst.step()
        time.sleep(NAP_S)


def registered(sched: SchedulerSide, transfer_id: str) -> bool:
    """The decode's registration reached the prefill's core (a read-only look)."""
    rt = sched._sync.runtime if sched._sync is not None else None
    if rt is None:
        return False
    with rt.lock:
        return any(t == transfer_id and s is PState.WAIT_KV for t, s in rt.endpoint.transfers())


def _sched_output(start: int, end: int, new: list[int], first: bool) -> Any:
    """The fields of vLLM's ``SchedulerOutput`` that ``Progress.plan`` reads."""
    req = "p-req"
    if first:
        new_reqs = [SimpleNamespace(req_id=req, block_ids=(new,), num_computed_tokens=start)]
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
    else:
        new_reqs = []
        cached = SimpleNamespace(req_ids=[req], new_block_ids=[(new,)], num_computed_tokens=[start])
    return SimpleNamespace(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req: end - start},
    )


def _prefill(
    prefill: Instance, decode: Instance, case: Case, tid: str, blocks: list[int], prompt: int
) -> tuple[int, int]:
    """The prefill's steps over the prompt, chunk by chunk; (first token,
    bytes posted before ``kv_ready``)."""
    progress = Progress(case.p_block, case.p_tp) if case.progressive else None
    if progress is not None:
        progress.track("p-req", tid, prompt)
        pump([prefill, decode], lambda: registered(prefill.sched, tid), "registration")
    chunk, held, first = case.chunk or prompt, 0, None
    for start in range(0, prompt, chunk):
        end = min(prompt, start + chunk)
        need = -(-end // case.p_block)
        plan = []
        if progress is not None:
            out = _sched_output(start, end, blocks[held:need], start == 0)
            plan = progress.plan(out)
        held = need
        computed, token = prefill.step(Chunk(start, end, tuple(blocks[:need]), tuple(plan)))
        first = token if token is not None else first
        for _, transfer_id, whole in progress.computed(computed) if progress else ():
            prefill.sched.kv_increment(transfer_id, whole)
        decode.step()
    if first is None:
        raise RuntimeError("the prefill ranks returned no first token")
    if progress is not None:  # the increments go while the "rest" is computed
        pump([prefill, decode], lambda: prefill.stats.get("bytes", 0) > 0, "an increment")
    return first, prefill.stats.get("bytes", 0)


def run_case(case: Case, spec: ModelSpec, ranks: Ranks, seed: int) -> dict[str, Any]:
    """One handoff and the decode's generation; the case's report."""
    t0 = time.monotonic()
    rng = random.Random(seed)
    prompt = [rng.randrange(spec.vocab) for _ in range(spec.prompt)]
    p_need, d_need = -(-spec.prompt // case.p_block), -(-spec.prompt // case.d_block)
    p_blocks = rng.sample(range(p_need + SPARE), p_need)
    d_blocks = rng.sample(range(d_need + SPARE), d_need)
    heads = spec.kv_heads // case.p_tp
    prefill = Instance(Role.PRODUCER, case.p_block, spec.kv_heads, ranks.prefill(case.p_tp),
                       free_port())  # fmt: skip
    decode = Instance(Role.CONSUMER, case.d_block, spec.kv_heads, ranks.decode(), 0)
    try:
        p_setups = [
            RankSetup(Role.PRODUCER, r, case.p_tp, f"{prefill.config.engine_id}-r{r}",
                      case.layout, case.p_block, p_need + SPARE, heads, r * heads, tuple(prompt))
            for r in range(case.p_tp)
        ]  # fmt: skip
        d_setup = RankSetup(Role.CONSUMER, 0, 1, f"{decode.config.engine_id}-r0", case.layout,
                            case.d_block, d_need + SPARE, spec.kv_heads, 0)  # fmt: skip
        prefill.start(p_setups, spec.dtype, spec.head_size)
        decode.start([d_setup], spec.dtype, spec.head_size)
        tid = f"kvp-{seed}-{rng.randrange(1 << 30)}"
        params_d = TransferParams(tid, "decode", case.mode, prefill.config.engine_id)
        if decode.sched.tokens_to_load("d-req", params_d, spec.prompt, 0) != spec.prompt:
            raise RuntimeError("the decode would not load the prompt's KV")
        decode.sched.reserve("d-req", params_d, d_blocks, 0)
        first, early = _prefill(prefill, decode, case, tid, p_blocks, spec.prompt)
        t_ready = time.monotonic()
        params_p = TransferParams(tid, "prefill", case.mode, "decode")
        if not prefill.sched.kv_ready("p-req", params_p, p_blocks):
            raise RuntimeError("kv_ready refused the blocks")
        pump(
            [prefill, decode],
            lambda: "d-req" in decode.seen.recving and "p-req" in prefill.seen.sending,
            "the transfer",
        )
        moved_s = time.monotonic() - t_ready
        if decode.seen.failed:
            raise RuntimeError(f"the load failed: {decode.seen.failed}")
        gen = Generate(tuple(prompt), tuple(d_blocks), first, case.chunk or spec.prompt)
        report: dict[str, Any] = decode.ranks[0].call(("generate", gen), "generated")[1]
    finally:
        prefill.close()
        decode.close()
    poster = prefill if case.mode is Mode.PUSH else decode
    elem = 2 if spec.dtype in ("bfloat16", "float16") else 4
    kv_bytes = spec.layers * spec.prompt * spec.kv_heads * 2 * spec.head_size * elem
    report |= {
        "case": case.name,
        "tokens_equal": report["tokens"] == report["reference"],
        "zero_kv_differs": report["zero_kv_tokens"] != report["reference"],
        "bytes_posted": poster.stats.get("bytes", 0),
        "kv_bytes": kv_bytes,
        "ops_posted": poster.stats.get("posted", 0),
        "failed_posts": prefill.stats.get("failed", 0) + decode.stats.get("failed", 0),
        "transfer_s": round(moved_s, 3),
        "seconds": round(time.monotonic() - t0, 2),
    }
    if case.progressive:
        report["bytes_before_kv_ready"] = early
    checks = [
        report["tokens_equal"], report["zero_kv_differs"], report["kv_equal"],
        report["elsewhere_zero"], report["bytes_posted"] >= kv_bytes,
        report["failed_posts"] == 0, not case.progressive or early > 0,
    ]  # fmt: skip
    report["ok"] = all(checks)
    return report


def cases_for(names: str) -> list[Case]:
    """``names``: comma-separated case names, ``all`` (:data:`CASES`) or ``ci``
    (:data:`CPU_CASES`)."""
    if names in ("all", "ci"):
        return list(CASES if names == "all" else CPU_CASES)
    every = {c.name: c for c in (*CASES, *CPU_CASES)}
    unknown = [n for n in names.split(",") if n not in every]
    if unknown:
        raise ValueError(f"unknown model cases {unknown}; known: {sorted(every)}")
    return [every[n] for n in names.split(",")]


def run_model_check(
    device: str,
    spec: ModelSpec,
    cases: list[Case],
    log: Callable[[str], None],
    out: dict[str, Any],
) -> None:
    """Every case in turn with the same rank processes; the JSON "model"
    section is filled into ``out`` as the cases go (a report even when cut short)."""
    out |= {
        "ok": False,
        "device": device,
        "spec": asdict(spec),
        "cases": [],
        "unit": "tokens: the decode's first token, then its greedy ones; seconds per case",
    }
    t0 = time.monotonic()
    try:
        with Ranks(spec, device, max(c.p_tp for c in cases)) as ranks:
            out["start_s"] = round(time.monotonic() - t0, 1)
            for i, case in enumerate(cases):
                log(f"device-check: model {case.name} ...")
                try:
                    out["cases"].append(run_case(case, spec, ranks, seed=i + 1))
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"[:2000]
                    out["cases"].append({"case": case.name, "ok": False, "error": error})
                log(f"device-check: model {_line(out['cases'][-1])}")
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        out["ok"] = len(out["cases"]) == len(cases) > 0 and all(c["ok"] for c in out["cases"])
        out["elapsed_s"] = round(time.monotonic() - t0, 1)


def _line(case: dict[str, Any]) -> str:
    keys = ("case", "ok", "tokens_equal", "zero_kv_differs", "kv_equal", "bytes_posted",
            "transfer_s", "seconds", "error")  # fmt: skip
    return ", ".join(f"{k}={case[k]}" for k in keys if k in case)
