"""kvpush's numbers through vLLM's connector stats and Prometheus hooks.

Each worker reports, per step, what its data plane did since the last step
(:meth:`~kvpush_vllm.connector.KvpushConnector.get_kv_connector_stats`);
vLLM sums them over workers and steps (:meth:`KvpushStats.aggregate`), logs
the interval (:meth:`KvpushStats.reduce`) and feeds :class:`KvpushPromMetrics`,
counters named like vLLM's own (``vllm:kvpush_...``).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ("COUNTERS", "KvpushPromMetrics", "KvpushStats")

#: stats key -> (Prometheus name, help).
COUNTERS: dict[str, tuple[str, str]] = {
    "posted": ("vllm:kvpush_transfers_posted_total", "WRITEs (push) or READs (pull) posted"),
    "failed": ("vllm:kvpush_transfers_failed_total", "Transfers that failed to post or land"),
    "bytes": ("vllm:kvpush_transfer_bytes_total", "KV bytes posted"),
    "notices": ("vllm:kvpush_notices_total", "Completion notices received"),
}


class KvpushStats(KVConnectorStats):  # type: ignore[misc]
    """Counts since the last report; sums when aggregated."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: self.data.get(key, 0) for key in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in COUNTERS)


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
        self._counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in COUNTERS.items():
            counter = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[key] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, children in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                children[engine_idx].inc(value)
