"""The control channel's link machine (kvpush/runtime/_link.py) under a fake
clock: dials and backoff, the simultaneous open and its tie-break, the loss
window, forgetting, and the refusal of every input its table lacks."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

import kvpush.runtime._link
from kvpush.protocol import LocalProtocolError
from kvpush.runtime._link import TABLE, Effect, Input, Link, State, Timer

E, In, S = Effect, Input, State
LOST_AFTER = 5.0
ROUTE = ("127.0.0.1", 9000)


def link(me: str = "a", peer: str = "b", *, routed: bool = True) -> Link:
    """A link whose n-th backoff is ``0.1 * 2**n`` seconds (no jitter)."""
    lk = Link(peer, me, LOST_AFTER, lambda n: 0.1 * 2**n)
    if routed:
        lk.route = ROUTE
    return lk


def state_of(lk: Link) -> State:
    """``lk.state``, read through a call (mypy would narrow the attribute)."""
    return lk.state


def up(lk: Link) -> bool:
    return lk.up


def dial_up(lk: Link, now: float, *, instance: int = 7, conn_id: int = 11) -> list[Effect]:
    """Dial, connect and get an ack: the effects of the ack."""
    if state_of(lk) is not S.DIALING:
        assert E.DIAL in lk.step(now, In.DIAL)
    assert lk.step(now, In.CONNECTED) == [E.SEND_PREAMBLE]
    assert state_of(lk) is S.PREAMBLE
    return lk.step(now, In.ACK_OK, instance=instance, conn_id=conn_id)


def test_a_dial_that_succeeds_reports_the_peer_up() -> None:
    lk = link()
    assert state_of(lk) is S.IDLE and not up(lk)
    assert lk.step(0.0, In.DIAL) == [E.DIAL]
    assert state_of(lk) is S.DIALING
    assert dial_up(lk, 0.1) == [E.ADOPT, E.REPORT_UP]
    assert state_of(lk) is S.UP and up(lk)
    assert (lk.instance, lk.conn_id) == (7, 11)
    assert lk.next_deadline() is None
    assert lk.step(0.2, In.DIAL) == []  # a new route while up: used at the next dial


def test_failed_dials_back_off_and_retry_on_the_timer_or_a_new_route() -> None:
    lk = link()
    lk.step(0.0, In.DIAL)
    assert lk.step(1.0, In.DIAL_FAILED) == []
    assert state_of(lk) is S.BACKOFF and lk.next_deadline() == pytest.approx(1.1)
    assert lk.handle_timer(1.05) == []  # not yet
    assert lk.handle_timer(1.1) == [E.DIAL]
    assert state_of(lk) is S.DIALING and lk.next_deadline() is None
    lk.step(1.2, In.CONNECTED)
    assert lk.step(1.3, In.ACK_BAD) == [E.REFUSE]  # the wrong peer answered
    assert state_of(lk) is S.BACKOFF and lk.next_deadline() == pytest.approx(1.5)  # 0.2: doubled
    assert lk.step(1.4, In.DIAL) == [E.DIAL]  # a new route cuts the wait short
    assert state_of(lk) is S.DIALING and Timer.RETRY not in lk.timers
    lk.step(1.5, In.DIAL_FAILED)
    assert lk.next_deadline() == pytest.approx(1.9)  # 0.4
    assert lk.step(1.6, In.INBOUND, instance=3, conn_id=5) == [E.ADOPT, E.REPORT_UP]
    assert state_of(lk) is S.UP and lk.attempt == 0 and lk.next_deadline() is None


@pytest.mark.parametrize("stage", [S.DIALING, S.PREAMBLE])
def test_simultaneous_open_settles_on_the_smaller_names_dial(stage: State) -> None:
    a, b = link("a", "b"), link("b", "a")
    for lk in (a, b):
        lk.step(0.0, In.DIAL)
        if stage is S.PREAMBLE:
            lk.step(0.0, In.CONNECTED)
    # b's dial reaches a while a's own is in flight: a's name is smaller, a refuses.
    assert a.inbound(0.1, instance=2, conn_id=22, supersedes=0) == [E.REFUSE]
    assert state_of(a) is stage
    # a's dial reaches b: b's is larger, b adopts a's dial (and acks it).
    assert b.inbound(0.1, instance=1, conn_id=11, supersedes=0) == [E.ADOPT, E.REPORT_UP]
    assert state_of(b) is S.UP and b.conn_id == 11
    # a gets the ack of its dial; b's own dial goes on and is refused by a.
    if stage is S.DIALING:
        assert a.step(0.2, In.CONNECTED) == [E.SEND_PREAMBLE]
        assert b.step(0.2, In.CONNECTED) == [E.SEND_PREAMBLE]
    assert a.step(0.2, In.ACK_OK, instance=2, conn_id=11) == [E.ADOPT, E.REPORT_UP]
    assert b.step(0.3, In.DIAL_FAILED) == []
    assert (state_of(a), state_of(b)) == (S.UP, S.UP)
    assert a.conn_id == b.conn_id == 11  # one connection, a's
    assert b.attempt == 0 and b.next_deadline() is None


def test_a_late_ack_after_the_peers_dial_won_is_closed() -> None:
    b = link("b", "a")
    b.step(0.0, In.DIAL)
    b.step(0.0, In.CONNECTED)
    b.inbound(0.1, instance=1, conn_id=11, supersedes=0)
    assert b.step(0.2, In.ACK_OK, instance=1, conn_id=33) == [E.REFUSE]
    assert b.conn_id == 11


def test_a_dial_while_up_is_refused_unless_it_replaces_or_restarts() -> None:
    lk = link(routed=False)
    assert lk.inbound(0.0, instance=7, conn_id=11, supersedes=0) == [E.ADOPT, E.REPORT_UP]
    # A stale duplicate from the same instance, naming no connection it lost.
    assert lk.inbound(0.1, instance=7, conn_id=12, supersedes=0) == [E.REFUSE]
    assert lk.inbound(0.1, instance=7, conn_id=12, supersedes=99) == [E.REFUSE]
    # A redial that saw connection 11 die: it replaces it, the peer stays up.
    assert lk.inbound(0.2, instance=7, conn_id=13, supersedes=11) == [E.CLOSE_OLD, E.ADOPT]
    assert lk.conn_id == 13
    # A new instance (a restart): the old one is lost, the new one up.
    effects = lk.inbound(0.3, instance=8, conn_id=14, supersedes=0)
    assert effects == [E.CLOSE_OLD, E.REPORT_LOST, E.ADOPT, E.REPORT_UP]
    assert lk.reason == "peer restarted"
    assert (state_of(lk), lk.instance, lk.conn_id) == (S.UP, 8, 14)


def test_a_routed_peer_that_comes_back_within_the_window_is_not_lost() -> None:
    lk = link()
    dial_up(lk, 0.0)
    assert lk.dropped(10.0, "closed by peer") == [E.DIAL]  # redial at once
    assert state_of(lk) is S.DIALING and up(lk)  # losing: up until the window ends
    assert lk.timers == {Timer.LOSS: 15.0}
    lk.step(10.1, In.DIAL_FAILED)
    assert state_of(lk) is S.BACKOFF and lk.next_deadline() == pytest.approx(10.2)
    assert lk.handle_timer(10.2) == [E.DIAL]  # backoff -> dialing, window still open
    assert lk.timers == {Timer.LOSS: 15.0}
    assert dial_up(lk, 11.0, conn_id=12) == [E.ADOPT]  # same instance: no event at all
    assert state_of(lk) is S.UP and lk.timers == {}
    assert lk.handle_timer(15.0) == []


def test_a_routed_peer_is_lost_once_then_redialed_and_reported_up_again() -> None:
    lk = link()
    dial_up(lk, 0.0)
    lk.dropped(10.0, "write stalled")
    lk.step(10.0, In.DIAL_FAILED)  # retry at 10.1
    lk.handle_timer(10.1)
    lk.step(10.2, In.DIAL_FAILED)  # retry at 10.4
    assert lk.handle_timer(14.9) == [E.DIAL]
    lk.step(14.9, In.DIAL_FAILED)  # retry at 15.3
    assert lk.handle_timer(15.0) == [E.REPORT_LOST]  # the window ends in BACKOFF
    assert lk.reason == "write stalled"
    assert state_of(lk) is S.BACKOFF and not up(lk)  # kept, and redialed
    assert lk.handle_timer(16.0) == [E.DIAL]
    assert dial_up(lk, 16.0, conn_id=12) == [E.ADOPT, E.REPORT_UP]


def test_the_loss_and_a_retry_due_together_fire_the_loss_first() -> None:
    lk = link()
    dial_up(lk, 0.0)
    lk.dropped(0.0, "x")
    lk.step(4.95, In.DIAL_FAILED)  # retry at 5.05, loss at 5.0
    assert lk.handle_timer(6.0) == [E.REPORT_LOST, E.DIAL]


def test_a_restarted_peer_answering_our_redial_is_lost_and_up_again() -> None:
    lk = link()
    dial_up(lk, 0.0, instance=7)
    lk.dropped(1.0, "closed by peer")
    effects = dial_up(lk, 1.5, instance=9, conn_id=12)
    assert effects == [E.REPORT_LOST, E.ADOPT, E.REPORT_UP]
    assert lk.reason == "peer restarted" and lk.timers == {}


def test_an_unrouted_peer_waits_for_a_dial_back_then_is_forgotten() -> None:
    lk = link(routed=False)
    lk.inbound(0.0, instance=7, conn_id=11, supersedes=0)
    assert lk.dropped(1.0, "closed by peer") == []
    assert state_of(lk) is S.LOSING and up(lk) and lk.next_deadline() == 6.0
    assert lk.inbound(2.0, instance=7, conn_id=12, supersedes=11) == [E.ADOPT]  # dialed back
    lk.dropped(3.0, "nothing received")
    assert lk.handle_timer(7.9) == []
    assert lk.handle_timer(8.0) == [E.REPORT_LOST, E.FORGET]
    assert state_of(lk) is S.GONE and not up(lk) and lk.next_deadline() is None
    with pytest.raises(LocalProtocolError):
        lk.inbound(9.0, instance=7, conn_id=13, supersedes=0)
    assert state_of(lk) is S.GONE


def test_a_route_given_while_losing_redials() -> None:
    lk = link(routed=False)
    lk.inbound(0.0, instance=7, conn_id=11, supersedes=0)
    lk.dropped(1.0, "closed by peer")
    lk.route = ROUTE
    assert lk.step(1.5, In.DIAL) == [E.DIAL]
    assert state_of(lk) is S.DIALING and lk.timers == {Timer.LOSS: 6.0}


def test_every_input_the_table_lacks_is_refused_and_changes_nothing() -> None:
    refused = 0
    for state in State:
        for inp in Input:
            if (state, inp) in TABLE:
                continue
            lk = link()
            lk.state = state
            with pytest.raises(LocalProtocolError, match=inp.name):
                lk.step(0.0, inp)
            assert state_of(lk) is state and lk.timers == {}
            refused += 1
    assert refused == len(State) * len(Input) - len(TABLE)
    assert not any(state is S.GONE for state, _ in TABLE)  # the end


def test_the_table_arms_retry_only_into_backoff_and_loss_only_on_a_drop() -> None:
    for (state, inp), row in TABLE.items():
        if row.timer is Timer.RETRY:
            assert row.next is S.BACKOFF, (state, inp)
        if row.timer is Timer.LOSS:
            assert (state, inp) in ((S.UP, In.DROPPED), (S.UP, In.DROPPED_UNROUTED))


def _inputs(lk: Link) -> list[Input]:
    """What the channel may feed ``lk`` now (the network's choice; not the timers)."""
    drops = (In.DROPPED, In.DROPPED_UNROUTED, In.RETRY_DUE, In.LOSS_DUE)
    allowed = [i for (s, i) in TABLE if s is lk.state and i not in drops]
    if state_of(lk) is S.UP:
        allowed.append(In.DROPPED if lk.route else In.DROPPED_UNROUTED)
    return allowed


@pytest.mark.parametrize("seed", range(20))
def test_random_walks_keep_the_links_invariants(seed: int) -> None:
    """Up and lost alternate (once per loss); RETRY runs exactly in BACKOFF;
    LOSS never while UP; ``up`` is UP or the loss window."""
    rng = random.Random(seed)
    lk = link(routed=rng.random() < 0.7)
    if lk.route is None:
        lk.step(0.0, In.INBOUND, instance=1, conn_id=1)
    now, reported_up = 0.0, lk.up
    for _ in range(300):
        now += rng.choice((0.01, 0.3, 2.0, 6.0))
        effects = lk.handle_timer(now)
        if state_of(lk) is not S.GONE and rng.random() < 0.8:
            inp = rng.choice(_inputs(lk))
            kw = {"instance": rng.choice((1, 1, 2)), "conn_id": rng.randrange(1, 99)}
            effects += lk.step(now, inp, **kw)
        for effect in effects:
            if effect is E.REPORT_UP:
                assert not reported_up
                reported_up = True
            elif effect is E.REPORT_LOST:
                assert reported_up
                reported_up = False
        assert reported_up == lk.up
        assert (Timer.RETRY in lk.timers) == (state_of(lk) is S.BACKOFF)
        assert not (state_of(lk) is S.UP and Timer.LOSS in lk.timers)
        if state_of(lk) is S.GONE:
            assert lk.route is None and E.FORGET in effects
            break


def test_the_link_machine_is_sans_io() -> None:
    """Standard library and the core only: no anyio, socket, asyncio, clock."""
    tree = ast.parse(Path(kvpush.runtime._link.__file__).read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    stdlib = {"__future__", "enum", "collections.abc", "dataclasses", "typing"}
    assert modules <= stdlib | {"kvpush.protocol"}
