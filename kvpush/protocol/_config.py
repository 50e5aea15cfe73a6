"""Endpoint configuration: identity, parallelism and the timing bounds."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ._errors import ConfigError
from ._layout import KVLayout
from ._messages import Hello
from ._options import check_options, option
from ._topology import MAX_RANKS
from ._types import MAX_ID_LEN, Mode, Role

__all__ = ("ConsumerConfig", "Identity", "ProducerConfig", "Timing")

#: ``max_ready_timeout`` / ``max_kv_hold_timeout`` unless configured, as a
#: multiple of the base timeout.
RENEW_LIMIT = 10
#: A positive number of seconds (each field's docs: its class's docstring).
_S: dict[str, Any] = {"unit": "s", "above": 0}


@dataclass(frozen=True, slots=True)
class Timing:
    """Bounds the safety argument rests on (docs/protocol.md, "Timing").

    ``max_transit``: a control frame is delivered within this many seconds of
    being sent, or never (the runtime drops older frames). ``op_bound``: a
    posted write or read settles (lands or dies) within this many seconds.

    The handshake's liveness (no safety rests on these): an unanswered hello
    is sent again after ``hello_retry`` seconds, then twice that, up to
    ``hello_retry_max``; after ``hello_retries`` resends (by default about
    47 s) it waits for the next reservation or connection.

    ``stall_window``: after the runtime reports a stall (``stalled()``),
    lease-bearing messages received within this many seconds are dropped;
    ``None`` means ``max_transit / 2`` (:attr:`stall_guard`).
    """

    max_transit: float = option(2.0, **_S)
    op_bound: float = option(10.0, **_S)
    hello_retry: float = option(1.0, **_S)
    hello_retry_max: float = option(8.0, unit="s", low="hello_retry")
    hello_retries: int = option(8, low=0, high=1000)
    stall_window: float | None = option(None, **_S)

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def stall_guard(self) -> float:
        """``stall_window``, else ``max_transit / 2``."""
        return self.max_transit / 2 if self.stall_window is None else self.stall_window


def _fingerprint(value: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    keys = {k for k, v in value if k and len(k.encode()) <= MAX_ID_LEN >= len(v.encode())}
    if len(keys) != len(value) or len(keys) > 32:
        raise ValueError(f"at most 32 pairs of str, unique non-empty keys, <= {MAX_ID_LEN} bytes")
    return value


@dataclass(frozen=True, slots=True)
class Identity:
    """What a peer learns about this endpoint at handshake."""

    engine_id: str = option(high=MAX_ID_LEN)
    instance: int = option(low=0, high=2**64 - 1)
    tp: int = option(1, low=1, high=MAX_RANKS)
    pp: int = option(1, low=1, high=MAX_RANKS)
    num_kv_heads: int = option(8, low=1, high=1 << 16)
    mla: bool = option(False)
    kv_groups: int = option(1, low=1, high=64)
    fingerprint: tuple[tuple[str, str], ...] = option((), parse=_fingerprint)
    modes: tuple[Mode, ...] = (Mode.PUSH, Mode.PULL)
    #: This rank group's KV memory; its fingerprint joins ``fingerprint``.
    layout: KVLayout | None = None
    #: Opaque per-rank data-plane descriptions the runtime fills in.
    ranks: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        check_options(self)
        if self.layout is not None and self.layout.num_groups != self.kv_groups:
            raise ConfigError(
                f"layout has {self.layout.num_groups} KV groups, kv_groups is {self.kv_groups}"
            )
        if not self.modes:
            raise ConfigError("modes must name at least one mode")

    def hello(
        self, role: Role, op_bound: float, max_transit: float = Timing().max_transit
    ) -> Hello:
        """The handshake message this identity sends."""
        return Hello(
            self.engine_id,
            self.instance,
            role,
            self.tp,
            self.pp,
            self.num_kv_heads,
            self.mla,
            self.kv_groups,
            op_bound,
            max_transit,
            self.fingerprint + (self.layout.fingerprint() if self.layout else ()),
            self.modes,
            layout=self.layout,
            ranks=self.ranks,
        )


@dataclass(frozen=True, slots=True)
class ConsumerConfig:
    """Decode-side settings.

    ``ready_timeout``: a reservation that is not ready this many seconds after
    it was made fails, unless its producer renews it (it is still computing):
    each renewal moves the deadline to ``ready_timeout`` after it, never past
    ``max_ready_timeout`` after the reservation (``None``: ten times
    ``ready_timeout``). ``max_reserved_blocks``: budget over all reservations,
    draining and suspect ones included (``None`` = unlimited).
    ``max_suspect_blocks``: while a producer keeps more suspect blocks than
    this, reservations from it are refused (``PEER_SUSPECT``); ``None``: a
    quarter of ``max_reserved_blocks``. The cap only keeps one silent
    producer from taking the whole pool: each suspect transfer ends alone.
    ``epoch_base``: epochs this endpoint hands out start above it (use e.g. a
    start timestamp). ``staging_bytes``: the staging pool every consumer
    rank registers, handed out in slots of whole ``staging_page`` pages to
    push reservations that ask (``reserve(stage_bytes=...)``); 0: none.
    """

    identity: Identity
    timing: Timing = Timing()
    ready_timeout: float = option(30.0, **_S)
    max_reserved_blocks: int | None = option(None, low=0)
    epoch_base: int = option(0, low=0)
    max_ready_timeout: float | None = option(None, unit="s", low="ready_timeout")
    max_suspect_blocks: int | None = option(None, low=0)
    staging_bytes: int = option(0, unit="bytes", low=0)
    staging_page: int = option(1 << 16, unit="bytes", low=1)

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def suspect_cap(self) -> float:
        """Suspect blocks a producer may keep before it is refused."""
        if self.max_suspect_blocks is not None:
            return self.max_suspect_blocks
        budget = self.max_reserved_blocks
        return math.inf if budget is None else budget // 4

    @property
    def ready_limit(self) -> float:
        """Seconds after a reservation past which no renewal moves its deadline."""
        limit = self.max_ready_timeout
        return RENEW_LIMIT * self.ready_timeout if limit is None else limit


@dataclass(frozen=True, slots=True)
class ProducerConfig:
    """Prefill-side settings.

    ``kv_hold_timeout``: how long ready KV waits for a usable registration
    (or, once delivered, for the consumer's acknowledgment); a decode that
    cannot reserve yet may ask to keep it (``Renew``), each time for
    ``kv_hold_timeout`` more, never past ``max_kv_hold_timeout`` after the KV
    was ready (``None``: ten times ``kv_hold_timeout``). ``tombstone_ttl``:
    how long a released transfer keeps rejecting registrations; must exceed
    ``timing.max_transit`` so that no delayed or duplicated registration can
    revive it.
    """

    identity: Identity
    timing: Timing = Timing()
    kv_hold_timeout: float = option(30.0, **_S)
    tombstone_ttl: float = option(60.0, unit="s", above="timing.max_transit")
    max_kv_hold_timeout: float | None = option(None, unit="s", low="kv_hold_timeout")

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def hold_limit(self) -> float:
        """Seconds after ``kv_ready`` past which no keep request extends the hold."""
        limit = self.max_kv_hold_timeout
        return RENEW_LIMIT * self.kv_hold_timeout if limit is None else limit
