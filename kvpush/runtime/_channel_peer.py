"""The control channel's records: each peer's (:class:`Peer`: its
:class:`~._link.Link`, queue, connection and counters) and the connections
that have not sent their preamble yet (:class:`Admission`, bounded per source
address and in all: docs/runtime.md, "Connections before their preamble").
The channel owns them all.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from anyio.abc import SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream

from kvpush.protocol import AuthenticationError, Codec, KvpushError, RemoteProtocolError

from ._channel_types import ChannelBusy, ChannelSettings, PeerStatistics
from ._framing import MAX_HANDSHAKE_BYTES, FramingError, Preamble, read_frame, unseal
from ._link import Link

#: The interface the channel uses (the package exports none of it).
__all__ = ("NET_ERRORS", "Admission", "Conn", "Outbox", "Peer", "Signal", "Slot")

log = logging.getLogger("kvpush.runtime.channel")

#: A writer joins queued frames into one send of about this many bytes.
BATCH_BYTES = 256 * 1024

NET_ERRORS = (
    OSError,  # includes TimeoutError
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
)


@dataclass(eq=False, slots=True)
class Signal:
    """Wake-ups without a level: ``waiter()`` returns an event set by the next ``fire()``.
    Take the waiter before checking the condition, then wait: nothing is missed."""

    _event: anyio.Event | None = None

    def fire(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    def waiter(self) -> anyio.Event:
        if self._event is None:
            self._event = anyio.Event()
        return self._event


@dataclass(eq=False, slots=True)
class Outbox:
    """A peer's bounded FIFO of (enqueue time, frame); a frame older than
    ``max_age`` is dropped, never sent late."""

    max_items: int
    max_bytes: int
    max_age: float
    items: deque[tuple[float, bytes]] = field(default_factory=deque)
    #: Set by :meth:`close`: every later put raises ``cls(why)``.
    closed: tuple[type[KvpushError], str] | None = None
    nbytes: int = 0
    dropped_old: int = 0
    discarded: int = 0
    space: Signal = field(default_factory=Signal)

    def _fits(self, n: int) -> bool:
        if not self.items:
            return True
        return len(self.items) < self.max_items and self.nbytes + n <= self.max_bytes

    def put_nowait(self, frame: bytes, now: float) -> None:
        if self.closed is not None:
            cls, why = self.closed
            raise cls(why)
        if not self._fits(len(frame)):
            self.expire(now)
            if not self._fits(len(frame)):
                raise ChannelBusy(f"send queue full ({len(self.items)} frames, {self.nbytes} B)")
        self.items.append((now, frame))
        self.nbytes += len(frame)

    def next_expiry(self) -> float:
        return self.items[0][0] + self.max_age if self.items else math.inf

    def _pop(self) -> bytes:
        _, frame = self.items.popleft()
        self.nbytes -= len(frame)
        return frame

    def expire(self, now: float) -> None:
        n = 0
        while self.items and now - self.items[0][0] > self.max_age:
            self._pop()
            n += 1
        if n:
            self.dropped_old += n
            self.space.fire()

    def take(self, now: float) -> list[bytes]:
        """Drop expired frames, then pop a batch (at least one frame if any)."""
        self.expire(now)
        out: list[bytes] = []
        size = 0
        while self.items and (not out or size + len(self.items[0][1]) <= BATCH_BYTES):
            frame = self._pop()
            out.append(frame)
            size += len(frame)
        if out:
            self.space.fire()
        return out

    def clear(self) -> int:
        n = len(self.items)
        self.items.clear()
        self.nbytes = 0
        self.discarded += n
        self.space.fire()
        return n

    def close(self, cls: type[KvpushError], why: str) -> int:
        """Refuse every later put (waiters wake and raise ``cls(why)``)."""
        if self.closed is None:
            self.closed = (cls, why)
        return self.clear()


@dataclass(eq=False, slots=True)
class Conn:
    """One established (or being acknowledged) connection to a peer."""

    stream: anyio.abc.SocketStream
    receiver: BufferedByteReceiveStream
    conn_id: int
    #: Held by whoever writes (the ack, then the writer's batches).
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    #: Cancels the reader when the connection is dropped (or refused): closed.
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


@dataclass(eq=False, slots=True)
class Peer:
    """Everything the channel holds for one peer; its state is the link's."""

    link: Link
    outbox: Outbox
    #: The adopted connection: set exactly while the link is UP (and open).
    conn: Conn | None = None
    #: The peer's writer (and dialer); cancelled when the peer is forgotten.
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    #: Anything changed: data queued, or the link.
    wake: Signal = field(default_factory=Signal)
    #: The link changed (its timers).
    changed: Signal = field(default_factory=Signal)
    sent: int = 0
    received: int = 0
    garbage: int = 0
    write_failures: int = 0
    connects: int = 0
    connect_failures: int = 0

    @property
    def name(self) -> str:
        return self.link.name

    def statistics(self) -> PeerStatistics:
        box = self.outbox
        return PeerStatistics(
            connected=self.conn is not None,
            up=self.link.up,
            route=self.link.route,
            queued=len(box.items),
            queued_bytes=box.nbytes,
            sent=self.sent,
            received=self.received,
            dropped_old=box.dropped_old,
            discarded=box.discarded,
            write_failures=self.write_failures,
            garbage=self.garbage,
            connects=self.connects,
            reconnects=max(0, self.connects - 1),
            connect_failures=self.connect_failures,
        )


@dataclass(eq=False, slots=True)
class Slot:
    """One accepted connection waiting for its preamble."""

    source: str
    #: Cancelled at the preamble deadline, or to evict the connection.
    scope: anyio.CancelScope
    evicted: str = ""


@dataclass(eq=False, repr=False)
class Admission:
    """The connections waiting for their preamble, bounded per source and in
    all (see the module docs), and the rate-limited log of refusals."""

    #: This channel's name, and how it runs the log's flush (``False``: it is closed).
    name: str
    spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], bool]
    settings: ChannelSettings
    #: Every waiting slot, oldest first; and per source, oldest first.
    slots: dict[Slot, None] = field(default_factory=dict)
    by_source: dict[str, dict[Slot, None]] = field(default_factory=dict)
    #: Refusals ever, by reason; and those not yet logged.
    refused: Counter[str] = field(default_factory=Counter)
    unlogged: Counter[str] = field(default_factory=Counter)
    next_log: float = -1.0
    flush_armed: bool = False
    peak: int = 0

    def enter(self, source: str, now: float) -> Slot:
        """A slot for a connection from ``source`` (making room first)."""
        mine = self.by_source.setdefault(source, {})
        if len(mine) >= self.settings.max_handshakes_per_source:
            self.evict(next(iter(mine)), "evicted_source")
        elif len(self.slots) >= self.settings.max_handshakes:
            most = max(len(v) for v in self.by_source.values())
            oldest = next(s for s in self.slots if len(self.by_source[s.source]) == most)
            self.evict(oldest, "evicted_full")
        slot = Slot(source, anyio.CancelScope(deadline=now + self.settings.preamble_timeout))
        mine[slot] = None
        self.slots[slot] = None
        self.peak = max(self.peak, len(self.slots))
        return slot

    def evict(self, slot: Slot, reason: str) -> None:
        slot.evicted = reason
        self.leave(slot)
        slot.scope.cancel()

    def leave(self, slot: Slot) -> None:
        """Free the slot (no-op if it was evicted already)."""
        if slot not in self.slots:
            return
        del self.slots[slot]
        mine = self.by_source[slot.source]
        del mine[slot]
        if not mine:
            del self.by_source[slot.source]

    def refuse(self, reason: str) -> None:
        """Count a refusal; log it now, or with the next line of counts."""
        now = anyio.current_time()
        self.refused[reason] += 1
        self.unlogged[reason] += 1
        if now >= self.next_log:
            self.log_line(now)
        elif not self.flush_armed:
            self.flush_armed = self.spawn(self._flush)

    async def _flush(self) -> None:
        try:
            await anyio.sleep(max(0.0, self.next_log - anyio.current_time()))
        finally:
            self.flush_armed = False
        self.log_line(anyio.current_time())

    def log_line(self, now: float) -> None:
        """Log the refusals not yet logged, as one line."""
        if not self.unlogged:
            return
        n = sum(self.unlogged.values())
        why = ", ".join(f"{k} {v}" for k, v in sorted(self.unlogged.items()))
        log.warning(
            "%s: refused %d connection(s) before their preamble (%s); %d waiting now",
            self.name,
            n,
            why,
            len(self.slots),
        )
        self.unlogged.clear()
        self.next_log = now + self.settings.refusal_log_interval

    async def preamble(
        self, stream: anyio.abc.SocketStream, codec: Codec
    ) -> tuple[Preamble, BufferedByteReceiveStream] | None:
        """Read an accepted connection's preamble under a slot; ``None``: refused (counted)."""
        address = stream.extra(SocketAttribute.remote_address, "?")
        source = str(address[0] if isinstance(address, tuple) else address)  # the host
        slot = self.enter(source, anyio.current_time())
        receiver = BufferedByteReceiveStream(stream)
        hello: Preamble | None = None
        try:
            with slot.scope:
                frame = await read_frame(receiver, max_frame_bytes=MAX_HANDSHAKE_BYTES)
                hello = Preamble.decode(unseal(frame, codec))
            reason = slot.evicted or "timeout"
            if hello is not None and hello.name == self.name:
                hello, reason = None, "own_name"
        except AuthenticationError:
            reason = "unauthenticated"
        except (FramingError, RemoteProtocolError):
            reason = "malformed"
        except NET_ERRORS:
            reason = "closed"
        finally:
            self.leave(slot)
        if hello is None:
            self.refuse(reason)
            return None
        return hello, receiver
