"""The state-machine engine (kvpush/protocol/_machine.py) and the tables it runs."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import pytest

from kvpush.protocol import Consumer, LocalProtocolError, Producer
from kvpush.protocol._machine import Engine, Machine, Row
from kvpush.protocol._tables import CONSUMER_PULL, CONSUMER_PUSH, PEER, PRODUCER, Timer


class S(enum.Enum):
    A = "a"
    B = "b"


class In(enum.Enum):
    GO = "go"
    BACK = "back"
    TICK = "tick"


TOY: Machine[S, In] = Machine(
    {(S.A, In.GO): Row(S.B, "note", "note"), (S.B, In.BACK): Row(S.A)},
    stays={S.B: (In.TICK,)},
    timers={S.A: ((Timer.RETRY, attrgetter("at")),)},
    fires={Timer.RETRY: In.GO},
)


@dataclass
class Rec:
    state: S = S.A
    at: float = 5.0
    timers: dict[Timer, float] = field(default_factory=dict)
    log: list[tuple[float, In]] = field(default_factory=list)


class Toy(Engine):
    def __init__(self) -> None:
        super().__init__()
        self.rec = Rec()

    def _machine(self, rec: Any) -> Machine[S, In]:
        return TOY

    def _key(self, rec: Any) -> str:
        return "r"

    def _record(self, key: Any) -> Rec | None:
        return self.rec if key == "r" else None

    def _note(self, now: float, rec: Rec, inp: In) -> None:
        rec.log.append((now, inp))


def test_a_machine_maps_to_next_states_and_declares_stays_as_rows() -> None:
    assert dict(TOY) == {(S.A, In.GO): S.B, (S.B, In.BACK): S.A, (S.B, In.TICK): S.B}
    assert TOY.rows[S.B, In.TICK].effects == ()
    with pytest.raises(ValueError, match="declared twice"):
        Machine({(S.B, In.TICK): Row(S.B)}, stays={S.B: (In.TICK,)})


def test_a_remote_input_missing_from_the_table_is_counted_and_changes_nothing() -> None:
    toy = Toy()
    assert toy._step(1.0, toy.rec, In.BACK, remote=True) is False
    assert toy.rec.state is S.A and toy.rec.log == []
    assert toy._counters == {"ignored_back_in_a": 1}


def test_a_local_input_missing_from_the_table_raises() -> None:
    toy = Toy()
    with pytest.raises(LocalProtocolError, match="BACK is not allowed in state A"):
        toy._step(1.0, toy.rec, In.BACK)
    assert toy.rec.state is S.A and not toy._counters


def test_a_row_moves_the_state_then_runs_its_effects_in_order() -> None:
    toy = Toy()
    assert toy._step(2.0, toy.rec, In.GO) is True
    assert toy.rec.state is S.B
    assert toy.rec.log == [(2.0, In.GO), (2.0, In.GO)]


def test_each_state_arms_its_timers_and_cancels_the_others() -> None:
    toy = Toy()
    toy._arm_for(toy.rec)
    assert toy.rec.timers == {Timer.RETRY: 5.0} and toy.next_deadline() == 5.0
    toy._arm_for(toy.rec)  # the same time: the heap entry is kept, not pushed again
    assert len(toy._heap) == 1
    toy._step(1.0, toy.rec, In.GO)  # B arms nothing: the timer is cancelled
    assert toy.rec.timers == {}
    assert toy.next_deadline() is None
    toy.rec.at = 7.0
    toy._step(2.0, toy.rec, In.BACK)  # A again, at its new time
    assert toy.next_deadline() == 7.0
    toy.handle_timer(6.9)
    assert toy.rec.log == [(1.0, In.GO)] * 2
    toy.handle_timer(7.0)  # RETRY fires GO
    assert toy.rec.state is S.B and toy.rec.log == [(1.0, In.GO)] * 2 + [(7.0, In.GO)] * 2


def test_a_timer_at_infinity_is_not_armed() -> None:
    toy = Toy()
    toy.rec.at = math.inf
    toy._arm_for(toy.rec)
    assert toy.rec.timers == {} and toy.next_deadline() is None


MACHINES: dict[str, tuple[Machine[Any, Any], type[Any] | None]] = {
    "PEER": (PEER, None),
    "PRODUCER": (PRODUCER, Producer),
    "CONSUMER_PUSH": (CONSUMER_PUSH, Consumer),
    "CONSUMER_PULL": (CONSUMER_PULL, Consumer),
}


@pytest.mark.parametrize("name", MACHINES)
def test_every_effect_of_a_row_is_a_method_of_its_endpoint(name: str) -> None:
    machine, endpoint = MACHINES[name]
    effects = {e for row in machine.rows.values() for e in row.effects}
    if endpoint is None:
        assert not effects
    for effect in effects:
        assert callable(getattr(endpoint, f"_{effect}", None)), f"{name}: no method _{effect}"


@pytest.mark.parametrize("name", MACHINES)
def test_every_timer_fires_into_a_row_of_each_state_that_arms_it(name: str) -> None:
    """A due timer never raises: its input has a row in every state that arms
    it (of the states the machine reaches: the modes share their timers)."""
    machine, _ = MACHINES[name]
    reached = {s for s, _ in machine.rows} | {row.next for row in machine.rows.values()}
    for state, timers in machine.timers.items():
        for kind, _when in timers if state in reached else ():
            assert (state, machine.fires[kind]) in machine.rows, (state, kind)
