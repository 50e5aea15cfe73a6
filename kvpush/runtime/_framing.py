"""Length-prefixed frames on a byte stream, and the control channel's preamble
and ack, sealed with the codec's secret if it has one. The byte layouts, and
why the reader checks a length before it reads: docs/runtime.md, "The
channel's wire format".
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from typing import Any

import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from kvpush.protocol import (
    MAX_ID_LEN,
    AuthenticationError,
    Codec,
    LocalProtocolError,
    RemoteProtocolError,
)

__all__ = (
    "MAX_HANDSHAKE_BYTES",
    "MAX_PREAMBLE_BYTES",
    "Ack",
    "FramingError",
    "Preamble",
    "encode_frame",
    "read_frame",
    "seal",
    "unseal",
    "write_frame",
)

_PREFIX = struct.Struct(">I")
#: Largest payload a 4-byte length prefix can describe.
_MAX_LENGTH = (1 << 32) - 1

_PREAMBLE_MAGIC = b"KVPCH1"
_ACK_MAGIC = b"KVPAK1"
_PREAMBLE = struct.Struct(">6sQQQ")
_ACK = struct.Struct(">6sQQ")
_SEAL_MAGIC = b"KVPMAC"
_SEAL_MAC_BYTES = 32
#: Largest preamble or ack payload (a name is at most MAX_ID_LEN UTF-8 bytes).
MAX_PREAMBLE_BYTES = _PREAMBLE.size + MAX_ID_LEN
#: Largest handshake frame: a preamble or ack, sealed.
MAX_HANDSHAKE_BYTES = len(_SEAL_MAGIC) + _SEAL_MAC_BYTES + MAX_PREAMBLE_BYTES


class FramingError(RemoteProtocolError):
    """The byte stream is not a sequence of valid frames (a length over the
    limit, or a malformed preamble): the connection cannot continue."""


def encode_frame(payload: bytes) -> bytes:
    """``payload`` with its length prefix (frames are concatenated as they are)."""
    if len(payload) > _MAX_LENGTH:
        raise LocalProtocolError(f"payload of {len(payload)} bytes cannot be framed")
    return _PREFIX.pack(len(payload)) + payload


async def write_frame(
    stream: anyio.abc.ByteSendStream, payload: bytes, *, max_frame_bytes: int | None = None
) -> None:
    """Send one frame (a single ``send``, so frames never interleave on a stream
    written by one task at a time). :class:`LocalProtocolError` if ``payload`` is
    longer than ``max_frame_bytes``; the stream's own errors propagate."""
    if max_frame_bytes is not None and len(payload) > max_frame_bytes:
        raise LocalProtocolError(
            f"frame of {len(payload)} bytes exceeds the limit of {max_frame_bytes}"
        )
    await stream.send(encode_frame(payload))


async def read_frame(stream: BufferedByteReceiveStream, *, max_frame_bytes: int) -> bytes:
    """Receive one frame's payload. ``stream`` wraps the connection once for
    its whole life (bytes buffered past one frame belong to the next). Raises
    :class:`FramingError` for a length over ``max_frame_bytes`` (nothing of the
    payload read), :class:`anyio.IncompleteRead` when the stream ends (even at
    a frame boundary), and the stream's own errors."""
    (length,) = _PREFIX.unpack(await stream.receive_exactly(_PREFIX.size))
    if length > max_frame_bytes:
        raise FramingError(f"frame length {length} exceeds the limit of {max_frame_bytes} bytes")
    if length == 0:
        return b""
    return await stream.receive_exactly(length)


def _unpack(data: bytes, head: struct.Struct, magic: bytes, what: str) -> tuple[Any, ...]:
    """``(name, *integers)`` of a preamble or ack; :class:`FramingError` unless
    ``data`` is a well-formed one."""
    if len(data) <= head.size or data[:6] != magic:
        raise FramingError(f"not a kvpush channel {what}")
    try:
        name = data[head.size :].decode()
    except UnicodeDecodeError:
        raise FramingError(f"{what}: name is not UTF-8") from None
    if len(data) - head.size > MAX_ID_LEN:
        raise FramingError(f"{what}: name must be 1 to {MAX_ID_LEN} bytes")
    return name, *head.unpack_from(data)[1:]


@dataclass(frozen=True, slots=True)
class Preamble:
    """The dialer's first frame: who it is, and which connection this replaces."""

    name: str
    instance: int
    conn_id: int
    supersedes: int = 0

    def encode(self) -> bytes:
        head = _PREAMBLE.pack(_PREAMBLE_MAGIC, self.instance, self.conn_id, self.supersedes)
        return head + self.name.encode()

    @classmethod
    def decode(cls, data: bytes) -> Preamble:
        return cls(*_unpack(data, _PREAMBLE, _PREAMBLE_MAGIC, "preamble"))


@dataclass(frozen=True, slots=True)
class Ack:
    """The acceptor's answer: the connection is accepted, and who it reached."""

    name: str
    instance: int
    conn_id: int

    def encode(self) -> bytes:
        return _ACK.pack(_ACK_MAGIC, self.instance, self.conn_id) + self.name.encode()

    @classmethod
    def decode(cls, data: bytes) -> Ack:
        return cls(*_unpack(data, _ACK, _ACK_MAGIC, "ack"))


def seal(payload: bytes, codec: Codec) -> bytes:
    """A preamble or ack as sent: sealed with the codec's secret, or as is without one."""
    mac = codec.handshake_mac(payload)
    return payload if mac is None else _SEAL_MAGIC + mac + payload


def unseal(data: bytes, codec: Codec) -> bytes:
    """The preamble or ack inside ``data``; :class:`AuthenticationError` if its
    seal is missing or wrong (with a secret), or present (without one)."""
    sealed = data[: len(_SEAL_MAGIC)] == _SEAL_MAGIC
    head = len(_SEAL_MAGIC) + _SEAL_MAC_BYTES
    if not codec.authenticated:
        if sealed:
            raise AuthenticationError("handshake has a MAC but no secret is configured")
        return data
    if not sealed:
        raise AuthenticationError("handshake has no MAC but a secret is configured")
    payload = data[head:]
    mac = codec.handshake_mac(payload)
    if (
        mac is None
        or len(data) <= head
        or not hmac.compare_digest(data[len(_SEAL_MAGIC) : head], mac)
    ):
        raise AuthenticationError("handshake has a bad MAC")
    return payload
