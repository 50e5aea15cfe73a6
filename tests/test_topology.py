"""Which producer rank writes which KV heads to which consumer rank."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from kvpush.protocol import (
    HeadSlice,
    Identity,
    IncompatiblePeerError,
    Role,
    Route,
    Source,
    Topology,
    TopologyError,
    check_compatible,
    compute_topology,
)

# --- an independent oracle ---------------------------------------------------------


def rank_heads(tp: int, heads: int, rank: int) -> set[int]:
    """The KV heads one rank of a TP group holds (GQA: replicated if TP > heads)."""
    if tp <= heads:
        per = heads // tp
        return set(range(rank * per, (rank + 1) * per))
    return {rank // (tp // heads)}


def supported(tp: int, heads: int) -> bool:
    return heads % tp == 0 if tp <= heads else tp % heads == 0


def span(s: HeadSlice) -> list[int]:
    return list(range(s.start, s.start + s.count))


def check_exact(topo: Topology, ptp: int, ppp: int, ctp: int, heads: int, mla: bool) -> None:
    """Every head a consumer rank needs is written exactly once per producer stage,
    by a producer rank that holds it; the pair set is what the consumer waits for."""
    pairs = [(r.source, r.consumer_rank) for r in topo.routes]
    assert len(set(pairs)) == len(pairs), "a (source, consumer rank) pair repeats"
    assert topo.expected_total == len(pairs)
    grouped: dict[tuple[int, int], list[Route]] = {}
    for r in topo.routes:
        grouped.setdefault((r.consumer_rank, r.source.pp), []).append(r)
    assert set(grouped) == {(c, stage) for c in range(ctp) for stage in range(ppp)}
    for c in range(ctp):
        need = set(range(heads)) if mla else rank_heads(ctp, heads, c)
        mine = [r for stage in range(ppp) for r in grouped[(c, stage)]]
        assert topo.sources_for(c) == frozenset(r.source for r in mine)
        for stage in range(ppp):
            staged = grouped[(c, stage)]
            covered = Counter(h for r in staged for h in span(r.heads))
            assert set(covered) == need, (c, stage, covered)
            assert set(covered.values()) == {1}, (c, stage, covered)
            if mla:
                assert len(staged) == 1
            for r in staged:
                assert 0 <= r.source.tp < ptp
                held = set(range(heads)) if mla else rank_heads(ptp, heads, r.source.tp)
                assert set(span(r.heads)) <= held
    assert {r.source.pp for r in topo.routes} == set(range(ppp))
    by_source: dict[Source, list[Route]] = {}
    for r in topo.routes:
        by_source.setdefault(r.source, []).append(r)
    for source, routes in by_source.items():
        assert topo.routes_from(source) == tuple(routes)
    assert topo.routes_from(Source(ptp, 0)) == ()


# --- named cases ------------------------------------------------------------------


def test_producer_tp_greater_than_consumer_tp() -> None:
    topo = compute_topology(4, 1, 2, 8)
    assert topo.sources_for(0) == {Source(0), Source(1)}
    assert topo.sources_for(1) == {Source(2), Source(3)}
    heads = {(r.source.tp, r.consumer_rank): (r.heads.start, r.heads.count) for r in topo.routes}
    assert heads == {(0, 0): (0, 2), (1, 0): (2, 2), (2, 1): (4, 2), (3, 1): (6, 2)}
    assert topo.expected_total == 4
    check_exact(topo, 4, 1, 2, 8, False)


def test_producer_tp_less_than_consumer_tp() -> None:
    topo = compute_topology(2, 1, 4, 8)
    assert [topo.sources_for(c) for c in range(4)] == [
        {Source(0)},
        {Source(0)},
        {Source(1)},
        {Source(1)},
    ]
    assert [r.heads for r in topo.routes] == [
        HeadSlice(0, 2),
        HeadSlice(2, 2),
        HeadSlice(4, 2),
        HeadSlice(6, 2),
    ]
    check_exact(topo, 2, 1, 4, 8, False)


def test_two_to_one_needs_both_sources() -> None:
    topo = compute_topology(2, 1, 1, 8)
    assert topo.sources_for(0) == {Source(0), Source(1)}
    assert topo.expected_total == 2


def test_consumer_tp_above_kv_heads_replicates_heads() -> None:
    # GQA with 2 KV heads: 8 consumer ranks hold 4 replicas of each head.
    topo = compute_topology(2, 1, 8, 2)
    assert [r.heads for r in topo.routes] == [HeadSlice(0, 1)] * 4 + [HeadSlice(1, 1)] * 4
    assert [tuple(topo.sources_for(c)) for c in range(8)] == [(Source(0),)] * 4 + [(Source(1),)] * 4
    check_exact(topo, 2, 1, 8, 2, False)


def test_replicated_producer_heads_spread_the_fan_out() -> None:
    # Producer TP 4 over 2 heads: ranks {0,1} hold head 0, {2,3} head 1; the replicas
    # take turns, so no producer rank writes to every consumer rank.
    topo = compute_topology(4, 1, 8, 2)
    writers = [next(iter(topo.sources_for(c))).tp for c in range(8)]
    assert writers == [0, 1, 0, 1, 2, 3, 2, 3]
    check_exact(topo, 4, 1, 8, 2, False)


def test_mla_one_writer_per_consumer_rank() -> None:
    topo = compute_topology(4, 1, 2, 1, mla=True)
    assert [(r.source, r.consumer_rank, r.heads) for r in topo.routes] == [
        (Source(0), 0, HeadSlice(0, 1)),
        (Source(1), 1, HeadSlice(0, 1)),
    ]
    wide = compute_topology(2, 1, 4, 1, mla=True)
    assert [len(wide.sources_for(c)) for c in range(4)] == [1, 1, 1, 1]
    assert [r.source.tp for r in wide.routes] == [0, 1, 0, 1]
    check_exact(wide, 2, 1, 4, 1, True)


def test_pipeline_stages_are_all_sources() -> None:
    topo = compute_topology(2, 3, 1, 8)
    assert topo.sources_for(0) == {Source(tp, pp) for tp in range(2) for pp in range(3)}
    assert topo.expected_total == 6
    check_exact(topo, 2, 3, 1, 8, False)
    mla = compute_topology(1, 2, 2, 1, mla=True)
    assert mla.sources_for(1) == {Source(0, 0), Source(0, 1)}


def test_exact_cover_brute_force() -> None:
    checked = refused = 0
    tps = (1, 2, 3, 4, 6, 8, 12, 16, 32)
    for heads, ptp, ctp, ppp, mla in itertools.product(
        (1, 2, 3, 4, 6, 8, 16), tps, tps, (1, 3), (False, True)
    ):
        ok = mla or (supported(ptp, heads) and supported(ctp, heads))
        if not ok:
            with pytest.raises(TopologyError):
                compute_topology(ptp, ppp, ctp, heads, mla=mla)
            refused += 1
            continue
        check_exact(compute_topology(ptp, ppp, ctp, heads, mla=mla), ptp, ppp, ctp, heads, mla)
        checked += 1
    assert checked > 1000
    assert refused > 500


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((3, 1, 1, 8), "producer TP 3 does not divide the 8 KV heads"),
        ((1, 1, 6, 8), "consumer TP 6 does not divide the 8 KV heads"),
        ((12, 1, 1, 8), "producer TP 12 exceeds the 8 KV heads but is not a multiple"),
        ((1, 1, 12, 8), "consumer TP 12 exceeds the 8 KV heads but is not a multiple"),
        ((0, 1, 1, 8), "producer TP must be an int in [1, 1024], got 0"),
        ((1, 0, 1, 8), "producer PP must be an int in [1, 1024], got 0"),
        ((1, 1, 2048, 8), "consumer TP must be an int in [1, 1024], got 2048"),
        ((1, 1, 1, 0), "num_kv_heads must be a positive int, got 0"),
    ],
)
def test_unsupported_combination_refused(args: tuple[int, int, int, int], message: str) -> None:
    with pytest.raises(TopologyError) as info:
        compute_topology(*args)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unsupported_topology_refused_at_handshake() -> None:
    producer = Identity("p", 1, tp=3).hello(Role.PRODUCER, 10.0)
    consumer = Identity("d", 1, tp=1).hello(Role.CONSUMER, 10.0)
    for local, remote in ((producer, consumer), (consumer, producer)):
        with pytest.raises(IncompatiblePeerError) as info:
            check_compatible(local, remote)
        assert info.value.field == "topology"
        assert "does not divide the 8 KV heads" in info.value.detail


def test_handshake_topology_matches_compute_topology() -> None:
    producer = Identity("p", 1, tp=4, pp=2, num_kv_heads=4).hello(Role.PRODUCER, 10.0)
    consumer = Identity("d", 1, tp=2, num_kv_heads=4).hello(Role.CONSUMER, 10.0)
    expected = compute_topology(4, 2, 2, 4)
    assert check_compatible(producer, consumer) == expected
    assert check_compatible(consumer, producer) == expected
