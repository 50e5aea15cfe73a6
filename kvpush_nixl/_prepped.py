"""Prepared descriptor lists of one route, and checks of the indices into them.

Indices become int32 (what NIXL's binding stores) after the bounds check that
keeps a huge index from wrapping onto a valid one. NIXL refuses paired entries
of different lengths with a bare ``NIXL_ERR_INVALID_PARAM``, so on a refusal we
find and name the entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpush.runtime import TransportError

from ._agent import I32, U64, Handle, NixlAgent
from ._memory import MemoryMap, check_rows, explained

__all__ = ("Prepped", "check_indices", "explain_indices", "prepare")


@dataclass(frozen=True, slots=True, eq=False)
class Prepped:
    """Both sides' prepared lists of one key, with each entry's length."""

    local: Handle
    remote: Handle
    local_len: U64
    remote_len: U64


def prepare(
    nixl: NixlAgent, peer: str, local: object, remote: object, mine: MemoryMap, theirs: MemoryMap
) -> Prepped:
    """Prepare local rows and the rows of NIXL agent ``peer`` (both sides, on the initiator)."""
    rows_l = check_rows(local, "local rows")
    rows_r = check_rows(remote, "remote rows")
    if not rows_l.shape[0] or not rows_r.shape[0] or max(len(rows_l), len(rows_r)) >= 1 << 31:
        raise TransportError("prepared lists need 1 to 2**31 - 1 rows on each side")
    side_l = (mine, rows_l, "local rows")
    side_r = (theirs, rows_r, f"rows of {peer!r}")
    mem_l, mem_r = mine.classify(rows_l, side_l[2]), theirs.classify(rows_r, side_r[2])
    try:
        lh = nixl.prep(None, rows_l, mem_l)
    except TransportError as exc:
        raise explained(exc, side_l) from None
    try:
        rh = nixl.prep(peer, rows_r, mem_r)
    except TransportError as exc:
        nixl.release(lh)
        raise explained(exc, side_r) from None
    return Prepped(lh, rh, rows_l[:, 1].copy(), rows_r[:, 1].copy())


def _index(idx: object, size: int, what: str) -> I32:
    if not isinstance(idx, np.ndarray) or idx.ndim != 1 or idx.dtype.kind not in "iu":
        raise TransportError(f"{what} indices must be a 1-D integer array")
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= size):
        raise TransportError(
            f"{what} indices must lie in [0, {size}), got [{int(idx.min())}, {int(idx.max())}]"
        )
    return np.ascontiguousarray(idx, dtype=np.int32)


def check_indices(prepped: Prepped, local: object, remote: object) -> tuple[I32, I32]:
    """``(local, remote)`` as int32, in range, of equal count. Paired lengths
    are NIXL's to check (a gather per side costs more than its request);
    :func:`explain_indices` names the entry when it refuses."""
    li = _index(local, prepped.local_len.size, "local")
    ri = _index(remote, prepped.remote_len.size, "remote")
    if li.size != ri.size:
        raise TransportError(f"{li.size} local indices but {ri.size} remote ones")
    return li, ri


def explain_indices(prepped: Prepped, li: I32, ri: I32) -> str | None:
    """The first entry whose local and remote rows differ in length, if any."""
    differ = prepped.local_len[li] != prepped.remote_len[ri]
    if not bool(differ.any()):
        return None
    k = int(np.argmax(differ))
    return (
        f"entry {k}: local row {int(li[k])} is {int(prepped.local_len[li[k]])} bytes, "
        f"remote row {int(ri[k])} {int(prepped.remote_len[ri[k]])}"
    )
