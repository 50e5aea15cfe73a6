"""The routing policy (kvpush.routing): capacity, spread, determinism, tie-breaks."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.protocol import ConfigError, LocalProtocolError
from kvpush.routing import Health, InstanceLoad, Ledger, Pick, pick

loads = st.builds(
    InstanceLoad,
    outstanding=st.integers(0, 4),
    reserved_blocks=st.integers(0, 12),
    capacity=st.none() | st.integers(0, 12),
)
sides = st.lists(loads, min_size=1, max_size=5)
sizes = st.integers(1, 6)
#: pair_used[p][d] for up to 6 x 6 pairs.
row = st.lists(st.integers(0, 3), min_size=6, max_size=6)
used = st.lists(row, min_size=6, max_size=6)


def key(x: InstanceLoad) -> tuple[int, int]:
    return x.reserved_blocks, x.outstanding


@given(sides, sides, used, st.integers(1, 6))
def test_never_picks_an_instance_without_room(
    ps: list[InstanceLoad], ds: list[InstanceLoad], pair_used: list[list[int]], n: int
) -> None:
    choice = pick(ps, ds, pair_used, n)
    if choice is None:
        assert not any(x.fits(n) for x in ps) or not any(x.fits(n) for x in ds)
        return
    for side, i in ((ps, choice.prefill), (ds, choice.decode)):
        assert side[i].fits(n)
        assert key(side[i]) == min(key(x) for x in side if x.fits(n))  # least-loaded


@given(sides, sides, used, st.integers(1, 6))
def test_the_same_loads_give_the_same_pick(
    ps: list[InstanceLoad], ds: list[InstanceLoad], pair_used: list[list[int]], n: int
) -> None:
    again = pick(tuple(ps), tuple(ds), tuple(map(tuple, pair_used)), n)
    assert pick(ps, ds, pair_used, n) == again


@given(sizes, sizes, used)
def test_ties_go_to_the_least_used_pair(p: int, d: int, pair_used: list[list[int]]) -> None:
    idle = [InstanceLoad()]
    choice = pick(idle * p, idle * d, pair_used)
    assert choice is not None
    least = min(pair_used[i][j] for i, j in itertools.product(range(p), range(d)))
    assert pair_used[choice.prefill][choice.decode] == least


@given(sizes, sizes, st.integers(0, 80))
def test_a_burst_spreads_over_every_pair(p: int, d: int, n: int) -> None:
    """N requests at once, each charged as picked: every pair within one of
    every other, each side within one request of even, at every step."""
    ledger, count = Ledger(p, d), dict.fromkeys(itertools.product(range(p), range(d)), 0)
    for _ in range(n):
        choice = ledger.acquire(3)
        assert choice is not None
        count[choice.prefill, choice.decode] += 1
        assert max(count.values()) - min(count.values()) <= 1
        for side in (ledger.prefills, ledger.decodes):
            assert max(x.outstanding for x in side) - min(x.outstanding for x in side) <= 1
    assert sum(x.reserved_blocks for x in ledger.decodes) == 3 * n


@given(sizes, sizes)
def test_an_idle_fleet_cycles_through_every_pair(p: int, d: int) -> None:
    ledger, seen = Ledger(p, d), []
    for _ in range(p * d):
        choice = ledger.acquire()
        assert choice is not None
        seen.append((choice.prefill, choice.decode))
        ledger.release_prefill(choice.prefill)
        ledger.release_decode(choice.decode)
    assert sorted(seen) == list(itertools.product(range(p), range(d)))


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=60), sizes, sizes)
def test_a_ledger_never_overfills_and_gives_back_exactly(
    steps: list[tuple[bool, int]], p: int, d: int
) -> None:
    ledger, held = Ledger(p, d, capacity=6), list[tuple[Pick, int]]()
    for acquire, n in steps:
        if acquire or not held:
            choice = ledger.acquire(n)
            if choice is not None:
                held.append((choice, n))
        else:
            given_back, m = held.pop(0)
            ledger.release_prefill(given_back.prefill, m)
            ledger.release_decode(given_back.decode, m)
        for x in (*ledger.prefills, *ledger.decodes):
            assert x.reserved_blocks <= 6
    for choice, n in held:
        ledger.release_prefill(choice.prefill, n)
        ledger.release_decode(choice.decode, n)
    assert set(ledger.prefills) == set(ledger.decodes) == {InstanceLoad(capacity=6)}


def test_blocks_first_then_requests() -> None:
    ledger = Ledger(1, 3)
    assert [ledger.acquire(1).decode for _ in range(3)] == [0, 1, 2]  # type: ignore[union-attr]
    ledger.release_decode(1)
    assert ledger.acquire(5) == Pick(0, 1)  # the one with nothing reserved
    assert ledger.acquire(1) == Pick(0, 0)  # 0 and 2 tie; (0, 0) came first in the round
    assert ledger.acquire(1) == Pick(0, 2)
    assert [(x.outstanding, x.reserved_blocks) for x in ledger.decodes] == [(2, 2), (1, 5), (2, 2)]
    fewer = [InstanceLoad(3, 4), InstanceLoad(1, 4), InstanceLoad(0, 5)]
    assert pick([InstanceLoad()], fewer) == Pick(0, 1)  # equal blocks: fewer requests


def test_full_sides_give_none_and_misuse_raises() -> None:
    full = InstanceLoad(1, 4, capacity=4)
    assert pick([InstanceLoad()], [full]) is None
    assert pick([InstanceLoad()], [full, InstanceLoad(capacity=0)]) is None
    assert pick([InstanceLoad(capacity=8)], [InstanceLoad(capacity=8)], blocks=8) == Pick(0, 0)
    with pytest.raises(LocalProtocolError, match="without a matching acquire"):
        Ledger(1, 1).release_decode(0)
    with pytest.raises(ConfigError):
        pick([], [full])
    with pytest.raises(ConfigError):
        pick([full], [full], blocks=0)
    with pytest.raises(ConfigError):
        InstanceLoad(-1)
    with pytest.raises(ConfigError):
        Ledger(0, 1)


# --- health and suspicion (issue 28) --------------------------------------------------


@given(sides, sides, used, st.integers(1, 6), st.data())
def test_never_picks_a_down_instance(
    ps: list[InstanceLoad],
    ds: list[InstanceLoad],
    pair_used: list[list[int]],
    n: int,
    data: st.DataObject,
) -> None:
    ps = [replace(x, up=data.draw(st.booleans())) for x in ps]
    choice = pick(ps, ds, pair_used, n)
    if choice is None:
        assert not any(x.fits(n) for x in ps) or not any(x.fits(n) for x in ds)
        return
    assert ps[choice.prefill].up


def test_a_dead_instance_holding_nothing_is_not_the_least_loaded() -> None:
    ledger = Ledger(2, 1)
    for _ in range(4):
        ledger.acquire()  # two each
    ledger.mark("prefill", 0, up=False)
    while ledger.prefills[0].outstanding:  # p0's requests all failed: it holds nothing now
        ledger.release_prefill(0)
    assert ledger.prefills[0].outstanding == 0
    assert [ledger.acquire().prefill for _ in range(3)] == [1, 1, 1]  # type: ignore[union-attr]
    ledger.mark("prefill", 1, up=False)
    assert ledger.acquire() is None  # every prefill down: no pick
    ledger.mark("prefill", 0, up=True)
    assert ledger.acquire() == Pick(0, 0)


def test_a_decode_with_suspect_blocks_ranks_after_every_clean_one() -> None:
    clean, busy = InstanceLoad(), InstanceLoad(outstanding=9, reserved_blocks=90)
    suspect = InstanceLoad(suspect_blocks=3)
    p = [InstanceLoad()]
    assert pick(p, [suspect, busy]) == Pick(0, 1)  # busier but clean
    assert pick(p, [suspect, replace(busy, up=False)]) == Pick(0, 0)  # the only one up
    assert pick(p, [suspect, clean]) == Pick(0, 1)
    ledger = Ledger(1, 2)
    ledger.mark("decode", 0, suspect_blocks=5)
    assert {ledger.acquire().decode for _ in range(3)} == {1}  # type: ignore[union-attr]
    ledger.mark("decode", 0, suspect_blocks=0)
    assert ledger.acquire() == Pick(0, 0)
    with pytest.raises(ConfigError):
        InstanceLoad(suspect_blocks=-1)


def test_health_backs_off_doubling_to_a_bound_with_jitter() -> None:
    h = Health(2, first=0.5, most=10.0, jitter=0.2)
    assert h.up(0) and h.next_probe() is None
    assert h.failed(0, 100.0, 0.5, "refused") == 100.5  # u = 0.5: no jitter
    assert not h.up(0) and h.why(0) == "refused" and h.down == (0,)
    assert h.failed(0, 100.2, 0.5) == 100.5  # more failures while down: one strike
    assert h.due(100.4) == [] and h.due(100.5) == [0]
    delays = [h.probe_failed(0, 0.0, 0.5) for _ in range(6)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert h.probe_failed(0, 0.0, 0.999) == 10.0  # jitter never passes the bound
    assert h.probe_failed(0, 0.0, 0.0) == pytest.approx(8.0)  # -20%
    h.answered(0)  # a probe answered: up, the count kept
    assert h.up(0) and h.why(0) == ""
    assert h.failed(0, 0.0, 0.5) == 10.0
    h.served(0)  # a served request resets it
    assert h.failed(0, 0.0, 0.5) == 0.5
    assert h.next_probe() == 0.5 and h.up(1)
    h2 = Health(1, first=0.5, most=10.0, jitter=0.2)
    assert h2.failed(0, 0.0, 0.0) == pytest.approx(0.4)
    assert Health(1).failed(0, 0.0, 0.999) == pytest.approx(0.5 * 1.1996)
    with pytest.raises(ConfigError):
        Health(0)
    with pytest.raises(ConfigError):
        Health(1, first=2.0, most=1.0)
