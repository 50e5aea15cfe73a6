"""The exhaustive explorer on CI-sized configurations (the full default one
runs with `make explore`), and proof that it can fail."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvpush.protocol import Consumer, Topology
from kvpush.protocol._consumer import _Reservation
from kvpush.protocol._endpoint import Endpoint, Timer
from kvpush.protocol._transfer import Transfer
from kvpush.testing import InvariantViolation, World, WorldConfig
from kvpush.testing.explorer import _EXCLUDED, _KEY_FIELDS, _record_key, explore

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


def test_every_interleaving_with_an_op_that_never_reports() -> None:
    """Issue 28: a hung write or read ends only through its initiator's
    cancel, and every block comes back (I3 without exception), in every
    order with a preemption. (Without the cancel the walk never ends: the
    suspect probes go on for ever; ``tests/test_regressions.py`` shows it.)"""
    config = WorldConfig(producer_tp=1, consumer_tp=1, **NO_TIMEOUTS)
    result = explore(config, transfers=1, preemptions=1, duplicates=0, hangs=1)
    assert result.states > 200
    assert result.terminal_states >= 2


def test_every_interleaving_of_two_staged_transfers_sharing_one_slot() -> None:
    """Issue 27: the decode's pool holds one slot (two pages, a transfer's
    blocks), so the second reservation gets it only once the first ended,
    preempted or not; every staged write lands in a slot its epoch owns."""
    config = WorldConfig(producer_tp=1, consumer_tp=1, staging_pages=2, **NO_TIMEOUTS)
    result = explore(config, transfers=2, preemptions=1, duplicates=0)
    assert result.states > 1_000
    assert result.terminal_states >= 2


def test_explorer_finds_a_staging_slot_released_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give a preempted epoch's slot back at once instead of when the epoch is
    released (after the producer's Settled, or its quarantine): a new epoch
    takes it while a write of the old one may still land in it."""
    preempt = Consumer.preempt

    def early(self: Consumer, now: float, transfer_id: str) -> bool:
        rec = self._live.get(transfer_id)
        if rec is not None and rec.stage:
            self._slots.give(rec.stage)
            rec.stage = ()
        return preempt(self, now, transfer_id)

    monkeypatch.setattr(Consumer, "preempt", early)
    config = WorldConfig(producer_tp=1, consumer_tp=1, staging_pages=2, **NO_TIMEOUTS)
    with pytest.raises(InvariantViolation, match="I1"):
        explore(config, transfers=1, preemptions=1, duplicates=0)


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


def test_every_interleaving_with_a_process_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    """Either process stalls once, anywhere, and reads what waited late: the
    stall rule drops its lease-bearing frames (a Register is answered
    Rejected(STALLED) and sent again as its next attempt, an Announce waits
    for the deadline) and nothing else breaks."""
    retries: list[float] = []
    fire = Consumer._fire

    def counting(self: Consumer, now: float, kind: Timer, key: Any) -> None:
        if kind is Timer.RETRY:
            retries.append(now)
        fire(self, now, kind, key)

    monkeypatch.setattr(Consumer, "_fire", counting)
    result = explore(
        WorldConfig(producer_tp=2, consumer_tp=1, **NO_TIMEOUTS),
        transfers=1,
        preemptions=1,
        duplicates=0,
        stalls=1,
    )
    assert result.states > 1_000
    assert retries, "the model never registered again after a stall"


#: The record fields the explorer keys states by. A new field of a record
#: fails here until it is placed: here if it decides the future (most do), or
#: in the explorer's ``_EXCLUDED`` with the reason it does not.
KEYED = {
    _Reservation: "transfer_id epoch peer mode blocks deadline skip_tokens stage state done "
    "settled "
    "quarantine_at failed instance after_reads attempt probes timers reads op_timer",
    Transfer: "transfer_id state peer max_epoch max_attempt src partial reg pending inflight sent "
    "committed writes owe "
    "ending delivered_epoch acked_epoch hold_until quarantine_at expires_at timers op_timer",
}


@pytest.mark.parametrize("cls", [_Reservation, Transfer], ids=lambda c: c.__name__)
def test_state_key_places_every_record_field(cls: type[Any]) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    excluded = _EXCLUDED[cls]
    assert all(reason.strip() for reason in excluded.values())
    assert set(excluded) <= set(names), "an excluded field no longer exists"
    assert set(KEYED[cls].split()).isdisjoint(excluded)
    unplaced = set(names) - set(KEYED[cls].split()) - set(excluded)
    assert not unplaced, f"{cls.__name__}: key or exclude (with a reason) {sorted(unplaced)}"
    assert _KEY_FIELDS[cls] == tuple(n for n in names if n not in excluded)


def test_state_key_of_live_records_is_canonical() -> None:
    """Keys of records in flight have a repr that names values (no object
    addresses) and do not depend on set or dict order."""
    world = World(WorldConfig(producer_tp=2, consumer_tp=1, **NO_TIMEOUTS))
    world.reserve("t0")
    world.kv_ready("t0")
    while world.net.queue:
        world.deliver(0)
    records: list[Any] = [*world.consumer._res.values(), *world.producer._tx.values()]
    assert {type(r) for r in records} == {_Reservation, Transfer}
    for rec in records:
        key = _record_key(rec)
        assert " at 0x" not in key
        shuffled = dict(reversed(rec.timers.items()))
        assert key == _record_key(dataclasses.replace(rec, timers=shuffled))
