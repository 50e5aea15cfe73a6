"""The stateful property test: every interleaving hypothesis can find.

:class:`ProtocolMachine` drives one producer instance (TP x PP ranks) and one
consumer instance (TP ranks) through a :class:`World`: reservations,
preemptions with re-reservation, aborts from both sides, KV readiness, message
delivery/drop/duplication/reordering/delay, writes and reads that complete,
fail or hang (a hung op ends only when its initiator's cancel is confirmed),
a producer that dies, and time. The invariant checker fires after every step;
the teardown stops inputs, lets every timer fire and checks that nothing leaked.
:class:`FaultFreeMachine` removes the faults and additionally checks liveness:
every transfer becomes ready.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpush.protocol import Mode

from ._world import World, WorldConfig
from .strategies import modes, transfer_ids, world_configs

__all__ = ("FaultFreeMachine", "ProtocolMachine")

_index = st.integers(0, 1 << 16)
#: Disruptive rules act only when this comes up 0, so runs also get deep.
_rarely = st.integers(0, 2)


class ProtocolMachine(RuleBasedStateMachine):
    """Faults on: drop, duplicate, reorder, delay, failing/hanging writes,
    aborts from both sides, producer death (detected or silent)."""

    faults = True

    def __init__(self) -> None:
        super().__init__()
        self.world = World(WorldConfig())

    @initialize(config=world_configs(faults=True))
    def setup(self, config: WorldConfig) -> None:
        self.world = World(config)

    # --- local inputs -------------------------------------------------------------

    @rule(tid=transfer_ids(), mode=modes())
    def reserve(self, tid: str, mode: Mode) -> None:
        self.world.reserve(tid, mode)

    @rule(tid=transfer_ids(), coin=_rarely)
    def preempt(self, tid: str, coin: int) -> None:
        if coin:
            return
        self.world.preempt(tid)

    @rule(tid=transfer_ids())
    def kv_ready(self, tid: str) -> None:
        self.world.kv_ready(tid)

    @rule(tid=transfer_ids())
    def kv_increment(self, tid: str) -> None:
        """Progressive push: the source's first blocks, before the rest."""
        self.world.kv_increment(tid)

    @precondition(lambda self: self.faults)
    @rule(tid=transfer_ids(), coin=_rarely)
    def abort_consumer(self, tid: str, coin: int) -> None:
        if coin:
            return
        self.world.abort_consumer(tid)

    @precondition(lambda self: self.faults)
    @rule(tid=transfer_ids(), coin=_rarely)
    def abort_producer(self, tid: str, coin: int) -> None:
        if coin:
            return
        self.world.abort_producer(tid)

    @precondition(lambda self: self.faults and self.world.producer_alive)
    @rule(detected=st.booleans(), coin=_rarely)
    def kill_producer(self, detected: bool, coin: int) -> None:
        if coin:
            return
        self.world.kill_producer(detected)

    @precondition(lambda self: self.faults and not self.world.producer_alive)
    @rule()
    def restart_producer(self) -> None:
        self.world.restart_producer()

    @precondition(lambda self: self.faults)
    @rule(detected=st.booleans(), coin=_rarely)
    def reconnect(self, detected: bool, coin: int) -> None:
        """The control connection drops and comes back: its frames are lost."""
        if coin:
            return
        self.world.reconnect(detected)

    @precondition(lambda self: self.faults)
    @rule(
        who=st.sampled_from(["prefill", "decode"]),
        gap=st.sampled_from([0.6, 3.0, 20.0]),
        coin=_rarely,
    )
    def stall(self, who: str, gap: float, coin: int) -> None:
        """One process stops for ``gap`` s; frames to it are read late."""
        if coin:
            return
        self.world.stall(who, gap)

    # --- the network --------------------------------------------------------------

    @precondition(lambda self: bool(self.world.net.queue))
    @rule(i=_index)
    def deliver(self, i: int) -> None:
        self.world.deliver(i % len(self.world.net.queue))

    @precondition(lambda self: self.faults and bool(self.world.net.queue))
    @rule(i=_index, coin=_rarely)
    def drop(self, i: int, coin: int) -> None:
        if coin:
            return
        self.world.net.drop(i % len(self.world.net.queue))

    @precondition(lambda self: bool(self.world.net.queue))
    @rule(i=_index)
    def duplicate(self, i: int) -> None:
        self.world.net.duplicate(i % len(self.world.net.queue))

    # --- the transport ------------------------------------------------------------

    def _pick(
        self, i: int, posted: bool | None, landed: bool | None, cancel: bool | None = None
    ) -> int | None:
        """The ``i``-th op (modulo) of those that match; a hung op only
        when asked for one whose cancel is out (``cancel=True``)."""
        ops = [
            k
            for k, op in enumerate(self.world.ops)
            if (posted is None or (op.posted_at is not None) == posted)
            and (landed is None or op.landed == landed)
            and (op.cancel if cancel else not op.hung)
        ]
        return ops[i % len(ops)] if ops else None

    @rule(i=_index)
    def post(self, i: int) -> None:
        k = self._pick(i, posted=False, landed=None)
        if k is not None:
            self.world.post(k)

    @rule(i=_index)
    def land(self, i: int) -> None:
        k = self._pick(i, posted=True, landed=False)
        if k is not None:
            self.world.land(k)

    @rule(i=_index)
    def ack(self, i: int) -> None:
        k = self._pick(i, posted=True, landed=True)
        if k is not None:
            self.world.ack(k)

    @precondition(lambda self: self.faults)
    @rule(i=_index, coin=_rarely)
    def fail(self, i: int, coin: int) -> None:
        if coin:
            return
        k = self._pick(i, posted=True, landed=False)
        if k is not None:
            self.world.fail(k)

    @precondition(lambda self: self.faults)
    @rule(i=_index, coin=_rarely)
    def hang(self, i: int, coin: int) -> None:
        if coin:
            return
        k = self._pick(i, posted=True, landed=False)
        if k is not None:
            self.world.hang(k)

    @rule(i=_index)
    def cancel(self, i: int) -> None:
        """The transport confirms a cancel its initiator asked for (a hung
        op, or one racing it: it may also still land, or fail)."""
        k = self._pick(i, posted=None, landed=False, cancel=True)
        if k is not None:
            self.world.cancel(k)

    @precondition(lambda self: bool(self.world.notices))
    @rule(i=_index)
    def notify(self, i: int) -> None:
        self.world.notify(i % len(self.world.notices))

    @precondition(lambda self: bool(self.world.notices))
    @rule(i=_index)
    def duplicate_notice(self, i: int) -> None:
        self.world.duplicate_notice(i % len(self.world.notices))

    @precondition(lambda self: self.faults and bool(self.world.notices))
    @rule(i=_index, coin=_rarely)
    def drop_notice(self, i: int, coin: int) -> None:
        if coin:
            return
        self.world.drop_notice(i % len(self.world.notices))

    # --- time -------------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.001, 0.01, 0.1, 0.5, 2.0]))
    def advance(self, dt: float) -> None:
        self.world.advance(dt if self.faults else min(dt, 0.01))

    @rule(picks=st.lists(_index, min_size=1, max_size=12))
    def progress(self, picks: list[int]) -> None:
        """Several forward moves in a row (deliver, post, land, acknowledge,
        poll a notice, confirm a hung op's cancel), each chosen among all
        that are possible, so that runs get deep without one rule call per
        move."""
        w = self.world
        for i in picks:
            moves: list[tuple[str, int]] = [("deliver", k) for k in range(len(w.net.queue))]
            moves += [("notify", k) for k in range(len(w.notices))]
            for k, op in enumerate(w.ops):
                if op.hung:  # it moves only by its confirmed cancel
                    if op.cancel:
                        moves.append(("cancel", k))
                elif op.posted_at is None:
                    moves.append(("post", k))
                elif not op.landed:
                    moves.append(("land", k))
                else:
                    moves.append(("ack", k))
            if not moves:
                return
            name, k = moves[i % len(moves)]
            getattr(w, name)(k)

    # --- checks -------------------------------------------------------------------------

    @invariant()
    def block_accounting(self) -> None:
        w = self.world
        open_blocks = sum(len(r.blocks) for r in w.checker.res.values() if r.ended is None)
        assert w.consumer.reserved_blocks == open_blocks
        if w.producer_alive:
            held = sum(len(b) for b in w.checker.src_held.values())
            assert w.producer.held_blocks == held

    def teardown(self) -> None:
        w = self.world
        # Inputs stop, but first every transfer gets its KV (and, fault-free,
        # its reservation), so that the end game runs the completion paths too.
        for tid in [f"t{i}" for i in range(3)]:
            if not self.faults and tid not in w.ready and tid not in w.live:
                w.reserve(tid)
            w.kv_ready(tid)
        w.quiesce()
        if not self.faults:
            everyone = {f"t{i}" for i in range(3)}
            assert w.ready == everyone, (w.ready, w.failure_reasons)
            assert not w.failed, w.failure_reasons


class FaultFreeMachine(ProtocolMachine):
    """No drops, failures, aborts or deaths (duplicates and reordering stay):
    every transfer must become ready (I5) with exactly one write per pair (I4)."""

    faults = False

    @initialize(config=world_configs(faults=False))
    def setup(self, config: WorldConfig) -> None:
        self.world = World(config)
