"""The decode-side endpoint: reservations, registration, per-rank completion.

One :class:`Consumer` serves one decode instance (all its TP ranks); each
reservation, one (transfer, epoch), moves through ``CONSUMER_PUSH`` or ``CONSUMER_PULL``.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ._config import ConsumerConfig
from ._endpoint import Endpoint, PeerView, Timer
from ._errors import LocalProtocolError
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
from ._outputs import Failed, Ready, Released, Send, StartRead
from ._slots import SlotPool
from ._tables import CONSUMER_PULL, CONSUMER_PUSH, CInput, CState, PeerState
from ._timeline import OpStamps, Timeline, TimelineBuilder
from ._topology import Topology
from ._types import (
    BlockIds,
    FailureReason,
    Mode,
    Pair,
    RejectReason,
    Role,
    Source,
    check_blocks,
    check_transfer_id,
)

__all__ = ("Consumer", "RefuseReason", "Refused", "Reserved")


class RefuseReason(enum.Enum):
    """Why :meth:`Consumer.reserve` refused (act on it: retry later, or
    prefill locally)."""

    #: The reservation would exceed ``max_reserved_blocks``.
    BUDGET = "budget"
    #: The handshake with that producer failed; see :meth:`Consumer.peer`.
    PEER_FAILED = "peer_failed"
    #: The producer does not support the requested mode.
    MODE_UNSUPPORTED = "mode_unsupported"
    #: The producer keeps more blocks suspect than ``max_suspect_blocks``: it
    #: is connected but left failed epochs unsettled past their quarantine
    #: (stopped, or stuck). Route elsewhere, or prefill locally.
    PEER_SUSPECT = "peer_suspect"


@dataclass(frozen=True, slots=True)
class Reserved:
    """The reservation was made; ``epoch`` identifies it. ``stage``: its
    staging slot ``(offset, nbytes)`` in every rank's pool, owned like its
    blocks until ``Ready`` or ``Released`` (empty: none)."""

    transfer_id: str
    epoch: int
    stage: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Refused:
    """The reservation was refused; nothing was reserved."""

    transfer_id: str
    reason: RefuseReason


#: Failure reason reported when a reservation fails on an input.
_FAILURE = {
    CInput.PEER_DOWN: FailureReason.PEER_LOST,
    CInput.DEADLINE: FailureReason.TIMEOUT,
    CInput.WRITE_FAILED: FailureReason.TRANSFER_FAILED,
    CInput.PAIRS_SETTLED: FailureReason.TRANSFER_FAILED,
    CInput.SETTLED: FailureReason.TRANSFER_FAILED,
    CInput.REJECTED: FailureReason.REJECTED,
    CInput.PEER_ABORT: FailureReason.PEER_ABORTED,
    CInput.READ_FAILED: FailureReason.TRANSFER_FAILED,
    CInput.READS_SETTLED: FailureReason.TRANSFER_FAILED,
}

#: Registrations of one epoch sent again after ``Rejected(STALLED)``.
STALL_RETRIES = 3

#: A suspect reservation probes its producer (``Withdraw``) on entering
#: ``SUSPECT`` and again after 2, 4, 8, 8, ... ``max_transit`` while its
#: producer is connected: an answer may be lost, and nothing else ends it.
SUSPECT_PROBE_CAP = 8


@dataclass(slots=True, eq=False)
class _Reservation:
    transfer_id: str
    epoch: int
    peer: str
    mode: Mode
    blocks: BlockIds
    nblocks: int
    deadline: float
    timeline: TimelineBuilder
    skip_tokens: int = 0
    #: The staging slot it owns, ``(offset, nbytes)``; empty: none.
    stage: tuple[int, ...] = ()
    state: CState = CState.WAITING_PEER
    topology: Topology | None = None
    #: How many (source, consumer rank) pairs the topology expects (set at registration).
    total: int = 0
    done: set[Pair] = field(default_factory=set)
    settled: set[Pair] = field(default_factory=set)
    quarantine_at: float = 0.0
    failed: bool = False
    #: The producer instance the registration went to, and its op bound.
    instance: int = -1
    op_bound: float = 0.0
    #: Pull: what to tell the producer once our reads settle.
    after_reads: CInput | None = None
    #: This epoch's registration attempt (see ``CState.RETRY_WAIT``), and
    #: when the next one goes out.
    attempt: int = 0
    retry_at: float = 0.0
    #: Probes sent while ``SUSPECT`` (see ``SUSPECT_PROBE_CAP``).
    probes: int = 0
    timers: dict[Timer, float] = field(default_factory=dict)
    #: Pull: the pairs with a read in flight, and when each is overdue (its
    #: ``StartRead`` plus our ``op_bound``; ``inf``: its ``Cancel`` is out),
    #: and their ``OVERDUE`` timer (apart: no state entry clears it).
    reads: dict[Pair, float] = field(default_factory=dict)
    op_timer: dict[Timer, float] = field(default_factory=dict)


class Consumer(Endpoint):
    """Decode-side protocol endpoint (sans-IO).

    Feed it with :meth:`reserve`, :meth:`preempt`, :meth:`abort`,
    :meth:`receive`, :meth:`completion_received`, :meth:`read_done`,
    :meth:`peer_lost` and :meth:`handle_timer`; drain its actions and events
    with :meth:`drain`.
    """

    role = Role.CONSUMER

    def __init__(self, config: ConsumerConfig) -> None:
        super().__init__(config.identity, config.timing)
        self.config = config
        self._res: dict[tuple[str, int], _Reservation] = {}
        self._live: dict[str, _Reservation] = {}
        self._epoch = config.epoch_base
        self._reserved_blocks = 0
        #: Suspect blocks per producer (see ``CState.SUSPECT``).
        self._suspect: dict[str, int] = {}
        #: The detail and reason of the input being applied (see ``_step``).
        self._failure: tuple[str, FailureReason | None] = ("", None)
        self._slots = SlotPool(config.staging_bytes, config.staging_page)

    # --- queries ------------------------------------------------------------

    @property
    def reserved_blocks(self) -> int:
        """Blocks currently reserved, draining reservations included."""
        return self._reserved_blocks

    @property
    def staging_bytes_used(self) -> int:
        """Bytes of the staging pool in slots now (draining reservations too)."""
        return self._slots.used * self._slots.page

    @property
    def suspect_blocks(self) -> int:
        """Blocks held as suspect: failed push epochs whose quarantine passed
        while their producer was connected and had not settled them."""
        return sum(self._suspect.values())

    def suspect_blocks_of(self, peer: str) -> int:
        """Suspect blocks held for producer ``peer``."""
        return self._suspect.get(peer, 0)

    def reservations(self) -> list[tuple[str, int, CState]]:
        """(transfer id, epoch, state) of every reservation not yet ended."""
        return [(r.transfer_id, r.epoch, r.state) for r in self._res.values()]

    def timeline(self, transfer_id: str) -> Timeline | None:
        """The live reservation's timeline for ``transfer_id``, if any."""
        rec = self._live.get(transfer_id)
        return rec.timeline.freeze() if rec else None

    # --- local inputs -------------------------------------------------------------

    def reserve(
        self,
        now: float,
        transfer_id: str,
        peer: str,
        blocks: Sequence[Sequence[int]],
        *,
        mode: Mode = Mode.PUSH,
        deadline: float | None = None,
        skip_tokens: int = 0,
        stage_bytes: int = 0,
    ) -> Reserved | Refused:
        """Reserve ``blocks`` (ids per KV group) for ``transfer_id`` from producer
        ``peer`` and register them once the handshake is done. ``skip_tokens``:
        tokens this side already holds (a prefix hit); ``blocks`` start there.
        ``stage_bytes``: push only, the staging slot to take with them if the
        pool has room (the bytes of ``blocks`` on the largest rank); with none
        free the transfer is written in place.
        Returns :class:`Refused` instead of raising when the caller can act on it."""
        check_transfer_id(transfer_id)
        ids = check_blocks(blocks, self.identity.kv_groups)
        for name, value in (("skip_tokens", skip_tokens), ("stage_bytes", stage_bytes)):
            if type(value) is not int or value < 0:
                raise LocalProtocolError(f"{name} must be an int >= 0, got {value!r}")
        if transfer_id in self._live:
            raise LocalProtocolError(
                f"transfer {transfer_id!r} already has a live reservation; preempt or abort it"
            )
        view = self._peers.get(peer)
        nblocks = sum(map(len, ids))
        reason = self._refusal(peer, view, mode, nblocks)
        if reason is not None:
            return Refused(transfer_id, reason)
        self._epoch += 1
        if deadline is None:
            deadline = now + self.config.ready_timeout
        elif deadline <= now:
            raise LocalProtocolError("deadline must lie in the future")
        rec = _Reservation(
            transfer_id,
            self._epoch,
            peer,
            mode,
            ids,
            nblocks,
            deadline,
            TimelineBuilder(transfer_id, self._epoch, reserved=now),
            skip_tokens=skip_tokens,
        )
        self._take_slot(rec, stage_bytes)
        self._res[(transfer_id, rec.epoch)] = rec
        self._live[transfer_id] = rec
        self._reserved_blocks += nblocks
        self._arm_for(rec)
        if view is not None and view.state is PeerState.READY:
            self._step(now, rec, CInput.PEER_READY)
        elif view is None or view.state is PeerState.DISCONNECTED:
            self.connect(now, peer)
        elif view.state is PeerState.HELLO_SENT and not self._peer_timers.get(peer):
            # Our hello went unanswered through every retry: try again now.
            self._counters["hello_restarted_by_reserve"] += 1
            self.connect(now, peer)
        return Reserved(transfer_id, rec.epoch, rec.stage)

    def _take_slot(self, rec: _Reservation, nbytes: int) -> None:
        if nbytes and rec.mode is Mode.PUSH:
            rec.stage = self._slots.take(nbytes) or ()
            self._counters["staged" if rec.stage else "staging_full"] += 1

    def _refusal(
        self, peer: str, view: PeerView | None, mode: Mode, nblocks: int
    ) -> RefuseReason | None:
        if view is not None and view.state is PeerState.FAILED:
            return RefuseReason.PEER_FAILED
        if self._suspect.get(peer, 0) > self.config.suspect_cap:
            self._counters["refused_suspect"] += 1
            return RefuseReason.PEER_SUSPECT
        if mode not in self.identity.modes or (
            view is not None and view.hello is not None and mode not in view.hello.modes
        ):
            return RefuseReason.MODE_UNSUPPORTED
        budget = self.config.max_reserved_blocks
        if budget is not None and self._reserved_blocks + nblocks > budget:
            self._counters["refused_budget"] += 1
            return RefuseReason.BUDGET
        return None

    def preempt(self, now: float, transfer_id: str) -> bool:
        """Withdraw the live reservation of ``transfer_id`` (the request was
        preempted); a later :meth:`reserve` makes a newer epoch. Its blocks come
        back with :class:`Released` once no write can land. Returns whether there
        was a live reservation."""
        rec = self._live.get(transfer_id)
        if rec is None:
            self._counters["preempt_without_reservation"] += 1
            return False
        self._step(now, rec, CInput.PREEMPT)
        return True

    def keep(self, now: float, transfer_id: str, peer: str) -> bool:
        """Ask producer ``peer`` to keep the ready KV of ``transfer_id`` that
        this side cannot reserve for yet (its hold grows by its
        ``kv_hold_timeout``, up to its ``max_kv_hold_timeout``). Returns
        whether it was sent (the handshake with ``peer`` is done)."""
        check_transfer_id(transfer_id)
        view = self._peers.get(peer)
        if view is None or view.state is not PeerState.READY:
            return False
        self._counters["keep_sent"] += 1
        self._out.append(Send(peer, Renew(transfer_id, 0)))
        return True

    def decline(self, now: float, transfer_id: str, peer: str) -> bool:
        """This side will never reserve for ``transfer_id``: tell producer
        ``peer`` to release the ready KV now, not at the end of its hold. It
        is an ``Abort`` of epoch 0, which no reservation has (so harmless once
        one was made). Returns whether it was sent (the handshake with
        ``peer`` is done and no reservation of ours is live)."""
        check_transfer_id(transfer_id)
        view = self._peers.get(peer)
        if transfer_id in self._live or view is None or view.state is not PeerState.READY:
            self._counters["decline_not_sent"] += 1
            return False
        self._counters["declined"] += 1
        self._out.append(Send(peer, Abort(transfer_id, 0)))
        return True

    def _gone(self, now: float, peer: str) -> int:
        """``peer``'s suspect blocks are released once a fresh quarantine
        passed (our transport may still place a write it had queued)."""
        gone = [r for r in self._res.values() if r.peer == peer and r.state is CState.SUSPECT]
        for rec in gone:
            self._step(now, rec, CInput.PEER_DOWN, remote=True)
        return len(gone)

    def abort(self, now: float, transfer_id: str) -> bool:
        """Abort ``transfer_id``; harmless (returns False) if there is none."""
        rec = self._live.get(transfer_id)
        if rec is None:
            self._counters["abort_without_reservation"] += 1
            return False
        self._step(now, rec, CInput.ABORT)
        return True

    def completion_received(
        self, now: float, peer: str | None, notice: Completion, *, seen: float | None = None
    ) -> None:
        """A data-plane completion notice arrived at consumer rank
        ``notice.consumer_rank`` (its data is visible), sent by the transport
        agent that producer ``peer``'s handshake introduced (``None``: none).

        It counts only for a reservation registered with that same producer:
        another producer's notice (xPyD), MAC and all, is counted
        (``completion_wrong_sender``) and ignored. ``seen``: when the data
        plane polled it (the timeline's ``notice_seen``)."""
        rec = self._res.get((notice.transfer_id, notice.epoch))
        if rec is not None and rec.peer != peer:
            self._counters["completion_wrong_sender"] += 1
            return
        pair = self._push_pair(rec, notice.source, notice.consumer_rank, "completion")
        if rec is None or pair is None:
            return
        rec.done.add(pair)
        rec.timeline.write_done[pair] = now
        if seen is not None:
            rec.timeline.notice_seen[pair] = seen
        if rec.state is CState.AWAITING:
            last, inp = len(rec.done) == rec.total, CInput.COMPLETION_LAST
        else:
            last, inp = len(rec.settled) == rec.total, CInput.PAIRS_SETTLED
        self._step(now, rec, inp if last else CInput.COMPLETION, remote=True)

    def read_done(
        self,
        now: float,
        transfer_id: str,
        epoch: int,
        source: Source,
        consumer_rank: int,
        ok: bool,
        *,
        stamps: OpStamps | None = None,
    ) -> None:
        """Pull: the transport finished (``ok``) or failed one :class:`StartRead`.
        ``stamps``: when the data plane planned, posted and saw it finish."""
        stamps = None if stamps is None else stamps.check()
        rec = self._res.get((transfer_id, epoch))
        pair = self._valid_pair(rec, source, consumer_rank, "read")
        if rec is None or pair is None:
            return
        if rec.reads.pop(pair, None) is not None:
            self._arm_ops(rec, rec.reads)
        if rec.state not in (CState.READING, CState.READ_DRAIN) or pair in rec.settled:
            self._counters["read_result_late"] += 1
            return
        if rec.state is CState.READING and now >= rec.deadline:
            # Past the deadline the producer may have released the source at
            # its quarantine and reused it, so a read finishing now may hold
            # another request's bytes: the deadline comes first.
            self._step(now, rec, CInput.DEADLINE)
        rec.settled.add(pair)
        if ok:
            rec.done.add(pair)
            rec.timeline.write_done[pair] = now
            if stamps is not None:
                rec.timeline.ops[pair] = stamps
        if len(rec.settled) < rec.total:
            inp = CInput.READ_OK if ok else CInput.READ_FAILED
        elif len(rec.done) == rec.total and rec.state is CState.READING:
            inp = CInput.READS_OK
        else:
            inp = CInput.READS_SETTLED
        self._step(now, rec, inp)

    # --- remote inputs --------------------------------------------------------------

    def _on_message(self, now: float, peer: str, message: ControlMessage) -> None:
        if isinstance(message, Abort):
            self._peer_abort(now, peer, message)
            return
        if not isinstance(message, (Settled, Rejected, WriteFailed, Announce, Renew)):
            self._counters[f"unexpected_{type(message).__name__}"] += 1
            return
        if isinstance(message, Rejected) and message.reason is RejectReason.UNKNOWN_PEER:
            # The producer lost our handshake (it saw the connection die, we
            # did not): introduce ourselves again; it answers every hello.
            self._counters["hello_resent_unknown_peer"] += 1
            self._out.append(Send(peer, self._hello))
        rec = self._addressee(peer, message)
        if rec is None:
            return
        if isinstance(message, Settled):
            self._step(now, rec, CInput.SETTLED, remote=True)
        elif isinstance(message, Renew):
            self._renew(now, rec)
        elif isinstance(message, Rejected):
            self._rejected(now, rec, message)
        elif isinstance(message, WriteFailed):
            self._write_failed(now, rec, message)
        elif len(message.blocks) != self.identity.kv_groups or message.lease <= 0:
            self._counters["announce_invalid"] += 1
        else:
            self._announce(now, rec, message)

    def _peer_abort(self, now: float, peer: str, message: Abort) -> None:
        rec = self._live.get(message.transfer_id)
        if rec is None or rec.peer != peer:
            self._counters["abort_stale"] += 1
            return
        self._step(now, rec, CInput.PEER_ABORT, remote=True)

    def _addressee(
        self, peer: str, message: Settled | Rejected | WriteFailed | Announce | Renew
    ) -> _Reservation | None:
        """The reservation ``message`` from ``peer`` is about, if it may speak for it."""
        rec = self._res.get((message.transfer_id, message.epoch))
        if rec is None or rec.peer != peer:
            self._counters[f"stale_{type(message).__name__}"] += 1
            return None
        hello = self._peers[peer].hello
        if rec.instance >= 0 and (hello is None or hello.instance != rec.instance):
            # From a restarted producer: it speaks for none of the old one's writes.
            self._counters["message_from_other_instance"] += 1
            return None
        return rec

    def _rejected(self, now: float, rec: _Reservation, message: Rejected) -> None:
        if message.attempt != rec.attempt:
            self._counters["rejected_stale_attempt"] += 1  # an earlier attempt's answer
            return
        retry_at = now + self.config.timing.stall_guard
        # The producer's stall rule took nothing: register again once its guard
        # window is over, if the deadline leaves time for it.
        again = (
            message.reason is RejectReason.STALLED
            and rec.attempt < STALL_RETRIES
            and retry_at < rec.deadline
        )
        if again and rec.state is CState.AWAITING:
            rec.retry_at = retry_at
            self._counters["register_retry_after_stall"] += 1
        inp = CInput.STALLED if again else CInput.REJECTED
        self._step(now, rec, inp, remote=True, detail=message.reason.value)

    def _renew(self, now: float, rec: _Reservation) -> None:
        """The producer holds our registration and still computes: move the
        deadline (and with it the quarantine) to ``ready_timeout`` from now,
        within the limit, *then* grant the producer the lease up to it."""
        if not self._step(now, rec, CInput.RENEW, remote=True):
            return
        assert rec.timeline.reserved is not None
        limit = rec.timeline.reserved + self.config.ready_limit
        deadline = min(now + self.config.ready_timeout, limit)
        if deadline > rec.deadline:
            rec.quarantine_at += deadline - rec.deadline
            rec.deadline = deadline
            rec.timeline.renewed.append(now)
            self._counters["renewed"] += 1
            self._arm_for(rec)
        else:
            self._counters["renew_at_limit" if deadline >= limit else "renew_not_needed"] += 1
        # Always answer: an earlier Extend may have been lost or dropped.
        lease = rec.deadline - now
        message = Extend(rec.transfer_id, rec.epoch, rec.attempt, lease)
        self._out.append(Send(rec.peer, message))

    def _probe(self, now: float, rec: _Reservation, inp: CInput | None = None) -> None:
        """Ask the producer of a suspect epoch to settle it (it answers a
        ``Withdraw`` with ``Settled`` once nothing of it is in flight). After
        the first probe our hello goes first: a producer that lost our
        handshake while we did not (we answer no hello while ready) learns
        who we are again; one that knows us answers with a duplicate hello."""
        if rec.probes:
            self._out.append(Send(rec.peer, self._hello))
        rec.probes = min(rec.probes + 1, SUSPECT_PROBE_CAP.bit_length() - 1)
        self._counters["suspect_probe"] += 1
        self._out.append(Send(rec.peer, Withdraw(rec.transfer_id, rec.epoch)))
        rec.retry_at = now + 2**rec.probes * self.config.timing.max_transit

    def _write_failed(self, now: float, rec: _Reservation, message: WriteFailed) -> None:
        if self._push_pair(rec, message.source, message.consumer_rank, "write_failed") is None:
            return
        last = len(rec.settled) == rec.total
        inp = CInput.PAIRS_SETTLED if last else CInput.WRITE_FAILED
        self._step(now, rec, inp, remote=True, detail=message.detail)

    def _announce(self, now: float, rec: _Reservation, message: Announce) -> None:
        not_after = now + message.lease
        if not self._step(now, rec, CInput.ANNOUNCE, remote=True):
            return
        assert rec.topology is not None
        overdue = now + self.config.timing.op_bound
        for route in rec.topology.routes:
            rec.reads[(route.source, route.consumer_rank)] = overdue
            self._out.append(
                StartRead(
                    rec.transfer_id,
                    rec.epoch,
                    rec.peer,
                    route,
                    message.blocks,
                    rec.blocks,
                    not_after,
                    rec.skip_tokens,
                )
            )
        self._arm_ops(rec, rec.reads)

    def _on_peer_ready(self, now: float, peer: str) -> None:
        view = self._peers[peer]
        assert view.hello is not None
        for rec in list(self._res.values()):
            if rec.peer == peer and rec.state is CState.WAITING_PEER:
                # A handshake that finished after the deadline grants no lease.
                late = now >= rec.deadline
                self._step(now, rec, CInput.DEADLINE if late else CInput.PEER_READY)
            elif rec.peer == peer and rec.state is CState.SUSPECT:
                if view.hello.instance != rec.instance:
                    # A new instance: the one that may still write is gone.
                    self._step(now, rec, CInput.PEER_DOWN, remote=True)
                else:  # the same process is back: ask it again
                    rec.probes = 0
                    self._step(now, rec, CInput.RETRY)

    def _on_peer_down(self, now: float, peer: str, reason: FailureReason, detail: str) -> None:
        for rec in list(self._res.values()):
            if rec.peer != peer:
                continue
            if rec.state is CState.SUSPECT:
                # A lost connection proves nothing of a process that was
                # already silent past its quarantine (stopped, or cut off):
                # its queued write may land when it runs again.
                self._counters["suspect_peer_lost"] += 1
                continue
            self._step(now, rec, CInput.PEER_DOWN, remote=True, detail=detail, reason=reason)

    # --- the engine's hooks ---------------------------------------------------------

    def _machine(self, rec: _Reservation) -> Machine[CState, CInput]:
        return CONSUMER_PUSH if rec.mode is Mode.PUSH else CONSUMER_PULL

    def _key(self, rec: _Reservation) -> tuple[str, int]:
        return (rec.transfer_id, rec.epoch)

    def _record(self, key: Hashable) -> _Reservation | None:
        return self._res.get(key)  # type: ignore[call-overload, no-any-return]

    def _timer_input(self, now: float, kind: Hashable, rec: _Reservation) -> CInput:
        if kind is not Timer.QUARANTINE:
            return self._machine(rec).fires[kind]
        view = self._peers.get(rec.peer)
        live = (
            view is not None
            and view.state is PeerState.READY
            and view.hello is not None
            and view.hello.instance == rec.instance
        )
        return CInput.QUARANTINE_LIVE if live else CInput.QUARANTINE

    def _fire_overdue(self, now: float, rec: _Reservation) -> None:
        self._cancel_overdue(now, rec, rec.reads, rec.epoch, rec.peer, "read")

    def _valid_pair(
        self, rec: _Reservation | None, source: Source, rank: int, what: str
    ) -> Pair | None:
        if rec is None:
            self._counters[f"{what}_unknown"] += 1
            return None
        topo = rec.topology
        if topo is None or not 0 <= rank < topo.consumer_tp or source not in topo.sources_for(rank):
            self._counters[f"{what}_unexpected_source"] += 1
            return None
        return (source, rank)

    def _push_pair(
        self, rec: _Reservation | None, source: Source, rank: int, what: str
    ) -> Pair | None:
        """The push pair a notice or failure settles, unless it is stale or settled."""
        pair = self._valid_pair(rec, source, rank, what)
        if rec is None or pair is None:
            return None
        if rec.mode is not Mode.PUSH or pair in rec.settled:
            self._counters[f"{what}_{'duplicate' if rec.mode is Mode.PUSH else 'in_pull'}"] += 1
            return None
        rec.settled.add(pair)
        return pair

    def _step(
        self,
        now: float,
        rec: _Reservation,
        inp: CInput,
        *,
        remote: bool = False,
        detail: str = "",
        reason: FailureReason | None = None,
    ) -> bool:
        """Apply ``inp`` to ``rec``; ``detail`` and ``reason`` go in the
        ``Failed`` its row may emit (``reason`` by default: ``_FAILURE``)."""
        self._failure = (detail, reason)
        return super()._step(now, rec, inp, remote=remote)

    # --- effects, named by the rows of CONSUMER_PUSH and CONSUMER_PULL -----------

    def _fail(self, now: float, rec: _Reservation, inp: CInput) -> None:
        """Tell the caller, once (rows after its own preempt or abort name
        no ``fail``: they merely end the drain)."""
        if rec.failed:
            return
        detail, reason = self._failure
        rec.failed = True
        rec.timeline.failed = now
        self._out.append(Failed(rec.transfer_id, rec.epoch, reason or _FAILURE[inp], detail))

    def _next_attempt(self, now: float, rec: _Reservation, inp: CInput) -> None:
        rec.attempt += 1

    def _register(self, now: float, rec: _Reservation, inp: CInput) -> None:
        view = self._peers[rec.peer]
        assert view.topology is not None and view.hello is not None
        rec.topology = view.topology
        rec.total = view.topology.expected_total
        rec.instance = view.hello.instance
        rec.op_bound = view.hello.op_bound
        lease = rec.deadline - now
        # After this send, a write may start until (receipt + lease) and then
        # stay in flight for the producer's op bound: that is the quarantine.
        rec.quarantine_at = rec.deadline + self.config.timing.max_transit + rec.op_bound
        rec.timeline.registration_sent = now
        engine = self.identity.engine_id
        msg = Register(
            rec.transfer_id,
            rec.epoch,
            engine,
            rec.blocks,
            lease,
            rec.mode,
            rec.skip_tokens,
            rec.attempt,
            rec.stage,
        )
        self._out.append(Send(rec.peer, msg))

    def _send_withdraw(self, now: float, rec: _Reservation, inp: CInput) -> None:
        self._out.append(Send(rec.peer, Withdraw(rec.transfer_id, rec.epoch)))

    def _send_abort(self, now: float, rec: _Reservation, inp: CInput) -> None:
        self._out.append(Send(rec.peer, Abort(rec.transfer_id, rec.epoch)))

    def _send_reads_failed(self, now: float, rec: _Reservation, inp: CInput) -> None:
        self._out.append(Send(rec.peer, ReadDone(rec.transfer_id, rec.epoch, False)))

    def _tell_after_reads(self, now: float, rec: _Reservation, inp: CInput) -> None:
        """Tell the producer what the input that ended the reads
        (``after_reads``) means for it."""
        after = rec.after_reads
        if after is CInput.PREEMPT:
            self._send_withdraw(now, rec, inp)
        elif after in (CInput.ABORT, CInput.DEADLINE):
            self._send_abort(now, rec, inp)
        elif after is not CInput.PEER_DOWN:  # a lost producer hears nothing
            self._send_reads_failed(now, rec, inp)

    def _drain(self, now: float, rec: _Reservation, inp: CInput) -> None:
        if self._live.get(rec.transfer_id) is rec:
            del self._live[rec.transfer_id]

    def _read_drain(self, now: float, rec: _Reservation, inp: CInput) -> None:
        self._drain(now, rec, inp)
        rec.after_reads = inp

    def _requarantine(self, now: float, rec: _Reservation, inp: CInput) -> None:
        rec.quarantine_at = now + self.config.timing.max_transit + rec.op_bound

    def _hold_suspect(self, now: float, rec: _Reservation, inp: CInput) -> None:
        self._count_suspect(rec, rec.nblocks)
        self._counters["suspect"] += 1
        rec.timeline.suspect = now
        rec.probes = 0
        self._probe(now, rec)

    def _drop_suspect(self, now: float, rec: _Reservation, inp: CInput) -> None:
        self._count_suspect(rec, -rec.nblocks)

    def _count_suspect(self, rec: _Reservation, blocks: int) -> None:
        held = self._suspect.get(rec.peer, 0) + blocks
        if held:
            self._suspect[rec.peer] = held
        else:
            del self._suspect[rec.peer]

    def _ready(self, now: float, rec: _Reservation, inp: CInput) -> None:
        """Push: the acknowledgment ends the producer's hold of the KV."""
        tid, epoch = rec.transfer_id, rec.epoch
        self._out.append(Send(rec.peer, ReadDone(tid, epoch, True)))
        rec.timeline.ready = now
        self._end(now, rec, inp)
        self._out.append(Ready(tid, epoch, rec.blocks, rec.timeline.freeze()))

    def _release(self, now: float, rec: _Reservation, inp: CInput) -> None:
        rec.timeline.released = now
        self._end(now, rec, inp)
        self._out.append(Released(rec.transfer_id, rec.epoch, rec.blocks, rec.timeline.freeze()))

    def _end(self, now: float, rec: _Reservation, inp: CInput) -> None:
        rec.timers.clear()
        del self._res[(rec.transfer_id, rec.epoch)]
        self._drain(now, rec, inp)
        self._reserved_blocks -= rec.nblocks
        if rec.stage:
            self._slots.give(rec.stage)
