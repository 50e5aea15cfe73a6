"""The deterministic KV the prefill writes and the decode checks.

Every ``head_bytes`` cell (one token of one head in one block of one region)
gets an 8-byte *stamp* mixed from (run seed, transfer id, layer, K/V, block
index within the request, global head, token within the block), repeated over
the cell and XORed with a byte ramp (``head_bytes`` must be a multiple of 8).
A cell that lands in the wrong block, head, token, layer or K/V slot, or
shifted inside its cell, no longer matches. Global heads make a TP reshard
(2 -> 1, 1 -> 2) part of what is checked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from kvpush.protocol import HeadOrder, KVLayout, Region

__all__ = ("corrupt_blocks", "fill", "request_seed")

U8 = NDArray[np.uint8]
U64 = NDArray[np.uint64]
_MASK = (1 << 64) - 1
_K1, _K2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_BLOCK, _HEAD, _TOKEN = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9


def request_seed(seed: int, transfer_id: str) -> int:
    """The 64-bit seed of one request's pattern."""
    digest = hashlib.blake2b(f"{seed}\0{transfer_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix_int(x: int) -> int:
    x &= _MASK
    x = ((x ^ (x >> 30)) * _K1) & _MASK
    x = ((x ^ (x >> 27)) * _K2) & _MASK
    return x ^ (x >> 31)


def _mix(x: U64) -> U64:
    """splitmix64's finalizer, elementwise (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(_K1)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(_K2)
    out: U64 = x ^ (x >> np.uint64(31))
    return out


def _expected(region: Region, nblocks: int, seed: int, start: int = 0) -> U64:
    """The cells of blocks start .. start+nblocks-1 of a request in ``region``, as
    ``(nblocks, heads, tokens, head_bytes // 8)`` little-endian words."""
    if region.head_bytes % 8:
        raise ValueError("the demo's pattern needs head_bytes to be a multiple of 8")
    kind = sum(region.kind.encode())
    base = _mix_int(seed ^ _mix_int(region.layer * 1_000_003 + kind))
    i = np.arange(start, start + nblocks, dtype=np.uint64)[:, None, None]
    h = np.arange(region.head_start, region.head_start + region.num_heads, dtype=np.uint64)
    t = np.arange(region.tokens_per_block, dtype=np.uint64)[None, None, :]
    x = np.uint64(base) + i * np.uint64(_BLOCK) + h[None, :, None] * np.uint64(_HEAD)
    stamps = _mix(x + t * np.uint64(_TOKEN))
    ramp = (np.arange(region.head_bytes, dtype=np.uint32) * 131 % 256).astype(np.uint8)
    out: U64 = stamps[..., None] ^ ramp.view(np.uint64)
    return out


def _view(memory: U8, region: Region) -> U8:
    """``region`` as ``(blocks, heads, tokens, head_bytes)`` cells (HND order)."""
    if region.order is not HeadOrder.HND:
        raise ValueError("the demo lays KV out in HND order")
    n, stride = region.num_blocks, region.stride
    rows = memory[region.base : region.base + n * stride].reshape(n, stride)
    cells: U8 = rows[:, : region.block_len].reshape(
        n, region.num_heads, region.tokens_per_block, region.head_bytes
    )
    return cells


def fill(memory: U8, layout: KVLayout, blocks: Sequence[int], seed: int, start: int = 0) -> None:
    """Write the request's KV: its ``start + i``-th block is ``blocks[i]``."""
    ids = np.asarray(blocks, dtype=np.intp)
    for region in layout.regions:
        _view(memory, region)[ids] = _expected(region, len(ids), seed, start).view(np.uint8)


def corrupt_blocks(memory: U8, layout: KVLayout, blocks: Sequence[int], seed: int) -> set[int]:
    """Indices (within the request) of the blocks whose KV on this rank differs
    from the pattern in any region."""
    ids = np.asarray(blocks, dtype=np.intp)
    bad: set[int] = set()
    for region in layout.regions:
        got = _view(memory, region)[ids].view(np.uint64)  # a copy: contiguous
        diff = (got != _expected(region, len(ids), seed)).reshape(len(ids), -1).any(axis=1)
        bad.update(int(i) for i in np.flatnonzero(diff))
    return bad
