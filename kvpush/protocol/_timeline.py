"""Where one transfer's time went, as seen by one endpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ._types import Source

__all__ = ("Timeline", "TimelineBuilder")


class Timeline(NamedTuple):
    """Times (the ``now`` values the endpoint was given) of one transfer's phases.

    Immutable; a named tuple because two are built per transfer and a tuple
    builds in C (a frozen dataclass sets each field through Python).

    A consumer fills ``reserved``, ``registration_sent``, ``write_done`` (when a
    completion arrived), ``ready``/``failed`` and ``released``; a producer fills
    ``registration_received``, ``kv_ready``, ``write_started``, ``write_done``
    (when its transport finished) and ``released``. ``None`` means "did not happen".
    """

    transfer_id: str
    epoch: int = 0
    reserved: float | None = None
    registration_sent: float | None = None
    registration_received: float | None = None
    kv_ready: float | None = None
    write_started: float | None = None
    #: ((source, consumer rank), time) for each write that finished.
    write_done: tuple[tuple[tuple[Source, int], float], ...] = ()
    ready: float | None = None
    failed: float | None = None
    released: float | None = None


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
    write_done: dict[tuple[Source, int], float] = field(default_factory=dict)
    ready: float | None = None
    failed: float | None = None
    released: float | None = None

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
            tuple(sorted(self.write_done.items())),
            self.ready,
            self.failed,
            self.released,
        )
