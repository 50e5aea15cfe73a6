"""Registration with vllm-router's ZMQ service discovery (its MoRI-IO WRITE
mode), when ``router_discovery`` is configured.

vllm-router binds a ZMQ ROUTER socket (``--vllm-discovery-address``) and
never answers. An instance connects a DEALER and sends one msgpack map per
heartbeat: ``{"type": "P" | "D", "http_address": "host:port", "zmq_address":
str, "transfer_mode": "WRITE"}``. An entry lives 5 s past its last message, so
:class:`Registrar` sends one every :data:`PERIOD`. The router writes
``zmq_address`` verbatim into each request id, where the decode reads the
prefill's address (``_contract.peer_of_request_id``): kvpush registers its
control address there.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import msgpack

__all__ = ("PERIOD", "Registrar", "registration")

log = logging.getLogger("kvpush.vllm")

#: Seconds between heartbeats (vllm-router drops an entry 5 s after the last).
PERIOD = 1.0


def registration(prefill: bool, http: str, control: str) -> dict[str, str]:
    """The map vllm-router 0.1.17 takes (its keys and values are exact: a
    lower-case role or ``transfer_mode`` is dropped)."""
    return {
        "type": "P" if prefill else "D",
        "http_address": http,
        "zmq_address": control,
        "transfer_mode": "WRITE",
    }


class Registrar:
    """Sends :func:`registration` to the router every :data:`PERIOD` on its own
    thread until :meth:`close`; a router that is down or restarts is reached
    when it comes back (ZMQ reconnects and queues)."""

    def __init__(self, router: str, message: dict[str, str], period: float = PERIOD) -> None:
        import zmq  # pyzmq: only an instance that registers needs it

        self._ctx: Any = zmq.Context()
        self._sock: Any = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 4)  # a router away: keep a few, drop the rest
        self._sock.connect(f"tcp://{router}")
        self._frame = msgpack.packb(message)
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpush-discovery", daemon=True)
        self._thread.start()
        log.info("kvpush: registering with vllm-router at %s as %s", router, message)

    def _run(self) -> None:
        import zmq

        while True:
            with contextlib.suppress(zmq.Again):  # the queue is full: the router is away
                self._sock.send(self._frame, flags=zmq.NOBLOCK)
            if self._stop.wait(self._period):
                return

    def close(self) -> None:
        """Stop the heartbeats: the router drops this instance within 5 s."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        self._ctx.term()
