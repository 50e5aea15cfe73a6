"""The prefill-side endpoint: the two-event rendezvous, epochs, held source KV.

One :class:`Producer` serves one prefill instance (all its TP x PP ranks); each
transfer is one record (``_transfer.Transfer``) moving through ``PRODUCER``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence

from ._config import ProducerConfig
from ._endpoint import Endpoint, Timer
from ._errors import LocalProtocolError
from ._layout import KVLayout
from ._machine import Machine
from ._messages import (
    Abort,
    Announce,
    Completion,
    ControlMessage,
    Extend,
    ReadDone,
    Register,
    Rejected,
    Renew,
    Settled,
    Withdraw,
    WriteFailed,
)
from ._outputs import ReleaseOutcome, Send, SourceReleased, StartWrite
from ._tables import PRODUCER, PInput, PState
from ._timeline import OpStamps, Timeline, TimelineBuilder
from ._transfer import Reg, Transfer, Writes, seen
from ._types import (
    BlockIds,
    FailureReason,
    Mode,
    Pair,
    RejectReason,
    Role,
    Source,
    check_blocks,
    clip_detail,
)

__all__ = ("Producer",)


#: Why the KV is released, by the input that releases it (other inputs are
#: aborts), unless the transfer ended for a reason of its own (``ending``).
_OUTCOMES: dict[PInput, ReleaseOutcome] = {
    PInput.SETTLED_DELIVERED: ReleaseOutcome.DELIVERED,
    PInput.SETTLED_ACKED: ReleaseOutcome.DELIVERED,
    PInput.READ_DONE: ReleaseOutcome.DELIVERED,
    PInput.SETTLED_FAILED: ReleaseOutcome.FAILED,
    PInput.QUARANTINE: ReleaseOutcome.EXPIRED,
    PInput.HOLD_EXPIRED: ReleaseOutcome.EXPIRED,
    PInput.PEER_GONE: ReleaseOutcome.DELIVERED,
}


#: The states in which a live registration's lease decides whether writes
#: may still start (so it is renewed and extended).
_LEASED = frozenset((PState.WAIT_KV, PState.STREAMING, PState.WAIT_REST))


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
        self._tx: dict[str, Transfer] = {}
        #: The instance of each consumer's last handshake.
        self._instances: dict[str, int] = {}
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

    def kv_ready(
        self,
        now: float,
        transfer_id: str,
        blocks: Sequence[Sequence[int]],
        *,
        final: bool = True,
    ) -> None:
        """The KV of ``transfer_id`` is computed in ``blocks`` (ids per KV group);
        hold them until a registration takes them or the hold expires.

        ``final=False``: an *increment* (progressive push): the whole blocks so
        far, extending those of the call before. A push epoch writes each as it
        comes, with the completion notices on the last; a pull epoch is lent
        only the whole source. Until the last no hold timer runs and no
        ``SourceReleased`` comes (the request owns its blocks)."""
        ids = check_blocks(blocks, self.identity.kv_groups)
        rec = self._get(now, transfer_id)
        if not self._grow_source(rec, ids, final):
            return
        if final:
            rec.timeline.kv_ready = now
        inp = PInput.KV_READY if final else PInput.KV_MORE
        reg = rec.reg
        if rec.state is PState.WRITING:
            self._lease_over(now, rec)
        if rec.state in _LEASED:
            assert reg is not None
            if now > reg.lease_until:
                self._step(now, rec, PInput.LEASE_EXPIRED)
            elif rec.state is not PState.STREAMING and (reg.mode is Mode.PUSH or final):
                self._rendezvous(now, rec)  # the second of the two events
                return
        self._step(now, rec, inp)

    def _grow_source(self, rec: Transfer, ids: BlockIds, final: bool) -> bool:
        """Take ``ids`` as the source (or its next increment); False: a duplicate."""
        old, tid = rec.src, rec.transfer_id
        if old is not None and not rec.partial:
            if old != ids or not final:
                what = "other blocks" if old != ids else "an increment after the last"
                raise LocalProtocolError(f"kv_ready for {tid!r} with {what}")
            self._counters["kv_ready_duplicate"] += 1
            return False
        if old is not None:
            if any(len(n) < len(o) or n[: len(o)] != o for o, n in zip(old, ids, strict=True)):
                raise LocalProtocolError(
                    f"kv_ready for {tid!r}: an increment must extend the blocks before it"
                )
            if old == ids and not final:
                self._counters["kv_increment_duplicate"] += 1
                return False
        self._held_blocks += sum(map(len, ids)) - (0 if old is None else sum(map(len, old)))
        rec.src, rec.partial = ids, not final
        return True

    def abort(self, now: float, transfer_id: str) -> bool:
        """Abort ``transfer_id`` (the prefill request is gone). The source blocks
        come back with :class:`SourceReleased` once no write reads them. Harmless
        on an unknown transfer (a tombstone then refuses its registration).
        Returns whether the transfer was known."""
        known = transfer_id in self._tx
        rec = self._get(now, transfer_id)
        partial, rec.partial = rec.partial, False  # the source ends where it is
        if partial and rec.state is PState.RELEASED:
            self._step(now, rec, PInput.KV_READY)  # released already: give it back now
        else:
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
        ``stamps``: when the data plane planned, posted and saw it finish."""
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
            rec = self._tx.get(tid)
            if rec is not None and (
                self._known(rec, message.epoch)
                or (message.epoch, message.attempt) <= (rec.max_epoch, rec.max_attempt)
            ):
                # A copy of a registration we took (its writes may be in
                # flight) or answered: a Rejected would free blocks a write
                # may still land in.
                self._counters["register_copy_from_unready_peer"] += 1
                return
            self._refuse(peer, message, RejectReason.UNKNOWN_PEER)
            # The consumer releases those blocks on this answer, so no copy of
            # this registration (duplicated, or delayed past a redone
            # handshake) may be served: remember its epoch, as for an unknown
            # Withdraw (the record expires after tombstone_ttl > max_transit).
            if rec is None:
                rec = self._get(now, tid)
                rec.peer = peer
            if rec.peer == peer:
                seen(rec, message.epoch)

    def _on_message(self, now: float, peer: str, message: ControlMessage) -> None:
        if isinstance(message, Register):
            self._on_register(now, peer, message)
            return
        if not isinstance(message, (Withdraw, Abort, ReadDone, Renew, Extend)):
            self._counters[f"unexpected_{type(message).__name__}"] += 1
            return
        rec = self._tx.get(message.transfer_id)
        if rec is not None and rec.peer is not None and rec.peer != peer:
            self._counters["message_from_wrong_peer"] += 1
        elif isinstance(message, Renew):
            self._on_keep(now, rec)
        elif isinstance(message, Extend):
            self._on_extend(now, rec, message)
        elif isinstance(message, ReadDone):
            self._on_read_done(now, rec, message)
        else:
            self._on_end_of_epoch(now, peer, message)

    def _on_read_done(self, now: float, rec: Transfer | None, message: ReadDone) -> None:
        if rec is not None and rec.state is PState.WRITING and message.ok:
            # The ack overtook our transport's report of the writes.
            self._counters["acked_early"] += 1
            rec.acked_epoch = max(rec.acked_epoch, message.epoch)
            return
        if rec is not None and rec.state is PState.DELIVERED:
            # Push: the consumer acknowledges its Ready (of this epoch or a later one).
            if message.epoch < rec.delivered_epoch:
                self._counters["ack_stale"] += 1
                return
            self._counters["acked"] += 1
            self._step(now, rec, PInput.READ_DONE, remote=True)
            return
        lent = rec.reg if rec is not None and rec.state is PState.LENT else None
        if rec is None or lent is None or lent.epoch != message.epoch:
            self._counters["read_done_stale"] += 1
            return
        if not message.ok and rec.ending is None:
            rec.ending = ReleaseOutcome.FAILED
        self._step(now, rec, PInput.READ_DONE, remote=True)

    def _on_keep(self, now: float, rec: Transfer | None) -> None:
        if rec is None or rec.state is not PState.HOLDING:
            self._counters["keep_ignored"] += 1
            return
        assert rec.timeline.kv_ready is not None
        limit = rec.timeline.kv_ready + self.config.hold_limit
        until = min(now + self.config.kv_hold_timeout, limit)
        if until <= rec.hold_until:
            self._counters["keep_at_limit" if until >= limit else "keep_not_needed"] += 1
            return
        self._counters["kept"] += 1
        rec.hold_until = until
        self._step(now, rec, PInput.KEEP, remote=True)

    def _on_extend(self, now: float, rec: Transfer | None, message: Extend) -> None:
        waits = rec is not None and (
            rec.state in _LEASED or (rec.partial and rec.state is PState.WRITING)
        )
        reg = rec.reg if rec is not None and waits else None
        if (
            rec is None
            or reg is None
            or (reg.epoch, reg.attempt) != (message.epoch, message.attempt)
            or message.lease <= 0
        ):
            self._counters["extend_stale"] += 1
            return
        until = now + message.lease
        if until <= reg.lease_until:
            self._counters["extend_not_longer"] += 1
            return
        self._counters["extended"] += 1
        rec.reg = dataclasses.replace(reg, lease_until=until)
        rec.renew_at = self._renew_time(now, until)
        self._step(now, rec, PInput.EXTEND, remote=True)

    def _on_end_of_epoch(self, now: float, peer: str, message: Withdraw | Abort) -> None:
        rec = self._get(now, message.transfer_id)
        rec.peer = rec.peer or peer
        epoch = message.epoch
        # An Abort of an epoch older than the newest registration seen ends only
        # that epoch (the consumer gave up on it, then reserved again): treat it
        # as a Withdraw, never as the end of the newer epoch it overtook.
        whole = isinstance(message, Abort) and epoch >= rec.max_epoch
        if isinstance(message, Abort) and not whole:
            self._counters["abort_of_older_epoch"] += 1
        seen(rec, epoch)
        if whole:
            self._on_peer_abort(now, rec, epoch)
        else:
            self._on_withdraw(now, peer, rec, epoch)

    def _on_peer_abort(self, now: float, rec: Transfer, epoch: int) -> None:
        if rec.state is not PState.DRAINING or rec.ending is None:
            rec.ending = ReleaseOutcome.ABORTED
        rec.owe.add(epoch)
        # Pull: an Abort of a newer epoch than the lent one (the consumer
        # preempted while reading, reserved again, then gave up) ends the
        # transfer, but the lent epoch's reads may still run: the KV stays
        # lent until they settle (its ReadDone, Withdraw or Abort) or its
        # quarantine passes.
        lent = rec.reg if rec.state is PState.LENT else None
        newer = lent is not None and lent.epoch != epoch
        if newer and rec.pending is not None and rec.pending.epoch == epoch:
            rec.pending = None  # the consumer ended it: no Rejected owed
        self._step(now, rec, PInput.PEER_ABORT_NEWER if newer else PInput.PEER_ABORT, remote=True)

    def _on_withdraw(self, now: float, peer: str, rec: Transfer, epoch: int) -> None:
        reg, pending = rec.reg, rec.pending
        if pending is not None and pending.epoch == epoch:
            rec.pending = None
            self._out.append(Send(peer, Settled(rec.transfer_id, epoch)))
        elif reg is not None and reg.epoch == epoch and rec.writes is not Writes.WITHDRAWN:
            # Lent, with the transfer already over: the end of that epoch's
            # reads is all we waited for.
            over = rec.state is PState.LENT and rec.ending is not None
            if rec.state is PState.WRITING:  # answered once its writes settle
                rec.writes = Writes.WITHDRAWN
            elif rec.state in (PState.STREAMING, PState.WAIT_REST):  # nothing in flight
                rec.owe.add(epoch)
            self._step(now, rec, PInput.READ_DONE if over else PInput.WITHDRAW, remote=True)
        elif self._in_flight(rec, epoch):
            self._counters["withdraw_duplicate"] += 1
        else:
            # Nothing of that epoch runs or ever will: say so at once.
            self._out.append(Send(peer, Settled(rec.transfer_id, epoch)))

    def _on_register(self, now: float, peer: str, msg: Register) -> None:
        hello = self._peers[peer].hello
        assert hello is not None
        if (
            msg.consumer != peer
            or len(msg.blocks) != hello.kv_groups
            or msg.lease <= 0
            or not _inside(msg.blocks, hello.layout)
        ):
            # A registration says where to write in remote memory: it may only
            # name blocks inside the regions its sender declared at handshake.
            self._counters["register_invalid"] += 1
            self._refuse(peer, msg, RejectReason.INVALID)
            return
        rec = self._get(now, msg.transfer_id)
        if rec.peer is not None and rec.peer != peer:
            self._counters["register_peer_mismatch"] += 1
            self._refuse(peer, msg, RejectReason.PEER_MISMATCH)
        elif self._known(rec, msg.epoch):
            # A duplicate, also of an epoch already delivered and released: a
            # Rejected would wrongly fail a transfer whose data already landed.
            self._counters["register_duplicate"] += 1
        elif (reason := self._refusal(rec, msg)) is not None:
            self._refuse(peer, msg, reason)
        else:
            self._accept(now, rec, peer, msg)

    def _known(self, rec: Transfer, epoch: int) -> bool:
        reg, pending = rec.reg, rec.pending
        return (
            (reg is not None and reg.epoch == epoch)
            or (pending is not None and pending.epoch == epoch)
            or epoch == rec.delivered_epoch
        )

    def _refusal(self, rec: Transfer, msg: Register) -> RejectReason | None:
        if msg.mode not in self.identity.modes:
            self._counters["register_invalid"] += 1
            return RejectReason.INVALID
        if rec.state in (PState.RELEASED, PState.DRAINING):
            self._counters["register_after_release"] += 1
            return RejectReason.RELEASED
        if (msg.epoch, msg.attempt) <= (rec.max_epoch, rec.max_attempt):
            self._counters["register_stale"] += 1
            return RejectReason.SUPERSEDED
        return None

    def _dropped_after_stall(
        self, now: float, peer: str, message: Register | Announce | Extend
    ) -> None:
        # An epoch this producer never took is refused, with the promise of
        # any Rejected: nothing is or will be written for it. So the record
        # keeps the epoch as seen, and a late copy of the same frame is
        # refused as stale, never taken. One it took (a duplicate) or that a
        # newer one superseded gets nothing.
        if not isinstance(message, Register):
            return
        known = self._tx.get(message.transfer_id)
        if known is not None and known.peer not in (None, peer):
            return  # another consumer's transfer: not this sender's to advance
        newest = (message.epoch, message.attempt)
        if known is None or newest > (known.max_epoch, known.max_attempt):
            rec = self._get(now, message.transfer_id)
            rec.peer = rec.peer or peer
            rec.max_epoch, rec.max_attempt = newest
            self._refuse(peer, message, RejectReason.STALLED)

    def _refuse(self, peer: str, msg: Register, reason: RejectReason) -> None:
        self._out.append(Send(peer, Rejected(msg.transfer_id, msg.epoch, reason, msg.attempt)))

    def _accept(self, now: float, rec: Transfer, peer: str, msg: Register) -> None:
        rec.peer = peer
        rec.max_epoch, rec.max_attempt = msg.epoch, msg.attempt
        rec.timeline.registration_received = now
        reg = Reg(
            msg.epoch,
            peer,
            msg.blocks,
            now + msg.lease,
            msg.mode,
            msg.skip_tokens,
            msg.attempt,
            msg.stage if msg.mode is Mode.PUSH else (),
        )
        if rec.state in (PState.WRITING, PState.LENT):  # it waits for the live epoch
            if rec.pending is not None:
                self._reject(rec, rec.pending, RejectReason.SUPERSEDED)
            rec.pending = reg
            if rec.state is PState.WRITING:  # the consumer moved on from the live epoch
                rec.writes = Writes.WITHDRAWN
            self._step(now, rec, PInput.REGISTER, remote=True)
            return
        if rec.state is PState.STREAMING:  # nothing of the older epoch is in flight
            self._owe_live(now, rec, PInput.REGISTER)
            self._send_owed(rec)
        elif rec.reg is not None:  # WAIT_KV / WAIT_REST with an older epoch
            self._reject(rec, rec.reg, RejectReason.SUPERSEDED)
        rec.reg = reg
        rec.renew_at = self._renew_time(now, reg.lease_until)
        if rec.state in (PState.HOLDING, PState.DELIVERED, PState.STREAMING):
            rec.ending = None  # a newer epoch: how it ends is its own
            self._rendezvous(now, rec)
        elif rec.state is PState.WAIT_REST and reg.mode is Mode.PUSH:
            self._rendezvous(now, rec)  # the partial source is written at once
        else:
            self._step(now, rec, PInput.REGISTER, remote=True)

    def _on_peer_ready(self, now: float, peer: str) -> None:
        hello = self._peers[peer].hello
        assert hello is not None
        old = self._instances.get(peer)
        self._instances[peer] = hello.instance
        if old is not None and old != hello.instance:
            # Another instance of the consumer: the old process, which alone
            # could re-register for what it was delivered, is gone.
            self._gone(now, peer)

    def _gone(self, now: float, peer: str) -> int:
        """The KV delivered to ``peer``, held for a re-registration that can
        no longer come, is released now instead of at the end of its hold."""
        gone = [r for r in self._tx.values() if r.peer == peer and r.state is PState.DELIVERED]
        for rec in gone:
            self._counters["delivered_released_peer_gone"] += 1
            self._step(now, rec, PInput.PEER_GONE, remote=True)
        return len(gone)

    def _on_peer_down(self, now: float, peer: str, reason: FailureReason, detail: str) -> None:
        for rec in list(self._tx.values()):
            if rec.peer == peer:
                if rec.state in (PState.WRITING, PState.LENT) and rec.ending is None:
                    rec.ending = ReleaseOutcome.PEER_LOST
                self._step(now, rec, PInput.PEER_DOWN, remote=True)

    # --- timers ---------------------------------------------------------------------

    def _machine(self, rec: Transfer) -> Machine[PState, PInput]:
        return PRODUCER

    def _key(self, rec: Transfer) -> str:
        return rec.transfer_id

    def _record(self, key: Hashable) -> Transfer | None:
        return self._tx.get(key)  # type: ignore[call-overload, no-any-return]

    def _timer_input(self, now: float, kind: Hashable, rec: Transfer) -> PInput:
        reg = rec.reg
        if kind is Timer.LEASE and reg is not None and now < reg.lease_until:
            return PInput.RENEW  # still computing, the lease half gone
        return PRODUCER.fires[kind]

    def _fire_overdue(self, now: float, rec: Transfer) -> None:
        assert rec.reg is not None
        self._cancel_overdue(now, rec, rec.inflight, rec.reg.epoch, rec.reg.peer, "write")

    def _renew(self, now: float, rec: Transfer, inp: PInput) -> None:
        reg = rec.reg
        assert reg is not None
        self._counters["renew_sent"] += 1
        rec.timeline.renewed.append(now)
        self._out.append(Send(reg.peer, Renew(rec.transfer_id, reg.epoch)))
        rec.renew_at = self._renew_time(now, reg.lease_until)

    def _lease_late(self, now: float, rec: Transfer, inp: PInput) -> None:
        """The renewal timer fired late, past the lease."""
        rec.renew_at = math.inf
        self._lease_over(now, rec)

    def _lease_over(self, now: float, rec: Transfer) -> None:
        """WRITING: no increment may start past the lease; an epoch with one
        still to post ends once its writes settle (as if withdrawn)."""
        reg = rec.reg
        if reg is None or now <= reg.lease_until or rec.writes is not Writes.DELIVERING:
            return
        view = self._peers[reg.peer]
        assert view.topology is not None
        if len(rec.committed) < len(view.topology.routes):
            self._counters["lease_over_mid_stream"] += 1
            rec.writes = Writes.WITHDRAWN

    def _renew_time(self, now: float, until: float) -> float:
        """Halfway to ``until``, unless too little is left for a renewal to
        come back (a round trip takes up to twice ``max_transit``)."""
        half = (until - now) / 2
        return now + half if half > 2 * self.config.timing.max_transit else math.inf

    def _get(self, now: float, transfer_id: str) -> Transfer:
        rec = self._tx.get(transfer_id)
        if rec is None:
            rec = Transfer(transfer_id, TimelineBuilder(transfer_id))
            rec.expires_at = now + self.config.tombstone_ttl
            self._tx[transfer_id] = rec
            self._arm(rec.timers, Timer.EXPIRE, rec.expires_at, transfer_id)
        return rec

    def _in_flight(self, rec: Transfer, epoch: int) -> bool:
        return bool(rec.inflight) and rec.reg is not None and rec.reg.epoch == epoch

    def _reject(self, rec: Transfer, reg: Reg, reason: RejectReason) -> None:
        self._out.append(Send(reg.peer, Rejected(rec.transfer_id, reg.epoch, reason, reg.attempt)))

    def _rendezvous(self, now: float, rec: Transfer) -> None:
        assert rec.reg is not None
        if rec.reg.mode is Mode.PUSH:
            self._step(now, rec, PInput.RENDEZVOUS_PUSH)
        elif rec.partial:  # only a whole source is lent: wait for the rest
            self._step(now, rec, PInput.REGISTER)
        else:
            self._step(now, rec, PInput.RENDEZVOUS_PULL)

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
        del rec.inflight[pair]
        self._arm_ops(rec, rec.inflight)
        if detail:
            self._failed_write(rec, epoch, pair, detail)
        else:
            rec.timeline.write_done[pair] = now
            if stamps is not None:
                rec.timeline.ops[pair] = stamps
            if rec.state is PState.WRITING:
                self._lease_over(now, rec)
            if rec.state is PState.WRITING and self._next_increment(rec, pair):
                self._step(now, rec, PInput.WRITE_NEXT)
                return
        if rec.inflight:  # not the last: no side effects, the table keeps the state
            self._step(now, rec, PInput.WRITE_SETTLED)
            return
        settled = self._settled(now, rec)
        rec.writes = Writes.DELIVERING  # none in flight
        self._step(now, rec, settled)

    def _next_increment(self, rec: Transfer, pair: Pair) -> bool:
        """Whether ``pair`` (none of its writes in flight) has an increment to
        post: blocks computed since its last write, or the commit."""
        if rec.writes is not Writes.DELIVERING or pair in rec.committed or rec.src is None:
            return False
        return not rec.partial or rec.sent.get(pair) != tuple(map(len, rec.src))

    def _failed_write(self, rec: Transfer, epoch: int, pair: Pair, detail: str) -> None:
        if rec.writes is Writes.DELIVERING:
            rec.writes = Writes.FAILING
        if rec.ending is not ReleaseOutcome.PEER_LOST:
            assert rec.reg is not None
            failed = WriteFailed(rec.transfer_id, epoch, pair[0], pair[1], detail)
            self._out.append(Send(rec.reg.peer, failed))

    def _settled(self, now: float, rec: Transfer) -> PInput:
        if rec.state is PState.DRAINING or rec.writes is not Writes.WITHDRAWN:
            if rec.writes is Writes.FAILING:
                return PInput.SETTLED_FAILED
            if rec.state is PState.WRITING and rec.partial:
                return PInput.SETTLED_PARTIAL  # every increment so far written
            assert rec.reg is not None
            acked = rec.state is PState.WRITING and rec.acked_epoch >= rec.reg.epoch
            return PInput.SETTLED_ACKED if acked else PInput.SETTLED_DELIVERED
        pending = rec.pending
        if pending is None:
            return PInput.SETTLED_IDLE
        if now > pending.lease_until:
            self._reject(rec, pending, RejectReason.LEASE_EXPIRED)
            rec.pending = None
            return PInput.SETTLED_IDLE
        # A pull epoch is lent from HOLDING, never written.
        return PInput.SETTLED_NEXT if pending.mode is Mode.PUSH else PInput.SETTLED_IDLE

    # --- effects, named by the rows of PRODUCER -------------------------------------

    def _next_epoch(self, now: float, rec: Transfer, inp: PInput) -> None:
        rec.reg, rec.pending = rec.pending, None
        assert rec.reg is not None
        rec.renew_at = self._renew_time(now, rec.reg.lease_until)

    def _new_epoch(self, now: float, rec: Transfer, inp: PInput) -> None:
        assert rec.reg is not None
        self._epoch_over(rec)
        rec.timeline.epoch = rec.reg.epoch
        rec.timeline.write_started = now

    def _write(self, now: float, rec: Transfer, inp: PInput) -> None:
        """Post each pair's next increment: what was computed since its last
        write (each write that settles, and each increment of the source,
        posts more). The last increment carries the completion notice."""
        reg, src = rec.reg, rec.src
        assert reg is not None and src is not None
        view = self._peers[reg.peer]
        assert view.topology is not None
        tid, epoch = rec.transfer_id, reg.epoch
        size = tuple(map(len, src))
        for route in view.topology.routes:
            pair = (route.source, route.consumer_rank)
            if pair in rec.inflight or not self._next_increment(rec, pair):
                continue
            first = rec.sent.get(pair, ())
            rec.sent[pair] = size
            notice = None
            if not rec.partial:
                notice = Completion(tid, epoch, route.source, route.consumer_rank)
                rec.committed.add(pair)
            rec.inflight[pair] = now + self.config.timing.op_bound
            self._out.append(
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
                    first,
                    reg.stage,
                )
            )
        self._arm_ops(rec, rec.inflight)

    def _epoch_over(self, rec: Transfer) -> None:
        rec.sent.clear()
        rec.committed.clear()

    def _delivered(self, now: float, rec: Transfer, inp: PInput) -> None:
        assert rec.reg is not None
        self._epoch_over(rec)
        rec.delivered_epoch = rec.reg.epoch
        rec.ending = ReleaseOutcome.DELIVERED
        self._send_owed(rec)
        rec.reg = None
        rec.hold_until = now + self.config.kv_hold_timeout

    def _lend(self, now: float, rec: Transfer, inp: PInput) -> None:
        reg, src = rec.reg, rec.src
        assert reg is not None and src is not None
        hello = self._peers[reg.peer].hello
        assert hello is not None
        rec.quarantine_at = reg.lease_until + self.config.timing.max_transit + hello.op_bound
        rec.timeline.write_started = now
        lease = reg.lease_until - now
        self._out.append(Send(reg.peer, Announce(rec.transfer_id, reg.epoch, src, lease)))

    def _tell_owed(self, now: float, rec: Transfer, inp: PInput) -> None:
        self._send_owed(rec)

    def _owe_live(self, now: float, rec: Transfer, inp: PInput) -> None:
        """The live epoch is owed a ``Settled`` (its writes settled, or the
        consumer aborted it)."""
        if rec.reg is not None:
            rec.owe.add(rec.reg.epoch)

    def _reject_lease(self, now: float, rec: Transfer, inp: PInput) -> None:
        assert rec.reg is not None
        self._reject(rec, rec.reg, RejectReason.LEASE_EXPIRED)

    def _settle_waiting(self, now: float, rec: Transfer, inp: PInput) -> None:
        assert rec.reg is not None
        self._out.append(Send(rec.reg.peer, Settled(rec.transfer_id, rec.reg.epoch)))

    def _hold(self, now: float, rec: Transfer, inp: PInput) -> None:
        """The live epoch (if any) is over; a waiting one starts now. A partial
        source is held without a timer (its prefill still runs)."""
        self._epoch_over(rec)
        rec.reg = None
        rec.hold_until = math.inf if rec.partial else now + self.config.kv_hold_timeout
        pending = rec.pending
        if pending is None:
            return
        rec.pending = None
        if now > pending.lease_until:  # it waited too long: never start it
            self._reject(rec, pending, RejectReason.LEASE_EXPIRED)
        else:
            rec.reg = pending
            rec.renew_at = self._renew_time(now, pending.lease_until)
            self._rendezvous(now, rec)

    def _unwait(self, now: float, rec: Transfer, inp: PInput) -> None:
        rec.reg = None
        rec.expires_at = now + self.config.tombstone_ttl

    def _release(self, now: float, rec: Transfer, inp: PInput) -> None:
        outcome = rec.ending or _OUTCOMES.get(inp, ReleaseOutcome.ABORTED)
        reg = rec.reg
        self._send_owed(rec)
        if rec.pending is not None:
            self._reject(rec, rec.pending, RejectReason.RELEASED)
        if outcome is ReleaseOutcome.DELIVERED and reg is not None:
            rec.delivered_epoch = reg.epoch
        self._epoch_over(rec)
        rec.reg = rec.pending = None
        # A partial source is given back at its last increment (or abort):
        # its request still computes in those blocks.
        rec.expires_at = math.inf if rec.partial else now + self.config.tombstone_ttl
        if rec.partial:
            rec.ending = outcome  # what SourceReleased will say
        if rec.src is not None and not rec.partial:
            self._held_blocks -= sum(map(len, rec.src))
            rec.timeline.released = now
            self._out.append(
                SourceReleased(rec.transfer_id, rec.src, outcome, rec.timeline.freeze())
            )

    def _forget(self, now: float, rec: Transfer, inp: PInput) -> None:
        del self._tx[rec.transfer_id]

    def _abort(self, now: float, rec: Transfer, inp: PInput) -> None:
        """A local abort: tell the consumer of its live epoch (or of the
        newest epoch it named), if one is known."""
        if rec.peer is not None:
            epoch = rec.max_epoch if rec.reg is None else rec.reg.epoch
            self._out.append(Send(rec.peer, Abort(rec.transfer_id, epoch)))
            rec.owe.add(epoch)
        self._abort_quietly(now, rec, inp)

    def _abort_quietly(self, now: float, rec: Transfer, inp: PInput) -> None:
        """A local abort the consumer is not told of: it was told already
        (DRAINING, RELEASED), or it has its Ready (DELIVERED), and an Abort
        would fail KV it may not have polled yet."""
        rec.ending = rec.ending or ReleaseOutcome.ABORTED
        self._drop_pending(now, rec, inp)

    def _drop_pending(self, now: float, rec: Transfer, inp: PInput) -> None:
        if rec.pending is not None:
            self._reject(rec, rec.pending, RejectReason.RELEASED)
            rec.pending = None

    def _send_owed(self, rec: Transfer) -> None:
        """No write of an owed epoch can land any more: tell the consumer,
        who may be draining those blocks."""
        if not rec.owe:
            return
        if rec.peer is not None and rec.ending is not ReleaseOutcome.PEER_LOST:
            for e in sorted(rec.owe):
                self._out.append(Send(rec.peer, Settled(rec.transfer_id, e)))
        rec.owe.clear()
