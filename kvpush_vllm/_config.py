"""The connector's options: ``kv_connector_extra_config``, validated once.

Every key is optional; docs/vllm.md lists them with an example. Unknown keys
are refused (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpush.protocol import ConfigError, Mode, Timing

from ._params import parse_host_port
from ._proven import FIELDS

__all__ = ("ConnectorConfig",)


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    #: Control channel address of this instance. A prefill instance needs a
    #: fixed ``port``: decode instances reach it there, and ``host:port`` is its
    #: engine id (the router's ``peer`` for it). ``port`` 0 picks one (decode).
    host: str = "127.0.0.1"
    port: int = 0
    #: This instance's engine id; default ``host:port`` (or a random one with port 0).
    engine_id: str = "kvpush"
    #: Shared secret (>= 16 bytes) for HMAC on control frames and notices.
    secret: bytes | None = None
    #: Default mode for requests whose parameters do not say.
    mode: Mode = Mode.PUSH
    #: Decode: seconds a reservation waits for its KV before it fails.
    ready_timeout: float = 30.0
    #: Prefill: seconds finished KV waits for a registration.
    kv_hold_timeout: float = 30.0
    timing: Timing = field(default_factory=Timing)
    #: NIXL: backends (LIBFABRIC on EFA) and their init parameters.
    backends: tuple[str, ...] = ("UCX",)
    backend_params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Fields of ``_proven.PROVEN`` to run outside what the tests prove (warned).
    allow_unproven: frozenset[str] = frozenset()
    #: A file to append one JSON line per transfer to: the per-request
    #: breakdown (``_breakdown.py``). None: off.
    timeline_file: str | None = None
    #: Decode: seconds an empty engine step waits for the KV it is loading
    #: before vLLM steps again (``_scheduler.SchedulerSide._idle_wait``); 0: never.
    idle_wait: float = 0.01
    #: Decode: prefill addresses (``host:port``, or ``host`` for any port) whose
    #: unsealed decode legs it acts on (docs/contract.md, "Trust").
    allowed_peers: frozenset[str] = frozenset()
    #: vllm-router's ZMQ service discovery (its MoRI-IO WRITE mode): the
    #: router's ``host:port`` and this instance's HTTP ``host:port``. Opt-in:
    #: MoRI-IO legs are read only when it is set.
    router_discovery: tuple[str, str] | None = None
    #: Prefill: write each chunked-prefill step's blocks while the rest is
    #: computed (progressive push, ``_progressive.py``); push legs only.
    progressive: bool = False
    #: A file to append one JSON line per engine step to: what vLLM's calls
    #: into the connector cost (``_steps.py``). None: off.
    step_profile_file: str | None = None
    #: MiB of each worker's staging pool, on the KV's device (staged transfers,
    #: docs/layouts.md); 0: none, every transfer in place. Both sides need one
    #: for a transfer to go staged; the cost model decides per write.
    staging_mib: int = 0
    #: Stage every write that can be, whatever the cost model says (for tests
    #: and measurements, e.g. on host memory where it would write in place).
    staging_always: bool = False

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; :class:`ConfigError` on misuse."""
        raw = dict(extra or {})
        known = {
            "host", "port", "engine_id", "secret", "mode", "ready_timeout",
            "kv_hold_timeout", "max_transit", "op_bound", "backends", "backend_params",
            "allow_unproven", "timeline_file", "idle_wait", "allowed_peers",
            "router_discovery", "progressive", "step_profile_file", "staging_mib",
            "staging_always",
        }  # fmt: skip
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown}; known: {sorted(known)}"
            )
        host = raw.get("host", "127.0.0.1")
        port = raw.get("port", 0)
        if not isinstance(host, str) or not host:
            raise ConfigError(f"host must be a non-empty str, got {host!r}")
        if type(port) is not int or not 0 <= port < 1 << 16:
            raise ConfigError(f"port must be an int in [0, 65535], got {port!r}")
        secret = raw.get("secret")
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < 16):
            raise ConfigError("secret must be a str or bytes of at least 16 bytes")
        mode = raw.get("mode", "push")
        if mode not in ("push", "pull"):
            raise ConfigError(f"mode must be 'push' or 'pull', got {mode!r}")
        times = {}
        for key, default in (
            ("ready_timeout", 30.0),
            ("kv_hold_timeout", 30.0),
            ("max_transit", Timing().max_transit),
            ("op_bound", Timing().op_bound),
        ):
            value = raw.get(key, default)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{key} must be a positive number of seconds, got {value!r}")
            times[key] = float(value)
        backends = raw.get("backends", ["UCX"])
        if isinstance(backends, str) or not isinstance(backends, (list, tuple)) or not backends:
            raise ConfigError(f"backends must be a non-empty list of names, got {backends!r}")
        params = raw.get("backend_params", {})
        if not isinstance(params, Mapping):
            raise ConfigError("backend_params must map backend name -> {param: value}")
        allow = raw.get("allow_unproven", [])
        if isinstance(allow, str) or not isinstance(allow, (list, tuple)):
            raise ConfigError(f"allow_unproven must be a list of field names, got {allow!r}")
        odd = sorted(set(allow) - FIELDS)
        if odd:
            raise ConfigError(f"allow_unproven: unknown field(s) {odd}; known: {sorted(FIELDS)}")
        idle_wait = raw.get("idle_wait", 0.01)
        if type(idle_wait) not in (int, float) or not 0 <= idle_wait <= 1:
            raise ConfigError(f"idle_wait must be seconds in [0, 1], got {idle_wait!r}")
        files = {}
        for key in ("timeline_file", "step_profile_file"):
            path = raw.get(key)
            if path is not None and (not isinstance(path, str) or not path):
                raise ConfigError(f"{key} must be a file path, got {path!r}")
            files[key] = path
        engine_id = raw.get("engine_id", "")
        if not isinstance(engine_id, str):
            raise ConfigError(f"engine_id must be a str, got {engine_id!r}")
        if not engine_id:
            engine_id = f"{host}:{port}" if port else f"kvpush-{secrets.token_hex(6)}"
        peers = raw.get("allowed_peers", [])
        if isinstance(peers, str) or not isinstance(peers, (list, tuple)):
            raise ConfigError(f"allowed_peers must be a list of host:port or host, got {peers!r}")
        for peer in peers:
            if not isinstance(peer, str) or not peer:
                raise ConfigError(f"allowed_peers: {peer!r} is not a host:port or host")
        progressive = raw.get("progressive", False)
        if type(progressive) is not bool:
            raise ConfigError(f"progressive must be true or false, got {progressive!r}")
        staging = raw.get("staging_mib", 0)
        if type(staging) is not int or not 0 <= staging <= 1 << 20:
            raise ConfigError(f"staging_mib must be an int of MiB in [0, 2**20], got {staging!r}")
        always = raw.get("staging_always", False)
        if type(always) is not bool:
            raise ConfigError(f"staging_always must be true or false, got {always!r}")
        discovery = raw.get("router_discovery")
        if discovery is not None:
            if not isinstance(discovery, Mapping) or set(discovery) != {"router", "http"}:
                raise ConfigError(
                    'router_discovery must be {"router": "host:port", "http": "host:port"}, '
                    f"got {discovery!r}"
                )
            for key in ("router", "http"):
                try:
                    parse_host_port(discovery[key])
                except (ConfigError, AttributeError):
                    raise ConfigError(
                        f"router_discovery.{key} must be host:port, got {discovery[key]!r}"
                    ) from None
            discovery = (discovery["router"], discovery["http"])
        return cls(
            host=host,
            port=port,
            engine_id=engine_id,
            secret=secret,
            mode=Mode(mode),
            ready_timeout=times["ready_timeout"],
            kv_hold_timeout=times["kv_hold_timeout"],
            timing=Timing(times["max_transit"], times["op_bound"]),
            backends=tuple(backends),
            backend_params=params,
            allow_unproven=frozenset(allow),
            timeline_file=files["timeline_file"],
            step_profile_file=files["step_profile_file"],
            idle_wait=float(idle_wait),
            allowed_peers=frozenset(peers),
            router_discovery=discovery,
            progressive=progressive,
            staging_mib=staging,
            staging_always=always,
        )
