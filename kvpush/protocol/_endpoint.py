"""What producer and consumer endpoints share: the handshake, one timer heap,
the output queue and the counters."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ._config import Identity, Timing
from ._errors import IncompatiblePeerError, LocalProtocolError, TopologyError
from ._machine import Engine
from ._messages import Announce, ControlMessage, Extend, Heartbeat, Hello, HelloReject, Register
from ._outputs import Cancel, Output, PeerFailed, PeerReady, Send
from ._tables import PEER, PeerInput, PeerState, Timer
from ._topology import Topology, compute_topology
from ._types import FailureReason, Pair, Role

__all__ = ("Endpoint", "PeerView", "Timer", "check_compatible")


#: Hello fields that must be equal on both sides (after the fingerprint).
#: ``max_transit``: each side's runtime drops the frames *it sends* after its
#: own bound, and both quarantines add it, so neither side may assume a larger
#: bound than the other enforces; none can be adopted once the channel runs.
_EQUAL = ("num_kv_heads", "mla", "kv_groups", "max_transit")
#: Hello bounds (seconds) that must be finite and > 0 on both sides. The peer's
#: ``op_bound`` is not compared: each side puts the peer's into its quarantine.
_BOUNDS = ("op_bound", "max_transit")


def _side(hello: Hello) -> str:
    return f"the {hello.role.value} {hello.engine_id!r}"


def _differ(name: str, local: Hello, remote: Hello, mine: object, theirs: object) -> None:
    """Raise for a field that differs, each value named by its side's role
    and engine (producer first): the same text on both sides, so the peer
    that receives it in a ``HelloReject`` reports each value correctly."""
    sides = sorted(((local, mine), (remote, theirs)), key=lambda s: s[0].role is not Role.PRODUCER)
    text = ", ".join(f"{v!r} on {_side(h)}" for h, v in sides)
    raise IncompatiblePeerError(name, text)


def _check_bounds(local: Hello, remote: Hello) -> None:
    for name in _BOUNDS:
        for hello in (local, remote):
            v = getattr(hello, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not (ok and math.isfinite(v) and v > 0):
                raise IncompatiblePeerError(
                    name, f"{v!r} on {_side(hello)} is not a positive finite number of seconds"
                )


def check_compatible(local: Hello, remote: Hello) -> Topology:
    """Decide whether two hellos may exchange KV; return the topology.

    The check is symmetric, so both sides reach the same verdict. Raises
    :class:`IncompatiblePeerError` naming the first field that differs (or,
    for ``op_bound`` and ``max_transit``, that is not a usable bound).
    """
    if local.version != remote.version:
        _differ("version", local, remote, local.version, remote.version)
    if local.role is remote.role:
        raise IncompatiblePeerError("role", f"both sides are {local.role.value}s")
    _check_bounds(local, remote)
    mine, theirs = dict(local.fingerprint), dict(remote.fingerprint)
    for key in sorted(mine.keys() | theirs.keys()):
        if mine.get(key) != theirs.get(key):
            _differ(key, local, remote, mine.get(key), theirs.get(key))
    for name in _EQUAL:
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            _differ(name, local, remote, a, b)
    if not set(local.modes) & set(remote.modes):
        raise IncompatiblePeerError("modes", "no transfer mode in common")
    producer, consumer = (local, remote) if local.role is Role.PRODUCER else (remote, local)
    if consumer.pp != 1:
        raise IncompatiblePeerError("pp", f"consumer PP {consumer.pp} is not supported (use 1)")
    try:
        return compute_topology(
            producer.tp, producer.pp, consumer.tp, producer.num_kv_heads, mla=producer.mla
        )
    except TopologyError as exc:
        raise IncompatiblePeerError("topology", str(exc)) from None


@dataclass(slots=True)
class PeerView:
    """What an endpoint knows about one peer."""

    state: PeerState = PeerState.DISCONNECTED
    hello: Hello | None = None
    topology: Topology | None = None
    failure: tuple[str, str] | None = None
    #: Hellos sent since the handshake last (re)started: 1 + retries so far.
    attempts: int = 0


@dataclass(frozen=True, slots=True)
class _PeerKey:
    """The timer key of a peer's handshake (never equal to a record's key)."""

    peer: str


@dataclass(frozen=True, slots=True)
class _OpsKey:
    """The timer key of a record's in-flight ops (never equal to a record's key)."""

    key: Hashable


class Endpoint(Engine):
    """Base of :class:`Producer` and :class:`Consumer`; not used on its own."""

    role: Role

    def __init__(self, identity: Identity, timing: Timing) -> None:
        super().__init__()
        self.identity = identity
        self._timing = timing
        self._hello = identity.hello(self.role, timing.op_bound, timing.max_transit)
        self._out: list[Output] = []
        self._peers: dict[str, PeerView] = {}
        #: Per peer: its armed handshake timer (at most ``HELLO_RETRY``).
        self._peer_timers: dict[str, dict[Timer, float]] = {}
        #: Lease-bearing messages received up to this time are refused (a stall).
        self._stall_until = -math.inf
        #: Lease-bearing messages refused after a stall (also ``stats()``).
        self.stall_dropped = 0

    # --- outputs and statistics ---------------------------------------------

    def drain(self) -> list[Output]:
        """Return and forget every pending action and event, oldest first."""
        out, self._out = self._out, []
        return out

    def stats(self) -> Mapping[str, int]:
        """A frozen snapshot of the counters (ignored inputs by kind, ...)."""
        return MappingProxyType(dict(self._counters))

    def peer(self, peer: str) -> PeerView:
        """A copy of what this endpoint knows about ``peer``."""
        return dataclasses.replace(self._peers.get(peer, PeerView()))

    # --- timers: a record's own (the engine's), its ops' and the handshake's ----

    def _timers_of(self, key: Hashable) -> dict[Timer, float] | None:
        if type(key) is _PeerKey:
            return self._peer_timers.get(key.peer)
        if type(key) is _OpsKey:
            rec = self._record(key.key)
            return None if rec is None else rec.op_timer
        return super()._timers_of(key)

    def _fire(self, now: float, kind: Hashable, key: Hashable) -> None:
        if type(key) is _PeerKey:
            self._fire_peer(now, kind, key.peer)  # type: ignore[arg-type]
        elif type(key) is _OpsKey:
            rec = self._record(key.key)
            del rec.op_timer[Timer.OVERDUE]
            self._fire_overdue(now, rec)
        else:
            super()._fire(now, kind, key)

    def _arm_ops(self, rec: Any, ops: dict[Pair, float]) -> None:
        """Keep ``rec``'s ``OVERDUE`` armed at the earliest op of ``ops``
        (pair -> when it is overdue) whose cancel was not asked for yet."""
        when, timers = min(ops.values(), default=math.inf), rec.op_timer
        if when == math.inf:
            timers.clear()
        elif timers.get(Timer.OVERDUE) != when:
            self._arm(timers, Timer.OVERDUE, when, _OpsKey(self._key(rec)))

    def _cancel_overdue(
        self, now: float, rec: Any, ops: dict[Pair, float], epoch: int, peer: str, what: str
    ) -> None:
        """Ops of ``rec`` still in flight ``op_bound`` after they were handed
        over: ask the adapter to cancel each (``inf``: its cancel is out). Its
        report (a failure once the transport confirms, or a success) settles
        it as any other."""
        for pair in sorted(pair for pair, when in ops.items() if when <= now):
            ops[pair] = math.inf
            self._counters[f"{what}_cancel"] += 1
            self._out.append(Cancel(rec.transfer_id, epoch, peer, *pair))
        self._arm_ops(rec, ops)

    def _fire_overdue(self, now: float, rec: Any) -> None:
        raise NotImplementedError

    # --- process stalls -------------------------------------------------------

    def stalled(self, now: float, gap: float) -> None:
        """The runtime noticed that this process (or its event loop) did not
        run for ``gap`` seconds, up to ``now``. Feed it before the frames read
        after the gap.

        A lease crosses machines as a duration measured from *receipt*, and the
        safety argument needs receipt within ``max_transit`` of sending. A frame
        that reached the kernel during the gap is read late, and a lease
        measured from then would outlive the peer's quarantine. So every
        lease-bearing message received until ``now + timing.stall_guard`` is
        dropped (``dropped_after_stall``); a producer answers a dropped
        ``Register`` with ``Rejected(STALLED)``."""
        if not (math.isfinite(now) and math.isfinite(gap)) or gap <= 0:
            raise LocalProtocolError(f"stalled() needs a finite gap > 0, got {gap!r}")
        self._counters["stalls"] += 1
        self._stall_until = max(self._stall_until, now + self._timing.stall_guard)

    def _dropped_after_stall(
        self, now: float, peer: str, message: Register | Announce | Extend
    ) -> None:
        """Answer a lease-bearing message the stall rule dropped, where the
        role can say so without a lease (the producer: ``Rejected``)."""

    # --- handshake ----------------------------------------------------------

    def _send_hello(self, now: float, peer: str, view: PeerView, *, fresh: bool) -> None:
        """Queue our hello to ``peer`` and arm its retry, backing off as
        :class:`~kvpush.Timing` says (``fresh``: from the first delay)."""
        if fresh:
            view.attempts = 0
        view.attempts += 1
        self._out.append(Send(peer, self._hello))
        timers = self._peer_timers.setdefault(peer, {})
        timers.clear()
        timing = self._timing
        if view.attempts > timing.hello_retries:
            self._counters["hello_retries_exhausted"] += 1
            return
        delay = min(timing.hello_retry * 2.0 ** (view.attempts - 1), timing.hello_retry_max)
        self._arm(timers, Timer.HELLO_RETRY, now + delay, _PeerKey(peer))

    def _fire_peer(self, now: float, kind: Timer, peer: str) -> None:
        del self._peer_timers[peer][kind]
        view = self._peers[peer]
        if self._peer_step(peer, view, PeerInput.RETRY) is PeerState.HELLO_SENT:
            self._counters["hello_retry"] += 1
            self._send_hello(now, peer, view, fresh=False)

    def connect(self, now: float, peer: str) -> None:
        """Start (or restart) the handshake with ``peer``: queues our hello and
        arms its retry (see :class:`~kvpush.Timing`)."""
        view = self._peers.setdefault(peer, PeerView())
        if self._peer_step(peer, view, PeerInput.CONNECT) is not PeerState.READY:
            self._send_hello(now, peer, view, fresh=True)

    def connection_up(self, now: float, peer: str) -> None:
        """A control connection to ``peer`` came up. If a loss ended our
        handshake, restart it now rather than at the next reservation, so both
        sides know each other's instance before anything is registered. If our
        hello is unanswered, send it again (it may have died in the old
        connection's queue), backoff restarted."""
        view = self._peers.get(peer)
        if view is None:
            return
        if view.state is PeerState.DISCONNECTED:
            self.connect(now, peer)
        elif view.state is PeerState.HELLO_SENT:
            self._counters["hello_resent_on_connect"] += 1
            self._send_hello(now, peer, view, fresh=True)

    def peer_gone(self, now: float, peer: str) -> int:
        """The caller knows that ``peer``'s process is gone (its pod deleted,
        its host fenced; a lost connection alone is no such proof): what was
        held for it alone ends now. Returns the number of transfers ended."""
        view = self._peers.get(peer)
        if view is not None and view.state is not PeerState.DISCONNECTED:
            self.peer_lost(now, peer)
        return self._gone(now, peer)

    def peer_lost(self, now: float, peer: str) -> None:
        """The control connection to ``peer`` is gone (the runtime decided)."""
        view = self._peers.get(peer)
        if view is None:
            self._counters["peer_lost_unknown"] += 1
        else:
            self._lost(now, peer, view, "connection lost")

    def _lost(self, now: float, peer: str, view: PeerView, detail: str) -> None:
        self._peer_step(peer, view, PeerInput.LOST)
        view.hello = view.topology = None
        self._on_peer_down(now, peer, FailureReason.PEER_LOST, detail)

    def receive(self, now: float, peer: str, message: ControlMessage) -> None:
        """Feed a control message that arrived from ``peer``."""
        if now <= self._stall_until and isinstance(message, (Register, Announce, Extend)):
            self._counters["dropped_after_stall"] += 1
            self.stall_dropped += 1
            self._dropped_after_stall(now, peer, message)
        elif isinstance(message, Hello):
            self._on_hello(now, peer, message)
        elif isinstance(message, HelloReject):
            view = self._peers.setdefault(peer, PeerView())
            if view.state is PeerState.FAILED and view.failure == (message.field, message.detail):
                self._counters["hello_reject_duplicate"] += 1
                return
            self._peer_step(peer, view, PeerInput.REJECT)
            self._peer_failed(now, peer, view, message.field, message.detail)
        elif isinstance(message, Heartbeat):
            self._counters["heartbeat"] += 1
        elif (known := self._peers.get(peer)) is None or known.state is not PeerState.READY:
            self._counters["message_from_unready_peer"] += 1
            self._on_unready_message(now, peer, message)
        else:
            self._on_message(now, peer, message)

    def _on_hello(self, now: float, peer: str, hello: Hello) -> None:
        view = self._peers.setdefault(peer, PeerView())
        if hello.engine_id != peer:
            self._counters["hello_wrong_engine_id"] += 1
            self._out.append(Send(peer, HelloReject("engine_id", "does not match the sender")))
            return
        if view.hello is not None and view.hello.instance != hello.instance:
            # The peer restarted: nothing of the old instance may be reused.
            self._counters["peer_restarted"] += 1
            self._lost(now, peer, view, "peer restarted")
        elif view.state is PeerState.READY:
            # The consumer starts the handshake and retries it; a retry means
            # our answer was lost, so the producer answers every hello. The
            # consumer answers none while ready, so no two sides ever bounce
            # hellos back and forth.
            self._counters["hello_duplicate"] += 1
            if self.role is Role.PRODUCER:
                self._out.append(Send(peer, self._hello))
            return
        try:
            topology = check_compatible(self._hello, hello)
        except IncompatiblePeerError as exc:
            self._peer_step(peer, view, PeerInput.HELLO_BAD)
            self._out.append(Send(peer, HelloReject(exc.field, exc.detail)))
            self._peer_failed(now, peer, view, exc.field, exc.detail)
            return
        if self._peer_step(peer, view, PeerInput.HELLO_OK) is not PeerState.HELLO_SENT:
            self._out.append(Send(peer, self._hello))
        view.hello, view.topology, view.failure = hello, topology, None
        self._out.append(PeerReady(peer, topology))
        self._on_peer_ready(now, peer)

    def _peer_step(self, peer: str, view: PeerView, inp: PeerInput) -> PeerState:
        """Apply ``inp`` to ``view`` (``PEER`` is total); returns the *old*
        state. Leaving ``HELLO_SENT`` cancels the hello's retry."""
        old = view.state
        view.state = PEER[old, inp]
        if old is PeerState.HELLO_SENT and view.state is not PeerState.HELLO_SENT:
            self._peer_timers.pop(peer, None)
        return old

    def _peer_failed(self, now: float, peer: str, view: PeerView, fld: str, detail: str) -> None:
        view.failure = (fld, detail)
        view.hello = view.topology = None
        self._out.append(PeerFailed(peer, fld, detail))
        self._on_peer_down(now, peer, FailureReason.HANDSHAKE_FAILED, f"{fld}: {detail}")

    # --- hooks for the roles --------------------------------------------------

    def _on_peer_ready(self, now: float, peer: str) -> None:
        raise NotImplementedError

    def _on_peer_down(self, now: float, peer: str, reason: FailureReason, detail: str) -> None:
        raise NotImplementedError

    def _on_message(self, now: float, peer: str, message: ControlMessage) -> None:
        raise NotImplementedError

    def _gone(self, now: float, peer: str) -> int:
        raise NotImplementedError

    def _on_unready_message(self, now: float, peer: str, message: ControlMessage) -> None:
        """A non-handshake message from a peer without a completed handshake."""
