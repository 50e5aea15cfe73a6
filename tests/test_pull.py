"""Pull mode: Announce -> StartRead per route -> read_done -> Ready + ReadDone."""

from __future__ import annotations

from typing import TypeVar

from kvpush.protocol import (
    Abort,
    Announce,
    Cancel,
    Consumer,
    ConsumerConfig,
    ControlMessage,
    CState,
    Failed,
    FailureReason,
    Identity,
    Mode,
    Output,
    PeerReady,
    Producer,
    ProducerConfig,
    PState,
    ReadDone,
    Ready,
    Register,
    Rejected,
    RejectReason,
    Released,
    ReleaseOutcome,
    Reserved,
    Send,
    Settled,
    Source,
    SourceReleased,
    StartRead,
    StartWrite,
    Timing,
    Withdraw,
)

P, D = "prefill", "decode"
T = TypeVar("T")
P_TIMING = Timing(max_transit=1.5, op_bound=6.0)
C_TIMING = Timing(max_transit=1.5, op_bound=4.0)  # max_transit must match
SRC = ((1, 2, 3),)
DST = ((7, 8, 9),)


class Wire:
    """A producer and a consumer; control messages in flight are moved by hand."""

    def __init__(self, p_tp: int = 2, c_tp: int = 1) -> None:
        self.p = Producer(ProducerConfig(Identity(P, 1, tp=p_tp), timing=P_TIMING))
        self.c = Consumer(ConsumerConfig(Identity(D, 1, tp=c_tp), timing=C_TIMING))
        self.inflight: list[tuple[str, str, ControlMessage]] = []
        self.events: dict[str, list[Output]] = {P: [], D: []}
        self.now = 0.0

    def collect(self) -> None:
        for name, end in ((P, self.p), (D, self.c)):
            for out in end.drain():
                if isinstance(out, Send):
                    self.inflight.append((name, out.peer, out.message))
                elif not isinstance(out, PeerReady):  # not what these tests watch
                    self.events[name].append(out)

    def deliver(self) -> list[ControlMessage]:
        """Deliver everything in flight (and what it provokes); return what moved."""
        moved = []
        self.collect()
        while self.inflight:
            _, dst, msg = self.inflight.pop(0)
            moved.append(msg)
            if dst == P:
                self.p.receive(self.now, D, msg)
            else:
                self.c.receive(self.now, P, msg)
            self.collect()
        return moved

    def take(self, name: str, kind: type[T]) -> list[T]:
        got: list[T] = [e for e in self.events[name] if isinstance(e, kind)]
        self.events[name] = [e for e in self.events[name] if not isinstance(e, kind)]
        return got

    def reserve(
        self,
        blocks: tuple[tuple[int, ...], ...] = DST,
        mode: Mode = Mode.PULL,
        deadline: float | None = None,
    ) -> int:
        reply = self.c.reserve(self.now, "t1", P, blocks, mode=mode, deadline=deadline)
        assert isinstance(reply, Reserved)
        return reply.epoch

    def reading(self) -> tuple[int, list[StartRead]]:
        """Handshake, reserve in pull mode, KV ready: the consumer's reads are posted."""
        e = self.reserve()
        self.deliver()
        self.now = 1.0
        self.p.kv_ready(self.now, "t1", SRC)
        moved = self.deliver()
        assert [type(m) for m in moved] == [Announce]
        reads = self.take(D, StartRead)
        assert reads
        return e, reads

    def read(self, r: StartRead, ok: bool = True) -> None:
        self.c.read_done(
            self.now, r.transfer_id, r.epoch, r.route.source, r.route.consumer_rank, ok
        )


def test_pull_lifecycle() -> None:
    w = Wire()
    e = w.reserve()
    moved = w.deliver()
    assert Register("t1", e, D, DST, 30.0, Mode.PULL) in moved
    assert w.p.transfers() == [("t1", PState.WAIT_KV)]
    w.now = 1.0
    w.p.kv_ready(1.0, "t1", SRC)
    assert w.deliver() == [Announce("t1", e, SRC, 29.0)]
    assert w.p.transfers() == [("t1", PState.LENT)]
    reads = w.take(D, StartRead)
    assert [(r.route.source, r.route.consumer_rank) for r in reads] == [
        (Source(0), 0),
        (Source(1), 0),
    ]
    for r in reads:
        assert (r.epoch, r.peer, r.src_blocks, r.dst_blocks, r.not_after) == (e, P, SRC, DST, 30.0)
    w.now = 2.0
    w.read(reads[0])
    w.collect()
    assert w.inflight == []
    assert w.events[D] == []
    w.read(reads[1])
    assert w.deliver() == [ReadDone("t1", e, True)]
    (ready,) = w.take(D, Ready)
    assert (ready.epoch, ready.blocks, ready.timeline.ready) == (e, DST, 2.0)
    (rel,) = w.take(P, SourceReleased)
    assert (rel.outcome, rel.blocks) == (ReleaseOutcome.DELIVERED, SRC)
    assert w.p.transfers() == [("t1", PState.RELEASED)]
    assert w.p.held_blocks == 0
    assert w.c.reservations() == []


def test_failed_read_waits_for_sibling_reads() -> None:
    w = Wire()
    e, reads = w.reading()
    w.read(reads[0], ok=False)
    w.collect()
    assert w.inflight == []
    assert w.take(D, Failed) == [Failed("t1", e, FailureReason.TRANSFER_FAILED, "")]
    assert w.events[D] == []  # the sibling read still writes into our blocks
    assert w.c.reservations() == [("t1", e, CState.READ_DRAIN)]
    assert w.p.transfers() == [("t1", PState.LENT)]
    w.read(reads[1], ok=True)
    assert w.deliver() == [ReadDone("t1", e, False)]
    assert [r.epoch for r in w.take(D, Released)] == [e]
    assert w.take(D, Ready) == []
    assert [r.outcome for r in w.take(P, SourceReleased)] == [ReleaseOutcome.FAILED]


def test_preempt_during_reads_then_new_epoch() -> None:
    w = Wire()
    e1, reads = w.reading()
    assert w.c.preempt(w.now, "t1") is True
    w.collect()
    assert w.inflight == []  # reads still land: no Withdraw yet
    assert w.c.reservations() == [("t1", e1, CState.READ_DRAIN)]
    e2 = w.reserve(blocks=((4, 5, 6),))
    assert e2 > e1
    assert [type(m) for m in w.deliver()] == [Register]
    assert w.p.transfers() == [("t1", PState.LENT)]
    for r in reads:
        w.read(r)
    moved = w.deliver()
    assert moved == [Withdraw("t1", e1), Announce("t1", e2, SRC, 30.0)]
    assert [r.epoch for r in w.take(D, Released)] == [e1]
    assert w.take(D, Failed) == []
    reads2 = w.take(D, StartRead)
    assert {(r.epoch, r.dst_blocks) for r in reads2} == {(e2, ((4, 5, 6),))}
    for r in reads2:
        w.read(r)
    assert w.deliver() == [ReadDone("t1", e2, True)]
    assert [(r.epoch, r.blocks) for r in w.take(D, Ready)] == [(e2, ((4, 5, 6),))]
    assert [r.outcome for r in w.take(P, SourceReleased)] == [ReleaseOutcome.DELIVERED]


def _preempt_reserve_abort(w: Wire) -> tuple[int, int, list[StartRead]]:
    """Issue 13 item 3: Register(e1), Announce(e1), the reads of e1 in flight,
    preempt (READING -> READ_DRAIN), reserve again (Register(e2)), abort
    (Abort(e2)); everything delivered. Returns (e1, e2, e1's reads)."""
    e1, reads = w.reading()
    assert w.c.preempt(w.now, "t1") is True
    e2 = w.reserve(blocks=((4, 5, 6),))
    assert [type(m) for m in w.deliver()] == [Register]
    assert w.c.abort(w.now, "t1") is True
    assert w.deliver()[0] == Abort("t1", e2)
    assert w.c.reservations() == [("t1", e1, CState.READ_DRAIN)]
    return e1, e2, reads


def test_abort_of_a_newer_epoch_keeps_the_source_until_older_reads_settle() -> None:
    """Regression (issue 13, 3): the producer took Abort(e2), the newest epoch,
    as the end of the whole transfer and released the source KV at once, while
    e1's reads were still running: they read blocks reused by another request."""
    w = Wire()
    e1, e2, reads = _preempt_reserve_abort(w)
    assert w.take(P, SourceReleased) == []  # e1's reads still run
    assert w.p.transfers() == [("t1", PState.LENT)]
    assert w.p.held_blocks == 3
    for r in reads:
        w.read(r)
    # The reads settled: the consumer says so (its Withdraw of e1), and only
    # now the source comes back, as aborted; both epochs are acknowledged.
    assert w.deliver() == [Withdraw("t1", e1), Settled("t1", e1), Settled("t1", e2)]
    assert [r.outcome for r in w.take(P, SourceReleased)] == [ReleaseOutcome.ABORTED]
    assert [r.epoch for r in w.take(D, Released)] == [e2, e1]
    assert w.p.held_blocks == 0
    assert w.c.reserved_blocks == 0


def test_abort_of_a_newer_epoch_with_reads_never_reported_waits_for_the_quarantine() -> None:
    w = Wire()
    w.now = 0.0
    _preempt_reserve_abort(w)
    quarantine = 30.0 + P_TIMING.max_transit + C_TIMING.op_bound  # e1's lease from 0.0
    assert w.p.next_deadline() == quarantine
    w.p.handle_timer(quarantine - 0.01)
    w.collect()
    assert w.take(P, SourceReleased) == []
    w.p.handle_timer(quarantine)
    w.collect()
    assert [r.outcome for r in w.take(P, SourceReleased)] == [ReleaseOutcome.ABORTED]


def test_withdraw_returns_producer_to_holding() -> None:
    w = Wire()
    e1, reads = w.reading()
    w.c.preempt(w.now, "t1")
    for r in reads:
        w.read(r, ok=False)
    assert w.deliver() == [Withdraw("t1", e1)]
    assert w.p.transfers() == [("t1", PState.HOLDING)]
    assert w.p.held_blocks == 3
    assert w.take(P, SourceReleased) == []
    w.now = 3.0
    e2 = w.reserve()
    assert [type(m) for m in w.deliver()] == [Register, Announce]
    assert [r.epoch for r in w.take(D, StartRead)] == [e2, e2]


def test_pending_epoch_whose_lease_ran_out_is_not_served_after_withdraw() -> None:
    w = Wire()
    e1, reads = w.reading()
    w.c.preempt(w.now, "t1")
    e2 = w.reserve(mode=Mode.PUSH, deadline=w.now + 2.0)  # lease 2 s
    w.deliver()
    w.now = 5.0  # the reads of e1 take longer than e2's lease
    for r in reads:
        w.read(r)
    moved = w.deliver()
    assert moved == [Withdraw("t1", e1), Rejected("t1", e2, RejectReason.LEASE_EXPIRED)]
    assert w.take(P, StartWrite) == []
    assert w.p.transfers() == [("t1", PState.HOLDING)]


def test_producer_abort_while_lent_waits_for_read_done() -> None:
    w = Wire()
    e, reads = w.reading()
    assert w.p.abort(w.now, "t1") is True
    assert w.deliver() == [Abort("t1", e)]
    assert w.take(P, SourceReleased) == []  # the consumer still reads our blocks
    assert w.p.transfers() == [("t1", PState.LENT)]
    assert [f.reason for f in w.take(D, Failed)] == [FailureReason.PEER_ABORTED]
    for r in reads:
        w.read(r)
    moved = w.deliver()
    assert moved[0] == ReadDone("t1", e, False)
    assert [r.epoch for r in w.take(D, Released)] == [e]
    assert [r.outcome for r in w.take(P, SourceReleased)] == [ReleaseOutcome.ABORTED]


def test_producer_abort_while_lent_waits_for_quarantine() -> None:
    w = Wire()
    w.reading()
    w.p.abort(w.now, "t1")
    w.collect()
    w.inflight.clear()  # the abort is lost; the consumer never answers
    # the registration's lease ran to 30.0 on the producer's clock; the consumer may
    # start a read until then (+ transit) and each read lasts at most its op bound
    quarantine = 30.0 + P_TIMING.max_transit + C_TIMING.op_bound
    assert w.p.next_deadline() == quarantine
    w.p.handle_timer(quarantine - 0.01)
    w.collect()
    assert w.take(P, SourceReleased) == []
    w.p.handle_timer(quarantine)
    w.collect()
    assert [r.outcome for r in w.take(P, SourceReleased)] == [ReleaseOutcome.ABORTED]


def test_no_timer_declares_a_read_dead() -> None:
    """A posted read stays posted until the transport reports it: the ready
    deadline fails the epoch, but the blocks stay held (READ_DRAIN, no timer
    armed) however long the read takes, and its late result settles it."""
    w = Wire()
    e, reads = w.reading()
    w.read(reads[0])
    w.c.handle_timer(reads[0].not_after)  # the ready deadline (30.0) fails the epoch
    w.collect()
    assert [f.reason for f in w.take(D, Failed)] == [FailureReason.TIMEOUT]
    assert w.c.reservations() == [("t1", e, CState.READ_DRAIN)]
    # Nothing but the transport ends the drain: the read's bound (op_bound
    # after the StartRead, long past) only asked the adapter to cancel it
    # (issue 28), once.
    r = reads[1]
    assert w.events[D] == [Cancel("t1", e, P, r.route.source, r.route.consumer_rank)]
    w.events[D].clear()
    assert w.c.next_deadline() is None
    w.c.handle_timer(reads[0].not_after + 1000.0)
    w.collect()
    assert w.inflight == []  # the Abort waits for the read: the source must stay lent
    assert w.events[D] == []
    assert w.c.reservations() == [("t1", e, CState.READ_DRAIN)]
    assert w.c.reserved_blocks == 3
    assert "read_timeout" not in w.c.stats()
    assert w.p.transfers() == [("t1", PState.LENT)]
    w.now = 1000.0
    w.read(reads[1], ok=True)  # the transport reports it at last
    assert w.deliver()[0] == Abort("t1", e)
    assert [r.epoch for r in w.take(D, Released)] == [e]
    assert w.take(D, Ready) == []
    assert w.c.reserved_blocks == 0
    assert [r.outcome for r in w.take(P, SourceReleased)] == [ReleaseOutcome.ABORTED]


def test_a_read_result_at_the_deadline_fails_the_epoch_instead_of_ready() -> None:
    """The last read reports success at (or after) the ready deadline, before
    the deadline's timer ran: past it the producer may have released and
    reused its source, so the bytes read are not trusted. The deadline is
    applied first: the epoch fails (TIMEOUT) and its blocks are released,
    never Ready, and the producer is told Abort, not ReadDone(ok)."""
    w = Wire()
    e, reads = w.reading()
    w.read(reads[0])
    w.now = 30.0  # the deadline (reserved at 0.0, ready_timeout 30)
    w.read(reads[1], ok=True)
    moved = w.deliver()
    assert moved[0] == Abort("t1", e)
    assert ReadDone("t1", e, True) not in moved
    assert w.take(D, Ready) == []
    assert [(f.epoch, f.reason) for f in w.take(D, Failed)] == [(e, FailureReason.TIMEOUT)]
    assert [r.epoch for r in w.take(D, Released)] == [e]
    assert w.c.reservations() == []
    assert [r.outcome for r in w.take(P, SourceReleased)] == [ReleaseOutcome.ABORTED]


def test_a_read_result_just_before_the_deadline_is_ready() -> None:
    w = Wire()
    e, reads = w.reading()
    w.read(reads[0])
    w.now = 29.999
    w.read(reads[1], ok=True)
    assert w.deliver() == [ReadDone("t1", e, True)]
    assert [r.epoch for r in w.take(D, Ready)] == [e]
    assert w.take(D, Failed) == []


def test_a_failed_read_result_after_the_deadline_fails_for_the_deadline() -> None:
    w = Wire()
    e, reads = w.reading()
    w.now = 31.0
    w.read(reads[0], ok=False)
    w.collect()
    assert [f.reason for f in w.take(D, Failed)] == [FailureReason.TIMEOUT]
    assert w.c.reservations() == [("t1", e, CState.READ_DRAIN)]
    w.read(reads[1], ok=True)
    assert w.deliver()[0] == Abort("t1", e)
    assert w.take(D, Ready) == []
    assert [r.epoch for r in w.take(D, Released)] == [e]


def test_pull_deadline_before_announce_releases_at_once() -> None:
    w = Wire()
    e = w.reserve(deadline=5.0)
    w.deliver()
    w.c.handle_timer(5.0)
    moved = w.deliver()
    assert moved[0] == Abort("t1", e)
    assert [type(x) for x in w.events[D]] == [Failed, Released]


def test_read_results_for_unknown_or_settled_reads_are_counted() -> None:
    w = Wire()
    e, reads = w.reading()
    w.read(reads[0])
    w.read(reads[0])
    w.c.read_done(w.now, "t1", e + 1, Source(0), 0, True)
    w.c.read_done(w.now, "t1", e, Source(7), 0, True)
    w.collect()
    assert w.events[D] == []
    assert w.c.stats()["read_result_late"] == 1
    assert w.c.stats()["read_unknown"] == 1
    assert w.c.stats()["read_unexpected_source"] == 1


def test_push_epoch_preempted_then_pull_epoch_is_lent_not_written() -> None:
    w = Wire(p_tp=1)
    e1 = w.reserve(mode=Mode.PUSH)
    w.deliver()
    w.p.kv_ready(w.now, "t1", SRC)
    w.collect()
    (write,) = w.take(P, StartWrite)
    w.c.preempt(w.now, "t1")
    e2 = w.reserve(blocks=((4, 5, 6),), mode=Mode.PULL)
    w.deliver()  # Withdraw(e1) and Register(e2, pull) wait for the write of e1
    w.take(P, StartWrite)
    w.p.write_done(w.now, "t1", e1, write.route.source, write.route.consumer_rank)
    moved = w.deliver()
    assert moved == [Settled("t1", e1), Announce("t1", e2, SRC, 30.0)]
    assert w.take(P, StartWrite) == []  # nothing is written into the pull epoch's blocks
    assert [r.epoch for r in w.take(D, Released)] == [e1]
    (read,) = w.take(D, StartRead)
    w.read(read)
    assert w.deliver() == [ReadDone("t1", e2, True)]
    assert [(r.epoch, r.blocks) for r in w.take(D, Ready)] == [(e2, ((4, 5, 6),))]
    assert [r.outcome for r in w.take(P, SourceReleased)] == [ReleaseOutcome.DELIVERED]
