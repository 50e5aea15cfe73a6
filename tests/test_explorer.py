"""The exhaustive explorer on CI-sized configurations (the full default one
runs with `make explore`), and proof that it can fail."""

from __future__ import annotations

import pytest

from kvpush.protocol import Topology
from kvpush.protocol._endpoint import Endpoint
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


def test_every_interleaving_of_a_handshake_that_loses_a_hello() -> None:
    """Issue 13 (2): the handshake runs over the explored network, which may
    duplicate one frame and lose one hello; the retry timer recovers every
    time, and the transfer becomes ready."""
    result = explore(
        WorldConfig(producer_tp=2, consumer_tp=1, **NO_TIMEOUTS),
        transfers=1,
        preemptions=0,
        duplicates=1,
        hello_losses=1,
    )
    assert result.states > 300
    assert result.terminal_states >= 1


def test_explorer_finds_a_handshake_without_retry_wedged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the retry away (today's code): a lost hello wedges the pair."""
    monkeypatch.setattr(Endpoint, "_fire_peer", lambda self, now, kind, peer: None)
    config = WorldConfig(producer_tp=1, consumer_tp=1, **NO_TIMEOUTS)
    with pytest.raises(AssertionError, match="I5"):
        explore(config, transfers=1, preemptions=0, duplicates=0, hello_losses=1)


def test_every_interleaving_with_a_process_stall() -> None:
    """Either process stalls once, anywhere, and reads what waited late: the
    stall rule drops its lease-bearing frames (such a transfer fails by its
    deadline) and nothing else breaks."""
    result = explore(
        WorldConfig(producer_tp=2, consumer_tp=1, **NO_TIMEOUTS),
        transfers=1,
        preemptions=1,
        duplicates=0,
        stalls=1,
    )
    assert result.states > 1_000
