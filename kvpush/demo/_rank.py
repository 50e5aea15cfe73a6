"""One rank process: creates and owns its shared-memory KV segment.

It stands for a TP worker that owns device memory. It creates the segment
(:class:`~kvpush.runtime.ShmTransport`, ``create=True``), reports its name to
the router and then only waits: the instance's leader maps the same segment
and drives every transfer from its own data-plane thread. On a :class:`Stop`,
a closed pipe (the router died), SIGTERM or a new parent, it closes the
transport, which unlinks the segment, and exits.
"""

from __future__ import annotations

import os
import signal
from multiprocessing.connection import Connection
from types import FrameType

from kvpush.runtime import ShmTransport

from ._wire import RankUp

__all__ = ("rank_main",)

#: How often a waiting rank checks that its parent is still the router.
_PARENT_CHECK = 1.0


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def rank_main(agent: str, segment: str, size: int, conn: Connection) -> None:
    """Process entry point (``multiprocessing`` spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the router handles Ctrl-C
    signal.signal(signal.SIGTERM, _terminate)
    parent = os.getppid()
    transport = ShmTransport(agent, size, name=segment)
    try:
        conn.send(RankUp(transport.segment_name, transport.size))
        while os.getppid() == parent:
            try:
                if conn.poll(_PARENT_CHECK):
                    conn.recv()  # Stop (anything else means the same)
                    break
            except (EOFError, OSError):  # the router is gone
                break
    except (BrokenPipeError, EOFError):
        pass
    finally:
        transport.close()
