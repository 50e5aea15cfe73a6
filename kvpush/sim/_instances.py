"""Prefill and decode instances: queues, compute, block pools, threads.

The protocol endpoints live on these objects but are driven by the fleet
(``_fleet.py``); this module only models time: a prefill instance runs one
prefill at a time (FIFO), a decode instance runs a loop of decode steps whose
length depends on the batch and its total context, and pull-mode descriptor
preparation stalls that loop. Each has a background thread (a FIFO server)
for work that does not stall its main loop.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpush.protocol import Consumer, Producer

from ._link import Nic
from ._request import Request

if TYPE_CHECKING:
    from ._fleet import Fleet

__all__ = ("DecodeInstance", "Pool", "PrefillInstance", "Thread")


class Pool:
    """A free list of block ids; ``take`` is LIFO, so memory fragments with use."""

    __slots__ = ("free", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.free = list(range(size - 1, -1, -1))

    def take(self, n: int) -> tuple[int, ...] | None:
        if n > len(self.free):
            return None
        if n == 0:
            return ()
        out = self.free[-n:]
        del self.free[-n:]
        out.reverse()
        return tuple(out)

    def give(self, blocks: tuple[int, ...]) -> None:
        self.free.extend(reversed(blocks))


class Thread:
    """A background thread: jobs run one after another, off the main loop."""

    __slots__ = ("busy_s", "free_at")

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0

    def run(self, fleet: Fleet, seconds: float, then: Callable[[], None]) -> None:
        start = max(fleet.loop.now, self.free_at)
        self.free_at = start + seconds
        self.busy_s += seconds
        fleet.loop.at(self.free_at, then)


class PrefillInstance:
    """Runs prefills one at a time; holds source KV blocks for the producer."""

    def __init__(self, fleet: Fleet, index: int, producer: Producer, blocks: int) -> None:
        self.fleet = fleet
        self.index = index
        self.name = f"p{index}"
        self.producer = producer
        self.pool = Pool(blocks)
        self.nic = Nic(self.name)
        self.thread = Thread()
        self.queue: deque[Request] = deque()
        self.current: Request | None = None
        self.alive = True
        self.timer_at: float | None = None
        self.busy_s = 0.0

    def submit(self, r: Request) -> None:
        """``r`` arrives."""
        self.queue.append(r)
        self.kick()

    def kick(self) -> None:
        fleet = self.fleet
        while self.alive and self.current is None and self.queue:
            r = self.queue[0]
            if r.ended:  # cancelled by the router while queued
                self.queue.popleft()
                continue
            blocks = self.pool.take(fleet.model.blocks(r.input_tokens))
            if blocks is None:
                return  # wait for a SourceReleased
            self.queue.popleft()
            self.current = r
            r.prefill_start = fleet.loop.now
            seconds = fleet.prefill_s(r.input_tokens)
            self.busy_s += seconds
            fleet.loop.after(seconds, functools.partial(self._done, r, blocks))
            if fleet.progressive:  # each chunk's whole blocks, as they are computed
                bt = fleet.model.tokens_per_block
                for tokens, at in fleet.prefill_chunks(r.input_tokens)[:-1]:
                    part = blocks[: tokens // bt]
                    if part:
                        fleet.loop.after(at, functools.partial(self._chunk, r, part))

    def _chunk(self, r: Request, part: tuple[int, ...]) -> None:
        if self.current is r:  # else the instance died meanwhile
            self.fleet.prefill_chunk(self, r, part)

    def _done(self, r: Request, blocks: tuple[int, ...]) -> None:
        if self.current is not r:  # the instance died meanwhile
            return
        self.current = None
        self.fleet.prefill_done(self, r, blocks)
        self.kick()


class DecodeInstance:
    """The decode loop: steps over the running batch; loop work stalls it."""

    def __init__(self, fleet: Fleet, index: int, consumer: Consumer, blocks: int) -> None:
        self.fleet = fleet
        self.index = index
        self.name = f"d{index}"
        self.consumer = consumer
        self.pool = Pool(blocks)
        self.nic = Nic(self.name)
        self.thread = Thread()
        self.timer_at: float | None = None
        #: tid -> request, from admission until the request ends here.
        self.requests: dict[str, Request] = {}
        #: Admissions waiting for free blocks.
        self.waiting: deque[Request] = deque()
        #: Work the decode loop must do before its next step (pull preparation).
        self.loop_work: deque[tuple[float, Callable[[], None]]] = deque()
        self.joining: list[Request] = []
        self.busy = False
        self.step = 0
        self.running = 0
        self._ctx_base = 0  # sum over running of (input_tokens - start_step)
        self._first: dict[int, list[Request]] = {}
        self._last: dict[int, list[Request]] = {}
        self.steps_s = 0.0
        self.stalled_s = 0.0

    def on_loop(self, seconds: float, then: Callable[[], None]) -> None:
        """Queue ``seconds`` of work for the decode loop (it stalls every step)."""
        self.loop_work.append((seconds, then))
        self.kick()

    def join(self, r: Request) -> None:
        """``r``'s KV is ready: it joins the batch at the next step boundary."""
        self.joining.append(r)
        self.kick()

    def kick(self) -> None:
        if not self.busy:
            self._boundary()

    def _boundary(self) -> None:
        loop = self.fleet.loop
        if self.loop_work:
            t = loop.now
            while self.loop_work:
                seconds, then = self.loop_work.popleft()
                t += seconds
                self.stalled_s += seconds
                loop.at(t, then)
            self.busy = True
            loop.at(t, self._boundary)
            return
        step = self.step
        for r in self.joining:
            if r.ended:
                continue
            r.start_step = step
            self.running += 1
            self._ctx_base += r.input_tokens - step
            self._first.setdefault(step, []).append(r)
            self._last.setdefault(step + r.output_tokens - 1, []).append(r)
        self.joining.clear()
        if not self.running:
            self.busy = False
            return
        seconds = self.fleet.step_s(self.running, self._ctx_base + self.running * step)
        self.steps_s += seconds
        self.busy = True
        loop.after(seconds, self._step_end)

    def _step_end(self) -> None:
        now = self.fleet.loop.now
        step = self.step
        for r in self._first.pop(step, ()):
            r.first_token = now
        for r in self._last.pop(step, ()):
            self.running -= 1
            self._ctx_base -= r.input_tokens - r.start_step
            self.fleet.decode_finished(self, r)
        self.step = step + 1
        self._boundary()
