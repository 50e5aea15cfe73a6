"""The control channel's connection set-up: dialing a peer and accepting a
peer's dial, each opened by the preamble exchange of :mod:`._framing`.

A mixin of :class:`~kvpush.runtime.ControlChannel` (its module docs give the
rules: at most one connection per peer, the smaller name's dial wins a race,
a dial replaces a live connection only if it names it or comes from a new
instance). Kept apart so each module reads in one sitting; the attributes
and methods declared below belong to :class:`ControlChannel`.

Admission. Before its preamble a connection is nobody's, and anyone who
reaches the port can open one, so what it may hold is bounded in count and
time (:class:`_Admission`): at most ``max_handshakes`` connections wait for
their preamble at once, at most ``max_handshakes_per_source`` from one source
address, each for at most ``preamble_timeout`` seconds. A new connection is
never refused for want of room: the *oldest* waiting one of its source makes
room (or, when the whole table is full, the oldest of the source that holds
the most). A real peer sends its whole preamble with its first bytes, so it
leaves the table within one turn of the event loop, long before
``max_handshakes_per_source`` newer connections can push it out, even when it
shares its address with the flood (loopback, a NAT). A flood of connections
that send nothing, or a byte at a time, only ever evicts itself. Each refusal
is counted by reason (``ChannelStatistics.handshake_refusals``) and logged at
most once per ``refusal_log_interval`` seconds, as one line of counts.
"""

from __future__ import annotations

import logging
import random
import secrets
from collections import Counter
from typing import Final

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.abc import SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream

from kvpush.protocol import AuthenticationError, Codec, RemoteProtocolError

from ._channel_peer import _Conn, _Peer
from ._channel_types import Backoff, ChannelEvent
from ._framing import (
    MAX_HANDSHAKE_BYTES,
    Ack,
    FramingError,
    Preamble,
    read_frame,
    seal,
    unseal,
    write_frame,
)

log = logging.getLogger("kvpush.runtime.channel")

#: Why a connection was refused before (or at) its preamble: the keys of
#: ``ChannelStatistics.handshake_refusals``.
REFUSALS: Final = (
    #: No whole preamble within ``preamble_timeout``.
    "timeout",
    #: Pushed out by a newer connection from the same source, which held
    #: ``max_handshakes_per_source`` already.
    "evicted_source",
    #: Pushed out by a newer connection while ``max_handshakes`` waited.
    "evicted_full",
    #: The connection ended or failed before its preamble.
    "closed",
    #: Not a preamble (a bad length, magic or name).
    "malformed",
    #: A missing or wrong seal (the codec's secret).
    "unauthenticated",
    #: A preamble that claims this channel's own name.
    "own_name",
)

_NET_ERRORS = (
    OSError,  # includes TimeoutError
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
)

_NEW, _OPEN, _CLOSED = "new", "open", "closed"


class _Slot:
    """One accepted connection waiting for its preamble."""

    __slots__ = ("evicted", "scope", "source")

    def __init__(self, source: str, scope: anyio.CancelScope) -> None:
        self.source = source
        #: Cancelled at the preamble deadline, or to evict the connection.
        self.scope = scope
        self.evicted = ""


class _Admission:
    """The connections waiting for their preamble, bounded per source and in
    all (see the module docs), and the rate-limited log of refusals."""

    def __init__(
        self, name: str, total: int, per_source: int, timeout: float, log_interval: float
    ) -> None:
        self.name = name
        self.total = total
        self.per_source = per_source
        self.timeout = timeout
        self.log_interval = log_interval
        #: Every waiting slot, oldest first; and per source, oldest first.
        self.slots: dict[_Slot, None] = {}
        self.by_source: dict[str, dict[_Slot, None]] = {}
        #: Refusals ever, by reason; and those not yet logged.
        self.refused: Counter[str] = Counter()
        self.unlogged: Counter[str] = Counter()
        self.next_log = -1.0
        self.flush_armed = False
        self.peak = 0

    def enter(self, source: str, now: float) -> _Slot:
        """A slot for a connection from ``source`` (making room first)."""
        mine = self.by_source.setdefault(source, {})
        if len(mine) >= self.per_source:
            self.evict(next(iter(mine)), "evicted_source")
        elif len(self.slots) >= self.total:
            most = max(len(v) for v in self.by_source.values())
            oldest = next(s for s in self.slots if len(self.by_source[s.source]) == most)
            self.evict(oldest, "evicted_full")
        slot = _Slot(source, anyio.CancelScope(deadline=now + self.timeout))
        mine[slot] = None
        self.slots[slot] = None
        self.peak = max(self.peak, len(self.slots))
        return slot

    def evict(self, slot: _Slot, reason: str) -> None:
        slot.evicted = reason
        self.leave(slot)
        slot.scope.cancel()

    def leave(self, slot: _Slot) -> None:
        """Free the slot (no-op if it was evicted already)."""
        if slot not in self.slots:
            return
        del self.slots[slot]
        mine = self.by_source[slot.source]
        del mine[slot]
        if not mine:
            del self.by_source[slot.source]

    def refuse(self, reason: str, now: float) -> bool:
        """Count a refusal; whether to log now (else a flush is due later)."""
        self.refused[reason] += 1
        self.unlogged[reason] += 1
        return now >= self.next_log

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
        self.next_log = now + self.log_interval


class _Links:
    """Dial and accept (see the module docs)."""

    # --- ControlChannel's state and helpers that set-up uses -------------------------

    _name: str
    _codec: Codec
    _instance: int
    _state: str
    _peers: dict[str, _Peer]
    _sockets: set[anyio.abc.SocketStream]
    _admission: _Admission
    _handshake_failures: int
    _connect_timeout: float
    _backoff: Backoff
    _rng: random.Random

    def _tg(self) -> anyio.abc.TaskGroup:
        raise NotImplementedError

    def _tune(self, stream: anyio.abc.SocketStream) -> None:
        raise NotImplementedError

    async def _close_now(self, stream: anyio.abc.SocketStream) -> None:
        raise NotImplementedError

    def _new_peer(self, name: str, route: tuple[str, int] | None) -> _Peer:
        raise NotImplementedError

    def _install(self, p: _Peer, conn: _Conn) -> list[ChannelEvent]:
        raise NotImplementedError

    def _drop(self, p: _Peer, conn: _Conn, reason: str) -> None:
        raise NotImplementedError

    async def _read_loop(self, p: _Peer, conn: _Conn, events: list[ChannelEvent]) -> None:
        raise NotImplementedError

    # --- dialing -----------------------------------------------------------------------

    async def _connect(self, p: _Peer) -> None:
        """Dial until the peer is connected (by us or by its own dial)."""
        attempt = 0
        while p.active is None and p.route is not None and not p.forgotten:
            changed = p.conn_changed.waiter()
            if await self._dial(p, p.route):
                return
            # ``changed`` is already set if the peer's own dial won meanwhile.
            with anyio.move_on_after(self._backoff.delay(attempt, self._rng)):
                await changed.wait()
            attempt += 1

    async def _dial(self, p: _Peer, route: tuple[str, int]) -> bool:
        conn_id = secrets.randbits(64) | 1
        pre = Preamble(self._name, self._instance, conn_id, p.last_conn_id)
        p.pending = conn_id
        stream: anyio.abc.SocketStream | None = None
        try:
            with anyio.fail_after(self._connect_timeout):
                stream = await anyio.connect_tcp(*route)
                self._sockets.add(stream)
                self._tune(stream)
                receiver = BufferedByteReceiveStream(stream)
                await write_frame(stream, seal(pre.encode(), self._codec))
                frame = await read_frame(receiver, max_frame_bytes=MAX_HANDSHAKE_BYTES)
                ack = Ack.decode(unseal(frame, self._codec))
        except (*_NET_ERRORS, RemoteProtocolError) as exc:
            p.connect_failures += 1
            log.debug("%s: dial %s at %s:%d failed: %r", self._name, p.name, *route, exc)
            if stream is not None:
                await self._close_now(stream)
            return False
        except BaseException:
            if stream is not None:
                with anyio.CancelScope(shield=True):
                    await self._close_now(stream)
            raise
        finally:
            if p.pending == conn_id:
                p.pending = None
        if ack.name != p.name or ack.conn_id != conn_id:
            p.connect_failures += 1
            log.warning(
                "%s: %s:%d answered as %r (connection %#x), not %r",
                self._name,
                *route,
                ack.name,
                ack.conn_id,
                p.name,
            )
            await self._close_now(stream)
            return False
        if p.active is not None or p.forgotten or self._state is not _OPEN:
            await self._close_now(stream)  # the peer's own dial won meanwhile
            return False
        conn = _Conn(stream, receiver, conn_id, ack.instance)
        self._tg().start_soon(self._read_loop, p, conn, self._install(p, conn))
        return True

    # --- accepting --------------------------------------------------------------------

    async def _accept_loop(self, listener: anyio.abc.SocketListener) -> None:
        while True:
            try:
                stream = await listener.accept()
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:  # out of descriptors and the like: keep serving
                log.warning("%s: accept failed: %r", self._name, exc)
                await anyio.sleep(0.1)
                continue
            if self._state is not _OPEN:
                await self._close_now(stream)
                return
            self._tg().start_soon(self._on_accept, stream)
            # Let the connections accepted so far read their preamble before
            # the next accept can evict them (a backlog drains one per turn).
            await anyio.lowlevel.checkpoint()

    async def _on_accept(self, stream: anyio.abc.SocketStream) -> None:
        self._sockets.add(stream)
        adm = self._admission
        slot = adm.enter(_source(stream), anyio.current_time())
        frame: bytes | None = None
        hello: Preamble | None = None
        reason = ""
        try:
            self._tune(stream)
            receiver = BufferedByteReceiveStream(stream)
            with slot.scope:
                frame = await read_frame(receiver, max_frame_bytes=MAX_HANDSHAKE_BYTES)
            if frame is None:
                reason = slot.evicted or "timeout"
            else:
                hello = Preamble.decode(unseal(frame, self._codec))
        except AuthenticationError:
            reason = "unauthenticated"
        except (FramingError, RemoteProtocolError):
            reason = "malformed"
        except _NET_ERRORS:
            reason = "closed"
        finally:
            adm.leave(slot)
        if hello is None:
            self._refuse(reason)
            await self._close_now(stream)
            return
        admitted = self._admit(hello, stream, receiver)
        if admitted is None:
            await self._close_now(stream)
            return
        p, conn, events = admitted
        try:
            with anyio.fail_after(self._connect_timeout):
                ack = Ack(self._name, self._instance, hello.conn_id).encode()
                await write_frame(stream, seal(ack, self._codec))
        except _NET_ERRORS as exc:
            self._drop(p, conn, f"ack failed: {exc!r}")
        finally:
            conn.lock.release()
        await self._read_loop(p, conn, events)

    def _admit(
        self,
        hello: Preamble,
        stream: anyio.abc.SocketStream,
        receiver: BufferedByteReceiveStream,
    ) -> tuple[_Peer, _Conn, list[ChannelEvent]] | None:
        """Decide on a dialed connection; if accepted, install it (write lock held)."""
        name = hello.name
        if self._state is not _OPEN:
            return None
        if name == self._name:
            self._refuse("own_name")
            return None
        p = self._peers.get(name)
        if p is not None:
            a = p.active
            if a is not None:
                if a.instance == hello.instance and hello.supersedes != a.conn_id:
                    log.debug("%s: refused a duplicate connection from %s", self._name, name)
                    return None
            elif p.pending is not None and self._name < name:
                log.debug("%s: refused %s's dial (ours wins)", self._name, name)
                return None
        else:
            p = self._new_peer(name, None)
        conn = _Conn(stream, receiver, hello.conn_id, hello.instance)
        conn.lock.acquire_nowait()  # the ack goes first
        return p, conn, self._install(p, conn)

    # --- refusals, counted and logged at a bounded rate -----------------------------

    def _refuse(self, reason: str) -> None:
        self._handshake_failures += 1
        adm, now = self._admission, anyio.current_time()
        if adm.refuse(reason, now):
            adm.log_line(now)
        elif not adm.flush_armed and self._state is _OPEN:
            adm.flush_armed = True
            self._tg().start_soon(self._flush_refusals)

    async def _flush_refusals(self) -> None:
        adm = self._admission
        try:
            await anyio.sleep(max(0.0, adm.next_log - anyio.current_time()))
        finally:
            adm.flush_armed = False
        adm.log_line(anyio.current_time())


def _source(stream: anyio.abc.SocketStream) -> str:
    """The remote address (host only) a connection came from."""
    try:
        address = stream.extra(SocketAttribute.remote_address)
    except anyio.TypedAttributeLookupError:  # pragma: no cover - TCP streams have one
        return "?"
    return str(address[0]) if isinstance(address, tuple) else str(address)
