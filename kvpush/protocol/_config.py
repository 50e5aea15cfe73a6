"""Endpoint configuration: identity, parallelism and the timing bounds."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._errors import ConfigError
from ._layout import KVLayout
from ._messages import Hello
from ._topology import MAX_RANKS
from ._types import MAX_ID_LEN, Mode, Role

__all__ = ("ConsumerConfig", "Identity", "ProducerConfig", "Timing")

#: ``max_ready_timeout`` / ``max_kv_hold_timeout`` unless configured, as a
#: multiple of the base timeout.
RENEW_LIMIT = 10


#: ``Timing.max_transit`` unless configured (seconds).
_MAX_TRANSIT = 2.0


def _positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True, slots=True)
class Timing:
    """Bounds the safety argument rests on (docs/protocol.md, "Timing").

    ``max_transit``: a control frame is delivered within this many seconds of
    being sent, or never (the runtime drops older frames). ``op_bound``: a
    posted write or read settles (lands or dies) within this many seconds.

    The handshake's liveness (no safety rests on these): an unanswered hello
    is sent again after ``hello_retry`` seconds, then after twice that, and so
    on up to ``hello_retry_max`` between two; after ``hello_retries`` resends
    the handshake waits for the next reservation or connection. (Defaults: 1,
    2, 4, 8, 8, ... s, 8 resends, about 47 s, longer than the default
    ``ready_timeout``.)

    ``stall_window``: after the runtime reports a stall (``stalled()``),
    lease-bearing messages received within this many seconds are dropped;
    ``None`` means ``max_transit / 2`` (:attr:`stall_guard`).
    """

    max_transit: float = _MAX_TRANSIT
    op_bound: float = 10.0
    hello_retry: float = 1.0
    hello_retry_max: float = 8.0
    hello_retries: int = 8
    stall_window: float | None = None

    def __post_init__(self) -> None:
        _positive("max_transit", self.max_transit)
        _positive("op_bound", self.op_bound)
        _positive("hello_retry", self.hello_retry)
        _positive("hello_retry_max", self.hello_retry_max)
        if self.hello_retry_max < self.hello_retry:
            raise ConfigError("hello_retry_max must be >= hello_retry")
        if type(self.hello_retries) is not int or not 0 <= self.hello_retries <= 1000:
            raise ConfigError(
                f"hello_retries must be an int in [0, 1000], got {self.hello_retries!r}"
            )
        if self.stall_window is not None:
            _positive("stall_window", self.stall_window)

    @property
    def stall_guard(self) -> float:
        """Seconds after a reported stall during which lease-bearing messages
        are dropped (``stall_window``, else ``max_transit / 2``)."""
        return self.max_transit / 2 if self.stall_window is None else self.stall_window


def _check_fingerprint(fingerprint: tuple[tuple[str, str], ...]) -> None:
    keys = [k for k, _ in fingerprint]
    if len(keys) != len(set(keys)) or len(keys) > 32:
        raise ConfigError("fingerprint keys must be unique (at most 32 entries)")
    for k, v in fingerprint:
        if not k or len(k.encode()) > MAX_ID_LEN or len(v.encode()) > MAX_ID_LEN:
            raise ConfigError(f"fingerprint entry {k!r} is empty or too long")


@dataclass(frozen=True, slots=True)
class Identity:
    """What a peer learns about this endpoint at handshake."""

    engine_id: str
    instance: int
    tp: int = 1
    pp: int = 1
    num_kv_heads: int = 8
    mla: bool = False
    kv_groups: int = 1
    fingerprint: tuple[tuple[str, str], ...] = ()
    modes: tuple[Mode, ...] = (Mode.PUSH, Mode.PULL)
    #: This rank group's KV memory; its fingerprint joins ``fingerprint``.
    layout: KVLayout | None = None
    #: Opaque per-rank data-plane descriptions the runtime fills in.
    ranks: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if type(self.instance) is not int or not 0 <= self.instance < 1 << 64:
            raise ConfigError(f"instance must be an int in [0, 2**64), got {self.instance!r}")
        _check_fingerprint(self.fingerprint)
        if self.layout is not None and self.layout.num_groups != self.kv_groups:
            raise ConfigError(
                f"layout has {self.layout.num_groups} KV groups, kv_groups is {self.kv_groups}"
            )
        if not self.engine_id or len(self.engine_id.encode()) > MAX_ID_LEN:
            raise ConfigError("engine_id must be a non-empty str of at most 256 bytes")
        for name in ("tp", "pp"):
            v = getattr(self, name)
            if type(v) is not int or not 1 <= v <= MAX_RANKS:
                raise ConfigError(f"{name} must be an int in [1, {MAX_RANKS}], got {v!r}")
        if type(self.kv_groups) is not int or not 1 <= self.kv_groups <= 64:
            raise ConfigError(f"kv_groups must be an int in [1, 64], got {self.kv_groups!r}")
        if type(self.num_kv_heads) is not int or not 1 <= self.num_kv_heads <= 1 << 16:
            raise ConfigError(f"num_kv_heads must be a positive int, got {self.num_kv_heads!r}")
        if not self.modes:
            raise ConfigError("modes must name at least one mode")

    def hello(self, role: Role, op_bound: float, max_transit: float = _MAX_TRANSIT) -> Hello:
        """The handshake message this identity sends (an endpoint passes its
        ``Timing``'s ``op_bound`` and ``max_transit``)."""
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
    this (failed epochs it neither settled nor was lost after their
    quarantine), reservations from it are refused (``PEER_SUSPECT``).
    ``None`` (the default): a quarter of ``max_reserved_blocks``, unlimited
    without a budget. A suspect transfer keeps only its own blocks, and
    each ends (its producer settles it, cancels an op that never reported,
    or is proven gone), so other work with that producer goes on meanwhile;
    the cap only keeps one silent producer from taking the whole pool.
    ``epoch_base``: epochs this endpoint hands out start above it (use e.g. a
    start timestamp). ``staging_bytes``: the staging pool every consumer
    rank registers (``KVLayout.staging``, at least this large), handed out
    in slots of whole ``staging_page`` pages to push reservations that ask
    (``reserve(stage_bytes=...)``); 0: none, every transfer in place.
    """

    identity: Identity
    timing: Timing = Timing()
    ready_timeout: float = 30.0
    max_reserved_blocks: int | None = None
    epoch_base: int = 0
    max_ready_timeout: float | None = None
    max_suspect_blocks: int | None = None
    staging_bytes: int = 0
    staging_page: int = 1 << 16

    def __post_init__(self) -> None:
        _positive("ready_timeout", self.ready_timeout)
        if self.max_ready_timeout is not None:
            _positive("max_ready_timeout", self.max_ready_timeout)
            if self.max_ready_timeout < self.ready_timeout:
                raise ConfigError("max_ready_timeout must be >= ready_timeout")
        cap = self.max_suspect_blocks
        if cap is not None and (type(cap) is not int or cap < 0):
            raise ConfigError("max_suspect_blocks must be an int >= 0 or None")
        if self.max_reserved_blocks is not None and self.max_reserved_blocks < 0:
            raise ConfigError("max_reserved_blocks must be >= 0 or None")
        if self.epoch_base < 0:
            raise ConfigError("epoch_base must be >= 0")
        if type(self.staging_bytes) is not int or self.staging_bytes < 0:
            raise ConfigError("staging_bytes must be an int >= 0")
        if type(self.staging_page) is not int or self.staging_page < 1:
            raise ConfigError("staging_page must be an int >= 1")

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
    kv_hold_timeout: float = 30.0
    tombstone_ttl: float = 60.0
    max_kv_hold_timeout: float | None = None

    def __post_init__(self) -> None:
        _positive("kv_hold_timeout", self.kv_hold_timeout)
        if self.max_kv_hold_timeout is not None:
            _positive("max_kv_hold_timeout", self.max_kv_hold_timeout)
            if self.max_kv_hold_timeout < self.kv_hold_timeout:
                raise ConfigError("max_kv_hold_timeout must be >= kv_hold_timeout")
        _positive("tombstone_ttl", self.tombstone_ttl)
        if self.tombstone_ttl <= self.timing.max_transit:
            raise ConfigError("tombstone_ttl must exceed timing.max_transit")

    @property
    def hold_limit(self) -> float:
        """Seconds after ``kv_ready`` past which no keep request extends the hold."""
        limit = self.max_kv_hold_timeout
        return RENEW_LIMIT * self.kv_hold_timeout if limit is None else limit
