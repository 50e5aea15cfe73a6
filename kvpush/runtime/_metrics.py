"""Prometheus metrics for an endpoint (optional: ``pip install kvpush[metrics]``),
named like vLLM's (docs/runtime.md, "Metrics"). Phases and outcomes come from
the events; everything else is read at scrape time, so nothing is counted twice.
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

    _COUNTER, _GAUGE = CounterMetricFamily, GaugeMetricFamily
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
        labels = {"role": endpoint.role.value, "engine": endpoint.identity.engine_id}
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
        v, ep = [self._labels["role"], self._labels["engine"]], self.endpoint
        if isinstance(ep, Consumer):
            # suspect: of those, held past their quarantine until the producer
            # proves that no write can land (docs/protocol.md, SUSPECT).
            held = {"reserved": ep.reserved_blocks, "suspect": ep.suspect_blocks}
        else:
            held = {"held": ep.held_blocks}
        yield _family(_GAUGE, "blocks", "KV blocks held by the protocol now.", v, "kind", held)
        text = "Inputs the endpoint counted instead of acting on (stale, duplicate, ...)."
        yield _family(_COUNTER, "inputs", text, v, "kind", dict(sorted(ep.stats().items())))
        if self.dataplane is None:
            return
        dp, st = self.dataplane, self.dataplane.stager
        yield _family(
            _COUNTER, "transfer_bytes", "Bytes posted by the data plane.", v, dp.bytes_posted
        )
        text = "Writes posted, by the way the cost model sent them (docs/layouts.md)."
        ways = {"staged": st.staged_writes, "direct": st.direct_writes}
        yield _family(_COUNTER, "writes", text, v, "path", ways)
        yield _family(
            _COUNTER, "staged_bytes", "Bytes gathered into staging slots.", v, st.staged_bytes
        )
        text = (
            "Staging memory in slots now (producer: lent to writes in flight; "
            "consumer: owned by reservations)."
        )
        used = ep.staging_bytes_used if isinstance(ep, Consumer) else st.pool_used()
        yield _family(_GAUGE, "staging_bytes", text, v, used)
        text = "Staged notices scattered into blocks, and dropped (no reservation)."
        outcomes = {"scattered": st.scatters, "dropped": st.dropped_notices}
        yield _family(_COUNTER, "scatters", text, v, "outcome", outcomes)


def _family(kind: Any, name: str, text: str, values: list[str], *sample: Any) -> Any:
    """``kvpush:<name>`` with one sample: ``(value,)``, or ``(label, {key: value})``."""
    if len(sample) == 1:
        family = kind(f"kvpush:{name}", text, labels=["role", "engine"])
        family.add_metric(values, sample[0])
        return family
    label, items = sample
    family = kind(f"kvpush:{name}", text, labels=["role", "engine", label])
    for key, value in items.items():
        family.add_metric([*values, key], value)
    return family
