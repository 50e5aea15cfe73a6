"""Every state machine of the core, as explicit transition tables.

Each table maps ``(state, input) -> new state``. Endpoints look an input up
before doing anything; a missing key is a protocol error: a local input raises
:class:`~kvpush.LocalProtocolError`, a remote one is counted and ignored without
changing state. Inputs whose meaning depends on a guard (e.g. "the last
expected completion") are distinct input members, so the table alone says how
state moves. ``docs/protocol.md`` renders these tables (``render_markdown``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

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
    "render_markdown",
)


class _Enum(enum.Enum):
    """Hashed by identity (members are singletons): ``Enum.__hash__`` is a Python
    call, and every transition looks up a ``(state, input)`` key."""

    __hash__ = object.__hash__


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


PEER: Mapping[tuple[PeerState, PeerInput], PeerState] = {
    (PeerState.DISCONNECTED, PeerInput.CONNECT): PeerState.HELLO_SENT,
    (PeerState.DISCONNECTED, PeerInput.HELLO_OK): PeerState.READY,
    (PeerState.DISCONNECTED, PeerInput.HELLO_BAD): PeerState.FAILED,
    (PeerState.DISCONNECTED, PeerInput.REJECT): PeerState.FAILED,
    (PeerState.DISCONNECTED, PeerInput.LOST): PeerState.DISCONNECTED,
    (PeerState.DISCONNECTED, PeerInput.RETRY): PeerState.DISCONNECTED,
    (PeerState.HELLO_SENT, PeerInput.CONNECT): PeerState.HELLO_SENT,
    (PeerState.HELLO_SENT, PeerInput.HELLO_OK): PeerState.READY,
    (PeerState.HELLO_SENT, PeerInput.HELLO_BAD): PeerState.FAILED,
    (PeerState.HELLO_SENT, PeerInput.REJECT): PeerState.FAILED,
    (PeerState.HELLO_SENT, PeerInput.LOST): PeerState.DISCONNECTED,
    (PeerState.HELLO_SENT, PeerInput.RETRY): PeerState.HELLO_SENT,
    (PeerState.READY, PeerInput.CONNECT): PeerState.READY,
    (PeerState.READY, PeerInput.HELLO_OK): PeerState.READY,
    (PeerState.READY, PeerInput.HELLO_BAD): PeerState.FAILED,
    (PeerState.READY, PeerInput.REJECT): PeerState.FAILED,
    (PeerState.READY, PeerInput.LOST): PeerState.DISCONNECTED,
    (PeerState.READY, PeerInput.RETRY): PeerState.READY,
    (PeerState.FAILED, PeerInput.CONNECT): PeerState.HELLO_SENT,
    (PeerState.FAILED, PeerInput.HELLO_OK): PeerState.READY,
    (PeerState.FAILED, PeerInput.HELLO_BAD): PeerState.FAILED,
    (PeerState.FAILED, PeerInput.REJECT): PeerState.FAILED,
    (PeerState.FAILED, PeerInput.LOST): PeerState.DISCONNECTED,
    (PeerState.FAILED, PeerInput.RETRY): PeerState.FAILED,
}


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

_CONSUMER_COMMON: dict[tuple[CState, CInput], CState] = {
    (_C.WAITING_PEER, _I.PEER_READY): _C.AWAITING,
    (_C.WAITING_PEER, _I.PEER_DOWN): _C.RELEASED,
    (_C.WAITING_PEER, _I.PREEMPT): _C.RELEASED,
    (_C.WAITING_PEER, _I.ABORT): _C.RELEASED,
    (_C.WAITING_PEER, _I.DEADLINE): _C.RELEASED,
    (_C.AWAITING, _I.STALLED): _C.RETRY_WAIT,
    (_C.AWAITING, _I.RENEW): _C.AWAITING,
    # Nothing of this epoch was taken, and no attempt is out: the blocks are
    # free at once, whatever ends it. A copy of the refused attempt answered
    # again (SUPERSEDED, STALLED) changes nothing.
    (_C.RETRY_WAIT, _I.RETRY): _C.AWAITING,
    (_C.RETRY_WAIT, _I.REJECTED): _C.RETRY_WAIT,
    (_C.RETRY_WAIT, _I.STALLED): _C.RETRY_WAIT,
    (_C.RETRY_WAIT, _I.PREEMPT): _C.RELEASED,
    (_C.RETRY_WAIT, _I.ABORT): _C.RELEASED,
    (_C.RETRY_WAIT, _I.DEADLINE): _C.RELEASED,
    (_C.RETRY_WAIT, _I.PEER_DOWN): _C.RELEASED,
    (_C.RETRY_WAIT, _I.PEER_ABORT): _C.RELEASED,
}

CONSUMER_PUSH: Mapping[tuple[CState, CInput], CState] = {
    **_CONSUMER_COMMON,
    (_C.AWAITING, _I.COMPLETION): _C.AWAITING,
    (_C.AWAITING, _I.COMPLETION_LAST): _C.READY,
    (_C.AWAITING, _I.WRITE_FAILED): _C.DRAINING,
    (_C.AWAITING, _I.PAIRS_SETTLED): _C.RELEASED,
    (_C.AWAITING, _I.SETTLED): _C.RELEASED,
    (_C.AWAITING, _I.REJECTED): _C.RELEASED,
    (_C.AWAITING, _I.PEER_ABORT): _C.DRAINING,
    (_C.AWAITING, _I.PEER_DOWN): _C.DRAINING,
    (_C.AWAITING, _I.DEADLINE): _C.DRAINING,
    (_C.AWAITING, _I.PREEMPT): _C.DRAINING,
    (_C.AWAITING, _I.ABORT): _C.DRAINING,
    (_C.DRAINING, _I.COMPLETION): _C.DRAINING,
    (_C.DRAINING, _I.WRITE_FAILED): _C.DRAINING,
    (_C.DRAINING, _I.PAIRS_SETTLED): _C.RELEASED,
    (_C.DRAINING, _I.SETTLED): _C.RELEASED,
    (_C.DRAINING, _I.REJECTED): _C.RELEASED,
    (_C.DRAINING, _I.QUARANTINE): _C.RELEASED,
    (_C.DRAINING, _I.QUARANTINE_LIVE): _C.SUSPECT,
    (_C.DRAINING, _I.PEER_ABORT): _C.DRAINING,
    (_C.DRAINING, _I.PEER_DOWN): _C.DRAINING,
    # No timer: only a proof from the producer ends it, or its loss, after
    # which a fresh quarantine runs (DRAINING).
    (_C.SUSPECT, _I.COMPLETION): _C.SUSPECT,
    (_C.SUSPECT, _I.WRITE_FAILED): _C.SUSPECT,
    (_C.SUSPECT, _I.PAIRS_SETTLED): _C.RELEASED,
    (_C.SUSPECT, _I.SETTLED): _C.RELEASED,
    (_C.SUSPECT, _I.REJECTED): _C.RELEASED,
    (_C.SUSPECT, _I.PEER_ABORT): _C.SUSPECT,
    (_C.SUSPECT, _I.PEER_DOWN): _C.DRAINING,
    (_C.SUSPECT, _I.RETRY): _C.SUSPECT,
}

CONSUMER_PULL: Mapping[tuple[CState, CInput], CState] = {
    **_CONSUMER_COMMON,
    (_C.AWAITING, _I.ANNOUNCE): _C.READING,
    (_C.AWAITING, _I.SETTLED): _C.RELEASED,
    (_C.AWAITING, _I.REJECTED): _C.RELEASED,
    (_C.AWAITING, _I.PEER_ABORT): _C.RELEASED,
    (_C.AWAITING, _I.PEER_DOWN): _C.RELEASED,
    (_C.AWAITING, _I.DEADLINE): _C.RELEASED,
    (_C.AWAITING, _I.PREEMPT): _C.RELEASED,
    (_C.AWAITING, _I.ABORT): _C.RELEASED,
    (_C.READING, _I.READ_OK): _C.READING,
    (_C.READING, _I.READS_OK): _C.READY,
    (_C.READING, _I.READ_FAILED): _C.READ_DRAIN,
    (_C.READING, _I.READS_SETTLED): _C.RELEASED,
    (_C.READING, _I.DEADLINE): _C.READ_DRAIN,
    (_C.READING, _I.PREEMPT): _C.READ_DRAIN,
    (_C.READING, _I.ABORT): _C.READ_DRAIN,
    (_C.READING, _I.PEER_ABORT): _C.READ_DRAIN,
    (_C.READING, _I.PEER_DOWN): _C.READ_DRAIN,
    (_C.READ_DRAIN, _I.READ_OK): _C.READ_DRAIN,
    (_C.READ_DRAIN, _I.READ_FAILED): _C.READ_DRAIN,
    (_C.READ_DRAIN, _I.READS_SETTLED): _C.RELEASED,
    (_C.READ_DRAIN, _I.PEER_ABORT): _C.READ_DRAIN,
    (_C.READ_DRAIN, _I.PEER_DOWN): _C.READ_DRAIN,
}


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

PRODUCER: Mapping[tuple[PState, PInput], PState] = {
    (_P.IDLE, _Q.REGISTER): _P.WAIT_KV,
    (_P.IDLE, _Q.KV_READY): _P.HOLDING,
    (_P.IDLE, _Q.KV_MORE): _P.HOLDING,
    (_P.IDLE, _Q.ABORT): _P.RELEASED,
    (_P.IDLE, _Q.PEER_ABORT): _P.RELEASED,
    (_P.IDLE, _Q.PEER_DOWN): _P.IDLE,
    (_P.IDLE, _Q.WITHDRAW): _P.IDLE,
    (_P.IDLE, _Q.EXPIRED): _P.GONE,
    (_P.WAIT_KV, _Q.REGISTER): _P.WAIT_KV,
    (_P.WAIT_KV, _Q.RENDEZVOUS_PUSH): _P.WRITING,
    (_P.WAIT_KV, _Q.RENDEZVOUS_PULL): _P.LENT,
    (_P.WAIT_KV, _Q.KV_MORE): _P.WAIT_REST,
    (_P.WAIT_KV, _Q.WITHDRAW): _P.IDLE,
    (_P.WAIT_KV, _Q.LEASE_EXPIRED): _P.IDLE,
    (_P.WAIT_KV, _Q.RENEW): _P.WAIT_KV,
    (_P.WAIT_KV, _Q.EXTEND): _P.WAIT_KV,
    (_P.WAIT_KV, _Q.ABORT): _P.RELEASED,
    (_P.WAIT_KV, _Q.PEER_ABORT): _P.RELEASED,
    (_P.WAIT_KV, _Q.PEER_DOWN): _P.IDLE,
    (_P.HOLDING, _Q.RENDEZVOUS_PUSH): _P.WRITING,
    (_P.HOLDING, _Q.RENDEZVOUS_PULL): _P.LENT,
    (_P.HOLDING, _Q.HOLD_EXPIRED): _P.RELEASED,
    (_P.HOLDING, _Q.ABORT): _P.RELEASED,
    (_P.HOLDING, _Q.PEER_ABORT): _P.RELEASED,
    (_P.HOLDING, _Q.PEER_DOWN): _P.HOLDING,
    (_P.HOLDING, _Q.KEEP): _P.HOLDING,
    (_P.HOLDING, _Q.KV_MORE): _P.HOLDING,
    (_P.HOLDING, _Q.KV_READY): _P.HOLDING,
    (_P.HOLDING, _Q.REGISTER): _P.WAIT_REST,
    (_P.WRITING, _Q.REGISTER): _P.WRITING,
    (_P.WRITING, _Q.WITHDRAW): _P.WRITING,
    (_P.WRITING, _Q.WRITE_SETTLED): _P.WRITING,
    (_P.WRITING, _Q.WRITE_NEXT): _P.WRITING,
    (_P.WRITING, _Q.KV_MORE): _P.WRITING,
    (_P.WRITING, _Q.KV_READY): _P.WRITING,
    (_P.WRITING, _Q.RENEW): _P.WRITING,
    (_P.WRITING, _Q.LEASE_EXPIRED): _P.WRITING,
    (_P.WRITING, _Q.EXTEND): _P.WRITING,
    (_P.WRITING, _Q.SETTLED_PARTIAL): _P.STREAMING,
    (_P.WRITING, _Q.SETTLED_DELIVERED): _P.DELIVERED,
    (_P.WRITING, _Q.SETTLED_ACKED): _P.RELEASED,
    (_P.WRITING, _Q.SETTLED_FAILED): _P.RELEASED,
    (_P.WRITING, _Q.SETTLED_NEXT): _P.WRITING,
    (_P.WRITING, _Q.SETTLED_IDLE): _P.HOLDING,
    (_P.WRITING, _Q.ABORT): _P.DRAINING,
    (_P.WRITING, _Q.PEER_ABORT): _P.DRAINING,
    (_P.WRITING, _Q.PEER_DOWN): _P.DRAINING,
    (_P.STREAMING, _Q.KV_MORE): _P.WRITING,
    (_P.STREAMING, _Q.KV_READY): _P.WRITING,
    (_P.STREAMING, _Q.RENDEZVOUS_PUSH): _P.WRITING,
    (_P.STREAMING, _Q.REGISTER): _P.WAIT_REST,
    (_P.STREAMING, _Q.WITHDRAW): _P.HOLDING,
    (_P.STREAMING, _Q.LEASE_EXPIRED): _P.HOLDING,
    (_P.STREAMING, _Q.RENEW): _P.STREAMING,
    (_P.STREAMING, _Q.EXTEND): _P.STREAMING,
    (_P.STREAMING, _Q.ABORT): _P.RELEASED,
    (_P.STREAMING, _Q.PEER_ABORT): _P.RELEASED,
    (_P.STREAMING, _Q.PEER_DOWN): _P.HOLDING,
    (_P.WAIT_REST, _Q.KV_MORE): _P.WAIT_REST,
    (_P.WAIT_REST, _Q.RENDEZVOUS_PULL): _P.LENT,
    (_P.WAIT_REST, _Q.RENDEZVOUS_PUSH): _P.WRITING,
    (_P.WAIT_REST, _Q.REGISTER): _P.WAIT_REST,
    (_P.WAIT_REST, _Q.WITHDRAW): _P.HOLDING,
    (_P.WAIT_REST, _Q.LEASE_EXPIRED): _P.HOLDING,
    (_P.WAIT_REST, _Q.RENEW): _P.WAIT_REST,
    (_P.WAIT_REST, _Q.EXTEND): _P.WAIT_REST,
    (_P.WAIT_REST, _Q.ABORT): _P.RELEASED,
    (_P.WAIT_REST, _Q.PEER_ABORT): _P.RELEASED,
    (_P.WAIT_REST, _Q.PEER_DOWN): _P.HOLDING,
    (_P.DELIVERED, _Q.RENDEZVOUS_PUSH): _P.WRITING,
    (_P.DELIVERED, _Q.RENDEZVOUS_PULL): _P.LENT,
    (_P.DELIVERED, _Q.READ_DONE): _P.RELEASED,
    (_P.DELIVERED, _Q.HOLD_EXPIRED): _P.RELEASED,
    (_P.DELIVERED, _Q.ABORT): _P.RELEASED,
    (_P.DELIVERED, _Q.PEER_ABORT): _P.RELEASED,
    (_P.DELIVERED, _Q.PEER_DOWN): _P.DELIVERED,
    (_P.DELIVERED, _Q.PEER_GONE): _P.RELEASED,
    (_P.DRAINING, _Q.REGISTER): _P.DRAINING,
    (_P.DRAINING, _Q.WRITE_SETTLED): _P.DRAINING,
    (_P.DRAINING, _Q.KV_MORE): _P.DRAINING,
    (_P.DRAINING, _Q.KV_READY): _P.DRAINING,
    (_P.DRAINING, _Q.SETTLED_DELIVERED): _P.RELEASED,
    (_P.DRAINING, _Q.SETTLED_FAILED): _P.RELEASED,
    (_P.DRAINING, _Q.ABORT): _P.DRAINING,
    (_P.DRAINING, _Q.PEER_ABORT): _P.DRAINING,
    (_P.DRAINING, _Q.PEER_DOWN): _P.DRAINING,
    (_P.LENT, _Q.REGISTER): _P.LENT,
    (_P.LENT, _Q.READ_DONE): _P.RELEASED,
    (_P.LENT, _Q.WITHDRAW): _P.HOLDING,
    (_P.LENT, _Q.QUARANTINE): _P.RELEASED,
    (_P.LENT, _Q.ABORT): _P.LENT,
    (_P.LENT, _Q.PEER_ABORT): _P.RELEASED,
    (_P.LENT, _Q.PEER_ABORT_NEWER): _P.LENT,
    (_P.LENT, _Q.PEER_DOWN): _P.LENT,
    (_P.RELEASED, _Q.REGISTER): _P.RELEASED,
    (_P.RELEASED, _Q.KV_READY): _P.RELEASED,
    (_P.RELEASED, _Q.KV_MORE): _P.RELEASED,
    (_P.RELEASED, _Q.EXPIRED): _P.GONE,
    (_P.RELEASED, _Q.ABORT): _P.RELEASED,
    (_P.RELEASED, _Q.PEER_ABORT): _P.RELEASED,
    (_P.RELEASED, _Q.PEER_DOWN): _P.RELEASED,
}


def render_markdown(table: Mapping[tuple[enum.Enum, enum.Enum], enum.Enum]) -> str:
    """Render a transition table as a Markdown table (used by docs/protocol.md)."""
    lines = ["| state | input | next state |", "|---|---|---|"]
    for (state, inp), new in table.items():
        lines.append(f"| `{state.name}` | `{inp.name}` | `{new.name}` |")
    return "\n".join(lines)
