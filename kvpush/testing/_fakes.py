"""A fake clock and a fake network that delays, drops, duplicates and reorders."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ("FakeClock", "FakeNetwork", "InFlight")

T = TypeVar("T")


@dataclass(slots=True)
class FakeClock:
    """Time as a plain number that only moves when told to."""

    now: float = 0.0

    def advance(self, dt: float) -> float:
        if dt < 0:
            raise ValueError("time does not run backwards")
        self.now += dt
        return self.now


@dataclass(frozen=True, slots=True)
class InFlight(Generic[T]):
    """One message on the wire."""

    seq: int
    sent_at: float
    src: str
    dst: str
    message: T


@dataclass(slots=True)
class FakeNetwork(Generic[T]):
    """Messages between named endpoints, delivered in any order the test picks.

    ``max_transit`` is the bound the protocol's timing argument assumes: a
    message older than that is never delivered (``expire`` drops it), which
    is what a runtime enforcing the bound does.
    """

    max_transit: float
    queue: list[InFlight[T]] = field(default_factory=list)
    sent: int = 0
    delivered: int = 0
    dropped: int = 0
    duplicated: int = 0
    _seq: int = 0

    def send(self, now: float, src: str, dst: str, message: T) -> None:
        self._seq += 1
        self.sent += 1
        self.queue.append(InFlight(self._seq, now, src, dst, message))

    def take(self, index: int) -> InFlight[T]:
        """Remove and return the message at ``index`` (to deliver it)."""
        self.delivered += 1
        return self.queue.pop(index)

    def drop(self, index: int) -> InFlight[T]:
        self.dropped += 1
        return self.queue.pop(index)

    def duplicate(self, index: int) -> None:
        """Queue a second copy of a message (same send time, so same deadline)."""
        self.duplicated += 1
        self._seq += 1
        m = self.queue[index]
        self.queue.append(InFlight(self._seq, m.sent_at, m.src, m.dst, m.message))

    def expire(self, now: float, *, spare: str | None = None) -> int:
        """Drop every message older than ``max_transit``; return how many.
        ``spare``: keep those addressed to it (they already reached its kernel:
        a stalled process reads them late, nobody drops them)."""
        keep = [m for m in self.queue if now - m.sent_at <= self.max_transit or m.dst == spare]
        gone = len(self.queue) - len(keep)
        self.queue = keep
        self.dropped += gone
        return gone

    def drop_to(self, name: str) -> None:
        """Drop everything addressed to or sent by ``name`` (a dead endpoint)."""
        keep = [m for m in self.queue if name not in (m.src, m.dst)]
        self.dropped += len(self.queue) - len(keep)
        self.queue = keep

    def oldest_deadline(self) -> float | None:
        """When the oldest message stops being deliverable."""
        if not self.queue:
            return None
        return min(m.sent_at for m in self.queue) + self.max_transit
