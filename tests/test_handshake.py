"""Handshake: compatibility verdicts on both sides, restarts, waiting reservations."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from kvpush.protocol import (
    Completion,
    ConfigError,
    Consumer,
    ConsumerConfig,
    ControlMessage,
    CState,
    Failed,
    FailureReason,
    Hello,
    HelloReject,
    Identity,
    Mode,
    Output,
    PeerFailed,
    PeerReady,
    PeerState,
    Producer,
    ProducerConfig,
    PState,
    Ready,
    Refused,
    RefuseReason,
    Register,
    Released,
    Reserved,
    Role,
    Send,
    Source,
    StartWrite,
    Timing,
    compute_topology,
)
from kvpush.protocol._tables import PEER, PeerInput

P, D = "prefill", "decode"
T = TypeVar("T")


class Wire:
    """Two endpoints and the control messages in flight between them, moved by hand."""

    def __init__(self, *ends: Producer | Consumer) -> None:
        self.ends = {e.identity.engine_id: e for e in ends}
        self.inflight: list[tuple[str, str, ControlMessage]] = []
        self.events: dict[str, list[Output]] = {name: [] for name in self.ends}
        self.delivered: list[tuple[str, str, ControlMessage]] = []
        self.now = 0.0

    def collect(self) -> None:
        for name, end in self.ends.items():
            for out in end.drain():
                if isinstance(out, Send):
                    self.inflight.append((name, out.peer, out.message))
                else:
                    self.events[name].append(out)

    def deliver(self) -> None:
        """Deliver everything in flight, and whatever that provokes, in order."""
        self.collect()
        while self.inflight:
            src, dst, msg = self.inflight.pop(0)
            self.delivered.append((src, dst, msg))
            self.ends[dst].receive(self.now, src, msg)
            self.collect()

    def take(self, name: str, kind: type[T]) -> list[T]:
        """Remove and return the events of ``kind`` that ``name`` emitted."""
        got: list[T] = [e for e in self.events[name] if isinstance(e, kind)]
        self.events[name] = [e for e in self.events[name] if not isinstance(e, kind)]
        return got


def producer(**kw: Any) -> Producer:
    return Producer(ProducerConfig(Identity(P, kw.pop("instance", 1), **kw)))


def consumer(**kw: Any) -> Consumer:
    base = kw.pop("epoch_base", 0)
    return Consumer(ConsumerConfig(Identity(D, kw.pop("instance", 1), **kw), epoch_base=base))


def test_compatible_pair_ready_on_both() -> None:
    w = Wire(producer(tp=2), consumer(tp=1))
    w.ends[D].connect(0.0, P)
    w.deliver()
    topo = compute_topology(2, 1, 1, 8)
    assert w.take(P, PeerReady) == [PeerReady(D, topo)]
    assert w.take(D, PeerReady) == [PeerReady(P, topo)]
    assert [type(m) for _, _, m in w.delivered] == [Hello, Hello]
    for name, other in ((P, D), (D, P)):
        view = w.ends[name].peer(other)
        assert view.state is PeerState.READY
        assert view.topology == topo
        assert view.failure is None
        assert w.events[name] == []


def test_connect_again_when_ready_sends_nothing() -> None:
    w = Wire(producer(), consumer())
    w.ends[D].connect(0.0, P)
    w.deliver()
    w.ends[D].connect(1.0, P)
    w.ends[P].connect(1.0, D)
    w.collect()
    assert w.inflight == []


def test_a_connection_coming_back_restarts_a_lost_handshake_at_once() -> None:
    """The channel redials a peer after a loss (e.g. it restarted on the same
    port): the handshake restarts from the new connection, so the new instance
    is known before the next reservation, and the first one registers."""
    w = Wire(producer(instance=1), consumer())
    w.ends[D].connect(0.0, P)
    w.deliver()
    w.take(D, PeerReady)
    w.ends[D].connection_up(1.0, P)  # READY: nothing to do
    w.ends[D].connection_up(1.0, "stranger")  # never met: nothing either
    w.collect()
    assert w.inflight == []
    w.ends[D].peer_lost(2.0, P)
    w.ends[P] = producer(instance=2)  # restarted, knows nobody
    w.events[P] = []
    w.ends[D].connection_up(3.0, P)
    w.deliver()
    assert [type(m) for _, _, m in w.delivered[-2:]] == [Hello, Hello]
    assert w.ends[D].peer(P).state is PeerState.READY
    assert w.ends[D].peer(P).hello.instance == 2  # type: ignore[union-attr]
    assert w.take(D, PeerReady) != []


_INCOMPATIBLE: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("topology", {"tp": 3}, {}),
    ("kv_groups", {"kv_groups": 2}, {}),
    ("dtype", {"fingerprint": (("dtype", "bf16"),)}, {"fingerprint": (("dtype", "fp8"),)}),
    ("layout", {"fingerprint": (("layout", "NHD"),)}, {}),
    ("num_kv_heads", {"num_kv_heads": 4}, {}),
    ("mla", {"mla": True}, {}),
    ("modes", {"modes": (Mode.PUSH,)}, {"modes": (Mode.PULL,)}),
    ("pp", {}, {"pp": 2}),
]


@pytest.mark.parametrize("initiator", [D, P])
@pytest.mark.parametrize(("field", "p_kw", "c_kw"), _INCOMPATIBLE)
def test_incompatible_pair_fails_on_both_sides(
    field: str, p_kw: dict[str, Any], c_kw: dict[str, Any], initiator: str
) -> None:
    w = Wire(producer(**p_kw), consumer(**c_kw))
    w.ends[initiator].connect(0.0, P if initiator == D else D)
    w.deliver()
    for name, other in ((P, D), (D, P)):
        failed = w.take(name, PeerFailed)
        assert [(f.peer, f.field) for f in failed] == [(other, field)], name
        assert failed[0].detail
        view = w.ends[name].peer(other)
        assert view.state is PeerState.FAILED
        assert view.failure is not None
        assert view.failure[0] == field
        assert view.topology is None
        assert w.take(name, PeerReady) == []


def test_version_mismatch_fails_on_both_sides() -> None:
    p = producer()
    p._hello = dataclasses.replace(p._hello, version=p._hello.version + 1)
    w = Wire(p, consumer())
    w.ends[D].connect(0.0, P)
    w.deliver()
    assert [f.field for f in w.take(P, PeerFailed)] == ["version"]
    assert [f.field for f in w.take(D, PeerFailed)] == ["version"]


def test_role_mismatch_fails_on_both_sides() -> None:
    other = Consumer(ConsumerConfig(Identity(P, 1)))
    w = Wire(other, consumer())
    w.ends[D].connect(0.0, P)
    w.deliver()
    assert [(f.peer, f.field) for f in w.take(P, PeerFailed)] == [(D, "role")]
    assert [(f.peer, f.field) for f in w.take(D, PeerFailed)] == [(P, "role")]


def test_hello_with_wrong_engine_id_is_refused() -> None:
    p = producer()
    p.receive(0.0, D, Identity("someone-else", 1).hello(Role.CONSUMER, 10.0))
    assert p.drain() == [Send(D, HelloReject("engine_id", "does not match the sender"))]
    assert p.stats()["hello_wrong_engine_id"] == 1
    assert p.peer(D).state is PeerState.DISCONNECTED


def test_reservation_waiting_on_failed_handshake_is_released() -> None:
    c = consumer()
    w = Wire(producer(tp=3), c)
    reply = c.reserve(0.0, "t1", P, [[1, 2]])
    assert isinstance(reply, Reserved)
    w.deliver()
    (failed,) = w.take(D, Failed)
    assert failed.reason is FailureReason.HANDSHAKE_FAILED
    assert "topology" in failed.detail
    assert [r.transfer_id for r in w.take(D, Released)] == ["t1"]
    assert c.reservations() == []
    assert c.reserved_blocks == 0
    assert not any(isinstance(m, Register) for _, _, m in w.delivered)


def test_reserve_before_handshake_waits_then_registers() -> None:
    w = Wire(producer(), consumer())
    c = w.ends[D]
    assert isinstance(c, Consumer)
    r1 = c.reserve(0.0, "t1", P, [[1, 2]])
    r2 = c.reserve(0.0, "t2", P, [[3]])
    assert isinstance(r1, Reserved)
    assert isinstance(r2, Reserved)
    w.collect()
    # one hello, no registration yet
    assert [type(m) for _, _, m in w.inflight] == [Hello]
    assert {(t, s) for t, _, s in c.reservations()} == {
        ("t1", CState.WAITING_PEER),
        ("t2", CState.WAITING_PEER),
    }
    w.deliver()
    regs = [m for _, _, m in w.delivered if isinstance(m, Register)]
    assert [(m.transfer_id, m.epoch, m.blocks) for m in regs] == [
        ("t1", r1.epoch, ((1, 2),)),
        ("t2", r2.epoch, ((3,),)),
    ]
    assert {s for _, _, s in c.reservations()} == {CState.AWAITING}
    p = w.ends[P]
    assert isinstance(p, Producer)
    assert sorted(p.transfers()) == [("t1", PState.WAIT_KV), ("t2", PState.WAIT_KV)]


def test_reserve_against_failed_peer_is_refused() -> None:
    w = Wire(producer(kv_groups=2), consumer())
    w.ends[D].connect(0.0, P)
    w.deliver()
    c = w.ends[D]
    assert isinstance(c, Consumer)
    assert c.peer(P).state is PeerState.FAILED
    assert c.reserve(1.0, "t1", P, [[1]]) == Refused("t1", RefuseReason.PEER_FAILED)
    assert c.drain() == []
    assert c.reservations() == []
    assert c.reserved_blocks == 0


def test_producer_restart_drops_old_state_and_handshakes_again() -> None:
    w = Wire(producer(), consumer())
    c = w.ends[D]
    assert isinstance(c, Consumer)
    old = c.reserve(0.0, "t1", P, [[1, 2]])
    assert isinstance(old, Reserved)
    w.deliver()
    w.take(D, PeerReady)
    # the producer process restarts: same engine id, new instance, no memory
    fresh = producer(instance=2)
    w.ends[P] = fresh
    w.events[P] = []
    w.now = 1.0
    fresh.connect(1.0, D)
    w.deliver()
    (failed,) = w.take(D, Failed)
    assert (failed.transfer_id, failed.epoch) == ("t1", old.epoch)
    assert failed.reason is FailureReason.PEER_LOST
    assert c.stats()["peer_restarted"] == 1
    assert c.reservations() == [("t1", old.epoch, CState.DRAINING)]
    assert c.peer(P).state is PeerState.READY
    assert c.peer(P).hello is not None
    assert c.peer(P).hello.instance == 2  # type: ignore[union-attr]
    assert len(w.take(D, PeerReady)) == 1
    assert len(w.take(P, PeerReady)) == 1
    # a completion of the old instance's epoch cannot make anything ready
    c.completion_received(1.0, P, Completion("t1", old.epoch, Source(0), 0))
    assert w.take(D, Ready) == []
    # the new instance serves new reservations end to end
    new = c.reserve(2.0, "t1", P, [[7]])
    assert isinstance(new, Reserved)
    assert new.epoch > old.epoch
    w.deliver()
    fresh.kv_ready(2.0, "t1", [[0]])
    w.collect()
    (write,) = w.take(P, StartWrite)
    assert (write.epoch, write.dst_blocks) == (new.epoch, ((7,),))
    fresh.write_done(2.5, "t1", write.epoch, write.route.source, write.route.consumer_rank)
    c.completion_received(2.5, P, write.notice)
    w.collect()
    assert [(r.transfer_id, r.epoch) for r in w.take(D, Ready)] == [("t1", new.epoch)]


def test_consumer_restart_drops_producer_registrations() -> None:
    w = Wire(producer(), consumer())
    c = w.ends[D]
    p = w.ends[P]
    assert isinstance(c, Consumer)
    assert isinstance(p, Producer)
    c.reserve(0.0, "t1", P, [[1, 2]])
    w.deliver()
    assert p.transfers() == [("t1", PState.WAIT_KV)]
    fresh = consumer(instance=2, epoch_base=1000)
    w.ends[D] = fresh
    w.events[D] = []
    fresh.connect(1.0, P)
    w.deliver()
    assert p.stats()["peer_restarted"] == 1
    assert p.peer(D).state is PeerState.READY
    # the old registration is gone: ready KV is held, not written to old blocks
    assert p.transfers() == [("t1", PState.IDLE)]
    p.kv_ready(1.0, "t1", [[0]])
    w.collect()
    assert w.take(P, StartWrite) == []
    assert p.transfers() == [("t1", PState.HOLDING)]
    reply = fresh.reserve(1.0, "t1", P, [[9]])
    assert isinstance(reply, Reserved)
    w.deliver()
    (write,) = w.take(P, StartWrite)
    assert (write.epoch, write.dst_blocks) == (reply.epoch, ((9,),))


# --- the PEER table: remote inputs never raise, local ones are total ---------------


def _in_state(state: PeerState) -> tuple[Wire, Producer, Consumer]:
    """A producer whose view of the consumer is in ``state``."""
    p, c = producer(), consumer()
    w = Wire(p, c)
    if state is PeerState.HELLO_SENT:
        p.connect(0.0, D)
    elif state is PeerState.READY:
        c.connect(0.0, P)
        w.deliver()
    elif state is PeerState.FAILED:
        c.connect(0.0, P)
        w.collect()
        w.inflight.clear()
        p.receive(0.0, D, dataclasses.replace(c._hello, kv_groups=3))
    w.collect()
    w.inflight.clear()
    assert p.peer(D).state is state
    return w, p, c


_REMOTE: dict[PeerInput, Callable[[Consumer], ControlMessage]] = {
    PeerInput.HELLO_OK: lambda c: c._hello,
    # a *restarted* instance (a same-instance hello in READY is a duplicate)
    PeerInput.HELLO_BAD: lambda c: dataclasses.replace(c._hello, kv_groups=3, instance=2),
    PeerInput.REJECT: lambda c: HelloReject("dtype", "bf16 here, fp8 there"),
}


@pytest.mark.parametrize("state", list(PeerState))
@pytest.mark.parametrize("inp", list(_REMOTE))
def test_peer_remote_inputs_never_raise(state: PeerState, inp: PeerInput) -> None:
    _, p, c = _in_state(state)
    p.receive(1.0, D, _REMOTE[inp](c))
    expected = PEER.get((state, inp), state)
    if inp is PeerInput.HELLO_OK and state is PeerState.READY:
        assert p.stats()["hello_duplicate"] == 1
    assert p.peer(D).state is expected


def test_peer_table_is_total() -> None:
    assert {(s, i) for s in PeerState for i in PeerInput} == set(PEER)


@pytest.mark.parametrize("state", list(PeerState))
def test_peer_local_inputs_are_total(state: PeerState) -> None:
    for inp in (PeerInput.CONNECT, PeerInput.LOST):
        assert (state, inp) in PEER
    _, p, _ = _in_state(state)
    p.peer_lost(1.0, D)
    assert p.peer(D).state is PeerState.DISCONNECTED
    p.connect(2.0, D)
    assert p.peer(D).state is PeerState.HELLO_SENT


def test_peer_lost_for_unknown_peer_is_counted() -> None:
    p = producer()
    p.peer_lost(0.0, "nobody")
    assert p.stats()["peer_lost_unknown"] == 1
    assert p.drain() == []


def test_unsolicited_reject_reports_failure() -> None:
    c = consumer()
    c.receive(0.0, P, HelloReject("dtype", "bf16 here, fp8 there"))
    assert c.drain() == [PeerFailed(P, "dtype", "bf16 here, fp8 there")]
    assert c.reserve(0.0, "t1", P, [[1]]) == Refused("t1", RefuseReason.PEER_FAILED)


# --- liveness: a lost handshake frame is sent again (issue 13, 2) -----------------


def _hellos(w: Wire) -> list[tuple[str, str]]:
    """(from, to) of every hello in flight, then forget everything in flight."""
    w.collect()
    got = [(src, dst) for src, dst, m in w.inflight if isinstance(m, Hello)]
    w.inflight.clear()
    return got


def test_a_lost_hello_is_sent_again_with_backoff_and_the_reservation_registers() -> None:
    """Regression: the consumer sent its hello only from DISCONNECTED; one lost
    hello left every reservation to that producer waiting until its deadline."""
    w = Wire(producer(), consumer())
    c = w.ends[D]
    assert isinstance(c, Consumer)
    assert isinstance(c.reserve(0.0, "t1", P, [[1]]), Reserved)
    assert _hellos(w) == [(D, P)]  # lost
    assert c.peer(P).state is PeerState.HELLO_SENT
    # 1, 2, 4 s between resends (Timing.hello_retry doubling), each lost
    for when in (1.0, 3.0, 7.0):
        assert c.next_deadline() == when  # the retry, long before the deadline
        c.handle_timer(when)
        assert _hellos(w) == [(D, P)]
    assert c.stats()["hello_retry"] == 3
    assert c.peer(P).attempts == 4
    c.handle_timer(15.0)  # the fourth resend gets through
    w.now = 15.0
    w.deliver()
    assert c.peer(P).state is PeerState.READY
    assert w.ends[P].peer(D).state is PeerState.READY
    assert any(isinstance(m, Register) for _, _, m in w.delivered)
    assert c.reservations() == [("t1", 1, CState.AWAITING)]
    assert c.peer(P).attempts == 5
    before = c.next_deadline()
    c.handle_timer(100.0)  # no retry is left armed once ready
    _hellos(w)
    assert c.stats()["hello_retry"] == 4
    assert before == 30.0  # only the reservation's deadline


def test_a_lost_answer_is_answered_again() -> None:
    """The producer got our hello and answered; the answer was lost. The
    retry reaches a producer that is already ready: it answers every hello."""
    w = Wire(producer(), consumer())
    c, p = w.ends[D], w.ends[P]
    c.connect(0.0, P)
    w.collect()
    (hello,) = [m for _, _, m in w.inflight]
    w.inflight.clear()
    p.receive(0.0, D, hello)
    assert _hellos(w) == [(P, D)]  # the answer, lost
    assert p.peer(D).state is PeerState.READY
    c.handle_timer(1.0)
    w.now = 1.0
    w.deliver()
    assert c.peer(P).state is PeerState.READY
    assert p.stats()["hello_duplicate"] == 1
    assert c.stats().get("hello_duplicate", 0) == 0
    # and it stops there: the consumer answers no duplicate while ready
    c.receive(2.0, P, p._hello)
    assert _hellos(w) == []
    assert c.stats()["hello_duplicate"] == 1


def test_a_new_connection_resends_an_unanswered_hello_at_once() -> None:
    """Issue 13, first live sequence: a decode reserves before its prefill
    listens; the hello expires in the channel's queue; the connection comes up.
    The hello goes out again on it, without waiting for the retry timer."""
    w = Wire(producer(), consumer())
    c = w.ends[D]
    assert isinstance(c, Consumer)
    c.reserve(0.0, "t1", P, [[1]])
    assert _hellos(w) == [(D, P)]  # expired in the queue
    c.connection_up(0.5, P)
    w.now = 0.5
    w.deliver()
    assert c.peer(P).state is PeerState.READY
    assert c.stats()["hello_resent_on_connect"] == 1
    assert c.reservations() == [("t1", 1, CState.AWAITING)]


def test_a_restart_that_outlasts_the_loss_timer_recovers_on_the_next_connection() -> None:
    """Issue 13, second live sequence: the prefill restarts; the channel
    reports it lost; requests arrive during the outage (their hellos die in
    the queue); the restarted prefill's connection comes up: the next
    reservation registers with the new instance."""
    w = Wire(producer(instance=1), consumer())
    c = w.ends[D]
    assert isinstance(c, Consumer)
    c.connect(0.0, P)
    w.deliver()
    c.peer_lost(1.0, P)
    w.ends[P] = producer(instance=2)
    w.events[P] = []
    for i in range(3):  # requests during the outage
        c.reserve(2.0 + i, f"t{i}", P, [[i]], deadline=4.5 + i)
    c.handle_timer(3.0)  # a retry, lost too
    assert set(_hellos(w)) == {(D, P)}
    c.connection_up(5.0, P)
    w.now = 5.0
    w.deliver()
    assert c.peer(P).hello.instance == 2  # type: ignore[union-attr]
    assert [s for _, _, s in c.reservations()] == [CState.AWAITING, CState.AWAITING]
    assert sorted(t for t, _, _ in c.reservations()) == ["t1", "t2"]  # t0's deadline passed


def test_retries_are_bounded_and_a_reservation_restarts_them() -> None:
    timing = Timing(hello_retry=0.5, hello_retry_max=1.0, hello_retries=2)
    c = Consumer(ConsumerConfig(Identity(D, 1), timing=timing))
    c.reserve(0.0, "t1", P, [[1]])
    sends = [0.0]
    c.drain()
    while (when := c.next_deadline()) is not None and when < 30.0:
        c.handle_timer(when)
        sends += [when for o in c.drain() if isinstance(o, Send)]
    assert sends == [0.0, 0.5, 1.5]  # the second gap is capped at 1.0
    assert c.stats()["hello_retries_exhausted"] == 1
    c.handle_timer(35.0)  # t1's deadline
    c.drain()
    c.reserve(40.0, "t2", P, [[2]])  # the handshake starts over
    assert [type(o.message) for o in c.drain() if isinstance(o, Send)] == [Hello]
    assert c.stats()["hello_restarted_by_reserve"] == 1
    assert c.next_deadline() == 40.5


def test_duplicate_hello_reject_changes_nothing() -> None:
    c = consumer()
    reject = HelloReject("dtype", "bf16 here, fp8 there")
    c.receive(0.0, P, reject)
    assert c.drain() == [PeerFailed(P, "dtype", "bf16 here, fp8 there")]
    c.receive(0.1, P, reject)
    assert c.drain() == []
    assert c.stats()["hello_reject_duplicate"] == 1


def test_rejected_unknown_peer_reintroduces_the_consumer() -> None:
    """The producer lost our handshake while we kept ours (it saw the
    connection die, we did not): its Rejected(UNKNOWN_PEER) makes us send our
    hello again, and the next reservation gets through."""
    w = Wire(producer(), consumer())
    c, p = w.ends[D], w.ends[P]
    assert isinstance(c, Consumer)
    c.connect(0.0, P)
    w.deliver()
    p.peer_lost(1.0, D)
    c.reserve(2.0, "t1", P, [[1]])
    w.now = 2.0
    w.deliver()
    assert [f.reason for f in w.take(D, Failed)] == [FailureReason.REJECTED]
    assert c.stats()["hello_resent_unknown_peer"] == 1
    assert p.peer(D).state is PeerState.READY
    c.reserve(3.0, "t2", P, [[2]])
    w.now = 3.0
    w.deliver()
    assert ("t2", 2, CState.AWAITING) in c.reservations()


def test_the_hello_retry_needs_sane_bounds() -> None:
    with pytest.raises(ConfigError, match="hello_retry_max"):
        Timing(hello_retry=2.0, hello_retry_max=1.0)
    with pytest.raises(ConfigError, match="hello_retries"):
        Timing(hello_retries=-1)
    with pytest.raises(ConfigError, match="hello_retry"):
        Timing(hello_retry=0.0)
