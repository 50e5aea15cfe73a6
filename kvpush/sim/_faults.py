"""Faults: decode preemption at a rate, a prefill instance dying, a slow link.

Each is scheduled on the fleet's event loop from the scenario's ``faults``
section; the protocol core then does what it does in production (new epochs,
``peer_lost``, deadlines) and the report counts what failed and how long the
fleet took to recover.
"""

from __future__ import annotations

from ._fleet import Fleet
from ._instances import PrefillInstance

__all__ = ("FaultInjector",)


class FaultInjector:
    """Arms the scenario's faults on ``fleet``; ``active`` stops the
    preemption process once the arrivals are over."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.active = True
        #: (kind, time) of every fault that started.
        self.onsets: list[tuple[str, float]] = []
        f = fleet.s.faults
        loop = fleet.loop
        if f.preempt_per_s > 0:
            loop.at(self._gap(), self._preempt)
        if f.kill_prefill_at_s >= 0:
            loop.at(f.kill_prefill_at_s, lambda: self.kill(fleet.prefills[0]))
        if f.slow_link_at_s >= 0:
            loop.at(f.slow_link_at_s, self._slow)

    def _gap(self) -> float:
        f = self.fleet.s.faults
        rate = f.preempt_per_s * len(self.fleet.decodes)
        return self.fleet.loop.now + self.fleet.rng.expovariate(rate)

    def _preempt(self) -> None:
        fleet = self.fleet
        if not self.active:
            return
        d = fleet.decodes[fleet.rng.randrange(len(fleet.decodes))]
        waiting = [r for r in d.requests.values() if r.epoch and r.ready < 0 and not r.ended]
        if waiting:
            r = waiting[fleet.rng.randrange(len(waiting))]
            fleet.preempt(d, r, fleet.s.faults.requeue_ms / 1e3)
        fleet.loop.at(self._gap(), self._preempt)

    def kill(self, p: PrefillInstance) -> None:
        """``p`` dies: its queue fails now, its flows die, every decode
        instance notices after ``detect_s``; a new instance (a new
        ``Identity.instance``) comes back after ``restart_after_s``."""
        fleet, f = self.fleet, self.fleet.s.faults
        if not p.alive:
            return
        self.onsets.append(("kill_prefill", fleet.loop.now))
        p.alive = False
        fleet.count("prefill_deaths")
        victims = list(p.queue) + ([p.current] if p.current else [])
        p.queue.clear()
        p.current = None
        for r in victims:
            fleet.fail(r, "prefill_died")
        fleet.links.fail_all(p.nic)
        # The router's connections to p break now (its legs in flight fail):
        # it takes p out of service and probes it (kvpush.routing.Health).
        fleet.prefill_down(p.index, "connection lost")

        def detected() -> None:
            for d in fleet.decodes:
                d.consumer.peer_lost(fleet.loop.now, p.name)
                fleet.touch_d(d)

        def restart() -> None:
            generation = p.producer.identity.instance + 1
            p.producer = fleet.make_producer(p.index, generation)
            p.pool.free = list(range(p.pool.size - 1, -1, -1))
            p.timer_at = None
            p.alive = True
            for d in fleet.decodes:
                d.consumer.connect(fleet.loop.now, p.name)
                fleet.touch_d(d)

        fleet.loop.after(f.detect_s, detected)
        fleet.loop.after(max(f.restart_after_s, f.detect_s), restart)

    def _slow(self) -> None:
        fleet, f = self.fleet, self.fleet.s.faults
        nic = fleet.prefills[0].nic
        self.onsets.append(("slow_link", fleet.loop.now))
        fleet.count("link_slowdowns")
        fleet.links.set_speed(nic, 1.0 / f.slow_link_factor)
        fleet.loop.after(f.slow_link_for_s, lambda: fleet.links.set_speed(nic, 1.0))
