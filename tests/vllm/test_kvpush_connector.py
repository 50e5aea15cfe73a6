"""``KvpushConnector`` under vLLM 0.33's real ``Scheduler``, with real ``Request``s,
real CPU KV tensors from vLLM's own allocator and real NIXL between a prefill
and a decode worker (two instances in this process, stepped like engines).

Each engine step is what vLLM's engine core and model runner do: schedule,
run the worker-side connector lifecycle (``kv_connector_no_forward``: bind,
start_load_kv, wait_for_save, get_transfer_results, load errors, worker
metadata, clear), sample one token per scheduled request, update_from_output.
"""

from __future__ import annotations

import collections
import logging
import socket
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import RequestStatus
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from kvpush.protocol import ConfigError, Mode, PeerState
from kvpush_vllm import TransferParams
from kvpush_vllm._contract import NIXL_PREFILL_LEG, release_params
from kvpush_vllm.connector import KvpushConnector

CONNECTOR, MODULE = "KvpushConnector", "kvpush_vllm.connector"
FAST = {"ready_timeout": 1.0, "max_transit": 0.2, "op_bound": 0.3}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Engine:
    """One vLLM instance: its real scheduler and one worker (TP 1)."""

    def __init__(
        self, make_scheduler: Any, make_worker: Any, role: str, extra: dict[str, Any], **kw: Any
    ) -> None:
        # Block size 16 (vec16 ISA) runs in no real engine here: acknowledged as unproven.
        extra = {
            "allow_unproven": ["block_size", "cpu_attn_isa"],
            "allowed_peers": ["127.0.0.1"],
            **extra,
        }
        self.scheduler, self.config, kv_cache_config = make_scheduler(
            role, CONNECTOR, MODULE, extra, **kw
        )
        self.connector = self.scheduler.get_kv_connector()
        assert isinstance(self.connector, KvpushConnector)
        self.worker, self.kv = make_worker(self.config, kv_cache_config)
        # What the engine core does after the workers registered their KV caches.
        meta = self.worker.get_handshake_metadata()
        assert meta is not None
        self.connector.set_xfer_handshake_metadata({0: meta})
        self.finished: list[str] = []
        #: req id -> the kv_transfer_params its output carried (what a router copies).
        self.answers: dict[str, Any] = {}
        self.sent: set[str] = set()
        self.recved: set[str] = set()
        # The scheduler side's counters, kept as vLLM drains them every step.
        self._counts: collections.Counter[str] = collections.Counter()
        sched = self.connector._sched
        assert sched is not None
        real = sched.stats

        def stats() -> dict[str, Any]:
            out = real()
            self._counts.update({k: v for k, v in out.items() if k[1:2] != ":" or k[0] == "r"})
            return out

        sched.stats = stats  # type: ignore[method-assign]

    def counts(self) -> dict[str, int]:
        """The scheduler side's counters (``r:<reason>``, ``declined``, ...) so far."""
        self.connector.get_kv_connector_stats()
        return dict(self._counts)

    def step(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        out = self.scheduler.schedule()
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", self.worker)
        ran = KVConnectorModelRunnerMixin.kv_connector_no_forward(out, self.config)
        kvo = ran.kv_connector_output
        req_ids = list(out.num_scheduled_tokens)
        # As the model runner does: a chunk short of the prompt samples nothing.
        reqs = self.scheduler.requests
        partial = {r for r in req_ids if reqs[r].num_computed_tokens < reqs[r].num_prompt_tokens}
        result = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[] if r in partial else [7] for r in req_ids],
            kv_connector_output=kvo,
        )
        for outputs in self.scheduler.update_from_output(out, result).values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.finished.append(o.request_id)
                    self.answers[o.request_id] = o.kv_transfer_params
        if kvo is not None:  # as vLLM's scheduler read them: after update_connector_output
            self.sent |= kvo.finished_sending or set()
            self.recved |= kvo.finished_recving or set()
        return out

    def blocks(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])


def run(
    engines: list[Engine],
    monkeypatch: pytest.MonkeyPatch,
    done: Callable[[], bool],
    timeout: float = 20.0,
) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        for e in engines:
            e.step(monkeypatch)
        time.sleep(0.002)


def fill(engine: Engine, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for kv in engine.kv.values():
        kv.copy_(torch.randn(kv.shape, generator=gen))


@pytest.mark.parametrize("mode", [Mode.PUSH, Mode.PULL])
def test_a_request_is_handed_off_between_two_real_schedulers(
    make_scheduler: Any,
    make_request: Any,
    make_worker_connector: Any,
    monkeypatch: pytest.MonkeyPatch,
    mode: Mode,
) -> None:
    port = free_port()
    prefill = Engine(make_scheduler, make_worker_connector, "kv_producer", {"port": port})
    decode = Engine(make_scheduler, make_worker_connector, "kv_consumer", {})
    fill(prefill, 1)
    prompt = list(range(3, 43))  # 40 tokens: 3 blocks of 16, the last partly used
    tid, peer = "kvp-e2e-1", f"127.0.0.1:{port}"
    p_params = TransferParams(tid, "prefill", mode, "decode").to_params()
    d_params = TransferParams(tid, "decode", mode, peer).to_params()
    # Both legs at once: the decode registers while the prefill computes.
    decode.scheduler.add_request(make_request("d1", prompt, 4, d_params))
    prefill.scheduler.add_request(make_request("p1", prompt, 1, p_params))
    out = decode.step(monkeypatch)
    assert decode.scheduler.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.num_scheduled_tokens == {}
    d_blocks = decode.blocks("d1")
    prefill.step(monkeypatch)  # computes the prompt, samples its one token
    assert "p1" in prefill.finished
    p_blocks = prefill.blocks("p1")  # held: request_finished asked for a delayed free
    assert len(p_blocks) == len(d_blocks) == 3
    run([prefill, decode], monkeypatch, lambda: "d1" in decode.recved and "p1" in prefill.sent)
    layer = next(iter(decode.kv))
    assert torch.equal(decode.kv[layer][d_blocks], prefill.kv[layer][p_blocks])
    for name in decode.kv:
        assert torch.equal(decode.kv[name][d_blocks], prefill.kv[name][p_blocks]), name
    # The decode runs; the prefill's blocks went back to its pool.
    run([prefill, decode], monkeypatch, lambda: "d1" in decode.finished)
    assert "p1" not in prefill.scheduler.requests
    assert not prefill.connector.has_pending_push_work()


def test_a_load_that_fails_is_reported_as_load_errors_and_recomputed(
    make_scheduler: Any,
    make_request: Any,
    make_worker_connector: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Registered with a prefill that is not there: the reservation fails at its
    deadline, its blocks come back as load errors, and vLLM (policy
    "recompute") computes the prompt itself: never parked."""
    decode = Engine(
        make_scheduler,
        make_worker_connector,
        "kv_consumer",
        FAST,
        kv_load_failure_policy="recompute",
    )
    params = TransferParams("kvp-lost", "decode", Mode.PUSH, f"127.0.0.1:{free_port()}").to_params()
    decode.scheduler.add_request(make_request("d2", list(range(3, 43)), 2, params))
    started = time.monotonic()
    scheduled: dict[str, int] = {}

    def computed() -> bool:
        scheduled.update(decode.step(monkeypatch).num_scheduled_tokens)
        return "d2" in scheduled

    run([], monkeypatch, computed)
    assert time.monotonic() - started >= FAST["ready_timeout"] - 0.1
    assert scheduled["d2"] > 1  # recomputing the prompt, not decoding on garbage
    run([decode], monkeypatch, lambda: "d2" in decode.finished)


def test_a_decode_request_aborted_while_loading_keeps_its_blocks_until_released(
    make_scheduler: Any,
    make_request: Any,
    make_worker_connector: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    prefill = Engine(make_scheduler, make_worker_connector, "kv_producer", {**FAST, "port": port})
    decode = Engine(make_scheduler, make_worker_connector, "kv_consumer", FAST)
    params = TransferParams("kvp-abort", "decode", Mode.PUSH, f"127.0.0.1:{port}").to_params()
    decode.scheduler.add_request(make_request("d3", list(range(3, 43)), 2, params))
    decode.step(monkeypatch)
    held = decode.blocks("d3")
    decode.scheduler.finish_requests("d3", RequestStatus.FINISHED_ABORTED)
    assert "d3" in decode.scheduler.requests  # kept: a write might still land
    free_before = decode.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    run([prefill, decode], monkeypatch, lambda: "d3" in decode.sent)
    run([decode], monkeypatch, lambda: "d3" not in decode.scheduler.requests)
    free_after = decode.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free_after >= free_before + len(held)


def test_a_decode_waiting_for_blocks_asks_the_prefill_to_keep_the_kv(
    make_scheduler: Any,
    make_request: Any,
    make_worker_connector: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decode has no free blocks for the request for 5 x the prefill's
    ``kv_hold_timeout``: it asks the prefill to keep the KV (``keep``), so
    once blocks free up the KV is pushed, not recomputed. Without the keep
    the prefill releases it at its hold and the load fails."""
    hold = {**FAST, "kv_hold_timeout": 0.4}
    port = free_port()
    prefill = Engine(make_scheduler, make_worker_connector, "kv_producer", {**hold, "port": port})
    decode = Engine(
        make_scheduler,
        make_worker_connector,
        "kv_consumer",
        hold,
        num_blocks=5,  # 4 usable (block 0 is vLLM's null block)
        kv_load_failure_policy="recompute",
    )
    fill(prefill, 3)
    prompt = list(range(3, 43))  # 3 blocks
    busy = list(range(100, 140))  # another prompt: no prefix cache hit for d5
    decode.scheduler.add_request(make_request("busy", busy, 8))  # local, takes 3 blocks
    decode.step(monkeypatch)
    tid, peer = "kvp-keep", f"127.0.0.1:{port}"
    p_params = TransferParams(tid, "prefill", Mode.PUSH, "decode").to_params()
    d_params = TransferParams(tid, "decode", Mode.PUSH, peer).to_params()
    decode.scheduler.add_request(make_request("d5", prompt, 2, d_params))
    prefill.scheduler.add_request(make_request("p5", prompt, 1, p_params))
    prefill.step(monkeypatch)
    p_blocks = prefill.blocks("p5")
    started = time.monotonic()
    while time.monotonic() - started < 5 * hold["kv_hold_timeout"]:
        prefill.step(monkeypatch)
        decode.scheduler.schedule()  # d5 asks, and waits: no blocks
        time.sleep(0.01)
    assert decode.scheduler.requests["d5"].status == RequestStatus.WAITING
    decode.scheduler.finish_requests("busy", RequestStatus.FINISHED_ABORTED)
    scheduled: dict[str, int] = {}

    def loaded() -> bool:
        scheduled.update(decode.step(monkeypatch).num_scheduled_tokens)
        prefill.step(monkeypatch)
        return "d5" in decode.recved

    run([], monkeypatch, loaded)
    d_blocks = decode.blocks("d5")
    for name in decode.kv:
        assert torch.equal(decode.kv[name][d_blocks], prefill.kv[name][p_blocks]), name
    run([prefill, decode], monkeypatch, lambda: "d5" in decode.finished and "p5" in prefill.sent)
    assert scheduled.get("d5", 1) == 1  # decoding from the pushed KV, nothing recomputed


def test_a_prefill_engine_keeps_stepping_while_a_push_is_pending(
    make_scheduler: Any,
    make_request: Any,
    make_worker_connector: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefill = Engine(make_scheduler, make_worker_connector, "kv_producer", {"port": free_port()})
    params = TransferParams("kvp-wait", "prefill", Mode.PUSH, "decode").to_params()
    prefill.scheduler.add_request(make_request("p4", list(range(3, 43)), 1, params))
    prefill.step(monkeypatch)
    assert "p4" in prefill.finished and "p4" in prefill.scheduler.requests  # blocks held
    assert prefill.connector.has_pending_push_work()
    assert prefill.scheduler.has_requests()  # vLLM's loop keeps stepping


def test_a_decoding_request_steps_without_waiting_while_other_requests_load(
    make_scheduler: Any,
    make_request: Any,
    make_worker_connector: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode engine decodes d0 while d1 and d2 wait for KV their prefill has
    not computed. Every step schedules d0, and no call vLLM makes into the
    connector waits for the runtime's thread (a round trip there costs a
    context switch, and, beside a busy neighbour on the same core, a whole
    time slice of the step every request is waiting on). Before: two per step
    (draining events, reading the block gauges), one more per reservation."""
    from anyio.from_thread import BlockingPortal

    port = free_port()
    prefill = Engine(make_scheduler, make_worker_connector, "kv_producer", {"port": port})
    decode = Engine(make_scheduler, make_worker_connector, "kv_consumer", {})
    peer = f"127.0.0.1:{port}"
    decode.scheduler.add_request(make_request("d0", list(range(3, 35)), 60))  # computed here
    decode.step(monkeypatch)
    legs = {r: TransferParams(f"kvp-{r}", "decode", Mode.PUSH, peer).to_params() for r in "12"}
    decode.scheduler.add_request(make_request("d1", list(range(3, 43)), 4, legs["1"]))
    decode.step(monkeypatch)  # d1 registers: the first leg to this prefill dials it (a hop)
    hops = 0
    real_call = BlockingPortal.call

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal hops
        hops += 1
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(BlockingPortal, "call", counted)
    for i in range(30):
        if i == 10:  # another leg to the same prefill, mid-way
            decode.scheduler.add_request(make_request("d2", list(range(5, 45)), 4, legs["2"]))
        out = decode.step(monkeypatch)
        assert out.num_scheduled_tokens.get("d0") == 1, out.num_scheduled_tokens
    monkeypatch.setattr(BlockingPortal, "call", real_call)
    for r in ("d1", "d2"):
        assert decode.scheduler.requests[r].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert hops == 0, f"{hops} round trips to the runtime's thread in 30 decode steps"
    assert not prefill.connector.has_pending_push_work()  # it computed nothing yet


def test_stats_and_prometheus_hooks(make_scheduler: Any) -> None:
    stats = KvpushConnector.build_kv_connector_stats({"posted": 2, "bytes": 10})
    stats = stats.aggregate(KvpushConnector.build_kv_connector_stats({"posted": 1, "notices": 3}))
    assert stats.reduce() == {
        "posted": 3, "failed": 0, "bytes": 10, "notices": 3, "staged": 0, "scattered": 0,
        "declined": 0, "decline_unsent": 0, "release_legs": 0, "refused_params": 0,
    }  # fmt: skip
    assert not stats.is_empty()
    # Refused legs by reason: summed, and in total.
    refused = KvpushConnector.build_kv_connector_stats({"r:untrusted": 2, "declined": 1})
    refused = refused.aggregate(
        KvpushConnector.build_kv_connector_stats({"r:untrusted": 1, "r:malformed": 1})
    )
    reduced = refused.reduce()
    assert (reduced["refused_params"], reduced["refused_untrusted"], reduced["declined"]) == (
        4,
        3,
        1,
    )
    # A gauge keeps its latest value; phase durations gather.
    gauges = KvpushConnector.build_kv_connector_stats({"g:reserved": 4, "h:load": [0.01]})
    gauges = gauges.aggregate(
        KvpushConnector.build_kv_connector_stats({"g:reserved": 1, "h:load": [0.03, 0.02]})
    )
    assert gauges.data == {"g:reserved": 1, "h:load": [0.01, 0.03, 0.02]}
    assert gauges.reduce()["reserved_blocks"] == 1 and gauges.reduce()["load_p50_ms"] == 20.0
    assert not KvpushConnector.build_kv_connector_stats({"g:held": 0}).is_empty()
    assert KvpushConnector.build_kv_connector_stats({"posted": 0}).is_empty()


def test_an_aborted_prefill_fails_the_decode_load_at_once(
    make_scheduler: Any,
    make_request: Any,
    make_worker_connector: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prefill leg is aborted (client gone, say) after the decode registered:
    the decode hears of it now, not at its 30 s deadline, and recomputes."""
    port = free_port()
    prefill = Engine(make_scheduler, make_worker_connector, "kv_producer", {"port": port})
    decode = Engine(
        make_scheduler, make_worker_connector, "kv_consumer", {}, kv_load_failure_policy="recompute"
    )
    tid, prompt = "kvp-gone", list(range(3, 43))
    d_params = TransferParams(tid, "decode", Mode.PUSH, f"127.0.0.1:{port}").to_params()
    p_params = TransferParams(tid, "prefill", Mode.PUSH, "decode").to_params()
    prefill.scheduler.add_request(make_request("p5", prompt, 1, p_params))
    decode.scheduler.add_request(make_request("d5", prompt, 2, d_params))
    decode.step(monkeypatch)
    # Let the registration reach the prefill before its request is aborted.
    time.sleep(0.3)
    prefill.scheduler.finish_requests("p5", RequestStatus.FINISHED_ABORTED)
    started = time.monotonic()
    run([prefill, decode], monkeypatch, lambda: "d5" in decode.recved, timeout=15)
    assert time.monotonic() - started < 10  # the deadline is 30 s
    assert "p5" not in prefill.scheduler.requests  # nothing held on the prefill


@pytest.mark.parametrize(("p_block", "d_block"), [(32, 64), (64, 32)])
def test_engines_with_different_block_sizes_refuse_the_handoff_naming_it(
    make_scheduler: Any,
    make_request: Any,
    make_worker_connector: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    p_block: int,
    d_block: int,
) -> None:
    """Issue 13 item 1: CPU tiles of 32 and 64 tokens were accepted and every K value
    landed in the wrong place. Now the handshake refuses them (``block_size``), nothing
    is copied, and the decode recomputes the prompt rather than decoding on garbage."""
    port = free_port()
    prefill = Engine(
        make_scheduler, make_worker_connector, "kv_producer", {**FAST, "port": port},
        block_size=p_block,
    )  # fmt: skip
    decode = Engine(
        make_scheduler, make_worker_connector, "kv_consumer", FAST,
        block_size=d_block, kv_load_failure_policy="recompute",
    )  # fmt: skip
    fill(prefill, 3)
    prompt = list(range(3, 3 + 100))
    tid, peer = f"kvp-bs-{p_block}-{d_block}", f"127.0.0.1:{port}"
    decode.scheduler.add_request(
        make_request("d1", prompt, 2, TransferParams(tid, "decode", Mode.PUSH, peer).to_params())
    )
    prefill.scheduler.add_request(
        make_request("p1", prompt, 1, TransferParams(tid, "prefill", Mode.PUSH, "d").to_params())
    )
    scheduled: dict[str, int] = {}

    def recomputed() -> bool:
        prefill.step(monkeypatch)
        scheduled.update(decode.step(monkeypatch).num_scheduled_tokens)
        return "d1" in scheduled

    with caplog.at_level("WARNING"):
        run([], monkeypatch, recomputed)
    assert scheduled["d1"] > 1  # recomputing the prompt, not decoding on garbage
    assert "block_size" in caplog.text, caplog.text
    assert not any(bool(kv.any()) for kv in decode.kv.values())  # nothing was written


def test_an_engine_outside_the_proven_envelope_is_refused_at_start_up(
    make_scheduler: Any,
) -> None:
    """Block size 16 runs in no real engine here (make e2e runs 32 and 64): the
    connector refuses it when vLLM builds it, naming the field and the way out."""
    with pytest.raises(Exception, match="refuses block_size = 16") as exc:
        make_scheduler("kv_consumer", CONNECTOR, MODULE, {}, block_size=16)
    assert '"allow_unproven": ["block_size"]' in str(exc.value)
    sched, _, _ = make_scheduler("kv_consumer", CONNECTOR, MODULE, {}, block_size=32)
    assert isinstance(sched.get_kv_connector(), KvpushConnector)


#: vllm-router 0.1.17's prefill leg in its default mode (``--kv-connector nixl``).
NIXL_PREFILL = NIXL_PREFILL_LEG
SECRET = "a-cluster-secret-of-32-bytes-abc"


def test_vllm_router_default_mode_pull_with_a_sealed_answer_and_an_injection_refused(
    make_scheduler: Any,
    make_request: Any,
    make_worker_connector: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The sequential flow behind vllm-router's default mode: the prefill gets
    NIXL's prefill leg, mints the transfer id and answers a sealed pull leg in
    its output's kv_transfer_params; the router copies it to the decode,
    which loads it. A client's own decode leg (what the router forwards when
    the prefill answers none) is refused: the decode computes it itself."""
    port = free_port()
    sealed = {"secret": SECRET, "allowed_peers": []}
    prefill = Engine(make_scheduler, make_worker_connector, "kv_producer", {"port": port, **sealed})
    decode = Engine(make_scheduler, make_worker_connector, "kv_consumer", sealed)
    fill(prefill, 3)
    prompt = list(range(5, 45))
    prefill.scheduler.add_request(make_request("cmpl-p1-0-abc", prompt, 1, NIXL_PREFILL))
    run([prefill], monkeypatch, lambda: "cmpl-p1-0-abc" in prefill.finished)
    answer = prefill.answers["cmpl-p1-0-abc"]
    assert set(answer) == {"kvpush"} and answer["kvpush"]["mode"] == "pull"
    assert answer["kvpush"]["peer"] == f"127.0.0.1:{port}" and answer["kvpush"]["seal"]
    p_blocks = prefill.blocks("cmpl-p1-0-abc")  # held for the pull
    decode.scheduler.add_request(make_request("cmpl-d1-0-def", prompt, 4, answer))
    decode.step(monkeypatch)
    assert decode.scheduler.requests["cmpl-d1-0-def"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d_blocks = decode.blocks("cmpl-d1-0-def")
    run([prefill, decode], monkeypatch, lambda: "cmpl-d1-0-def" in decode.recved)
    for name in decode.kv:
        assert torch.equal(decode.kv[name][d_blocks], prefill.kv[name][p_blocks]), name
    run([prefill, decode], monkeypatch, lambda: "cmpl-p1-0-abc" in prefill.sent)
    # The injection: the same leg pointed elsewhere (its seal no longer fits), and
    # an unsealed one; both refused, computed locally, nothing reserved.
    forged = {"kvpush": {**answer["kvpush"], "transfer_id": "kvp-stolen"}}
    unsealed = TransferParams("kvp-x", "decode", Mode.PUSH, f"127.0.0.1:{port}").to_params()
    for n, (req_id, params) in enumerate((("cmpl-i1-0-a", forged), ("cmpl-i2-0-b", unsealed))):
        other = list(range(100 + 50 * n, 140 + 50 * n))  # no prefix hit
        decode.scheduler.add_request(make_request(req_id, other, 2, params))
        out = decode.step(monkeypatch)
        assert out.num_scheduled_tokens.get(req_id) == len(other)  # at once: no remote KV
    run([decode], monkeypatch, lambda: {"cmpl-i1-0-a", "cmpl-i2-0-b"} <= set(decode.finished))
    # One error naming the fix; the second refusal of that kind only counted.
    refused = [r.getMessage() for r in caplog.records if "params refused" in r.getMessage()]
    assert len(refused) == 1 and "seal is missing or wrong" in refused[0], refused
    assert decode.counts().get("r:untrusted") == 2


def test_a_trusted_leg_the_decode_refuses_tells_the_prefill_to_release_at_once(
    make_scheduler: Any,
    make_request: Any,
    make_worker_connector: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 28, item 4: a decode that refuses a leg it trusts (here an
    ambiguous one: kvpush's object and NIXL's flags) computes the request
    itself and tells the prefill, which releases the KV within a round trip,
    not at its ``kv_hold_timeout`` (20 s here, 30 s by default)."""
    hold = {"kv_hold_timeout": 20.0}
    port = free_port()
    prefill = Engine(make_scheduler, make_worker_connector, "kv_producer", {**hold, "port": port})
    decode = Engine(make_scheduler, make_worker_connector, "kv_consumer", hold)
    peer = f"127.0.0.1:{port}"
    # A first handoff: the decode's handshake with the prefill is done.
    prompt = list(range(3, 43))
    d_first = TransferParams("kvp-first", "decode", Mode.PUSH, peer).to_params()
    decode.scheduler.add_request(make_request("d1", prompt, 2, d_first))
    p_first = TransferParams("kvp-first", "prefill", Mode.PUSH, "d").to_params()
    prefill.scheduler.add_request(make_request("p1", prompt, 1, p_first))
    run([prefill, decode], monkeypatch, lambda: "d1" in decode.recved and "p1" in prefill.sent)
    # The prefill computed the next request's KV and holds it for its decode.
    other = list(range(60, 100))
    p_params = TransferParams("kvp-refused", "prefill", Mode.PUSH, "d").to_params()
    prefill.scheduler.add_request(make_request("p2", other, 1, p_params))
    run([prefill], monkeypatch, lambda: "p2" in prefill.finished)
    assert prefill.connector.has_pending_push_work() and "p2" not in prefill.sent
    ambiguous = {
        **TransferParams("kvp-refused", "decode", Mode.PUSH, peer).to_params(),
        "do_remote_prefill": True,
    }
    decode.scheduler.add_request(make_request("d2", other, 2, ambiguous))
    out = decode.step(monkeypatch)
    assert out.num_scheduled_tokens.get("d2") == len(other)  # computed here, at once
    started = time.monotonic()
    run([prefill, decode], monkeypatch, lambda: "p2" in prefill.sent, timeout=5.0)
    assert time.monotonic() - started < 2.0
    stats = decode.counts()
    assert (stats.get("r:ambiguous"), stats.get("declined")) == (1, 1), stats
    run([prefill], monkeypatch, lambda: "p2" not in prefill.scheduler.requests)


def test_a_refusal_is_logged_once_naming_its_fix_then_counted(
    make_scheduler: Any,
    make_request: Any,
    make_worker_connector: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 28's setup: a decode with neither ``secret`` nor ``allowed_peers``
    gets unsealed legs. The first refusal of each class is an ERROR that names
    the fix; the others are counted (``vllm:kvpush_params_refused_total`` by
    reason) and logged at DEBUG, not an ERROR per request. The prefill an
    untrusted leg names is never dialed, not even to tell it."""
    import prometheus_client
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    caplog.set_level(logging.DEBUG, logger="kvpush.vllm")
    decode = Engine(make_scheduler, make_worker_connector, "kv_consumer", {"allowed_peers": []})
    peer = f"127.0.0.1:{free_port()}"
    ids = []
    for i in range(3):
        leg = TransferParams(f"kvp-u{i}", "decode", Mode.PUSH, peer).to_params()
        ids.append(f"u{i}")
        decode.scheduler.add_request(
            make_request(ids[-1], list(range(100 + 50 * i, 140 + 50 * i)), 1, leg)
        )
    bad = {"kvpush": {"transfer_id": "bad id!", "role": "decode", "mode": "push", "peer": peer}}
    for i in range(2):
        ids.append(f"m{i}")
        decode.scheduler.add_request(
            make_request(ids[-1], list(range(300 + 50 * i, 340 + 50 * i)), 1, bad)
        )
    run([decode], monkeypatch, lambda: set(ids) <= set(decode.finished))
    refused = [r for r in caplog.records if "kv_transfer_params refused" in r.getMessage()]
    errors = [r.getMessage() for r in refused if r.levelno == logging.ERROR]
    assert len(errors) == 2 and len(refused) == 5, [r.getMessage() for r in refused]
    (untrusted,) = [m for m in errors if "(untrusted)" in m]
    assert (
        "set `secret` on the router and both instances, or list the prefill in `allowed_peers`"
        in untrusted
    )
    (malformed,) = [m for m in errors if "(malformed)" in m]
    assert "transfer_id must be" in malformed and "docs/contract.md" in malformed
    stats = decode.counts()
    assert (stats.get("r:untrusted"), stats.get("r:malformed")) == (3, 2), stats
    assert "declined" not in stats and "decline_unsent" not in stats  # untrusted: never told
    rt = decode.connector._sched._running()[0].runtime  # type: ignore[union-attr]
    with rt.lock:
        assert rt.endpoint.peer(peer).state is PeerState.DISCONNECTED  # never dialed
    logger = PrometheusStatLogger(decode.config, engine_indexes=[0])
    logger.kv_connector_prom.observe({"r:untrusted": 3, "r:malformed": 2}, 0)
    text = prometheus_client.generate_latest().decode()
    counted = [
        line for line in text.splitlines() if line.startswith("vllm:kvpush_params_refused_total{")
    ]
    assert any('reason="untrusted"' in line and line.endswith(" 3.0") for line in counted), counted


def test_a_release_leg_frees_the_prefills_kv_at_once_and_is_a_plain_request(
    make_scheduler: Any,
    make_request: Any,
    make_worker_connector: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decode leg failed at the decode's API layer, so its engine never saw
    it: ``kvpush router`` sends the prefill a release (``release_params``) in a
    one-token request. The prefill releases the transfer's KV at once and
    serves the request as a plain one (it holds nothing for it). A release
    not sealed under the prefill's secret is refused and releases nothing."""
    sealed = {"secret": SECRET, "kv_hold_timeout": 20.0}
    prefill = Engine(
        make_scheduler, make_worker_connector, "kv_producer", {"port": free_port(), **sealed}
    )
    tid = "kvp-" + "7" * 32
    p_params = TransferParams(tid, "prefill", Mode.PUSH, "d").to_params()
    prefill.scheduler.add_request(make_request("p1", list(range(3, 43)), 1, p_params))
    run([prefill], monkeypatch, lambda: "p1" in prefill.finished)
    assert prefill.connector.has_pending_push_work()  # held for its decode
    # Forged: sealed under another cluster's secret. Served plain, nothing released.
    forged = release_params(tid, "push", b"another-cluster-secret-32-bytes!")
    prefill.scheduler.add_request(make_request("rel-forged", [5], 1, forged))
    run([prefill], monkeypatch, lambda: "rel-forged" in prefill.finished)
    for _ in range(5):
        prefill.step(monkeypatch)
    assert "p1" not in prefill.sent and "p1" in prefill.scheduler.requests
    # The router's release.
    release = release_params(tid, "push", SECRET.encode())
    prefill.scheduler.add_request(make_request("rel-1", [5], 1, release))
    started = time.monotonic()
    run([prefill], monkeypatch, lambda: "p1" in prefill.sent and "rel-1" in prefill.finished, 5.0)
    assert time.monotonic() - started < 2.0
    assert prefill.answers["rel-1"] is None and prefill.answers["rel-forged"] is None
    run([prefill], monkeypatch, lambda: "p1" not in prefill.scheduler.requests)
    assert not {"rel-1", "rel-forged"} & (set(prefill.scheduler.requests) | prefill.sent)
    assert not prefill.connector.has_pending_push_work()
    stats = prefill.counts()
    assert (stats.get("release_legs"), stats.get("r:release_unsealed")) == (1, 1), stats


def test_stats_reach_vllm_s_prometheus_registry(
    make_scheduler: Any,
    make_request: Any,
    make_worker_connector: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The block gauges and phase histograms go through vLLM's own path: the
    scheduler merges the connector's scheduler-side stats into
    SchedulerStats, and vLLM's Prometheus logger feeds build_prom_metrics."""
    import prometheus_client
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    port = free_port()
    prefill = Engine(make_scheduler, make_worker_connector, "kv_producer", {"port": port})
    decode = Engine(make_scheduler, make_worker_connector, "kv_consumer", {})
    merged: list[dict[str, Any]] = []
    for engine in (prefill, decode):
        real = engine.scheduler.make_stats

        def capture(*a: Any, _real: Any = real, **kw: Any) -> Any:
            st = _real(*a, **kw)
            if st is not None and st.kv_connector_stats:
                merged.append(st.kv_connector_stats)
            return st

        monkeypatch.setattr(engine.scheduler, "make_stats", capture)
    prompt = list(range(3, 43))
    tid, peer = "kvp-stats-1", f"127.0.0.1:{port}"
    decode.scheduler.add_request(
        make_request("d1", prompt, 2, TransferParams(tid, "decode", Mode.PUSH, peer).to_params())
    )
    decode.step(monkeypatch)
    assert {"g:reserved": 3, "g:suspect": 0} in merged, merged  # as the core counts them
    prefill.scheduler.add_request(
        make_request("p1", prompt, 1, TransferParams(tid, "prefill", Mode.PUSH, "d").to_params())
    )
    run([prefill, decode], monkeypatch, lambda: "d1" in decode.recved and "p1" in prefill.sent)
    time.sleep(0.3)  # past the gauges' read period: the next steps report them at 0
    run([prefill, decode], monkeypatch, lambda: "d1" in decode.finished, timeout=20)
    for _ in range(3):
        prefill.step(monkeypatch)
        decode.step(monkeypatch)
    logger = PrometheusStatLogger(decode.config, engine_indexes=[0])
    for payload in merged:
        logger.kv_connector_prom.observe(payload, 0)
    text = prometheus_client.generate_latest().decode()
    assert 'vllm:kvpush_blocks{engine="0"' in text and 'kind="reserved"' in text
    assert "vllm:kvpush_phase_seconds_bucket" in text and 'phase="load"' in text
    assert "vllm:kvpush_phase_seconds_count" in text
    assert any("h:load" in p for p in merged), merged  # the decode's load, timed
    assert any("h:source_held" in p for p in merged), merged  # the prefill's hold


def test_a_chunked_prefill_pushes_each_chunk_while_the_next_is_computed(
    make_scheduler: Any,
    make_request: Any,
    make_worker_connector: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Progressive push through vLLM's real scheduler: 16 tokens a step, so a
    40-token prompt takes three steps; the first two chunks' blocks are written
    as increments once the worker's wait_for_save echoed them, the last commits.
    The decode's KV equals the prefill's."""
    port = free_port()
    prefill = Engine(
        make_scheduler, make_worker_connector, "kv_producer",
        {"port": port, "progressive": True}, max_num_batched_tokens=16,
    )  # fmt: skip
    decode = Engine(make_scheduler, make_worker_connector, "kv_consumer", {})
    fill(prefill, 3)
    prompt = list(range(3, 43))
    tid, peer = "kvp-progressive-1", f"127.0.0.1:{port}"
    p_params = TransferParams(tid, "prefill", Mode.PUSH, "decode").to_params()
    d_params = TransferParams(tid, "decode", Mode.PUSH, peer).to_params()
    decode.scheduler.add_request(make_request("d1", prompt, 4, d_params))
    prefill.scheduler.add_request(make_request("p1", prompt, 1, p_params))
    decode.step(monkeypatch)
    steps = 0
    while "p1" not in prefill.finished:
        prefill.step(monkeypatch)
        decode.step(monkeypatch)
        steps += 1
        time.sleep(0.05)  # the registration and the increments' writes move meanwhile
        assert steps < 10
    assert steps == 3
    dp = prefill.worker._worker._dataplane
    assert dp is not None
    early = dp.posted  # written while the prompt was still being computed
    p_blocks = prefill.blocks("p1")
    run([prefill, decode], monkeypatch, lambda: "d1" in decode.recved and "p1" in prefill.sent)
    d_blocks = decode.blocks("d1")
    for name in decode.kv:
        assert torch.equal(decode.kv[name][d_blocks], prefill.kv[name][p_blocks]), name
    assert early >= 1 and dp.posted >= early + 1  # increment(s), then the commit


def test_progressive_push_is_accepted_where_its_ordering_rule_holds(make_scheduler: Any) -> None:
    """On the CPU a forward has written its KV at wait_for_save; on CUDA writes wait
    for the event recorded there (tests/test_fence.py); nowhere else is it proven."""
    from kvpush_vllm import _proven

    _proven.check_proven("cpu", {"progressive": "cpu"}, (), "kv_producer")
    _proven.check_proven("cuda", {"progressive": "cuda"}, (), "kv_producer")
    with pytest.raises(Exception, match="refuses progressive = xpu"):
        _proven.check_proven("cpu", {"progressive": "xpu"}, (), "kv_producer")


def test_a_gpu_engine_inside_the_proven_envelope_starts_and_one_outside_is_refused(
    make_scheduler: Any,
) -> None:
    """A CUDA engine in bf16 (vLLM's config with the platform and dtype a GPU engine
    has; its KV views from vLLM's allocator in LBHNC, on CPU memory) starts with no
    allow_unproven: the layout reads as packed-HND. Outside the envelope the connector
    refuses naming the field (docs/vllm.md, "Supported and refused")."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvpush_vllm import _proven

    _, cfg, kv_cfg = make_scheduler("kv_producer", CONNECTOR, MODULE, {}, block_size=32)
    cfg.device_config.device_type = "cuda"
    cfg.model_config.dtype = torch.bfloat16
    worker = KvpushConnector(cfg, KVConnectorRole.WORKER, kv_cfg)
    try:
        caches = allocate_kv_cache(kv_cfg, torch.device("cpu"), KVCacheLayout.LBHNC)
        worker.register_kv_caches(caches)
        assert worker._worker is not None and worker._worker._dataplane is not None
        layout = worker._worker._dataplane.ranks[0].layout
        assert _proven.kv_layout_kind(layout) == "packed-HND"
        assert worker._facts.values()["kv_dtype"] == "bfloat16"
    finally:
        worker.shutdown()
    assert KvpushConnector.get_required_kvcache_layout(cfg) == "HND"
    cfg.cache_config.cache_dtype = "fp8_per_token_head"
    with pytest.raises(ConfigError, match="refuses kv_dtype = fp8_per_token_head"):
        KvpushConnector(cfg, KVConnectorRole.WORKER, kv_cfg)
    cfg.cache_config.cache_dtype = "auto"
    cfg.device_config.device_type = "xpu"
    with pytest.raises(ConfigError, match="refuses platform = xpu"):
        KvpushConnector(cfg, KVConnectorRole.WORKER, kv_cfg)
