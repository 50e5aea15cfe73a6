"""Where one transfer's time went, as seen by one endpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ._errors import LocalProtocolError
from ._types import Source

__all__ = ("OpStamps", "Timeline", "TimelineBuilder")

Pair = tuple[Source, int]


class OpStamps(NamedTuple):
    """When the data plane handled one write or read (the clock of the
    endpoint's ``now``): it took the action and started planning it
    (``plan_started``), had the plan (``planned``), had posted it on the
    transport (``posted``), and saw the transport report it settled
    (``done``). The adapter measures them and passes them in with the result
    (the core reads no clock)."""

    plan_started: float
    planned: float
    posted: float
    done: float
    #: Bytes the op moved staged (gathered, written as spans, scattered on
    #: arrival); 0: written in place.
    staged: int = 0

    def check(self) -> OpStamps:
        """``self``; :class:`LocalProtocolError` unless the stamps are in order."""
        if not self.plan_started <= self.planned <= self.posted <= self.done:
            raise LocalProtocolError(f"op stamps out of order: {self!r}")
        return self


class Timeline(NamedTuple):
    """Times (the ``now`` values the endpoint was given) of one transfer's phases.

    Immutable; a named tuple because two are built per transfer and a tuple
    builds in C (a frozen dataclass sets each field through Python).

    A consumer fills ``reserved``, ``registration_sent``, ``write_done`` (when
    the core took a completion, or a read's result), ``notice_seen`` (when its
    data plane polled each completion notice), ``ops`` (pull: its data plane's
    stamps of each read), ``ready``/``failed`` and ``released``; a producer
    fills ``registration_received``, ``kv_ready``, ``write_started`` (when it
    asked for the writes, or sent the Announce), ``ops`` (push: its data
    plane's stamps of each write), ``write_done`` (when the core took each
    write's result) and ``released``. ``delivered`` is not the core's: the
    runtime sets it on a :class:`Ready` when it hands the event to its caller.
    ``renewed``: when each lease renewal happened (consumer: each deadline
    extension it granted; producer: each :class:`~kvpush.protocol.Renew` it
    sent). ``suspect`` (consumer): when a failed epoch's quarantine passed
    with its producer connected and silent, so its blocks were held as
    suspect. ``None`` (or empty) means "did not happen" or "not measured".
    """

    transfer_id: str
    epoch: int = 0
    reserved: float | None = None
    registration_sent: float | None = None
    registration_received: float | None = None
    kv_ready: float | None = None
    write_started: float | None = None
    #: ((source, consumer rank), time) for each write that finished.
    write_done: tuple[tuple[Pair, float], ...] = ()
    ready: float | None = None
    failed: float | None = None
    released: float | None = None
    #: ((source, consumer rank), stamps) for each write (producer) or read
    #: (consumer) whose data plane measured it.
    ops: tuple[tuple[Pair, OpStamps], ...] = ()
    #: ((source, consumer rank), time) the consumer's data plane polled each notice.
    notice_seen: tuple[tuple[Pair, float], ...] = ()
    #: When the runtime handed the Ready to its caller.
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
