"""The wire codec: the only place where bytes become messages and back.

docs/protocol.md ("Wire format") has the frame and notice layouts, the field
encodings and ranges, the limits and the authentication rules. Block ids travel
as bins of uint32 (``struct`` beat numpy both ways at 64 to 2**18 ids);
``Hello.version`` travels in the body, so ``check_compatible`` can name it.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, fields
from typing import Any

import msgpack

from ._codec_fields import TYPE_CODES, FieldError, Schema, capped, schemas
from ._errors import (
    AuthenticationError,
    ConfigError,
    LocalProtocolError,
    RemoteProtocolError,
    UnsupportedVersionError,
)
from ._messages import Completion, ControlMessage, WriteFailed
from ._topology import MAX_RANKS
from ._types import MAX_ID_LEN

__all__ = (
    "MAX_NOTICE_BYTES",
    "MAX_STAGED_GROUPS",
    "MIN_SECRET_BYTES",
    "WIRE_VERSION",
    "AuthenticationError",
    "Codec",
    "CodecLimits",
    "UnsupportedVersionError",
)

#: Version of the frame layout (both frames and notices); others are refused.
WIRE_VERSION = 1
#: Largest Completion notice: ``64 + MAX_ID_LEN`` bytes.
MAX_NOTICE_BYTES = 64 + MAX_ID_LEN
#: Shortest accepted HMAC secret (bytes).
MIN_SECRET_BYTES = 16

_MAGIC = b"KVP"
_NOTICE_MAGIC = b"KVN"
_HEADER = 6
_MAC_BYTES = 32
_NOTICE_MAC_BYTES = 16
_FLAG_MAC = 0x01
_FLAG_STAGED = 0x02
_NOTICE = struct.Struct("<3sBBQHHH")
#: Most KV groups a staged notice names (keeps it within MAX_NOTICE_BYTES).
MAX_STAGED_GROUPS = 7
_HANDSHAKE_LABEL = b"kvpush channel handshake\0"


@dataclass(frozen=True, slots=True)
class CodecLimits:
    """Bounds on what one frame may hold (bytes or counts); both peers should
    use the same (docs/protocol.md, "Limits"). ``max_frame_bytes`` must hold the
    largest message the others admit, so a valid message always encodes."""

    max_frame_bytes: int = 1 << 22
    #: Block ids per frame, over all KV groups (4 bytes each on the wire).
    max_block_ids: int = 1 << 18
    #: Exclusive bound on TP ranks, PP stages and consumer ranks; TP/PP sizes <= it.
    max_ranks: int = MAX_RANKS
    #: Ids, engine ids, fingerprint keys and values, HelloReject.field (UTF-8 bytes).
    max_id_len: int = MAX_ID_LEN
    #: Free-text ``detail`` fields (UTF-8 bytes).
    max_detail_len: int = 4096
    max_fingerprint_entries: int = 64
    max_kv_groups: int = 64
    #: The KV layout a hello carries (a nested msgpack document).
    max_layout_bytes: int = 1 << 20
    #: All per-rank data-plane descriptions of a hello together.
    max_ranks_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        caps: dict[str, int] = {
            "max_ranks": MAX_RANKS,
            "max_id_len": MAX_ID_LEN,
            "max_block_ids": 1 << 28,
        }
        for f in fields(self):
            v = getattr(self, f.name)
            lo = 0 if f.name in ("max_fingerprint_entries", "max_detail_len") else 1
            hi = caps.get(f.name, 1 << 30)
            if type(v) is not int or not lo <= v <= hi:
                raise ConfigError(f"{f.name} must be an int in [{lo}, {hi}], got {v!r}")
        if self.max_frame_bytes < self.largest_frame():
            raise ConfigError(
                f"max_frame_bytes {self.max_frame_bytes} cannot hold the largest valid "
                f"message ({self.largest_frame()} bytes)"
            )

    def largest_frame(self) -> int:
        """A bound on the encoded size of any message these limits admit."""
        text, detail = self.max_id_len + 5, self.max_detail_len + 5
        blocks = 2 * text + 5 * self.max_kv_groups + 4 * self.max_block_ids
        fingerprint = text + self.max_fingerprint_entries * (1 + 2 * text)
        fixed = _HEADER + _MAC_BYTES + 128  # headers, ints, floats, enum names
        ranks = 5 + self.max_ranks * 5 + self.max_ranks_bytes
        hello = fingerprint + self.max_layout_bytes + 5 + ranks
        return fixed + max(blocks, hello, text + detail)


def _tag(key: hmac.HMAC, data: bytes) -> bytes:
    """HMAC-SHA256 of ``data`` (``key`` is keyed once; copying it is cheap)."""
    mac = key.copy()
    mac.update(data)
    return mac.digest()


def _as_bytes(data: object) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise LocalProtocolError(f"expected bytes to decode, got {type(data).__name__}")


class Codec:
    """Encodes and decodes control frames and Completion notices; stateless, so
    safe to share. ``secret`` turns on HMAC-SHA256 for every frame and notice."""

    def __init__(self, *, limits: CodecLimits | None = None, secret: bytes | None = None) -> None:
        lim = CodecLimits() if limits is None else limits
        if not isinstance(lim, CodecLimits):
            raise ConfigError(f"limits must be a CodecLimits, got {type(lim).__name__}")
        self._limits = lim
        self._mac: hmac.HMAC | None = None
        if secret is not None:
            if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
                raise ConfigError(f"secret must be bytes of at least {MIN_SECRET_BYTES} bytes")
            self._mac = hmac.new(bytes(secret), digestmod=hashlib.sha256)
        self._schemas: dict[type[Any], Schema] = schemas(lim)
        self._by_code = {code: (cls, self._schemas[cls]) for cls, code in TYPE_CODES.items()}
        self._notice = dict(self._schemas[WriteFailed])
        # A valid body holds the message array, one of blocks/fingerprint/source,
        # the fingerprint entries, modes and ranks: cap arrays, so junk cannot allocate.
        self._max_lists = lim.max_fingerprint_entries + 5
        widest = max(len(s) for s in self._schemas.values())
        self._unpack_limits = {
            "max_str_len": max(lim.max_id_len, lim.max_detail_len),
            "max_bin_len": max(4 * lim.max_block_ids, lim.max_layout_bytes, lim.max_ranks_bytes),
            "max_array_len": max(
                widest, lim.max_kv_groups, lim.max_fingerprint_entries, lim.max_ranks
            ),
            "max_map_len": 0,
            "max_ext_len": 0,
        }

    def __repr__(self) -> str:
        return f"Codec(limits={self._limits!r}, authenticated={self.authenticated})"

    @property
    def limits(self) -> CodecLimits:
        return self._limits

    @property
    def authenticated(self) -> bool:
        """Whether frames and notices carry (and must carry) a MAC."""
        return self._mac is not None

    def handshake_mac(self, data: bytes) -> bytes | None:
        """HMAC-SHA256 of ``data`` under the secret for the control channel's own
        handshake (its preamble and ack), or ``None`` without a secret. A fixed
        label keeps these tags apart from the tags of frames and notices."""
        if self._mac is None:
            return None
        return _tag(self._mac, _HANDSHAKE_LABEL + bytes(data))

    def encode(self, message: ControlMessage) -> bytes:
        """The frame for ``message``; :class:`LocalProtocolError` if it is invalid."""
        cls: type[Any] = type(message)
        schema = self._schemas.get(cls)
        if schema is None:
            hint = " (use encode_notice)" if cls is Completion else ""
            raise LocalProtocolError(f"not a control message: {cls.__name__}{hint}")
        wire: list[Any] = []
        for name, (enc, _) in schema:
            try:
                wire.append(enc(getattr(message, name)))
            except FieldError as exc:
                raise LocalProtocolError(f"{cls.__name__}.{name}: {exc}") from None
        flags = 0 if self._mac is None else _FLAG_MAC
        frame = _MAGIC + bytes((WIRE_VERSION, TYPE_CODES[cls], flags))
        body: bytes = msgpack.packb(wire, use_bin_type=True)
        frame += body
        if self._mac is not None:
            frame += _tag(self._mac, frame)
        if len(frame) > self._limits.max_frame_bytes:  # pragma: no cover - limits prevent it
            raise LocalProtocolError(f"{cls.__name__} frame of {len(frame)} bytes exceeds limit")
        return frame

    def decode(self, data: bytes | bytearray | memoryview) -> ControlMessage:
        """The message in one whole frame; :class:`RemoteProtocolError` if malformed."""
        data = _as_bytes(data)
        if len(data) > self._limits.max_frame_bytes:
            raise RemoteProtocolError(f"frame of {len(data)} bytes exceeds the limit")
        if len(data) < _HEADER or data[:3] != _MAGIC:
            raise RemoteProtocolError("not a kvpush control frame (bad magic)")
        if data[3] != WIRE_VERSION:
            raise UnsupportedVersionError(data[3], WIRE_VERSION)
        body = memoryview(data)[_HEADER : self._verify(data, data[5], _MAC_BYTES, _HEADER)]
        entry = self._by_code.get(data[4])
        if entry is None:
            raise RemoteProtocolError(f"unknown message type {data[4]}")
        cls, schema = entry
        count_lists = capped(self._max_lists, "too many arrays")
        try:
            wire = msgpack.unpackb(body, list_hook=count_lists, **self._unpack_limits)
        except Exception as exc:  # msgpack documents "other exceptions can be raised"
            raise RemoteProtocolError(f"{cls.__name__}: malformed body: {exc}") from None
        if type(wire) is not list or len(wire) != len(schema):
            raise RemoteProtocolError(f"{cls.__name__}: expected {len(schema)} fields")
        values: list[Any] = []
        for (name, (_, dec)), v in zip(schema, wire, strict=True):
            try:
                values.append(dec(v))
            except FieldError as exc:
                raise RemoteProtocolError(f"{cls.__name__}.{name}: {exc}") from None
        message: ControlMessage = cls(*values)
        return message

    def _verify(self, data: bytes, flags: int, mac_len: int, header: int) -> int:
        """Check the flags and MAC of ``data``; return where the payload ends."""
        if flags & ~_FLAG_MAC:
            raise RemoteProtocolError(f"unknown flags {flags:#04x}")
        if not flags & _FLAG_MAC:
            if self._mac is not None:
                raise AuthenticationError("frame has no MAC but a secret is configured")
            return len(data)
        if self._mac is None:
            raise AuthenticationError("frame has a MAC but no secret is configured")
        end = len(data) - mac_len
        if end < header:
            raise AuthenticationError("frame too short for its MAC")
        if not hmac.compare_digest(data[end:], _tag(self._mac, data[:end])[:mac_len]):
            raise AuthenticationError("bad MAC")
        return end

    def encode_notice(self, notice: Completion) -> bytes:
        """The compact form of ``notice`` for a transfer notification."""
        if type(notice) is not Completion:
            raise LocalProtocolError(f"not a Completion: {type(notice).__name__}")
        kinds = self._notice  # the same fields as WriteFailed's
        try:
            tid: str = kinds["transfer_id"][0](notice.transfer_id)
            epoch: int = kinds["epoch"][0](notice.epoch)
            tp, pp = kinds["source"][0](notice.source)
            rank: int = kinds["consumer_rank"][0](notice.consumer_rank)
        except FieldError as exc:
            raise LocalProtocolError(f"Completion: {exc}") from None
        staged = notice.staged
        if not isinstance(staged, tuple) or len(staged) > MAX_STAGED_GROUPS:
            raise LocalProtocolError(
                f"Completion: staged must be a tuple of <= {MAX_STAGED_GROUPS}"
            )
        if any(type(n) is not int or not 0 <= n < 1 << 32 for n in staged):
            raise LocalProtocolError("Completion: staged token counts must be uint32")
        flags = (0 if self._mac is None else _FLAG_MAC) | (_FLAG_STAGED if staged else 0)
        data = _NOTICE.pack(_NOTICE_MAGIC, WIRE_VERSION, flags, epoch, tp, pp, rank)
        if staged:
            data += struct.pack(f"<B{len(staged)}I", len(staged), *staged)
        data += tid.encode()
        if self._mac is not None:
            data += _tag(self._mac, data)[:_NOTICE_MAC_BYTES]
        return data

    def decode_notice(self, data: bytes | bytearray | memoryview) -> Completion:
        """The Completion in a notice; :class:`RemoteProtocolError` if malformed."""
        data = _as_bytes(data)
        if len(data) > MAX_NOTICE_BYTES:
            raise RemoteProtocolError(f"notice of {len(data)} bytes exceeds the limit")
        if len(data) < _NOTICE.size or data[:3] != _NOTICE_MAGIC:
            raise RemoteProtocolError("not a kvpush Completion notice (bad magic)")
        _, version, flags, epoch, tp, pp, rank = _NOTICE.unpack_from(data)
        if version != WIRE_VERSION:
            raise UnsupportedVersionError(version, WIRE_VERSION)
        end = self._verify(data, flags & ~_FLAG_STAGED, _NOTICE_MAC_BYTES, _NOTICE.size)
        at = _NOTICE.size
        staged: tuple[int, ...] = ()
        if flags & _FLAG_STAGED:
            count = data[at] if at < end else 0
            if not 1 <= count <= MAX_STAGED_GROUPS or at + 1 + 4 * count > end:
                raise RemoteProtocolError("Completion: malformed staged token counts")
            staged = struct.unpack_from(f"<{count}I", data, at + 1)
            at += 1 + 4 * count
        try:
            tid = data[at:end].decode()
        except UnicodeDecodeError:
            raise RemoteProtocolError("Completion: transfer id is not UTF-8") from None
        kinds = self._notice
        try:
            kinds["transfer_id"][1](tid)
            kinds["epoch"][1](epoch)
            source = kinds["source"][1]([tp, pp])
            kinds["consumer_rank"][1](rank)
        except FieldError as exc:
            raise RemoteProtocolError(f"Completion: {exc}") from None
        return Completion(tid, epoch, source, rank, staged)
