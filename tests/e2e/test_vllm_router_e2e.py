"""End to end behind vLLM's own router: the real ``vllm-router`` 0.1.17 binary
from PyPI in front of real vLLM CPU engines with kvpush (docs/contract.md).

One start of three engines (the GQA model, block size 32): a baseline, a
prefill and a decode, behind two vllm-routers at once:

* ``vr-nixl``: ``--kv-connector nixl`` with static URLs (its default mode,
  sequential). The prefill gets NIXL's prefill leg, mints the transfer id and
  answers a sealed pull leg, which the router copies to the decode;
* ``vr-moriio``: ``--kv-connector moriio`` with ZMQ service discovery (both
  legs at once, MoRI-IO WRITE). Both engines register over ZMQ
  (``router_discovery``); the decode reads the prefill's address from the
  request id and kvpush pushes.

Both must give the baseline's token ids. Then the failures: a prompt only the
prefill refuses (its ``--max-model-len`` is 512, the decode's 1024) and a
request only the decode refuses (``min_tokens`` above ``max_tokens``; the
router rewrites both to 1 on the prefill leg). The client gets an error each
time, and no block stays held on either side (``vllm:kvpush_blocks`` back to 0 within its bound).
The decode's ``/metrics`` shows kvpush's gauges and phase histograms.

Needs the e2e venv (``make e2e``); skipped elsewhere.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import TIMINGS, Proc, free_port, metric_sum, metrics
from e2e_lib import (
    MAX_TOKENS,
    REQUEST_TIMEOUT,
    Cluster,
    Engine,
    baseline,
    complete,
    engine,
    handoff,
    make_model,
    prompts,
    running,
    skip_unless_e2e_venv,
)

skip_unless_e2e_venv()

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

#: scripts/install-vllm-e2e.sh puts vllm-router in a venv of its own beside vLLM's.
VLLM_ROUTER = Path(sys.prefix) / "router" / "bin" / "vllm-router"
SECRET = "kvpush-e2e-cluster-secret-0123456789"
HOLD, READY = 8.0, 20.0  # kv_hold_timeout, ready_timeout
MAX_TRANSIT, OP_BOUND = 2.0, 10.0  # the defaults
P_MAX_LEN = 512
LENGTHS = (1, 5, 31, 32, 33, 64, 100, 257, 400, P_MAX_LEN - 16)


def vllm_router(name: str, logs: Path, args: list[str]) -> Engine:
    port = free_port()
    argv = [
        str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port),
        "--vllm-pd-disaggregation", "--policy", "round_robin",
        "--prometheus-port", str(free_port()),
        "--request-timeout-secs", str(int(REQUEST_TIMEOUT)), *args,
    ]  # fmt: skip
    proc = Proc(name, argv, logs / f"{name}.log", {"PATH": "/usr/bin:/bin", "RUST_LOG": "info"})
    return Engine(name, f"http://127.0.0.1:{port}", proc, 32, "router")


@pytest.fixture(scope="module")
def vr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if not VLLM_ROUTER.exists():
        pytest.fail(f"{VLLM_ROUTER} is missing: run scripts/install-vllm-e2e.sh", pytrace=False)
    work = tmp_path_factory.mktemp("kvpush-e2e-vllm-router")
    logs = work / "logs"
    logs.mkdir()
    model = make_model(work, "gqa-d64")
    zmq_port, p_port, d_port = free_port(), free_port(), free_port()

    def config(http: int) -> dict[str, object]:
        return {
            "secret": SECRET,
            "kv_hold_timeout": HOLD,
            "ready_timeout": READY,
            "router_discovery": {"router": f"127.0.0.1:{zmq_port}", "http": f"127.0.0.1:{http}"},
        }

    p = engine(
        "p",
        model,
        logs,
        bind="0",
        block_size=32,
        role="prefill",
        port=p_port,
        extra=config(p_port),
        args=["--max-model-len", str(P_MAX_LEN)],
    )
    d = engine(
        "d",
        model,
        logs,
        bind="1",
        block_size=32,
        role="decode",
        port=d_port,
        extra={**config(d_port), "allowed_peers": [f"127.0.0.1:{p.ctrl}"]},
        kv={"kv_load_failure_policy": "recompute"},
    )
    routers = [
        vllm_router("vr-nixl", logs, ["--kv-connector", "nixl", "--prefill", p.url,
                                      "--decode", d.url, "--worker-startup-check-interval", "1"]),
        vllm_router("vr-moriio", logs, ["--kv-connector", "moriio",
                                        "--vllm-discovery-address", f"127.0.0.1:{zmq_port}"]),
    ]  # fmt: skip
    engines = [engine("baseline", model, logs, bind="0", block_size=32), p, d]
    print(f"\nkvpush e2e (vllm-router): logs in {logs}")
    routes = {"vr-nixl": ("p", "d"), "vr-moriio": ("p", "d")}
    with running("vllm-router", [*engines, *routers], routes) as c:
        yield c


def held(c: Cluster) -> dict[str, float]:
    """kvpush's block gauges on both engines, from their /metrics."""
    out = {}
    for name, kind in (("p", "held"), ("d", "reserved"), ("d", "suspect")):
        out[f"{name}.{kind}"] = metric_sum(metrics(c[name].url), "vllm:kvpush_blocks", kind=kind)
    return out


def settled(c: Cluster, within: float) -> tuple[dict[str, float], float]:
    """Wait until no block is held on either side; the gauges and how long it took."""
    t = time.monotonic()
    while True:
        now = held(c)
        if not any(now.values()) or time.monotonic() - t > within:
            return now, time.monotonic() - t
        time.sleep(0.5)


@pytest.mark.parametrize(("route", "mode"), [("vr-nixl", "pull"), ("vr-moriio", "push")])
def test_vllm_router_drives_kvpush_token_identical(vr: Cluster, route: str, mode: str) -> None:
    with vr.explain():
        batch = prompts(41 if mode == "pull" else 42, LENGTHS)
        want = baseline(vr, "baseline", batch, f"{route} {mode}")
        moved = handoff(vr, route, batch, want, [""] * len(batch), f"{route} {mode}")
        total = sum(len(p) for p in batch)
        assert moved["decode.external_kv_transfer"] >= total - len(batch), moved
        assert moved["decode.local_compute"] <= len(batch), moved
        assert moved["prefill.transfers_failed_total"] == 0, moved
        assert moved["decode.transfers_failed_total"] == 0, moved
        # pull: the decode posts the reads; push: the prefill posts the writes.
        poster = "decode" if mode == "pull" else "prefill"
        assert moved[f"{poster}.transfers_posted_total"] >= 1, moved
        gauges, took = settled(vr, HOLD + 10)
        TIMINGS[f"{route}: blocks settled after the batch"] = took
        assert not any(gauges.values()), gauges


@pytest.mark.parametrize("route", ["vr-nixl", "vr-moriio"])
def test_a_prefill_failure_and_a_decode_failure_give_errors_and_leak_no_block(
    vr: Cluster, route: str
) -> None:
    with vr.explain():
        url = vr[route].url
        # The prefill refuses it (past its 512 tokens), the decode would not.
        (too_long,) = prompts(43, [P_MAX_LEN + 88])
        got = complete(url, too_long)
        assert got.status >= 400, (got.status, got.raw)
        print(f"{route}: prefill failure -> HTTP {got.status}: {str(got.raw)[:200]}")
        # Withdrawn at once when vLLM aborts the decode leg; else by the deadline.
        gauges, took = settled(vr, READY + MAX_TRANSIT + OP_BOUND + 15)
        TIMINGS[f"{route}: blocks settled after a prefill failure"] = took
        assert not any(gauges.values()), gauges
        # The decode refuses it (min_tokens > max_tokens: vLLM's 400); the
        # prefill leg, rewritten by the router to max_tokens = min_tokens = 1, runs.
        (fits,) = prompts(44, [400])
        got = complete(url, fits, max_tokens=4, min_tokens=8)
        assert got.status == 400, (got.status, got.raw)
        print(f"{route}: decode failure -> HTTP {got.status}: {str(got.raw)[:200]}")
        gauges, took = settled(vr, HOLD + 15)  # the prefill's hold, at most
        TIMINGS[f"{route}: blocks settled after a decode failure"] = took
        assert not any(gauges.values()), gauges
        # And the pair still serves.
        (ok,) = prompts(45, [77])
        want = complete(vr["baseline"].url, ok)
        again = complete(url, ok)
        assert again.status == 200 and again.token_ids == want.token_ids, again.raw
        assert len(want.token_ids or ()) == MAX_TOKENS


def test_the_decode_s_metrics_show_kvpush_s_gauges_and_phases(vr: Cluster) -> None:
    with vr.explain():
        page = metrics(vr["d"].url)
        kinds = {k for k in page if k.startswith("vllm:kvpush_blocks{")}
        assert any('kind="reserved"' in k for k in kinds), sorted(page)[:50]
        assert any('kind="suspect"' in k for k in kinds), kinds
        loads = metric_sum(page, "vllm:kvpush_phase_seconds_count", phase="load")
        assert loads >= len(LENGTHS), loads  # every load of the two batches was timed
        p_page = metrics(vr["p"].url)
        assert metric_sum(p_page, "vllm:kvpush_phase_seconds_count", phase="source_held") >= 1
        assert any(k.startswith("vllm:kvpush_blocks{") and 'kind="held"' in k for k in p_page)
