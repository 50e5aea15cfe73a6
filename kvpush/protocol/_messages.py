"""Control messages exchanged between a producer and a consumer endpoint.

Small frozen values, checked by the codec; what each promises:
docs/protocol.md, "Messages".
"""

from __future__ import annotations

from dataclasses import dataclass

from ._layout import KVLayout
from ._types import BlockIds, Mode, RejectReason, Role, Source

__all__ = (
    "PROTOCOL_VERSION",
    "Abort",
    "Announce",
    "Completion",
    "ControlMessage",
    "Extend",
    "Heartbeat",
    "Hello",
    "HelloReject",
    "ReadDone",
    "Register",
    "Rejected",
    "Renew",
    "Settled",
    "Withdraw",
    "WriteFailed",
)

#: Version of the control protocol; both peers must speak the same one.
PROTOCOL_VERSION = 3


@dataclass(frozen=True, slots=True)
class Hello:
    """Handshake: who I am and what must match between us."""

    engine_id: str
    #: Fresh per process start: a new one under a known engine id is a restart.
    instance: int
    role: Role
    tp: int
    pp: int
    num_kv_heads: int
    mla: bool
    kv_groups: int
    #: Seconds a posted write or read may stay in flight (the peer's quarantine).
    op_bound: float
    #: Seconds a control frame may take to arrive; equal on both sides.
    max_transit: float
    #: Named values that must be equal on both sides.
    fingerprint: tuple[tuple[str, str], ...] = ()
    modes: tuple[Mode, ...] = (Mode.PUSH, Mode.PULL)
    version: int = PROTOCOL_VERSION
    #: A registration may only name blocks inside it.
    layout: KVLayout | None = None
    #: Opaque per-rank data-plane descriptions, in rank order (the runtime's).
    ranks: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class HelloReject:
    """Handshake refused; ``field`` names what differs."""

    field: str
    detail: str


@dataclass(frozen=True, slots=True)
class Register:
    """Consumer -> producer: write (push) or lend (pull) this transfer's KV;
    no write may start later than ``lease`` seconds after receipt."""

    transfer_id: str
    epoch: int
    consumer: str
    blocks: BlockIds
    lease: float
    mode: Mode = Mode.PUSH
    #: Tokens the consumer already holds (a prefix hit): ``blocks`` start there.
    skip_tokens: int = 0
    #: Times this epoch was sent again after ``Rejected(STALLED)``.
    attempt: int = 0
    #: Push: ``(offset, nbytes)`` of this epoch's staging slot; empty: in place.
    stage: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Withdraw:
    """Consumer -> producer: the consumer preempted this epoch; keep the KV for a
    newer one. Answered by :class:`Settled` once no write of it can land."""

    transfer_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Abort:
    """Either way: the transfer is over. ``epoch`` 0 means "no epoch known".
    A producer answers a consumer's abort with :class:`Settled`; a producer that
    aborts sends :class:`Settled` itself once its writes settle."""

    transfer_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Settled:
    """Producer -> consumer: no write of (transfer, epoch) is in flight and none
    will ever start; the consumer may reuse that epoch's blocks."""

    transfer_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """Producer -> consumer: registration refused; nothing was or will be written
    for that ``attempt`` of the epoch, nor for any earlier one."""

    transfer_id: str
    epoch: int
    reason: RejectReason
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class WriteFailed:
    """Producer -> consumer: the write ``source -> consumer_rank`` failed (or
    failed to post) and has settled; it will not land."""

    transfer_id: str
    epoch: int
    source: Source
    consumer_rank: int
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Announce:
    """Producer -> consumer (pull): the KV is ready in ``blocks``; read it by
    ``lease`` seconds after receipt, then answer :class:`ReadDone`."""

    transfer_id: str
    epoch: int
    blocks: BlockIds
    lease: float


@dataclass(frozen=True, slots=True)
class ReadDone:
    """Consumer -> producer: the consumer is done with the source of (transfer,
    epoch). Pull: every read has settled (``ok``: all succeeded). Push: the
    epoch is ready (always ``ok``), the acknowledgment that ends the
    producer's hold of delivered KV (docs/protocol.md, "Hold until
    acknowledged")."""

    transfer_id: str
    epoch: int
    ok: bool


@dataclass(frozen=True, slots=True)
class Renew:
    """Either way: "still working on this transfer, keep it". Producer ->
    consumer: it holds the registration of ``epoch`` and is still computing
    the KV (the consumer answers :class:`Extend`). Consumer -> producer,
    ``epoch`` 0: a decode that cannot reserve yet asks the producer to keep
    the ready KV (its hold is extended)."""

    transfer_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Extend:
    """Consumer -> producer: the registration of (transfer, epoch, attempt)
    may start its writes (or lend) until ``lease`` seconds after receipt; the
    consumer moved its deadline and quarantine before sending it."""

    transfer_id: str
    epoch: int
    attempt: int
    lease: float


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Liveness probe for the control channel (the runtime's business)."""

    seq: int


@dataclass(frozen=True, slots=True)
class Completion:
    """Data-plane notice: ``source`` finished writing (transfer, epoch) to
    ``consumer_rank``. Carried by the transfer itself, after its data."""

    transfer_id: str
    epoch: int
    source: Source
    consumer_rank: int
    #: Per KV group, the tokens this write left in the staging slot; empty: in place.
    staged: tuple[int, ...] = ()


ControlMessage = (
    Hello
    | HelloReject
    | Register
    | Withdraw
    | Abort
    | Settled
    | Rejected
    | WriteFailed
    | Announce
    | ReadDone
    | Renew
    | Extend
    | Heartbeat
)
