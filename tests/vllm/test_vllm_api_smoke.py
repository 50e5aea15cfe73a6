"""Proves the harness in conftest.py against vLLM 0.33.0's real scheduler and connector API.

The connector here is a minimal out-of-tree ``KVConnectorBase_V1`` subclass that records
every call; vLLM's factory loads it by ``kv_connector_module_path`` (this module). It is
not the project's connector: it only pins down what vLLM calls, when, and with what.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from tiny_model import HEAD_DIM, NUM_HEADS, attention_layer_names
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

CONNECTOR = "RecordingConnector"
MODULE = __name__  # what kv_connector_module_path names: this very module
BLOCK = 16


@dataclass
class RecordingMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step (``SchedulerOutput.kv_connector_metadata``)."""

    loads: dict[str, list[int]] = field(default_factory=dict)  # req id -> block ids to fill
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)


class RecordingConnector(KVConnectorBase_V1):
    """Records (method, details) for every call. ``kv_connector_extra_config``:
    ``matched_tokens`` (external hit for requests carrying ``do_remote_prefill``),
    ``load_async`` (report that hit as an async load), ``delay_free`` (keep the
    blocks of requests carrying ``do_remote_decode`` until the worker reports them sent).
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.matched_tokens = int(extra.get("matched_tokens", 0))
        self.load_async = bool(extra.get("load_async", False))
        self.delay_free = bool(extra.get("delay_free", False))
        self.calls: list[tuple[str, dict[str, Any]]] = []
        # Scheduler side.
        self._loads: dict[str, list[int]] = {}
        self._held: set[str] = set()
        # Worker side.
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._recved: set[str] = set()
        self._sent: set[str] = set()

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def of(self, name: str) -> list[dict[str, Any]]:
        return [details for n, details in self.calls if n == name]

    # ---- scheduler side -------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        self.calls.append(
            ("on_new_request", {"req": request.request_id, "params": request.kv_transfer_params})
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        hit = self.matched_tokens if params.get("do_remote_prefill") else 0
        self.calls.append(
            (
                "get_num_new_matched_tokens",
                {
                    "req": request.request_id,
                    "num_computed_tokens": num_computed_tokens,
                    "status": request.status,
                    "num_preemptions": request.num_preemptions,
                },
            )
        )
        return hit, bool(hit and self.load_async)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = blocks.get_block_ids()
        self.calls.append(
            (
                "update_state_after_alloc",
                {
                    "req": request.request_id,
                    "blocks_type": type(blocks),
                    "block_ids": block_ids,
                    "num_external_tokens": num_external_tokens,
                    "num_computed_tokens": request.num_computed_tokens,
                },
            )
        )
        if num_external_tokens > 0:
            # Blocks covering the external tokens are the request's first ones.
            n = -(-num_external_tokens // BLOCK)
            self._loads[request.request_id] = block_ids[0][:n]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RecordingMetadata(
            loads=self._loads,
            finished_req_ids=set(scheduler_output.finished_req_ids),
            preempted_req_ids=set(scheduler_output.preempted_req_ids or ()),
        )
        self._loads = {}
        self.calls.append(
            (
                "build_connector_meta",
                {
                    "scheduled": dict(scheduler_output.num_scheduled_tokens),
                    "new": [r.req_id for r in scheduler_output.scheduled_new_reqs],
                    "resumed": set(scheduler_output.scheduled_cached_reqs.resumed_req_ids),
                    "finished": set(scheduler_output.finished_req_ids),
                    "preempted": set(scheduler_output.preempted_req_ids or ()),
                    "loads": dict(meta.loads),
                },
            )
        )
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.calls.append(
            (
                "update_connector_output",
                {
                    "sending": set(connector_output.finished_sending or ()),
                    "recving": set(connector_output.finished_recving or ()),
                },
            )
        )
        self._held -= set(connector_output.finished_sending or ())

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        delay = self.delay_free and bool(params.get("do_remote_decode"))
        self.calls.append(
            (
                "request_finished",
                {"req": request.request_id, "block_ids": block_ids, "status": request.status},
            )
        )
        if delay:
            self._held.add(request.request_id)
        return delay, {"echo": params, "block_ids": list(block_ids)}

    def has_pending_push_work(self) -> bool:
        return bool(self._held)

    # ---- worker side -----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.calls.append(("register_kv_caches", {"layers": list(kv_caches)}))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RecordingMetadata)
        self.calls.append(("start_load_kv", {"loads": dict(meta.loads)}))
        for req_id, block_ids in meta.loads.items():
            for layer, kv in enumerate(self.kv_caches.values()):
                for b in block_ids:
                    kv[b].fill_(float(layer * 1000 + b))  # kv[b]: one whole block of a layer
            self._recved.add(req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait_for_layer_load", {"layer": layer_name}))

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.calls.append(("save_kv_layer", {"layer": layer_name}))

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save", {}))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._sent |= set(finished_req_ids)
        sent, recved = self._sent, self._recved
        self._sent, self._recved = set(), set()
        self.calls.append(
            (
                "get_finished",
                {"finished_req_ids": set(finished_req_ids), "sent": sent, "recved": recved},
            )
        )
        return sent or None, recved or None


def _sampled(scheduler_output: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """What a model runner returns after a step: one token per request that finished
    its prefill (no KV connector output)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token] for _ in req_ids],
    )


def _outputs(engine_outputs: dict[int, Any]) -> dict[str, EngineCoreOutput]:
    return {o.request_id: o for eco in engine_outputs.values() for o in eco.outputs}


# ------------------------------------------------------------------------------------------


def test_factory_loads_out_of_tree_connector_by_module_path(make_scheduler) -> None:
    scheduler, vllm_config, kv_cache_config = make_scheduler("kv_both", CONNECTOR, MODULE, {})
    connector = scheduler.get_kv_connector()
    assert type(connector) is RecordingConnector
    assert connector.role is KVConnectorRole.SCHEDULER
    # Without SupportsHMA vLLM turns the hybrid KV cache manager off itself.
    assert vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is True
    assert vllm_config.kv_transfer_config.engine_id  # a uuid4 unless given
    group = kv_cache_config.kv_cache_groups[0]
    assert group.layer_names == attention_layer_names()
    assert kv_cache_config.num_blocks == 64


def test_factory_also_builds_vllms_registered_example_connector(make_scheduler, tmp_path) -> None:
    scheduler, _, _ = make_scheduler(
        "kv_both", "ExampleConnector", None, {"shared_storage_path": str(tmp_path)}
    )
    assert type(scheduler.get_kv_connector()).__name__ == "ExampleConnector"


def test_schedule_and_finish_call_the_scheduler_side_hooks(make_scheduler, make_request) -> None:
    scheduler, _, _ = make_scheduler("kv_both", CONNECTOR, MODULE, {})
    connector = scheduler.get_kv_connector()
    params = {"transfer_id": "t-1"}
    request = make_request("r1", list(range(3, 43)), kv_transfer_params=params)  # 40 tokens
    assert request.kv_transfer_params == params  # from SamplingParams.extra_args

    scheduler.add_request(request)
    assert connector.names() == ["on_new_request"]
    assert connector.of("on_new_request")[0]["params"] == params

    out = scheduler.schedule()
    assert connector.names()[1:] == [
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
    ]
    (matched,) = connector.of("get_num_new_matched_tokens")
    assert matched["num_computed_tokens"] == 0 and matched["status"] == RequestStatus.WAITING
    (alloc,) = connector.of("update_state_after_alloc")
    assert alloc["blocks_type"] is KVCacheBlocks
    assert alloc["num_external_tokens"] == 0
    ((block_ids,)) = alloc["block_ids"]  # one KV cache group
    assert len(block_ids) == 3  # ceil(40 / 16): the blocks of this step's tokens
    assert isinstance(out.kv_connector_metadata, RecordingMetadata)
    assert out.num_scheduled_tokens == {"r1": 40}

    aborted = scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in aborted] == ["r1"]
    (finished,) = connector.of("request_finished")
    assert finished["status"] == RequestStatus.FINISHED_ABORTED
    assert finished["block_ids"] == block_ids  # list[int] of the group, computed tokens only
    assert "r1" not in scheduler.requests  # not delayed: blocks freed at once
    # The id reaches the worker side in the next step's finished_req_ids.
    scheduler.schedule()
    assert connector.of("build_connector_meta")[-1]["finished"] == {"r1"}


def test_kv_transfer_params_return_in_engine_core_output_and_delay_free(
    make_scheduler, make_request
) -> None:
    scheduler, _, _ = make_scheduler("kv_producer", CONNECTOR, MODULE, {"delay_free": True})
    connector = scheduler.get_kv_connector()
    params = {"do_remote_decode": True, "transfer_id": "t-2"}
    scheduler.add_request(make_request("p1", list(range(3, 43)), 1, params))

    out = scheduler.schedule()
    engine_outputs = scheduler.update_from_output(out, _sampled(out))
    (result,) = _outputs(engine_outputs).values()
    assert result.finish_reason == FinishReason.LENGTH
    assert result.kv_transfer_params == {"echo": params, "block_ids": [1, 2, 3]}
    (finished,) = connector.of("request_finished")
    assert finished["status"] == RequestStatus.FINISHED_LENGTH_CAPPED

    # delay_free=True: the blocks stay allocated, the request stays known, and
    # has_pending_push_work keeps the engine loop stepping.
    assert "p1" in scheduler.requests
    assert scheduler.has_requests() and not scheduler.has_unfinished_requests()
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    # The worker reports the send done: KVConnectorOutput.finished_sending frees them.
    out = scheduler.schedule()
    assert connector.of("build_connector_meta")[-1]["finished"] == {"p1"}
    report = ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput(finished_sending={"p1"}))
    scheduler.update_from_output(out, report)
    assert connector.of("update_connector_output")[-1]["sending"] == {"p1"}
    assert "p1" not in scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before + 3
    assert not scheduler.has_requests()


def test_async_load_round_trip_through_the_worker_side(
    make_scheduler, make_request, make_worker_connector, monkeypatch
) -> None:
    scheduler, vllm_config, kv_cache_config = make_scheduler(
        "kv_consumer", CONNECTOR, MODULE, {"matched_tokens": 32, "load_async": True}
    )
    sched_conn = scheduler.get_kv_connector()
    worker, kv_caches = make_worker_connector(vllm_config, kv_cache_config)
    assert type(worker) is RecordingConnector and worker.role is KVConnectorRole.WORKER
    assert worker.names() == ["register_kv_caches"]

    params = {"do_remote_prefill": True, "transfer_id": "t-3"}
    scheduler.add_request(make_request("d1", list(range(3, 43)), 4, params))

    # Step 1: the connector claims 32 external tokens, async. Blocks are allocated for
    # those tokens only, the request parks in WAITING_FOR_REMOTE_KVS, nothing is computed.
    out1 = scheduler.schedule()
    (alloc,) = sched_conn.of("update_state_after_alloc")
    assert alloc["num_external_tokens"] == 32
    assert alloc["block_ids"] == ([1, 2],)
    assert scheduler.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out1.num_scheduled_tokens == {}
    assert out1.kv_connector_metadata.loads == {"d1": [1, 2]}

    # The worker side runs vLLM's own per-step lifecycle (the code a model runner uses for
    # a step with no forward pass): bind -> start_load_kv -> wait_for_save ->
    # get_finished (via get_transfer_results) -> get_block_ids_with_load_errors -> clear.
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", worker)
    runner_out = KVConnectorModelRunnerMixin.kv_connector_no_forward(out1, vllm_config)
    assert worker.names()[1:] == ["start_load_kv", "wait_for_save", "get_finished"]
    assert not worker.has_connector_metadata()  # cleared after the step
    assert runner_out.kv_connector_output.finished_recving == {"d1"}
    first_layer = kv_caches[attention_layer_names()[0]]
    assert torch.all(first_layer[1] == 1.0) and torch.all(first_layer[3] == 0.0)

    # Step 2: the scheduler learns the load finished; the request is admitted with 32
    # computed tokens, update_state_after_alloc runs a second time (0 external tokens),
    # now with all of the request's blocks (the loaded ones first).
    scheduler.update_from_output(out1, runner_out)
    assert sched_conn.of("update_connector_output")[-1]["recving"] == {"d1"}
    out2 = scheduler.schedule()
    assert out2.num_scheduled_tokens == {"d1": 8}
    second = sched_conn.of("update_state_after_alloc")[-1]
    assert second["num_external_tokens"] == 0 and second["num_computed_tokens"] == 32
    assert second["block_ids"] == ([1, 2, 3],)
    # get_num_new_matched_tokens is not asked again once tokens are computed.
    assert len(sched_conn.of("get_num_new_matched_tokens")) == 1


def test_preemption_is_silent_to_the_connector_and_readmission_asks_again(
    make_scheduler, make_request
) -> None:
    # 7 usable blocks (block 0 is the null block): two 48-token prompts take 3 each; the
    # first decode step needs a 4th block for each, so the newer request is preempted.
    scheduler, _, _ = make_scheduler("kv_both", CONNECTOR, MODULE, {}, num_blocks=8)
    connector = scheduler.get_kv_connector()
    scheduler.add_request(make_request("a", list(range(3, 51)), 8))
    scheduler.add_request(make_request("b", list(range(100, 148)), 8))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 48, "b": 48}
    assert [d["block_ids"] for d in connector.of("update_state_after_alloc")] == [
        ([1, 2, 3],),
        ([4, 5, 6],),
    ]
    scheduler.update_from_output(out, _sampled(out))

    before = len(connector.calls)
    out = scheduler.schedule()
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert scheduler.requests["b"].status == RequestStatus.PREEMPTED
    assert scheduler.requests["b"].num_preemptions == 1
    # vLLM 0.33 has no preemption hook: the step's only connector call is
    # build_connector_meta, whose SchedulerOutput lists the preempted id.
    assert connector.names()[before:] == ["build_connector_meta"]
    assert connector.of("build_connector_meta")[-1]["preempted"] == {"b"}
    scheduler.update_from_output(out, _sampled(out))

    # While "b" waits for blocks, every step asks get_num_new_matched_tokens again and
    # then fails to allocate: no update_state_after_alloc follows (hence "no side effects").
    before = len(connector.calls)
    out = scheduler.schedule()
    assert connector.names()[before:] == ["get_num_new_matched_tokens", "build_connector_meta"]
    blocked = connector.of("get_num_new_matched_tokens")[-1]
    # Its freed blocks are still in the prefix cache: a 48-token local hit.
    assert blocked == {
        "req": "b",
        "num_computed_tokens": 48,
        "status": RequestStatus.PREEMPTED,
        "num_preemptions": 1,
    }
    scheduler.update_from_output(out, _sampled(out))

    # Finishing "a" frees its blocks; "b" is re-admitted: asked again, then
    # update_state_after_alloc with all its blocks (the cached ones reused), and it
    # shows up as resumed (scheduled_cached_reqs.resumed_req_ids), not as new.
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    before = len(connector.calls)
    out = scheduler.schedule()
    assert connector.names()[before:] == [
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
    ]
    readmit = connector.of("update_state_after_alloc")[-1]
    assert readmit["req"] == "b" and readmit["num_external_tokens"] == 0
    assert readmit["block_ids"] == ([4, 5, 6, 7],)
    meta = connector.of("build_connector_meta")[-1]
    assert meta["resumed"] == {"b"} and meta["new"] == [] and meta["finished"] == {"a"}
    assert out.num_scheduled_tokens == {"b": 1}


def test_worker_kv_caches_have_the_cpu_backend_shape(make_scheduler, make_worker_connector) -> None:
    _, vllm_config, kv_cache_config = make_scheduler("kv_both", CONNECTOR, MODULE, {})
    _, kv_caches = make_worker_connector(vllm_config, kv_cache_config)
    assert list(kv_caches) == attention_layer_names()

    # The CPU backend accepts one layout only, and a connector cannot change it: a
    # different get_required_kvcache_layout is dropped with a warning at resolution.
    assert CPUAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)
    assert RecordingConnector.get_required_kvcache_layout(vllm_config) is None
    assert vllm_config.cache_config.get_resolved_kv_cache_layout() is KVCacheLayout.LBHNC

    # Per layer: [B, H, N, C] = (num_blocks, num_kv_heads, block_size, head_size + head_size_v)
    page = NUM_HEADS * BLOCK * 2 * HEAD_DIM  # elements per block of one layer
    storages = set()
    for kv in kv_caches.values():
        assert kv.shape == (64, NUM_HEADS, BLOCK, 2 * HEAD_DIM)
        assert kv.dtype == torch.float32 and kv.device.type == "cpu"
        assert kv.is_contiguous() and kv.stride(0) == page
        storages.add(kv.untyped_storage().data_ptr())
    assert len(storages) == 1  # every layer is a view of one int8 buffer

    # How CPUAttentionBackendImpl reads a block (cpu_attn.py:423-425): per (block, head),
    # the first block_size*head_size values are K and the next block_size*head_size are V.
    kv = next(iter(kv_caches.values()))
    key_cache, value_cache = kv.view(64, NUM_HEADS, 2 * BLOCK, HEAD_DIM).chunk(2, dim=2)
    assert key_cache.shape == value_cache.shape == (64, NUM_HEADS, BLOCK, HEAD_DIM)
    kv[5].fill_(1.0)
    assert torch.all(key_cache[5] == 1.0) and torch.all(value_cache[4] == 0.0)


@pytest.mark.parametrize("name", ["build_kv_connector_stats", "build_prom_metrics"])
def test_optional_classmethod_hooks_exist(name: str) -> None:
    assert isinstance(KVConnectorBase_V1.__dict__[name], classmethod)
    assert RecordingConnector.build_kv_connector_stats() is None
    assert EMPTY_MODEL_RUNNER_OUTPUT.kv_connector_output is None
