"""The control channel's connection set-up: dialing a peer and accepting a
peer's dial, each opened by the preamble exchange of :mod:`._framing`.

:class:`Links` does both for :class:`~kvpush.runtime.ControlChannel`, which
owns it (its module docs give the rules: at most one connection per peer, the
smaller name's dial wins a race, a dial replaces a live connection only if it
names it or comes from a new instance). A connection that passes is installed
in the channel's :class:`~._channel_peer.Peers` and handed to the channel's
reader.

Admission. Before its preamble a connection is nobody's, and anyone who
reaches the port can open one, so what it may hold is bounded in count and
time (:class:`Admission`): at most ``max_handshakes`` connections wait for
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
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.abc import SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream

from kvpush.protocol import AuthenticationError, Codec, RemoteProtocolError

from ._channel_peer import NET_ERRORS, Conn, Hub, Peer, Peers
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

#: The interface the channel uses (the package exports none of it).
__all__ = ("REFUSALS", "Admission", "Links", "Slot")

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

    hub: Hub
    total: int
    per_source: int
    timeout: float
    log_interval: float
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
        if len(mine) >= self.per_source:
            self.evict(next(iter(mine)), "evicted_source")
        elif len(self.slots) >= self.total:
            most = max(len(v) for v in self.by_source.values())
            oldest = next(s for s in self.slots if len(self.by_source[s.source]) == most)
            self.evict(oldest, "evicted_full")
        slot = Slot(source, anyio.CancelScope(deadline=now + self.timeout))
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
        elif not self.flush_armed and self.hub.open:
            self.flush_armed = True
            self.hub.spawn(self._flush)

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
            self.hub.name,
            n,
            why,
            len(self.slots),
        )
        self.unlogged.clear()
        self.next_log = now + self.log_interval


@dataclass(eq=False, repr=False)
class Links:
    """Dial and accept (see the module docs)."""

    hub: Hub
    peers: Peers
    #: The channel's reader: emits the install's events, then reads until the end.
    read: Callable[[Peer, Conn, list[ChannelEvent]], Coroutine[Any, Any, None]]
    codec: Codec
    connect_timeout: float
    backoff: Backoff
    admission: Admission
    instance: int = field(default_factory=lambda: secrets.randbits(64))
    rng: random.Random = field(default_factory=lambda: random.Random(secrets.randbits(64)))

    # --- dialing -----------------------------------------------------------------------

    async def connect(self, p: Peer) -> None:
        """Dial until the peer is connected (by us or by its own dial)."""
        attempt = 0
        while p.active is None and p.route is not None and not p.forgotten:
            changed = p.conn_changed.waiter()
            if await self._dial(p, p.route):
                return
            # ``changed`` is already set if the peer's own dial won meanwhile.
            with anyio.move_on_after(self.backoff.delay(attempt, self.rng)):
                await changed.wait()
            attempt += 1

    async def _dial(self, p: Peer, route: tuple[str, int]) -> bool:
        hub = self.hub
        conn_id = secrets.randbits(64) | 1
        pre = Preamble(hub.name, self.instance, conn_id, p.last_conn_id)
        p.pending = conn_id
        stream: anyio.abc.SocketStream | None = None
        try:
            with anyio.fail_after(self.connect_timeout):
                stream = await anyio.connect_tcp(*route)
                hub.adopt(stream)
                receiver = BufferedByteReceiveStream(stream)
                await write_frame(stream, seal(pre.encode(), self.codec))
                frame = await read_frame(receiver, max_frame_bytes=MAX_HANDSHAKE_BYTES)
                ack = Ack.decode(unseal(frame, self.codec))
        except (*NET_ERRORS, RemoteProtocolError) as exc:
            p.connect_failures += 1
            log.debug("%s: dial %s at %s:%d failed: %r", hub.name, p.name, *route, exc)
            if stream is not None:
                await hub.close_now(stream)
            return False
        except BaseException:
            if stream is not None:
                with anyio.CancelScope(shield=True):
                    await hub.close_now(stream)
            raise
        finally:
            if p.pending == conn_id:
                p.pending = None
        if ack.name != p.name or ack.conn_id != conn_id:
            p.connect_failures += 1
            log.warning(
                "%s: %s:%d answered as %r (connection %#x), not %r",
                hub.name,
                *route,
                ack.name,
                ack.conn_id,
                p.name,
            )
            await hub.close_now(stream)
            return False
        if p.active is not None or p.forgotten or not hub.open:
            await hub.close_now(stream)  # the peer's own dial won meanwhile
            return False
        conn = Conn(stream, receiver, conn_id, ack.instance)
        hub.spawn(self.read, p, conn, self.peers.install(p, conn))
        return True

    # --- accepting --------------------------------------------------------------------

    async def accept_loop(self, listener: anyio.abc.SocketListener) -> None:
        while True:
            try:
                stream = await listener.accept()
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:  # out of descriptors and the like: keep serving
                log.warning("%s: accept failed: %r", self.hub.name, exc)
                await anyio.sleep(0.1)
                continue
            if not self.hub.open:
                await self.hub.close_now(stream)
                return
            self.hub.spawn(self.accept, stream)
            # Let the connections accepted so far read their preamble before
            # the next accept can evict them (a backlog drains one per turn).
            await anyio.lowlevel.checkpoint()

    async def accept(self, stream: anyio.abc.SocketStream) -> None:
        """One accepted connection, from its preamble to its end."""
        hub, adm = self.hub, self.admission
        hub.adopt(stream)
        slot = adm.enter(_source(stream), anyio.current_time())
        frame: bytes | None = None
        hello: Preamble | None = None
        reason = ""
        try:
            receiver = BufferedByteReceiveStream(stream)
            with slot.scope:
                frame = await read_frame(receiver, max_frame_bytes=MAX_HANDSHAKE_BYTES)
            if frame is None:
                reason = slot.evicted or "timeout"
            else:
                hello = Preamble.decode(unseal(frame, self.codec))
        except AuthenticationError:
            reason = "unauthenticated"
        except (FramingError, RemoteProtocolError):
            reason = "malformed"
        except NET_ERRORS:
            reason = "closed"
        finally:
            adm.leave(slot)
        if hello is None:
            adm.refuse(reason)
            await hub.close_now(stream)
            return
        admitted = self._admit(hello, stream, receiver)
        if admitted is None:
            await hub.close_now(stream)
            return
        p, conn, events = admitted
        try:
            with anyio.fail_after(self.connect_timeout):
                ack = Ack(hub.name, self.instance, hello.conn_id).encode()
                await write_frame(stream, seal(ack, self.codec))
        except NET_ERRORS as exc:
            self.peers.drop(p, conn, f"ack failed: {exc!r}")
        finally:
            conn.lock.release()
        await self.read(p, conn, events)

    def _admit(
        self,
        hello: Preamble,
        stream: anyio.abc.SocketStream,
        receiver: BufferedByteReceiveStream,
    ) -> tuple[Peer, Conn, list[ChannelEvent]] | None:
        """Decide on a dialed connection; if accepted, install it (write lock held)."""
        name, me = hello.name, self.hub.name
        if not self.hub.open:
            return None
        if name == me:
            self.admission.refuse("own_name")
            return None
        p = self.peers.by_name.get(name)
        if p is not None:
            a = p.active
            if a is not None:
                if a.instance == hello.instance and hello.supersedes != a.conn_id:
                    log.debug("%s: refused a duplicate connection from %s", me, name)
                    return None
            elif p.pending is not None and me < name:
                log.debug("%s: refused %s's dial (ours wins)", me, name)
                return None
        else:
            p = self.peers.add(name, None)
        conn = Conn(stream, receiver, hello.conn_id, hello.instance)
        conn.lock.acquire_nowait()  # the ack goes first
        return p, conn, self.peers.install(p, conn)


def _source(stream: anyio.abc.SocketStream) -> str:
    """The remote address (host only) a connection came from."""
    try:
        address = stream.extra(SocketAttribute.remote_address)
    except anyio.TypedAttributeLookupError:  # pragma: no cover - TCP streams have one
        return "?"
    return str(address[0]) if isinstance(address, tuple) else str(address)
