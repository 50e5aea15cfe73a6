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
    text = _text_kind(max_len, nonempty=False)[0]

    def check(pairs: list[tuple[str, str]]) -> None:
        if len({k for k, _ in pairs}) != len(pairs):
            raise FieldError("duplicate fingerprint key")

    def enc(v: Any) -> list[list[str]]:
        pairs = [
            tuple(_seq(p, 2, 2, "fingerprint entry"))
            for p in _seq(v, 0, max_entries, "fingerprint")
        ]
        out = [(text(k), text(x)) for k, x in pairs]
        check(out)
        return [list(p) for p in out]

    def dec(v: Any) -> tuple[tuple[str, str], ...]:
        wire = [
            _wire_list(p, 2, 2, "fingerprint entry")
            for p in _wire_list(v, 0, max_entries, "fingerprint")
        ]
        out = [(text(k), text(x)) for k, x in wire]
        check(out)
        return tuple(out)

    return enc, dec


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

    def check(blobs: list[bytes]) -> None:
        if sum(len(b) for b in blobs) > max_bytes:
            raise FieldError(f"rank descriptions exceed {max_bytes} bytes in all")

    def enc(v: Any) -> list[bytes]:
        blobs = list(_seq(v, 0, max_ranks, "ranks"))
        if any(type(b) is not bytes for b in blobs):
            raise FieldError("ranks must be bytes")
        check(blobs)
        return blobs

    def dec(v: Any) -> tuple[bytes, ...]:
        blobs = _wire_list(v, 0, max_ranks, "ranks")
        if any(type(b) is not bytes for b in blobs):
            raise FieldError("ranks must be bins")
        check(blobs)
        return tuple(blobs)

    return enc, dec


def _stage_kind() -> Kind:
    """A staging slot: ``[]`` (none) or ``[offset, nbytes]``, nbytes > 0."""

    def check(v: list[Any]) -> tuple[int, ...]:
        if len(v) not in (0, 2) or any(type(x) is not int or not 0 <= x <= U64_MAX for x in v):
            raise FieldError(f"expected [] or [offset, nbytes], got {_show(v)}")
        if v and v[1] == 0:
            raise FieldError("a staging slot has nbytes > 0")
        return tuple(v)

    def enc(v: Any) -> list[int]:
        return list(check(list(_seq(v, 0, 2, "stage"))))

    def dec(v: Any) -> tuple[int, ...]:
        return check(list(_wire_list(v, 0, 2, "stage")))

    return enc, dec


def _modes_kind() -> Kind:
    enc_one, dec_one = _enum_kind(Mode)

    def check(modes: list[Any]) -> None:
        if len(set(modes)) != len(modes):
            raise FieldError("duplicate mode")

    def enc(v: Any) -> list[str]:
        out = [enc_one(m) for m in _seq(v, 1, len(Mode), "modes")]
        check(out)
        return out

    def dec(v: Any) -> tuple[Mode, ...]:
        out = [dec_one(m) for m in _wire_list(v, 1, len(Mode), "modes")]
        check(out)
        return tuple(out)

    return enc, dec


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
    """Field kinds of every message, in declaration order, bound to ``lim``."""
    ident = _text_kind(lim.max_id_len, nonempty=True)
    epoch = _int_kind(0, EPOCH_MAX)
    lease = _seconds_kind(positive=False)
    blocks = _blocks_kind(lim.max_kv_groups, lim.max_block_ids)
    detail = _text_kind(lim.max_detail_len, nonempty=False)
    size = _int_kind(1, lim.max_ranks)
    source = _source_kind(lim.max_ranks)
    rank = _int_kind(0, lim.max_ranks - 1)
    flag = (_bool, _bool)
    attempt = _int_kind(0, MAX_ATTEMPT)
    key: Schema = (("transfer_id", ident), ("epoch", epoch))
    return {
        Hello: (
            ("engine_id", ident),
            ("instance", _int_kind(0, U64_MAX)),
            ("role", _enum_kind(Role)),
            ("tp", size),
            ("pp", size),
            ("num_kv_heads", _int_kind(1, MAX_HEADS)),
            ("mla", flag),
            ("kv_groups", _int_kind(1, lim.max_kv_groups)),
            ("op_bound", _seconds_kind(positive=True)),
            ("max_transit", _seconds_kind(positive=True)),
            ("fingerprint", _fingerprint_kind(lim.max_fingerprint_entries, lim.max_id_len)),
            ("modes", _modes_kind()),
            ("version", _int_kind(0, 0xFFFF)),
            ("layout", _layout_kind(lim.max_layout_bytes)),
            ("ranks", _ranks_kind(lim.max_ranks, lim.max_ranks_bytes)),
        ),
        HelloReject: (("field", _text_kind(lim.max_id_len, nonempty=False)), ("detail", detail)),
        Register: (
            *key,
            ("consumer", ident),
            ("blocks", blocks),
            ("lease", lease),
            ("mode", _enum_kind(Mode)),
            ("skip_tokens", _int_kind(0, EPOCH_MAX)),
            ("attempt", attempt),
            ("stage", _stage_kind()),
        ),
        Withdraw: key,
        Abort: key,
        Settled: key,
        Rejected: (*key, ("reason", _enum_kind(RejectReason)), ("attempt", attempt)),
        WriteFailed: (*key, ("source", source), ("consumer_rank", rank), ("detail", detail)),
        Announce: (*key, ("blocks", blocks), ("lease", lease)),
        ReadDone: (*key, ("ok", flag)),
        Renew: key,
        Extend: (*key, ("attempt", attempt), ("lease", lease)),
        Heartbeat: (("seq", _int_kind(0, U64_MAX)),),
    }
