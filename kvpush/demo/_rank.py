"""One rank process: owns its shared-memory KV segment and computes into it.

It stands for a TP worker that owns device memory. It creates the segment
(:class:`~kvpush.shm.ShmTransport`, ``create=True``), touches every page
once (a real KV cache is allocated up front), reports to the supervisor, then
serves its leader: :class:`Fill` writes a request's pattern into blocks (the
prefill's "forward pass"), :class:`Check` compares blocks with it (the
decode's check). It moves no bytes between instances: the leader maps the
same segment and drives every transfer from its data-plane thread. Doing the
pattern work here, one process per rank, keeps it off the leader's
interpreter, so it neither competes with the data plane for the GIL nor
serialises the ranks.

On a :class:`Stop` or a closed pipe from the supervisor (the supervisor died),
SIGTERM, or a new parent, it closes the transport, which unlinks the
segment, and exits.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from types import FrameType

from kvpush.shm import ShmTransport

from ._children import ignore_sigint
from ._model import SideGeometry
from ._pattern import corrupt_blocks, fill
from ._wire import Check, Fill, RankReply, RankUp

__all__ = ("RankSpec", "rank_main")

#: How often a waiting rank checks that its parent is still the supervisor.
_PARENT_CHECK = 1.0
_PAGE = 4096


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Everything a rank process needs (pickled to it)."""

    agent: str
    segment: str
    geometry: SideGeometry
    rank: int


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def rank_main(spec: RankSpec, work: Connection, conn: Connection) -> None:
    """Process entry point (``multiprocessing`` spawn target): ``work`` is the
    pipe from the leader, ``conn`` the one from the supervisor."""
    ignore_sigint()  # the supervisor handles Ctrl-C
    signal.signal(signal.SIGTERM, _terminate)
    parent = os.getppid()
    transport = ShmTransport(spec.agent, spec.geometry.segment_bytes, name=spec.segment)
    try:
        memory = transport.memory
        memory[::_PAGE] = 0  # fault every page in now, not during the first transfers
        layout = spec.geometry.layout(spec.rank)
        conn.send(RankUp(transport.segment_name, transport.size))
        serving = True
        while os.getppid() == parent:
            ready = wait([conn, work] if serving else [conn], _PARENT_CHECK)
            if conn in ready:  # Stop, or the supervisor is gone
                break
            if not ready:
                continue
            try:
                msg = work.recv()
                if isinstance(msg, Fill):
                    fill(memory, layout, msg.blocks, msg.seed, msg.start)
                    work.send(RankReply())
                elif isinstance(msg, Check):
                    bad = corrupt_blocks(memory, layout, msg.blocks, msg.seed)
                    work.send(RankReply(tuple(sorted(bad))))
            except (EOFError, OSError):  # the leader is gone; the supervisor will stop us
                serving = False
    except (EOFError, OSError):
        pass  # the supervisor is gone
    finally:
        transport.close()
