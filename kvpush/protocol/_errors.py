"""The one exception hierarchy of kvpush.

Every exception the library raises on purpose derives from :class:`KvpushError`.
*Local* errors mean the caller misused the API (fix the calling code); *remote*
errors mean a peer sent something malformed (drop or count the frame, maybe the
peer). Peer *failures* (a peer that dies, a write that fails) are never
exceptions: they are reported as events.
"""

from __future__ import annotations

__all__ = (
    "AuthenticationError",
    "ConfigError",
    "IncompatiblePeerError",
    "KvpushError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "TopologyError",
    "UnsupportedVersionError",
)


class KvpushError(Exception):
    """Root of every exception kvpush raises on purpose."""


class LocalProtocolError(KvpushError):
    """The local caller asked for something the protocol does not allow."""


class RemoteProtocolError(KvpushError):
    """A peer sent something malformed; the input changed no state."""


class UnsupportedVersionError(RemoteProtocolError):
    """The peer speaks another wire version (``version``): upgrade one side."""

    def __init__(self, version: int, ours: int) -> None:
        super().__init__(f"unsupported wire version {version} (this side speaks {ours})")
        self.version = version


class AuthenticationError(RemoteProtocolError):
    """A frame's MAC is missing, wrong, or present while no secret is set."""


class ConfigError(KvpushError, ValueError):
    """A configuration value is out of range or inconsistent."""


class TopologyError(KvpushError, ValueError):
    """A parallelism combination that kvpush cannot map (refused at handshake)."""


class IncompatiblePeerError(KvpushError):
    """Two peers cannot exchange KV; ``field`` names what differs."""

    def __init__(self, field: str, detail: str) -> None:
        detail = detail if len(detail) <= 512 else detail[:509] + "..."
        super().__init__(f"incompatible peer: {field}: {detail}")
        self.field = field
        self.detail = detail
