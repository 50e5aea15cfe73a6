"""A doorbell from the workers to the scheduler side: "I have results".

An idle decode step waits up to ``idle_wait`` (``SchedulerSide._idle_wait``)
instead of letting vLLM spin, but a push notice or a read's completion lands
in a *worker* process and reaches the scheduler only with the step's output,
after the wait. So a worker rings the scheduler side's doorbell (one UDP
datagram) whenever it has results: the wait ends, the step runs at once, and
``update_connector_output`` hears the load finished in that step. The bell is
a hint, never the message: a lost or stale ring costs at most one wait or one
early step, and a worker on another host changes nothing but the latency.
"""

from __future__ import annotations

import contextlib
import select
import socket

__all__ = ("Bell", "Doorbell")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class Doorbell:
    """The scheduler side's end: a UDP socket the workers ring."""

    def __init__(self, host: str) -> None:
        self._sock = socket.socket(_family(host), socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.bind((host, 0))
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a ring; True if one came (every
        ring queued so far is taken)."""
        readable, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        if not readable:
            return False
        with contextlib.suppress(BlockingIOError):
            while self._sock.recv(64):
                pass
        return True

    def close(self) -> None:
        self._sock.close()


class Bell:
    """A worker's end: rings the doorbell it was last told of (errors ignored)."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._to: tuple[str, int] | None = None

    def aim(self, address: tuple[str, int] | None) -> None:
        if address == self._to:
            return
        self.close()
        self._to = address
        if address is not None:
            self._sock = socket.socket(_family(address[0]), socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    def ring(self) -> None:
        sock, to = self._sock, self._to
        if sock is not None and to is not None:
            with contextlib.suppress(OSError):  # a full buffer: a ring is there already
                sock.sendto(b"\0", to)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
