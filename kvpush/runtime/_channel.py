"""The control channel: codec frames between named endpoints over TCP (anyio).

One :class:`ControlChannel` per endpoint process, at most one connection per
peer, used both ways. Its rules and why (bounded queues and ``max_age``, no
retry of a lost frame, ``PeerLost`` once per loss, garbage, admission before
the preamble, the sealed preamble, shutdown): docs/runtime.md, "The control
channel" and "Trust". Each peer's connection life is decided by its
:class:`~._link.Link` (sans-IO); the channel pumps it as the endpoint runtime
pumps the core, and owns every task, socket and peer.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import secrets
import socket
from collections.abc import Callable, Coroutine
from types import MappingProxyType, TracebackType
from typing import Any, Final

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.abc import SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvpush.protocol import Codec, ConfigError, ControlMessage, RemoteProtocolError, build_options

from ._channel_peer import NET_ERRORS, Admission, Conn, Outbox, Peer
from ._channel_types import (
    Backoff,
    ChannelBusy,
    ChannelClosed,
    ChannelEvent,
    ChannelSettings,
    ChannelStatistics,
    Garbage,
    PeerConnected,
    PeerLost,
    PeerUnreachable,
    Received,
    check_name,
)
from ._framing import (
    MAX_HANDSHAKE_BYTES,
    Ack,
    FramingError,
    Preamble,
    encode_frame,
    read_frame,
    seal,
    unseal,
    write_frame,
)
from ._link import Effect, Input, Link, State

#: The values are _channel_types' (the tests import Backoff from here too).
__all__ = ("Backoff", "ControlChannel")


log = logging.getLogger("kvpush.runtime.channel")

#: How long aclose() waits for the channel's tasks to finish (they are cancelled).
_CLOSE_GRACE: Final = 2.0

NEW, OPEN, CLOSED = "new", "open", "closed"


class ControlChannel:
    """Control frames between this endpoint (``name``) and its peers over TCP.

    Use as ``async with ControlChannel(name, codec) as ch:``; inside, call
    :meth:`listen`, :meth:`add_route`, :meth:`send` / :meth:`send_nowait` and
    consume :meth:`events`. ``settings`` (:class:`ChannelSettings`), or its
    fields as keywords (``max_age=...``), bound the queues, waits and
    handshakes (docs/runtime.md, "The control channel").
    """

    def __init__(
        self, name: str, codec: Codec, settings: ChannelSettings | None = None, **options: Any
    ) -> None:
        check_name("name", name)
        if not isinstance(codec, Codec):
            raise ConfigError(f"codec must be a Codec, got {type(codec).__name__}")
        if settings is None:
            settings = build_options(ChannelSettings, options, what="channel")
        elif options or not isinstance(settings, ChannelSettings):
            raise ConfigError("pass a ChannelSettings or its fields as keywords, not both")
        self.name = name
        self.settings = settings
        self._codec = codec
        self._instance = secrets.randbits(64)
        self._rng = random.Random(secrets.randbits(64))
        self._state = NEW
        self._tg: anyio.abc.TaskGroup | None = None
        self._sockets: set[anyio.abc.SocketStream] = set()
        self._events: MemoryObjectSendStream[ChannelEvent] | None = None
        self._events_recv: MemoryObjectReceiveStream[ChannelEvent] | None = None
        self._peers: dict[str, Peer] = {}
        self._admission = Admission(name, self._spawn, settings)
        self._stopped: anyio.Event | None = None
        self._outer: anyio.abc.TaskGroup | None = None
        self._listeners: list[anyio.abc.Listener[anyio.abc.SocketStream]] = []
        self._ports: list[int] = []
        self._garbage = 0
        #: Frames discarded unsent with their peer forgotten, or at close.
        self._discarded = 0

    def __repr__(self) -> str:
        return f"ControlChannel({self.name!r}, {self._state}, peers={sorted(self._peers)})"

    @property
    def max_age(self) -> float:
        """Seconds a frame may wait in a send queue (and unacknowledged on the
        socket): this side's share of ``max_transit``."""
        return self.settings.max_age

    @property
    def _open(self) -> bool:
        return self._state is OPEN and self._tg is not None

    async def __aenter__(self) -> ControlChannel:
        if self._state is not NEW:
            raise ChannelClosed("a ControlChannel can be entered only once")
        send, recv = anyio.create_memory_object_stream[ChannelEvent](self.settings.max_events)
        self._events, self._events_recv = send, recv
        self._stopped = anyio.Event()
        outer = anyio.create_task_group()
        await outer.__aenter__()
        self._outer = outer
        try:
            await outer.start(self._root)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        self._state = OPEN
        for p in self._peers.values():
            self._start(p)
            self._apply(p, p.link.step(anyio.current_time(), Input.DIAL))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.aclose()
        finally:
            outer, self._outer = self._outer, None
            try:
                if outer is not None:
                    # Our tasks live in an inner group (cancelled by aclose), so the
                    # caller's exception is not ours to wrap: it propagates as is.
                    await outer.__aexit__(None, None, None)
            finally:
                if self._events_recv is not None:
                    self._events_recv.close()

    async def _root(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:
            if self._stopped is not None:
                self._stopped.set()

    async def aclose(self) -> None:
        """Close now: waiting senders get :class:`ChannelClosed`, queued frames are
        discarded, sockets closed, tasks cancelled. Idempotent; never hangs."""
        if self._state is CLOSED:
            return
        self._state = CLOSED
        with anyio.CancelScope(shield=True):
            for p in self._peers.values():
                n = p.outbox.close(ChannelClosed, "the channel is closed")
                self._discarded += n
                if n:
                    log.info("%s: discarded %d frame(s) to %s at close", self.name, n, p.name)
            for listener in self._listeners:
                await anyio.aclose_forcefully(listener)
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
            for stream in list(self._sockets):
                await anyio.aclose_forcefully(stream)
            self._sockets.clear()
            if self._events is not None:
                self._events.close()
            self._admission.log_line(anyio.current_time())  # held back by the rate limit
            if self._stopped is not None:
                with anyio.move_on_after(_CLOSE_GRACE):
                    await self._stopped.wait()

    def events(self) -> MemoryObjectReceiveStream[ChannelEvent]:
        """The stream of events (bounded: ``max_events``); it ends after close."""
        if self._events_recv is None:
            raise ChannelClosed("the channel has not been entered")
        return self._events_recv

    async def listen(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Accept peers on ``host:port`` (0: any free port); returns the port."""
        if not self._open:
            raise ChannelClosed("the channel is not open")
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        if self._state is not OPEN:
            await anyio.aclose_forcefully(listener)
            raise ChannelClosed("the channel closed while it started listening")
        self._listeners.append(listener)
        actual: int = listener.extra(SocketAttribute.local_port)
        self._ports.append(actual)
        for sub in listener.listeners:
            if isinstance(sub, anyio.abc.SocketListener):  # (all TCP listeners are)
                self._spawn(self._accept_loop, sub)
        log.info("%s: listening on %s:%d", self.name, host, actual)
        return actual

    def add_route(self, peer: str, host: str, port: int) -> None:
        """Dial ``peer`` at ``host:port`` (now, and whenever its connection drops)."""
        check_name("peer", peer)
        if peer == self.name:
            raise ConfigError("a channel cannot route to itself")
        if not isinstance(host, str) or not host:
            raise ConfigError("host must be a non-empty str")
        if type(port) is not int or not 0 < port < 1 << 16:
            raise ConfigError(f"port must be an int in [1, 65535], got {port!r}")
        if self._state is CLOSED:
            raise ChannelClosed("the channel is closed")
        p = self._peers.get(peer) or self._add(peer)
        p.link.route = (host, port)
        if self._open:
            self._apply(p, p.link.step(anyio.current_time(), Input.DIAL))

    def send_nowait(self, peer: str, message: ControlMessage) -> None:
        """Queue ``message`` for ``peer`` or raise: :class:`ChannelBusy` (queue full),
        :class:`PeerUnreachable`, :class:`ChannelClosed`, or the codec's
        :class:`LocalProtocolError` (an invalid message)."""
        frame = self._codec.encode(message)
        p = self._sendable(peer)
        p.outbox.put_nowait(frame, anyio.current_time())
        p.wake.fire()

    async def send(self, peer: str, message: ControlMessage) -> None:
        """Queue ``message`` for ``peer``, waiting up to ``send_timeout`` for room;
        raises like :meth:`send_nowait` (:class:`ChannelBusy` after the wait)."""
        frame = self._codec.encode(message)
        p = self._sendable(peer)
        timeout = self.settings.send_timeout
        deadline = anyio.current_time() + timeout
        while True:
            now = anyio.current_time()
            space = p.outbox.space.waiter()
            try:
                p.outbox.put_nowait(frame, now)
            except ChannelBusy:
                if now >= deadline:
                    raise ChannelBusy(
                        f"send queue to {peer!r} stayed full for {timeout} s"
                    ) from None
            else:
                p.wake.fire()
                return
            # Wake when room is made, or when the oldest frame expires.
            wait = min(deadline, p.outbox.next_expiry()) - now
            with anyio.move_on_after(max(wait, 0.0) + 0.001):
                await space.wait()

    def statistics(self) -> ChannelStatistics:
        """A frozen snapshot of the counters."""
        adm = self._admission
        peers = {p.name: p.statistics() for p in self._peers.values()}
        events = 0 if self._events is None else self._events.statistics().current_buffer_used
        return ChannelStatistics(
            name=self.name,
            open=self._state is OPEN,
            ports=tuple(self._ports),
            peers=MappingProxyType(peers),
            handshake_failures=sum(adm.refused.values()),
            handshake_refusals=MappingProxyType(dict(adm.refused)),
            handshakes_waiting=len(adm.slots),
            handshakes_waiting_peak=adm.peak,
            garbage=self._garbage,
            discarded=self._discarded,
            events_queued=events,
        )

    def _sendable(self, peer: str) -> Peer:
        if self._state is not OPEN:
            raise ChannelClosed("the channel is not open")
        p = self._peers.get(peer)
        if p is None:
            raise PeerUnreachable(f"no connection to {peer!r} and no route to it")
        return p

    def _add(self, name: str) -> Peer:
        s = self.settings
        delay = s.backoff.delay
        link = Link(name, self.name, s.peer_lost_after, lambda n: delay(n, self._rng))
        p = self._peers[name] = Peer(link, Outbox(s.max_queue, s.max_queue_bytes, s.max_age))
        if self._open:
            self._start(p)
        return p

    def _start(self, p: Peer) -> None:
        self._spawn(self._run_peer, p, name=f"kvpush channel {self.name}->{p.name}")
        self._spawn(self._run_timers, p)

    def _apply(
        self, p: Peer, effects: list[Effect], conn: Conn | None = None
    ) -> list[ChannelEvent]:
        """Carry out a link's effects (``conn``: the connection handed in); the
        events to emit, in order. ``DIAL`` and ``SEND_PREAMBLE`` are the dialer's."""
        events: list[ChannelEvent] = []
        for effect in effects:
            if effect is Effect.ADOPT and conn is not None:
                p.conn = conn
                p.connects += 1
                log.info("%s: connected to %s (connection %#x)", self.name, p.name, conn.conn_id)
            elif effect is Effect.REFUSE and conn is not None:
                self._close(conn)
            elif effect is Effect.CLOSE_OLD and p.conn is not None:
                self._close(p.conn)
            elif effect is Effect.REPORT_UP:
                events.append(PeerConnected(p.name))
            elif effect is Effect.REPORT_LOST:
                events.append(self._lost(p))
            elif effect is Effect.FORGET:
                self._forget(p)
        p.changed.fire()
        p.wake.fire()
        return events

    def _lost(self, p: Peer) -> PeerLost:
        n = p.outbox.clear()
        reason = p.link.reason
        log.warning("%s: peer %s lost (%s); %d frame(s) discarded", self.name, p.name, reason, n)
        return PeerLost(p.name, reason)

    def _forget(self, p: Peer) -> None:
        if self._peers.get(p.name) is p:
            del self._peers[p.name]
        self._discarded += p.outbox.close(PeerUnreachable, f"peer {p.name!r} was lost")
        p.scope.cancel()

    def _drop(self, p: Peer, conn: Conn, reason: str) -> None:
        """Close ``conn``; if it was the peer's connection, tell the link."""
        if conn.scope.cancel_called:
            return
        self._close(conn)
        if p.conn is not conn:
            return
        p.conn = None
        if self._open:  # (otherwise every socket closes with the channel)
            log.info("%s: connection to %s dropped: %s", self.name, p.name, reason)
            self._apply(p, p.link.dropped(anyio.current_time(), reason))

    def _close(self, conn: Conn) -> None:
        conn.scope.cancel()
        self._spawn(self._close_now, conn.stream)

    async def _run_timers(self, p: Peer) -> None:
        link = p.link
        while link.state is not State.GONE:
            changed = p.changed.waiter()
            deadline = link.next_deadline()
            wait = math.inf if deadline is None else deadline - anyio.current_time()
            with anyio.move_on_after(wait):
                await changed.wait()
            now = anyio.current_time()
            if deadline is not None and now >= deadline:
                for event in self._apply(p, link.handle_timer(now)):
                    await self._emit(event)

    async def _run_peer(self, p: Peer) -> None:
        with p.scope:
            while True:
                wake = p.wake.waiter()
                if p.conn is not None:
                    await self._drain(p, p.conn)
                elif p.link.state is State.DIALING:
                    await self._dial(p)
                else:
                    await wake.wait()

    async def _drain(self, p: Peer, conn: Conn) -> None:
        while p.conn is conn:
            wake = p.wake.waiter()
            frames = p.outbox.take(anyio.current_time())
            if not frames:
                await wake.wait()
                continue
            payload = b"".join(encode_frame(f) for f in frames)
            timeout = self.settings.write_timeout
            try:
                with anyio.fail_after(timeout):
                    async with conn.lock:
                        await conn.stream.send(payload)
            except TimeoutError:
                reason = f"write stalled for {timeout} s"
            except NET_ERRORS as exc:
                reason = f"write failed: {exc!r}"
            else:
                p.sent += len(frames)
                continue
            p.write_failures += len(frames)
            self._drop(p, conn, reason)

    async def _dial(self, p: Peer) -> None:
        """One dial of the link's route: connect, preamble, ack."""
        link, route = p.link, p.link.route
        assert route is not None  # DIALING is entered with a route
        conn_id = secrets.randbits(64) | 1
        pre = Preamble(self.name, self._instance, conn_id, link.conn_id)
        stream: anyio.abc.SocketStream | None = None
        try:
            with anyio.fail_after(self.settings.connect_timeout):
                stream = await anyio.connect_tcp(*route)
                self._adopt_socket(stream)
                receiver = BufferedByteReceiveStream(stream)
                self._apply(p, link.step(anyio.current_time(), Input.CONNECTED))
                await write_frame(stream, seal(pre.encode(), self._codec))
                frame = await read_frame(receiver, max_frame_bytes=MAX_HANDSHAKE_BYTES)
                ack = Ack.decode(unseal(frame, self._codec))
        except BaseException as exc:
            if stream is not None:
                with anyio.CancelScope(shield=True):
                    await self._close_now(stream)
            if not isinstance(exc, (*NET_ERRORS, RemoteProtocolError)):
                raise
            p.connect_failures += 1
            log.debug("%s: dial %s at %s:%d failed: %r", self.name, p.name, *route, exc)
            self._apply(p, link.step(anyio.current_time(), Input.DIAL_FAILED))
            return
        ok = ack.name == p.name and ack.conn_id == conn_id
        if not ok:
            p.connect_failures += 1
            log.warning(
                "%s: %s:%d answered as %r (connection %#x), not %r",
                *(self.name, *route, ack.name, ack.conn_id, p.name),
            )
        if not self._open:
            await self._close_now(stream)
            return
        conn = Conn(stream, receiver, conn_id)
        inp = Input.ACK_OK if ok else Input.ACK_BAD
        now = anyio.current_time()
        events = self._apply(p, link.step(now, inp, instance=ack.instance, conn_id=conn_id), conn)
        if p.conn is conn:
            self._spawn(self._read_loop, p, conn, events)

    async def _accept_loop(self, listener: anyio.abc.SocketListener) -> None:
        while True:
            try:
                stream = await listener.accept()
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:  # out of descriptors and the like: keep serving
                log.warning("%s: accept failed: %r", self.name, exc)
                await anyio.sleep(0.1)
                continue
            if not self._spawn(self._accept, stream):
                await anyio.aclose_forcefully(stream)
                return
            # Let the connections accepted so far read their preamble before
            # the next accept can evict them (a backlog drains one per turn).
            await anyio.lowlevel.checkpoint()

    async def _accept(self, stream: anyio.abc.SocketStream) -> None:
        """One accepted connection, from its preamble to its end."""
        self._adopt_socket(stream)
        got = await self._admission.preamble(stream, self._codec)
        if got is None or not self._open:
            await self._close_now(stream)
            return
        hello, receiver = got
        p = self._peers.get(hello.name) or self._add(hello.name)
        conn = Conn(stream, receiver, hello.conn_id)
        conn.lock.acquire_nowait()  # the ack goes first
        now = anyio.current_time()
        effects = p.link.inbound(now, hello.instance, hello.conn_id, hello.supersedes)
        events = self._apply(p, effects, conn)
        if p.conn is not conn:
            log.debug("%s: refused %s's dial (%s)", self.name, p.name, p.link.state.name)
            return
        try:
            with anyio.fail_after(self.settings.connect_timeout):
                ack = Ack(self.name, self._instance, hello.conn_id).encode()
                await write_frame(stream, seal(ack, self._codec))
        except NET_ERRORS as exc:
            self._drop(p, conn, f"ack failed: {exc!r}")
        finally:
            conn.lock.release()
        await self._read_loop(p, conn, events)

    async def _read_loop(self, p: Peer, conn: Conn, events: list[ChannelEvent]) -> None:
        """Emit ``events`` (the adoption's), then deliver frames until the connection ends."""
        emit, idle = self._emit, self.settings.idle_timeout
        reason = "closed by peer"
        framing: FramingError | None = None
        limit = self._codec.limits.max_frame_bytes
        try:
            # Outside conn.scope: these are emitted even if the connection dies at once.
            for event in events:
                await emit(event)
            with conn.scope:
                while True:
                    with anyio.fail_after(math.inf if idle is None else idle):
                        frame = await read_frame(conn.receiver, max_frame_bytes=limit)
                    try:
                        message = self._codec.decode(frame)
                    except RemoteProtocolError as exc:
                        await emit(self._garbage_from(p, exc))
                        continue
                    p.received += 1
                    await emit(Received(p.name, message))
        except FramingError as exc:
            framing = exc
            reason = f"framing error: {exc}"
        except TimeoutError:
            reason = f"nothing received for {idle} s"
        except (anyio.EndOfStream, anyio.IncompleteRead):
            reason = "closed by peer"
        except NET_ERRORS as exc:
            reason = f"connection error: {exc!r}"
        finally:
            self._drop(p, conn, reason)
        if framing is not None:
            await emit(self._garbage_from(p, framing))

    def _garbage_from(self, p: Peer, exc: RemoteProtocolError) -> Garbage:
        p.garbage += 1
        self._garbage += 1
        log.warning("%s: garbage from %s: %s", self.name, p.name, exc)
        return Garbage(p.name, exc)

    def _spawn(
        self, fn: Callable[..., Coroutine[Any, Any, object]], *args: object, name: str | None = None
    ) -> bool:
        """Run ``fn(*args)`` in the channel's task group; ``False`` if it is not open."""
        if self._tg is None or self._state is not OPEN:
            return False
        self._tg.start_soon(fn, *args, name=name)
        return True

    def _adopt_socket(self, stream: anyio.abc.SocketStream) -> None:
        """Track a new socket (closed at the latest with the channel) and give it
        ``TCP_USER_TIMEOUT = max_age`` where the platform has it."""
        self._sockets.add(stream)
        sock = stream.extra(SocketAttribute.raw_socket, None)
        opt = getattr(socket, "TCP_USER_TIMEOUT", None)
        if sock is not None and opt is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, opt, max(1, round(self.max_age * 1000)))

    async def _close_now(self, stream: anyio.abc.SocketStream) -> None:
        self._sockets.discard(stream)
        await anyio.aclose_forcefully(stream)

    async def _emit(self, event: ChannelEvent) -> None:
        if self._events is None:
            return
        try:
            await self._events.send(event)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            log.debug("%s: event dropped (events closed): %r", self.name, event)
