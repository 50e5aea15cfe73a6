"""The record the producer keeps per transfer, and its live registration.

:class:`~kvpush.protocol.Producer` moves each through ``PRODUCER`` in
``_tables.py``; the explorer keys its states by their fields (every field
decides the future unless ``explorer._EXCLUDED`` says why not).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from ._endpoint import Timer
from ._outputs import ReleaseOutcome
from ._tables import PState
from ._timeline import TimelineBuilder
from ._types import BlockIds, Mode, Pair

__all__ = ("EVERY_ATTEMPT", "Pair", "Reg", "Transfer", "Writes", "seen")


class Writes(enum.Enum):
    """How the live epoch's writes go while any is in flight (push)."""

    #: Every write that settled so far succeeded.
    DELIVERING = "delivering"
    #: A write failed: the epoch fails once the others settle.
    FAILING = "failing"
    #: The consumer moved on (withdrew the epoch, or registered a newer one),
    #: or its lease ran out before the last increment was posted: once the
    #: writes settle the KV is held again (``Settled``), or the newer epoch
    #: written.
    WITHDRAWN = "withdrawn"


@dataclass(slots=True, frozen=True)
class Reg:
    epoch: int
    peer: str
    blocks: BlockIds
    #: Producer-clock time after which no write of this epoch may start.
    lease_until: float
    mode: Mode
    skip_tokens: int = 0
    attempt: int = 0
    #: The consumer's staging slot (``Register.stage``); empty: none.
    stage: tuple[int, ...] = ()


#: ``max_attempt`` of an epoch the consumer ended (Withdraw, Abort) or
#: released on a refusal: no attempt of it may be taken any more.
EVERY_ATTEMPT = 1 << 30


@dataclass(slots=True, eq=False)
class Transfer:
    transfer_id: str
    timeline: TimelineBuilder
    state: PState = PState.IDLE
    peer: str | None = None
    max_epoch: int = 0
    #: The newest attempt of ``max_epoch`` seen: a registration is new only
    #: above (max_epoch, max_attempt). An attempt above 0 follows a
    #: ``Rejected(STALLED)``, which took nothing.
    max_attempt: int = 0
    src: BlockIds | None = None
    #: ``src`` is a prefix: the prefill still computes the rest (progressive).
    partial: bool = False
    reg: Reg | None = None
    pending: Reg | None = None
    #: Push: the pairs with a write in flight, and when each is overdue (its
    #: ``StartWrite`` plus our ``op_bound``; ``inf``: its ``Cancel`` is out).
    inflight: dict[Pair, float] = field(default_factory=dict)
    #: Push: per pair, the source blocks (per KV group) the live epoch's
    #: writes posted so far; each increment starts where the last ended.
    sent: dict[Pair, tuple[int, ...]] = field(default_factory=dict)
    #: Push: pairs whose last increment, with its completion notice, is posted.
    committed: set[Pair] = field(default_factory=set)
    #: How the in-flight writes go (``DELIVERING`` when none is in flight).
    writes: Writes = Writes.DELIVERING
    #: Epochs owed a Settled once the in-flight writes settle.
    owe: set[int] = field(default_factory=set)
    #: Why we are draining (or lending after the transfer ended).
    ending: ReleaseOutcome | None = None
    #: The epoch whose writes were all delivered (kept by the tombstone).
    delivered_epoch: int = -1
    #: The newest epoch the consumer acknowledged (push: its completion
    #: notices can reach it before our own transport reports the writes done).
    acked_epoch: int = -1
    hold_until: float = 0.0
    #: WAIT_KV: when the next Renew goes out (``inf``: none before the lease ends).
    renew_at: float = math.inf
    quarantine_at: float = 0.0
    expires_at: float = 0.0
    timers: dict[Timer, float] = field(default_factory=dict)
    #: The ``OVERDUE`` timer of ``inflight`` (apart: no state entry clears it).
    op_timer: dict[Timer, float] = field(default_factory=dict)


def seen(rec: Transfer, epoch: int) -> None:
    """The consumer ended ``epoch`` (or was told to release it): no attempt of
    it, nor of any older epoch, is taken from now on."""
    if epoch >= rec.max_epoch:
        rec.max_epoch, rec.max_attempt = epoch, EVERY_ATTEMPT
