"""The prefill-side endpoint: the two-event rendezvous, epochs, held source KV.

One :class:`Producer` serves one prefill instance (all its TP x PP ranks). Each
transfer is one record moving through ``PRODUCER`` in ``_tables.py``; this module
performs the side effects of those transitions.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ._config import ProducerConfig
from ._endpoint import Endpoint, Timer
from ._errors import LocalProtocolError
from ._layout import KVLayout
from ._messages import (
    Abort,
    Announce,
    Completion,
    ControlMessage,
    ReadDone,
    Register,
    Rejected,
    Settled,
    Withdraw,
    WriteFailed,
)
from ._outputs import ReleaseOutcome, Send, SourceReleased, StartWrite
from ._tables import PRODUCER, PInput, PState
from ._timeline import OpStamps, Timeline, TimelineBuilder
from ._types import (
    BlockIds,
    FailureReason,
    Mode,
    RejectReason,
    Role,
    Source,
    check_blocks,
    clip_detail,
)

__all__ = ("Producer",)

Pair = tuple[Source, int]

#: Timers each state keeps armed (everything else is cancelled on entry).
_TIMERS: dict[PState, Timer] = {
    PState.IDLE: Timer.EXPIRE,
    PState.WAIT_KV: Timer.LEASE,
    PState.HOLDING: Timer.HOLD,
    PState.WRITING: Timer.OP,
    PState.DRAINING: Timer.OP,
    PState.LENT: Timer.QUARANTINE,
    PState.RELEASED: Timer.EXPIRE,
}


@dataclass(slots=True, frozen=True)
class _Reg:
    epoch: int
    peer: str
    blocks: BlockIds
    #: Producer-clock time after which no write of this epoch may start.
    lease_until: float
    mode: Mode
    skip_tokens: int = 0


@dataclass(slots=True, eq=False)
class _Transfer:
    transfer_id: str
    timeline: TimelineBuilder
    state: PState = PState.IDLE
    peer: str | None = None
    max_epoch: int = 0
    src: BlockIds | None = None
    released: bool = False
    reg: _Reg | None = None
    pending: _Reg | None = None
    #: The live epoch was withdrawn or superseded while its writes run.
    withdrawn: bool = False
    inflight: set[Pair] = field(default_factory=set)
    write_failed: bool = False
    #: Epochs owed a Settled once the in-flight writes settle.
    owe: set[int] = field(default_factory=set)
    #: Why we are draining (or lending after a local abort).
    ending: ReleaseOutcome | None = None
    #: The epoch whose writes were all delivered (kept by the tombstone).
    delivered_epoch: int = -1
    hold_until: float = 0.0
    op_deadline: float = 0.0
    quarantine_at: float = 0.0
    expires_at: float = 0.0
    timers: dict[Timer, float] = field(default_factory=dict)


def _inside(blocks: BlockIds, layout: KVLayout | None) -> bool:
    """Whether every block id lies inside the declared regions of its group."""
    if layout is None:
        return True
    return all(
        not group or max(group) < layout.group_region(g).num_blocks
        for g, group in enumerate(blocks)
    )


class Producer(Endpoint):
    """Prefill-side protocol endpoint (sans-IO).

    Feed it with :meth:`kv_ready`, :meth:`abort`, :meth:`receive`,
    :meth:`write_done`, :meth:`write_failed`, :meth:`peer_lost` and
    :meth:`handle_timer`; drain its actions and events with :meth:`drain`.
    """

    role = Role.PRODUCER

    def __init__(self, config: ProducerConfig) -> None:
        super().__init__(config.identity, config.timing)
        self.config = config
        self._tx: dict[str, _Transfer] = {}
        self._held_blocks = 0

    # --- queries ------------------------------------------------------------

    @property
    def held_blocks(self) -> int:
        """Source blocks currently held (KV ready and not yet released)."""
        return self._held_blocks

    def transfers(self) -> list[tuple[str, PState]]:
        """(transfer id, state) of every transfer record, tombstones included."""
        return [(t.transfer_id, t.state) for t in self._tx.values()]

    def timeline(self, transfer_id: str) -> Timeline | None:
        """The timeline of ``transfer_id`` while its record exists."""
        rec = self._tx.get(transfer_id)
        return rec.timeline.freeze() if rec else None

    # --- local inputs -------------------------------------------------------------

    def kv_ready(self, now: float, transfer_id: str, blocks: Sequence[Sequence[int]]) -> None:
        """The KV of ``transfer_id`` is computed in ``blocks`` (ids per KV group);
        hold them until a registration takes them or the hold expires."""
        ids = check_blocks(blocks, self.identity.kv_groups)
        rec = self._get(now, transfer_id)
        if rec.src is not None:
            if rec.src != ids:
                raise LocalProtocolError(f"kv_ready for {transfer_id!r} with other blocks")
            self._counters["kv_ready_duplicate"] += 1
            return
        rec.src = ids
        rec.timeline.kv_ready = now
        self._held_blocks += sum(map(len, ids))
        if rec.state is PState.WAIT_KV:
            assert rec.reg is not None
            if now > rec.reg.lease_until:
                self._step(now, rec, PInput.LEASE_EXPIRED)
            else:
                self._rendezvous(now, rec)
                return
        self._step(now, rec, PInput.KV_READY)

    def abort(self, now: float, transfer_id: str) -> bool:
        """Abort ``transfer_id`` (the prefill request is gone). The source blocks
        come back with :class:`SourceReleased` once no write reads them. Harmless
        on an unknown transfer (a tombstone then refuses its registration).
        Returns whether the transfer was known."""
        known = transfer_id in self._tx
        rec = self._get(now, transfer_id)
        self._step(now, rec, PInput.ABORT)
        return known

    def write_done(
        self,
        now: float,
        transfer_id: str,
        epoch: int,
        source: Source,
        consumer_rank: int,
        *,
        stamps: OpStamps | None = None,
    ) -> None:
        """The transport finished one :class:`StartWrite` (its notice was sent).
        ``stamps``: when the data plane planned, posted and saw it finish (for
        the timeline's ``ops``)."""
        stamps = None if stamps is None else stamps.check()
        self._write_result(now, transfer_id, epoch, (source, consumer_rank), "", stamps)

    def write_failed(
        self,
        now: float,
        transfer_id: str,
        epoch: int,
        source: Source,
        consumer_rank: int,
        detail: str = "write failed",
    ) -> None:
        """One :class:`StartWrite` failed to post or failed in flight, and has
        settled (nothing more of it will land)."""
        detail = clip_detail(detail or "failed")
        self._write_result(now, transfer_id, epoch, (source, consumer_rank), detail)

    # --- remote inputs --------------------------------------------------------------

    def _on_unready_message(self, now: float, peer: str, message: ControlMessage) -> None:
        if isinstance(message, Register):
            tid = message.transfer_id
            reject = Rejected(tid, message.epoch, RejectReason.UNKNOWN_PEER)
            self._out.append(Send(peer, reject))
            # The consumer releases those blocks on this answer, so no copy of
            # this registration (duplicated, or delayed past a redone
            # handshake) may be served: remember its epoch, as for an unknown
            # Withdraw (the record expires after tombstone_ttl > max_transit).
            rec = self._tx.get(tid)
            if rec is None:
                rec = self._get(now, tid)
                rec.peer = peer
            if rec.peer == peer:
                rec.max_epoch = max(rec.max_epoch, message.epoch)

    def _on_message(self, now: float, peer: str, message: ControlMessage) -> None:
        if isinstance(message, Register):
            self._on_register(now, peer, message)
            return
        if not isinstance(message, (Withdraw, Abort, ReadDone)):
            self._counters[f"unexpected_{type(message).__name__}"] += 1
            return
        rec = self._tx.get(message.transfer_id)
        if rec is not None and rec.peer is not None and rec.peer != peer:
            self._counters["message_from_wrong_peer"] += 1
            return
        if isinstance(message, ReadDone):
            if (
                rec is None
                or rec.state is not PState.LENT
                or rec.reg is None
                or rec.reg.epoch != message.epoch
            ):
                self._counters["read_done_stale"] += 1
                return
            if not message.ok and rec.ending is None:
                rec.ending = ReleaseOutcome.FAILED
            self._step(now, rec, PInput.READ_DONE, remote=True)
            return
        rec = self._get(now, message.transfer_id)
        rec.peer = rec.peer or peer
        epoch = message.epoch
        # An Abort of an epoch older than the newest registration seen ends only
        # that epoch (the consumer gave up on it, then reserved again): treat it
        # as a Withdraw, never as the end of the newer epoch it overtook.
        whole = isinstance(message, Abort) and epoch >= rec.max_epoch
        if isinstance(message, Abort) and not whole:
            self._counters["abort_of_older_epoch"] += 1
        rec.max_epoch = max(rec.max_epoch, epoch)
        if whole:
            if rec.state is not PState.DRAINING or rec.ending is None:
                rec.ending = ReleaseOutcome.ABORTED
            rec.owe.add(epoch)
            released = rec.state is PState.RELEASED
            # Pull: an Abort of a newer epoch than the lent one (the consumer
            # preempted while reading, reserved again, then gave up) ends the
            # transfer, but the lent epoch's reads may still run: the KV stays
            # lent until they settle (its ReadDone, Withdraw or Abort) or its
            # quarantine passes.
            newer = rec.state is PState.LENT and rec.reg is not None and rec.reg.epoch != epoch
            if newer and rec.pending is not None and rec.pending.epoch == epoch:
                rec.pending = None  # the consumer ended it: no Rejected owed
            inp = PInput.PEER_ABORT_NEWER if newer else PInput.PEER_ABORT
            self._step(now, rec, inp, remote=True)
            if released:  # a tombstone has nothing in flight: acknowledge at once
                self._send_owed(rec)
        elif rec.pending is not None and rec.pending.epoch == epoch:
            rec.pending = None
            self._out.append(Send(peer, Settled(rec.transfer_id, epoch)))
        elif rec.reg is not None and rec.reg.epoch == epoch and not rec.withdrawn:
            # Lent, with the transfer already over: the end of that epoch's
            # reads is all we waited for.
            over = rec.state is PState.LENT and rec.ending is not None
            self._step(now, rec, PInput.READ_DONE if over else PInput.WITHDRAW, remote=True)
        elif self._in_flight(rec, epoch):
            self._counters["withdraw_duplicate"] += 1
        else:
            # Nothing of that epoch runs or ever will: say so at once.
            self._out.append(Send(peer, Settled(rec.transfer_id, epoch)))

    def _on_register(self, now: float, peer: str, msg: Register) -> None:
        view = self._peers[peer]
        assert view.hello is not None
        tid, epoch = msg.transfer_id, msg.epoch
        if (
            msg.consumer != peer
            or len(msg.blocks) != view.hello.kv_groups
            or msg.lease <= 0
            or not _inside(msg.blocks, view.hello.layout)
        ):
            # A registration says where to write in remote memory: it may only
            # name blocks inside the regions its sender declared at handshake.
            self._counters["register_invalid"] += 1
            self._out.append(Send(peer, Rejected(tid, epoch, RejectReason.INVALID)))
            return
        rec = self._get(now, tid)
        if rec.peer is not None and rec.peer != peer:
            self._counters["register_peer_mismatch"] += 1
            self._out.append(Send(peer, Rejected(tid, epoch, RejectReason.PEER_MISMATCH)))
            return
        reg, pending = rec.reg, rec.pending
        if (
            (reg is not None and reg.epoch == epoch)
            or (pending is not None and pending.epoch == epoch)
            or (rec.state is PState.RELEASED and epoch == rec.delivered_epoch)
        ):
            # A duplicate, also of an epoch already delivered and released: a
            # Rejected would wrongly fail a transfer whose data already landed.
            self._counters["register_duplicate"] += 1
            return
        if msg.mode not in self.identity.modes:
            self._counters["register_invalid"] += 1
            self._out.append(Send(peer, Rejected(tid, epoch, RejectReason.INVALID)))
            return
        if rec.state in (PState.RELEASED, PState.DRAINING):
            self._counters["register_after_release"] += 1
            self._out.append(Send(peer, Rejected(tid, epoch, RejectReason.RELEASED)))
            return
        if epoch <= rec.max_epoch:
            self._counters["register_stale"] += 1
            self._out.append(Send(peer, Rejected(tid, epoch, RejectReason.SUPERSEDED)))
            return
        rec.peer = peer
        rec.max_epoch = epoch
        rec.timeline.registration_received = now
        reg = _Reg(epoch, peer, msg.blocks, now + msg.lease, msg.mode, msg.skip_tokens)
        if rec.state in (PState.WRITING, PState.LENT):
            if rec.pending is not None:
                self._reject(rec, rec.pending, RejectReason.SUPERSEDED)
            rec.pending = reg
            if rec.state is PState.WRITING:
                rec.withdrawn = True  # the consumer moved on from the live epoch
            self._step(now, rec, PInput.REGISTER, remote=True)
            return
        if rec.state is PState.WAIT_KV:
            assert rec.reg is not None
            self._reject(rec, rec.reg, RejectReason.SUPERSEDED)
        rec.reg = reg
        if rec.state is PState.HOLDING:
            self._rendezvous(now, rec)
        else:
            self._step(now, rec, PInput.REGISTER, remote=True)

    def _on_peer_ready(self, now: float, peer: str) -> None:
        pass

    def _on_peer_down(self, now: float, peer: str, reason: FailureReason, detail: str) -> None:
        for rec in list(self._tx.values()):
            if rec.peer == peer:
                if rec.state in (PState.WRITING, PState.LENT) and rec.ending is None:
                    rec.ending = ReleaseOutcome.PEER_LOST
                self._step(now, rec, PInput.PEER_DOWN, remote=True)

    # --- timers ---------------------------------------------------------------------

    def _timers_of(self, key: Hashable) -> dict[Timer, float] | None:
        rec = self._tx.get(key)  # type: ignore[call-overload]
        return rec.timers if rec is not None else None

    def _fire(self, now: float, kind: Timer, key: Hashable) -> None:
        rec = self._tx[key]  # type: ignore[index]
        del rec.timers[kind]
        if kind is Timer.EXPIRE:
            self._step(now, rec, PInput.EXPIRED)
        elif kind is Timer.LEASE:
            self._step(now, rec, PInput.LEASE_EXPIRED)
        elif kind is Timer.HOLD:
            self._step(now, rec, PInput.HOLD_EXPIRED)
        elif kind is Timer.QUARANTINE:
            self._step(now, rec, PInput.QUARANTINE)
        else:  # Timer.OP: writes past their bound are dead
            assert rec.reg is not None
            epoch = rec.reg.epoch
            self._counters["write_timeout"] += 1
            for source, rank in sorted(rec.inflight):
                self.write_failed(now, rec.transfer_id, epoch, source, rank, "timeout")

    # --- transitions -------------------------------------------------------------

    def _get(self, now: float, transfer_id: str) -> _Transfer:
        rec = self._tx.get(transfer_id)
        if rec is None:
            rec = _Transfer(transfer_id, TimelineBuilder(transfer_id))
            rec.expires_at = now + self.config.tombstone_ttl
            self._tx[transfer_id] = rec
            self._arm(rec.timers, Timer.EXPIRE, rec.expires_at, transfer_id)
        return rec

    def _in_flight(self, rec: _Transfer, epoch: int) -> bool:
        return bool(rec.inflight) and rec.reg is not None and rec.reg.epoch == epoch

    def _reject(self, rec: _Transfer, reg: _Reg, reason: RejectReason) -> None:
        self._out.append(Send(reg.peer, Rejected(rec.transfer_id, reg.epoch, reason)))

    def _rendezvous(self, now: float, rec: _Transfer) -> None:
        assert rec.reg is not None
        mode = rec.reg.mode
        push = mode is Mode.PUSH
        self._step(now, rec, PInput.RENDEZVOUS_PUSH if push else PInput.RENDEZVOUS_PULL)

    def _write_result(
        self,
        now: float,
        transfer_id: str,
        epoch: int,
        pair: Pair,
        detail: str,
        stamps: OpStamps | None = None,
    ) -> None:
        rec = self._tx.get(transfer_id)
        if rec is None or not self._in_flight(rec, epoch) or pair not in rec.inflight:
            self._counters["write_result_unknown"] += 1
            return
        assert rec.reg is not None
        rec.inflight.discard(pair)
        if detail:
            rec.write_failed = True
            if rec.ending is not ReleaseOutcome.PEER_LOST:
                failed = WriteFailed(transfer_id, epoch, pair[0], pair[1], detail)
                self._out.append(Send(rec.reg.peer, failed))
        else:
            rec.timeline.write_done[pair] = now
            if stamps is not None:
                rec.timeline.ops[pair] = stamps
        if rec.inflight:  # not the last: no side effects, the table keeps the state
            self._step(now, rec, PInput.WRITE_SETTLED)
            return
        if rec.state is PState.DRAINING:
            settle = PInput.SETTLED_FAILED if rec.write_failed else PInput.SETTLED_DELIVERED
        elif rec.pending is not None:
            if now > rec.pending.lease_until:
                self._reject(rec, rec.pending, RejectReason.LEASE_EXPIRED)
                rec.pending = None
                settle = PInput.SETTLED_IDLE
            elif rec.pending.mode is Mode.PUSH:
                settle = PInput.SETTLED_NEXT
            else:  # a pull epoch is lent from HOLDING, never written
                settle = PInput.SETTLED_IDLE
        elif rec.withdrawn:
            settle = PInput.SETTLED_IDLE
        else:
            settle = PInput.SETTLED_FAILED if rec.write_failed else PInput.SETTLED_DELIVERED
        self._step(now, rec, settle)

    def _step(self, now: float, rec: _Transfer, inp: PInput, *, remote: bool = False) -> None:
        """Apply ``inp`` to ``rec`` through the table, then its side effects."""
        old = rec.state
        new = PRODUCER.get((old, inp))
        if new is None:
            if remote:
                self._counters[f"ignored_{inp.value}_in_{old.value}"] += 1
                return
            raise LocalProtocolError(f"{inp.name} is not allowed in state {old.name}")
        rec.state = new
        if inp is not PInput.WRITE_SETTLED:  # the one input without side effects
            self._effects(now, rec, old, inp)
        state = rec.state
        if state is PState.GONE:
            del self._tx[rec.transfer_id]
            return
        if state is not old or inp in (PInput.SETTLED_NEXT, PInput.REGISTER):
            self._arm_for(now, rec, old)

    def _effects(self, now: float, rec: _Transfer, old: PState, inp: PInput) -> None:
        new = rec.state
        tid = rec.transfer_id
        if inp in (PInput.RENDEZVOUS_PUSH, PInput.SETTLED_NEXT):
            if inp is PInput.SETTLED_NEXT:
                assert rec.reg is not None and rec.pending is not None
                self._settle_owed(rec, rec.reg.epoch)
                rec.reg, rec.pending = rec.pending, None
            self._start_writes(now, rec)
        elif inp is PInput.RENDEZVOUS_PULL:
            assert rec.reg is not None and rec.src is not None
            lease = rec.reg.lease_until - now
            view = self._peers[rec.reg.peer]
            assert view.hello is not None
            rec.quarantine_at = rec.reg.lease_until + self.config.timing.max_transit
            rec.quarantine_at += view.hello.op_bound
            rec.withdrawn = False
            rec.timeline.write_started = now
            self._out.append(Send(rec.reg.peer, Announce(tid, rec.reg.epoch, rec.src, lease)))
        elif inp is PInput.SETTLED_IDLE or (old is PState.LENT and inp is PInput.WITHDRAW):
            assert rec.reg is not None
            if inp is PInput.SETTLED_IDLE:
                self._settle_owed(rec, rec.reg.epoch)
            rec.reg = None
            rec.hold_until = now + self.config.kv_hold_timeout
        elif inp is PInput.WITHDRAW and old is PState.WAIT_KV:
            assert rec.reg is not None
            self._out.append(Send(rec.reg.peer, Settled(tid, rec.reg.epoch)))
            rec.reg = None
        elif inp is PInput.WITHDRAW:  # WRITING: settle later
            rec.withdrawn = True
        elif inp is PInput.LEASE_EXPIRED:
            assert rec.reg is not None
            self._reject(rec, rec.reg, RejectReason.LEASE_EXPIRED)
            rec.reg = None
        elif inp is PInput.PEER_DOWN and old is PState.WAIT_KV:
            rec.reg = None
        elif inp in (PInput.ABORT, PInput.PEER_ABORT, PInput.PEER_ABORT_NEWER):
            self._abort_effects(rec, old, inp)
        elif inp is PInput.KV_READY and old is PState.IDLE:
            rec.hold_until = now + self.config.kv_hold_timeout
        if new is PState.RELEASED and (old is not PState.RELEASED or inp is PInput.KV_READY):
            self._release(now, rec, inp)
        elif new is PState.HOLDING and rec.pending is not None:
            if now > rec.pending.lease_until:  # it waited too long: never start it
                self._reject(rec, rec.pending, RejectReason.LEASE_EXPIRED)
                rec.pending = None
            else:
                rec.reg, rec.pending = rec.pending, None
                self._rendezvous(now, rec)

    def _abort_effects(self, rec: _Transfer, old: PState, inp: PInput) -> None:
        tid = rec.transfer_id
        if inp is PInput.ABORT:
            if rec.ending is None:
                rec.ending = ReleaseOutcome.ABORTED
            if old in (PState.WRITING, PState.WAIT_KV, PState.LENT) and rec.reg is not None:
                self._out.append(Send(rec.reg.peer, Abort(tid, rec.reg.epoch)))
                rec.owe.add(rec.reg.epoch)
            elif old in (PState.IDLE, PState.HOLDING) and rec.peer is not None:
                self._out.append(Send(rec.peer, Abort(tid, rec.max_epoch)))
                rec.owe.add(rec.max_epoch)
        elif rec.reg is not None:
            rec.owe.add(rec.reg.epoch)
        if rec.pending is not None:
            self._reject(rec, rec.pending, RejectReason.RELEASED)
            rec.pending = None
        if old is PState.WRITING and rec.reg is not None:
            rec.owe.add(rec.reg.epoch)

    def _start_writes(self, now: float, rec: _Transfer) -> None:
        reg, src = rec.reg, rec.src
        assert reg is not None and src is not None
        view = self._peers[reg.peer]
        assert view.topology is not None
        tid, epoch = rec.transfer_id, reg.epoch
        rec.withdrawn = False
        rec.write_failed = False
        rec.op_deadline = reg.lease_until + self.config.timing.op_bound
        rec.timeline.epoch = epoch
        rec.timeline.write_started = now
        out = self._out
        for route in view.topology.routes:
            notice = Completion(tid, epoch, route.source, route.consumer_rank)
            rec.inflight.add((route.source, route.consumer_rank))
            out.append(
                StartWrite(
                    tid,
                    epoch,
                    reg.peer,
                    route,
                    src,
                    reg.blocks,
                    reg.lease_until,
                    notice,
                    reg.skip_tokens,
                )
            )

    def _settle_owed(self, rec: _Transfer, epoch: int) -> None:
        """No write of ``epoch`` (nor of any owed epoch) can land any more:
        tell the consumer, who may be draining those blocks."""
        rec.owe.add(epoch)
        self._send_owed(rec)

    def _send_owed(self, rec: _Transfer) -> None:
        if not rec.owe:
            return
        if rec.peer is not None and rec.ending is not ReleaseOutcome.PEER_LOST:
            for e in sorted(rec.owe):
                self._out.append(Send(rec.peer, Settled(rec.transfer_id, e)))
        rec.owe.clear()

    def _release(self, now: float, rec: _Transfer, inp: PInput) -> None:
        if inp is PInput.SETTLED_FAILED:
            outcome = rec.ending or ReleaseOutcome.FAILED
        elif inp in (PInput.SETTLED_DELIVERED, PInput.READ_DONE):
            outcome = rec.ending or ReleaseOutcome.DELIVERED
        elif inp is PInput.QUARANTINE:
            outcome = rec.ending or ReleaseOutcome.EXPIRED
        elif inp is PInput.HOLD_EXPIRED:
            outcome = ReleaseOutcome.EXPIRED
        else:
            outcome = ReleaseOutcome.ABORTED
        if inp is PInput.SETTLED_FAILED and rec.reg is not None:
            rec.owe.add(rec.reg.epoch)
        self._send_owed(rec)
        if rec.pending is not None:
            self._reject(rec, rec.pending, RejectReason.RELEASED)
        if outcome is ReleaseOutcome.DELIVERED and rec.reg is not None:
            rec.delivered_epoch = rec.reg.epoch
        rec.reg = rec.pending = None
        rec.expires_at = now + self.config.tombstone_ttl
        if rec.src is not None and not rec.released:
            rec.released = True
            self._held_blocks -= sum(map(len, rec.src))
            rec.timeline.released = now
            self._out.append(
                SourceReleased(rec.transfer_id, rec.src, outcome, rec.timeline.freeze())
            )

    def _arm_for(self, now: float, rec: _Transfer, old: PState) -> None:
        kind = _TIMERS.get(rec.state)
        if kind is None:
            rec.timers.clear()
            return
        if kind is Timer.EXPIRE:
            if rec.state is PState.IDLE and old is not PState.IDLE:
                rec.expires_at = now + self.config.tombstone_ttl
            when = rec.expires_at
        elif kind is Timer.LEASE:
            assert rec.reg is not None
            when = rec.reg.lease_until
        elif kind is Timer.HOLD:
            when = rec.hold_until
        elif kind is Timer.OP:
            when = rec.op_deadline
        else:
            when = rec.quarantine_at
        if len(rec.timers) == 1 and rec.timers.get(kind) == when:
            return  # its heap entry is still queued and valid
        rec.timers.clear()
        self._arm(rec.timers, kind, when, rec.transfer_id)
