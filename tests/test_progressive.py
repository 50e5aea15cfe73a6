"""Progressive push in the core: a source that becomes ready in increments.

The producer writes each increment as soon as the registration is there; only
the last one (the commit) carries the completion notices, so the consumer is
told Ready only then. Each increment is written once per pair (I4), nothing of
an epoch is written after it was withdrawn (I1), and preemption, abort, a
failed increment or a lease running out end the epoch as they do a one-shot
transfer. docs/protocol.md#progressive-push explains the rules.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpush.protocol import (
    Completion,
    ControlMessage,
    Extend,
    Identity,
    LocalProtocolError,
    Mode,
    Producer,
    ProducerConfig,
    PState,
    Register,
    Rejected,
    RejectReason,
    ReleaseOutcome,
    Renew,
    Role,
    Send,
    Settled,
    SourceReleased,
    StartWrite,
    Timing,
    Withdraw,
    WriteFailed,
)
from kvpush.testing import InvariantViolation
from kvpush.testing.explorer import explore

P, D = "prefill", "decode"
TIMING = Timing(max_transit=1.5, op_bound=6.0)
DST = ((7, 8, 9, 10),)


def make(*, p_tp: int = 1) -> Producer:
    p = Producer(ProducerConfig(Identity(P, 1, tp=p_tp), timing=TIMING, kv_hold_timeout=10.0))
    p.receive(0.0, D, Identity(D, 1, tp=1).hello(Role.CONSUMER, 4.0, TIMING.max_transit))
    p.drain()
    return p


def register(epoch: int, lease: float = 30.0, mode: Mode = Mode.PUSH) -> Register:
    return Register("t1", epoch, D, DST, lease, mode)


def writes(out: list[Any]) -> list[StartWrite]:
    return [o for o in out if isinstance(o, StartWrite)]


def sent(out: list[Any]) -> list[ControlMessage]:
    return [o.message for o in out if isinstance(o, Send)]


def done(p: Producer, ws: list[StartWrite], now: float) -> list[Any]:
    for w in ws:
        p.write_done(now, w.transfer_id, w.epoch, w.route.source, w.route.consumer_rank)
    return p.drain()


def test_each_increment_is_written_as_it_comes_and_only_the_last_commits() -> None:
    p = make(p_tp=2)
    p.receive(0.0, D, register(1))
    assert writes(p.drain()) == []
    p.kv_ready(1.0, "t1", [[1]], final=False)
    first = writes(p.drain())
    assert [(w.src_blocks, w.first, w.notice) for w in first] == [(((1,),), (), None)] * 2
    # A pair's next increment waits for its write in flight: one at a time.
    p.kv_ready(2.0, "t1", [[1, 2, 3]], final=False)
    assert writes(p.drain()) == []
    second = writes(done(p, first[:1], 2.5))
    assert [(w.route, w.src_blocks, w.first) for w in second] == [
        (first[0].route, ((1, 2, 3),), (1,))
    ]
    later = writes(done(p, first[1:], 2.6))
    assert [(w.route, w.first) for w in later] == [(first[1].route, (1,))]
    done(p, second + later, 3.0)
    assert p.transfers() == [("t1", PState.STREAMING)]
    # The last increment, with the completion notices.
    p.kv_ready(4.0, "t1", [[1, 2, 3, 4]])
    last = writes(p.drain())
    assert [(w.first, w.notice) for w in last] == [
        ((3,), Completion("t1", 1, w.route.source, w.route.consumer_rank)) for w in last
    ]
    assert len(last) == 2
    done(p, last, 5.0)
    assert p.transfers() == [("t1", PState.DELIVERED)]
    assert p.held_blocks == 4


def test_a_last_increment_with_no_new_block_still_commits() -> None:
    p = make()
    p.receive(0.0, D, register(1))
    p.kv_ready(1.0, "t1", [[1, 2]], final=False)
    done(p, writes(p.drain()), 1.5)
    p.kv_ready(2.0, "t1", [[1, 2]])
    (commit,) = writes(p.drain())
    assert commit.first == (2,) and commit.notice is not None  # the notice alone


def test_increments_must_extend_the_blocks_before_them() -> None:
    p = make()
    p.kv_ready(1.0, "t1", [[1, 2]], final=False)
    for bad in ([[2, 1, 3]], [[1]], [[5, 6, 7]]):
        with pytest.raises(LocalProtocolError, match="must extend"):
            p.kv_ready(2.0, "t1", bad, final=False)
    p.kv_ready(2.0, "t1", [[1, 2]], final=False)
    assert p.stats()["kv_increment_duplicate"] == 1
    p.kv_ready(3.0, "t1", [[1, 2, 3]])
    with pytest.raises(LocalProtocolError, match="an increment after the last"):
        p.kv_ready(4.0, "t1", [[1, 2, 3]], final=False)
    assert p.held_blocks == 3


def test_a_partial_source_has_no_hold_timer_and_is_never_released_by_one() -> None:
    p = make()
    p.kv_ready(1.0, "t1", [[1, 2]], final=False)
    assert p.transfers() == [("t1", PState.HOLDING)]
    assert p.next_deadline() is None  # the prefill still computes: nothing expires
    p.kv_ready(2.0, "t1", [[1, 2, 3]])
    assert p.next_deadline() == 12.0  # the hold starts at the last increment
    p.handle_timer(12.0)
    (rel,) = [o for o in p.drain() if isinstance(o, SourceReleased)]
    assert rel.blocks == ((1, 2, 3),) and rel.outcome is ReleaseOutcome.EXPIRED


def test_preemption_mid_stream_writes_the_new_epoch_from_the_first_block() -> None:
    p = make()
    p.receive(0.0, D, register(1))
    p.kv_ready(1.0, "t1", [[1, 2]], final=False)
    (w1,) = writes(p.drain())
    p.receive(1.5, D, Withdraw("t1", 1))  # preempted while the increment is in flight
    p.receive(1.6, D, register(2))
    assert writes(p.drain()) == []
    p.kv_ready(1.7, "t1", [[1, 2, 3]], final=False)  # nothing more of epoch 1
    assert writes(p.drain()) == []
    out = done(p, [w1], 2.0)
    assert Settled("t1", 1) in sent(out)
    (w2,) = writes(out)
    assert (w2.epoch, w2.first, w2.src_blocks, w2.notice) == (2, (), ((1, 2, 3),), None)


def test_a_withdraw_between_increments_is_settled_at_once() -> None:
    p = make()
    p.receive(0.0, D, register(1))
    p.kv_ready(1.0, "t1", [[1]], final=False)
    done(p, writes(p.drain()), 1.2)
    p.receive(1.5, D, Withdraw("t1", 1))
    assert sent(p.drain()) == [Settled("t1", 1)]
    assert p.transfers() == [("t1", PState.HOLDING)]
    p.kv_ready(2.0, "t1", [[1, 2]], final=False)
    assert writes(p.drain()) == []


def test_a_newer_registration_between_increments_takes_over_at_once() -> None:
    p = make()
    p.receive(0.0, D, register(1))
    p.kv_ready(1.0, "t1", [[1]], final=False)
    done(p, writes(p.drain()), 1.2)
    p.receive(1.5, D, register(2))
    out = p.drain()
    assert Settled("t1", 1) in sent(out)
    (w,) = writes(out)
    assert (w.epoch, w.first) == (2, ())


def test_the_lease_running_out_mid_stream_refuses_the_epoch_and_keeps_the_source() -> None:
    p = make()
    p.receive(0.0, D, register(1, lease=2.0))
    p.kv_ready(0.5, "t1", [[1]], final=False)
    done(p, writes(p.drain()), 0.8)
    p.handle_timer(2.0)
    assert sent(p.drain()) == [Rejected("t1", 1, RejectReason.LEASE_EXPIRED)]
    assert p.transfers() == [("t1", PState.HOLDING)]
    p.kv_ready(3.0, "t1", [[1, 2]], final=False)
    assert writes(p.drain()) == []  # no increment of an ended epoch
    p.receive(3.5, D, register(2))
    (w,) = writes(p.drain())
    assert (w.epoch, w.first, w.src_blocks) == (2, (), ((1, 2),))


def test_a_long_prefill_renews_the_lease_while_it_streams() -> None:
    p = make()
    p.receive(0.0, D, register(1, lease=20.0))
    p.kv_ready(1.0, "t1", [[1]], final=False)
    (w,) = writes(p.drain())
    p.handle_timer(10.0)  # halfway, with the increment still in flight
    assert sent(p.drain()) == [Renew("t1", 1)]
    p.receive(10.5, D, Extend("t1", 1, 0, 30.0))
    p.kv_ready(11.0, "t1", [[1, 2]], final=False)
    # Past the first lease: the extended one holds.
    (w2,) = writes(done(p, [w], 21.0))
    assert w2.not_after == 40.5 and w2.first == (1,)


def test_a_failed_increment_fails_the_epoch_and_the_source_comes_back_at_the_end() -> None:
    p = make()
    p.receive(0.0, D, register(1))
    p.kv_ready(1.0, "t1", [[1]], final=False)
    (w,) = writes(p.drain())
    p.write_failed(1.5, "t1", 1, w.route.source, 0, "link down")
    out = p.drain()
    assert [type(m) for m in sent(out)] == [WriteFailed, Settled]
    assert not [o for o in out if isinstance(o, SourceReleased)]  # still computing
    assert p.held_blocks == 1
    p.kv_ready(2.0, "t1", [[1, 2]])
    (rel,) = [o for o in p.drain() if isinstance(o, SourceReleased)]
    assert rel.outcome is ReleaseOutcome.FAILED and rel.blocks == ((1, 2),)
    assert p.held_blocks == 0


def test_an_abort_mid_stream_gives_the_source_back_once_the_increment_settles() -> None:
    p = make()
    p.receive(0.0, D, register(1))
    p.kv_ready(1.0, "t1", [[1, 2]], final=False)
    (w,) = writes(p.drain())
    p.abort(1.5, "t1")
    assert not [o for o in p.drain() if isinstance(o, SourceReleased)]
    (rel,) = [o for o in done(p, [w], 2.0) if isinstance(o, SourceReleased)]
    assert rel.blocks == ((1, 2),) and p.held_blocks == 0


def test_a_pull_registration_is_lent_only_the_whole_source() -> None:
    p = make()
    p.receive(0.0, D, register(1, mode=Mode.PULL))
    p.kv_ready(1.0, "t1", [[1]], final=False)
    assert p.transfers() == [("t1", PState.WAIT_REST)] and sent(p.drain()) == []
    p.kv_ready(2.0, "t1", [[1, 2]])
    (announce,) = sent(p.drain())
    assert announce.blocks == ((1, 2),)  # type: ignore[attr-defined]


# --- the explorer, with increments and seeded bugs --------------------------------


def test_every_interleaving_of_two_increments_keeps_the_invariants() -> None:
    result = explore(transfers=1, increments=2)
    assert result.terminal_states >= 4 and result.states > 15_000


def _commit_early(self: Producer, now: float, rec: Any, inp: Any) -> None:
    partial, rec.partial = rec.partial, False
    try:
        _WRITE(self, now, rec, inp)
    finally:
        rec.partial = partial


_WRITE = Producer._write


def test_the_explorer_catches_a_notice_on_an_early_increment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded bug: every increment carries the notice (a commit before the
    rest is written). The consumer's Ready would come before all its KV."""
    monkeypatch.setattr(Producer, "_write", _commit_early)
    with pytest.raises(InvariantViolation, match=r"I2|I4"):
        explore(transfers=1, increments=2, preemptions=0, duplicates=0)


def test_the_explorer_catches_an_increment_written_after_a_withdraw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded bug: increments keep going to an epoch the consumer withdrew."""

    def blind(self: Producer, rec: Any, pair: Any) -> bool:
        return (
            rec.src is not None
            and pair not in rec.committed
            and (not rec.partial or rec.sent.get(pair) != tuple(map(len, rec.src)))
        )

    monkeypatch.setattr(Producer, "_next_increment", blind)
    with pytest.raises(InvariantViolation, match=r"I1|I4"):
        explore(transfers=1, increments=2, duplicates=0)


def test_the_lease_running_out_while_an_increment_is_in_flight_ends_the_epoch() -> None:
    """No increment starts past the lease, even when the timer fires late or a
    write settles after it: the epoch ends once its writes settle (Settled),
    and the source is held for a newer registration."""
    p = make()
    p.receive(0.0, D, register(1, lease=20.0))
    p.kv_ready(1.0, "t1", [[1]], final=False)
    (w,) = writes(p.drain())
    p.kv_ready(2.0, "t1", [[1, 2]], final=False)
    p.handle_timer(25.0)  # the renewal timer, fired late (a stall): no Renew now
    assert sent(p.drain()) == []
    out = done(p, [w], 26.0)
    assert writes(out) == [] and sent(out) == [Settled("t1", 1)]
    assert p.transfers() == [("t1", PState.HOLDING)]
    assert p.stats()["lease_over_mid_stream"] == 1
    p.kv_ready(27.0, "t1", [[1, 2, 3]])
    p.receive(27.5, D, register(2))
    (w2,) = writes(p.drain())
    assert (w2.epoch, w2.first, w2.notice is not None) == (2, (), True)
