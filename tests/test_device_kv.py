"""scripts/device_kv.py, the device check's copy of vLLM 0.33's packed KV cache
allocation: K and V land where FlashAttention reads them, nothing else is
written, and kvpush reads the views as vLLM's own (the stride-for-stride
comparison with vLLM's allocator is tests/test_device_vllm_alloc.py)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from kvpush.protocol import HeadOrder  # noqa: E402
from kvpush_vllm._tensors import layout_from_tensors  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load(name: str) -> types.ModuleType:
    """A module of scripts/ (not a package: loaded by path)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


kv = load("device_kv")


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_k_and_v_land_where_flash_attention_reads_them(layout: str, dtype: torch.dtype) -> None:
    shape = kv.CacheShape(layers=2, num_blocks=6, heads=2, block_size=16, head_size=64)
    caches = kv.allocate_packed(shape, dtype, layout, "cpu")
    assert list(caches) == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    first = caches["model.layers.0.self_attn.attn"]
    assert first.shape == (6, 2, 16, 128) and first.dtype == dtype
    storage = {c.untyped_storage().data_ptr() for c in caches.values()}
    assert len(storage) == 1  # one buffer for every layer
    blocks, tokens = [4, 1, 3], 40
    k = torch.randn(tokens, 2, 64).to(dtype)
    v = torch.randn(tokens, 2, 64).to(dtype)
    cache = caches["model.layers.1.self_attn.attn"]
    kv.write_tokens(cache, blocks, 16, 0, k[:20], v[:20])
    kv.write_tokens(cache, blocks, 16, 20, k[20:], v[20:])  # a second chunk
    for t in (0, 15, 16, 39):
        b, n = blocks[t // 16], t % 16
        for h in range(2):
            assert torch.equal(cache[b, h, n, :64], k[t, h])  # K: view[b, h, n, :head_size]
            assert torch.equal(cache[b, h, n, 64:], v[t, h])  # V: view[b, h, n, head_size:]
    got_k, got_v = kv.read_tokens(cache, blocks, 16, tokens, 64)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert kv.slots_zero_elsewhere(caches, blocks, 16, tokens, 64)
    cache[0, 0, 0, 0] = 1  # a stray value outside the request
    assert not kv.slots_zero_elsewhere(caches, blocks, 16, tokens, 64)


@pytest.mark.parametrize(("layout", "order"), [("LBHNC", HeadOrder.HND), ("LBNHC", HeadOrder.NHD)])
def test_kvpush_reads_the_views_as_packed_rows(layout: str, order: HeadOrder) -> None:
    """platform "cuda": one region of kind "KV" per layer, a cell one token's [k | v]."""
    shape = kv.CacheShape(layers=3, num_blocks=5, heads=2, block_size=32, head_size=128)
    caches = kv.allocate_packed(shape, torch.bfloat16, layout, "cpu")
    layout_ = layout_from_tensors(
        caches, tokens_per_block=32, num_kv_heads=2, head_size=128, head_start=2, platform="cuda"
    )
    page = 2 * 32 * 2 * 128 * 2
    base = caches["model.layers.0.self_attn.attn"].data_ptr()
    for i, region in enumerate(layout_.regions):
        assert (region.layer, region.kind, region.order) == (i, "KV", order)
        assert region.base == base + i * 5 * page
        assert (region.block_len, region.head_bytes, region.head_start) == (page, 512, 2)
