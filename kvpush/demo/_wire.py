"""What the supervisor, the leaders and the ranks say to each other over pipes.

One :func:`multiprocessing.Pipe` from the supervisor to each child, and one from
each leader to each of its ranks; messages are these small frozen dataclasses
(pickled by the pipe). Times are ``time.monotonic()`` values, one
clock for every process on the machine (Linux ``CLOCK_MONOTONIC``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = (
    "Check",
    "ConsumerResult",
    "Dial",
    "Dispatch",
    "Drop",
    "Fill",
    "Finish",
    "LeaderError",
    "LeaderUp",
    "OpsSummary",
    "PeerUp",
    "ProducerResult",
    "RankReply",
    "RankUp",
    "Stats",
    "Stop",
)

# --- supervisor -> child ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dispatch:
    """One leg of a request: decode reserves and registers, prefill computes."""

    transfer_id: str
    tokens: int
    #: Decode: the prefill instance (engine id) that computes this request.
    peer: str = ""


@dataclass(frozen=True, slots=True)
class Drop:
    """Prefill: the decode leg ended without the KV; drop the transfer."""

    transfer_id: str


@dataclass(frozen=True, slots=True)
class Dial:
    """Decode: where prefill instance ``peer``'s control channel listens (dial it)."""

    peer: str
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Finish:
    """Every request settled: answer with :class:`Stats`."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Shut down cleanly (a closed pipe means the same)."""


# --- leader -> rank, and back ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fill:
    """Prefill rank: write the pattern of request ``seed`` into ``blocks``
    (the request's blocks from its ``start``-th on)."""

    blocks: tuple[int, ...]
    seed: int
    start: int = 0


@dataclass(frozen=True, slots=True)
class Check:
    """Decode rank: compare ``blocks`` with the pattern of request ``seed``."""

    blocks: tuple[int, ...]
    seed: int


@dataclass(frozen=True, slots=True)
class RankReply:
    """A rank did what it was asked (answers come in the order asked)."""

    #: Check: indices (within the request) of the blocks that differ.
    corrupt: tuple[int, ...] = ()


# --- child -> supervisor ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankUp:
    """A rank process created its segment."""

    segment: str
    size: int


@dataclass(frozen=True, slots=True)
class LeaderUp:
    """A leader attached its ranks' segments and listens on ``port``."""

    port: int


@dataclass(frozen=True, slots=True)
class PeerUp:
    """Decode: the handshake with prefill instance ``peer`` completed."""

    peer: str


@dataclass(frozen=True, slots=True)
class LeaderError:
    """A leader hit an error it cannot go on from (it exits next)."""

    text: str


@dataclass(frozen=True, slots=True)
class OpsSummary:
    """One side's data-plane stamps of a transfer's writes or reads."""

    #: When the last op's plan was done (the transport was asked to move it).
    planned: float
    #: The longest planning and the longest post call, in seconds.
    planning: float
    posting: float
    #: When the data plane saw the last op settle.
    done: float


@dataclass(frozen=True, slots=True)
class ProducerResult:
    """Prefill: the source blocks of a transfer were released."""

    transfer_id: str
    #: A :class:`~kvpush.protocol.ReleaseOutcome` value, or "aborted" / "no_blocks"
    #: when the transfer never reached the protocol.
    outcome: str
    registration_received: float | None
    kv_ready: float | None
    write_started: float | None
    write_done: float | None
    #: Push, from the data plane's stamps of the writes: the last plan done,
    #: the longest planning and posting (seconds), the last write settled.
    ops: OpsSummary | None = None
    #: When the source blocks were released (after the decode's acknowledgment).
    released: float | None = None


@dataclass(frozen=True, slots=True)
class ConsumerResult:
    """Decode: a transfer ended (Ready and checked, or Failed and Released)."""

    transfer_id: str
    ok: bool
    #: Why it failed ("" when ok).
    reason: str
    corrupt_blocks: int
    reserved: float | None
    #: The last completion notice (push) or read (pull) that landed.
    write_done: float | None
    ready: float | None
    #: Push: when the data plane polled the last notice. Pull: None.
    notice_seen: float | None = None
    #: Pull, from the data plane's stamps of the reads (as ProducerResult's).
    ops: OpsSummary | None = None
    #: When the runtime handed the Ready to the leader.
    delivered: float | None = None


@dataclass(frozen=True, slots=True)
class Stats:
    """A leader's closing numbers."""

    #: The endpoint's ``held_blocks`` (prefill) or ``reserved_blocks`` (decode).
    endpoint_blocks: int
    #: Blocks the leader's own pool still has out.
    pool_blocks: int
    frames_dropped: int
    #: Seconds the decode leader's loop spent in each call to reserve, and in
    #: handling each Ready.
    caller_reserve: tuple[float, ...] = ()
    caller_ready: tuple[float, ...] = ()
