"""A discrete-event heap: callbacks at simulated times, run in time order.

Ties run in the order they were scheduled (a sequence number), so a run is a
pure function of its inputs and seed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

__all__ = ("EventLoop",)

Callback = Callable[[], None]


class EventLoop:
    """``now`` only moves when :meth:`run` pops the next event."""

    __slots__ = ("_heap", "_seq", "events", "now")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callback]] = []
        self._seq = 0
        #: Events run so far.
        self.events = 0

    def at(self, when: float, fn: Callback) -> None:
        """Run ``fn`` at ``when`` (never earlier than now)."""
        self._seq += 1
        heapq.heappush(self._heap, (when if when > self.now else self.now, self._seq, fn))

    def after(self, delay: float, fn: Callback) -> None:
        self.at(self.now + delay, fn)

    def pending(self) -> int:
        return len(self._heap)

    def run(self, until: float = float("inf"), max_events: int = 200_000_000) -> None:
        """Run events up to time ``until`` (inclusive), or until none is left."""
        heap = self._heap
        pop = heapq.heappop
        n = 0
        while heap and heap[0][0] <= until:
            when, _, fn = pop(heap)
            self.now = when
            fn()
            n += 1
            if n >= max_events:
                raise RuntimeError(f"more than {max_events} events: the model does not settle")
        self.events += n
