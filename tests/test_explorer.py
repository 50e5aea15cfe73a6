"""The exhaustive explorer on CI-sized configurations (the full default one
runs with `make explore`), and proof that it can fail."""

from __future__ import annotations

import pytest

from kvpush.protocol import Topology
from kvpush.testing import InvariantViolation, WorldConfig
from kvpush.testing.explorer import explore

NO_TIMEOUTS = {
    "max_transit": 1e6,
    "ready_timeout": 1e6,
    "kv_hold_timeout": 1e6,
    "tombstone_ttl": 2e6,
}


def test_every_interleaving_of_one_transfer_tp2_to_1_with_preemption_and_duplicate() -> None:
    result = explore(
        WorldConfig(producer_tp=2, consumer_tp=1, **NO_TIMEOUTS),
        transfers=1,
        preemptions=1,
        duplicates=1,
    )
    assert result.states > 5_000
    assert result.terminal_states >= 2


def test_two_transfers_with_and_without_partial_order_reduction() -> None:
    """The reduction skips only orders of independent moves: the same end
    states are reached, through fewer states."""
    config = WorldConfig(producer_tp=1, consumer_tp=1, **NO_TIMEOUTS)
    full = explore(config, transfers=2, preemptions=0, duplicates=0, reduce=False)
    reduced = explore(config, transfers=2, preemptions=0, duplicates=0)
    assert full.states > 400
    assert reduced.states < full.states
    assert reduced.terminal_states == full.terminal_states


def test_explorer_finds_a_consumer_that_readies_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break the per-rank completion count: some interleaving must expose it."""
    monkeypatch.setattr(Topology, "expected_total", property(lambda self: 1))
    config = WorldConfig(producer_tp=2, consumer_tp=1, **NO_TIMEOUTS)
    with pytest.raises(InvariantViolation, match="I2"):
        explore(config, transfers=1, preemptions=0)
