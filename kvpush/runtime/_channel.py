"""The control channel: codec frames between named endpoints over TCP (anyio).

One :class:`ControlChannel` per endpoint process. It keeps at most one
connection per peer and uses it both ways, whoever dialed it. Peers we must
reach first get a route (:meth:`ControlChannel.add_route`); the channel dials
them, and redials with backoff when the connection drops. Everything that
arrives comes out of one bounded stream of events (:meth:`~ControlChannel.events`):
:class:`Received`, :class:`PeerConnected`, :class:`PeerLost` and :class:`Garbage`.

Sending. Each peer has a bounded queue (``max_queue`` frames and
``max_queue_bytes``) drained by one writer task. :meth:`~ControlChannel.send`
waits up to ``send_timeout`` for room, then raises :class:`ChannelBusy`;
:meth:`~ControlChannel.send_nowait` raises it at once. A frame that waited in
the queue longer than ``max_age`` (half the protocol's ``Timing.max_transit``:
the other half is the receiving pump's ``stall_limit``) is
dropped and counted, never sent late; sockets also get ``TCP_USER_TIMEOUT =
max_age`` where the platform has it, so bytes the peer does not acknowledge in
time kill the connection instead of arriving late. A frame handed to a
connection that then fails is lost (counted), not retried: the protocol
survives lost frames, and a retry could arrive late.

Peer loss. A peer is *up* from :class:`PeerConnected` until :class:`PeerLost`,
which comes exactly once per loss: when its connection dropped and no new one
was established within ``peer_lost_after`` seconds (routed peers are redialed
meanwhile; unrouted ones must dial back), or at once when the peer reconnects
as a new instance (a restart). The frames still queued for it are discarded
then; an unrouted peer is forgotten (sends raise :class:`PeerUnreachable`).

Garbage. A frame the codec refuses (malformed, forged, wrong secret) is counted,
logged and reported as :class:`Garbage`; the connection stays. A length prefix
over the codec's ``max_frame_bytes`` (or a bad preamble) drops the connection;
other peers never notice.

Admission. A connection that has not sent its preamble holds one of at most
``max_handshakes`` slots (at most ``max_handshakes_per_source`` per source
address) for at most ``preamble_timeout`` seconds; a new connection that finds
no room evicts the oldest waiting one of its own source (or of the busiest
source), so a flood of slow or silent connections, even from a real peer's
own address, cannot keep that peer out: its preamble comes with its first
bytes. Refusals are counted by reason (``handshake_refusals``) and logged as
one line of counts per ``refusal_log_interval`` (see :mod:`._channel_links`).

Shutdown. Leaving the ``async with`` block (or :meth:`~ControlChannel.aclose`)
fails every waiting :meth:`~ControlChannel.send` with :class:`ChannelClosed`,
discards queued frames (counted), closes every socket and cancels every task;
it never waits on the network.

Parts. The channel runs each peer's writer and each connection's reader; it
owns its :class:`~._channel_peer.Peers`, its :class:`~._channel_links.Links`
(dial and accept) and the :class:`~._channel_peer.Hub` they share.

Connections open with the preamble described in :mod:`._framing`. When both
sides dial at once, the acceptor with the smaller name refuses the other's dial
while its own is in flight (so the connection dialed by the smaller name wins
on both sides); a dial that arrives while a connection is up replaces it only
if the dialer names that connection as the one it replaces (it saw it die), or
comes from a new instance of the peer. With a codec secret the preamble and
ack are sealed with it too (:func:`._framing.seal`): a forger can neither
inject messages nor displace a peer's connection (a preamble under a live
peer's name and a new instance would otherwise pass for its restart, and fail
its transfers). Without a secret, whoever reaches the port is trusted.
"""

from __future__ import annotations

import logging
from types import MappingProxyType, TracebackType
from typing import Final

import anyio
import anyio.abc
from anyio.abc import SocketAttribute
from anyio.streams.memory import MemoryObjectReceiveStream

from kvpush.protocol import (
    Codec,
    ConfigError,
    ControlMessage,
    RemoteProtocolError,
    Timing,
)

from ._channel_links import Admission, Links
from ._channel_peer import CLOSED, NET_ERRORS, NEW, OPEN, Conn, Hub, Peer, Peers
from ._channel_types import (
    Backoff,
    ChannelBusy,
    ChannelClosed,
    ChannelEvent,
    ChannelStatistics,
    Garbage,
    PeerConnected,
    PeerLost,
    PeerStatistics,
    PeerUnreachable,
    Received,
    check_name,
    positive,
)
from ._framing import FramingError, encode_frame, read_frame

__all__ = (
    "Backoff",
    "ChannelBusy",
    "ChannelClosed",
    "ChannelEvent",
    "ChannelStatistics",
    "ControlChannel",
    "Garbage",
    "PeerConnected",
    "PeerLost",
    "PeerStatistics",
    "PeerUnreachable",
    "Received",
)


log = logging.getLogger("kvpush.runtime.channel")

#: How long aclose() waits for the channel's tasks to finish (they are cancelled).
_CLOSE_GRACE: Final = 2.0


class ControlChannel:
    """Control frames between this endpoint (``name``) and its peers over TCP.

    Use as ``async with ControlChannel(name, codec) as ch:``; inside, call
    :meth:`listen`, :meth:`add_route`, :meth:`send` / :meth:`send_nowait` and
    consume :meth:`events`. ``max_age`` should be half the endpoint's
    ``Timing.max_transit`` (the receiving pump's ``stall_limit`` is the other
    half); ``idle_timeout`` (off by default) drops a connection that received
    nothing for that long (pair it with periodic Heartbeats).
    ``max_handshakes``, ``max_handshakes_per_source``, ``preamble_timeout``
    and ``refusal_log_interval`` bound the connections that have not yet sent
    their preamble (module docs, "Admission").
    """

    def __init__(
        self,
        name: str,
        codec: Codec,
        *,
        max_queue: int = 1024,
        max_queue_bytes: int = 64 << 20,
        send_timeout: float = 5.0,
        connect_timeout: float = 2.0,
        write_timeout: float = 10.0,
        backoff: Backoff | None = None,
        peer_lost_after: float = 5.0,
        max_age: float = Timing().max_transit / 2,
        max_events: int = 1024,
        idle_timeout: float | None = None,
        max_handshakes: int = 64,
        max_handshakes_per_source: int = 16,
        preamble_timeout: float = 1.0,
        refusal_log_interval: float = 10.0,
    ) -> None:
        check_name("name", name)
        if not isinstance(codec, Codec):
            raise ConfigError(f"codec must be a Codec, got {type(codec).__name__}")
        for what, n in (
            ("max_queue", max_queue),
            ("max_queue_bytes", max_queue_bytes),
            ("max_handshakes", max_handshakes),
            ("max_handshakes_per_source", max_handshakes_per_source),
        ):
            if type(n) is not int or n < 1:
                raise ConfigError(f"{what} must be a positive int, got {n!r}")
        if type(max_events) is not int or max_events < 1:
            raise ConfigError(f"max_events must be a positive int, got {max_events!r}")
        for what, v in (
            ("send_timeout", send_timeout),
            ("connect_timeout", connect_timeout),
            ("write_timeout", write_timeout),
            ("peer_lost_after", peer_lost_after),
            ("max_age", max_age),
            ("preamble_timeout", preamble_timeout),
            ("refusal_log_interval", refusal_log_interval),
        ):
            positive(what, v)
        if max_handshakes_per_source > max_handshakes:
            raise ConfigError("max_handshakes_per_source must be <= max_handshakes")
        if idle_timeout is not None:
            positive("idle_timeout", idle_timeout)
        if backoff is not None and not isinstance(backoff, Backoff):
            raise ConfigError(f"backoff must be a Backoff, got {type(backoff).__name__}")
        self._codec = codec
        self._send_timeout = float(send_timeout)
        self._write_timeout = float(write_timeout)
        self._max_age = float(max_age)
        self._max_events = max_events
        self._idle_timeout = idle_timeout
        self._hub = hub = Hub(name, self._max_age)
        self._peers = Peers(hub, self._run_peer, max_queue, max_queue_bytes, float(peer_lost_after))
        adm = Admission(
            hub,
            max_handshakes,
            max_handshakes_per_source,
            float(preamble_timeout),
            float(refusal_log_interval),
        )
        backoff = Backoff() if backoff is None else backoff
        self._links = Links(
            hub, self._peers, self._read_loop, codec, float(connect_timeout), backoff, adm
        )
        self._stopped: anyio.Event | None = None
        self._outer: anyio.abc.TaskGroup | None = None
        self._events_recv: MemoryObjectReceiveStream[ChannelEvent] | None = None
        self._listeners: list[anyio.abc.Listener[anyio.abc.SocketStream]] = []
        self._ports: list[int] = []
        self._garbage = 0

    def __repr__(self) -> str:
        hub = self._hub
        return f"ControlChannel({hub.name!r}, {hub.state}, peers={sorted(self._peers.by_name)})"

    @property
    def name(self) -> str:
        return self._hub.name

    @property
    def max_age(self) -> float:
        """Seconds a frame may wait in a send queue (and unacknowledged on the
        socket) before it is dropped: this side's share of ``max_transit``."""
        return self._max_age

    # --- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> ControlChannel:
        if self._hub.state is not NEW:
            raise ChannelClosed("a ControlChannel can be entered only once")
        send, recv = anyio.create_memory_object_stream[ChannelEvent](self._max_events)
        self._hub.events, self._events_recv = send, recv
        self._stopped = anyio.Event()
        outer = anyio.create_task_group()
        await outer.__aenter__()
        self._outer = outer
        try:
            await outer.start(self._root)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        self._hub.state = OPEN
        for p in self._peers.by_name.values():
            self._peers.start(p)
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
                self._hub.tg = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:
            if self._stopped is not None:
                self._stopped.set()

    async def aclose(self) -> None:
        """Close now: waiting senders get :class:`ChannelClosed`, queued frames are
        discarded, sockets closed, tasks cancelled. Idempotent; never hangs."""
        if self._hub.state is CLOSED:
            return
        self._hub.state = CLOSED
        with anyio.CancelScope(shield=True):
            self._peers.close()
            for listener in self._listeners:
                await anyio.aclose_forcefully(listener)
            await self._hub.close()
            self._links.admission.log_line(anyio.current_time())  # held back by the rate limit
            if self._stopped is not None:
                with anyio.move_on_after(_CLOSE_GRACE):
                    await self._stopped.wait()

    # --- public API -------------------------------------------------------------------

    def events(self) -> MemoryObjectReceiveStream[ChannelEvent]:
        """The stream of events (bounded: ``max_events``). While it is full, readers
        stop reading their sockets (TCP backpressure). It ends after close."""
        if self._events_recv is None:
            raise ChannelClosed("the channel has not been entered")
        return self._events_recv

    async def listen(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Accept peers on ``host:port`` (0: any free port); returns the port."""
        if not self._hub.open:
            raise ChannelClosed("the channel is not open")
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        if self._hub.state is not OPEN:
            await anyio.aclose_forcefully(listener)
            raise ChannelClosed("the channel closed while it started listening")
        self._listeners.append(listener)
        actual: int = listener.extra(SocketAttribute.local_port)
        self._ports.append(actual)
        for sub in listener.listeners:
            if isinstance(sub, anyio.abc.SocketListener):
                self._hub.spawn(self._links.accept_loop, sub)
            else:  # pragma: no cover - TCP listeners are socket listeners
                self._hub.spawn(sub.serve, self._links.accept, self._hub.tg)
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
        if self._hub.state is CLOSED:
            raise ChannelClosed("the channel is closed")
        p = self._peers.by_name.get(peer)
        if p is None:
            self._peers.add(peer, (host, port))
        else:
            p.route = (host, port)
            p.notify_conn()

    def send_nowait(self, peer: str, message: ControlMessage) -> None:
        """Queue ``message`` for ``peer`` or raise: :class:`ChannelBusy` (queue full),
        :class:`PeerUnreachable`, :class:`ChannelClosed`, or the codec's
        :class:`LocalProtocolError` (an invalid message)."""
        frame = self._codec.encode(message)
        p = self._sendable(peer)
        p.outbox.put_nowait(frame, anyio.current_time(), self._max_age)
        p.wake.fire()

    async def send(self, peer: str, message: ControlMessage) -> None:
        """Queue ``message`` for ``peer``, waiting up to ``send_timeout`` for room;
        raises like :meth:`send_nowait` (:class:`ChannelBusy` after the wait)."""
        frame = self._codec.encode(message)
        p = self._sendable(peer)
        deadline = anyio.current_time() + self._send_timeout
        while True:
            now = anyio.current_time()
            space = p.outbox.space.waiter()
            try:
                p.outbox.put_nowait(frame, now, self._max_age)
            except ChannelBusy:
                if now >= deadline:
                    raise ChannelBusy(
                        f"send queue to {peer!r} stayed full for {self._send_timeout} s"
                    ) from None
            else:
                p.wake.fire()
                return
            # Wake when room is made, or when the oldest frame expires.
            wait = min(deadline, p.outbox.next_expiry(self._max_age)) - now
            with anyio.move_on_after(max(wait, 0.0) + 0.001):
                await space.wait()

    def statistics(self) -> ChannelStatistics:
        """A frozen snapshot of the counters."""
        hub, adm = self._hub, self._links.admission
        peers = {p.name: p.statistics() for p in self._peers.by_name.values()}
        events = 0 if hub.events is None else hub.events.statistics().current_buffer_used
        return ChannelStatistics(
            name=hub.name,
            open=hub.state is OPEN,
            ports=tuple(self._ports),
            peers=MappingProxyType(peers),
            handshake_failures=sum(adm.refused.values()),
            handshake_refusals=MappingProxyType(dict(adm.refused)),
            handshakes_waiting=len(adm.slots),
            handshakes_waiting_peak=adm.peak,
            garbage=self._garbage,
            discarded=self._peers.discarded,
            events_queued=events,
        )

    def _sendable(self, peer: str) -> Peer:
        if self._hub.state is not OPEN:
            raise ChannelClosed("the channel is not open")
        p = self._peers.by_name.get(peer)
        if p is None:
            raise PeerUnreachable(f"no connection to {peer!r} and no route to it")
        return p

    # --- per-peer task: dial (through the links), then drain the queue ---------------

    async def _run_peer(self, p: Peer) -> None:
        with anyio.CancelScope() as scope:
            p.task_scope = scope
            while not p.forgotten:
                conn = p.active
                if conn is not None:
                    await self._drain(p, conn)
                elif p.route is not None:
                    await self._links.connect(p)
                else:
                    changed = p.conn_changed.waiter()
                    if p.active is None and p.route is None and not p.forgotten:
                        await changed.wait()

    async def _drain(self, p: Peer, conn: Conn) -> None:
        while p.active is conn:
            wake = p.wake.waiter()
            frames = p.outbox.take(anyio.current_time(), self._max_age)
            if not frames:
                await wake.wait()
                continue
            payload = b"".join(encode_frame(f) for f in frames)
            try:
                with anyio.fail_after(self._write_timeout):
                    async with conn.lock:
                        await conn.stream.send(payload)
            except TimeoutError:
                reason = f"write stalled for {self._write_timeout} s"
            except NET_ERRORS as exc:
                reason = f"write failed: {exc!r}"
            else:
                p.sent += len(frames)
                continue
            p.write_failures += len(frames)
            self._peers.drop(p, conn, reason)

    # --- per-connection task: read until the connection ends -------------------------

    async def _read_loop(self, p: Peer, conn: Conn, events: list[ChannelEvent]) -> None:
        """Emit ``events`` (the install's), then deliver frames until the connection ends."""
        emit = self._hub.emit
        reason = "closed by peer"
        framing: FramingError | None = None
        limit = self._codec.limits.max_frame_bytes
        try:
            # Outside conn.scope: these are emitted even if the connection dies at once.
            for event in events:
                await emit(event)
            with conn.scope:
                while True:
                    if self._idle_timeout is None:
                        frame = await read_frame(conn.receiver, max_frame_bytes=limit)
                    else:
                        with anyio.fail_after(self._idle_timeout):
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
            reason = f"nothing received for {self._idle_timeout} s"
        except (anyio.EndOfStream, anyio.IncompleteRead):
            reason = "closed by peer"
        except NET_ERRORS as exc:
            reason = f"connection error: {exc!r}"
        finally:
            self._peers.drop(p, conn, reason)
        if framing is not None:
            await emit(self._garbage_from(p, framing))

    def _garbage_from(self, p: Peer, exc: RemoteProtocolError) -> Garbage:
        p.garbage += 1
        self._garbage += 1
        log.warning("%s: garbage from %s: %s", self.name, p.name, exc)
        return Garbage(p.name, exc)
