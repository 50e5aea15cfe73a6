"""Constructor options of :class:`NixlTransport`, and the prepped-or-rows rule.

Kept apart from the transport so the measured rule and its figures sit next
to each other (``benchmarks/nixl_strategies.py`` prints the figures).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpush.protocol import MAX_ID_LEN, ConfigError

__all__ = ("SYNC_MODES", "PrepRule", "validate_options")

#: Lock modes offered: NIXL's NONE (its default without the listener thread)
#: hung 3 of 3 times with one thread posting while another polled.
SYNC_MODES = ("STRICT", "RW")


def validate_options(
    agent: object,
    backends: object,
    backend_params: object,
    progress_thread: object,
    sync_mode: object,
    close_timeout: object,
) -> dict[str, dict[str, object]]:
    """``{backend: init params}`` in creation order; ConfigError on misuse."""
    if type(agent) is not str or not 1 <= len(agent.encode()) <= MAX_ID_LEN or "\0" in agent:
        raise ConfigError(f"agent must be a non-empty str of at most {MAX_ID_LEN} bytes")
    ok = isinstance(close_timeout, (int, float)) and not isinstance(close_timeout, bool)
    if not ok or not 0 <= close_timeout <= 3600:  # type: ignore[operator]
        raise ConfigError(f"close_timeout must be seconds in [0, 3600], got {close_timeout!r}")
    if isinstance(backends, str) or not isinstance(backends, Sequence) or not backends:
        raise ConfigError("backends must be a non-empty sequence of NIXL backend names")
    names = list(backends)
    if any(type(b) is not str or not b for b in names) or len(set(names)) != len(names):
        raise ConfigError(f"backends must be distinct non-empty names, got {names!r:.100}")
    params: dict[str, dict[str, object]] = {b: {} for b in names}
    if backend_params is not None:
        if not isinstance(backend_params, Mapping):
            raise ConfigError("backend_params must map backend name -> {param: value}")
        for backend, values in backend_params.items():
            if backend not in params:
                raise ConfigError(f"backend_params names {backend!r}, which is not in backends")
            if not isinstance(values, Mapping):
                raise ConfigError(f"backend_params[{backend!r}] must be a mapping")
            for key, value in values.items():
                if type(key) is not str or not key or not _param_ok(value):
                    raise ConfigError(
                        f"backend_params[{backend!r}][{key!r:.40}]: need a str key and a str, "
                        f"int, bool or list of str/int value, got {value!r:.40}"
                    )
                params[backend][key] = value
    if type(progress_thread) is not bool:
        raise ConfigError(f"progress_thread must be a bool, got {progress_thread!r}")
    if sync_mode not in SYNC_MODES:
        raise ConfigError(f"sync_mode must be one of {SYNC_MODES}, got {sync_mode!r}")
    return params


def _param_ok(value: object) -> bool:
    if isinstance(value, (str, int, bool)):
        return True
    return isinstance(value, Sequence) and all(isinstance(v, (str, int)) for v in value)


@dataclass(frozen=True, slots=True)
class PrepRule:
    """Which way to post a plan of ``merged_rows`` rows (``pieces`` unmerged).

    Measured with ``benchmarks/nixl_strategies.py`` (2 vCPU shared host, UCX
    on loopback, NIXL 1.5.1; medians, ranges over three runs; the full table
    is in ``docs/operations.md``):

    * End to end (two processes; 16 KiB / 256 KiB / 2 MiB blocks; contiguous
      or fragmented destinations; 32 to 2,048 pieces) the two ways are equal
      to within noise, e.g. 2,048 fragmented 16 KiB pieces 9.43 ms by rows,
      9.37 ms by index: over loopback UCX copies inside ``transfer()`` and
      the copy dominates. What differs is the CPU cost of building the
      request, which an RDMA host (where ``transfer`` returns at once) pays
      on the data-plane thread for every transfer.
    * Request cost, our checks included. By rows: 15-35 us fixed, then
      ``initialize_xfer`` grows faster than linearly with rows: 2,048
      fragmented rows 103-122 us, 8,192 550-862 us, 32,768 over 128 regions
      4.8-9.0 ms. By index: 35-90 us fixed (``plan.indices()`` alone is 20-60
      us), then 20-30 ns per piece (~7 ns in runs NIXL merges): 2,048 pieces
      115-151 us, 8,192 240-363 us, 32,768 fragmented 0.88-1.15 ms.
      Contiguous plans (2 rows for 8,192 pieces; 128 rows for 32,768) cost
      15-35 us by rows against 106-193 us by index. Ties: 4,096 fragmented
      rows over 128 regions (140-144 vs 140-178 us) and 16,384 runs of two
      blocks (498-800 vs 512-730 us).

    Rule: by index when ``merged_rows >= 4096`` and ``pieces <= 2 *
    merged_rows`` (large, and merging saved at most half); by rows otherwise.
    It picked the cheaper way in every measured case but the two ties.
    """

    #: Index when the plan merged to at least this share of its pieces ...
    min_merge_ratio: float = 0.5
    #: ... and has at least this many rows (fixed costs amortised).
    min_rows: int = 4096

    def prefers_prepped(self, merged_rows: int, pieces: int) -> bool:
        return merged_rows >= self.min_rows and merged_rows >= self.min_merge_ratio * pieces
