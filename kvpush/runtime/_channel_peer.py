"""The control channel's per-peer state: outbox, connection and signals."""

from __future__ import annotations

import math
from collections import deque

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from kvpush.protocol import KvpushError

from ._channel_types import ChannelBusy

#: A writer joins queued frames into one send of about this many bytes.
_BATCH_BYTES = 256 * 1024


class _Signal:
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


class _Outbox:
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
        self.space = _Signal()

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
        while self._items and (not out or size + len(self._items[0][1]) <= _BATCH_BYTES):
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


class _Conn:
    """One established (or being acknowledged) connection to a peer."""

    __slots__ = ("closed", "conn_id", "instance", "lock", "receiver", "scope", "stream")

    def __init__(
        self,
        stream: anyio.abc.SocketStream,
        receiver: BufferedByteReceiveStream,
        conn_id: int,
        instance: int,
    ) -> None:
        self.stream = stream
        self.receiver = receiver
        self.conn_id = conn_id
        self.instance = instance
        self.closed = False
        #: Held by whoever writes (the ack, then the writer's batches).
        self.lock = anyio.Lock()
        #: Cancels the reader when the connection is dropped.
        self.scope = anyio.CancelScope()


class _Peer:
    """Everything known about one peer."""

    __slots__ = (
        "active",
        "conn_changed",
        "connect_failures",
        "connects",
        "down_reason",
        "forgotten",
        "garbage",
        "gen",
        "instance",
        "last_conn_id",
        "loss_armed",
        "loss_scope",
        "name",
        "outbox",
        "pending",
        "received",
        "route",
        "sent",
        "task_scope",
        "up",
        "wake",
        "write_failures",
    )

    def __init__(self, name: str, route: tuple[str, int] | None, outbox: _Outbox) -> None:
        self.name = name
        self.route = route
        self.outbox = outbox
        self.active: _Conn | None = None
        #: The conn id of our dial in flight, if any.
        self.pending: int | None = None
        self.instance: int | None = None
        self.last_conn_id = 0
        self.up = False
        self.down_reason = ""
        #: Bumped on every install: a loss timer of an older generation is void.
        self.gen = 0
        self.loss_armed = False
        self.loss_scope: anyio.CancelScope | None = None
        self.task_scope: anyio.CancelScope | None = None
        self.forgotten = False
        #: Anything changed: data queued, connection, route.
        self.wake = _Signal()
        #: The connection or the route changed.
        self.conn_changed = _Signal()
        self.sent = self.received = self.garbage = self.write_failures = 0
        self.connects = self.connect_failures = 0

    def notify_conn(self) -> None:
        self.conn_changed.fire()
        self.wake.fire()


# --- the channel ----------------------------------------------------------------------
