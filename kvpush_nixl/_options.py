"""Constructor options of :class:`NixlTransport`, and the prepped-or-rows rule
(kept beside its figures: ``benchmarks/nixl_strategies.py`` prints them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpush.protocol import MAX_ID_LEN, ConfigError, check_options, option

__all__ = ("NixlOptions", "PrepRule")


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
class NixlOptions:
    """:class:`NixlTransport`'s constructor options (its docstring says what each does)."""

    agent: str = option(parse=_agent)
    backends: tuple[str, ...] = option()
    backend_params: Mapping[str, Mapping[str, Any]] | None = option(parse=_params)
    progress_thread: bool = option()
    #: NIXL's NONE lock mode (its default without the listener thread) hung 3
    #: of 3 times with one thread posting while another polled.
    sync_mode: str = option(choices=("STRICT", "RW"))
    close_timeout: float = option(unit="s", low=0, high=3600)

    def __post_init__(self) -> None:
        check_options(self)
        names = self.backends
        if len(set(names)) < len(names) or not set(self.backend_params or ()) <= set(names):
            raise ConfigError(
                f"backends must be distinct names covering backend_params, got {names}"
            )

    def params(self) -> dict[str, dict[str, object]]:
        """``{backend: init params}`` in creation order."""
        given = self.backend_params or {}
        return {b: dict(given.get(b, {})) for b in self.backends}


@dataclass(frozen=True, slots=True)
class PrepRule:
    """Which way to post a plan of ``merged_rows`` rows (``pieces`` unmerged):
    by index when ``merged_rows >= 4096`` and ``pieces <= 2 * merged_rows``
    (large, and merging saved at most half), by rows otherwise. The figures
    behind it (``benchmarks/nixl_strategies.py``): docs/operations.md."""

    #: Index when the plan merged to at least this share of its pieces ...
    min_merge_ratio: float = 0.5
    #: ... and has at least this many rows (fixed costs amortised).
    min_rows: int = 4096

    def prefers_prepped(self, merged_rows: int, pieces: int) -> bool:
        return merged_rows >= self.min_rows and merged_rows >= self.min_merge_ratio * pieces
