"""The control channel's connection set-up: dialing a peer and accepting a
peer's dial, each opened by the preamble exchange of :mod:`._framing`.

A mixin of :class:`~kvpush.runtime.ControlChannel` (its module docs give the
rules: at most one connection per peer, the smaller name's dial wins a race,
a dial replaces a live connection only if it names it or comes from a new
instance). Kept apart so each module reads in one sitting; the attributes
and methods declared below belong to :class:`ControlChannel`.
"""

from __future__ import annotations

import logging
import random
import secrets
from typing import Final

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from kvpush.protocol import Codec, RemoteProtocolError

from ._channel_peer import _Conn, _Peer
from ._channel_types import Backoff, ChannelEvent
from ._framing import (
    MAX_HANDSHAKE_BYTES,
    Ack,
    Preamble,
    read_frame,
    seal,
    unseal,
    write_frame,
)

log = logging.getLogger("kvpush.runtime.channel")

#: Connections still in their preamble at once; more are closed unread.
_MAX_HANDSHAKES: Final = 64

_NET_ERRORS = (
    OSError,  # includes TimeoutError
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
)

_NEW, _OPEN, _CLOSED = "new", "open", "closed"


class _Links:
    """Dial and accept (see the module docs)."""

    # --- ControlChannel's state and helpers that set-up uses -------------------------

    _name: str
    _codec: Codec
    _instance: int
    _state: str
    _peers: dict[str, _Peer]
    _sockets: set[anyio.abc.SocketStream]
    _handshakes: int
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

    async def _on_accept(self, stream: anyio.abc.SocketStream) -> None:
        self._sockets.add(stream)
        if self._handshakes >= _MAX_HANDSHAKES:
            self._handshake_failures += 1
            log.warning("%s: too many connections in handshake; closing one", self._name)
            await self._close_now(stream)
            return
        self._handshakes += 1
        try:
            self._tune(stream)
            receiver = BufferedByteReceiveStream(stream)
            with anyio.fail_after(self._connect_timeout):
                frame = await read_frame(receiver, max_frame_bytes=MAX_HANDSHAKE_BYTES)
            hello = Preamble.decode(unseal(frame, self._codec))
        except (*_NET_ERRORS, RemoteProtocolError) as exc:
            self._handshake_failures += 1
            log.warning("%s: refused a connection before its preamble: %r", self._name, exc)
            await self._close_now(stream)
            return
        finally:
            self._handshakes -= 1
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
            self._handshake_failures += 1
            log.warning("%s: refused a connection that claims our own name", self._name)
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
