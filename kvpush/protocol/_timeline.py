"""Where one transfer's time went, as seen by one endpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ._errors import LocalProtocolError
from ._types import Pair

__all__ = ("OpStamps", "Timeline", "TimelineBuilder")


class OpStamps(NamedTuple):
    """When the data plane took, planned, posted and saw settled one write or
    read (the endpoint's clock); the adapter passes them in with the result."""

    plan_started: float
    planned: float
    posted: float
    done: float
    #: Bytes the op moved staged; 0: written in place.
    staged: int = 0

    def check(self) -> OpStamps:
        """``self``; :class:`LocalProtocolError` unless the stamps are in order."""
        if not self.plan_started <= self.planned <= self.posted <= self.done:
            raise LocalProtocolError(f"op stamps out of order: {self!r}")
        return self


class Timeline(NamedTuple):
    """The ``now`` values of one transfer's phases, as one endpoint saw them
    (each field: docs/api.md, "Timelines"); ``None`` or empty: did not happen.
    A named tuple: two are built per transfer, and a tuple builds in C."""

    transfer_id: str
    epoch: int = 0
    reserved: float | None = None
    registration_sent: float | None = None
    registration_received: float | None = None
    kv_ready: float | None = None
    write_started: float | None = None
    write_done: tuple[tuple[Pair, float], ...] = ()
    ready: float | None = None
    failed: float | None = None
    released: float | None = None
    ops: tuple[tuple[Pair, OpStamps], ...] = ()
    notice_seen: tuple[tuple[Pair, float], ...] = ()
    delivered: float | None = None
    renewed: tuple[float, ...] = ()
    suspect: float | None = None


@dataclass(slots=True)
class TimelineBuilder:
    """Mutable twin of :class:`Timeline`, owned by one transfer record."""

    transfer_id: str
    epoch: int = 0
    reserved: float | None = None
    registration_sent: float | None = None
    registration_received: float | None = None
    kv_ready: float | None = None
    write_started: float | None = None
    write_done: dict[Pair, float] = field(default_factory=dict)
    ready: float | None = None
    failed: float | None = None
    released: float | None = None
    ops: dict[Pair, OpStamps] = field(default_factory=dict)
    notice_seen: dict[Pair, float] = field(default_factory=dict)
    #: Never set by the core (see :class:`Timeline`).
    delivered: float | None = None
    renewed: list[float] = field(default_factory=list)
    suspect: float | None = None

    def freeze(self) -> Timeline:
        """A frozen snapshot."""
        return Timeline(
            self.transfer_id,
            self.epoch,
            self.reserved,
            self.registration_sent,
            self.registration_received,
            self.kv_ready,
            self.write_started,
            tuple(sorted(self.write_done.items())) if self.write_done else (),
            self.ready,
            self.failed,
            self.released,
            tuple(sorted(self.ops.items())) if self.ops else (),
            tuple(sorted(self.notice_seen.items())) if self.notice_seen else (),
            self.delivered,
            tuple(self.renewed),
            self.suspect,
        )
