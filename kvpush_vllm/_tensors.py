"""vLLM's per-layer KV tensors as a kvpush :class:`~kvpush.protocol.KVLayout`.

:func:`layout_from_tensors` reads each tensor from its sizes and strides,
never a backend's name, and describes it byte for byte, or refuses it with a
:class:`ConfigError` naming ``kv_layout`` (the families: docs/layouts.md, "The
layout description"; docs/vllm.md, "Supported and refused"). The platform,
not the shape, tells the CPU tile (``2 * block_size`` rows a block:
:func:`token_scale`) from the packed ``LBHNC`` view.
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
    tokens_per_block: int,
    num_kv_heads: int,
    head_size: int,
    head_start: int = 0,
    platform: str,
) -> KVLayout:
    """The layout of one rank's KV tensors (``num_kv_heads``: this rank's heads;
    ``platform``: vLLM's ``device_type``, ``"cpu"`` for the CPU backend's tiles)."""
    if not kv_caches:
        raise ConfigError("no KV cache tensors to register")
    regions: list[Region] = []
    for name in sorted(kv_caches, key=layer_index):
        cell = _Cell(name, kv_caches[name], tokens_per_block, num_kv_heads, head_size, head_start)
        regions += _regions(cell, platform)
    return KVLayout(tuple(regions))


def token_scale(layout: KVLayout, tokens_per_block: int) -> int:
    """Rows per real token in ``layout``'s blocks (2 for the CPU tile, else 1)."""
    return layout.regions[0].tokens_per_block // tokens_per_block


class _Cell:
    """One tensor and what its blocks should hold, for the readers below."""

    def __init__(
        self,
        name: str,
        t: TensorLike,
        tokens_per_block: int,
        heads: int,
        head_size: int,
        start: int,
    ) -> None:
        self.name, self.t = name, t
        self.tokens_per_block, self.heads, self.head_size, self.head_start = (
            tokens_per_block, heads, head_size, start,
        )  # fmt: skip
        self.shape, self.strides, self.elem = list(t.shape), list(t.stride()), t.element_size()
        self.where = f"KV cache {name!r} (shape {tuple(self.shape)}, strides {tuple(self.strides)})"

    def region(self, kind: str, base: int, num_blocks: int, stride: int, **geometry: Any) -> Region:
        memory, device = MemoryType.DRAM, 0
        dev = self.t.device
        if getattr(dev, "type", "cpu") != "cpu":
            memory, device = MemoryType.VRAM, int(getattr(dev, "index", 0) or 0)
        return Region(
            layer=layer_index(self.name),
            kind=kind,
            base=base,
            num_blocks=num_blocks,
            block_stride=stride * self.elem,
            num_heads=self.heads,
            head_start=self.head_start,
            memory=memory,
            device=device,
            **geometry,
        )

    def refuse(self, why: str) -> ConfigError:
        return ConfigError(f"kvpush refuses kv_layout: {self.where}: {why}")


def _regions(c: _Cell, platform: str) -> list[Region]:
    if len(c.shape) == 4 and platform == "cpu":
        return _tile(c)
    if len(c.shape) == 4:
        return _packed(c)
    if len(c.shape) == 5:
        return _split(c)
    if len(c.shape) == 3:
        raise c.refuse("an MLA latent cache (use_mla): not proven, refused")
    raise c.refuse("expected 4 dimensions (packed or CPU tile) or 5 (split K/V)")


def _tile(c: _Cell) -> list[Region]:
    """The CPU backend's K-then-V tile (module docs)."""
    heads, bs, hs = c.heads, c.tokens_per_block, c.head_size
    row = 2 * hs
    if c.shape[1:] != [heads, bs, row] or c.strides[1:] != [bs * row, row, 1]:
        raise c.refuse(
            f"the CPU backend's cache must be (blocks, {heads} heads, {bs} tokens, "
            f"2 x {hs}), K rows then V rows per (block, head), contiguous"
        )
    return [
        c.region(
            "tile", c.t.data_ptr(), c.shape[0], c.strides[0],
            block_len=heads * bs * row * c.elem, tokens_per_block=2 * bs,
            head_bytes=hs * c.elem, order=HeadOrder.HND,
        )
    ]  # fmt: skip


def _packed(c: _Cell) -> list[Region]:
    """vLLM 0.33's ``(blocks, heads, tokens, [k | v])`` view (module docs)."""
    (blocks, heads, tokens, row), (s_blk, s_head, s_tok, s_ch) = c.shape, c.strides
    if heads == 1 and row == c.head_size:
        raise c.refuse("an MLA latent cache (use_mla): not proven, refused")
    if heads != c.heads or row != 2 * c.head_size or s_ch != 1:
        raise c.refuse(
            f"a packed cache must be (blocks, {c.heads} heads, tokens, 2 x {c.head_size}) "
            "with K and V contiguous in the last dimension"
        )
    if s_tok == row and s_head == tokens * row:
        order = HeadOrder.HND  # LBHNC, BLHNC
    elif s_head == row and s_tok == heads * row:
        order = HeadOrder.NHD  # LBNHC, BLNHC
    else:
        raise c.refuse(
            "a block's heads and tokens are not one contiguous run (layouts LHBNC and "
            "BHLNC put heads outside the block): use LBHNC or LBNHC (VLLM_KV_CACHE_LAYOUT)"
        )
    dense = tokens * heads * row
    ratio, stride = 1, s_blk
    if tokens != c.tokens_per_block:
        if c.tokens_per_block % tokens or blocks % (c.tokens_per_block // tokens):
            raise c.refuse(
                f"{tokens}-token blocks do not divide the block size {c.tokens_per_block}"
            )
        ratio = c.tokens_per_block // tokens
        if order is HeadOrder.HND or s_blk != dense:
            raise c.refuse(
                f"kernel blocks of {tokens} tokens in {c.tokens_per_block}-token blocks are only "
                "one block when token-major and dense (LBNHC); use LBNHC or a block size "
                "the attention kernel takes whole"
            )
        stride = ratio * s_blk
    return [
        c.region(
            "KV", c.t.data_ptr(), blocks // ratio, stride,
            block_len=dense * ratio * c.elem, tokens_per_block=c.tokens_per_block,
            head_bytes=row * c.elem, order=order,
        )
    ]  # fmt: skip


def _split(c: _Cell) -> list[Region]:
    """``(2, blocks, ...)`` or ``(blocks, 2, ...)`` with NHD or HND blocks."""
    shape, strides = c.shape, c.strides
    bs, heads, hs = c.tokens_per_block, c.heads, c.head_size
    # Assign roles to dimensions by size; the first assignment whose strides
    # describe contiguous NHD or HND cells wins (equal sizes are tried both ways).
    for kv, blk, tok, hd, ch in itertools.permutations(range(5)):
        if (shape[kv], shape[tok], shape[hd], shape[ch]) != (2, bs, heads, hs) or strides[ch] != 1:
            continue
        if strides[hd] == hs and strides[tok] == heads * hs:
            order = HeadOrder.NHD
        elif strides[tok] == hs and strides[hd] == bs * hs:
            order = HeadOrder.HND
        else:
            continue
        return [
            c.region(
                kind, c.t.data_ptr() + i * strides[kv] * c.elem, shape[blk], strides[blk],
                block_len=bs * heads * hs * c.elem, tokens_per_block=bs,
                head_bytes=hs * c.elem, order=order,
            )
            for i, kind in enumerate(("K", "V"))
        ]  # fmt: skip
    raise c.refuse(
        f"no dimension order gives contiguous blocks of {bs} tokens x {heads} heads x "
        f"{hs} channels (NHD or HND)"
    )
