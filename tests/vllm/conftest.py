"""Harness for testing KV connectors against the real vLLM 0.33.0 API on a CPU-only host.

vLLM (the API only: scheduler, connector base/factory, config, Request) is installed by
``scripts/install-vllm-api.sh``; ``make test`` runs it, so these tests run in CI. Where vLLM
is not installed at all the whole directory is skipped, with the reason shown; an installed
but broken vLLM fails the collection instead of hiding behind a skip.

Fixtures:
- ``tiny_model_dir`` (session): a random-weight OPT model generated offline (tiny_model.py).
- ``make_scheduler(kv_role, connector_name, module_path, extra_config, num_blocks=64,
  block_size=16, **options)`` -> ``(scheduler, vllm_config, kv_cache_config)``: vLLM's real
  ``Scheduler``, which creates the scheduler-side connector through ``KVConnectorFactory``.
- ``make_request(request_id, prompt_token_ids, max_tokens=16, kv_transfer_params=None,
  block_size=16)`` -> ``vllm.v1.request.Request``, built the way vLLM's engine core builds it.
- ``make_worker_connector(vllm_config, kv_cache_config)`` -> ``(connector, kv_caches)``: the
  worker-side connector, with ``register_kv_caches`` called on real CPU KV tensors allocated
  by vLLM's own allocator (one int8 backing buffer, one ``[B, H, N, C]`` view per layer).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Before anything imports vLLM (its platform detection and env module read these once).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# tests/ is on sys.path (rootdir conftest), so this directory is itself a namespace
# package "vllm" to find_spec: only a spec with a file (origin) is vLLM.
_VLLM = importlib.util.find_spec("vllm")
if _VLLM is None or _VLLM.origin is None:  # pragma: no cover - depends on the environment
    pytest.skip(
        "vLLM is not installed; install the CPU API with "
        "scripts/install-vllm-api.sh PYTHON (make test does)",
        allow_module_level=True,
    )

# vLLM is installed, so from here on a failing import is an error, not a skip. torch and
# vLLM warn at import time (e.g. torch.jit.script_method's DeprecationWarning); under the
# project's filterwarnings=error those would be collection errors, so imports are quiet.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    from tiny_model import EOS_ID, attention_layer_names, make_tiny_model
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.utils import allocate_kv_cache

    # Also what the test modules import, so that their collection imports nothing new.
    importlib.import_module("vllm.v1.attention.backends.cpu_attn")
    importlib.import_module("vllm.v1.worker.kv_connector_model_runner_mixin")

#: The only layout vLLM 0.33's CPU attention backend accepts
#: (CPUAttentionBackend.supported_kv_cache_layouts, v1/attention/backends/cpu_attn.py:82).
CPU_KV_CACHE_LAYOUT = "LBHNC"

SchedulerFactory = Callable[..., tuple[Scheduler, VllmConfig, KVCacheConfig]]
RequestFactory = Callable[..., Request]
WorkerFactory = Callable[
    [VllmConfig, KVCacheConfig], tuple[KVConnectorBase_V1, dict[str, torch.Tensor]]
]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm-tiny-model"))


@pytest.fixture(scope="session", autouse=True)
def _none_hash() -> None:
    # What EngineCore does once per process before hashing any request's blocks.
    init_none_hash(sha256)


@pytest.fixture
def make_scheduler(tiny_model_dir: Path) -> Iterator[SchedulerFactory]:
    """Factory for vLLM's real ``Scheduler`` with the given connector on the tiny model.

    ``make_scheduler(kv_role, connector_name, module_path, extra_config, num_blocks=64,
    block_size=16, *, max_num_seqs=16, max_num_batched_tokens=None, max_model_len=256,
    enable_prefix_caching=True, kv_load_failure_policy="fail", engine_id=None,
    kv_cache_layout="LBHNC", log_stats=True)``

    ``module_path`` None selects a connector from vLLM's own registry by name. The
    KVCacheConfig has one full-attention group over the model's attention layers, with
    its ``kv_cache_tensors`` planned by vLLM (so a worker can allocate real tensors).
    Every scheduler it made is shut down (its connector's runtime closed) at teardown.
    """
    made: list[Scheduler] = []

    def factory(
        kv_role: str,
        connector_name: str,
        module_path: str | None,
        extra_config: dict[str, Any] | None = None,
        num_blocks: int = 64,
        block_size: int = 16,
        *,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int | None = None,
        max_model_len: int = 256,
        enable_prefix_caching: bool = True,
        kv_load_failure_policy: str = "fail",
        engine_id: str | None = None,
        kv_cache_layout: str = CPU_KV_CACHE_LAYOUT,
        log_stats: bool = True,
    ) -> tuple[Scheduler, VllmConfig, KVCacheConfig]:
        model_config = ModelConfig(
            model=str(tiny_model_dir),
            tokenizer=str(tiny_model_dir),
            dtype="float32",
            max_model_len=max_model_len,
            seed=0,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or max_model_len,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        )
        cache_config = CacheConfig(
            block_size=block_size, enable_prefix_caching=enable_prefix_caching
        )
        # The engine core resolves the layout before any connector is built; mirror that.
        cache_config.kv_cache_layout = kv_cache_layout
        kv_transfer_config = KVTransferConfig(
            kv_connector=connector_name,
            kv_connector_module_path=module_path,
            kv_role=kv_role,  # type: ignore[arg-type]
            kv_connector_extra_config=dict(extra_config or {}),
            kv_load_failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
            engine_id=engine_id,
        )
        vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=kv_transfer_config,
        )
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
            head_size=model_config.get_head_size(),
            dtype=model_config.dtype,
        )
        layers = attention_layer_names(model_config.get_num_layers(vllm_config.parallel_config))
        groups = [KVCacheGroupSpec(layers, spec)]
        kv_cache_config = get_kv_cache_config_from_groups(
            vllm_config, groups, available_memory=num_blocks * len(layers) * spec.page_size_bytes
        )
        assert kv_cache_config.num_blocks == num_blocks
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            log_stats=log_stats,
        )
        made.append(scheduler)
        return scheduler, vllm_config, kv_cache_config

    yield factory
    for scheduler in made:
        scheduler.shutdown()


def build_request(
    request_id: str,
    prompt_token_ids: list[int],
    max_tokens: int = 16,
    kv_transfer_params: dict[str, Any] | None = None,
    block_size: int = 16,
) -> Request:
    """A ``Request`` as EngineCore builds one from an ``EngineCoreRequest``.

    In vLLM 0.33 ``kv_transfer_params`` travel in ``SamplingParams.extra_args``
    (the OpenAI server puts them there); ``Request.__init__`` copies them to
    ``request.kv_transfer_params`` (v1/request.py:119-122).
    """
    extra_args = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    params = SamplingParams(max_tokens=max_tokens, extra_args=extra_args)
    # The input processor fills the EOS id from the model's generation config.
    params.update_from_generation_config({}, EOS_ID)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


@pytest.fixture
def make_request() -> RequestFactory:
    """``make_request(request_id, prompt_token_ids, max_tokens=16, kv_transfer_params=None,
    block_size=16)`` -> a real ``vllm.v1.request.Request``."""
    return build_request


@pytest.fixture
def make_worker_connector() -> Iterator[WorkerFactory]:
    """Worker-side connector over real CPU KV tensors; shut down at teardown.

    The tensors come from vLLM's own ``allocate_kv_cache`` (what the model runner calls
    before ``register_kv_caches``), in the layout the engine resolved (LBHNC on CPU): one
    ``[B, H, N, C]`` view per layer, for the tiny model at block_size 16 in float32
    ``(num_blocks, 2 kv heads, 16 tokens, 64 + 64)``, each block one contiguous 16 KiB page,
    all layers views of one int8 buffer (layer-major). The CPU attention kernel reads each
    (block, head) tile as K (its first 16*64 values) then V (the next 16*64).
    """
    made: list[KVConnectorBase_V1] = []

    def factory(
        vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> tuple[KVConnectorBase_V1, dict[str, torch.Tensor]]:
        connector = KVConnectorFactory.create_connector(
            vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
        assert isinstance(connector, KVConnectorBase_V1)
        made.append(connector)
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        connector.register_kv_caches(kv_caches)
        return connector, kv_caches

    yield factory
    for connector in made:
        connector.shutdown()
