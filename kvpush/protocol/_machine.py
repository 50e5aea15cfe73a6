"""One engine for the state machines of the core (h2's ``stream.py`` is the model).

A :class:`Machine` is one table: rows ``(state, input) -> Row(next, effects)``,
the timers each state keeps armed, and the input each timer feeds.
:class:`Engine`, the base of both endpoints, applies an input to a record:

1. it looks the row up; an input the table lacks is refused, counted as
   ``ignored_<input>_in_<state>`` if it is remote (a message, a transport
   result, a lost connection) and raised as :class:`LocalProtocolError` if it
   is local (an API call or a timer), the state unchanged either way;
2. it moves the record to ``row.next`` and runs ``row.effects`` in order: an
   effect ``name`` is the endpoint's method ``_name(now, rec, inp)``;
3. it arms the timers of the new state, each at the time its function reads
   from the record (``inf``: not armed), and cancels the others.

Every record's timers share one heap, lazily invalidated: an entry counts
while its record still has that kind armed at that time.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from ._errors import LocalProtocolError

__all__ = ("Engine", "Machine", "Row")

S = TypeVar("S", bound=enum.Enum)
In = TypeVar("In", bound=enum.Enum)

#: When a timer fires, read from the record (``inf``: it is not armed).
When = Callable[[Any], float]

#: A heap entry: (when, seq, kind, key). A plain tuple, so the heap compares in C;
#: ``seq`` is unique, so ``kind`` and ``key`` are never compared.
_Entry = tuple[float, int, Hashable, Hashable]


class Row(Generic[S]):
    """What an input does in a state: the next state, then the effects in order."""

    __slots__ = ("effects", "next")

    def __init__(self, next: S, *effects: str) -> None:
        self.next = next
        self.effects = effects


class Machine(Mapping[tuple[S, In], S]):
    """A transition table. As a mapping it takes ``(state, input)`` to the next
    state; ``rows`` holds the whole rows. ``stays``: per state, the inputs that
    keep it with no effect (rows of their own, declared compactly). ``timers``:
    per state, the ``(kind, when)`` it keeps armed. ``fires``: the input each
    kind of timer feeds."""

    def __init__(
        self,
        rows: Mapping[tuple[S, In], Row[S]],
        *,
        stays: Mapping[S, Iterable[In]] | None = None,
        timers: Mapping[S, Iterable[tuple[Any, When]]] | None = None,
        fires: Mapping[Any, In] | None = None,
    ) -> None:
        self.rows: dict[tuple[S, In], Row[S]] = dict(rows)
        self.stays = {s: tuple(inputs) for s, inputs in (stays or {}).items()}
        for state, inputs in self.stays.items():
            for inp in inputs:
                if (state, inp) in self.rows:
                    raise ValueError(f"({state.name}, {inp.name}) is declared twice")
                self.rows[(state, inp)] = Row(state)
        self.timers = {s: tuple(t) for s, t in (timers or {}).items()}
        self.fires: dict[Any, In] = dict(fires or {})

    def __getitem__(self, key: tuple[S, In]) -> S:
        return self.rows[key].next

    def __iter__(self) -> Iterator[tuple[S, In]]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


class Engine:
    """A record has ``state`` and ``timers`` (kind -> time armed)."""

    def __init__(self) -> None:
        self._counters: Counter[str] = Counter()
        self._heap: list[_Entry] = []
        self._seq = 0

    # An endpoint supplies the machine a record moves through, the key that
    # names it in the heap, and the record a key names (``None``: it is gone).

    def _machine(self, rec: Any) -> Machine[Any, Any]:
        raise NotImplementedError

    def _key(self, rec: Any) -> Hashable:
        raise NotImplementedError

    def _record(self, key: Hashable) -> Any:
        raise NotImplementedError

    def _timer_input(self, now: float, kind: Any, rec: Any) -> Any:
        """The input a due timer of ``rec`` feeds (an endpoint adds guards)."""
        return self._machine(rec).fires[kind]

    def _step(self, now: float, rec: Any, inp: Any, *, remote: bool = False) -> bool:
        """Apply ``inp`` to ``rec``; returns whether the table allowed it."""
        machine = self._machine(rec)
        old = rec.state
        row = machine.rows.get((old, inp))
        if row is None:
            if remote:
                self._counters[f"ignored_{inp.value}_in_{old.value}"] += 1
                return False
            raise LocalProtocolError(f"{inp.name} is not allowed in state {old.name}")
        rec.state = row.next
        for effect in row.effects:
            getattr(self, f"_{effect}")(now, rec, inp)
        if machine.timers:
            self._arm_for(rec)
        return True

    def _arm_for(self, rec: Any) -> None:
        """Arm the timers of ``rec``'s state at their times; cancel the others."""
        old, rec.timers = rec.timers, {}
        for kind, when in self._machine(rec).timers.get(rec.state, ()):
            at = when(rec)
            if at == math.inf:
                continue
            if old.get(kind) == at:  # its heap entry is still queued and valid
                rec.timers[kind] = at
            else:
                self._arm(rec.timers, kind, at, self._key(rec))

    def _arm(self, timers: dict[Any, float], kind: Hashable, when: float, key: Hashable) -> None:
        timers[kind] = when
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, kind, key))

    def _timers_of(self, key: Hashable) -> dict[Any, float] | None:
        """The timers armed under ``key`` (``None``: its owner is gone)."""
        rec = self._record(key)
        return None if rec is None else rec.timers

    def _fire(self, now: float, kind: Hashable, key: Hashable) -> None:
        """A valid heap entry is due: feed its record the input it names (an
        endpoint routes keys of its own first)."""
        rec = self._record(key)
        del rec.timers[kind]
        self._step(now, rec, self._timer_input(now, kind, rec))

    def next_deadline(self) -> float | None:
        """The earliest time at which :meth:`handle_timer` has work, or ``None``."""
        heap = self._heap
        while heap:
            top = heap[0]
            if self._valid(top):
                return top[0]
            heapq.heappop(heap)
        return None

    def handle_timer(self, now: float) -> None:
        """Fire every timer due at or before ``now``."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if self._valid(entry):
                self._fire(now, entry[2], entry[3])

    def _valid(self, entry: _Entry) -> bool:
        when, _, kind, key = entry
        timers = self._timers_of(key)
        return timers is not None and timers.get(kind) == when
