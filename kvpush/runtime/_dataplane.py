"""The background data-plane thread: plan, post and poll writes and reads.

The runtime hands the core's :class:`StartWrite` / :class:`StartRead` to a
:class:`DataPlane`, whose own thread plans each (:class:`TransferPlanner`,
cached per route), posts it on the right rank's :class:`Transport`, polls
every transport and hands the results back through ``on_results``: the
caller's thread pays one queue put. ``not_after`` and every stamp
(:class:`~kvpush.protocol.OpStamps`) are on ``time.monotonic()``, the clock
anyio's loop runs on. Why it polls as it does, and the rules for notices'
senders and for fences: docs/runtime.md ("Where a handoff's time goes",
"Notices are bound to their sender", "The GPU ordering rule").
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvpush.protocol import (
    Cancel,
    Codec,
    Completion,
    HeadSlice,
    KVLayout,
    KvpushError,
    OpStamps,
    Role,
    Route,
    Source,
    StartRead,
    StartWrite,
)

from ._plan import TransferPlan, TransferPlanner
from ._stage import Copier, CostModel
from ._stager import Stager
from ._transport import Completed, PreppedTransport, Transport

__all__ = ("DataPlane", "Fence", "NoticeIn", "OpResult", "PeerRanks", "Rank")

log = logging.getLogger("kvpush.dataplane")

_STOP = "stop"

#: The naps while an op is posted, and for ``busy_for`` after any command or
#: result (:meth:`DataPlane._nap`).
INFLIGHT_POLL_INTERVAL = 0.00002
BUSY_POLL_INTERVAL = 0.00005


class Fence(Protocol):
    """Work an action's source depends on (``torch.cuda.Event`` is one)."""

    def query(self) -> bool:
        """True once the work has finished; never blocks."""
        ...


@dataclass(frozen=True, slots=True)
class Rank:
    """One local rank: its transport and where its KV lives."""

    transport: Transport
    layout: KVLayout


@dataclass(frozen=True, slots=True)
class PeerRanks:
    """A peer instance's ranks: transport metadata and layout per rank index
    (producer: ``pp * tp_size + tp``; consumer: its TP rank)."""

    peer: str
    ranks: Mapping[int, tuple[bytes, KVLayout]]
    tp: int


@dataclass(frozen=True, slots=True)
class OpResult:
    """A StartWrite or StartRead settled (``error`` is None on success).
    ``stamps``: when it was planned, posted and seen settled (``None`` if it
    was never posted)."""

    action: StartWrite | StartRead
    error: str | None
    stamps: OpStamps | None = None


@dataclass(frozen=True, slots=True)
class NoticeIn:
    """A completion notice that arrived at one of our ranks from a rank of
    ``peer`` (the peer whose handshake introduced the sending agent; ``None``
    if none did), polled at ``seen`` (``time.monotonic()``)."""

    notice: Completion
    peer: str | None
    seen: float | None = None


Result = OpResult | NoticeIn


class DataPlane:
    """Owns the local ranks' transports and the thread that drives them.

    Its public methods may be called from any thread; the rest run on its
    thread. The poll intervals: :meth:`_nap` (each is capped by the one
    after it). ``polls`` counts the passes that polled."""

    def __init__(
        self,
        role: Role,
        ranks: Mapping[int, Rank],
        tp: int,
        codec: Codec,
        *,
        poll_interval: float = 0.0002,
        busy_for: float = 0.05,
        expecting: bool = True,
        copier: Copier | None = None,
        costs: CostModel | None = None,
    ) -> None:
        for name, value in (("poll_interval", poll_interval), ("busy_for", busy_for)):
            if not 0 <= value < math.inf:
                raise KvpushError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        self.role = role
        self.ranks = dict(ranks)
        self.tp = tp
        self.codec = codec
        self._on_results: Callable[[list[Result]], None] = _unbound
        self._poll_interval = poll_interval
        self._busy_poll_interval = min(BUSY_POLL_INTERVAL, poll_interval)
        self._inflight_poll_interval = min(INFLIGHT_POLL_INTERVAL, self._busy_poll_interval)
        self._busy_for = busy_for
        self._busy_until = 0.0  # poll at the busy interval until then (monotonic)
        #: Transfers to or from a peer may be under way (:meth:`expect`).
        self._expecting = expecting
        self._expect_sent = expecting
        self.polls = 0
        #: The thread's OS id (``threading.get_native_id``), once it runs.
        self.native_id: int | None = None
        #: Commands: an action and its fence, a Cancel, a PeerRanks, a bool
        #: (:meth:`expect`) or ``_STOP``.
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        #: Actions waiting for their fence, in submission order.
        self._fenced: deque[tuple[StartWrite | StartRead, Fence]] = deque()
        self._peers: dict[str, PeerRanks] = {}
        self._agents: dict[tuple[str, int], str] = {}
        #: Transport agent -> the peer whose handshake introduced it.
        self._senders: dict[str, str] = {}
        self._planners: dict[tuple[str, Route], TransferPlanner] = {}
        self._prepped: set[tuple[str, Route]] = set()
        self._preppers: dict[int, PreppedTransport] = {
            i: r.transport
            for i, r in self.ranks.items()
            if isinstance(r.transport, PreppedTransport)
        }
        self.posted_prepped = 0
        #: (rank index, handle) -> (action, plan started, planned, posted).
        self._posted: dict[tuple[int, int], tuple[StartWrite | StartRead, float, float, float]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.posted = 0
        self.bytes_posted = 0
        self.failed_posts = 0
        #: Cancels asked of transports (the core's ``Cancel``), and those a
        #: transport could not confirm.
        self.cancels = 0
        self.cancels_unconfirmed = 0
        #: Staged transfers (docs/layouts.md): on for the ranks whose layout
        #: has a staging pool, given a copier for their memory.
        self.stager = Stager(copier, {i: r.layout for i, r in self.ranks.items()}, costs)
        #: (rank index, handle) -> the staging slot a posted write borrowed,
        #: and the bytes it staged.
        self._borrowed: dict[tuple[int, int], tuple[tuple[int, int, int], int]] = {}
        # Registered now: a rank's metadata (for the handshake) may list it.
        for rank in self.ranks.values():
            rank.transport.register(rank.layout)

    def start(self) -> None:
        if self._thread is not None:
            raise KvpushError("data plane already started")
        self._thread = threading.Thread(target=self._run, name="kvpush-dataplane", daemon=True)
        self._thread.start()

    def bind(self, on_results: Callable[[list[Result]], None]) -> None:
        """Where results go (called from the data-plane thread); before start()."""
        self._on_results = on_results

    def submit(self, action: StartWrite | StartRead, after: Fence | None = None) -> None:
        """Queue an action, to be posted once ``after`` is done; O(1), never blocks."""
        self._inbox.put((action, after))

    def cancel(self, cancel: Cancel) -> None:
        """Queue the core's ``Cancel`` of an op past ``op_bound``; O(1). It is
        reported failed only once nothing of it can move: a transport that
        cannot confirm leaves it posted (a guess would break I1)."""
        self._inbox.put(cancel)

    def add_peer(self, peer: PeerRanks) -> None:
        """Queue a peer's rank metadata (a new instance replaces the old)."""
        self._inbox.put(peer)

    def expect(self, expecting: bool) -> None:
        """Whether a peer may be moving bytes to or from our ranks now (a
        registration or a held source is open): then the thread polls every
        ``poll_interval`` even with nothing of its own posted (a NIXL target
        that does not poll stalls the peer); repeats cost nothing."""
        if expecting != self._expect_sent:
            self._expect_sent = expecting
            self._inbox.put(expecting)

    def stage_need(self, blocks: list[list[int]]) -> int:
        """Consumer: the ``stage_bytes`` a push reservation of ``blocks`` asks for."""
        return self.stager.need(blocks)

    def stage(
        self, transfer_id: str, epoch: int, blocks: list[list[int]], slot: tuple[int, ...]
    ) -> None:
        """Consumer: record a reservation's ``blocks`` and staging ``slot``
        before its registration can reach the producer; any thread."""
        self.stager.stage((transfer_id, epoch), blocks, slot)

    def unstage(self, transfer_id: str, epoch: int) -> None:
        """Consumer: drop the record before the reservation's ``Ready`` or
        ``Released`` reaches anyone; returns once no scatter into its blocks
        runs or ever will. Any thread."""
        self.stager.unstage((transfer_id, epoch))

    def metadata(self) -> dict[int, bytes]:
        """Our ranks' transport metadata, for the handshake."""
        return {i: r.transport.metadata() for i, r in self.ranks.items()}

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread; posted transfers are reported failed."""
        self._stop.set()
        self._inbox.put(_STOP)  # wakes a thread that sleeps on the inbox
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise KvpushError("data-plane thread did not stop in time")
        actions = [a[0] for a in self._posted.values()] + [a for a, _ in self._fenced]
        self._posted.clear()
        self._fenced.clear()
        for slot, _ in self._borrowed.values():
            self.stager.settled(slot)
        self._borrowed.clear()
        while not self._inbox.empty():
            item = self._inbox.get_nowait()
            if isinstance(item, tuple):
                actions.append(item[0])
        leftover: list[Result] = [OpResult(a, "data plane stopped") for a in actions]
        if leftover:
            self._on_results(leftover)

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        command: object = None
        try:
            self.stager.calibrate()
            while not self._stop.is_set():
                results = self._take_commands(command)
                command = None  # run: not to be handed back by the finally below
                if self._stop.is_set():
                    if results:
                        self._on_results(results)
                    break
                if self._fenced:
                    self._release(results)
                busy = bool(results)
                busy = self._poll(results) or busy
                command = self._wait(results, busy)
        except BaseException as exc:  # surfaced by the runtime, never swallowed
            log.exception("data-plane thread failed")
            self.error = exc
        finally:
            if command is not None:  # taken but not run: stop() reports it
                self._inbox.put(command)

    def _poll(self, results: list[Result]) -> bool:
        """Poll every rank once; whether anything settled or arrived."""
        self.polls += 1
        moved = False
        for index, rank in self.ranks.items():
            completed, notices = rank.transport.poll()
            if not (completed or notices):
                continue
            moved = True
            now = time.monotonic()
            self._busy_until = now + self._busy_for
            for c in completed:
                self._settled(index, c, now, results)
            for n in notices:
                notice = self.codec.decode_notice(n.payload)
                self._arrived(NoticeIn(notice, self._senders.get(n.peer), now), results)
        if self.stager.parked:
            for until, item in self.stager.unpark():
                assert isinstance(item, NoticeIn)
                self._arrived(item, results, until)
        return moved

    def _settled(self, index: int, c: Completed, now: float, results: list[Result]) -> None:
        borrowed = self._borrowed.pop((index, c.handle), None)
        if borrowed is not None:
            self.stager.settled(borrowed[0])
        posted = self._posted.pop((index, c.handle), None)
        if posted is not None:
            action, started, planned, sent = posted
            staged = borrowed[1] if borrowed is not None else 0
            stamps = OpStamps(started, planned, sent, max(now, sent), staged)
            results.append(OpResult(action, c.error, stamps))

    def _wait(self, results: list[Result], busy: bool) -> object:
        """Hand the results over, then wait for a command as :meth:`_nap` says."""
        if results:
            self._on_results(results)
            # The loop just woken needs the GIL: block briefly (a command
            # still wakes us at once) rather than poll again at once and keep
            # it waiting for a whole round.
            nap: float | None = self._inflight_poll_interval
        else:
            nap = 0.0 if busy else self._nap()
        if nap is None:
            return self._inbox.get()  # nothing to poll for: sleep
        if nap > 0:
            with contextlib.suppress(queue.Empty):
                return self._inbox.get(timeout=nap)
        return None

    def _arrived(self, item: NoticeIn, results: list[Result], until: float | None = None) -> None:
        """A notice polled: a staged one is scattered first (or waits for its
        reservation's record, until ``until``); then it goes to the core."""
        notice = item.notice
        if notice.staged:
            error = self._scatter(item)
            if error == "park":
                self.stager.park(item, until)
                return
            if error is not None:
                self.stager.dropped_notices += 1
                log.error("staged notice of %s dropped: %s", notice.transfer_id, error)
                return
        results.append(item)

    def _scatter(self, item: NoticeIn) -> str | None:
        notice, peer = item.notice, item.peer
        rank = self.ranks.get(notice.consumer_rank)
        if self.role is not Role.CONSUMER or not self.stager.enabled or rank is None:
            return "this rank offered no staging slot"
        if peer is None or peer not in self._peers:
            return "from an unknown peer"
        local, remote = self._indices(peer, notice.source, notice.consumer_rank)
        theirs = self._peers[peer].ranks.get(remote)
        if theirs is None:
            return f"from unknown rank {notice.source}"
        mine, other = rank.layout.regions[0], theirs[1].regions[0]
        lo = max(mine.head_start, other.head_start)
        hi = min(mine.head_start + mine.num_heads, other.head_start + other.num_heads)
        if hi <= lo:
            return f"{notice.source} holds none of this rank's heads"
        route = Route(notice.source, notice.consumer_rank, HeadSlice(lo, hi - lo))
        try:
            planner = self._planner(peer, route, local, remote)
        except KvpushError as exc:
            return str(exc)
        return self.stager.scatter(notice, local, planner)

    def _nap(self) -> float | None:
        """How long to wait for a command before polling again when the last
        poll brought nothing (None: until the next command); why each
        interval: docs/runtime.md, "Where a handoff's time goes"."""
        if self._posted or self._fenced:
            return self._inflight_poll_interval
        if time.monotonic() < self._busy_until or self.stager.parked:
            return self._busy_poll_interval
        if self._expecting:
            return self._poll_interval
        return None

    def _take_commands(self, command: object) -> list[Result]:
        results: list[Result] = []
        while True:
            if command is None:
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    return results
            if command is _STOP:
                return results
            if isinstance(command, bool):
                self._expecting = command
                command = None
                continue
            self._busy_until = time.monotonic() + self._busy_for
            if isinstance(command, PeerRanks):
                self._add_peer(command)
            elif isinstance(command, Cancel):
                self._cancel(command, results)
            elif isinstance(command, tuple):
                action, fence = command
                if fence is None:
                    self._post_or_fail(action, results)
                else:
                    self._fenced.append((action, fence))
            command = None

    def _release(self, results: list[Result]) -> None:
        """Post the fenced actions whose fence is done, in order; fail those
        whose lease ran out while they waited."""
        while self._fenced:
            action, fence = self._fenced[0]
            if fence.query():
                self._fenced.popleft()
                self._post_or_fail(action, results)
            elif time.monotonic() > action.not_after:
                self._fenced.popleft()
                self.failed_posts += 1
                why = "not posted: its lease ran out waiting for the forward that computes its KV"
                results.append(OpResult(action, why))
            else:
                return

    def _cancel(self, cancel: Cancel, results: list[Result]) -> None:
        """One op past its bound: drop it if it waits for its fence, else ask
        its transport to cancel it (the result comes from the next poll)."""

        def match(a: StartWrite | StartRead) -> bool:
            return (
                (a.transfer_id, a.epoch) == (cancel.transfer_id, cancel.epoch)
                and a.route.source == cancel.source
                and a.route.consumer_rank == cancel.consumer_rank
            )

        for entry in self._fenced:
            if match(entry[0]):
                self._fenced.remove(entry)
                results.append(OpResult(entry[0], "cancelled before it was posted"))
                return
        for (index, handle), posted in self._posted.items():
            if not match(posted[0]):
                continue
            self.cancels += 1
            stop = getattr(self.ranks[index].transport, "cancel", None)
            if stop is None or not stop(handle):
                self.cancels_unconfirmed += 1
                log.error(
                    "op %s epoch %d to %s is past its bound and its transport cannot "
                    "confirm a cancel: it stays posted (the transfer holds its blocks)",
                    cancel.transfer_id,
                    cancel.epoch,
                    cancel.peer,
                )
            return

    def _post_or_fail(self, action: StartWrite | StartRead, results: list[Result]) -> None:
        error = self._post(action)
        if error is not None:
            self.failed_posts += 1
            results.append(OpResult(action, error))

    def _add_peer(self, peer: PeerRanks) -> None:
        self._peers[peer.peer] = peer
        self._planners = {k: v for k, v in self._planners.items() if k[0] != peer.peer}
        self._prepped = {k for k in self._prepped if k[0] != peer.peer}
        try:
            for index, (meta, layout) in peer.ranks.items():
                for rank in self.ranks.values():
                    agent = rank.transport.add_peer(meta, layout)
                owner = self._senders.get(agent)
                if owner is not None and owner != peer.peer:
                    raise KvpushError(f"its agent {agent!r} belongs to peer {owner!r}")
                self._agents[(peer.peer, index)] = agent
        except KvpushError as exc:  # its transport metadata: the peer is unusable
            log.error("cannot add peer %s: %s", peer.peer, exc)
            del self._peers[peer.peer]
            return
        for agent in [a for a, owner in self._senders.items() if owner == peer.peer]:
            del self._senders[agent]
        for (name, _), agent in self._agents.items():
            if name == peer.peer:
                self._senders[agent] = name

    def _post(self, action: StartWrite | StartRead) -> str | None:
        """Post one action; return an error text instead of raising."""
        started = time.monotonic()
        if started > action.not_after:
            return "not posted: its lease ran out"
        route = action.route
        local_index, remote_index = self._indices(action.peer, route.source, route.consumer_rank)
        peer = self._peers.get(action.peer)
        if local_index not in self.ranks or peer is None or remote_index not in peer.ranks:
            return f"no rank to serve {route}"
        try:
            planner = self._planner(action.peer, route, local_index, remote_index)
            agent = self._agents[(action.peer, remote_index)]
            # An increment but the last of a progressive source: only what was
            # computed since the one before, and no notice (b"": none).
            write = isinstance(action, StartWrite)
            first, note = (
                (action.first, action.notice) if isinstance(action, StartWrite) else ((), None)
            )
            plan = planner.plan(
                action.src_blocks,
                action.dst_blocks,
                skip_tokens=action.skip_tokens,
                first=first,
                partial=write and note is None,
            )
            planned = time.monotonic()
            remote = peer.ranks[remote_index][1]
            handle = self._send(action, local_index, agent, planner, plan, remote)
        except KvpushError as exc:
            return f"not posted: {exc}"
        self._posted[(local_index, handle)] = (action, started, planned, time.monotonic())
        self.posted += 1
        self.bytes_posted += int(plan.src[:, 1].sum())
        return None

    def _send(
        self,
        action: StartWrite | StartRead,
        index: int,
        agent: str,
        planner: TransferPlanner,
        plan: TransferPlan,
        remote: KVLayout,
    ) -> int:
        """Post a planned action on rank ``index``: staged, by index into the
        route's prepped lists, or as descriptor rows; its handle."""
        transport = self.ranks[index].transport
        notice = b""
        if isinstance(action, StartWrite):
            staged, note = self.stager.write(action, index, planner, plan, remote)
            notice = b"" if note is None else self.codec.encode_notice(note)
            if staged is not None:
                try:
                    handle = transport.write(agent, staged.src, staged.dst, notice)
                except KvpushError:
                    self.stager.settled(staged.slot)
                    raise
                self._borrowed[(index, handle)] = (staged.slot, staged.nbytes)
                return handle
        prepper = self._preppers.get(index)
        if prepper is not None and prepper.prefers_prepped(plan.num_descriptors, plan.num_pieces):
            return self._send_prepped(prepper, agent, action, planner, plan, notice)
        if isinstance(action, StartWrite):
            return transport.write(agent, plan.src, plan.dst, notice)
        return transport.read(agent, plan.dst, plan.src)

    def _send_prepped(
        self,
        transport: PreppedTransport,
        agent: str,
        action: StartWrite | StartRead,
        planner: TransferPlanner,
        plan: TransferPlan,
        notice: bytes,
    ) -> int:
        """Post by index, the route's lists prepared the first time it is used."""
        route = action.route
        if (action.peer, route) not in self._prepped:
            other = Role.CONSUMER if self.role is Role.PRODUCER else Role.PRODUCER
            transport.prep(agent, route, planner.prepped(self.role), planner.prepped(other))
            self._prepped.add((action.peer, route))
        src, dst = plan.indices()
        if isinstance(action, StartWrite):
            handle = transport.write_prepped(agent, route, src, dst, notice)
        else:
            handle = transport.read_prepped(agent, route, dst, src)
        self.posted_prepped += 1
        return handle

    def _indices(self, peer: str, source: Source, consumer_rank: int) -> tuple[int, int]:
        """(local rank index, remote rank index) of a route."""
        if self.role is Role.PRODUCER:
            return source.pp * self.tp + source.tp, consumer_rank
        tp = self._peers[peer].tp if peer in self._peers else 1
        return consumer_rank, source.pp * tp + source.tp

    def _planner(self, peer: str, route: Route, local: int, remote: int) -> TransferPlanner:
        key = (peer, route)
        planner = self._planners.get(key)
        if planner is None:
            mine = self.ranks[local].layout
            theirs = self._peers[peer].ranks[remote][1]
            producer, consumer = (mine, theirs) if self.role is Role.PRODUCER else (theirs, mine)
            planner = TransferPlanner(producer, consumer, route)
            self._planners[key] = planner
        return planner


def _unbound(results: list[Result]) -> None:
    raise KvpushError("DataPlane.bind() was not called")
