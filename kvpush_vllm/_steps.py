"""What each engine step costs in the connector: vLLM's calls, timed.

With ``step_profile_file`` set, every call vLLM makes into a connector instance
is timed and one JSON line per step cycle is appended to the file, on
``time.monotonic()``, with a ``"threads"`` line per write (the OS ids of
kvpush's threads). Off, nothing is wrapped. ``benchmarks/vllm_peer.py`` reads
them (docs/performance.md, "The connector's cost per step").
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ("SCHEDULER_CALLS", "WORKER_CALLS", "StepClock")

#: vLLM's calls into the scheduler-side instance (engine-core process).
SCHEDULER_CALLS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "has_pending_push_work",
    "get_kv_connector_stats",
)
#: vLLM's calls into each worker-side instance (one per TP rank).
WORKER_CALLS = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "clear_connector_metadata",
    "get_kv_connector_stats",
)
#: Steps buffered before a write.
FLUSH_EVERY = 256


class StepClock:
    """Times the methods of one connector instance, one line per step."""

    def __init__(
        self,
        path: str,
        side: str,
        role: str,
        hops: Callable[[], int],
        threads: Callable[[], dict[str, int]],
    ) -> None:
        self._path = path
        self._head = {"side": side, "role": role, "pid": os.getpid()}
        self._hops = hops
        self._threads = threads
        self._lock = threading.Lock()
        self._ns: dict[str, int] = {}
        self._n: dict[str, int] = {}
        self._hops_at = 0
        self._scheduled = 0
        self._lines: list[str] = []
        self._flushed = time.monotonic()

    def wrap(self, target: object, names: tuple[str, ...], boundary: str) -> None:
        """Time each method ``names`` of ``target``; ``boundary`` begins a step."""
        for name in names:
            setattr(target, name, self._timed(getattr(target, name), name, name == boundary))

    def scheduled(self, n: int) -> None:
        """The number of requests vLLM scheduled in the current step."""
        self._scheduled = n

    def _timed(self, fn: Callable[..., Any], name: str, boundary: bool) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if boundary:
                self._end_step()
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter_ns() - t0
                with self._lock:
                    self._ns[name] = self._ns.get(name, 0) + dt
                    self._n[name] = self._n.get(name, 0) + 1

        return timed

    def _end_step(self) -> None:
        hops = self._hops()
        with self._lock:
            ns, n, self._ns, self._n = self._ns, self._n, {}, {}
            line = {
                **self._head,
                "t": round(time.monotonic(), 6),
                "scheduled": self._scheduled,
                "ns": ns,
                "calls": n,
                "hops": hops - self._hops_at,
            }
            self._hops_at = hops
            if ns:
                self._lines.append(json.dumps(line, separators=(",", ":")))
            now = time.monotonic()
            full = len(self._lines) >= FLUSH_EVERY or now - self._flushed > 1.0
        if full:
            self._flushed = now
            self.flush()

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
        if not lines:
            return
        threads = self._threads()
        if threads:
            line = {**self._head, "kind": "threads", "threads": threads}
            lines.append(json.dumps(line, separators=(",", ":")))
        # One write on an O_APPEND descriptor: the scheduler's and every
        # worker's lines share the file, and must not interleave.
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, ("\n".join(lines) + "\n").encode())
        finally:
            os.close(fd)
