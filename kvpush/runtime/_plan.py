"""Merged transfer plans: which bytes go where for one route of one transfer.

The data plane's planner: pure numpy, no I/O, kept out of the core so that the
core never imports numpy (docs/architecture.md). How a plan is built (chunks,
templates, merging, classes of regions of one geometry, the prefix trim and
the bounds checks) and why: docs/layouts.md, "The planner".
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvpush.protocol import (
    HeadOrder,
    IncompatiblePeerError,
    KVLayout,
    LocalProtocolError,
    Region,
    Role,
    Route,
)

__all__ = ("TransferPlan", "TransferPlanner", "plan_transfer")

I64 = NDArray[np.int64]
U64 = NDArray[np.uint64]


@dataclass(frozen=True, slots=True, eq=False)
class TransferPlan:
    """The descriptors of one route of one transfer; arrays are read-only
    (the fields: docs/layouts.md, "The planner"). Within a region, rows follow
    token order."""

    src: U64
    dst: U64
    region_rows: I64
    #: Total bytes moved; merged descriptors (rows of ``src`` and ``dst``).
    nbytes: int
    num_descriptors: int
    #: Descriptor count without merging (the length of :meth:`indices`).
    num_pieces: int
    _classes: tuple[_Class, ...] = field(repr=False)
    _chunks: tuple[_Chunks, ...] = field(repr=False)

    def indices(self) -> tuple[I64, I64]:
        """``(src_index, dst_index)``: the transfer as unmerged pieces, into
        ``TransferPlanner.prepped(Role.PRODUCER)`` and ``prepped(Role.CONSUMER)``
        (for NIXL's ``make_prepped_xfer``), region-major, then token order;
        computed on demand."""
        counts = np.zeros(self.region_rows.size - 1, dtype=np.int64)
        for cls in self._classes:
            counts[cls.regions] = self._chunks[cls.group].src_block.size * cls.lengths.size
        rows_at = np.concatenate(([0], np.cumsum(counts)))
        out = np.empty((2, int(rows_at[-1])), dtype=np.int64)
        for cls in self._classes:
            ch = self._chunks[cls.group]
            pieces = np.arange(cls.lengths.size, dtype=np.int64)
            rows = _rows(cls, rows_at, ch.src_block.size * pieces.size)
            for k, side, block, sub in (
                (0, cls.src, ch.src_block, ch.src_sub),
                (1, cls.dst, ch.dst_block, ch.dst_sub),
            ):
                local = ((block * side.ratio + sub)[:, None] * pieces.size + pieces).reshape(-1)
                out[k, rows] = (side.units[:, None] + local).reshape(-1)
        _readonly(out)
        return out[0], out[1]


@dataclass(frozen=True, slots=True, eq=False)
class _Side:
    """One side's geometry for a class of region pairs (see :class:`_Class`)."""

    #: Bytes from one block to the next, and from one chunk of a block to the next.
    stride: int
    sub: int
    #: Chunks per block and blocks per region.
    ratio: int
    blocks: int
    #: Offsets of the template pieces within chunk 0 of a block.
    offsets: I64
    #: Per region of the class: base address, device id, first prepped entry.
    base: U64
    dev: U64
    units: I64


@dataclass(frozen=True, slots=True, eq=False)
class _Class:
    """Region pairs of identical geometry: one run computation serves them all."""

    group: int
    #: Lengths of the template pieces (equal on both sides).
    lengths: I64
    #: The pairs' indices; ``contiguous`` if they form one ascending range.
    regions: I64
    contiguous: bool
    src: _Side
    dst: _Side
    #: ``(2, regions)``: both sides' bases and devices, for :func:`_fill`.
    base: U64
    dev: U64


@dataclass(frozen=True, slots=True, eq=False)
class _Chunks:
    """Per chunk to copy, in token order: block id and chunk within the block."""

    src_block: I64
    src_sub: I64
    dst_block: I64
    dst_sub: I64


def _cell_offsets(r: Region, tokens: I64, heads: I64) -> I64:
    local = heads - r.head_start
    if r.order is HeadOrder.NHD:
        return (tokens * r.num_heads + local) * r.head_bytes
    return (local * r.tokens_per_block + tokens) * r.head_bytes


def _template(p: Region, c: Region, route: Route, chunk: int) -> tuple[I64, I64, I64]:
    """One chunk's cells as maximal pieces contiguous on both sides, in dst order."""
    tokens = np.arange(chunk, dtype=np.int64)[:, None]
    heads = np.arange(route.heads.start, route.heads.start + route.heads.count, dtype=np.int64)
    src = _cell_offsets(p, tokens, heads[None, :]).reshape(-1)
    dst = _cell_offsets(c, tokens, heads[None, :]).reshape(-1)
    order = np.argsort(dst, kind="stable")
    src_s, dst_s, lengths = merge_runs(
        np.full(src.size, p.head_bytes, np.int64), src[order], dst[order]
    )
    return src_s, dst_s, lengths


def merge_runs(lengths: I64, *sides: I64) -> tuple[I64, ...]:
    """Pieces (``lengths``, a start per side) that start where their
    predecessor ends on every side joined: ``(*starts, lengths)`` of the runs."""
    if lengths.size < 2:
        return (*sides, lengths)
    joins = sides[0][1:] == sides[0][:-1] + lengths[:-1]
    for side in sides[1:]:
        joins &= side[1:] == side[:-1] + lengths[:-1]
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return (*(side[starts] for side in sides), np.add.reduceat(lengths, starts))


def _sub_stride(r: Region, chunk: int) -> int:
    """Offset between consecutive chunks of one block (0 if a block is one chunk)."""
    if chunk == r.tokens_per_block:
        return 0
    if r.order is HeadOrder.NHD:
        return chunk * r.num_heads * r.head_bytes
    return chunk * r.head_bytes


def rows(address: ArrayLike, length: ArrayLike, device: ArrayLike) -> U64:
    """``(N, 3)`` descriptor rows from columns (arrays or scalars, broadcast)."""
    out = np.empty((np.broadcast(address, length, device).size, 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = address, length, device
    return out


def _readonly(a: NDArray[np.generic]) -> None:
    a.flags.writeable = False


class TransferPlanner:
    """Plans every transfer of one route; build once per (peer, route).

    Construction raises :class:`IncompatiblePeerError` (naming the field:
    docs/layouts.md, "The planner") where the layouts can never exchange KV;
    :meth:`plan` then checks only the per-transfer inputs.
    """

    def __init__(
        self, producer: KVLayout, consumer: KVLayout, route: Route, *, allow_strided: bool = False
    ) -> None:
        self.producer, self.consumer, self.route = producer, consumer, route
        self.allow_strided = allow_strided
        if route.heads.count < 1 or route.heads.start < 0:
            raise IncompatiblePeerError("kv.heads", f"empty or negative head slice {route.heads}")
        # A producer PP stage holds only its layers; the consumer all of them.
        where = {(r.layer, r.kind): r for r in consumer.regions}
        pairs: list[tuple[Region, Region]] = []
        for p in producer.regions:
            c = where.get((p.layer, p.kind))
            if c is None:
                raise IncompatiblePeerError(
                    "kv.region_map", f"the consumer's layout has no region {p.name}"
                )
            self._check_pair(p, c)
            pairs.append((p, c))
        #: (producer region, consumer region) in the producer's order; plans follow it.
        self.pairs = tuple(pairs)
        chunk: list[int] = []
        ratios: list[tuple[int, int]] = []
        limits: list[tuple[int, int]] = []
        for g in range(producer.num_groups):
            p, c = producer.group_region(g), consumer.group_region(g)
            bp, bc = p.tokens_per_block, c.tokens_per_block
            if max(bp, bc) % min(bp, bc):
                raise IncompatiblePeerError(
                    "kv.tokens_per_block",
                    f"KV group {g}: producer blocks of {bp} tokens and consumer blocks of "
                    f"{bc} tokens: one must be a whole multiple of the other",
                )
            chunk.append(min(bp, bc))
            ratios.append((bp // min(bp, bc), bc // min(bp, bc)))
            limits.append((p.num_blocks, c.num_blocks))
        #: Per KV group: the tokens of one chunk (the finer block size), chunks
        #: per block on the producer and on the consumer, and their block counts.
        self.chunk_tokens = tuple(chunk)
        self.ratios = tuple(ratios)
        self._limits = tuple(limits)
        #: The region pairs grouped by geometry, with their chunk templates.
        self.classes = self._classify()
        self._py = tuple(_PyClass.of(cls) for cls in self.classes)

    def _check_pair(self, p: Region, c: Region) -> None:
        if p.group != c.group:
            raise IncompatiblePeerError(
                "kv.region_map",
                f"{p.name} is in KV group {p.group} on the producer, {c.group} on the consumer",
            )
        if p.head_bytes != c.head_bytes:
            raise IncompatiblePeerError(
                "kv.head_bytes", f"{p.name}: {p.head_bytes} producer, {c.head_bytes} consumer"
            )
        lo, hi = self.route.heads.start, self.route.heads.start + self.route.heads.count
        for side, r in (("producer", p), ("consumer", c)):
            if lo < r.head_start or hi > r.head_start + r.num_heads:
                raise IncompatiblePeerError(
                    "kv.heads",
                    f"{r.name}: the route's heads [{lo}, {hi}) are not all held by the "
                    f"{side} rank, which holds [{r.head_start}, {r.head_start + r.num_heads})",
                )

    def _classify(self) -> tuple[_Class, ...]:
        """Templates per pair, then pairs grouped by identical geometry."""
        route = self.route
        keyed: dict[tuple[object, ...], list[int]] = {}
        templates: list[tuple[I64, I64, I64]] = []
        cache: dict[tuple[object, ...], tuple[I64, I64, I64]] = {}
        units = np.zeros((2, len(self.pairs) + 1), dtype=np.int64)
        for i, (p, c) in enumerate(self.pairs):
            chunk = self.chunk_tokens[p.group]
            rs, rd = self.ratios[p.group]
            shape = tuple((r.order, r.num_heads, r.head_start, r.tokens_per_block) for r in (p, c))
            t = cache.get((chunk, p.head_bytes, shape))
            if t is None:
                t = cache[chunk, p.head_bytes, shape] = _template(p, c, route, chunk)
            if t[0].size > route.heads.count and not self.allow_strided:
                lo, hi = route.heads.start, route.heads.start + route.heads.count
                raise IncompatiblePeerError(
                    "kv.strided",
                    f"{p.name}: the route's heads [{lo}, {hi}) are not all the heads of a "
                    f"token on both sides (the producer holds {p.num_heads}, the consumer "
                    f"{c.num_heads}), so the {p.order.value}/{c.order.value} layouts need "
                    f"{t[0].size} descriptors per chunk of {chunk} tokens; declare head-major "
                    "(HND) layouts on both sides, or build the planner with allow_strided=True",
                )
            templates.append(t)
            units[0, i + 1] = units[0, i] + p.num_blocks * rs * t[0].size
            units[1, i + 1] = units[1, i] + c.num_blocks * rd * t[0].size
            key = (
                p.group,
                p.stride,
                c.stride,
                _sub_stride(p, chunk),
                _sub_stride(c, chunk),
                *(a.tobytes() for a in t),
            )
            keyed.setdefault(key, []).append(i)
        classes: list[_Class] = []
        for members in keyed.values():
            p0, c0 = self.pairs[members[0]]
            regs = np.array(members, dtype=np.int64)
            t_src, t_dst, lengths = templates[members[0]]
            sides = []
            for k, (r0, offsets) in enumerate(((p0, t_src), (c0, t_dst))):
                regions = [self.pairs[i][k] for i in members]
                sides.append(
                    _Side(
                        stride=r0.stride,
                        sub=_sub_stride(r0, self.chunk_tokens[p0.group]),
                        ratio=self.ratios[p0.group][k],
                        blocks=r0.num_blocks,
                        offsets=offsets,
                        base=np.array([r.base for r in regions], dtype=np.uint64),
                        dev=np.array([r.device for r in regions], dtype=np.uint64),
                        units=units[k, regs],
                    )
                )
            contiguous = members == list(range(members[0], members[0] + len(members)))
            base = np.stack((sides[0].base, sides[1].base))
            dev = np.stack((sides[0].dev, sides[1].dev))
            classes.append(
                _Class(p0.group, lengths, regs, contiguous, sides[0], sides[1], base, dev)
            )
        return tuple(classes)

    def prepped(self, role: Role) -> U64:
        """The per-piece descriptor list of one side, for ``prep_xfer_dlist``
        (what :meth:`TransferPlan.indices` index into): per pair in the
        producer's order, per block id (every block), chunk within the block
        and template piece. Build it once per route.
        """
        parts: list[U64] = [np.empty((0, 3), dtype=np.uint64)] * len(self.pairs)
        for cls in self.classes:
            side = cls.src if role is Role.PRODUCER else cls.dst
            local = (
                np.arange(side.blocks, dtype=np.int64)[:, None, None] * side.stride
                + np.arange(side.ratio, dtype=np.int64)[None, :, None] * side.sub
                + side.offsets[None, None, :]
            ).reshape(-1)
            lengths = np.tile(cls.lengths, side.blocks * side.ratio)
            for j, region in enumerate(cls.regions):
                parts[int(region)] = rows(
                    local.astype(np.uint64) + side.base[j], lengths, side.dev[j]
                )
        result = np.concatenate(parts)
        _readonly(result)
        return result

    def plan(
        self,
        src_blocks: Sequence[Sequence[int]],
        dst_blocks: Sequence[Sequence[int]],
        *,
        skip_tokens: int = 0,
        first: Sequence[int] = (),
        partial: bool = False,
    ) -> TransferPlan:
        """Plan one transfer (the arguments and what is refused with
        :class:`LocalProtocolError`: docs/layouts.md, "The planner").

        One increment of a progressive source: ``first[g]`` source blocks of
        group ``g`` were written before (empty: none), only the chunks after
        them are planned; ``partial``: more of the source is to come, so it
        may be shorter than the destination (all its blocks are whole).
        """
        groups = len(self.chunk_tokens)
        for what, blocks, want in (
            ("src_blocks", src_blocks, groups),
            ("dst_blocks", dst_blocks, self.consumer.num_groups),
        ):
            if not isinstance(blocks, (tuple, list)) or len(blocks) != want:
                raise LocalProtocolError(f"{what} must list block ids for {want} KV group(s)")
        if type(skip_tokens) is not int or skip_tokens < 0:
            raise LocalProtocolError(f"skip_tokens must be a non-negative int, got {skip_tokens!r}")
        if first and (len(first) != groups or any(type(n) is not int or n < 0 for n in first)):
            raise LocalProtocolError(f"first must list {groups} non-negative block counts")
        starts = tuple(first) or (0,) * groups
        small = _small_plan(self, src_blocks, dst_blocks, skip_tokens, starts, partial)
        if small is not None:
            return small
        chunks = [
            self._chunks(g, src_blocks[g], dst_blocks[g], skip_tokens, starts[g], partial)
            for g in range(groups)
        ]
        return self._assemble(chunks)

    def _chunks(
        self,
        g: int,
        src: Sequence[int],
        dst: Sequence[int],
        skip: int,
        done: int = 0,
        partial: bool = False,
    ) -> _Chunks:
        """The chunks to copy in KV group ``g``, in token order."""
        rs, rd = self.ratios[g]
        s = _block_ids(src, "source", g, self._limits[g][0], unique=False)
        d = _block_ids(dst, "destination", g, self._limits[g][1], unique=True)
        span = chunk_span(self.chunk_tokens[g], rs, rd, s.size, d.size, skip, done, partial)
        if isinstance(span, str):
            raise LocalProtocolError(f"KV group {g}: {span}")
        # Chunk i of the request is chunk i - base of the destination list.
        base, first, end = span
        i = np.arange(first, end, dtype=np.int64)
        j = i - base
        if rs == 1:
            sblk, ssub = s[first:end], np.zeros(j.size, dtype=np.int64)
        else:
            sblk, ssub = s[i // rs], i % rs
        if rd == 1:
            dblk, dsub = d[first - base : end - base], np.zeros(j.size, dtype=np.int64)
        else:
            dblk, dsub = d[j // rd], j % rd
        return _Chunks(sblk, ssub, dblk, dsub)

    def _assemble(self, chunks: list[_Chunks]) -> TransferPlan:
        merged: list[tuple[_Class, U64, I64]] = []
        counts = np.zeros(len(self.pairs), dtype=np.int64)
        pieces = 0
        for cls in self.classes:
            ch = chunks[cls.group]
            rel_s = ch.src_block * cls.src.stride + ch.src_sub * cls.src.sub
            rel_d = ch.dst_block * cls.dst.stride + ch.dst_sub * cls.dst.sub
            if cls.lengths.size > 1:
                rel_s = (rel_s[:, None] + cls.src.offsets[None, :]).reshape(-1)
                rel_d = (rel_d[:, None] + cls.dst.offsets[None, :]).reshape(-1)
                lens = np.tile(cls.lengths, ch.src_block.size)
            else:
                rel_s = rel_s + cls.src.offsets[0]
                rel_d = rel_d + cls.dst.offsets[0]
                lens = np.full(rel_s.size, cls.lengths[0], dtype=np.int64)
            pieces += rel_s.size * cls.regions.size
            rel_s, rel_d, lens = merge_runs(lens, rel_s, rel_d)
            merged.append((cls, np.stack((rel_s, rel_d)).astype(np.uint64), lens))
            counts[cls.regions] = rel_s.size
        region_rows = np.concatenate(([0], np.cumsum(counts)))
        nbytes = sum(int(lens.sum()) * cls.regions.size for cls, _, lens in merged)
        return _filled(region_rows, merged, nbytes, pieces, self.classes, chunks)


def _filled(
    region_rows: I64,
    merged: Sequence[tuple[_Class, U64, I64 | list[int]]],
    nbytes: int,
    pieces: int,
    classes: tuple[_Class, ...],
    chunks: Sequence[_Chunks],
) -> TransferPlan:
    """The plan whose class ``c`` has the runs ``(rel, lengths)`` (``rel``:
    ``(2, runs)`` offsets from each region's base on both sides)."""
    # One buffer for both sides: two equal-size arrays allocated and freed per
    # plan kept missing glibc's mmap threshold and were page-faulted afresh on
    # every call (3-4x slower in benchmarks/plan.py).
    n = int(region_rows[-1])
    both = np.empty((2, n, 3), dtype=np.uint64)
    for cls, rel, lens in merged:
        _fill(both, _rows(cls, region_rows, rel.shape[1]), cls, rel, lens)
    _readonly(both)
    _readonly(region_rows)
    return TransferPlan(both[0], both[1], region_rows, nbytes, n, pieces, classes, tuple(chunks))


def _fill(both: U64, rows: slice | I64, cls: _Class, rel: U64, lens: I64 | list[int]) -> None:
    """Write one class's rows on both sides: every region's base plus the
    shared offsets, straight into the output (no temporaries its size)."""
    n_reg, n_run = cls.base.shape[1], rel.shape[1]
    if isinstance(rows, slice):
        view = both[:, rows].reshape(2, n_reg, n_run, 3)
        np.add(cls.base[:, :, None], rel[:, None, :], out=view[..., 0])
        view[..., 1] = lens
        view[..., 2] = cls.dev[:, :, None]
    else:
        both[:, rows, 0] = (cls.base[:, :, None] + rel[:, None, :]).reshape(2, -1)
        both[:, rows, 1] = np.broadcast_to(lens, (n_reg, n_run)).reshape(-1)
        both[:, rows, 2] = np.repeat(cls.dev, n_run, axis=1)


def _rows(cls: _Class, starts: I64, per_region: int) -> slice | I64:
    """Output rows of a class whose regions each get ``per_region`` rows."""
    if cls.contiguous:
        lo = int(starts[cls.regions[0]])
        return slice(lo, lo + cls.regions.size * per_region)
    return (starts[cls.regions][:, None] + np.arange(per_region)).reshape(-1)


def _block_ids(ids: object, side: str, group: int, limit: int, *, unique: bool) -> I64:
    """Block ids as int64, checked against ``limit`` (the side's ``num_blocks``)."""
    try:
        arr = np.asarray(ids)
    except (ValueError, TypeError, OverflowError):
        raise LocalProtocolError(f"{side} block ids of KV group {group} are malformed") from None
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise LocalProtocolError(f"{side} block ids of KV group {group} must be a list of ints")
    bad = (arr < 0) | (arr >= limit)
    if bad.any():
        raise LocalProtocolError(
            f"{side} block id {int(arr[np.argmax(bad)])} of KV group {group} is outside the "
            f"{limit} blocks the {side} side declared"
        )
    out = arr.astype(np.int64, copy=False)
    if unique and out.size > 1:
        srt = np.sort(out)
        dup = srt[1:] == srt[:-1]
        if dup.any():
            raise LocalProtocolError(
                f"{side} block id {int(srt[1:][np.argmax(dup)])} of KV group {group} is "
                "listed twice"
            )
    return out


#: Block lists up to this long (per KV group and side), and plans of up to this
#: many template pieces, take :func:`_small_plan` (docs/runtime.md, "Small plans";
#: ``benchmarks/plan.py --small``).
SMALL_PLAN_BLOCKS = 128
SMALL_PLAN_PIECES = 512


@dataclass(frozen=True, slots=True, eq=False)
class _PyClass:
    """A :class:`_Class`'s geometry as plain Python values, for :func:`_small_plan`."""

    cls: _Class
    regions: tuple[int, ...]
    #: Block stride and chunk stride of the source, then of the destination.
    strides: tuple[int, int, int, int]
    #: Per template piece: source offset, destination offset, length.
    pieces: tuple[tuple[int, int, int], ...]

    @staticmethod
    def of(c: _Class) -> _PyClass:
        offsets = (c.src.offsets.tolist(), c.dst.offsets.tolist(), c.lengths.tolist())
        return _PyClass(
            c,
            tuple(c.regions.tolist()),
            (c.src.stride, c.src.sub, c.dst.stride, c.dst.sub),
            tuple(zip(*offsets, strict=True)),
        )


_PyChunks = tuple[list[int], list[int], list[int], list[int]]


def chunk_span(
    chunk: int, rs: int, rd: int, ns: int, nd: int, skip: int, done: int, partial: bool
) -> tuple[int, int, int] | str:
    """``(base, first, end)``: chunks ``first..end`` of the request are copied,
    chunk ``i`` into chunk ``i - base`` of the destination list; or what is
    wrong. ``ns``/``nd``: block counts, ``bp = chunk * rs`` and ``bc = chunk
    * rd`` tokens per block; ``done`` source blocks were written before."""
    bp, bc = chunk * rs, chunk * rd
    if skip % bc:
        return (
            f"skip_tokens {skip} is not a multiple of the consumer's {bc} tokens per "
            "block; a consumer can only hold whole blocks"
        )
    if done > ns:
        return f"{done} source blocks written before, but the source has {ns}"
    # The token count each side's block list implies, as a closed range.
    lo_p, hi_p = max(0, (ns - 1) * bp + 1), ns * bp
    lo_d, hi_d = skip + max(0, (nd - 1) * bc + 1), skip + nd * bc
    if partial and hi_p > hi_d:
        return (
            f"an increment of {ns} source blocks of {bp} tokens ({hi_p} tokens) does not fit "
            f"skip_tokens {skip} plus {nd} destination blocks of {bc} tokens ({hi_d})"
        )
    if not partial and max(lo_p, lo_d) > min(hi_p, hi_d):
        return (
            f"{ns} source blocks of {bp} tokens hold {lo_p}..{hi_p} tokens, but skip_tokens "
            f"{skip} plus {nd} destination blocks of {bc} tokens make {lo_d}..{hi_d}: the "
            "block lists disagree"
        )
    base = skip // chunk
    first = max(base, done * rs)
    return base, first, max(first, min(hi_p, hi_d) // chunk)


def _small_chunks(
    pl: TransferPlanner, g: int, src: object, dst: object, skip: int, done: int, partial: bool
) -> _PyChunks | None:
    """:meth:`TransferPlanner._chunks` in plain Python; ``None`` when the lists
    are long or anything is wrong (the numpy path then plans, or raises)."""
    if not isinstance(src, (tuple, list)) or not isinstance(dst, (tuple, list)):
        return None
    ns, nd = len(src), len(dst)
    if ns > SMALL_PLAN_BLOCKS or nd > SMALL_PLAN_BLOCKS:
        return None
    limit_s, limit_d = pl._limits[g]
    for ids, limit in ((src, limit_s), (dst, limit_d)):
        for x in ids:
            if type(x) is not int or not 0 <= x < limit:
                return None
    if len(set(dst)) != nd:
        return None
    rs, rd = pl.ratios[g]
    span = chunk_span(pl.chunk_tokens[g], rs, rd, ns, nd, skip, done, partial)
    if isinstance(span, str):
        return None
    base, first, end = span
    n = end - first
    if rs == 1:
        sblk, ssub = list(src[first:end]), [0] * n
    else:
        sblk = [src[i // rs] for i in range(first, end)]
        ssub = [i % rs for i in range(first, end)]
    js = range(first - base, end - base)
    if rd == 1:
        dblk, dsub = list(dst[js.start : js.stop]), [0] * n
    else:
        dblk, dsub = [dst[j // rd] for j in js], [j % rd for j in js]
    return sblk, ssub, dblk, dsub


def _small_runs(c: _PyClass, ch: _PyChunks) -> tuple[list[int], list[int], list[int]]:
    """One class's merged runs (relative offsets, lengths), as in ``_assemble``."""
    s_stride, s_sub, d_stride, d_sub = c.strides
    run_s: list[int] = []
    run_d: list[int] = []
    run_l: list[int] = []
    end_s = end_d = -1
    for sblk, ssub, dblk, dsub in zip(*ch, strict=True):
        base_s = sblk * s_stride + ssub * s_sub
        base_d = dblk * d_stride + dsub * d_sub
        for o_s, o_d, n in c.pieces:
            a, b = base_s + o_s, base_d + o_d
            if a == end_s and b == end_d:
                run_l[-1] += n
            else:
                run_s.append(a)
                run_d.append(b)
                run_l.append(n)
            end_s, end_d = a + n, b + n
    return run_s, run_d, run_l


def _small_plan(
    pl: TransferPlanner,
    src_blocks: Sequence[object],
    dst_blocks: Sequence[object],
    skip: int,
    starts: Sequence[int] = (),
    partial: bool = False,
) -> TransferPlan | None:
    """The plan the numpy path makes, in plain Python, for small transfers (the
    demo's, and large blocks): a handful of numpy calls instead of about fifty.
    ``None`` when the transfer is large or the inputs need the numpy path's
    checks; ``tests/test_plan.py`` checks that both paths agree."""
    chunks: list[_PyChunks] = []
    for g in range(len(pl.chunk_tokens)):
        done = starts[g] if starts else 0
        ch = _small_chunks(pl, g, src_blocks[g], dst_blocks[g], skip, done, partial)
        if ch is None:
            return None
        chunks.append(ch)
    if sum(len(chunks[c.cls.group][0]) * len(c.pieces) for c in pl._py) > SMALL_PLAN_PIECES:
        return None
    counts = [0] * len(pl.pairs)
    merged = []
    pieces = nbytes = 0
    for c in pl._py:
        run_s, run_d, run_l = _small_runs(c, chunks[c.cls.group])
        merged.append((c.cls, np.array((run_s, run_d), dtype=np.uint64).reshape(2, -1), run_l))
        pieces += len(chunks[c.cls.group][0]) * len(c.pieces) * len(c.regions)
        nbytes += sum(run_l) * len(c.regions)
        for region in c.regions:
            counts[region] = len(run_l)
    region_rows = np.array([0, *itertools.accumulate(counts)], dtype=np.int64)
    arrays = [np.array(ch, dtype=np.int64).reshape(4, -1) for ch in chunks]
    as_chunks = [_Chunks(a[0], a[1], a[2], a[3]) for a in arrays]
    return _filled(region_rows, merged, nbytes, pieces, pl.classes, as_chunks)


def plan_transfer(
    producer: KVLayout,
    consumer: KVLayout,
    route: Route,
    src_blocks: Sequence[Sequence[int]],
    dst_blocks: Sequence[Sequence[int]],
    *,
    skip_tokens: int = 0,
    allow_strided: bool = False,
) -> TransferPlan:
    """One-off :meth:`TransferPlanner.plan` (build a planner to plan many)."""
    planner = TransferPlanner(producer, consumer, route, allow_strided=allow_strided)
    return planner.plan(src_blocks, dst_blocks, skip_tokens=skip_tokens)
