"""Staged transfers: gather into one span, move it, scatter on arrival.

Why and how (the slot image, ownership, the cost model, the copiers):
docs/layouts.md, "Staged transfers". This module holds the pure parts: the
image (:func:`staged_pieces`: where each byte of a consumer rank's
registration sits in its slot, computed alone by each side from the
consumer's layout, the block counts and the route), the :class:`CostModel`
and the host :class:`Copier`.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import as_strided
from numpy.typing import NDArray

from kvpush.protocol import KVLayout, Role

from ._plan import TransferPlanner, chunk_span, merge_runs, rows

__all__ = (
    "Copier",
    "CostModel",
    "HostCopier",
    "Staged",
    "stage_bytes",
    "staged_pieces",
)

I64 = NDArray[np.int64]
U64 = NDArray[np.uint64]


class Copier(Protocol):
    """Copies local memory: row ``i`` of ``src`` to row ``i`` of ``dst``
    (``(N, 3)`` uint64 ``(address, length, device)`` rows, equal lengths),
    returning once every byte is in place."""

    def copy(self, src: U64, dst: U64) -> None: ...


def stage_bytes(layout: KVLayout, blocks: Sequence[Sequence[int]]) -> int:
    """The slot a registration of ``blocks`` (ids per KV group) needs on a
    rank of ``layout``: the bytes of those blocks."""
    return sum(len(blocks[r.group]) * r.block_len for r in layout.regions)


@dataclass(frozen=True, slots=True, eq=False)
class Staged:
    """One side's pieces of a staged op, sorted by image offset: ``kv``, its
    ``(N, 3)`` rows of KV memory, and ``image``, each one's offset in the slot."""

    kv: U64
    image: I64

    @property
    def nbytes(self) -> int:
        return int(self.kv[:, 1].sum())

    def spans(self) -> tuple[I64, I64, I64]:
        """``(image offset, compact offset, length)`` of each contiguous run
        of the image (the compact buffer holds the pieces back to back)."""
        lens = self.kv[:, 1].astype(np.int64)
        compact = np.cumsum(lens) - lens
        image, compact, lens = merge_runs(lens, self.image, compact)
        return image, compact, lens


def staged_pieces(
    planner: TransferPlanner,
    side: Role,
    dst_counts: Sequence[int],
    chunks: Sequence[tuple[I64, I64, I64]],
) -> Staged:
    """The pieces of ``side`` for the chunks of each KV group, with their image
    offsets. ``chunks[g]``: ``(j, block, sub)``: chunk ``j`` of the
    registration (0 is its first token) is chunk ``sub`` of ``side``'s block
    ``block``. ``dst_counts[g]``: the registration's block count (the image's
    capacity)."""
    consumer = planner.consumer
    route = planner.route
    caps = [dst_counts[r.group] * r.tokens_per_block for r in consumer.regions]
    plane = sum(cap * r.head_bytes for cap, r in zip(caps, consumer.regions, strict=True))
    before: dict[tuple[int, str], int] = {}
    at = 0
    for cap, r in zip(caps, consumer.regions, strict=True):
        before[(r.layer, r.kind)] = at
        at += cap * r.head_bytes
    heads = route.heads
    head0 = consumer.regions[0].head_start
    kv: list[U64] = []
    image: list[I64] = []
    for cls in planner.classes:
        j, block, sub = chunks[cls.group]
        if not j.size:
            continue
        sd = cls.src if side is Role.PRODUCER else cls.dst
        lengths = cls.lengths
        pos = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        rel = block * sd.stride + sub * sd.sub
        local = (rel[:, None] + sd.offsets[None, :]).reshape(-1).astype(np.uint64)
        starts = np.array(
            [
                (heads.start - head0) * plane
                + heads.count * before[(planner.pairs[p][1].layer, planner.pairs[p][1].kind)]
                for p in cls.regions
            ],
            dtype=np.int64,
        )
        offs = (j[:, None] * int(lengths.sum()) + pos[None, :]).reshape(-1)
        tiled = np.tile(lengths, j.size)
        for k in range(cls.regions.size):
            kv.append(rows(local + sd.base[k], tiled, sd.dev[k]))
            image.append(offs + starts[k])
    if not kv:
        return Staged(np.zeros((0, 3), dtype=np.uint64), np.zeros(0, dtype=np.int64))
    all_image = np.concatenate(image)
    order = np.argsort(all_image, kind="stable")
    return Staged(np.concatenate(kv)[order], all_image[order])


def write_chunks(
    planner: TransferPlanner,
    src_blocks: Sequence[Sequence[int]],
    dst_blocks: Sequence[Sequence[int]],
    skip_tokens: int,
    first: Sequence[int],
    partial: bool,
) -> tuple[list[tuple[I64, I64, I64]], tuple[int, ...]]:
    """The producer's chunks of one write, as :func:`staged_pieces` takes
    them, and per KV group the tokens of the registration they reach."""
    out: list[tuple[I64, I64, I64]] = []
    reach: list[int] = []
    for g, chunk in enumerate(planner.chunk_tokens):
        rs, rd = planner.ratios[g]
        src = np.asarray(src_blocks[g], dtype=np.int64)
        nd = len(dst_blocks[g])
        done = first[g] if first else 0
        span = chunk_span(chunk, rs, rd, src.size, nd, skip_tokens, done, partial)
        assert not isinstance(span, str), span  # the plan checked these inputs
        base, lo, hi = span
        i = np.arange(lo, hi, dtype=np.int64)
        out.append((i - base, src[i // rs] if i.size else i, i % rs))
        reach.append((hi - base) * chunk)
    return out, tuple(reach)


def scatter_chunks(
    planner: TransferPlanner, dst_blocks: Sequence[Sequence[int]], staged: Sequence[int]
) -> list[tuple[I64, I64, I64]] | str:
    """The consumer's chunks holding the first ``staged[g]`` tokens of its
    registration in each KV group; or what is wrong with ``staged``."""
    if len(staged) != len(planner.chunk_tokens):
        return f"names {len(staged)} KV groups, the route has {len(planner.chunk_tokens)}"
    out: list[tuple[I64, I64, I64]] = []
    for g, chunk in enumerate(planner.chunk_tokens):
        rd = planner.ratios[g][1]
        dst = np.asarray(dst_blocks[g], dtype=np.int64)
        n, rest = divmod(staged[g], chunk)
        if rest or n > dst.size * rd:
            return f"{staged[g]} tokens of KV group {g} do not fit its {dst.size} blocks"
        j = np.arange(n, dtype=np.int64)
        out.append((j, dst[j // rd] if n else j, j % rd))
    return out


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds one op costs, direct or staged, from measured coefficients
    (the formulas: docs/layouts.md, "Staged transfers").

    ``post``: per op posted; ``row``: per descriptor row the transport moves;
    ``wire_byte``: per byte on the wire; ``copy_row`` and ``copy_byte``: per
    row and per byte of one local copy (a staged op makes two: the gather and
    the scatter). ``margin``: staging must win by this factor (it holds slots).
    """

    post: float
    row: float
    wire_byte: float
    copy_row: float
    copy_byte: float
    margin: float = 1.1

    def direct(self, rows: int, nbytes: int) -> float:
        return self.post + rows * self.row + nbytes * self.wire_byte

    def staged(self, spans: int, copy_rows: int, nbytes: int) -> float:
        return self.direct(spans, nbytes) + copy_rows * self.copy_row + 2 * nbytes * self.copy_byte

    def prefers_staged(self, rows: int, spans: int, copy_rows: int, nbytes: int) -> bool:
        return self.staged(spans, copy_rows, nbytes) * self.margin < self.direct(rows, nbytes)


#: Transport coefficients measured with benchmarks/nixl_throughput.py: UCX
#: over shared memory on a 2-core host (DRAM), and UCX cuda_ipc on one H200
#: (VRAM; issue 27's table: 8.6 us per put, about 1.7 TB/s for one large put).
TRANSPORT_COSTS = {
    "DRAM": (30e-6, 0.9e-6, 0.12e-9),
    "VRAM": (20e-6, 8.6e-6, 0.6e-12),
}


def calibrate(copier: Copier, src: U64, dst: U64, repeat: int = 3) -> tuple[float, float]:
    """``(seconds per row, seconds per byte)`` of ``copier``, fitted from
    copying the rows of ``src`` into ``dst`` as many small rows and as one
    large one (the best of ``repeat`` each). Each side's rows must tile one
    range of memory, the two ranges apart."""

    def best(s: U64, d: U64) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            copier.copy(s, d)
            times.append(time.perf_counter() - t0)
        return min(times)

    nbytes = int(src[:, 1].sum())
    t_many = best(src, dst)
    # One row over the same bytes: from the lowest address of each side (the
    # rows tile one range per side, so the two never overlap).
    one_s = np.array([[src[:, 0].min(), nbytes, src[0, 2]]], dtype=np.uint64)
    one_d = np.array([[dst[:, 0].min(), nbytes, dst[0, 2]]], dtype=np.uint64)
    t_one = best(one_s, one_d)
    per_byte = t_one / nbytes
    per_row = max(0.0, (t_many - t_one) / max(1, src.shape[0] - 1))
    return per_row, per_byte


class HostCopier:
    """:class:`Copier` for host memory (DRAM): a scatter out of one contiguous
    buffer is numpy's fancy assignment into a view of the address range (about
    6 GB/s at 4 KiB rows on a 2-core host, ``benchmarks/staging.py``); anything
    else one ``memmove`` per merged row (3 GB/s; numpy's gathers reach 2.5)."""

    __slots__ = ()

    def copy(self, src: U64, dst: U64) -> None:
        n = src.shape[0]
        if n == 0:
            return
        lens = src[:, 1]
        length = int(lens[0])
        uniform = n > 16 and length % 8 == 0 and bool((lens == length).all())
        # One run of memory: a scatter out of one contiguous buffer.
        if uniform and bool((np.diff(src[:, 0].astype(np.int64)) == length).all()):
            self._scatter(int(src[0, 0]), dst[:, 0].astype(np.int64), length)
            return
        as_int = (src[:, 1], src[:, 0], dst[:, 0])
        s, d, lengths = merge_runs(*(a.astype(np.int64) for a in as_int))
        for a, b, k in zip(d.tolist(), s.tolist(), lengths.tolist(), strict=True):
            ctypes.memmove(a, b, k)

    @staticmethod
    def _scatter(first: int, d: I64, length: int) -> None:
        """Rows ``first + i * length`` (one contiguous buffer) to ``d[i]``."""
        lo = min(int(d.min()), first) & ~7
        hi = max(int(d.max()), first + d.size * length) + length
        unit = 8 if not ((d - lo) % 8).any() and not (first - lo) % 8 else 1
        raw = memoryview((ctypes.c_char * (hi - lo)).from_address(lo)).cast("B")
        mem = np.frombuffer(raw, dtype=np.uint64 if unit == 8 else np.uint8)
        width = length // unit
        rows = as_strided(mem, shape=(mem.size - width + 1, width), strides=(unit, unit))
        at = (first - lo) // unit
        block = mem[at : at + d.size * width].reshape(d.size, width)
        rows[(d - lo) // unit] = block
