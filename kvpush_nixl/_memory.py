"""Registered memory of one NIXL agent, as address spans, and descriptor-row checks.

NIXL refuses rows outside memory registered on both sides with a bare
``NIXL_ERR_NOT_FOUND``; a :class:`MemoryMap` gives a list of rows its one memory
type (NIXL lists carry one) and, on a refusal, names the row. With DRAM and VRAM
both registered that costs a binary search per row (~40 ns: 1.2 ms for 32,768
rows, as much as NIXL's own request), hence not on every post.

:func:`layout_spans` merges overlapping regions (FlashInfer interleaves K and V
in one tensor) so no byte is registered twice, but not touching ones: two
allocations may be adjacent, and a registration (a CUDA or ibverbs memory
region) must not straddle them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from kvpush.protocol import KVLayout
from kvpush.runtime import TransportError

__all__ = ("MEMORY_TYPES", "U64", "MemoryMap", "Span", "check_rows", "explained", "layout_spans")

#: The memory types a span may have (NIXL's names; kvpush's MemoryType values).
MEMORY_TYPES = ("DRAM", "VRAM")

U64 = NDArray[np.uint64]


@dataclass(frozen=True, slots=True)
class Span:
    """``length`` registered bytes at ``base`` of one memory type and device."""

    memory: str
    device: int
    base: int
    length: int

    @property
    def end(self) -> int:
        return self.base + self.length


def layout_spans(layout: KVLayout) -> tuple[Span, ...]:
    """The spans to register for ``layout``: one per region and one for its
    staging pool, overlaps merged."""
    spans = [Span(r.memory.value, r.device, r.base, r.extent) for r in layout.regions]
    if layout.staging is not None:
        st = layout.staging
        spans.append(Span(st.memory.value, st.device, st.base, st.nbytes))
    raw = sorted(spans, key=lambda s: (s.base, s.end))
    merged: list[Span] = []
    for span in raw:
        last = merged[-1] if merged else None
        if last is not None and span.base < last.end:
            if (span.memory, span.device) != (last.memory, last.device):
                raise TransportError(
                    f"regions overlap at {span.base:#x} but differ in memory "
                    f"({last.memory} device {last.device} vs {span.memory} device {span.device})"
                )
            merged[-1] = Span(
                last.memory, last.device, last.base, max(last.end, span.end) - last.base
            )
        else:
            merged.append(span)
    return tuple(merged)


def check_rows(rows: object, what: str) -> U64:
    """``rows`` as a C-contiguous ``(N, 3)`` uint64 array with no zero length.

    Accepts any non-negative integer array (the planner's rows are uint64
    already and pass through without a copy)."""
    if not isinstance(rows, np.ndarray) or rows.ndim != 2 or rows.shape[1] != 3:
        raise TransportError(f"{what} must be an (N, 3) array of (address, length, device) rows")
    if rows.dtype.kind not in "iu" or (rows.dtype.kind == "i" and bool((rows < 0).any())):
        raise TransportError(f"{what} must hold non-negative integers, got dtype {rows.dtype}")
    out: U64 = np.ascontiguousarray(rows, dtype=np.uint64)
    if out.shape[0] and not bool(out[:, 1].all()):
        i = int(np.argmin(out[:, 1]))
        raise TransportError(f"{what} row {i} has length 0")
    return out


class MemoryMap:
    """Disjoint spans sorted by address, with vectorised row lookups."""

    __slots__ = ("_devs", "_ends", "_kinds", "_single", "_starts", "spans")

    def __init__(self, spans: Iterable[Span]) -> None:
        ordered = tuple(sorted(spans, key=lambda s: s.base))
        for a, b in itertools.pairwise(ordered):
            if b.base < a.end:
                raise TransportError(f"registered spans overlap at {b.base:#x}")
        for s in ordered:
            if s.memory not in MEMORY_TYPES:
                raise TransportError(f"unknown memory type {s.memory!r:.20}")
        self.spans = ordered
        self._starts = np.array([s.base for s in ordered], dtype=np.uint64)
        self._ends = np.array([s.end for s in ordered], dtype=np.uint64)
        self._devs = np.array([s.device for s in ordered], dtype=np.uint64)
        self._kinds = np.array([MEMORY_TYPES.index(s.memory) for s in ordered], dtype=np.int8)
        kinds = {(s.memory, s.device) for s in ordered}
        self._single = next(iter(kinds))[0] if len(kinds) == 1 else None

    def _locate(self, rows: U64) -> tuple[NDArray[np.int64], int]:
        """Per row, the span holding it, and the first row no span holds (-1: none)."""
        addr, length, dev = rows[:, 0], rows[:, 1], rows[:, 2]
        idx = np.searchsorted(self._starts, addr, side="right").astype(np.int64) - 1
        at = np.maximum(idx, 0)
        end = self._ends[at]
        # addr >= start wherever idx >= 0; compare lengths, not ends, so nothing wraps.
        bad = (idx < 0) | (length > end - np.minimum(addr, end)) | (dev != self._devs[at])
        return at, int(np.argmax(bad)) if bool(bad.any()) else -1

    def classify(self, rows: U64, what: str) -> str:
        """The one memory type of ``rows`` (N >= 1). With one type and device
        registered, a row outside it is NIXL's to refuse (:meth:`explain` names it)."""
        if not self.spans:
            raise TransportError(f"{what}: no memory is registered there")
        if self._single is not None:
            return self._single
        at, bad = self._locate(rows)
        if bad >= 0:
            raise TransportError(self._outside(rows, bad, what))
        kinds = self._kinds[at]
        first = int(kinds[0])
        if bool((kinds != first).any()):
            raise TransportError(f"{what} mix DRAM and VRAM rows; post them as separate transfers")
        return MEMORY_TYPES[first]

    def explain(self, rows: U64, what: str) -> str | None:
        """Why NIXL would refuse ``rows`` (a row outside every span, or on the
        wrong device), or ``None``."""
        if not rows.shape[0]:
            return None
        if not self.spans:
            return f"{what}: no memory is registered there"
        _, bad = self._locate(rows)
        return self._outside(rows, bad, what) if bad >= 0 else None

    def _outside(self, rows: U64, i: int, what: str) -> str:
        a, n, d = (int(v) for v in rows[i])
        return (
            f"{what} row {i} [{a:#x}, +{n}) device {d} is not inside memory registered "
            f"there ({self.describe()})"
        )

    def check_layout(self, layout: KVLayout, what: str) -> None:
        """Every region of ``layout`` lies in a span of its memory type and device."""
        regions = layout.regions
        rows = np.array([(r.base, r.extent, r.device) for r in regions], dtype=np.uint64)
        kinds = np.array([MEMORY_TYPES.index(r.memory.value) for r in regions], dtype=np.int8)
        at, bad = self._locate(rows) if self.spans else (np.zeros(0, np.int64), 0)
        if bad < 0:
            wrong = self._kinds[at] != kinds
            bad = int(np.argmax(wrong)) if bool(wrong.any()) else -1
        if bad >= 0:
            r = regions[bad]
            raise TransportError(
                f"{what}: region {r.name} ({r.memory.value} device {r.device}, "
                f"[{r.base:#x}, +{r.extent})) is not in memory its metadata registers "
                f"({self.describe() or 'none'})"
            )

    def describe(self) -> str:
        """A short human summary for error messages."""
        parts = [f"{s.memory}:{s.device} [{s.base:#x}, {s.end:#x})" for s in self.spans[:3]]
        more = f" and {len(self.spans) - 3} more" if len(self.spans) > 3 else ""
        return ", ".join(parts) + more


def explained(exc: TransportError, *sides: tuple[MemoryMap, U64, str]) -> TransportError:
    """NIXL's refusal ``exc``, led by the first row that explains it (a row
    outside the registered memory of its side), if one does."""
    for memory, rows, what in sides:
        detail = memory.explain(rows, what)
        if detail is not None:
            return TransportError(f"{detail}; {exc}")
    return exc
