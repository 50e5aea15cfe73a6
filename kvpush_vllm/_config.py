"""The connector's options: ``kv_connector_extra_config``, validated once.

Every key is optional; docs/vllm.md lists them with an example. Unknown keys
are refused (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvpush.protocol import Mode, Timing, build_options, check_options, option

from ._params import parse_host_port
from ._proven import FIELDS

__all__ = ("ConnectorConfig",)

_TIMING = Timing()
_S: dict[str, Any] = {"unit": "s", "above": 0}
_Params = Mapping[str, Mapping[str, Any]]


def _unproven(value: object) -> frozenset[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise ValueError("a list of field names")
    odd = sorted(set(value) - FIELDS)
    if odd:
        raise ValueError(f"a list of field names; unknown field(s) {odd}, known: {sorted(FIELDS)}")
    return frozenset(value)


def _discovery(value: Any) -> tuple[str, str]:
    """``{"router": "host:port", "http": "host:port"}`` (or the pair it became)."""
    if isinstance(value, Mapping) and set(value) == {"router", "http"}:
        value = (value["router"], value["http"])
    with contextlib.suppress(ValueError, AttributeError):  # parse_host_port's refusals
        if isinstance(value, tuple) and len(value) == 2 and all(map(parse_host_port, value)):
            return value
    raise ValueError('{"router": "host:port", "http": "host:port"}')


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """``kv_connector_extra_config``: :meth:`from_extra` reads it (docs/vllm.md says
    what each key does)."""

    host: str = option("127.0.0.1", "control channel host of this instance")
    port: int = option(0, "control port: fixed on a prefill; 0 picks one", low=0, high=65535)
    engine_id: str = option("", "default host:port (random with port 0)", empty=True)
    secret: bytes | None = option(None, "HMAC key of frames and notices", low=16, secret=True)
    mode: Mode = option(Mode.PUSH, "mode of requests whose parameters do not say")
    ready_timeout: float = option(30.0, "decode: a reservation waits for its KV", **_S)
    kv_hold_timeout: float = option(30.0, "prefill: finished KV waits for a registration", **_S)
    max_transit: float = option(_TIMING.max_transit, "Timing.max_transit", **_S)
    op_bound: float = option(_TIMING.op_bound, "Timing.op_bound", **_S)
    backends: tuple[str, ...] = option(("UCX",), "NIXL backends (LIBFABRIC on EFA)")
    backend_params: _Params = option(help="{backend: {param: value}}", factory=dict)
    allow_unproven: frozenset[str] = option(frozenset(), "run unproven (warned)", parse=_unproven)
    idle_wait: float = option(0.01, "decode: empty steps wait for loads", unit="s", low=0, high=1)
    allowed_peers: frozenset[str] = option(frozenset(), "decode: trusted prefills", empty=True)
    progressive: bool = option(False, "prefill: write each chunk's blocks while computing")
    router_discovery: tuple[str, str] | None = option(None, "ZMQ discovery", parse=_discovery)
    timeline_file: str | None = option(None, "a JSON line per transfer (_breakdown.py)")
    step_profile_file: str | None = option(None, "a JSON line per engine step (_steps.py)")
    staging_mib: int = option(0, "each worker's staging pool", unit="MiB", low=0, high=1 << 20)
    staging_always: bool = option(False, "stage every write that can be (tests, measurements)")

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def timing(self) -> Timing:
        return Timing(self.max_transit, self.op_bound)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; :class:`ConfigError` on misuse."""
        config = build_options(cls, extra, what="kv_connector_extra_config")
        engine = f"{config.host}:{config.port}" if config.port else f"kvpush-{secrets.token_hex(6)}"
        return config if config.engine_id else replace(config, engine_id=engine)
