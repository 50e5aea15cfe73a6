"""The device check's KV cache allocator (scripts/device_kv.py) against vLLM 0.33's own.

The GPU host has no vLLM, so the device check allocates vLLM's packed GPU cache
itself. Here, where vLLM is installed (``make test`` installs its CPU API), the
views must equal vLLM's, as its model runner gets them: planned by
``get_kv_cache_config_from_groups`` in the resolved layout, allocated by
``allocate_kv_cache`` (one int8 buffer; ``create_kv_cache_views``: one
``as_strided`` view per layer, then ``.view(dtype)``): shape, strides, offset
into the buffer, dtype and buffer size, for several layouts, dtypes, block
sizes, head counts and head sizes. And kvpush reads both alike.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM reads its environment
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# tests/vllm is a namespace package "vllm" to find_spec: only a spec with a file is vLLM.
_VLLM = importlib.util.find_spec("vllm")
if _VLLM is None or _VLLM.origin is None:  # pragma: no cover - depends on the environment
    pytest.skip(
        "vLLM is not installed; install the CPU API with scripts/install-vllm-api.sh "
        "PYTHON (make test does)",
        allow_module_level=True,
    )

with warnings.catch_warnings():  # vLLM and torch warn at import (filterwarnings=error)
    warnings.simplefilter("ignore")
    import torch
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

from test_device_kv import load  # noqa: E402

from kvpush_vllm._tensors import layout_from_tensors  # noqa: E402

kv = load("device_kv")

#: (layout, dtype, block size, KV heads of the rank, head size, layers, blocks)
CONFIGS = [
    ("LBHNC", "bfloat16", 16, 2, 128, 2, 7),
    ("LBNHC", "bfloat16", 16, 2, 128, 2, 7),
    ("LBHNC", "float16", 32, 4, 64, 3, 5),
    ("LBNHC", "float16", 32, 4, 64, 3, 5),
    ("LBHNC", "float32", 64, 1, 64, 2, 4),
    ("LBNHC", "float32", 128, 8, 128, 4, 3),
    ("LBHNC", "bfloat16", 128, 2, 256, 2, 3),
    ("LBNHC", "bfloat16", 16, 4, 64, 4, 9),
]


def vllm_views(layout: str, dtype: Any, shape: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """vLLM's own allocation, as its GPU model runner makes it (on CPU tensors)."""
    cfg = VllmConfig(cache_config=CacheConfig(block_size=shape.block_size),
                     device_config=DeviceConfig("cpu"))  # fmt: skip
    cfg.cache_config.kv_cache_layout = layout
    spec = FullAttentionSpec(
        block_size=shape.block_size,
        num_kv_heads=shape.heads,
        head_size=shape.head_size,
        dtype=dtype,
    )
    memory = shape.num_blocks * len(names) * spec.page_size_bytes
    plan = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(names, spec)], memory)
    assert plan.num_blocks == shape.num_blocks
    return allocate_kv_cache(plan, torch.device("cpu"), KVCacheLayout[layout])


@pytest.mark.parametrize(
    ("layout", "dtype", "block_size", "heads", "head_size", "layers", "blocks"), CONFIGS
)
def test_the_allocator_is_vllms(
    layout: str, dtype: str, block_size: int, heads: int, head_size: int, layers: int, blocks: int
) -> None:
    shape = kv.CacheShape(layers, blocks, heads, block_size, head_size)
    torch_dtype = getattr(torch, dtype)
    names = [kv.layer_name(i) for i in range(layers)]
    theirs = vllm_views(layout, torch_dtype, shape, names)
    mine = kv.allocate_packed(shape, torch_dtype, layout, "cpu")
    assert list(mine) == names and sorted(theirs) == sorted(names)
    buf_mine = mine[names[0]].untyped_storage()
    buf_theirs = theirs[names[0]].untyped_storage()
    assert buf_mine.nbytes() == buf_theirs.nbytes()
    for name in names:
        a, b = mine[name], theirs[name]
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (
            b.shape, b.stride(), b.storage_offset(), b.dtype,
        ), name  # fmt: skip
        assert a.untyped_storage().data_ptr() == buf_mine.data_ptr()  # one buffer
        assert b.untyped_storage().data_ptr() == buf_theirs.data_ptr()
    # kvpush describes both alike (bases relative to each buffer).
    assert described(mine) == described(theirs)


def described(views: dict[str, torch.Tensor]) -> list[tuple[Any, ...]]:
    """kvpush's regions for ``views``, the bases relative to their buffer."""
    first = next(iter(views.values()))
    start = first.untyped_storage().data_ptr()
    heads, block_size, row = first.shape[1:]
    regions = layout_from_tensors(
        views, tokens_per_block=block_size, num_kv_heads=heads, head_size=row // 2, platform="cuda"
    ).regions
    return [
        (r.layer, r.kind, r.base - start, r.num_blocks, r.block_stride, r.block_len, r.order)
        for r in regions
    ]
