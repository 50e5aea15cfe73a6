"""Network interfaces shared between concurrent transfers.

Each instance has one :class:`Nic` (all its ranks' rails together). A
:class:`Flow` moves ``work`` seconds' worth of bytes and wire operations at
full speed; concurrent flows share each NIC equally (processor sharing), and a
flow runs at the slower of its two ends' shares. A slowed NIC (a fault)
divides its speed. A fixed ``latency`` is added after the shared part.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from ._events import EventLoop

__all__ = ("Fabric", "Flow", "Nic")


class Nic:
    __slots__ = ("flows", "name", "speed")

    def __init__(self, name: str) -> None:
        self.name = name
        self.speed = 1.0
        self.flows: dict[Flow, None] = {}  # insertion-ordered: deterministic


class Flow:
    __slots__ = ("done", "ends", "last", "rate", "remaining", "version")

    def __init__(self, work: float, ends: tuple[Nic, Nic], done: Callable[[bool], None]) -> None:
        self.remaining = work
        self.ends = ends
        self.done = done
        self.rate = 0.0
        self.last = 0.0
        self.version = 0


class Fabric:
    """Starts flows, keeps their rates fair and fires ``done(ok)`` at the end."""

    def __init__(self, loop: EventLoop, latency: float) -> None:
        self.loop = loop
        self.latency = latency
        self.busy_s = 0.0
        #: Flows killed by the transport bound.
        self.expired = 0

    def start(
        self, work: float, src: Nic, dst: Nic, done: Callable[[bool], None], bound: float
    ) -> Flow:
        """Start a flow; like a real transport, one still running ``bound``
        seconds after it was posted is killed (``done(False)``): the protocol's
        ``op_bound`` rests on that."""
        flow = Flow(max(work, 1e-9), (src, dst), done)
        flow.last = self.loop.now
        src.flows[flow] = None
        dst.flows[flow] = None
        self._rebalance(src, dst)
        self.loop.after(bound, functools.partial(self._expire, flow))
        return flow

    def _expire(self, flow: Flow) -> None:
        if flow in flow.ends[0].flows:
            self.expired += 1
            self.cancel(flow)

    def cancel(self, flow: Flow) -> None:
        """The flow dies now (its producer died): ``done(False)`` at once."""
        if self._detach(flow):
            flow.done(False)

    def set_speed(self, nic: Nic, speed: float) -> None:
        self._advance(nic.flows)
        nic.speed = speed
        self._rebalance(nic)

    def fail_all(self, nic: Nic) -> None:
        for flow in list(nic.flows):
            self.cancel(flow)

    # --- internals -----------------------------------------------------------------

    def _detach(self, flow: Flow) -> bool:
        src, dst = flow.ends
        if flow not in src.flows:
            return False
        self._advance(src.flows.keys() | dst.flows.keys())
        del src.flows[flow]
        del dst.flows[flow]
        flow.version += 1
        self._rebalance(src, dst)
        return True

    def _advance(self, flows: Iterable[Flow]) -> None:
        now = self.loop.now
        for f in flows:
            f.remaining -= f.rate * (now - f.last)
            f.last = now

    def _rebalance(self, *nics: Nic) -> None:
        touched: dict[Flow, None] = {}
        for nic in nics:
            touched.update(nic.flows)
        self._advance(touched)
        now = self.loop.now
        for f in touched:
            src, dst = f.ends
            rate = min(src.speed / len(src.flows), dst.speed / len(dst.flows))
            if rate == f.rate:
                continue
            f.rate = rate
            f.version += 1
            version = f.version
            self.loop.at(
                now + max(f.remaining, 0.0) / rate, functools.partial(self._end, f, version)
            )

    def _end(self, flow: Flow, version: int) -> None:
        if version != flow.version:
            return
        self._detach(flow)
        self.loop.after(self.latency, lambda: flow.done(True))
