"""vLLM's per-layer KV tensors as a kvpush :class:`~kvpush.protocol.KVLayout`.

``register_kv_caches`` hands the worker one tensor per attention layer. Their
*logical* shape depends on the attention backend and the vLLM version, e.g.
``(2, num_blocks, block_size, num_kv_heads, head_size)`` (K and V split,
FlashAttention and CPU) or ``(num_blocks, 2, ...)`` (interleaved), and their
*physical* order on the stride order the backend asked for (NHD or HND inside
a block). vLLM 0.33's CPU backend (layout ``LBHNC``) hands 4-D tensors,
``(num_blocks, num_kv_heads, block_size, 2 * head_size)``. Its kernels view
every (block, head) tile as ``block_size`` K rows then ``block_size`` V rows
of ``head_size`` values, but only V is stored token by token: with the
``vec`` / ``vec16`` ISAs the K half is *channel-major* (value ``c`` of token
``t`` at ``c * block_size + t``), and the AMX ISA packs both halves again
(``tests/e2e/test_cpu_tile.py`` checks this against the kernel). So a tile is
described as what it is byte for byte, one region of kind ``"KV"`` in HND
order with ``2 * block_size`` rows per block (*virtual tokens*:
:func:`token_scale` is 2; prefix lengths given to the core are scaled alike,
so both sides count the same units), and it is exact **only between tiles of
the same size and format**: whole tiles, or whole heads of tiles, are copied.
A block-size ratio would cut a K half at token boundaries it does not have
(issue 13 item 1: every greedy output wrong); the connector refuses it at
handshake (``_proven.handshake_fingerprint``: ``block_size`` and
``cpu_attn_isa`` must be equal on both sides).

Rather than trusting a name, :func:`layout_from_tensors` reads each tensor's
sizes and strides: it finds the K/V, block, token, head and channel
dimensions by size (the known ``block_size``, ``num_kv_heads`` and
``head_size``), checks that each block's cells are contiguous in NHD or HND
order, and describes the K and V regions (base address, block stride, cell
order, memory type and device) for the planner. A layout it cannot prove is
refused with the shape and strides in the message, never guessed.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvpush.protocol import ConfigError, HeadOrder, KVLayout, MemoryType, Region

__all__ = ("TensorLike", "layer_index", "layout_from_tensors", "token_scale")


class TensorLike(Protocol):
    """What is read of a ``torch.Tensor`` (duck-typed: no torch import)."""

    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def device(self) -> Any: ...

    def stride(self) -> Sequence[int]: ...

    def data_ptr(self) -> int: ...

    def element_size(self) -> int: ...


def layer_index(name: str) -> int:
    """The layer number in a vLLM layer name (``model.layers.3.self_attn.attn`` -> 3)."""
    numbers = [int(p) for p in name.split(".") if p.isdigit()]
    if not numbers:
        raise ConfigError(f"cannot find a layer number in KV cache name {name!r}")
    return numbers[0]


def layout_from_tensors(
    kv_caches: Mapping[str, TensorLike],
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    head_start: int = 0,
) -> KVLayout:
    """The layout of one rank's KV tensors (``num_kv_heads``: this rank's heads)."""
    if not kv_caches:
        raise ConfigError("no KV cache tensors to register")
    regions: list[Region] = []
    for name in sorted(kv_caches, key=layer_index):
        regions += _regions(name, kv_caches[name], block_size, num_kv_heads, head_size, head_start)
    return KVLayout(tuple(regions))


def token_scale(layout: KVLayout, block_size: int) -> int:
    """Rows per real token in ``layout``'s blocks (2 for K-then-V tiles, else 1)."""
    return layout.regions[0].tokens_per_block // block_size


def _place(t: TensorLike) -> tuple[MemoryType, int]:
    device = t.device
    if getattr(device, "type", "cpu") == "cpu":
        return MemoryType.DRAM, 0
    return MemoryType.VRAM, int(getattr(device, "index", 0) or 0)


def _tiled(
    name: str, t: TensorLike, block_size: int, heads: int, head_size: int, head_start: int
) -> list[Region] | None:
    """The 4-D K-then-V tile layout (see the module docs), or None if ``t`` is not it."""
    shape, strides, elem = list(t.shape), list(t.stride()), t.element_size()
    if shape[1:] != [heads, block_size, 2 * head_size]:
        return None
    row = 2 * head_size  # one real token's K and V values
    if strides[3] != 1 or strides[2] != row or strides[1] != block_size * row:
        return None
    memory, device = _place(t)
    return [
        Region(
            layer=layer_index(name),
            kind="KV",
            base=t.data_ptr(),
            num_blocks=shape[0],
            block_len=heads * block_size * row * elem,
            block_stride=strides[0] * elem,
            tokens_per_block=2 * block_size,
            num_heads=heads,
            head_bytes=head_size * elem,
            head_start=head_start,
            order=HeadOrder.HND,
            memory=memory,
            device=device,
        )
    ]


def _regions(
    name: str, t: TensorLike, block_size: int, heads: int, head_size: int, head_start: int
) -> list[Region]:
    shape, strides, elem = list(t.shape), list(t.stride()), t.element_size()
    where = f"KV cache {name!r} (shape {tuple(shape)}, strides {tuple(strides)})"
    if len(shape) == 4:
        tiled = _tiled(name, t, block_size, heads, head_size, head_start)
        if tiled is None:
            raise ConfigError(
                f"{where}: a 4-D KV cache must be (blocks, {heads} heads, {block_size} tokens, "
                f"2 x {head_size}) with K rows then V rows per (block, head), contiguous"
            )
        return tiled
    if len(shape) != 5:
        raise ConfigError(f"{where}: expected 5 dimensions (K/V, blocks, tokens, heads, channels)")
    found = None
    # Assign roles to dimensions by size; the first assignment whose strides
    # describe contiguous NHD or HND cells wins (equal sizes are tried both ways).
    for kv, blk, tok, hd, ch in itertools.permutations(range(5)):
        if (shape[kv], shape[tok], shape[hd], shape[ch]) != (2, block_size, heads, head_size):
            continue
        if strides[ch] != 1:
            continue
        cell = head_size
        if strides[hd] == cell and strides[tok] == heads * cell:
            order = HeadOrder.NHD
        elif strides[tok] == cell and strides[hd] == block_size * cell:
            order = HeadOrder.HND
        else:
            continue
        found = (kv, blk, order)
        break
    if found is None:
        raise ConfigError(
            f"{where}: no dimension order gives contiguous blocks of {block_size} tokens x "
            f"{heads} heads x {head_size} channels (NHD or HND)"
        )
    kv, blk, order = found
    num_blocks = shape[blk]
    memory, dev_id = _place(t)
    block_len = block_size * heads * head_size * elem
    base = t.data_ptr()
    return [
        Region(
            layer=layer_index(name),
            kind=kind,
            base=base + i * strides[kv] * elem,
            num_blocks=num_blocks,
            block_len=block_len,
            block_stride=strides[blk] * elem,
            tokens_per_block=block_size,
            num_heads=heads,
            head_bytes=head_size * elem,
            head_start=head_start,
            order=order,
            memory=memory,
            device=dev_id,
        )
        for i, kind in enumerate(("K", "V"))
    ]
