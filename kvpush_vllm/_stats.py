"""kvpush's numbers through vLLM's connector stats and Prometheus hooks
(docs/vllm.md, "Metrics"). Keys: a counter by its name (:data:`COUNTERS`),
a gauge as ``g:<kind>`` (:data:`GAUGES`: the latest value wins), a phase's
durations as ``h:<phase>`` (:data:`PHASES`), legs refused as ``r:<reason>``
(``_contract.REFUSALS``; :data:`REFUSED`).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ._contract import REFUSALS

__all__ = ("COUNTERS", "GAUGES", "PHASES", "REFUSED", "KvpushPromMetrics", "KvpushStats")

#: stats key -> (Prometheus name, help).
COUNTERS: dict[str, tuple[str, str]] = {
    "posted": ("vllm:kvpush_transfers_posted_total", "WRITEs (push) or READs (pull) posted"),
    "failed": ("vllm:kvpush_transfers_failed_total", "Transfers that failed to post or land"),
    "bytes": ("vllm:kvpush_transfer_bytes_total", "KV bytes posted"),
    "notices": ("vllm:kvpush_notices_total", "Completion notices received"),
    "staged": ("vllm:kvpush_staged_writes_total", "WRITEs gathered and sent staged"),
    "scattered": ("vllm:kvpush_scatters_total", "Staged notices scattered into blocks"),
    "declined": (
        "vllm:kvpush_declined_total",
        "decode: transfers it will not load (leg or reservation refused) whose prefill "
        "was told to release the KV at once",
    ),
    "decline_unsent": (
        "vllm:kvpush_decline_unsent_total",
        "decode: such transfers whose prefill could not be told (no handshake with it "
        "yet): it releases the KV at its kv_hold_timeout",
    ),
    "release_legs": (
        "vllm:kvpush_release_legs_total",
        "prefill: releases from the router (a decode leg failed before its engine saw it)",
    ),
}
#: The Prometheus name of the legs refused, by ``reason`` (``r:<reason>``).
REFUSED = (
    "vllm:kvpush_params_refused_total",
    "Requests whose kv_transfer_params broke the contract (docs/contract.md), by reason",
)
#: gauge kind -> help; one gauge, ``vllm:kvpush_blocks{kind=...}``.
GAUGES: dict[str, str] = {
    "reserved": "decode: blocks reserved for loads, draining ones included",
    "suspect": "decode: blocks held as suspect (a failed push whose producer is silent)",
    "held": "prefill: source blocks held until their KV is sent and acknowledged",
}
#: phase -> what it spans; one histogram, ``vllm:kvpush_phase_seconds{phase=...}``.
PHASES: dict[str, str] = {
    "load": "decode: reserved -> KV ready",
    "wait_registration": "prefill: KV ready -> writes started (or announced)",
    "write": "prefill: writes started -> the last write done",
    "source_held": "prefill: KV ready -> source blocks released",
}
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class KvpushStats(KVConnectorStats):  # type: ignore[misc]
    """Counts since the last report; sums when aggregated."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key.startswith("g:"):
                self.data[key] = value
            elif key.startswith("h:"):
                self.data[key] = [*self.data.get(key, ()), *value]
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {key: self.data.get(key, 0) for key in COUNTERS}
        out["refused_params"] = 0
        for key, value in self.data.items():
            if key.startswith("r:"):
                out["refused_params"] += value
                out[f"refused_{key[2:]}"] = value
            elif key.startswith("g:"):
                out[f"{key[2:]}_blocks"] = value
            elif key.startswith("h:") and value:
                out[f"{key[2:]}_p50_ms"] = round(1000 * sorted(value)[len(value) // 2], 3)
        return out

    def is_empty(self) -> bool:
        # A gauge is news even at 0 (its blocks came back).
        return not any(value or key.startswith("g:") for key, value in self.data.items())


class KvpushPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """One counter per :data:`COUNTERS` entry, a child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        engines = per_engine_labelvalues.items()

        def children(metric: Any, *label: str) -> dict[int, Any]:
            return {idx: metric.labels(*values, *label) for idx, values in engines}

        #: stats key (a counter's, or ``r:<reason>``) -> the counter's children.
        self._counters = {
            key: children(self._counter_cls(name=name, documentation=doc, labelnames=labelnames))
            for key, (name, doc) in COUNTERS.items()
        }
        gauge = self._gauge_cls(
            name="vllm:kvpush_blocks",
            documentation="KV blocks kvpush holds, by kind: "
            + "; ".join(f"{k}: {v}" for k, v in GAUGES.items()),
            labelnames=[*labelnames, "kind"],
            multiprocess_mode="mostrecent",
        )
        self._gauges = {kind: children(gauge, kind) for kind in GAUGES}
        for by_engine in self._gauges.values():  # shown from the start, at 0
            for child in by_engine.values():
                child.set(0)
        histogram = self._histogram_cls(
            name="vllm:kvpush_phase_seconds",
            documentation="Seconds each transfer spent in a phase: "
            + "; ".join(f"{k}: {v}" for k, v in PHASES.items()),
            labelnames=[*labelnames, "phase"],
            buckets=_BUCKETS,
        )
        self._phases = {phase: children(histogram, phase) for phase in PHASES}
        name, doc = REFUSED
        refused = self._counter_cls(
            name=name, documentation=doc, labelnames=[*labelnames, "reason"]
        )
        self._counters |= {f"r:{reason}": children(refused, reason) for reason in REFUSALS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for key, children in self._counters.items():
            if data.get(key, 0):
                children[engine_idx].inc(data[key])
        for kind, children in self._gauges.items():
            if f"g:{kind}" in data:
                children[engine_idx].set(data[f"g:{kind}"])
        for phase, children in self._phases.items():
            for seconds in data.get(f"h:{phase}", ()):
                children[engine_idx].observe(seconds)
