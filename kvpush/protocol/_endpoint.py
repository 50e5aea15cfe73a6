"""What producer and consumer endpoints share: the handshake, one timer heap,
the output queue and the counters."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ._config import Identity
from ._errors import IncompatiblePeerError, LocalProtocolError, TopologyError
from ._messages import ControlMessage, Heartbeat, Hello, HelloReject
from ._outputs import Output, PeerFailed, PeerReady, Send
from ._tables import PEER, PeerInput, PeerState
from ._topology import Topology, compute_topology
from ._types import FailureReason, Role

__all__ = ("Endpoint", "PeerView", "check_compatible")


def check_compatible(local: Hello, remote: Hello) -> Topology:
    """Decide whether two hellos may exchange KV; return the topology.

    The check is symmetric, so both sides reach the same verdict. Raises
    :class:`IncompatiblePeerError` naming the first field that differs.
    """
    if local.version != remote.version:
        raise IncompatiblePeerError(
            "version", f"protocol {local.version} here, {remote.version} there"
        )
    if local.role is remote.role:
        raise IncompatiblePeerError("role", f"both sides are {local.role.value}s")
    mine, theirs = dict(local.fingerprint), dict(remote.fingerprint)
    for key in sorted(mine.keys() | theirs.keys()):
        if mine.get(key) != theirs.get(key):
            raise IncompatiblePeerError(
                key, f"{mine.get(key)!r} here, {theirs.get(key)!r} there"
            )
    for name in ("num_kv_heads", "mla", "kv_groups"):
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            raise IncompatiblePeerError(name, f"{a!r} here, {b!r} there")
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


#: A heap entry: (when, seq, kind, key). A plain tuple, so the heap compares in C;
#: ``seq`` is unique, so ``kind`` and ``key`` are never compared.
_TimerEntry = tuple[float, int, str, Hashable]


class Endpoint:
    """Base of :class:`Producer` and :class:`Consumer`; not used on its own."""

    role: Role

    def __init__(self, identity: Identity, op_bound: float) -> None:
        self.identity = identity
        self._hello = identity.hello(self.role, op_bound)
        self._out: list[Output] = []
        self._counters: Counter[str] = Counter()
        self._peers: dict[str, PeerView] = {}
        self._heap: list[_TimerEntry] = []
        self._seq = 0

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
        view = self._peers.get(peer, PeerView())
        return PeerView(view.state, view.hello, view.topology, view.failure)

    # --- timers -----------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest time at which :meth:`handle_timer` has work, or ``None``."""
        heap = self._heap
        while heap:
            top = heap[0]
            if self._timer_valid(top):
                return top[0]
            heapq.heappop(heap)
        return None

    def handle_timer(self, now: float) -> None:
        """Fire every timer due at or before ``now``."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if self._timer_valid(entry):
                self._fire(now, entry[2], entry[3])

    def _arm(self, timers: dict[str, float], kind: str, when: float, key: Hashable) -> None:
        timers[kind] = when
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, kind, key))

    def _timer_valid(self, entry: _TimerEntry) -> bool:
        when, _, kind, key = entry
        timers = self._timers_of(key)
        return timers is not None and timers.get(kind) == when

    def _timers_of(self, key: Hashable) -> dict[str, float] | None:
        raise NotImplementedError

    def _fire(self, now: float, kind: str, key: Hashable) -> None:
        raise NotImplementedError

    # --- handshake ----------------------------------------------------------

    def connect(self, now: float, peer: str) -> None:
        """Start (or restart) the handshake with ``peer``: queues our hello."""
        view = self._peers.setdefault(peer, PeerView())
        if self._peer_step(view, PeerInput.CONNECT) is not PeerState.READY:
            self._out.append(Send(peer, self._hello))

    def connection_up(self, now: float, peer: str) -> None:
        """A control connection to ``peer`` came up (the runtime saw it). If a
        loss ended our handshake with ``peer``, restart it now rather than at
        the next reservation: a peer that restarted learns who we are, and we
        learn its new instance before anything is registered with it."""
        view = self._peers.get(peer)
        if view is not None and view.state is PeerState.DISCONNECTED:
            self.connect(now, peer)

    def peer_lost(self, now: float, peer: str) -> None:
        """The control connection to ``peer`` is gone (the runtime decided)."""
        view = self._peers.get(peer)
        if view is None:
            self._counters["peer_lost_unknown"] += 1
            return
        self._peer_step(view, PeerInput.LOST)
        view.hello = None
        view.topology = None
        self._on_peer_down(now, peer, FailureReason.PEER_LOST, "connection lost")

    def receive(self, now: float, peer: str, message: ControlMessage) -> None:
        """Feed a control message that arrived from ``peer``."""
        if isinstance(message, Hello):
            self._on_hello(now, peer, message)
        elif isinstance(message, HelloReject):
            view = self._peers.setdefault(peer, PeerView())
            self._peer_step(view, PeerInput.REJECT)
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
            self._peer_step(view, PeerInput.LOST)
            view.hello = view.topology = None
            self._on_peer_down(now, peer, FailureReason.PEER_LOST, "peer restarted")
        elif view.state is PeerState.READY:
            self._counters["hello_duplicate"] += 1
            return
        try:
            topology = check_compatible(self._hello, hello)
        except IncompatiblePeerError as exc:
            self._peer_step(view, PeerInput.HELLO_BAD)
            self._out.append(Send(peer, HelloReject(exc.field, exc.detail)))
            self._peer_failed(now, peer, view, exc.field, exc.detail)
            return
        if self._peer_step(view, PeerInput.HELLO_OK) is not PeerState.HELLO_SENT:
            self._out.append(Send(peer, self._hello))
        view.hello, view.topology, view.failure = hello, topology, None
        self._out.append(PeerReady(peer, topology))
        self._on_peer_ready(now, peer)

    def _peer_step(self, view: PeerView, inp: PeerInput) -> PeerState:
        """Apply ``inp`` to ``view``; returns the *old* state."""
        old = view.state
        new = PEER.get((old, inp))
        if new is None:  # pragma: no cover - the peer table is total
            raise LocalProtocolError(f"peer input {inp.name} in state {old.name}")
        view.state = new
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

    def _on_unready_message(self, now: float, peer: str, message: ControlMessage) -> None:
        """A non-handshake message from a peer without a completed handshake."""
