"""Which producer rank writes which KV heads to which consumer rank.

The map is computed once per peer pair, at handshake, from both sides'
parallelism. Every consumer rank gets an *exact* set of sources: each KV head it
needs is written by exactly one (producer TP rank, PP stage) pair per stage.
Combinations kvpush cannot map raise :class:`TopologyError` at handshake, so both
sides learn before any transfer starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._errors import TopologyError
from ._types import Source

__all__ = ("MAX_RANKS", "HeadSlice", "Route", "Topology", "compute_topology")

#: Largest TP or PP size accepted (keeps tables and frames bounded).
MAX_RANKS = 1024


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """A contiguous range of global KV head indices ``[start, start + count)``."""

    start: int
    count: int


@dataclass(frozen=True, slots=True)
class Route:
    """One writer/reader pair: ``source`` moves ``heads`` to ``consumer_rank``."""

    source: Source
    consumer_rank: int
    heads: HeadSlice


@dataclass(frozen=True, slots=True)
class Topology:
    """The exact source sets of one producer/consumer pair of instances."""

    producer_tp: int
    producer_pp: int
    consumer_tp: int
    num_kv_heads: int
    mla: bool
    routes: tuple[Route, ...]
    _by_consumer: tuple[frozenset[Source], ...] = field(repr=False, compare=False)
    _by_source: dict[Source, tuple[Route, ...]] = field(repr=False, compare=False)

    def sources_for(self, consumer_rank: int) -> frozenset[Source]:
        """The exact set of sources that consumer rank ``consumer_rank`` waits for."""
        return self._by_consumer[consumer_rank]

    def routes_from(self, source: Source) -> tuple[Route, ...]:
        """The routes producer rank ``source`` writes (empty if it writes none)."""
        return self._by_source.get(source, ())

    @property
    def expected_total(self) -> int:
        """How many (source, consumer rank) completions make a transfer ready."""
        return len(self.routes)


def _check_size(name: str, value: int) -> None:
    if type(value) is not int or not 1 <= value <= MAX_RANKS:
        raise TopologyError(f"{name} must be an int in [1, {MAX_RANKS}], got {value!r}")


def _heads_of_rank(side: str, tp: int, heads: int, rank: int) -> HeadSlice:
    """The KV heads a rank of a TP group holds (one replicated head if TP > heads)."""
    if tp <= heads:
        if heads % tp:
            raise TopologyError(
                f"{side} TP {tp} does not divide the {heads} KV heads; "
                f"use a TP size that divides {heads} or is a multiple of it"
            )
        per = heads // tp
        return HeadSlice(rank * per, per)
    if tp % heads:
        raise TopologyError(
            f"{side} TP {tp} exceeds the {heads} KV heads but is not a multiple of them"
        )
    return HeadSlice(rank // (tp // heads), 1)


def _writer_of_head(producer_tp: int, heads: int, head: int, consumer_rank: int) -> int:
    """The producer TP rank that writes ``head`` to ``consumer_rank``.

    With replicated heads (producer TP > heads) the replicas take turns by
    consumer rank, so fan-out spreads over the producer ranks.
    """
    if producer_tp <= heads:
        return head // (heads // producer_tp)
    replicas = producer_tp // heads
    return head * replicas + consumer_rank % replicas


def _mla_routes(producer_tp: int, producer_pp: int, consumer_tp: int, heads: int) -> list[Route]:
    """The latent KV is replicated on every rank: one writer per consumer rank."""
    whole = HeadSlice(0, heads)
    return [
        Route(Source(c % producer_tp, stage), c, whole)
        for c in range(consumer_tp)
        for stage in range(producer_pp)
    ]


def _head_routes(producer_tp: int, producer_pp: int, consumer_tp: int, heads: int) -> list[Route]:
    """Each consumer rank's heads, in runs of consecutive heads of one writer."""
    for p in range(producer_tp):  # validate the producer side up front
        _heads_of_rank("producer", producer_tp, heads, p)
    routes: list[Route] = []
    for c in range(consumer_tp):
        need = _heads_of_rank("consumer", consumer_tp, heads, c)
        runs: list[tuple[int, int, int]] = []  # (writer, first head, count)
        for head in range(need.start, need.start + need.count):
            writer = _writer_of_head(producer_tp, heads, head, c)
            if runs and runs[-1][0] == writer:
                runs[-1] = (writer, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((writer, head, 1))
        for stage in range(producer_pp):
            for writer, first, count in runs:
                routes.append(Route(Source(writer, stage), c, HeadSlice(first, count)))
    return routes


def compute_topology(
    producer_tp: int,
    producer_pp: int,
    consumer_tp: int,
    num_kv_heads: int,
    *,
    mla: bool = False,
) -> Topology:
    """Map producer (TP, PP) ranks onto consumer TP ranks.

    Raises :class:`TopologyError` for an unsupported combination.
    """
    _check_size("producer TP", producer_tp)
    _check_size("producer PP", producer_pp)
    _check_size("consumer TP", consumer_tp)
    if type(num_kv_heads) is not int or not 1 <= num_kv_heads <= 1 << 16:
        raise TopologyError(f"num_kv_heads must be a positive int, got {num_kv_heads!r}")
    if mla:
        routes = _mla_routes(producer_tp, producer_pp, consumer_tp, num_kv_heads)
    else:
        routes = _head_routes(producer_tp, producer_pp, consumer_tp, num_kv_heads)
    by_consumer = tuple(
        frozenset(r.source for r in routes if r.consumer_rank == c) for c in range(consumer_tp)
    )
    by_source: dict[Source, list[Route]] = {}
    for r in routes:
        by_source.setdefault(r.source, []).append(r)
    return Topology(
        producer_tp,
        producer_pp,
        consumer_tp,
        num_kv_heads,
        mla,
        tuple(routes),
        by_consumer,
        {s: tuple(rs) for s, rs in by_source.items()},
    )
