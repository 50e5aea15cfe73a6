"""The control channel's public values: errors, events, statistics, backoff."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

from kvpush.protocol import (
    MAX_ID_LEN,
    ConfigError,
    ControlMessage,
    KvpushError,
    RemoteProtocolError,
)

__all__ = (
    "Backoff",
    "ChannelBusy",
    "ChannelClosed",
    "ChannelEvent",
    "ChannelStatistics",
    "Garbage",
    "PeerConnected",
    "PeerLost",
    "PeerStatistics",
    "PeerUnreachable",
    "Received",
)


class ChannelClosed(KvpushError):
    """The channel is not open (not entered yet, or closed): nothing more is sent."""


class ChannelBusy(KvpushError):
    """The peer's send queue is full (``send_nowait``) or stayed full for
    ``send_timeout`` seconds (``send``)."""


class PeerUnreachable(KvpushError):
    """No connection to the peer and no route to dial it (or it was lost)."""


# --- configuration, events, statistics ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays between dials: ``initial * factor**n`` capped at ``maximum``, each
    scaled by a uniform factor in ``[1 - jitter, 1 + jitter]``."""

    initial: float = 0.05
    maximum: float = 2.0
    factor: float = 2.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        positive("backoff initial", self.initial)
        positive("backoff maximum", self.maximum)
        if self.maximum < self.initial:
            raise ConfigError("backoff maximum must be >= initial")
        if not isinstance(self.factor, (int, float)) or not 1 <= self.factor < math.inf:
            raise ConfigError(f"backoff factor must be finite and >= 1, got {self.factor!r}")
        if not isinstance(self.jitter, (int, float)) or not 0 <= self.jitter < 1:
            raise ConfigError(f"backoff jitter must be in [0, 1), got {self.jitter!r}")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """The pause after failed attempt number ``attempt`` (0 for the first)."""
        base, n = self.initial, 0
        while n < attempt and base < self.maximum and self.factor > 1:
            base, n = base * self.factor, n + 1
        return min(base, self.maximum) * (1.0 + self.jitter * rng.uniform(-1.0, 1.0))


@dataclass(frozen=True, slots=True)
class Received:
    """``peer`` sent ``message``."""

    peer: str
    message: ControlMessage


@dataclass(frozen=True, slots=True)
class PeerConnected:
    """A connection to ``peer`` is up, and the peer was not (first contact, after
    a :class:`PeerLost`, or a restarted peer). Not sent for a reconnect to the
    same instance within ``peer_lost_after``."""

    peer: str


@dataclass(frozen=True, slots=True)
class PeerLost:
    """``peer`` is gone (feed the core ``peer_lost``); once per loss."""

    peer: str
    reason: str


@dataclass(frozen=True, slots=True)
class Garbage:
    """``peer`` sent a frame that was refused (counted, not delivered)."""

    peer: str
    error: RemoteProtocolError


ChannelEvent = Received | PeerConnected | PeerLost | Garbage


@dataclass(frozen=True, slots=True)
class PeerStatistics:
    """One peer's counters (frames, unless named otherwise)."""

    #: A connection is established now.
    connected: bool
    #: Between PeerConnected and PeerLost.
    up: bool
    route: tuple[str, int] | None
    queued: int
    queued_bytes: int
    sent: int
    received: int
    #: Older than ``max_age`` in the queue: dropped, never sent.
    dropped_old: int
    #: Queued when the peer was lost or restarted (or the channel closed).
    discarded: int
    #: Handed to a connection whose write then failed.
    write_failures: int
    #: Refused frames (the codec's errors and framing errors).
    garbage: int
    #: Connections established, and how many of them replaced an earlier one.
    connects: int
    reconnects: int
    #: Dials that failed (refused, timed out, wrong peer, duplicate).
    connect_failures: int


@dataclass(frozen=True, slots=True)
class ChannelStatistics:
    """A snapshot of :meth:`ControlChannel.statistics`."""

    name: str
    open: bool
    ports: tuple[int, ...]
    peers: Mapping[str, PeerStatistics]
    #: Connections dropped before they named a peer (bad preamble, timeout,
    #: evicted, our own name): the sum of ``handshake_refusals``.
    handshake_failures: int
    #: Those refusals by reason: ``timeout``, ``evicted_source``,
    #: ``evicted_full``, ``closed``, ``malformed``, ``unauthenticated``,
    #: ``own_name`` (only reasons that happened appear).
    handshake_refusals: Mapping[str, int]
    #: Connections waiting for their preamble now, and at most at once.
    handshakes_waiting: int
    handshakes_waiting_peak: int
    #: Garbage frames from every peer, including forgotten ones.
    garbage: int
    #: Frames discarded unsent with their peer forgotten, or at close.
    discarded: int
    events_queued: int


# --- validation the channel shares (not exported) -----------------------------------


def positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{name} must be a positive finite number, got {value!r}")


def check_name(what: str, name: object) -> str:
    if not isinstance(name, str) or not name or len(name.encode()) > MAX_ID_LEN:
        raise ConfigError(f"{what} must be a non-empty str of at most {MAX_ID_LEN} bytes")
    return name
