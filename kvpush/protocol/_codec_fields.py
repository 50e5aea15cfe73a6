"""Field kinds of the wire codec: how each message field maps to msgpack.

Every kind is a pair of functions (to wire, from wire). Both validate with the
same rules, which is what makes ``decode(encode(m)) == m`` hold for every valid
message and makes every other input fail the same way on either side. They
raise only :class:`FieldError`; the codec turns it into
:class:`LocalProtocolError` on encode and :class:`RemoteProtocolError` on decode.
The *from wire* half receives whatever msgpack produced (any type), so it checks
types before touching a value.
"""

from __future__ import annotations

import math
import reprlib
import struct
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack

from ._errors import RemoteProtocolError
from ._layout import MAX_REGIONS, KVLayout
from ._messages import (
    Abort,
    Announce,
    Extend,
    Heartbeat,
    Hello,
    HelloReject,
    ReadDone,
    Register,
    Rejected,
    Renew,
    Settled,
    Withdraw,
    WriteFailed,
)
from ._types import Mode, RejectReason, Role, Source

if TYPE_CHECKING:
    from ._codec import CodecLimits

__all__ = ("TYPE_CODES", "FieldError", "Kind", "Schema", "capped", "schemas")

EPOCH_MAX = (1 << 63) - 1
U64_MAX = (1 << 64) - 1
MAX_HEADS = 1 << 16  # the bound compute_topology applies
MAX_ATTEMPT = 0xFF  # a registration's attempt (the consumer makes a few)


_T = TypeVar("_T")


class FieldError(Exception):
    """A field failed validation; encode and decode turn it into their error."""


# --- field kinds: (to wire, from wire), both validating -----------------------

_Conv = Callable[[Any], Any]
Kind = tuple[_Conv, _Conv]


def _show(v: object) -> str:
    return f"{type(v).__name__} {reprlib.repr(v)}"


def _int_kind(lo: int, hi: int) -> Kind:
    def conv(v: Any) -> int:
        if type(v) is not int or not lo <= v <= hi:
            raise FieldError(f"expected an int in [{lo}, {hi}], got {_show(v)}")
        return v

    return conv, conv


def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise FieldError(f"expected a bool, got {_show(v)}")
    return v


def _text_kind(max_len: int, *, nonempty: bool) -> Kind:
    lo = 1 if nonempty else 0

    def conv(v: Any) -> str:
        if type(v) is not str:
            raise FieldError(f"expected a str, got {_show(v)}")
        try:
            n = len(v.encode())
        except UnicodeEncodeError:
            raise FieldError("str is not encodable as UTF-8") from None
        if not lo <= n <= max_len:
            raise FieldError(f"str of {n} bytes outside [{lo}, {max_len}]")
        return v

    return conv, conv


def _seconds_kind(*, positive: bool) -> Kind:
    def check(f: float) -> float:
        if not math.isfinite(f) or f < 0 or (positive and f == 0):
            raise FieldError(f"seconds must be finite and {'>' if positive else '>='} 0, got {f!r}")
        return f

    def enc(v: Any) -> float:
        if isinstance(v, float):
            return check(float(v))
        if type(v) is not int:
            raise FieldError(f"expected seconds as a float, got {_show(v)}")
        # An int is accepted when exact as a float, so it round-trips equal.
        if not -(1 << 53) <= v <= 1 << 53:
            raise FieldError(f"{v!r} is not exactly a float")
        return check(float(v))

    def dec(v: Any) -> float:
        if type(v) is not float:
            raise FieldError(f"expected a float, got {_show(v)}")
        return check(v)

    return enc, dec


def _enum_kind(enum: type[Mode] | type[Role] | type[RejectReason]) -> Kind:
    by_value: dict[str, Any] = {m.value: m for m in enum}

    def enc(v: Any) -> str:
        if not isinstance(v, enum):
            raise FieldError(f"expected a {enum.__name__}, got {_show(v)}")
        return str(v.value)

    def dec(v: Any) -> Any:
        if type(v) is not str or v not in by_value:
            raise FieldError(f"unknown {enum.__name__} {_show(v)}")
        return by_value[v]

    return enc, dec


def _seq(v: Any, lo: int, hi: int, what: str) -> tuple[Any, ...] | list[Any]:
    if not isinstance(v, (tuple, list)) or not lo <= len(v) <= hi:
        raise FieldError(f"{what}: expected {lo} to {hi} entries, got {_show(v)}")
    return v


def _wire_list(v: Any, lo: int, hi: int, what: str) -> list[Any]:
    if type(v) is not list or not lo <= len(v) <= hi:
        raise FieldError(f"{what}: expected an array of {lo} to {hi} entries, got {_show(v)}")
    return v


def _same(v: Any) -> Any:
    return v


def _array(
    item: Kind, lo: int, hi: int, what: str, check: Callable[[list[Any]], None] | None = None
) -> Kind:
    """``lo`` to ``hi`` values of kind ``item``: a tuple or list to the wire, a
    msgpack array (a list) on it, a tuple from it; ``check`` sees them all."""
    enc_one, dec_one = item

    def enc(v: Any) -> list[Any]:
        out = [enc_one(x) for x in _seq(v, lo, hi, what)]
        if check is not None:
            check(out)
        return out

    def dec(v: Any) -> tuple[Any, ...]:
        out = [dec_one(x) for x in _wire_list(v, lo, hi, what)]
        if check is not None:
            check(out)
        return tuple(out)

    return enc, dec


def _unique(error: str, at: int | None = None) -> Callable[[list[Any]], None]:
    """A check that the values (or their item ``at``) are distinct."""

    def check(values: list[Any]) -> None:
        keys = values if at is None else [v[at] for v in values]
        if len(set(keys)) != len(keys):
            raise FieldError(error)

    return check


def _source_kind(max_ranks: int) -> Kind:
    rank = _int_kind(0, max_ranks - 1)[0]

    def enc(v: Any) -> list[int]:
        if not isinstance(v, Source):
            raise FieldError(f"expected a Source, got {_show(v)}")
        return [rank(v.tp), rank(v.pp)]

    def dec(v: Any) -> Source:
        tp, pp = _wire_list(v, 2, 2, "source")
        return Source(rank(tp), rank(pp))

    return enc, dec


def _pack_ids(group: Any) -> bytes:
    if set(map(type, group)) - {int}:
        raise FieldError("block ids must be ints")
    if len(set(group)) != len(group):
        raise FieldError("duplicate block id within a KV group")
    try:
        return struct.pack(f"<{len(group)}I", *group)
    except struct.error:
        raise FieldError("block id outside [0, 2**32)") from None


def _blocks_kind(max_groups: int, max_ids: int) -> Kind:
    def enc(v: Any) -> list[bytes]:
        out: list[bytes] = []
        total = 0
        for group in _seq(v, 1, max_groups, "KV groups"):
            _seq(group, 0, max_ids - total, "block ids")
            total += len(group)
            out.append(_pack_ids(group))
        return out

    def dec(v: Any) -> tuple[tuple[int, ...], ...]:
        out: list[tuple[int, ...]] = []
        total = 0
        for raw in _wire_list(v, 1, max_groups, "KV groups"):
            if type(raw) is not bytes or len(raw) % 4:
                raise FieldError(f"a KV group must be a bin of uint32, got {_show(raw)}")
            n = len(raw) // 4
            total += n
            if total > max_ids:
                raise FieldError(f"more than {max_ids} block ids")
            ids = struct.unpack(f"<{n}I", raw)
            if len(set(ids)) != n:
                raise FieldError("duplicate block id within a KV group")
            out.append(ids)
        return tuple(out)

    return enc, dec


def _fingerprint_kind(max_entries: int, max_len: int) -> Kind:
    entry = _array(_text_kind(max_len, nonempty=False), 2, 2, "fingerprint entry")
    return _array(entry, 0, max_entries, "fingerprint", _unique("duplicate fingerprint key", 0))


#: Unpacker limits of the document inside a layout field.
_LAYOUT_LIMITS = {
    "max_str_len": 64,
    "max_bin_len": 0,
    "max_ext_len": 0,
    "max_array_len": MAX_REGIONS,
    "max_map_len": 32,
}


def capped(limit: int, error: str) -> Callable[[_T], _T]:
    """A msgpack hook that passes values through and raises :class:`FieldError`
    (``error``) once it has seen more than ``limit`` of them."""
    seen = 0

    def hook(v: _T) -> _T:
        nonlocal seen
        seen += 1
        if seen > limit:
            raise FieldError(error)
        return v

    return hook


def _layout_kind(max_bytes: int) -> Kind:
    """A KV layout as a nested msgpack document in a bin (empty = none).

    Nested so that the outer frame keeps its tight limits (no maps at all); the
    inner document gets its own bounded unpacker and the layout's own strict
    validation (:meth:`KVLayout.from_wire`).
    """

    def enc(v: Any) -> bytes:
        if v is None:
            return b""
        if not isinstance(v, KVLayout):
            raise FieldError(f"expected a KVLayout or None, got {_show(v)}")
        data: bytes = msgpack.packb(v.to_wire())
        if len(data) > max_bytes:
            raise FieldError(f"KV layout of {len(data)} bytes exceeds {max_bytes}")
        return data

    def dec(v: Any) -> KVLayout | None:
        if type(v) is not bytes or len(v) > max_bytes:
            raise FieldError(f"expected a KV layout of at most {max_bytes} bytes")
        return _unpack_layout(v) if v else None

    return enc, dec


def _unpack_layout(data: bytes) -> KVLayout:
    # Its own map, one per region and one for its staging pool.
    maps = capped(MAX_REGIONS + 2, "too many maps in the KV layout")
    # A valid layout holds one array (its regions); without this cap a 1 MiB
    # bin of nested empty arrays builds ~1M lists (~64 MiB).
    lists = capped(1, "too many arrays in the KV layout")
    try:
        obj = msgpack.unpackb(data, object_hook=maps, list_hook=lists, **_LAYOUT_LIMITS)
    except FieldError:
        raise
    except Exception as exc:  # msgpack documents "other exceptions can be raised"
        raise FieldError(f"malformed KV layout: {exc}") from None
    try:
        return KVLayout.from_wire(obj)
    except RemoteProtocolError as exc:
        raise FieldError(str(exc)) from None


def _ranks_kind(max_ranks: int, max_bytes: int) -> Kind:
    """Per-rank opaque blobs: an array of bins, bounded in count and in total."""

    def blob(error: str) -> _Conv:
        def conv(v: Any) -> bytes:
            if type(v) is not bytes:
                raise FieldError(error)
            return v

        return conv

    def check(blobs: list[bytes]) -> None:
        if sum(len(b) for b in blobs) > max_bytes:
            raise FieldError(f"rank descriptions exceed {max_bytes} bytes in all")

    return _array(
        (blob("ranks must be bytes"), blob("ranks must be bins")), 0, max_ranks, "ranks", check
    )


def _check_stage(v: list[Any]) -> None:
    """A staging slot: ``[]`` (none) or ``[offset, nbytes]``, nbytes > 0."""
    if len(v) not in (0, 2) or any(type(x) is not int or not 0 <= x <= U64_MAX for x in v):
        raise FieldError(f"expected [] or [offset, nbytes], got {_show(v)}")
    if v and v[1] == 0:
        raise FieldError("a staging slot has nbytes > 0")


# --- the message table ----------------------------------------------------------

Schema = tuple[tuple[str, Kind], ...]

#: Type byte of each control message; numbers are never reused.
TYPE_CODES: dict[type[Any], int] = {
    Hello: 1,
    HelloReject: 2,
    Register: 3,
    Withdraw: 4,
    Abort: 5,
    Settled: 6,
    Rejected: 7,
    WriteFailed: 8,
    Announce: 9,
    ReadDone: 10,
    Heartbeat: 11,
    Renew: 12,
    Extend: 13,
}


def schemas(lim: CodecLimits) -> dict[type[Any], Schema]:
    """Field kinds of every message, in declaration order, bound to ``lim``.

    One kind per field name: a field of the same name is encoded the same way
    in every message."""
    ident = _text_kind(lim.max_id_len, nonempty=True)
    epoch = _int_kind(0, EPOCH_MAX)
    lease = _seconds_kind(positive=False)
    size = _int_kind(1, lim.max_ranks)
    flag = (_bool, _bool)
    kinds: dict[str, Kind] = {
        "transfer_id": ident,
        "epoch": epoch,
        "engine_id": ident,
        "instance": _int_kind(0, U64_MAX),
        "role": _enum_kind(Role),
        "tp": size,
        "pp": size,
        "num_kv_heads": _int_kind(1, MAX_HEADS),
        "mla": flag,
        "kv_groups": _int_kind(1, lim.max_kv_groups),
        "op_bound": _seconds_kind(positive=True),
        "max_transit": _seconds_kind(positive=True),
        "fingerprint": _fingerprint_kind(lim.max_fingerprint_entries, lim.max_id_len),
        "modes": _array(_enum_kind(Mode), 1, len(Mode), "modes", _unique("duplicate mode")),
        "version": _int_kind(0, 0xFFFF),
        "layout": _layout_kind(lim.max_layout_bytes),
        "ranks": _ranks_kind(lim.max_ranks, lim.max_ranks_bytes),
        "field": _text_kind(lim.max_id_len, nonempty=False),
        "detail": _text_kind(lim.max_detail_len, nonempty=False),
        "consumer": ident,
        "blocks": _blocks_kind(lim.max_kv_groups, lim.max_block_ids),
        "lease": lease,
        "mode": _enum_kind(Mode),
        "skip_tokens": _int_kind(0, EPOCH_MAX),
        "attempt": _int_kind(0, MAX_ATTEMPT),
        "stage": _array((_same, _same), 0, 2, "stage", _check_stage),
        "reason": _enum_kind(RejectReason),
        "source": _source_kind(lim.max_ranks),
        "consumer_rank": _int_kind(0, lim.max_ranks - 1),
        "ok": flag,
        "seq": _int_kind(0, U64_MAX),
    }
    return {cls: tuple((f.name, kinds[f.name]) for f in fields(cls)) for cls in TYPE_CODES}
