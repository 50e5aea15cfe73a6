"""The control channel's peers (:class:`Peers`: the table, and each peer's
connection, :class:`PeerConnected` and :class:`PeerLost`), and the
:class:`Hub` (state, tasks, sockets, events) that the channel's parts share."""

from __future__ import annotations

import contextlib
import logging
import math
import socket
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from anyio.abc import SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.memory import MemoryObjectSendStream

from kvpush.protocol import KvpushError

from ._channel_types import (
    ChannelBusy,
    ChannelClosed,
    ChannelEvent,
    PeerConnected,
    PeerLost,
    PeerStatistics,
    PeerUnreachable,
)

#: The interface the channel and its links use (the package exports none of it).
__all__ = ("CLOSED", "NET_ERRORS", "NEW", "OPEN", "Conn", "Hub", "Outbox", "Peer", "Peers")

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

NEW, OPEN, CLOSED = "new", "open", "closed"


@dataclass(eq=False, repr=False)
class Hub:
    """What the channel's parts share: its state, task group, sockets and events."""

    name: str
    max_age: float
    state: str = NEW
    tg: anyio.abc.TaskGroup | None = None
    sockets: set[anyio.abc.SocketStream] = field(default_factory=set)
    events: MemoryObjectSendStream[ChannelEvent] | None = None

    @property
    def open(self) -> bool:
        return self.state is OPEN and self.tg is not None

    def spawn(
        self, fn: Callable[..., Coroutine[Any, Any, object]], *args: object, name: str | None = None
    ) -> None:
        """Run ``fn(*args)`` in the channel's task group; :class:`ChannelClosed` if not open."""
        if self.tg is None or self.state is not OPEN:
            raise ChannelClosed("the channel is not open")
        self.tg.start_soon(fn, *args, name=name)

    def adopt(self, stream: anyio.abc.SocketStream) -> None:
        """Track a new socket (closed at the latest with the channel) and give it
        ``TCP_USER_TIMEOUT = max_age`` where the platform has it."""
        self.sockets.add(stream)
        sock = stream.extra(SocketAttribute.raw_socket, None)
        opt = getattr(socket, "TCP_USER_TIMEOUT", None)
        if sock is not None and opt is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, opt, max(1, round(self.max_age * 1000)))

    async def close_now(self, stream: anyio.abc.SocketStream) -> None:
        self.sockets.discard(stream)
        await anyio.aclose_forcefully(stream)

    async def emit(self, event: ChannelEvent) -> None:
        if self.events is None:
            return
        try:
            await self.events.send(event)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            log.debug("%s: event dropped (events closed): %r", self.name, event)

    async def close(self) -> None:
        """Cancel every task, close every socket and end the event stream."""
        if self.tg is not None:
            self.tg.cancel_scope.cancel()
        for stream in list(self.sockets):
            await anyio.aclose_forcefully(stream)
        self.sockets.clear()
        if self.events is not None:
            self.events.close()


class Signal:
    """Wake-ups without a level: ``waiter()`` returns an event set by the next ``fire()``.
    Take the waiter before checking the condition, then wait: nothing is missed."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    def fire(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    def waiter(self) -> anyio.Event:
        if self._event is None:
            self._event = anyio.Event()
        return self._event


class Outbox:
    """A peer's bounded FIFO of (enqueue time, frame)."""

    __slots__ = (
        "_closed",
        "_items",
        "_max_bytes",
        "_max_items",
        "discarded",
        "dropped_old",
        "nbytes",
        "space",
    )

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self._items: deque[tuple[float, bytes]] = deque()
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._closed: tuple[type[KvpushError], str] | None = None
        self.nbytes = 0
        self.dropped_old = 0
        self.discarded = 0
        self.space = Signal()

    def __len__(self) -> int:
        return len(self._items)

    def _fits(self, n: int) -> bool:
        if not self._items:
            return True
        return len(self._items) < self._max_items and self.nbytes + n <= self._max_bytes

    def put_nowait(self, frame: bytes, now: float, max_age: float) -> None:
        if self._closed is not None:
            cls, why = self._closed
            raise cls(why)
        if not self._fits(len(frame)):
            self.expire(now, max_age)
            if not self._fits(len(frame)):
                raise ChannelBusy(f"send queue full ({len(self._items)} frames, {self.nbytes} B)")
        self._items.append((now, frame))
        self.nbytes += len(frame)

    def next_expiry(self, max_age: float) -> float:
        return self._items[0][0] + max_age if self._items else math.inf

    def _pop(self) -> bytes:
        _, frame = self._items.popleft()
        self.nbytes -= len(frame)
        return frame

    def expire(self, now: float, max_age: float) -> None:
        n = 0
        while self._items and now - self._items[0][0] > max_age:
            self._pop()
            n += 1
        if n:
            self.dropped_old += n
            self.space.fire()

    def take(self, now: float, max_age: float) -> list[bytes]:
        """Drop expired frames, then pop a batch (at least one frame if any)."""
        self.expire(now, max_age)
        out: list[bytes] = []
        size = 0
        while self._items and (not out or size + len(self._items[0][1]) <= BATCH_BYTES):
            frame = self._pop()
            out.append(frame)
            size += len(frame)
        if out:
            self.space.fire()
        return out

    def clear(self) -> int:
        n = len(self._items)
        self._items.clear()
        self.nbytes = 0
        self.discarded += n
        self.space.fire()
        return n

    def close(self, cls: type[KvpushError], why: str) -> int:
        """Refuse every later put (waiters wake and raise ``cls(why)``)."""
        if self._closed is None:
            self._closed = (cls, why)
        return self.clear()


@dataclass(eq=False, slots=True)
class Conn:
    """One established (or being acknowledged) connection to a peer."""

    stream: anyio.abc.SocketStream
    receiver: BufferedByteReceiveStream
    conn_id: int
    instance: int
    closed: bool = False
    #: Held by whoever writes (the ack, then the writer's batches).
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    #: Cancels the reader when the connection is dropped.
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


@dataclass(eq=False, slots=True)
class Peer:
    """Everything known about one peer."""

    name: str
    route: tuple[str, int] | None
    outbox: Outbox
    active: Conn | None = None
    #: The conn id of our dial in flight, if any.
    pending: int | None = None
    instance: int | None = None
    last_conn_id: int = 0
    up: bool = False
    down_reason: str = ""
    #: Bumped on every install: a loss timer of an older generation is void.
    gen: int = 0
    loss_armed: bool = False
    loss_scope: anyio.CancelScope | None = None
    task_scope: anyio.CancelScope | None = None
    forgotten: bool = False
    #: Anything changed: data queued, connection, route.
    wake: Signal = field(default_factory=Signal)
    #: The connection or the route changed.
    conn_changed: Signal = field(default_factory=Signal)
    sent: int = 0
    received: int = 0
    garbage: int = 0
    write_failures: int = 0
    connects: int = 0
    connect_failures: int = 0

    def notify_conn(self) -> None:
        self.conn_changed.fire()
        self.wake.fire()

    def statistics(self) -> PeerStatistics:
        box = self.outbox
        return PeerStatistics(
            connected=self.active is not None,
            up=self.up,
            route=self.route,
            queued=len(box),
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


@dataclass(eq=False, repr=False)
class Peers:
    """The peer table. Each peer gets one task, ``run(peer)`` (the channel's
    writer, which dials through the links), from when it is added (or the
    channel opens) until it is forgotten."""

    hub: Hub
    run: Callable[[Peer], Coroutine[Any, Any, None]]
    max_queue: int
    max_queue_bytes: int
    lost_after: float
    by_name: dict[str, Peer] = field(default_factory=dict)
    #: Frames discarded unsent with their peer forgotten, or at close.
    discarded: int = 0

    def add(self, name: str, route: tuple[str, int] | None) -> Peer:
        p = Peer(name, route, Outbox(self.max_queue, self.max_queue_bytes))
        self.by_name[name] = p
        if self.hub.open:
            self.start(p)
        return p

    def start(self, p: Peer) -> None:
        self.hub.spawn(self.run, p, name=f"kvpush channel {self.hub.name}->{p.name}")

    def close(self) -> None:
        """At channel close: every queue refuses further frames, its frames discarded."""
        for p in self.by_name.values():
            n = p.outbox.close(ChannelClosed, "the channel is closed")
            self.discarded += n
            if n:
                log.info("%s: discarded %d frame(s) to %s at close", self.hub.name, n, p.name)

    def _forget(self, p: Peer) -> None:
        p.forgotten = True
        if self.by_name.get(p.name) is p:
            del self.by_name[p.name]
        self.discarded += p.outbox.close(PeerUnreachable, f"peer {p.name!r} was lost")
        if p.task_scope is not None:
            p.task_scope.cancel()
        p.notify_conn()

    def _lose(self, p: Peer, reason: str, *, forget: bool) -> PeerLost:
        p.up = False
        n = p.outbox.clear()
        log.warning(
            "%s: peer %s lost (%s); %d frame(s) discarded", self.hub.name, p.name, reason, n
        )
        if forget and p.route is None:
            self._forget(p)
        return PeerLost(p.name, reason)

    def install(self, p: Peer, conn: Conn) -> list[ChannelEvent]:
        """Make ``conn`` the peer's connection (closing any other); the events to emit."""
        events: list[ChannelEvent] = []
        old = p.active
        p.active = conn
        if old is not None:
            self.drop(p, old, "replaced")
        if p.up and p.instance is not None and p.instance != conn.instance:
            events.append(self._lose(p, "peer restarted", forget=False))
        p.instance = conn.instance
        p.last_conn_id = conn.conn_id
        p.gen += 1
        p.loss_armed = False
        if p.loss_scope is not None:
            p.loss_scope.cancel()
            p.loss_scope = None
        p.connects += 1
        if not p.up:
            p.up = True
            events.append(PeerConnected(p.name))
        log.info("%s: connected to %s (connection %#x)", self.hub.name, p.name, conn.conn_id)
        p.notify_conn()
        return events

    def drop(self, p: Peer, conn: Conn, reason: str) -> None:
        """Close ``conn``; if it was the peer's connection, the peer is down."""
        if conn.closed:
            return
        conn.closed = True
        conn.scope.cancel()
        if self.hub.open:  # (otherwise the hub closes every socket with the channel)
            self.hub.spawn(self.hub.close_now, conn.stream)
        if p.active is not conn:
            return
        p.active = None
        p.down_reason = reason
        if not self.hub.open:
            return
        log.info("%s: connection to %s dropped: %s", self.hub.name, p.name, reason)
        p.notify_conn()
        if p.up and not p.loss_armed:
            p.loss_armed = True
            self.hub.spawn(self._watch_loss, p, p.gen)

    async def _watch_loss(self, p: Peer, gen: int) -> None:
        if p.gen != gen:
            return
        with anyio.CancelScope() as scope:
            p.loss_scope = scope
            await anyio.sleep(self.lost_after)
        if p.gen != gen or p.loss_scope is not scope:
            return
        p.loss_scope = None
        p.loss_armed = False
        if p.active is not None or not p.up:
            return
        await self.hub.emit(self._lose(p, p.down_reason, forget=True))
