"""Every state machine of the core, as tables of the one engine (``_machine.py``).

Inputs whose meaning depends on a guard (e.g. "the last expected completion")
are distinct input members, so the table alone says how state moves and what
it does; the endpoints compute which input applies and define the effects.
``docs/protocol.md`` shows these tables (``tests/test_docs.py`` renders them).
"""

from __future__ import annotations

import enum
import math
from operator import attrgetter
from typing import Any

from ._machine import Machine, Row

__all__ = (
    "CONSUMER_PULL",
    "CONSUMER_PUSH",
    "PEER",
    "PRODUCER",
    "CInput",
    "CState",
    "PInput",
    "PState",
    "PeerInput",
    "PeerState",
    "Timer",
)


class _Enum(enum.Enum):
    """Hashed by identity (members are singletons): ``Enum.__hash__`` is a Python
    call, and every transition looks up a ``(state, input)`` key."""

    __hash__ = object.__hash__


class Timer(_Enum):
    """The kinds of timer an endpoint arms (one heap, lazily invalidated)."""

    #: Consumer: the reservation is not ready in time.
    DEADLINE = "deadline"
    #: No write (consumer) or read (producer) of the epoch can land any more,
    #: unless its initiator is connected and silent (consumer: ``SUSPECT``).
    QUARANTINE = "quarantine"
    #: Producer: forget an unused record or a tombstone.
    EXPIRE = "expire"
    #: Producer: a waiting registration's lease ran out, or is half gone
    #: (send a ``Renew``).
    LEASE = "lease"
    #: Producer: ready KV found no usable registration in time, or delivered
    #: KV no acknowledgment.
    HOLD = "hold"
    #: Consumer: send a registration the producer dropped after a stall again
    #: (``RETRY_WAIT``), or the next probe of a suspect epoch (``SUSPECT``).
    RETRY = "retry"
    #: Handshake: our hello went unanswered; send it again (``HELLO_SENT``).
    HELLO_RETRY = "hello_retry"
    #: An op this side posted (producer: a write; consumer: a read) is still
    #: in flight ``op_bound`` after it was handed over: ask for its cancel.
    OVERDUE = "overdue"


# --- handshake (both roles) ----------------------------------------------------


class PeerState(_Enum):
    #: No handshake yet, or the connection was lost.
    DISCONNECTED = "disconnected"
    #: Our hello is out; waiting for the peer's.
    HELLO_SENT = "hello_sent"
    #: Both hellos exchanged and compatible.
    READY = "ready"
    #: The handshake failed; transfers with this peer are refused.
    FAILED = "failed"


class PeerInput(_Enum):
    CONNECT = "connect"  #: local: start the handshake
    HELLO_OK = "hello_ok"  #: remote: a compatible hello
    HELLO_BAD = "hello_bad"  #: remote: an incompatible hello
    REJECT = "reject"  #: remote: the peer refused our hello
    LOST = "lost"  #: local: the connection was lost
    RETRY = "retry"  #: timer: our hello is unanswered; send it again


_S = PeerState
_H = PeerInput

#: Total, and without effects: the handshake sends and answers hellos around
#: the lookup. Its one timer, the hello's retry, backs off, so the hello's
#: send arms it (``Endpoint._send_hello``); leaving ``HELLO_SENT`` cancels it.
PEER: Machine[PeerState, PeerInput] = Machine(
    {
        (_S.DISCONNECTED, _H.CONNECT): Row(_S.HELLO_SENT),
        (_S.DISCONNECTED, _H.HELLO_OK): Row(_S.READY),
        (_S.DISCONNECTED, _H.HELLO_BAD): Row(_S.FAILED),
        (_S.DISCONNECTED, _H.REJECT): Row(_S.FAILED),
        (_S.HELLO_SENT, _H.HELLO_OK): Row(_S.READY),
        (_S.HELLO_SENT, _H.HELLO_BAD): Row(_S.FAILED),
        (_S.HELLO_SENT, _H.REJECT): Row(_S.FAILED),
        (_S.HELLO_SENT, _H.LOST): Row(_S.DISCONNECTED),
        (_S.READY, _H.HELLO_BAD): Row(_S.FAILED),
        (_S.READY, _H.REJECT): Row(_S.FAILED),
        (_S.READY, _H.LOST): Row(_S.DISCONNECTED),
        (_S.FAILED, _H.CONNECT): Row(_S.HELLO_SENT),
        (_S.FAILED, _H.HELLO_OK): Row(_S.READY),
        (_S.FAILED, _H.LOST): Row(_S.DISCONNECTED),
    },
    stays={
        _S.DISCONNECTED: (_H.LOST, _H.RETRY),
        _S.HELLO_SENT: (_H.CONNECT, _H.RETRY),
        _S.READY: (_H.CONNECT, _H.HELLO_OK, _H.RETRY),
        _S.FAILED: (_H.HELLO_BAD, _H.REJECT, _H.RETRY),
    },
)


# --- consumer: one reservation (transfer, epoch) --------------------------------


class CState(_Enum):
    #: Blocks reserved; the registration waits for the handshake.
    WAITING_PEER = "waiting_peer"
    #: Registration sent; waiting for completions (push) or the announce (pull).
    AWAITING = "awaiting"
    #: The producer dropped the registration after a stall of its own
    #: (``Rejected(STALLED)``: nothing was or will be taken); it is sent again,
    #: as a new attempt of the same epoch, once the producer's stall guard passed.
    RETRY_WAIT = "retry_wait"
    #: Pull: reads posted; waiting for them.
    READING = "reading"
    #: Pull: failed or withdrawn with reads in flight; waiting for them to settle.
    READ_DRAIN = "read_drain"
    #: Push: failed or withdrawn; waiting until no write can land (Settled,
    #: every pair settled, or the quarantine with the producer gone).
    DRAINING = "draining"
    #: Push: the quarantine passed, but the producer is connected and has not
    #: settled the epoch, so a write may still land (a stopped producer
    #: resumes): the blocks are held, counted as suspect, until it settles
    #: them, or it is gone and a fresh quarantine passed. It is asked again
    #: (``Withdraw``, a probe) a few times, in case its answer was lost.
    SUSPECT = "suspect"
    #: Terminal: every expected source completed; the blocks hold the KV.
    READY = "ready"
    #: Terminal: the blocks were handed back.
    RELEASED = "released"


class CInput(_Enum):
    PEER_READY = "peer_ready"  #: the handshake completed
    PEER_DOWN = "peer_down"  #: connection lost or handshake failed
    PREEMPT = "preempt"  #: local: withdraw this epoch (a newer one may follow)
    ABORT = "abort"  #: local: the request is gone
    DEADLINE = "deadline"  #: timer: not ready in time
    QUARANTINE = "quarantine"  #: timer: the quarantine passed, the producer is gone
    QUARANTINE_LIVE = "quarantine_live"  #: timer: the quarantine passed, producer connected
    RENEW = "renew"  #: producer: still computing; the deadline is extended
    COMPLETION = "completion"  #: an expected completion, not the last
    COMPLETION_LAST = "completion_last"  #: the last expected completion
    WRITE_FAILED = "write_failed"  #: producer: a write failed, not the last pair
    PAIRS_SETTLED = "pairs_settled"  #: every pair completed or failed
    SETTLED = "settled"  #: producer: nothing in flight, nothing will start
    REJECTED = "rejected"  #: producer: registration refused
    STALLED = "stalled"  #: producer: refused after its stall; retry (time and attempts left)
    RETRY = "retry"  #: timer: register again (RETRY_WAIT), or probe again (SUSPECT)
    PEER_ABORT = "peer_abort"  #: producer aborted the transfer
    ANNOUNCE = "announce"  #: pull: the producer's KV is ready
    READ_OK = "read_ok"  #: pull: a read finished, not the last
    READ_FAILED = "read_failed"  #: pull: a read failed, not the last
    READS_OK = "reads_ok"  #: pull: the last read finished, all succeeded
    READS_SETTLED = "reads_settled"  #: pull: the last outstanding read settled


_C = CState
_I = CInput

_deadline = (Timer.DEADLINE, attrgetter("deadline"))
_retry = (Timer.RETRY, attrgetter("retry_at"))

#: What both modes share: the timers, and the rows before the producer has
#: taken anything (nothing of the epoch was taken, and no attempt is out in
#: RETRY_WAIT, so the blocks are free at once, whatever ends it).
_CONSUMER_TIMERS = {
    _C.WAITING_PEER: (_deadline,),
    _C.AWAITING: (_deadline,),
    _C.RETRY_WAIT: (_deadline, _retry),
    _C.READING: (_deadline,),
    _C.DRAINING: ((Timer.QUARANTINE, attrgetter("quarantine_at")),),
    _C.SUSPECT: (_retry,),  # the next probe; none ends it
}
_CONSUMER_FIRES = {
    Timer.DEADLINE: _I.DEADLINE,
    Timer.RETRY: _I.RETRY,
    Timer.QUARANTINE: _I.QUARANTINE,
}
_CONSUMER_COMMON: dict[tuple[CState, CInput], Row[CState]] = {
    (_C.WAITING_PEER, _I.PEER_READY): Row(_C.AWAITING, "register"),
    (_C.WAITING_PEER, _I.PEER_DOWN): Row(_C.RELEASED, "fail", "release"),
    (_C.WAITING_PEER, _I.PREEMPT): Row(_C.RELEASED, "release"),
    (_C.WAITING_PEER, _I.ABORT): Row(_C.RELEASED, "release"),
    (_C.WAITING_PEER, _I.DEADLINE): Row(_C.RELEASED, "fail", "release"),
    (_C.AWAITING, _I.STALLED): Row(_C.RETRY_WAIT),
    (_C.RETRY_WAIT, _I.RETRY): Row(_C.AWAITING, "next_attempt", "register"),
    (_C.RETRY_WAIT, _I.PREEMPT): Row(_C.RELEASED, "send_withdraw", "release"),
    (_C.RETRY_WAIT, _I.ABORT): Row(_C.RELEASED, "send_abort", "release"),
    (_C.RETRY_WAIT, _I.DEADLINE): Row(_C.RELEASED, "fail", "send_abort", "release"),
    (_C.RETRY_WAIT, _I.PEER_DOWN): Row(_C.RELEASED, "fail", "release"),
    (_C.RETRY_WAIT, _I.PEER_ABORT): Row(_C.RELEASED, "fail", "release"),
}
#: A copy of the refused attempt answered again (SUPERSEDED, STALLED) changes nothing.
_RETRY_WAIT_STAYS = (_I.REJECTED, _I.STALLED)

CONSUMER_PUSH: Machine[CState, CInput] = Machine(
    {
        **_CONSUMER_COMMON,
        (_C.AWAITING, _I.COMPLETION_LAST): Row(_C.READY, "ready"),
        (_C.AWAITING, _I.WRITE_FAILED): Row(_C.DRAINING, "fail", "drain"),
        (_C.AWAITING, _I.PAIRS_SETTLED): Row(_C.RELEASED, "fail", "release"),
        (_C.AWAITING, _I.SETTLED): Row(_C.RELEASED, "fail", "release"),
        (_C.AWAITING, _I.REJECTED): Row(_C.RELEASED, "fail", "release"),
        (_C.AWAITING, _I.PEER_ABORT): Row(_C.DRAINING, "fail", "drain"),
        (_C.AWAITING, _I.PEER_DOWN): Row(_C.DRAINING, "fail", "drain"),
        (_C.AWAITING, _I.DEADLINE): Row(_C.DRAINING, "fail", "send_abort", "drain"),
        (_C.AWAITING, _I.PREEMPT): Row(_C.DRAINING, "send_withdraw", "drain"),
        (_C.AWAITING, _I.ABORT): Row(_C.DRAINING, "send_abort", "drain"),
        (_C.DRAINING, _I.PAIRS_SETTLED): Row(_C.RELEASED, "release"),
        (_C.DRAINING, _I.SETTLED): Row(_C.RELEASED, "release"),
        (_C.DRAINING, _I.REJECTED): Row(_C.RELEASED, "release"),
        (_C.DRAINING, _I.QUARANTINE): Row(_C.RELEASED, "release"),
        (_C.DRAINING, _I.QUARANTINE_LIVE): Row(_C.SUSPECT, "hold_suspect"),
        # No timer ends it, only a proof from the producer, or its loss,
        # after which a fresh quarantine runs (DRAINING).
        (_C.SUSPECT, _I.PAIRS_SETTLED): Row(_C.RELEASED, "drop_suspect", "release"),
        (_C.SUSPECT, _I.SETTLED): Row(_C.RELEASED, "drop_suspect", "release"),
        (_C.SUSPECT, _I.REJECTED): Row(_C.RELEASED, "drop_suspect", "release"),
        (_C.SUSPECT, _I.PEER_DOWN): Row(_C.DRAINING, "drop_suspect", "requarantine"),
        (_C.SUSPECT, _I.RETRY): Row(_C.SUSPECT, "probe"),
    },
    stays={
        _C.AWAITING: (_I.RENEW, _I.COMPLETION),
        _C.RETRY_WAIT: _RETRY_WAIT_STAYS,
        _C.DRAINING: (_I.COMPLETION, _I.WRITE_FAILED, _I.PEER_ABORT, _I.PEER_DOWN),
        _C.SUSPECT: (_I.COMPLETION, _I.WRITE_FAILED, _I.PEER_ABORT),
    },
    timers=_CONSUMER_TIMERS,
    fires=_CONSUMER_FIRES,
)

CONSUMER_PULL: Machine[CState, CInput] = Machine(
    {
        **_CONSUMER_COMMON,
        (_C.AWAITING, _I.ANNOUNCE): Row(_C.READING),
        (_C.AWAITING, _I.SETTLED): Row(_C.RELEASED, "fail", "release"),
        (_C.AWAITING, _I.REJECTED): Row(_C.RELEASED, "fail", "release"),
        (_C.AWAITING, _I.PEER_ABORT): Row(_C.RELEASED, "fail", "release"),
        (_C.AWAITING, _I.PEER_DOWN): Row(_C.RELEASED, "fail", "release"),
        (_C.AWAITING, _I.DEADLINE): Row(_C.RELEASED, "fail", "send_abort", "release"),
        (_C.AWAITING, _I.PREEMPT): Row(_C.RELEASED, "send_withdraw", "release"),
        (_C.AWAITING, _I.ABORT): Row(_C.RELEASED, "send_abort", "release"),
        (_C.READING, _I.READS_OK): Row(_C.READY, "ready"),
        (_C.READING, _I.READ_FAILED): Row(_C.READ_DRAIN, "fail", "read_drain"),
        (_C.READING, _I.READS_SETTLED): Row(_C.RELEASED, "fail", "send_reads_failed", "release"),
        (_C.READING, _I.DEADLINE): Row(_C.READ_DRAIN, "fail", "read_drain"),
        (_C.READING, _I.PREEMPT): Row(_C.READ_DRAIN, "read_drain"),
        (_C.READING, _I.ABORT): Row(_C.READ_DRAIN, "read_drain"),
        (_C.READING, _I.PEER_ABORT): Row(_C.READ_DRAIN, "fail", "read_drain"),
        (_C.READING, _I.PEER_DOWN): Row(_C.READ_DRAIN, "fail", "read_drain"),
        (_C.READ_DRAIN, _I.READS_SETTLED): Row(_C.RELEASED, "tell_after_reads", "release"),
    },
    stays={
        _C.AWAITING: (_I.RENEW,),
        _C.RETRY_WAIT: _RETRY_WAIT_STAYS,
        _C.READING: (_I.READ_OK,),
        _C.READ_DRAIN: (_I.READ_OK, _I.READ_FAILED, _I.PEER_ABORT, _I.PEER_DOWN),
    },
    timers=_CONSUMER_TIMERS,
    fires=_CONSUMER_FIRES,
)


# --- producer: one transfer's source KV ------------------------------------------


class PState(_Enum):
    #: No KV and no live registration; remembers the highest epoch seen.
    IDLE = "idle"
    #: A live registration waits for the KV.
    WAIT_KV = "wait_kv"
    #: The KV is held; no usable registration yet.
    HOLDING = "holding"
    #: Push: the live epoch's writes are in flight.
    WRITING = "writing"
    #: Push, progressive: every increment of the source so far is written
    #: (nothing in flight); the prefill still computes the rest.
    STREAMING = "streaming"
    #: Pull: a live registration waits for the rest of a partial source (only
    #: a whole source is lent).
    WAIT_REST = "wait_rest"
    #: Push: every write of the live epoch landed; the KV is kept until the
    #: consumer acknowledges its Ready (``ReadDone``), so that a newer epoch
    #: (a preemption the producer learns of late) is still written.
    DELIVERED = "delivered"
    #: Aborting: in-flight writes must settle before the KV is released.
    DRAINING = "draining"
    #: Pull: the KV was announced; the consumer reads it.
    LENT = "lent"
    #: Tombstone: released; registrations are rejected until it expires.
    RELEASED = "released"
    #: The record is forgotten (nothing held, no duplicate can still arrive).
    GONE = "gone"


class PInput(_Enum):
    REGISTER = "register"  #: remote: a registration newer than any seen
    KV_READY = "kv_ready"  #: local: the source blocks hold the KV (its last increment)
    KV_MORE = "kv_more"  #: local: another increment of the source, not the last
    RENDEZVOUS_PUSH = "rendezvous_push"  #: the second of KV/registration, push
    RENDEZVOUS_PULL = "rendezvous_pull"  #: the second of KV/registration, pull
    WITHDRAW = "withdraw"  #: remote: the live epoch was preempted
    LEASE_EXPIRED = "lease_expired"  #: timer: the registration's lease ran out
    RENEW = "renew"  #: timer: still computing; ask the consumer for more lease
    EXTEND = "extend"  #: remote: the consumer extended the registration's lease
    KEEP = "keep"  #: remote: a decode that cannot reserve yet asks to keep the KV
    HOLD_EXPIRED = "hold_expired"  #: timer: no usable registration in time
    WRITE_SETTLED = "write_settled"  #: a write finished or failed, not the last
    WRITE_NEXT = "write_next"  #: a write finished; its pair's next increment is ready
    SETTLED_DELIVERED = "settled_delivered"  #: last write settled, all succeeded
    SETTLED_ACKED = "settled_acked"  #: ... and the consumer already acknowledged
    SETTLED_FAILED = "settled_failed"  #: last write settled, some failed
    SETTLED_NEXT = "settled_next"  #: last write settled; a newer epoch waits
    SETTLED_IDLE = "settled_idle"  #: last write settled; epoch withdrawn
    SETTLED_PARTIAL = "settled_partial"  #: last write settled; more of the source to come
    READ_DONE = "read_done"  #: remote: the consumer's reads settled, or its ack (push)
    QUARANTINE = "quarantine"  #: timer (pull): no read can still be running
    ABORT = "abort"  #: local: abort the transfer
    PEER_ABORT = "peer_abort"  #: remote: the consumer aborted
    PEER_GONE = "peer_gone"  #: proof the consumer process is gone (it restarted; peer_gone)
    PEER_ABORT_NEWER = "peer_abort_newer"  #: remote (pull): a newer epoch than the lent one aborted
    PEER_DOWN = "peer_down"  #: the consumer's connection was lost
    EXPIRED = "expired"  #: timer: forget this record


_P = PState
_Q = PInput


def _lease(rec: Any) -> float:
    """A waiting registration's timer: the next renewal, or the end of the lease."""
    return min(rec.renew_at, rec.reg.lease_until)  # type: ignore[no-any-return]


def _renewal(rec: Any) -> float:
    """WRITING's timer: the next renewal while the source is partial. The
    lease ends no in-flight write; one posted after it fails (``not_after``)."""
    return rec.renew_at if rec.partial else math.inf


_expire = ((Timer.EXPIRE, attrgetter("expires_at")),)
_hold = ((Timer.HOLD, attrgetter("hold_until")),)

#: ``abort``: a local abort, told to the consumer (``abort_quietly``: it knows,
#: or has its Ready). Rows that move no timer's time re-arm nothing.
PRODUCER: Machine[PState, PInput] = Machine(
    {
        (_P.IDLE, _Q.REGISTER): Row(_P.WAIT_KV),
        (_P.IDLE, _Q.KV_READY): Row(_P.HOLDING, "hold"),
        (_P.IDLE, _Q.KV_MORE): Row(_P.HOLDING, "hold"),
        (_P.IDLE, _Q.ABORT): Row(_P.RELEASED, "abort", "release"),
        (_P.IDLE, _Q.PEER_ABORT): Row(_P.RELEASED, "owe_live", "drop_pending", "release"),
        (_P.IDLE, _Q.EXPIRED): Row(_P.GONE, "forget"),
        (_P.WAIT_KV, _Q.RENDEZVOUS_PUSH): Row(_P.WRITING, "new_epoch", "write"),
        (_P.WAIT_KV, _Q.RENDEZVOUS_PULL): Row(_P.LENT, "lend"),
        (_P.WAIT_KV, _Q.KV_MORE): Row(_P.WAIT_REST),
        (_P.WAIT_KV, _Q.WITHDRAW): Row(_P.IDLE, "settle_waiting", "unwait"),
        (_P.WAIT_KV, _Q.LEASE_EXPIRED): Row(_P.IDLE, "reject_lease", "unwait"),
        (_P.WAIT_KV, _Q.RENEW): Row(_P.WAIT_KV, "renew"),
        (_P.WAIT_KV, _Q.ABORT): Row(_P.RELEASED, "abort", "release"),
        (_P.WAIT_KV, _Q.PEER_ABORT): Row(_P.RELEASED, "owe_live", "drop_pending", "release"),
        (_P.WAIT_KV, _Q.PEER_DOWN): Row(_P.IDLE, "unwait"),
        (_P.HOLDING, _Q.RENDEZVOUS_PUSH): Row(_P.WRITING, "new_epoch", "write"),
        (_P.HOLDING, _Q.RENDEZVOUS_PULL): Row(_P.LENT, "lend"),
        (_P.HOLDING, _Q.HOLD_EXPIRED): Row(_P.RELEASED, "release"),
        (_P.HOLDING, _Q.ABORT): Row(_P.RELEASED, "abort", "release"),
        (_P.HOLDING, _Q.PEER_ABORT): Row(_P.RELEASED, "owe_live", "drop_pending", "release"),
        (_P.HOLDING, _Q.KV_MORE): Row(_P.HOLDING, "hold"),
        (_P.HOLDING, _Q.KV_READY): Row(_P.HOLDING, "hold"),
        (_P.HOLDING, _Q.REGISTER): Row(_P.WAIT_REST),
        (_P.WRITING, _Q.WRITE_NEXT): Row(_P.WRITING, "write"),
        (_P.WRITING, _Q.KV_MORE): Row(_P.WRITING, "write"),
        (_P.WRITING, _Q.KV_READY): Row(_P.WRITING, "write"),
        (_P.WRITING, _Q.RENEW): Row(_P.WRITING, "renew"),
        (_P.WRITING, _Q.LEASE_EXPIRED): Row(_P.WRITING, "lease_late"),
        (_P.WRITING, _Q.SETTLED_PARTIAL): Row(_P.STREAMING),
        (_P.WRITING, _Q.SETTLED_DELIVERED): Row(_P.DELIVERED, "delivered"),
        (_P.WRITING, _Q.SETTLED_ACKED): Row(_P.RELEASED, "release"),
        (_P.WRITING, _Q.SETTLED_FAILED): Row(_P.RELEASED, "owe_live", "release"),
        (_P.WRITING, _Q.SETTLED_NEXT): Row(
            _P.WRITING, "owe_live", "tell_owed", "next_epoch", "new_epoch", "write"
        ),
        (_P.WRITING, _Q.SETTLED_IDLE): Row(_P.HOLDING, "owe_live", "tell_owed", "hold"),
        (_P.WRITING, _Q.ABORT): Row(_P.DRAINING, "abort"),
        (_P.WRITING, _Q.PEER_ABORT): Row(_P.DRAINING, "owe_live", "drop_pending"),
        (_P.WRITING, _Q.PEER_DOWN): Row(_P.DRAINING),
        (_P.STREAMING, _Q.KV_MORE): Row(_P.WRITING, "write"),
        (_P.STREAMING, _Q.KV_READY): Row(_P.WRITING, "write"),
        (_P.STREAMING, _Q.RENDEZVOUS_PUSH): Row(_P.WRITING, "new_epoch", "write"),
        (_P.STREAMING, _Q.REGISTER): Row(_P.WAIT_REST),
        (_P.STREAMING, _Q.WITHDRAW): Row(_P.HOLDING, "tell_owed", "hold"),
        (_P.STREAMING, _Q.LEASE_EXPIRED): Row(_P.HOLDING, "reject_lease", "hold"),
        (_P.STREAMING, _Q.RENEW): Row(_P.STREAMING, "renew"),
        (_P.STREAMING, _Q.ABORT): Row(_P.RELEASED, "abort", "release"),
        (_P.STREAMING, _Q.PEER_ABORT): Row(_P.RELEASED, "owe_live", "drop_pending", "release"),
        (_P.STREAMING, _Q.PEER_DOWN): Row(_P.HOLDING, "hold"),
        (_P.WAIT_REST, _Q.RENDEZVOUS_PULL): Row(_P.LENT, "lend"),
        (_P.WAIT_REST, _Q.RENDEZVOUS_PUSH): Row(_P.WRITING, "new_epoch", "write"),
        (_P.WAIT_REST, _Q.WITHDRAW): Row(_P.HOLDING, "tell_owed", "hold"),
        (_P.WAIT_REST, _Q.LEASE_EXPIRED): Row(_P.HOLDING, "reject_lease", "hold"),
        (_P.WAIT_REST, _Q.RENEW): Row(_P.WAIT_REST, "renew"),
        (_P.WAIT_REST, _Q.ABORT): Row(_P.RELEASED, "abort", "release"),
        (_P.WAIT_REST, _Q.PEER_ABORT): Row(_P.RELEASED, "owe_live", "drop_pending", "release"),
        (_P.WAIT_REST, _Q.PEER_DOWN): Row(_P.HOLDING, "hold"),
        (_P.DELIVERED, _Q.RENDEZVOUS_PUSH): Row(_P.WRITING, "new_epoch", "write"),
        (_P.DELIVERED, _Q.RENDEZVOUS_PULL): Row(_P.LENT, "lend"),
        (_P.DELIVERED, _Q.READ_DONE): Row(_P.RELEASED, "release"),
        (_P.DELIVERED, _Q.HOLD_EXPIRED): Row(_P.RELEASED, "release"),
        (_P.DELIVERED, _Q.ABORT): Row(_P.RELEASED, "abort_quietly", "release"),
        (_P.DELIVERED, _Q.PEER_ABORT): Row(_P.RELEASED, "owe_live", "drop_pending", "release"),
        (_P.DELIVERED, _Q.PEER_GONE): Row(_P.RELEASED, "release"),
        (_P.DRAINING, _Q.SETTLED_DELIVERED): Row(_P.RELEASED, "release"),
        (_P.DRAINING, _Q.SETTLED_FAILED): Row(_P.RELEASED, "owe_live", "release"),
        (_P.DRAINING, _Q.ABORT): Row(_P.DRAINING, "abort_quietly"),
        (_P.DRAINING, _Q.PEER_ABORT): Row(_P.DRAINING, "owe_live", "drop_pending"),
        (_P.LENT, _Q.READ_DONE): Row(_P.RELEASED, "release"),
        (_P.LENT, _Q.WITHDRAW): Row(_P.HOLDING, "tell_owed", "hold"),
        (_P.LENT, _Q.QUARANTINE): Row(_P.RELEASED, "release"),
        (_P.LENT, _Q.ABORT): Row(_P.LENT, "abort"),
        (_P.LENT, _Q.PEER_ABORT): Row(_P.RELEASED, "owe_live", "drop_pending", "release"),
        (_P.LENT, _Q.PEER_ABORT_NEWER): Row(_P.LENT, "owe_live", "drop_pending"),
        # A source given back at its last increment (or abort): see ``_release``.
        (_P.RELEASED, _Q.KV_READY): Row(_P.RELEASED, "release"),
        (_P.RELEASED, _Q.KV_MORE): Row(_P.RELEASED, "release"),
        (_P.RELEASED, _Q.EXPIRED): Row(_P.GONE, "forget"),
        (_P.RELEASED, _Q.ABORT): Row(_P.RELEASED, "abort_quietly"),
        # A tombstone has nothing in flight: it acknowledges an Abort at once.
        (_P.RELEASED, _Q.PEER_ABORT): Row(_P.RELEASED, "tell_owed"),
    },
    stays={
        _P.IDLE: (_Q.PEER_DOWN, _Q.WITHDRAW),
        _P.WAIT_KV: (_Q.REGISTER, _Q.EXTEND),
        _P.HOLDING: (_Q.PEER_DOWN, _Q.KEEP),
        _P.WRITING: (_Q.REGISTER, _Q.WITHDRAW, _Q.WRITE_SETTLED, _Q.EXTEND),
        _P.STREAMING: (_Q.EXTEND,),
        _P.WAIT_REST: (_Q.KV_MORE, _Q.REGISTER, _Q.EXTEND),
        _P.DELIVERED: (_Q.PEER_DOWN,),
        _P.DRAINING: (_Q.REGISTER, _Q.WRITE_SETTLED, _Q.KV_MORE, _Q.KV_READY, _Q.PEER_DOWN),
        _P.LENT: (_Q.REGISTER, _Q.PEER_DOWN),
        _P.RELEASED: (_Q.REGISTER, _Q.PEER_DOWN),
    },
    timers={
        _P.IDLE: _expire,
        _P.WAIT_KV: ((Timer.LEASE, _lease),),
        _P.WRITING: ((Timer.LEASE, _renewal),),
        _P.STREAMING: ((Timer.LEASE, _lease),),
        _P.WAIT_REST: ((Timer.LEASE, _lease),),
        _P.HOLDING: _hold,
        _P.DELIVERED: _hold,
        _P.LENT: ((Timer.QUARANTINE, attrgetter("quarantine_at")),),
        _P.RELEASED: _expire,
    },
    fires={
        Timer.EXPIRE: _Q.EXPIRED,
        Timer.LEASE: _Q.LEASE_EXPIRED,  # or RENEW, before the lease ends
        Timer.HOLD: _Q.HOLD_EXPIRED,
        Timer.QUARANTINE: _Q.QUARANTINE,
    },
)
