"""Between the scheduler side and the workers: the data plane's stand-in, the doorbell.

In vLLM the KV tensors live in the worker processes, the protocol endpoint in
the engine-core process. :class:`WorkerBridge` is the pump's
:class:`~kvpush.runtime.DataPlaneLike` there: an op the core emits waits until
``build_connector_meta`` ships it to the workers; their results come back
through ``update_connector_output``. One lock guards the queues (the pump
calls in from whichever thread fed the core, vLLM from its scheduler thread).

A worker with results rings the scheduler side's :class:`Doorbell` (one UDP
datagram) to end an idle decode step's wait (docs/performance.md). The bell
is a hint, never the message: a lost or stale ring costs at most one wait or
one early step.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpush.protocol import Cancel, KVLayout, KvpushError, StartRead, StartWrite
from kvpush.runtime import OpResult, PeerRanks, Result, stage_bytes

__all__ = ("Bell", "Doorbell", "Outbound", "Staged", "WorkerBridge")


@dataclass(slots=True)
class Staged:
    """The decode's staging records for the workers (docs/layouts.md): those
    that own a slot, and those that ended (dropped first)."""

    records: list[tuple[str, int, list[list[int]], tuple[int, ...]]] = field(default_factory=list)
    dropped: list[tuple[str, int]] = field(default_factory=list)


@dataclass(slots=True)
class Outbound:
    """What one ``build_connector_meta`` ships to every worker."""

    #: Ops for the workers, and the core's cancels of ops past their bound.
    actions: list[StartWrite | StartRead | Cancel] = field(default_factory=list)
    peers: list[PeerRanks] = field(default_factory=list)
    staging: Staged = field(default_factory=Staged)


class WorkerBridge:
    """Queues the pump's transfers for the workers; feeds back their results."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._out = Outbound()
        self._on_results: Callable[[list[Result]], None] | None = None
        self._stopped = False
        self.error: BaseException | None = None
        #: Decode: the workers' layouts when every one has a staging pool
        #: (their reservations then ask for slots); empty: none is staged.
        self.staging_layouts: list[KVLayout] = []
        self._staged: set[tuple[str, int]] = set()

    # --- the pump's side (DataPlaneLike) ---------------------------------------

    def bind(self, on_results: Callable[[list[Result]], None]) -> None:
        self._on_results = on_results

    def start(self) -> None:
        if self._on_results is None:
            raise KvpushError("WorkerBridge.bind() was not called")

    def stop(self, timeout: float = 5.0) -> None:
        """Fail whatever never reached a worker (nothing posted it)."""
        with self._lock:
            self._stopped = True
            left, self._out.actions = self._out.actions, []
        if left and self._on_results is not None:
            self._on_results(
                [OpResult(a, "the connector stopped") for a in left if not isinstance(a, Cancel)]
            )

    def submit(self, action: StartWrite | StartRead) -> None:
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self._out.actions.append(action)
        if stopped and self._on_results is not None:
            self._on_results([OpResult(action, "the connector stopped")])

    def cancel(self, cancel: Cancel) -> None:
        with self._lock:
            if not self._stopped:
                self._out.actions.append(cancel)

    def add_peer(self, peer: PeerRanks) -> None:
        with self._lock:
            self._out.peers.append(peer)

    def stage_need(self, blocks: list[list[int]]) -> int:
        return max((stage_bytes(lay, blocks) for lay in self.staging_layouts), default=0)

    def stage(
        self, transfer_id: str, epoch: int, blocks: list[list[int]], slot: tuple[int, ...]
    ) -> None:
        """Ship the record with the next step: a notice that reaches a worker
        first waits for it there (``DataPlane.stage``)."""
        with self._lock:
            self._staged.add((transfer_id, epoch))
            self._out.staging.records.append((transfer_id, epoch, blocks, slot))

    def unstage(self, transfer_id: str, epoch: int) -> None:
        """Ship the drop with the next step, applied before that step's
        forward (``SchedulerSide._releasing`` frees the blocks after)."""
        with self._lock:
            if (transfer_id, epoch) in self._staged:
                self._staged.discard((transfer_id, epoch))
                self._out.staging.dropped.append((transfer_id, epoch))

    # --- vLLM's side -------------------------------------------------------------

    def take(self) -> Outbound:
        with self._lock:
            out, self._out = self._out, Outbound()
        return out

    def has_actions(self) -> bool:
        with self._lock:
            out = self._out
            return bool(out.actions or out.staging.records or out.staging.dropped)


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
        """Block up to ``timeout`` seconds for a ring; True if one came (all are taken)."""
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
