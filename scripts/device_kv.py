"""vLLM 0.33's packed GPU KV cache, allocated the way vLLM allocates it, without vLLM.

The GPU host of the device check has no vLLM, so this is a small copy of what
vLLM 0.33 does (``vllm/v1/worker/utils.py: allocate_kv_cache``,
``vllm/v1/kv_cache_interface.py: create_kv_cache_views`` and
``compute_layout_strides``): ONE ``torch.zeros(int8)`` buffer for every layer,
each layer an ``as_strided`` view of the 5-D byte grid ``[L, B, H, N, C]``
(layers, blocks, KV heads, tokens, ``2 * head_size * elem`` bytes) in a
physical order (``vllm/v1/kv_cache_layout.py``): ``LBHNC`` ("HND", head-major
blocks) or ``LBNHC`` ("NHD", token-major blocks), then ``.view(dtype)``. The
layer view's logical shape is ``(num_blocks, num_kv_heads, block_size, 2 *
head_size)``: K and V packed in the last dimension, each token row ``[k | v]``.
``tests/test_device_kv.py`` checks that the views equal vLLM's own, stride for
stride, where vLLM is installed.

K and V are read and written as FlashAttention reads them
(``kv_cache.transpose(1, 2).split(head_size, dim=-1)``): K of (block ``b``,
head ``h``, token ``n``) is ``view[b, h, n, :head_size]``, V is
``view[b, h, n, head_size:]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = (
    "LAYOUTS",
    "CacheShape",
    "allocate_packed",
    "layer_name",
    "read_tokens",
    "slots_zero_elsewhere",
    "write_tokens",
)

#: vLLM's ``KVCacheLayout`` stride orders over the logical ``[L, B, H, N, C]``
#: axes (physical order, outermost first), for the layer-compact layouts.
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
}


@dataclass(frozen=True, slots=True)
class CacheShape:
    """One rank's KV cache: ``heads`` is this rank's KV heads."""

    layers: int
    num_blocks: int
    heads: int
    block_size: int
    head_size: int


def layer_name(layer: int) -> str:
    """The attention layer's name in vLLM's Llama (the ``kv_caches`` key)."""
    return f"model.layers.{layer}.self_attn.attn"


def byte_sizes(shape: CacheShape, elem: int) -> tuple[int, ...]:
    """The ``[L, B, H, N, C]`` grid's sizes, ``C`` in bytes (``[k | v]``)."""
    s = shape
    return (s.layers, s.num_blocks, s.heads, s.block_size, 2 * s.head_size * elem)


def byte_strides(shape: CacheShape, elem: int, layout: str) -> tuple[int, ...]:
    """Byte strides of the ``[L, B, H, N, C]`` grid in ``layout``, as vLLM's
    ``compute_layout_strides`` gives them for unpadded pages."""
    sizes = byte_sizes(shape, elem)
    strides = [0] * 5
    current = 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim] = current
        current *= sizes[dim]
    return tuple(strides)


def allocate_packed(shape: CacheShape, dtype: Any, layout: str, device: Any) -> dict[str, Any]:
    """Layer name -> its ``(blocks, heads, tokens, 2 * head_size)`` view of one
    zeroed int8 buffer (module docs)."""
    elem = torch.empty((), dtype=dtype).element_size()
    sizes = byte_sizes(shape, elem)
    buf = torch.zeros(math.prod(sizes), dtype=torch.int8, device=device)
    grid = torch.as_strided(buf, sizes, byte_strides(shape, elem, layout))
    return {layer_name(i): grid[i].view(dtype) for i in range(shape.layers)}


def _kv(cache: Any, head_size: int) -> tuple[Any, Any]:
    """K and V as FlashAttention reads them: ``(blocks, tokens, heads, head_size)``."""
    k, v = cache.transpose(1, 2).split(head_size, dim=-1)
    return k, v


def _slots(blocks: list[int], block_size: int, start: int, end: int, device: Any) -> Any:
    tokens = torch.arange(start, end, device=device)
    ids = torch.tensor(blocks, dtype=torch.long, device=device)
    return ids[tokens // block_size], tokens % block_size


def write_tokens(
    cache: Any, blocks: list[int], block_size: int, start: int, k: Any, v: Any
) -> None:
    """Write tokens ``start ..`` (``k``, ``v``: ``(tokens, heads, head_size)``)
    into their slots of ``blocks``, as the attention backend's cache write does."""
    head_size = k.shape[-1]
    kc, vc = _kv(cache, head_size)
    b, n = _slots(blocks, block_size, start, start + k.shape[0], cache.device)
    kc[b, n] = k.to(cache.dtype)
    vc[b, n] = v.to(cache.dtype)


def read_tokens(
    cache: Any, blocks: list[int], block_size: int, tokens: int, head_size: int
) -> tuple[Any, Any]:
    """K and V of tokens ``0 .. tokens`` from ``blocks``: ``(tokens, heads, head_size)`` each."""
    kc, vc = _kv(cache, head_size)
    b, n = _slots(blocks, block_size, 0, tokens, cache.device)
    return kc[b, n], vc[b, n]


def slots_zero_elsewhere(
    caches: dict[str, Any], blocks: list[int], block_size: int, tokens: int, head_size: int
) -> bool:
    """Whether every byte of the buffer outside tokens ``0 .. tokens`` of
    ``blocks`` is zero (nothing was written anywhere else)."""
    first = next(iter(caches.values()))
    whole = torch.empty(0, dtype=torch.int8, device=first.device)
    whole.set_(first.untyped_storage())
    copy = whole.clone()
    scratch = torch.empty(0, dtype=torch.int8, device=first.device)
    scratch.set_(copy.untyped_storage())
    for cache in caches.values():
        view = torch.as_strided(
            scratch.view(cache.dtype), cache.shape, cache.stride(), cache.storage_offset()
        )
        kc, vc = _kv(view, head_size)
        b, n = _slots(blocks, block_size, 0, tokens, first.device)
        kc[b, n] = 0
        vc[b, n] = 0
    return not bool(copy.any())
