"""Invariant checks I1-I5 over what two endpoints and a model transport did.

The checker watches every input given to and every output drained from a
producer and a consumer, plus the model transport's landings, and raises
:class:`InvariantViolation` the moment an invariant breaks. docs/testing.md
lists the invariants; docs/protocol.md argues why they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.protocol import (
    Abort,
    Completion,
    Extend,
    Failed,
    Mode,
    Output,
    Ready,
    Register,
    Rejected,
    Released,
    Send,
    Settled,
    SourceReleased,
    StartRead,
    StartWrite,
    Topology,
    Withdraw,
    WriteFailed,
)

__all__ = ("InvariantChecker", "InvariantViolation")

Key = tuple[str, int]
Delivery = tuple[str, int, object, int]  # (transfer, epoch, source, consumer rank)


class InvariantViolation(AssertionError):
    """An invariant of the protocol does not hold."""


@dataclass(slots=True)
class _Res:
    blocks: frozenset[int]
    deadline: float
    quarantine: float
    registered: bool = False
    withdrawn: bool = False  # preempted or aborted by the caller
    ended: str | None = None  # "ready" | "released"
    failed: bool = False
    notices: set[tuple[object, int]] = field(default_factory=set)
    pull: bool = False
    #: The producer promised nothing of this epoch can land (Settled/Rejected).
    promised: bool = False
    write_failed: set[tuple[object, int]] = field(default_factory=set)
    #: The producer instance it was registered with (the consumer's view).
    instance: int | None = None
    #: Pull: a read of it moved bytes from source blocks no longer held.
    tainted: bool = False
    #: Pages of its staging slot (``Reserved.stage``), held until it ends.
    slot: frozenset[int] = frozenset()


@dataclass
class InvariantChecker:
    """Watches one producer/consumer pair. ``topology`` is their route map;
    ``max_transit`` and ``op_bound`` are the timing bounds in force."""

    topology: Topology
    max_transit: float
    op_bound: float
    res: dict[Key, _Res] = field(default_factory=dict)
    #: dst block -> landings since it was last reserved.
    content: dict[int, set[Delivery]] = field(default_factory=dict)
    dst_owner: dict[int, Key] = field(default_factory=dict)
    #: staging page -> the reservation whose slot holds it.
    slot_owner: dict[int, Key] = field(default_factory=dict)
    #: transfer -> source blocks held (kv_ready and not yet released).
    src_held: dict[str, frozenset[int]] = field(default_factory=dict)
    src_released: set[str] = field(default_factory=set)
    leases: dict[Key, float] = field(default_factory=dict)
    producer_withdrawn: set[Key] = field(default_factory=set)
    #: transfer -> the epoch of the Abort that ended it at the producer (a
    #: newer epoch may be served once the producer forgot the transfer).
    producer_aborted: dict[str, int] = field(default_factory=dict)
    #: pair -> the source block indices its increments wrote (I4), and
    #: whether its last increment (the commit, with the notice) was posted.
    writes: dict[Delivery, tuple[frozenset[int], bool]] = field(default_factory=dict)
    readies: set[str] = field(default_factory=set)
    #: Pull reads the consumer started and was not yet told settled, with the
    #: time by which each is dead anyway (``not_after + op_bound``).
    reads: dict[Delivery, float] = field(default_factory=dict)
    #: The consumer's view of its producer: (instance, connected). The world
    #: sets it before routing outputs.
    link: tuple[int | None, bool] = (None, False)

    def fail(self, what: str) -> None:
        raise InvariantViolation(what)

    # --- inputs -----------------------------------------------------------------

    def reserved(
        self,
        now: float,
        tid: str,
        epoch: int,
        blocks: frozenset[int],
        deadline: float,
        slot: frozenset[int] = frozenset(),
    ) -> None:
        if (tid, epoch) in self.res:
            self.fail(f"epoch {epoch} of {tid} reserved twice")
        if any(r.ended is None and r.blocks & blocks for r in self.res.values()):
            self.fail("a block was reserved twice")
        taken = {self.slot_owner[p] for p in slot if p in self.slot_owner}
        if taken:
            self.fail(f"I1: a staging slot page was handed out while {taken} still owns it")
        q = deadline + self.max_transit + self.op_bound
        self.res[(tid, epoch)] = _Res(blocks, deadline, q, slot=slot)
        for b in blocks:
            self.content[b] = set()
            self.dst_owner[b] = (tid, epoch)
        for p in slot:
            self.slot_owner[p] = (tid, epoch)

    def producer_restarted(self) -> None:
        """The producer died and a new instance started: the old one's memory
        and what it had seen are gone (a transfer id may be served afresh)."""
        self.src_held.clear()
        self.src_released.clear()
        self.producer_aborted.clear()
        self.reads.clear()  # they read the old instance's memory, or nothing

    def withdrawn_locally(self, tid: str, epoch: int) -> None:
        self.res[(tid, epoch)].withdrawn = True

    def kv_ready(self, tid: str, blocks: frozenset[int]) -> None:
        """The source of ``tid`` so far (an increment repeats what came before)."""
        if tid not in self.src_released:
            self.src_held[tid] = self.src_held.get(tid, frozenset()) | blocks

    def producer_received(self, now: float, message: object) -> None:
        if isinstance(message, (Register, Extend)):
            key = (message.transfer_id, message.epoch)
            self.leases[key] = max(self.leases.get(key, 0.0), now + message.lease)
        elif isinstance(message, Withdraw):
            self.producer_withdrawn.add((message.transfer_id, message.epoch))
        elif isinstance(message, Abort):
            # An Abort older than the newest registration ends only its epoch.
            newest = max((e for t, e in self.leases if t == message.transfer_id), default=0)
            if message.epoch >= newest:
                tid = message.transfer_id
                self.producer_aborted[tid] = max(self.producer_aborted.get(tid, 0), message.epoch)
            else:
                self.producer_withdrawn.add((message.transfer_id, message.epoch))

    def consumer_received(self, message: object) -> None:
        """A control message reached the consumer."""
        key = (getattr(message, "transfer_id", None), getattr(message, "epoch", None))
        rec = self.res.get(key)  # type: ignore[arg-type]
        if rec is None:
            return
        if isinstance(message, (Settled, Rejected)):
            rec.promised = True
        elif isinstance(message, WriteFailed):
            rec.write_failed.add((message.source, message.consumer_rank))

    def notice_delivered(self, notice: Completion) -> None:
        rec = self.res.get((notice.transfer_id, notice.epoch))
        if rec is not None and rec.ended is None:
            rec.notices.add((notice.source, notice.consumer_rank))

    # --- outputs ----------------------------------------------------------------

    def consumer_output(self, now: float, out: Output) -> None:
        if isinstance(out, Send) and isinstance(out.message, Register):
            rec = self.res[(out.message.transfer_id, out.message.epoch)]
            rec.registered = True
            rec.pull = out.message.mode is Mode.PULL
            rec.instance = self.link[0]
        elif isinstance(out, Send) and isinstance(out.message, Extend):
            self.renewed((out.message.transfer_id, out.message.epoch), now + out.message.lease)
        elif isinstance(out, Ready):
            self._ready(now, out)
        elif isinstance(out, Failed):
            rec = self.res[(out.transfer_id, out.epoch)]
            if rec.ended == "ready":
                self.fail(f"{out.transfer_id}/{out.epoch} failed after it was ready")
            rec.failed = True
        elif isinstance(out, Released):
            self._released(now, out)

    def producer_output(self, now: float, out: Output) -> None:
        if isinstance(out, StartWrite):
            self._start_write(now, out)
        elif isinstance(out, SourceReleased):
            if out.transfer_id in self.src_released:
                self.fail(f"source of {out.transfer_id} released twice")
            held = self.src_held.pop(out.transfer_id, None)
            if held is None or held != _flat(out.blocks):
                self.fail(f"released source blocks of {out.transfer_id} that were not held")
            self.src_released.add(out.transfer_id)
            # I1, proactively (pull): a lent source comes back only once no read
            # of any epoch may still run (catches an early release even when no
            # late read happens to land).
            for (tid, epoch, _, _), dead_at in self.reads.items():
                if tid == out.transfer_id and now < dead_at - 1e-9:
                    self.fail(
                        f"I1: source of {tid} released while a read of epoch {epoch} "
                        "may be in flight"
                    )

    def consumer_read(self, out: StartRead) -> None:
        rec = self.res.get((out.transfer_id, out.epoch))
        if rec is None or rec.ended is not None or _flat(out.dst_blocks) != rec.blocks:
            self.fail(f"read for {out.transfer_id}/{out.epoch} targets blocks it does not own")
        pair = (out.transfer_id, out.epoch, out.route.source, out.route.consumer_rank)
        self.reads[pair] = out.not_after + self.op_bound

    def read_settled(self, op: StartRead) -> None:
        """The consumer is told a read finished or failed (nothing more of it runs)."""
        self.reads.pop((op.transfer_id, op.epoch, op.route.source, op.route.consumer_rank), None)

    def _start_write(self, now: float, out: StartWrite) -> None:
        key = (out.transfer_id, out.epoch)
        pair = (out.transfer_id, out.epoch, out.route.source, out.route.consumer_rank)
        done, committed = self.writes.get(pair, (frozenset(), False))
        span = frozenset(_span(out))
        if committed or span & done:
            self.fail(f"I4: an increment of {pair} written twice (or after the commit)")
        if out.notice is not None and len(done | span) != _count(out.src_blocks):
            self.fail(f"I2: the commit of {pair} leaves blocks of the source unwritten")
        self.writes[pair] = (done | span, out.notice is not None)
        rec = self.res.get(key)
        if rec is None or not rec.registered or _flat(out.dst_blocks) != rec.blocks:
            self.fail(f"I1: write for {key} targets blocks not registered under it")
        aborted = self.producer_aborted.get(out.transfer_id, -1)
        if key in self.producer_withdrawn or out.epoch <= aborted:
            self.fail(f"I1: write for {key} started after the producer saw it withdrawn")
        lease = self.leases.get(key)
        if lease is None or now > out.not_after or out.not_after > lease + 1e-9:
            self.fail(f"I1: write for {key} starts outside its lease")

    def _ready(self, now: float, out: Ready) -> None:
        key = (out.transfer_id, out.epoch)
        rec = self.res[key]
        if rec.ended is not None or out.transfer_id in self.readies:
            self.fail(f"I2: second end for {key}")
        if rec.withdrawn or rec.failed:
            self.fail(f"I2: ready for withdrawn or failed epoch {key}")
        if rec.tainted:
            self.fail(f"I1: ready for {key}, read from source blocks no longer held")
        want = {(r.source, r.consumer_rank) for r in self.topology.routes}
        if rec.notices != want:
            self.fail(f"I2: ready for {key} with completions {rec.notices} != {want}")
        for b in rec.blocks:
            landed = self.content[b]
            if not landed:
                self.fail(f"I2: block {b} of {key} is ready with no data in it")
            if {(t, e) for t, e, _, _ in landed} != {key}:
                self.fail(f"I1: block {b} of {key} holds foreign writes {landed}")
            if {(s, c) for _, _, s, c in landed} != want:
                self.fail(f"I2: block {b} of {key} lacks data from some source")
        rec.ended = "ready"
        self.readies.add(out.transfer_id)
        self._slot_back(key)

    def _released(self, now: float, out: Released) -> None:
        key = (out.transfer_id, out.epoch)
        rec = self.res[key]
        if rec.ended is not None:
            self.fail(f"I3: reservation {key} ended twice")
        if _flat(out.blocks) != rec.blocks:
            self.fail(f"released blocks of {key} differ from the reserved ones")
        # I1, proactively: before its quarantine a registered push epoch may be
        # released only on an explicit promise that nothing of it can land.
        settled = {(r.source, r.consumer_rank) for r in self.topology.routes}
        early = now < rec.quarantine - 1e-9
        all_settled = settled <= rec.notices | rec.write_failed
        unproven = rec.registered and not rec.pull and not rec.promised and not all_settled
        if unproven and early:
            self.fail(f"I1: {key} released before its quarantine without a promise")
        # No timing assumption while the producer is there: a producer that is
        # connected but silent (stopped) may still land a write it posted.
        if unproven and self.link == (rec.instance, True):
            self.fail(f"I1: {key} released on a timer while its producer is connected")
        rec.ended = "released"
        for b in rec.blocks:
            del self.dst_owner[b]
        self._slot_back(key)

    def _slot_back(self, key: Key) -> None:
        """The core gave the reservation's staging slot back (Ready or Released)."""
        for p in self.res[key].slot:
            if self.slot_owner.get(p) == key:
                del self.slot_owner[p]

    # --- the model transport --------------------------------------------------------

    def landed(self, now: float, op: StartWrite | StartRead) -> None:
        """A write (or read) moved bytes into ``op.dst_blocks`` just now."""
        key = (op.transfer_id, op.epoch)
        dst = [b for g in op.dst_blocks for b in g]
        targets = [dst[i] for i in _span(op)] if isinstance(op, StartWrite) else dst
        for b in targets:
            if self.dst_owner.get(b) != key or self.res[key].ended is not None:
                self.fail(f"I1: data of {key} landed in block {b} it does not own")
            self.content[b].add((*key, op.route.source, op.route.consumer_rank))
        if isinstance(op, StartWrite) and op.stage:
            # Staged: the bytes land in the slot first (the scatter into the
            # blocks, checked above, runs before the notice counts).
            for p in range(op.stage[0], op.stage[0] + op.stage[1]):
                if self.slot_owner.get(p) != key or self.res[key].ended is not None:
                    self.fail(f"I1: data of {key} landed in staging page {p} it does not own")
        if isinstance(op, StartRead):
            # A read that landed is its own completion notice.
            self.res[key].notices.add((op.route.source, op.route.consumer_rank))
            held = self.src_held.get(op.transfer_id)
            if held is None or not _flat(op.src_blocks) <= held:
                # The producer's lent quarantine is a timer: a read its stalled
                # reader resumes late may read reused memory. Harmless only
                # if the consumer never makes it Ready: it lands past the
                # deadline, and the consumer steps the deadline first.
                if now < self.res[key].deadline:
                    self.fail(f"pull read of {key} from source blocks no longer held")
                self.res[key].tainted = True

    # --- time and quiescence -----------------------------------------------------------

    def check_time(self, now: float, excused: set[Key] | frozenset[Key] = frozenset()) -> None:
        """I5: by its deadline a reservation is ready or failed (or withdrawn);
        by its quarantine it is released, unless ``excused`` (held as
        suspect, or waiting for an op that may still land).

        The deadline is the reservation's last one: a renewal moves it."""
        for key, rec in self.res.items():
            if rec.ended is not None:
                continue
            if now > rec.deadline and not (rec.failed or rec.withdrawn):
                self.fail(f"I5: {key} neither ready nor failed after its deadline")
            if now > rec.quarantine and key not in excused:
                self.fail(f"I5: {key} not released after its quarantine")

    def requarantine(self, key: Key, now: float) -> None:
        """A suspect ``key`` learnt at ``now`` that its producer is gone: what
        it had queued may still be placed until a fresh quarantine."""
        rec = self.res[key]
        rec.quarantine = max(rec.quarantine, now + self.max_transit + self.op_bound)

    def renewed(self, key: Key, deadline: float) -> None:
        """The consumer moved the deadline of ``key`` (a renewal)."""
        rec = self.res[key]
        if deadline < rec.deadline:
            self.fail(f"renewal moved the deadline of {key} back")
        rec.quarantine += deadline - rec.deadline
        rec.deadline = deadline

    def check_quiescent(
        self,
        reserved_blocks: int,
        held_blocks: int,
        *,
        producer_alive: bool = True,
    ) -> None:
        """I3: once inputs stop and every timer fired, nothing is held (a dead
        producer's own memory excepted). No exception for an op that never
        reports: its initiator cancels it past its bound, and the transfer
        ends as for any failed op (issue 28)."""
        for key, rec in self.res.items():
            if rec.ended is None:
                self.fail(f"I3: reservation {key} never released")
        if self.src_held and producer_alive:
            self.fail(f"I3: source blocks still held for {sorted(self.src_held)}")
        if reserved_blocks != 0 or (producer_alive and held_blocks != 0):
            self.fail(f"I3: endpoints still count {reserved_blocks}/{held_blocks} blocks")


def _flat(blocks: tuple[tuple[int, ...], ...]) -> frozenset[int]:
    return frozenset(b for group in blocks for b in group)


def _count(blocks: tuple[tuple[int, ...], ...]) -> int:
    return sum(map(len, blocks))


def _span(op: StartWrite) -> list[int]:
    """The flat indices of the source blocks one increment writes (the model
    world's blocks are alike on both sides: index ``i`` lands in ``dst[i]``)."""
    out: list[int] = []
    base = 0
    for g, group in enumerate(op.src_blocks):
        first = op.first[g] if op.first else 0
        out += range(base + first, base + len(group))
        base += len(group)
    return out
