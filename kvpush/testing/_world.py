"""A producer and a consumer wired through a fake network and a model transport.

:class:`World` is the harness behind the stateful property test and the
exhaustive explorer, and it is public so that a serving framework can drive its
own integration the same way. Every method is one *move*: it feeds one input,
then routes everything the endpoints emit (messages into the network, writes
and reads into the model transport, events into the invariant checker).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.protocol import (
    Cancel,
    Completion,
    Consumer,
    ConsumerConfig,
    CState,
    Failed,
    FailureReason,
    Identity,
    Mode,
    Output,
    PeerState,
    Producer,
    ProducerConfig,
    Ready,
    Released,
    ReleaseOutcome,
    Reserved,
    Send,
    SourceReleased,
    StartRead,
    StartWrite,
    Timing,
    compute_topology,
)

from ._fakes import FakeClock, FakeNetwork
from ._invariants import InvariantChecker

__all__ = ("Op", "World", "WorldConfig")

P, D = "prefill", "decode"


@dataclass(frozen=True, slots=True)
class WorldConfig:
    """Shape of a world: parallelism, timing bounds and pool sizes."""

    producer_tp: int = 1
    consumer_tp: int = 1
    producer_pp: int = 1
    num_kv_heads: int = 8
    mla: bool = False
    max_transit: float = 1.0
    op_bound: float = 2.0
    ready_timeout: float = 10.0
    kv_hold_timeout: float = 10.0
    tombstone_ttl: float = 5.0
    blocks_per_transfer: int = 2
    pool_blocks: int = 64
    max_reserved_blocks: int | None = None
    #: Shake hands over a reliable path when the world is built; ``False``: the
    #: first reservation starts the handshake over the faulty network.
    handshake: bool = True
    #: Pages of the consumer's staging pool (one per block a push reservation
    #: holds; 0: none, every write in place). Fewer than the blocks of the
    #: transfers in play makes slots change hands between epochs.
    staging_pages: int = 0


@dataclass(slots=True)
class Op:
    """A write (push) or read (pull) in the model transport."""

    action: StartWrite | StartRead
    posted_at: float | None = None
    #: Landed but the initiator has not yet been told (writes only).
    landed: bool = False
    #: Its initiator stalled while it was posted: over a software transport
    #: it progresses only when the initiator runs, so it may land at any
    #: later time, past every bound.
    unbounded: bool = False
    #: Posted by a producer process that died since: no stall of a later
    #: process resumes it (it lands within its bound, or never; the bound of
    #: one its stall had unbounded counts from the death, as ``posted_at``).
    orphan: bool = False
    #: It never reports: it neither lands nor fails, until its initiator
    #: cancels it (a stuck NIXL request; the cancel, or the agent's teardown,
    #: is the only thing that ends it).
    hung: bool = False
    #: Its initiator asked for its cancel (``Cancel``): the transport may
    #: still finish it first, or confirm the cancel (``World.cancel``).
    cancel: bool = False


@dataclass
class World:
    """One producer instance and one consumer instance, handshaken."""

    config: WorldConfig = field(default_factory=WorldConfig)

    def __post_init__(self) -> None:
        cfg = self.config
        timing = Timing(cfg.max_transit, cfg.op_bound)
        heads = cfg.num_kv_heads
        self.clock = FakeClock()
        self.net: FakeNetwork[object] = FakeNetwork(cfg.max_transit)
        self.producer = self._new_producer(1)
        self.consumer = Consumer(
            ConsumerConfig(
                Identity(D, 2, tp=cfg.consumer_tp, num_kv_heads=heads, mla=cfg.mla),
                timing,
                ready_timeout=cfg.ready_timeout,
                max_reserved_blocks=cfg.max_reserved_blocks,
                staging_bytes=cfg.staging_pages,
                staging_page=1,
            )
        )
        self.producer_alive = True
        self.free_dst = list(range(cfg.pool_blocks))
        self.free_src = list(range(cfg.pool_blocks))
        self.ops: list[Op] = []
        self.notices: list[Completion] = []
        self.live: dict[str, int] = {}  # transfer -> live epoch
        self.kv: dict[str, tuple[int, ...]] = {}  # transfer -> source blocks
        #: transfer -> the source blocks of its increment (before its last).
        self.parts: dict[str, tuple[int, ...]] = {}
        self.ready: set[str] = set()
        self.failed: set[tuple[str, int]] = set()
        self.failure_reasons: dict[tuple[str, int], FailureReason] = {}
        self.source_outcomes: dict[str, ReleaseOutcome] = {}
        #: Transfers that lost a lease-bearing frame to the stall rule.
        self.stall_losses: set[str] = set()
        #: (transfer, epoch) of ops that hung (reported only once cancelled).
        self.hung: set[tuple[str, int]] = set()
        #: Suspect reservations after the last pump (see :meth:`pump`).
        self.suspect: frozenset[tuple[str, int]] = frozenset()
        self.events: list[Output] = []
        topology = compute_topology(
            cfg.producer_tp, cfg.producer_pp, cfg.consumer_tp, heads, mla=cfg.mla
        )
        self.checker = InvariantChecker(topology, cfg.max_transit, cfg.op_bound)
        if cfg.handshake:
            # Handshake over a reliable path; faults start afterwards.
            self.consumer.connect(0.0, P)
            self._settle_handshake()
            if self.consumer.peer(P).topology != topology:
                raise AssertionError("handshake failed or disagrees with the model's topology")

    def _new_producer(self, instance: int) -> Producer:
        cfg = self.config
        return Producer(
            ProducerConfig(
                Identity(
                    P,
                    instance,
                    tp=cfg.producer_tp,
                    pp=cfg.producer_pp,
                    num_kv_heads=cfg.num_kv_heads,
                    mla=cfg.mla,
                ),
                Timing(cfg.max_transit, cfg.op_bound),
                kv_hold_timeout=cfg.kv_hold_timeout,
                tombstone_ttl=cfg.tombstone_ttl,
            )
        )

    def _settle_handshake(self) -> None:
        for _ in range(4):
            self.pump()
            while self.net.queue:
                self.deliver(0)

    # --- local inputs -------------------------------------------------------------

    def reserve(self, tid: str, mode: Mode = Mode.PUSH) -> bool:
        """Reserve blocks for ``tid`` (a fresh epoch); False if not possible."""
        n = self.config.blocks_per_transfer
        if tid in self.live or tid in self.ready or len(self.free_dst) < n:
            return False
        blocks, self.free_dst = self.free_dst[:n], self.free_dst[n:]
        now = self.clock.now
        stage = n if self.config.staging_pages else 0
        result = self.consumer.reserve(now, tid, P, [blocks], mode=mode, stage_bytes=stage)
        if not isinstance(result, Reserved):
            self.free_dst = blocks + self.free_dst
            return False
        self.live[tid] = result.epoch
        deadline = now + self.config.ready_timeout
        slot = frozenset(range(result.stage[0], sum(result.stage))) if result.stage else frozenset()
        self.checker.reserved(now, tid, result.epoch, frozenset(blocks), deadline, slot)
        self.pump()
        return True

    def preempt(self, tid: str) -> bool:
        epoch = self.live.pop(tid, None)
        if epoch is None:
            return False
        self.checker.withdrawn_locally(tid, epoch)
        self.consumer.preempt(self.clock.now, tid)
        self.pump()
        return True

    def abort_consumer(self, tid: str) -> bool:
        epoch = self.live.pop(tid, None)
        if epoch is None:
            return False
        self.checker.withdrawn_locally(tid, epoch)
        self.consumer.abort(self.clock.now, tid)
        self.pump()
        return True

    def kv_ready(self, tid: str) -> bool:
        """The prefill of ``tid`` is done (its last increment, if it had some)."""
        n = self.config.blocks_per_transfer
        part = self.parts.pop(tid, ())
        if not self.producer_alive or tid in self.kv or len(self.free_src) < n - len(part):
            if part:
                self.parts[tid] = part
            return False
        rest, self.free_src = self.free_src[: n - len(part)], self.free_src[n - len(part) :]
        blocks = [*part, *rest]
        self.kv[tid] = tuple(blocks)
        self.checker.kv_ready(tid, frozenset(blocks))
        self.producer.kv_ready(self.clock.now, tid, [blocks])
        self.pump()
        return True

    def kv_increment(self, tid: str) -> bool:
        """The prefill of ``tid`` computed its first ``blocks_per_transfer - 1``
        blocks (progressive push: an increment, not the last)."""
        n = self.config.blocks_per_transfer - 1
        if not self.producer_alive or tid in self.kv or tid in self.parts or n < 1:
            return False
        if len(self.free_src) < n:
            return False
        blocks, self.free_src = self.free_src[:n], self.free_src[n:]
        self.parts[tid] = tuple(blocks)
        self.checker.kv_ready(tid, frozenset(blocks))
        self.producer.kv_ready(self.clock.now, tid, [blocks], final=False)
        self.pump()
        return True

    def abort_producer(self, tid: str) -> bool:
        if not self.producer_alive:
            return False
        if tid in self.parts:  # the prefill is gone: its source ends where it is
            self.kv[tid] = self.parts.pop(tid)
        self.producer.abort(self.clock.now, tid)
        self.pump()
        return True

    def kill_producer(self, detected: bool) -> bool:
        """The prefill process dies. Posted writes may still land within their
        bound; nothing new is posted. ``detected``: the runtime noticed."""
        if not self.producer_alive:
            return False
        self.producer_alive = False
        self.net.drop_to(P)
        self.ops = [
            op for op in self.ops if op.posted_at is not None or isinstance(op.action, StartRead)
        ]
        # A write that hung dies with its process: nothing of it moves again.
        self.ops = [op for op in self.ops if not (op.hung and isinstance(op.action, StartWrite))]
        now = self.clock.now
        for op in self.ops:
            if isinstance(op.action, StartWrite):
                # Its sockets close: what is left of a write stalled with its
                # process lands within the bound from now, or never.
                op.orphan = True
                if op.unbounded:
                    op.unbounded, op.posted_at = False, now
        if detected:
            self.consumer.peer_lost(self.clock.now, P)
            self.pump()
        return True

    def restart_producer(self) -> bool:
        """A dead prefill process starts again: a new instance with all its
        memory free and no state. Reads of the old instance's memory fail (its
        transport agent is gone). The consumer's channel sees the new
        connection: the old peer lost (if not noticed yet), a connection up."""
        if self.producer_alive:
            return False
        self.producer = self._new_producer(self.producer.identity.instance + 1)
        self.producer_alive = True
        self.free_src = list(range(self.config.pool_blocks))
        self.kv.clear()
        self.parts.clear()
        self.checker.producer_restarted()
        reads = [op for op in self.ops if isinstance(op.action, StartRead)]
        self.ops = [op for op in self.ops if not isinstance(op.action, StartRead)]
        now = self.clock.now
        for op in reads:
            self._report(op, ok=False)
        if self.consumer.peer(P).state is not PeerState.DISCONNECTED:
            self.consumer.peer_lost(now, P)
        self.consumer.connection_up(now, P)
        self.pump()
        return True

    def reconnect(self, detected: bool) -> None:
        """The control connection breaks and comes back (same processes): the
        frames in flight on it are lost. ``detected``: the outage outlasted the
        channels' loss timer, so both sides saw the peer lost first."""
        now = self.clock.now
        alive = self.producer_alive
        while self.net.queue:  # the old connection's frames
            self.net.drop(0)
        if detected:
            self.consumer.peer_lost(now, P)
            if alive:
                self.producer.peer_lost(now, D)
        self.pump()
        if alive:
            self.consumer.connection_up(now, P)
            self.producer.connection_up(now, D)
        self.pump()

    def stall(self, who: str, gap: float) -> bool:
        """The process of ``who`` (``"prefill"`` or ``"decode"``) does not run
        for ``gap`` seconds (SIGSTOP, a VM pause, a blocked event loop). The
        other side and the transports go on; frames to it wait in its kernel
        (none expires: the sender's channel handed them over); its timers do
        not fire. Then its runtime notices (``stalled(now, gap)``), reads every
        frame that waited, and fires its overdue timers."""
        if gap <= 0 or (who == P and not self.producer_alive):
            return False
        me = self.producer if who == P else self.consumer
        mine = StartWrite if who == P else StartRead
        # A producer the consumer does not see connected is taken as gone at the
        # quarantine: its writes rest on A2 (docs/protocol.md, timing), so only a
        # stop of a connected one leaves them unbounded.
        connected = who == D or self.consumer.peer(P).state is PeerState.READY
        for op in self.ops:
            if op.posted_at is not None and isinstance(op.action, mine) and not op.orphan:
                op.unbounded = op.unbounded or connected
        target = self.clock.now + gap
        for _ in range(100_000):
            other = self.consumer.next_deadline() if who == P else None
            if who == D and self.producer_alive:
                other = self.producer.next_deadline()
            if other is None or other > target:
                break
            self._tick(max(other, self.clock.now), frozen=who)
        else:
            raise AssertionError("timers keep firing without time moving")
        self._tick(target, frozen=who)
        me.stalled(self.clock.now, gap)
        waiting = [m.seq for m in self.net.queue if m.dst == who]
        for seq in waiting:  # in the order they were sent
            self.deliver(next(k for k, m in enumerate(self.net.queue) if m.seq == seq))
        self._tick(self.clock.now)
        return True

    # --- the network --------------------------------------------------------------

    def deliver(self, index: int) -> None:
        m = self.net.take(index)
        now = self.clock.now
        end = self.producer if m.dst == P else self.consumer
        if m.dst == P:
            if not self.producer_alive:
                return
            # A message from a peer without a handshake is ignored (counted):
            # the producer has not seen it (a Register is answered UNKNOWN_PEER).
            if self.producer.peer(m.src).state is PeerState.READY:
                self.checker.producer_received(now, m.message)
        else:
            self.checker.consumer_received(m.message)
        before = end.stall_dropped
        end.receive(now, m.src, m.message)  # type: ignore[arg-type]
        if end.stall_dropped != before:
            self.stall_losses.add(m.message.transfer_id)  # type: ignore[attr-defined]
        self.pump()

    def drop_notice(self, index: int) -> None:
        """A completion notice is lost on the data plane."""
        self.notices.pop(index)

    def duplicate_notice(self, index: int) -> None:
        """The data plane delivers a completion notice twice."""
        self.notices.append(self.notices[index])

    # --- the model transport ------------------------------------------------------

    def post(self, index: int) -> None:
        """The adapter posts a queued write/read (or reports it expired)."""
        op = self.ops[index]
        assert op.posted_at is None
        now = self.clock.now
        if now > op.action.not_after:
            del self.ops[index]
            self._report(op, ok=False)
            return
        op.posted_at = now

    def land(self, index: int) -> None:
        """A posted op moves its bytes; a write's notice reaches the consumer
        later (``notify``), its initiator is told later (``ack``)."""
        op = self.ops[index]
        assert op.posted_at is not None and not op.landed and not op.hung
        self.checker.landed(self.clock.now, op.action)
        if isinstance(op.action, StartWrite):
            op.landed = True
            if op.action.notice is not None:  # an increment but the last has none
                self.notices.append(op.action.notice)
        else:
            del self.ops[index]
            self._report(op, ok=True)

    def ack(self, index: int) -> None:
        """The initiator of a landed write learns it is done."""
        op = self.ops.pop(index)
        assert op.landed
        self._report(op, ok=True)

    def fail(self, index: int) -> None:
        """A posted op fails (it may have moved some bytes first)."""
        op = self.ops.pop(index)
        assert op.posted_at is not None and not op.landed and not op.hung
        self.checker.landed(self.clock.now, op.action)
        self._report(op, ok=False)

    def hang(self, index: int) -> None:
        """A posted op never completes on its own and nobody is told (no
        transport timeout either). Its initiator asks for its cancel
        ``op_bound`` after handing it over (``Cancel``); until the transport
        confirms that (:meth:`cancel`), the consumer holds the blocks it
        targets (``SUSPECT``)."""
        op = self.ops[index]
        assert op.posted_at is not None and not op.landed and not op.hung
        op.hung = True
        self.hung.add((op.action.transfer_id, op.action.epoch))

    def cancel(self, index: int) -> None:
        """The transport confirms the cancel its initiator asked for: nothing
        of the op moves any more (some bytes may have landed before); its
        initiator is told it failed."""
        op = self.ops.pop(index)
        assert op.cancel and not op.landed
        if op.posted_at is not None:
            self.checker.landed(self.clock.now, op.action)
        self._report(op, ok=False)

    def notify(self, index: int) -> None:
        """The consumer polls one completion notice."""
        notice = self.notices.pop(index)
        self.checker.notice_delivered(notice)
        self.consumer.completion_received(self.clock.now, P, notice)
        self.pump()

    def _report(self, op: Op, ok: bool) -> None:
        a, now = op.action, self.clock.now
        if isinstance(a, StartWrite):
            if not self.producer_alive:
                return
            src, rank = a.route.source, a.route.consumer_rank
            if ok:
                self.producer.write_done(now, a.transfer_id, a.epoch, src, rank)
            else:
                self.producer.write_failed(now, a.transfer_id, a.epoch, src, rank, "model failure")
        else:
            self.checker.read_settled(a)
            self.consumer.read_done(
                now, a.transfer_id, a.epoch, a.route.source, a.route.consumer_rank, ok
            )
        self.pump()

    # --- time -----------------------------------------------------------------------

    def next_event_time(self) -> float | None:
        """The next endpoint timer. (Message expiry and the op bound need no
        event of their own: every tick applies them.)"""
        times = [self.consumer.next_deadline()]
        if self.producer_alive:
            times.append(self.producer.next_deadline())
        found = [t for t in times if t is not None]
        return min(found) if found else None

    def advance(self, dt: float) -> None:
        """Let ``dt`` pass, firing every timer and bound on the way in order."""
        target = self.clock.now + dt
        for _ in range(100_000):
            nxt = self.next_event_time()
            if nxt is None or nxt > target:
                break
            self._tick(max(nxt, self.clock.now))
        else:
            raise AssertionError("timers keep firing without time moving")
        self._tick(target)

    def advance_to_next(self) -> bool:
        """Jump just past the next timer or bound; False if there is none."""
        nxt = self.next_event_time()
        if nxt is None:
            return False
        self._tick(max(nxt, self.clock.now) + 1e-6)
        return True

    def _tick(self, now: float, frozen: str | None = None) -> None:
        """Time moves to ``now``; ``frozen``: a stalled side, whose timers do not
        fire and whose waiting frames do not expire (see :meth:`stall`)."""
        self.clock.now = now
        self.net.expire(now, spare=frozen)
        bound = self.config.op_bound
        # The transport's own error timeout: a posted op older than op_bound
        # is dead and its initiator is told (unless it stalled meanwhile).
        dead = [
            op
            for op in self.ops
            if not (op.landed or op.unbounded or op.hung or op.posted_at is None)
            and now - op.posted_at > bound
        ]
        for op in dead:
            self.ops.remove(op)
            self._report(op, ok=False)
        if frozen != D:
            self.consumer.handle_timer(now)
        if self.producer_alive and frozen != P:
            self.producer.handle_timer(now)
        self.pump()
        if frozen != D:  # a stopped consumer cannot meet its deadlines (I5)
            self.checker.check_time(now, self.excused())

    def excused(self) -> set[tuple[str, int]]:
        """Reservations that may outlive their quarantine: suspect ones (a
        write of a connected producer may still land), and those with an op
        that may land later (its initiator stalled) or that hung (it ends
        when its cancel is confirmed, at any later move)."""
        held = {(t, e) for t, e, st in self.consumer.reservations() if st is CState.SUSPECT}
        late = {
            (op.action.transfer_id, op.action.epoch)
            for op in self.ops
            # unbounded, or a read the adapter has not posted (nor reported) yet
            if op.unbounded
            or op.hung
            or (op.posted_at is None and isinstance(op.action, StartRead))
        }
        return held | late

    def quiesce(self, limit: int = 10_000) -> None:
        """Stop new inputs: deliver, post, land and acknowledge everything in
        order, confirm every cancel asked for, then let every timer fire.
        Checks I3: nothing is held, hung ops included (their initiators
        cancel them). A dead producer's loss is noticed in the end (its
        connection closes)."""
        if not self.producer_alive:
            # Its connection closes, and (the world knows) it is gone.
            self.consumer.peer_gone(self.clock.now, P)
            self.pump()
        for _ in range(limit):
            if self.net.queue:
                self.deliver(0)
            elif self.notices:
                self.notify(0)
            elif (i := self._next_op()) is not None:
                op = self.ops[i]
                if op.posted_at is None:
                    self.post(i)
                elif op.landed:
                    self.ack(i)
                elif op.hung:
                    self.cancel(i)
                else:
                    self.land(i)
            elif not self.advance_to_next():
                break
        else:
            raise AssertionError("the world did not quiesce")
        self.checker.check_quiescent(
            self.consumer.reserved_blocks,
            self.producer.held_blocks if self.producer_alive else 0,
            producer_alive=self.producer_alive,
        )

    def _next_op(self) -> int | None:
        """The first op that can move now: any but a hung one whose cancel
        is not asked for yet (time must pass for that)."""
        return next((i for i, op in enumerate(self.ops) if op.cancel or not op.hung), None)

    # --- output routing -----------------------------------------------------------

    def pump(self) -> None:
        """Route everything both endpoints emitted."""
        now = self.clock.now
        view = self.consumer.peer(P)
        instance = None if view.hello is None else view.hello.instance
        self.checker.link = (instance, view.state is PeerState.READY)
        states = {(t, e): st for t, e, st in self.consumer.reservations()}
        for key in self.suspect:
            if states.get(key) is CState.DRAINING:  # proof the producer is gone
                self.checker.requarantine(key, now)
        moved = True
        while moved:
            moved = False
            for out in self.consumer.drain():
                moved = True
                self.checker.consumer_output(now, out)
                self._route(D, out)
            if self.producer_alive:
                for out in self.producer.drain():
                    moved = True
                    self.checker.producer_output(now, out)
                    self._route(P, out)
        self.suspect = frozenset(
            (t, e) for t, e, st in self.consumer.reservations() if st is CState.SUSPECT
        )

    def _route(self, me: str, out: Output) -> None:
        if isinstance(out, Send):
            if self.producer_alive or me != D:
                self.net.send(self.clock.now, me, out.peer, out.message)
        elif isinstance(out, StartWrite):
            self.ops.append(Op(out))
        elif isinstance(out, StartRead):
            self.checker.consumer_read(out)
            self.ops.append(Op(out))
        elif isinstance(out, Cancel):
            kind = StartWrite if me == P else StartRead
            for op in self.ops:
                a = op.action
                if isinstance(a, kind) and _cancels(out, a):
                    op.cancel = True
        else:
            self._event(out)
        self.events.append(out)

    def _event(self, out: Output) -> None:
        """The World's bookkeeping of an endpoint's event."""
        if isinstance(out, Ready):
            self.ready.add(out.transfer_id)
            self.live.pop(out.transfer_id, None)
        elif isinstance(out, Released):
            if self.live.get(out.transfer_id) == out.epoch:
                del self.live[out.transfer_id]
            self.free_dst.extend(b for g in out.blocks for b in g)
        elif isinstance(out, SourceReleased):
            self.free_src.extend(b for g in out.blocks for b in g)
            self.source_outcomes[out.transfer_id] = out.outcome
        elif isinstance(out, Failed):
            self.failed.add((out.transfer_id, out.epoch))
            self.failure_reasons[(out.transfer_id, out.epoch)] = out.reason
            if self.live.get(out.transfer_id) == out.epoch:
                del self.live[out.transfer_id]


def _cancels(cancel: Cancel, a: StartWrite | StartRead) -> bool:
    """Whether ``cancel`` names the op of action ``a``."""
    where = (a.route.source, a.route.consumer_rank) == (cancel.source, cancel.consumer_rank)
    return where and (a.transfer_id, a.epoch) == (cancel.transfer_id, cancel.epoch)
