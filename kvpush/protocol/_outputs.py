"""What an endpoint asks its caller to do (actions) and tells it (events),
drained in order: e.g. a ``Send`` queued before a ``Released`` must be sent
before the blocks are reused.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ._messages import Completion, ControlMessage
from ._timeline import Timeline
from ._topology import Route, Topology
from ._types import BlockIds, FailureReason, Source

__all__ = (
    "Action",
    "Cancel",
    "Event",
    "Failed",
    "Output",
    "PeerFailed",
    "PeerReady",
    "Ready",
    "ReleaseOutcome",
    "Released",
    "Send",
    "SourceReleased",
    "StartRead",
    "StartWrite",
)


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to ``peer`` over the control channel."""

    peer: str
    message: ControlMessage


@dataclass(frozen=True, slots=True)
class StartWrite:
    """Producer: write ``src_blocks`` of ``route.source`` into ``dst_blocks`` of
    ``route.consumer_rank`` on ``peer``, with ``notice`` as the transfer's
    notification. Must not be posted after ``not_after`` (report it failed
    instead); report the outcome with ``write_done`` / ``write_failed``.

    One *increment* of a progressive source: ``src_blocks`` is the source so
    far, of which the first ``first[g]`` blocks of group ``g`` were written by
    this epoch's earlier increments (empty: none); only the rest is written.
    ``notice`` is ``None`` for every increment but the last (the commit)."""

    transfer_id: str
    epoch: int
    peer: str
    route: Route
    src_blocks: BlockIds
    dst_blocks: BlockIds
    not_after: float
    notice: Completion | None
    #: Tokens the consumer already holds; ``dst_blocks`` start there.
    skip_tokens: int = 0
    #: Source blocks per KV group written by earlier increments of the epoch.
    first: tuple[int, ...] = ()
    #: ``Register.stage``: the consumer's staging slot; empty: none.
    stage: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StartRead:
    """Consumer (pull): read ``src_blocks`` of ``route.source`` on ``peer`` into
    ``dst_blocks`` of ``route.consumer_rank``. Must not be posted after
    ``not_after``; report the outcome with ``read_done``."""

    transfer_id: str
    epoch: int
    peer: str
    route: Route
    src_blocks: BlockIds
    dst_blocks: BlockIds
    not_after: float
    #: Tokens the consumer already holds; ``dst_blocks`` start there.
    skip_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Cancel:
    """An op this side posted (producer: a :class:`StartWrite`; consumer: a
    :class:`StartRead`) of (``transfer_id``, ``epoch``) on the route from
    ``source`` to ``consumer_rank`` is still in flight ``op_bound`` after it
    was handed over: stop it. Report it as any op, once: failed
    (``write_failed``, ``read_done(ok=False)``) only when the transport
    confirms that nothing of it can move any more (cancelled, or its
    connection torn down), or done if it finished first. A report of failure
    on a timer's guess breaks I1: the peer reuses the blocks on it."""

    transfer_id: str
    epoch: int
    peer: str
    source: Source
    consumer_rank: int


Action = Send | StartWrite | StartRead | Cancel


class ReleaseOutcome(enum.Enum):
    """Why a producer released its source blocks."""

    #: Every write (or the consumer's reads) of the live epoch succeeded.
    DELIVERED = "delivered"
    #: Every write of the live epoch settled, at least one failed.
    FAILED = "failed"
    #: No usable registration arrived while the KV was held.
    EXPIRED = "expired"
    #: Aborted locally or by the consumer.
    ABORTED = "aborted"
    #: The consumer's connection was lost.
    PEER_LOST = "peer_lost"


@dataclass(frozen=True, slots=True)
class PeerReady:
    """The handshake with ``peer`` completed; ``topology`` maps our ranks."""

    peer: str
    topology: Topology


@dataclass(frozen=True, slots=True)
class PeerFailed:
    """The handshake with ``peer`` failed (``field`` names what differs)."""

    peer: str
    field: str
    detail: str


@dataclass(frozen=True, slots=True)
class Ready:
    """Consumer: every expected source completed (transfer, epoch). The KV in
    ``blocks`` is valid; the reservation ends here and the blocks are the
    caller's. Emitted at most once per transfer."""

    transfer_id: str
    epoch: int
    blocks: BlockIds
    timeline: Timeline


@dataclass(frozen=True, slots=True)
class Failed:
    """Consumer: (transfer, epoch) will not become ready. Its blocks come back
    with a later :class:`Released`, once no write can land in them."""

    transfer_id: str
    epoch: int
    reason: FailureReason
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Released:
    """Consumer: the blocks of (transfer, epoch) are free to reuse."""

    transfer_id: str
    epoch: int
    blocks: BlockIds
    timeline: Timeline


@dataclass(frozen=True, slots=True)
class SourceReleased:
    """Producer: the source blocks of a transfer are free to reuse."""

    transfer_id: str
    blocks: BlockIds
    outcome: ReleaseOutcome
    timeline: Timeline


Event = PeerReady | PeerFailed | Ready | Failed | Released | SourceReleased
Output = Action | Event
