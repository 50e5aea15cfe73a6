"""Prometheus metrics for an endpoint (optional: ``pip install kvpush[metrics]``).

Named the way vLLM names its metrics (``kvpush:`` prefix, base units, ``_total``
for counters). Phase histograms and outcomes come from the events the runtime
reports; block gauges, bytes and ignored inputs are read from the endpoint and
the data plane at scrape time by a collector, so nothing is double-counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvpush.protocol import (
    ConfigError,
    Consumer,
    Event,
    Failed,
    Producer,
    Ready,
    Released,
    SourceReleased,
    Timeline,
)

if TYPE_CHECKING:
    from ._dataplane import DataPlane

try:
    import prometheus_client as prom
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError:  # pragma: no cover - exercised only without the extra
    prom = None  # type: ignore[assignment]
    Collector = object  # type: ignore[assignment,misc]

__all__ = ("EndpointMetrics",)

#: Seconds; the handoff phases run from tens of microseconds to seconds.
_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


def _phases(t: Timeline) -> Iterator[tuple[str, float]]:
    """(phase, seconds) pairs this endpoint's timeline can tell. With the data
    plane's stamps (``ops``), preparation ends when the last op was planned
    and transfer when the last op settled; without, at the core's moments."""
    done = max((when for _, when in t.write_done), default=None)
    moving = t.write_started
    if t.ops:
        moving = max(st.planned for _, st in t.ops)
        done = max(st.done for _, st in t.ops)
    spans = (
        ("registration", t.reserved, t.registration_sent),
        ("handoff_preparation", t.kv_ready, moving),
        ("transfer", moving, done),
        ("ready", t.reserved, t.ready),
        ("held", t.kv_ready, t.released),
    )
    for name, start, end in spans:
        if start is not None and end is not None and end >= start:
            yield name, end - start


class EndpointMetrics(Collector):
    """Metrics of one endpoint; feed it every event with :meth:`observe`."""

    def __init__(
        self,
        endpoint: Producer | Consumer,
        dataplane: DataPlane | None = None,
        *,
        registry: Any = None,
    ) -> None:
        if prom is None:
            raise ConfigError("metrics need prometheus_client: pip install 'kvpush[metrics]'")
        self.endpoint = endpoint
        self.dataplane = dataplane
        registry = prom.REGISTRY if registry is None else registry
        role = endpoint.role.value
        labels = {"role": role, "engine": endpoint.identity.engine_id}
        self._labels = labels
        self._phase = prom.Histogram(
            "kvpush:transfer_phase_seconds",
            "Time spent in each phase of a KV handoff, as seen by this endpoint.",
            ["role", "engine", "phase"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self._outcomes = prom.Counter(
            "kvpush:transfers",
            "Transfers (reservations or source holds) ended, by outcome.",
            ["role", "engine", "outcome"],
            registry=registry,
        )
        self._failures = prom.Counter(
            "kvpush:transfer_failures",
            "Reservations that failed, by reason.",
            ["role", "engine", "reason"],
            registry=registry,
        )
        registry.register(self)

    def observe(self, event: Event) -> None:
        """Account one event the runtime reported."""
        if isinstance(event, (Ready, Released, SourceReleased)):
            for phase, seconds in _phases(event.timeline):
                self._phase.labels(**self._labels, phase=phase).observe(seconds)
        if isinstance(event, Ready):
            self._outcomes.labels(**self._labels, outcome="ready").inc()
        elif isinstance(event, Released):
            self._outcomes.labels(**self._labels, outcome="released").inc()
        elif isinstance(event, SourceReleased):
            self._outcomes.labels(**self._labels, outcome=event.outcome.value).inc()
        elif isinstance(event, Failed):
            self._failures.labels(**self._labels, reason=event.reason.value).inc()

    def collect(self) -> Iterator[Any]:
        """Scrape-time values read from the endpoint and the data plane."""
        names, values = ["role", "engine"], [self._labels["role"], self._labels["engine"]]
        ep = self.endpoint
        blocks = GaugeMetricFamily(
            "kvpush:blocks", "KV blocks held by the protocol now.", labels=[*names, "kind"]
        )
        if isinstance(ep, Consumer):
            blocks.add_metric([*values, "reserved"], ep.reserved_blocks)
            # Of those, held past their quarantine until the producer proves
            # that no write can land (docs/protocol.md, SUSPECT).
            blocks.add_metric([*values, "suspect"], ep.suspect_blocks)
        else:
            blocks.add_metric([*values, "held"], ep.held_blocks)
        yield blocks
        ignored = CounterMetricFamily(
            "kvpush:inputs",
            "Inputs the endpoint counted instead of acting on (stale, duplicate, ...).",
            labels=[*names, "kind"],
        )
        for kind, n in sorted(ep.stats().items()):
            ignored.add_metric([*values, kind], n)
        yield ignored
        if self.dataplane is not None:
            moved = CounterMetricFamily(
                "kvpush:transfer_bytes", "Bytes posted by the data plane.", labels=names
            )
            moved.add_metric(values, self.dataplane.bytes_posted)
            yield moved
            st = self.dataplane.stager
            writes = CounterMetricFamily(
                "kvpush:writes",
                "Writes posted, by the way the cost model sent them (docs/layouts.md).",
                labels=[*names, "path"],
            )
            writes.add_metric([*values, "staged"], st.staged_writes)
            writes.add_metric([*values, "direct"], st.direct_writes)
            yield writes
            staged = CounterMetricFamily(
                "kvpush:staged_bytes", "Bytes gathered into staging slots.", labels=names
            )
            staged.add_metric(values, st.staged_bytes)
            yield staged
            pool = GaugeMetricFamily(
                "kvpush:staging_bytes",
                "Staging memory in slots now (producer: lent to writes in flight; "
                "consumer: owned by reservations).",
                labels=names,
            )
            used = ep.staging_bytes_used if isinstance(ep, Consumer) else st.pool_used()
            pool.add_metric(values, used)
            yield pool
            scattered = CounterMetricFamily(
                "kvpush:scatters",
                "Staged notices scattered into blocks, and dropped (no reservation).",
                labels=[*names, "outcome"],
            )
            scattered.add_metric([*values, "scattered"], st.scatters)
            scattered.add_metric([*values, "dropped"], st.dropped_notices)
            yield scattered
