"""The connector's worker side: one TP rank's NIXL agent and data plane, on its
own thread (never on vLLM's forward path).

Every worker gets every action and posts those whose route it serves (a
producer rank the writes of its ``Source``, a consumer rank the reads of its
``consumer_rank``). The GPU ordering rule (docs/runtime.md): vLLM calls
``wait_for_save`` when the step's forward is *queued*, so writes wait for a
CUDA event recorded there, on the data-plane thread, never in a synchronize.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvpush.protocol import Cancel, Codec, KVLayout, MemoryType, Role, StartRead, StartWrite
from kvpush.runtime import (
    Copier,
    CostModel,
    DataPlane,
    Fence,
    NoticeIn,
    OpResult,
    PeerRanks,
    Rank,
    Result,
    Transport,
    encode_rank,
)

from ._bridge import Bell, Staged

__all__ = ("WorkerSide",)


class WorkerSide:
    """One rank: register its KV, post its share of the transfers, report back."""

    def __init__(self, role: Role, rank: int, tp: int, codec: Codec, transport: Transport) -> None:
        self.role, self.rank, self.tp = role, rank, tp
        self._codec = codec
        self._transport = transport
        self._dataplane: DataPlane | None = None
        self._lock = threading.Lock()
        self._results: list[Result] = []
        self._computed: list[tuple[int, str, int]] = []
        #: The KV lives on a CUDA device (set by :meth:`register`).
        self._cuda = False
        #: The event recorded after the latest forward (CUDA only): writes wait for it.
        self._fence: Fence | None = None
        self.blob: bytes | None = None
        self._reported: dict[str, int] = {}
        self._notices = 0
        self._bell = Bell()

    def register(
        self, layout: KVLayout, copier: Copier | None = None, costs: CostModel | None = None
    ) -> bytes:
        """Register this rank's KV, start the data plane; returns the handshake blob."""
        if self._dataplane is not None:
            raise RuntimeError("register() was already called")
        # The data plane shares the GIL with the engine's forward: it polls
        # only with a transfer open, every 0.5 ms (faster for 2 ms after a
        # command or result: a transfer's next notice is usually close behind).
        dp = DataPlane(
            self.role,
            {self.rank: Rank(self._transport, layout)},
            self.tp,
            self._codec,
            poll_interval=0.0005,
            busy_for=0.002,
            expecting=False,
            copier=copier,
            costs=costs,
        )
        dp.bind(self._collect)
        dp.start()
        self._dataplane = dp
        self._cuda = any(r.memory is MemoryType.VRAM for r in layout.regions)
        self.blob = encode_rank(self._transport.metadata(), layout)
        return self.blob

    def step(
        self,
        actions: Sequence[StartWrite | StartRead | Cancel],
        peers: Sequence[PeerRanks],
        expecting: bool,
        doorbell: tuple[str, int] | None = None,
        staging: Staged | None = None,
    ) -> None:
        """Apply a step's metadata before its forward (which may reuse dropped blocks)."""
        self._bell.aim(doorbell)
        dp = self._dataplane
        if dp is None:
            if actions:
                self._fail(actions, "the worker registered no KV caches")
            return
        dp.expect(expecting)
        for peer in peers:  # a new instance of a peer replaces the old one
            dp.add_peer(peer)
        if staging is not None:
            for tid, epoch in staging.dropped:
                dp.unstage(tid, epoch)
            for tid, epoch, blocks, slot in staging.records:
                dp.stage(tid, epoch, blocks, slot)
        for action in actions:
            if not self._serves(action):
                continue
            if isinstance(action, Cancel):
                dp.cancel(action)
            else:
                dp.submit(action, self._fence if isinstance(action, StartWrite) else None)

    def computed(self, progress: Sequence[tuple[str, int]]) -> None:
        """The step's forward is queued: on a GPU record the fence writes wait for."""
        if self._dataplane is None:
            return
        if self._cuda:
            self._fence = _stream_event()
        with self._lock:
            self._computed += [(self.rank, req_id, tokens) for req_id, tokens in progress]

    def take_computed(self) -> list[tuple[int, str, int]]:
        with self._lock:
            out, self._computed = self._computed, []
        return out

    def take_results(self) -> list[Result]:
        with self._lock:
            out, self._results = self._results, []
        return out

    def close(self) -> None:
        dp, self._dataplane = self._dataplane, None
        if dp is not None:
            dp.stop()
        self._transport.close()
        self._bell.close()

    def threads(self) -> dict[str, int]:
        dp = self._dataplane
        if dp is None or dp.native_id is None:
            return {}
        return {"dataplane": dp.native_id}

    def _serves(self, action: StartWrite | StartRead | Cancel) -> bool:
        route = action if isinstance(action, Cancel) else action.route
        if self.role is Role.PRODUCER:
            return route.source.pp * self.tp + route.source.tp == self.rank
        return route.consumer_rank == self.rank

    def stats(self) -> dict[str, int]:
        dp = self._dataplane
        if dp is None:
            return {}
        with self._lock:
            now = {
                "posted": dp.posted,
                "failed": dp.failed_posts,
                "bytes": dp.bytes_posted,
                "notices": self._notices,
                "staged": dp.stager.staged_writes,
                "scattered": dp.stager.scatters,
            }
            delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
            self._reported = now
        return {k: v for k, v in delta.items() if v}

    def _collect(self, results: list[Result]) -> None:
        with self._lock:
            self._results.extend(results)
            self._notices += sum(isinstance(r, NoticeIn) for r in results)
        self._bell.ring()

    def _fail(self, actions: Sequence[StartWrite | StartRead | Cancel], why: str) -> None:
        ops = [a for a in actions if not isinstance(a, Cancel) and self._serves(a)]
        self._collect([OpResult(a, why) for a in ops])


def _stream_event() -> Fence:
    """A CUDA event recorded on the current (the forward's) stream."""
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event  # type: ignore[no-any-return]
