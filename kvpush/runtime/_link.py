"""The control channel's per-peer link machine: sans-IO, one table.

A :class:`Link` decides a peer's connection life and nothing else does: when
to dial, which of two crossing dials wins, which connection to adopt or
refuse, when the peer is reported up and when lost, when it is forgotten.
It does no I/O and reads no clock: each call takes ``now`` and returns the
:class:`Effect` list for the caller (the channel, :mod:`._channel`) to carry
out; :meth:`Link.next_deadline` and :meth:`Link.handle_timer` are its timer.
An input its :data:`TABLE` lacks raises :class:`LocalProtocolError` (the
caller classifies whatever the network does into inputs the table has).

The rules the rows encode, and why (losing is a timer too): docs/runtime.md,
"The control channel".
Only the channel feeds a link, one dial at a time, so a dial's results reach
it in the order sent.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from kvpush.protocol import LocalProtocolError

__all__ = ("TABLE", "Effect", "Input", "Link", "Row", "State", "Timer")


class State(enum.Enum):
    #: Nothing yet: a peer just added (a routed one before the channel opens).
    IDLE = "idle"
    #: Our dial is opening its TCP connection.
    DIALING = "dialing"
    #: Our preamble is sent; the ack is awaited.
    PREAMBLE = "preamble"
    #: A connection is adopted: frames flow.
    UP = "up"
    #: An unrouted peer's connection dropped; it may dial back within the window.
    LOSING = "losing"
    #: Our last dial failed; ``Timer.RETRY`` runs.
    BACKOFF = "backoff"
    #: Forgotten (an unrouted peer lost): the end.
    GONE = "gone"


class Input(enum.Enum):
    #: A route was given (or the channel opened with one).
    DIAL = "dial"
    #: Our dial's TCP connection is open.
    CONNECTED = "connected"
    #: The ack names the peer and our connection (preamble ok), or not (bad).
    ACK_OK = "ack_ok"
    ACK_BAD = "ack_bad"
    #: Our dial failed: refused, timed out, closed, garbled.
    DIAL_FAILED = "dial_failed"
    #: The peer dialed us, with no dial or connection of ours in the way.
    INBOUND = "inbound"
    #: The peer dialed us while we dial it: our name is smaller (ours wins) or larger.
    TIE_WON = "tie_won"
    TIE_LOST = "tie_lost"
    #: The peer dialed us while UP, from the same instance and naming no lost connection.
    DUPLICATE = "duplicate"
    #: ... naming the connection we hold (it saw it die), or from a new instance.
    REPLACE = "replace"
    #: The connection failed; we have a route (redial) or not (wait for the peer).
    DROPPED = "dropped"
    DROPPED_UNROUTED = "dropped_unrouted"
    #: The timers.
    RETRY_DUE = "retry_due"
    LOSS_DUE = "loss_due"


class Timer(enum.Enum):
    #: BACKOFF's: dial again (cancelled on leaving BACKOFF).
    RETRY = "retry"
    #: From a drop: report the peer lost (cancelled by the next adoption).
    LOSS = "loss"


class Effect(enum.Enum):
    #: Dial the route (the channel dials while the link is DIALING).
    DIAL = "dial"
    #: Write our preamble on the dial's connection.
    SEND_PREAMBLE = "send_preamble"
    #: The connection handed in is the peer's now (an inbound one gets its ack).
    ADOPT = "adopt"
    #: Close the connection handed in (an inbound one without an ack).
    REFUSE = "refuse"
    #: Close the connection the adopted one replaces.
    CLOSE_OLD = "close_old"
    #: :class:`PeerConnected`; :class:`PeerLost` (``Link.reason``), its queue discarded.
    REPORT_UP = "report_up"
    REPORT_LOST = "report_lost"
    #: Drop the peer from the table: sends raise :class:`PeerUnreachable`.
    FORGET = "forget"


class Row(NamedTuple):
    """The next state, the effects in order, and the timer the row arms."""

    next: State
    effects: tuple[Effect, ...] = ()
    timer: Timer | None = None


S, In, E = State, Input, Effect
_ADOPT = (E.ADOPT,)
_REFUSE = (E.REFUSE,)
_LOST = (E.REPORT_LOST,)

#: ``(state, input) -> Row``. ``ADOPT`` expands when it runs: ``REPORT_UP``
#: unless the peer is up, and ``REPORT_LOST`` first if it is up as another
#: instance (``Link._adopt``).
TABLE: Final[dict[tuple[State, Input], Row]] = {
    (S.IDLE, In.DIAL): Row(S.DIALING, (E.DIAL,)),
    (S.IDLE, In.INBOUND): Row(S.UP, _ADOPT),
    (S.DIALING, In.DIAL): Row(S.DIALING),
    (S.DIALING, In.CONNECTED): Row(S.PREAMBLE, (E.SEND_PREAMBLE,)),
    (S.DIALING, In.DIAL_FAILED): Row(S.BACKOFF, (), Timer.RETRY),
    (S.DIALING, In.TIE_WON): Row(S.DIALING, _REFUSE),
    (S.DIALING, In.TIE_LOST): Row(S.UP, _ADOPT),
    (S.DIALING, In.LOSS_DUE): Row(S.DIALING, _LOST),
    # A dial that was under way when the connection it lost to dropped.
    (S.DIALING, In.ACK_OK): Row(S.UP, _ADOPT),
    (S.DIALING, In.ACK_BAD): Row(S.BACKOFF, _REFUSE, Timer.RETRY),
    (S.PREAMBLE, In.DIAL): Row(S.PREAMBLE),
    (S.PREAMBLE, In.ACK_OK): Row(S.UP, _ADOPT),
    (S.PREAMBLE, In.ACK_BAD): Row(S.BACKOFF, _REFUSE, Timer.RETRY),
    (S.PREAMBLE, In.DIAL_FAILED): Row(S.BACKOFF, (), Timer.RETRY),
    (S.PREAMBLE, In.TIE_WON): Row(S.PREAMBLE, _REFUSE),
    (S.PREAMBLE, In.TIE_LOST): Row(S.UP, _ADOPT),
    (S.PREAMBLE, In.LOSS_DUE): Row(S.PREAMBLE, _LOST),
    (S.UP, In.DIAL): Row(S.UP),
    (S.UP, In.DUPLICATE): Row(S.UP, _REFUSE),
    (S.UP, In.REPLACE): Row(S.UP, (E.CLOSE_OLD, E.ADOPT)),
    (S.UP, In.DROPPED): Row(S.DIALING, (E.DIAL,), Timer.LOSS),
    (S.UP, In.DROPPED_UNROUTED): Row(S.LOSING, (), Timer.LOSS),
    # Our dial that lost the race goes on (the peer refuses it, or we close it).
    (S.UP, In.CONNECTED): Row(S.UP, (E.SEND_PREAMBLE,)),
    (S.UP, In.ACK_OK): Row(S.UP, _REFUSE),
    (S.UP, In.ACK_BAD): Row(S.UP, _REFUSE),
    (S.UP, In.DIAL_FAILED): Row(S.UP),
    (S.LOSING, In.DIAL): Row(S.DIALING, (E.DIAL,)),
    (S.LOSING, In.INBOUND): Row(S.UP, _ADOPT),
    (S.LOSING, In.LOSS_DUE): Row(S.GONE, (E.REPORT_LOST, E.FORGET)),
    (S.BACKOFF, In.DIAL): Row(S.DIALING, (E.DIAL,)),
    (S.BACKOFF, In.RETRY_DUE): Row(S.DIALING, (E.DIAL,)),
    (S.BACKOFF, In.INBOUND): Row(S.UP, _ADOPT),
    (S.BACKOFF, In.LOSS_DUE): Row(S.BACKOFF, _LOST),
}


@dataclass(eq=False)
class Link:
    """One peer's link, from this channel's side (``me``)."""

    name: str
    me: str
    #: Seconds from a drop to ``REPORT_LOST`` unless a connection is adopted.
    lost_after: float
    #: The pause after failed dial number ``n`` (0 for the first): the backoff.
    delay: Callable[[int], float]
    route: tuple[str, int] | None = None
    state: State = State.IDLE
    #: The peer's instance and the connection adopted last (a redial supersedes it).
    instance: int | None = None
    conn_id: int = 0
    #: Failed dials since the last adoption.
    attempt: int = 0
    #: Why the connection dropped: the reason ``REPORT_LOST`` gives.
    reason: str = ""
    timers: dict[Timer, float] = field(default_factory=dict)

    @property
    def up(self) -> bool:
        """Reported up: from ``REPORT_UP`` until ``REPORT_LOST``."""
        return self.state is State.UP or Timer.LOSS in self.timers

    def step(self, now: float, inp: Input, *, instance: int = 0, conn_id: int = 0) -> list[Effect]:
        """Apply ``inp`` (``instance`` and ``conn_id``: the connection handed in)."""
        row = TABLE.get((self.state, inp))
        if row is None:
            raise LocalProtocolError(f"link {self.name}: {inp.name} in state {self.state.name}")
        was_up = self.up
        self.state = row.next
        if row.next is not State.BACKOFF:
            self.timers.pop(Timer.RETRY, None)
        out: list[Effect] = []
        for effect in row.effects:
            if effect is Effect.ADOPT:
                out += self._adopt(was_up, instance, conn_id)
            else:
                out.append(effect)
        if Effect.REPORT_LOST in row.effects:
            del self.timers[Timer.LOSS]
        if row.timer is Timer.RETRY:
            self.timers[Timer.RETRY] = now + self.delay(self.attempt)
            self.attempt += 1
        elif row.timer is Timer.LOSS:
            self.timers[Timer.LOSS] = now + self.lost_after
        return out

    def _adopt(self, was_up: bool, instance: int, conn_id: int) -> list[Effect]:
        restarted = was_up and self.instance is not None and instance != self.instance
        self.timers.pop(Timer.LOSS, None)
        self.instance, self.conn_id, self.attempt = instance, conn_id, 0
        if restarted:
            self.reason = "peer restarted"
            return [Effect.REPORT_LOST, Effect.ADOPT, Effect.REPORT_UP]
        return [Effect.ADOPT] if was_up else [Effect.ADOPT, Effect.REPORT_UP]

    def inbound(self, now: float, instance: int, conn_id: int, supersedes: int) -> list[Effect]:
        """The peer dialed us (its preamble): the tie-break and the duplicate check."""
        if self.state is State.UP:
            duplicate = instance == self.instance and supersedes != self.conn_id
            inp = Input.DUPLICATE if duplicate else Input.REPLACE
        elif self.state in (State.DIALING, State.PREAMBLE):
            inp = Input.TIE_WON if self.me < self.name else Input.TIE_LOST
        else:
            inp = Input.INBOUND
        return self.step(now, inp, instance=instance, conn_id=conn_id)

    def dropped(self, now: float, reason: str) -> list[Effect]:
        """The adopted connection failed."""
        self.reason = reason
        return self.step(now, Input.DROPPED if self.route else Input.DROPPED_UNROUTED)

    def next_deadline(self) -> float | None:
        return min(self.timers.values(), default=None)

    def handle_timer(self, now: float) -> list[Effect]:
        """Fire the timers due at ``now`` (the loss first)."""
        out: list[Effect] = []
        for timer, inp in ((Timer.LOSS, Input.LOSS_DUE), (Timer.RETRY, Input.RETRY_DUE)):
            due = self.timers.get(timer)
            if due is not None and due <= now:
                out += self.step(now, inp)
        return out
