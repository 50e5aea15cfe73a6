"""``kvpush simulate``: a discrete-event model of a P/D fleet driven by the
real protocol core (see docs/simulation.md).

Prefill and decode instances, their compute, control costs and links are
modelled; reservation, registration, rendezvous, epochs and per-rank
completion are the real :mod:`kvpush.protocol` endpoints, run on a simulated
clock.
"""

from __future__ import annotations

from ._fleet import MODES, Fleet
from ._params import Scenario, ScenarioError, available_scenarios, load_scenario
from ._run import Result, Row, simulate

__all__ = (
    "MODES",
    "Fleet",
    "Result",
    "Row",
    "Scenario",
    "ScenarioError",
    "available_scenarios",
    "load_scenario",
    "simulate",
)
