"""The device copier: the gathers and scatters of staged transfers, in torch
(``kvpush.runtime.Copier``; torch is imported only here: docs/architecture.md;
the method and its speed: docs/layouts.md, "Staged transfers").

Rows are ``(address, length, device)``, inside the tensors the copier was
built with (the KV caches and the staging pool). :meth:`TorchCopier.copy`
returns once its stream is synchronized: a gathered slot is complete before
the write that reads it is posted, a scatter before its notice reaches the core.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import numpy as np
import torch
from numpy.typing import NDArray

from kvpush.protocol import KvpushError

__all__ = ("TorchCopier",)

U64 = NDArray[np.uint64]
I64 = NDArray[np.int64]


class TorchCopier:
    """:class:`kvpush.runtime.Copier` over the memory of ``tensors``."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        flats: dict[int, torch.Tensor] = {}
        for t in tensors:
            storage = t.untyped_storage()
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            flats[int(flat.data_ptr())] = flat
        self._bases = np.array(sorted(flats), dtype=np.int64)
        self._flats = [flats[int(b)] for b in self._bases]
        self._ends = np.array(
            [b + f.numel() for b, f in zip(self._bases, self._flats, strict=True)]
        )
        device = self._flats[0].device if self._flats else torch.device("cpu")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device = device

    def copy(self, src: U64, dst: U64) -> None:
        if not src.shape[0]:
            return
        si, so = self._locate(src, "source")
        di, do = self._locate(dst, "destination")
        lens = src[:, 1].astype(np.int64)
        keys = (si * len(self._flats) + di) * (1 << 40) + lens
        with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
            for key in np.unique(keys):
                pick = keys == key
                self._group(
                    int(si[pick][0]), int(di[pick][0]), int(lens[pick][0]), so[pick], do[pick]
                )
        if self._stream is not None:
            self._stream.synchronize()

    def _locate(self, rows: U64, what: str) -> tuple[I64, I64]:
        addr = rows[:, 0].astype(np.int64)
        idx = np.searchsorted(self._bases, addr, side="right") - 1
        ok = (idx >= 0) & (addr + rows[:, 1].astype(np.int64) <= self._ends[np.maximum(idx, 0)])
        if not ok.all():
            bad = int(addr[np.argmin(ok)])
            raise KvpushError(f"a {what} row at {bad:#x} is outside the copier's tensors")
        return idx, addr - self._bases[idx]

    def _group(self, si: int, di: int, length: int, so: I64, do: I64) -> None:
        s_flat, d_flat = self._flats[si], self._flats[di]
        if (so % length).any() or (do % length).any():
            for a, b in zip(so.tolist(), do.tolist(), strict=True):
                d_flat[b : b + length].copy_(s_flat[a : a + length])
            return
        dtype, unit = (torch.int64, 8) if length % 8 == 0 else (torch.uint8, 1)
        sv = _rows(s_flat, length, dtype, unit)
        dv = _rows(d_flat, length, dtype, unit)
        s_idx, d_idx = so // length, do // length
        n = s_idx.size
        # One tensor on both sides: torch refuses overlapping in-place copies.
        if si != di and n > 1 and (np.diff(d_idx) == 1).all():
            lo = int(d_idx[0])
            torch.index_select(sv, 0, self._index(s_idx), out=dv[lo : lo + n])
        elif si != di and n > 1 and (np.diff(s_idx) == 1).all():
            lo = int(s_idx[0])
            dv.index_copy_(0, self._index(d_idx), sv[lo : lo + n])
        else:
            dv.index_copy_(0, self._index(d_idx), sv.index_select(0, self._index(s_idx)))

    def _index(self, idx: I64) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(idx)).to(self.device, non_blocking=True)


def _rows(flat: torch.Tensor, length: int, dtype: torch.dtype, unit: int) -> torch.Tensor:
    whole = flat.numel() // length * length
    return flat[:whole].view(dtype).view(-1, length // unit)
