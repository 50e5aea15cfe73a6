"""The control channel's public values: errors, settings, events, statistics."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from kvpush.protocol import (
    MAX_ID_LEN,
    ConfigError,
    ControlMessage,
    KvpushError,
    RemoteProtocolError,
    Timing,
    check_options,
    option,
)

__all__ = (
    "Backoff",
    "ChannelBusy",
    "ChannelClosed",
    "ChannelEvent",
    "ChannelSettings",
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


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays between dials: ``initial * factor**n`` capped at ``maximum``, each
    scaled by a uniform factor in ``[1 - jitter, 1 + jitter]``."""

    initial: float = option(0.05, "the first delay", unit="s", above=0)
    maximum: float = option(2.0, "the largest delay", unit="s", above=0)
    factor: float = option(2.0, "growth per failed dial", low=1)
    jitter: float = option(0.1, "random spread, a fraction below 1", low=0)

    def __post_init__(self) -> None:
        check_options(self)
        if self.maximum < self.initial:
            raise ConfigError("backoff maximum must be >= initial")
        if self.jitter >= 1:
            raise ConfigError(f"jitter must be a number in [0, 1), got {self.jitter!r}")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """The pause after failed attempt number ``attempt`` (0 for the first)."""
        base, n = self.initial, 0
        while n < attempt and base < self.maximum and self.factor > 1:
            base, n = base * self.factor, n + 1
        return min(base, self.maximum) * (1.0 + self.jitter * rng.uniform(-1.0, 1.0))


@dataclass(frozen=True, slots=True)
class ChannelSettings:
    """A :class:`ControlChannel`'s settings (its module docs say what each bounds)."""

    max_queue: int = option(1024, "frames queued per peer", low=1)
    max_queue_bytes: int = option(64 << 20, "bytes queued per peer", unit="bytes", low=1)
    send_timeout: float = option(5.0, "how long send() waits for room", unit="s", above=0)
    connect_timeout: float = option(2.0, "a dial's limit, ack included", unit="s", above=0)
    write_timeout: float = option(10.0, "a write stalled this long drops", unit="s", above=0)
    backoff: Backoff = option(Backoff(), "delays between dials", cli=False)
    peer_lost_after: float = option(5.0, "no connection this long: PeerLost", unit="s", above=0)
    #: Half the protocol's ``max_transit``: the receiving pump's ``stall_limit`` is the other.
    max_age: float = option(Timing().max_transit / 2, "a frame's age limit", unit="s", above=0)
    max_events: int = option(1024, "events waiting to be read", low=1)
    idle_timeout: float | None = option(None, "silence that drops a connection", unit="s", above=0)
    max_handshakes: int = option(64, "connections awaiting their preamble", low=1)
    max_handshakes_per_source: int = option(16, "of them from one address", low=1)
    preamble_timeout: float = option(1.0, "a preamble's limit", unit="s", above=0)
    refusal_log_interval: float = option(10.0, "one log line of refusals per", unit="s", above=0)

    def __post_init__(self) -> None:
        if not isinstance(self.backoff, Backoff):
            raise ConfigError(f"backoff must be a Backoff, got {type(self.backoff).__name__}")
        check_options(self)
        if self.max_handshakes_per_source > self.max_handshakes:
            raise ConfigError("max_handshakes_per_source must be <= max_handshakes")


@dataclass(frozen=True, slots=True)
class Received:
    """``peer`` sent ``message``."""

    peer: str
    message: ControlMessage


@dataclass(frozen=True, slots=True)
class PeerConnected:
    """``peer`` is up and was not: first contact, after a :class:`PeerLost`, or
    a restart (not a reconnect within ``peer_lost_after``)."""

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
    #: Those refusals by reason (only reasons that happened appear; the
    #: reasons: docs/runtime.md, "Connections before their preamble").
    handshake_refusals: Mapping[str, int]
    #: Connections waiting for their preamble now, and at most at once.
    handshakes_waiting: int
    handshakes_waiting_peak: int
    #: Garbage frames from every peer, including forgotten ones.
    garbage: int
    #: Frames discarded unsent with their peer forgotten, or at close.
    discarded: int
    events_queued: int


def check_name(what: str, name: object) -> str:
    if not isinstance(name, str) or not name or len(name.encode()) > MAX_ID_LEN:
        raise ConfigError(f"{what} must be a non-empty str of at most {MAX_ID_LEN} bytes")
    return name
