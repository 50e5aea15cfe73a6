"""The ``kv_transfer_params`` the kvpush router sends and the connector reads:
the one definition of ``{"kvpush": {"transfer_id", "role", "mode", "peer"}}``
(docs/router.md, docs/contract.md; ``_contract.py`` parses the other shapes
into the same :class:`TransferParams`). On the decode leg ``peer`` is the
prefill's control address; on the prefill leg it is only informational.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

from kvpush.protocol import ConfigError, Mode

__all__ = (
    "PARAMS_KEY",
    "RELEASE_KEY",
    "LegRole",
    "ParamsError",
    "Release",
    "Shape",
    "TransferParams",
    "new_transfer_id",
    "parse_host_port",
)

#: The key of kvpush's entry in ``kv_transfer_params``.
PARAMS_KEY = "kvpush"
#: The key of a release (:class:`Release`) in ``kv_transfer_params``.
RELEASE_KEY = "kvpush_release"
#: Which leg of a request an instance serves.
LegRole = Literal["prefill", "decode"]
#: Which contract shape a leg came in (docs/contract.md).
Shape = Literal["kvpush", "nixl", "llmd", "moriio"]

_FIELDS = ("transfer_id", "role", "mode", "peer")
_MAX_LEN = 256
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")


class ParamsError(ConfigError):
    """``kv_transfer_params`` do not follow the schema; the message says how.
    ``reason``: a key of ``_contract.REFUSALS``; ``leg``: a decode leg this
    instance trusts, whose prefill it tells to release the KV, or ``None``."""

    def __init__(
        self, message: str, reason: str = "malformed", leg: TransferParams | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.leg = leg


def new_transfer_id() -> str:
    """A fresh transfer id: ``"kvp-"`` and 32 hex digits (a uuid4)."""
    return f"kvp-{uuid.uuid4().hex}"


def parse_host_port(text: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6addr]:port`` for IPv6) into host and port."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ParamsError(f"IPv6 address must be bracketed, [addr]:port, got {text!r}")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ParamsError(f"expected host:port with a port in 1..65535, got {text!r}")
    return host, int(port)


def _check(tid: object, mode: object, role: object = "prefill") -> None:
    if not isinstance(tid, str) or len(tid) > _MAX_LEN or not _ID.fullmatch(tid):
        raise ParamsError(
            f"transfer_id must be 1..{_MAX_LEN} characters of [A-Za-z0-9._:-] "
            f"starting with a letter or digit, got {tid!r}"
        )
    if role not in ("prefill", "decode"):
        raise ParamsError(f"role must be 'prefill' or 'decode', got {role!r}")
    if not isinstance(mode, Mode):
        raise ParamsError(f"mode must be a kvpush.protocol.Mode, got {mode!r}")


def _mode(value: object) -> Mode:
    try:
        return Mode(value)
    except ValueError:
        raise ParamsError(f"mode must be 'push' or 'pull', got {value!r}") from None


@dataclass(frozen=True, slots=True)
class TransferParams:
    """kvpush's part of one leg's ``kv_transfer_params`` (see the module doc)."""

    #: Router-assigned id of the transfer, the same on both legs.
    transfer_id: str
    #: ``"prefill"`` or ``"decode"``.
    role: LegRole
    #: Push (prefill WRITEs) or pull (decode READs).
    mode: Mode
    #: Prefill leg: the decode's name or URL. Decode leg: the prefill's ``host:port``.
    peer: str
    #: The shape the leg came in: what the prefill answers depends on it.
    shape: Shape = "kvpush"

    def __post_init__(self) -> None:
        _check(self.transfer_id, self.mode, self.role)
        if not isinstance(self.peer, str) or not self.peer or len(self.peer) > _MAX_LEN:
            raise ParamsError(f"peer must be a non-empty str of <= {_MAX_LEN} characters")
        if self.role == "decode":
            parse_host_port(self.peer)

    def peer_address(self) -> tuple[str, int]:
        """The prefill's control address (decode leg only), as ``(host, port)``."""
        if self.role != "decode":
            raise ParamsError("only the decode leg's peer is a control address")
        return parse_host_port(self.peer)

    def to_params(self) -> dict[str, dict[str, str]]:
        """The whole ``kv_transfer_params`` value for this leg (JSON-ready)."""
        return {PARAMS_KEY: {k: getattr(self, k) for k in _FIELDS} | {"mode": self.mode.value}}

    @classmethod
    def from_params(cls, kv_transfer_params: object) -> TransferParams | None:
        """Parse a request's ``kv_transfer_params``: ``None`` when they hold no
        ``"kvpush"`` entry; :class:`ParamsError` when it breaks the schema."""
        if kv_transfer_params is None:
            return None
        if not isinstance(kv_transfer_params, Mapping):
            raise ParamsError(
                f"kv_transfer_params must be an object, got {type(kv_transfer_params).__name__}"
            )
        raw = kv_transfer_params.get(PARAMS_KEY)
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ParamsError(f"kv_transfer_params[{PARAMS_KEY!r}] must be an object")
        missing = [k for k in _FIELDS if k not in raw]
        extra = sorted(str(k) for k in raw if k not in _FIELDS and k != "seal")
        if missing or extra:
            raise ParamsError(
                f"kv_transfer_params[{PARAMS_KEY!r}]: missing {missing}, unknown {extra}; "
                f"expected exactly {list(_FIELDS)} (and an optional seal)"
            )
        for key in _FIELDS:
            if not isinstance(raw[key], str):
                raise ParamsError(f"{key} must be a string, got {type(raw[key]).__name__}")
        mode = _mode(raw["mode"])
        return cls(raw["transfer_id"], cast(LegRole, raw["role"]), mode, raw["peer"])


@dataclass(frozen=True, slots=True)
class Release:
    """A release (docs/contract.md): the prefill is to release
    ``transfer_id``'s KV now, as its decode leg failed before the decode's
    engine saw it (``_contract.release_params`` builds one)."""

    transfer_id: str
    mode: Mode

    def __post_init__(self) -> None:
        _check(self.transfer_id, self.mode)

    @classmethod
    def from_params(cls, raw: object) -> Release:
        """Parse the value of ``kv_transfer_params["kvpush_release"]``."""
        if not isinstance(raw, Mapping):
            raise ParamsError(f"kv_transfer_params[{RELEASE_KEY!r}] must be an object")
        keys = {str(k) for k in raw}
        if not {"transfer_id", "mode"} <= keys <= {"transfer_id", "mode", "seal"}:
            raise ParamsError(
                f"kv_transfer_params[{RELEASE_KEY!r}]: expected transfer_id, mode and an "
                f"optional seal, got {sorted(keys)}"
            )
        return cls(raw["transfer_id"], _mode(raw["mode"]))
