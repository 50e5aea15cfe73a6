"""Where one transfer's time went, as seen by one endpoint."""

from __future__ import annotations

from dataclasses import dataclass, field

from ._types import Source

__all__ = ("Timeline", "TimelineBuilder")


@dataclass(frozen=True, slots=True)
class Timeline:
    """Times (the ``now`` values the endpoint was given) of one transfer's phases.

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


def _by_pair(item: tuple[tuple[Source, int], float]) -> tuple[int, int, int]:
    """Sort key of a ``write_done`` item: the order of (source, consumer rank),
    without calling the dataclass comparison methods of :class:`Source`."""
    (source, rank), _ = item
    return (source.tp, source.pp, rank)


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
            tuple(sorted(self.write_done.items(), key=_by_pair)),
            self.ready,
            self.failed,
            self.released,
        )
