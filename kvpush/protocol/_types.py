"""Small value types shared by every part of the core."""

from __future__ import annotations

import enum
from typing import NamedTuple

from ._errors import LocalProtocolError

__all__ = (
    "MAX_DETAIL_LEN",
    "MAX_ID_LEN",
    "BlockIds",
    "FailureReason",
    "Mode",
    "Pair",
    "RejectReason",
    "Role",
    "Source",
    "check_blocks",
    "check_transfer_id",
    "clip_detail",
)

#: Longest transfer id or engine id accepted anywhere (bytes of UTF-8 text).
MAX_ID_LEN = 256

#: Longest free-text ``detail`` the core puts in a message (UTF-8 bytes).
MAX_DETAIL_LEN = 1024

#: Block ids per KV group: ``blocks[g]`` lists the block ids of KV group ``g``.
BlockIds = tuple[tuple[int, ...], ...]


class Mode(enum.Enum):
    """Who moves the bytes for one transfer (chosen per transfer)."""

    #: The producer WRITEs into blocks the consumer registered in advance.
    PUSH = "push"
    #: The producer announces its blocks; the consumer READs them.
    PULL = "pull"


class Role(enum.Enum):
    """Which side of the handoff an endpoint plays."""

    #: The prefill side: owns the computed KV (the source blocks).
    PRODUCER = "producer"
    #: The decode side: owns the destination blocks.
    CONSUMER = "consumer"


class FailureReason(enum.Enum):
    """Why a transfer (one epoch of it) failed."""

    #: Not ready by its deadline.
    TIMEOUT = "timeout"
    #: A write or read failed to post or failed in flight.
    TRANSFER_FAILED = "transfer_failed"
    #: The producer refused the registration (see :class:`RejectReason`).
    REJECTED = "rejected"
    #: The peer aborted the transfer.
    PEER_ABORTED = "peer_aborted"
    #: The peer's connection was lost.
    PEER_LOST = "peer_lost"
    #: The handshake with the peer failed (incompatible or refused).
    HANDSHAKE_FAILED = "handshake_failed"


class RejectReason(enum.Enum):
    """Why a producer refused a registration. Every rejection implies that
    nothing was, or ever will be, written for that (transfer, epoch)."""

    #: The producer already released the transfer (tombstone).
    RELEASED = "released"
    #: The registration's lease ran out before the KV was ready.
    LEASE_EXPIRED = "lease_expired"
    #: A newer epoch of the same transfer superseded this one.
    SUPERSEDED = "superseded"
    #: The registration came from a peer without a completed handshake.
    UNKNOWN_PEER = "unknown_peer"
    #: Another consumer already registered this transfer.
    PEER_MISMATCH = "peer_mismatch"
    #: The registration does not fit the handshake (wrong group count).
    INVALID = "invalid"
    #: The registration was read just after this process stalled, so it may be
    #: older than its lease, and was dropped unread (the stall rule).
    STALLED = "stalled"


class Source(NamedTuple):
    """One producer rank: its tensor-parallel rank and pipeline stage (a named
    tuple: it is hashed on every completion, and a tuple hashes in C)."""

    tp: int
    pp: int = 0


#: A (producer source, consumer rank) pair: one route's ops and completion.
Pair = tuple[Source, int]


def clip_detail(detail: str) -> str:
    """``detail`` cut to at most :data:`MAX_DETAIL_LEN` UTF-8 bytes."""
    data = detail.encode()
    if len(data) <= MAX_DETAIL_LEN:
        return detail
    return data[: MAX_DETAIL_LEN - 3].decode(errors="ignore") + "..."


def check_transfer_id(transfer_id: str) -> str:
    """Validate a router-assigned transfer id and return it."""
    if not isinstance(transfer_id, str) or not transfer_id:
        raise LocalProtocolError("transfer id must be a non-empty str")
    if len(transfer_id.encode()) > MAX_ID_LEN:
        raise LocalProtocolError(f"transfer id longer than {MAX_ID_LEN} bytes")
    return transfer_id


def check_blocks(blocks: object, groups: int | None = None) -> BlockIds:
    """Normalise block ids per KV group to a tuple of tuples, validating them."""
    if not isinstance(blocks, (tuple, list)) or not blocks:
        raise LocalProtocolError("blocks must be a non-empty sequence of groups")
    out: list[tuple[int, ...]] = []
    for group in blocks:
        if not isinstance(group, (tuple, list)):
            raise LocalProtocolError("each KV group must be a sequence of block ids")
        ids = tuple(group)
        for b in ids:
            if type(b) is not int or b < 0:
                raise LocalProtocolError(f"block id {b!r} is not a non-negative int")
        if len(set(ids)) != len(ids):
            raise LocalProtocolError("duplicate block id within a KV group")
        out.append(ids)
    if groups is not None and len(out) != groups:
        raise LocalProtocolError(f"expected {groups} KV groups, got {len(out)}")
    return tuple(out)
