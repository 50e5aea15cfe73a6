"""Constructor options of :class:`NixlTransport`, and the prepped-or-rows rule.

Kept apart from the transport so the measured rule and its figures sit next
to each other (``benchmarks/nixl_strategies.py`` prints the figures).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpush.protocol import MAX_ID_LEN, ConfigError, build_options, option

__all__ = ("SYNC_MODES", "PrepRule", "validate_options")

#: Lock modes offered: NIXL's NONE (its default without the listener thread)
#: hung 3 of 3 times with one thread posting while another polled.
SYNC_MODES = ("STRICT", "RW")


def _agent(value: Any) -> str:
    if type(value) is not str or not 1 <= len(value.encode()) <= MAX_ID_LEN or "\0" in value:
        raise ValueError(f"a non-empty str of at most {MAX_ID_LEN} bytes without NUL")
    return value


def _params(value: Any) -> Any:
    maps = isinstance(value, Mapping) and all(isinstance(p, Mapping) for p in value.values())
    if not maps or not all(_param_ok(k, v) for p in value.values() for k, v in p.items()):
        raise ValueError("{backend: {param: value}}, a value a str, int, bool or list of str/int")
    return value


def _param_ok(key: object, value: object) -> bool:
    items = value if isinstance(value, Sequence) else [value]  # a str: its characters
    return type(key) is str and bool(key) and all(isinstance(v, (str, int)) for v in items)


@dataclass(frozen=True, slots=True)
class _Options:
    """:class:`NixlTransport`'s constructor options (its docstring says what each does)."""

    agent: str = option(parse=_agent)
    backends: tuple[str, ...] = option()
    backend_params: Mapping[str, Mapping[str, Any]] = option(parse=_params)
    progress_thread: bool = option()
    sync_mode: str = option(choices=SYNC_MODES)
    close_timeout: float = option(unit="s", low=0, high=3600)


def validate_options(
    agent: object,
    backends: object,
    backend_params: object,
    progress_thread: object,
    sync_mode: object,
    close_timeout: object,
) -> dict[str, dict[str, object]]:
    """``{backend: init params}`` in creation order; ConfigError on misuse."""
    params = {} if backend_params is None else backend_params
    raw = {"agent": agent, "backends": backends, "backend_params": params}
    raw.update(progress_thread=progress_thread, sync_mode=sync_mode, close_timeout=close_timeout)
    opts = build_options(_Options, raw, what="NixlTransport")
    names = opts.backends
    if len(set(names)) < len(names) or not set(opts.backend_params) <= set(names):
        raise ConfigError(f"backends must be distinct names covering backend_params, got {names}")
    return {b: dict(opts.backend_params.get(b, {})) for b in names}


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
