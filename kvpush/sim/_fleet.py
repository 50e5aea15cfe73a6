"""The fleet: instances, router, control network and the real protocol core.

Every reservation, registration, rendezvous, write, read and completion goes
through :class:`kvpush.protocol.Producer` / :class:`~kvpush.protocol.Consumer`
with the simulated clock as ``now``. The fleet carries out what they ask
(``Send`` after a control latency, ``StartWrite`` / ``StartRead`` as
preparation plus a flow on the links) and feeds back what happens.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvpush.protocol import (
    Consumer,
    ConsumerConfig,
    ControlMessage,
    Failed,
    Identity,
    Mode,
    Producer,
    ProducerConfig,
    Ready,
    Released,
    ReleaseOutcome,
    Reserved,
    Send,
    SourceReleased,
    StartRead,
    StartWrite,
)
from kvpush.routing import Health, Ledger

from ._events import EventLoop
from ._instances import DecodeInstance, PrefillInstance
from ._link import Fabric
from ._params import Scenario
from ._request import Request

__all__ = ("MODES", "Fleet")

#: Simulator modes and their core mode. ``progressive``: push, the prefill
#: calling ``kv_ready(final=False)`` after each chunk.
MODES: dict[str, Mode] = {
    "pull": Mode.PULL,
    "push": Mode.PUSH,
    "bg-pull": Mode.PULL,
    "progressive": Mode.PUSH,
}

Op = StartWrite | StartRead


def runs(src: tuple[int, ...], dst: tuple[int, ...]) -> int:
    """Runs of blocks contiguous on both sides (one merged descriptor each)."""
    n = 1 if src else 0
    for i in range(1, len(src)):
        if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            n += 1
    return n


def _moved(op: Op) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (source, destination) blocks ``op`` moves: for an increment of a
    progressive push, the blocks after ``first`` of the source so far."""
    src, dst = op.src_blocks[0], op.dst_blocks[0]
    if isinstance(op, StartWrite) and (op.first or len(src) < len(dst)):
        start = op.first[0] if op.first else 0
        return src[start:], dst[start : len(src)]
    return src, dst


class Fleet:
    """P and D instances wired through the core for one mode."""

    def __init__(self, scenario: Scenario, mode: str, seed: int) -> None:
        self.s = scenario
        self.model = scenario.model
        self.mode = mode
        self.core_mode = MODES[mode]
        self.progressive = mode == "progressive"
        router = scenario.fleet.router
        auto_seq = self.core_mode is Mode.PULL
        self.sequential = router == "sequential" or (router == "auto" and auto_seq)
        #: Faults and per-rank completion order (arrivals have their own stream).
        self.rng = random.Random(f"{seed}/fleet")
        self.loop = EventLoop()
        hw, ctl = scenario.hardware, scenario.control
        self.links = Fabric(self.loop, hw.transfer_latency_us / 1e6)
        self.ctl_latency = ctl.control_latency_ms / 1e3
        #: The transport's bound on a posted op (the core's Timing.op_bound).
        self.op_bound = ProducerConfig(self._identity("p", 1)).timing.op_bound
        self.hop = ctl.hop_ms / 1e3
        #: Request handling on the common path (P's ingress, D's streaming out).
        self.frontend = ctl.frontend_ms / 1e3
        self._prefill_cache: dict[int, float] = {}
        self.requests: list[Request] = []
        self.ended = 0
        self.stats: dict[str, int] = {}
        #: Per delivered transfer: (KV ready -> source released, last write
        #: done -> source released) in seconds; the second is the hold until
        #: the decode's acknowledgment.
        self.source_holds: list[tuple[float, float]] = []
        #: Integrity, checked by the simulator itself (not by the core): per
        #: (transfer, epoch), how many routes' bytes landed in each block.
        self.landed: dict[tuple[str, int], dict[int, int]] = {}
        self.owner: list[dict[int, tuple[str, int]]] = []
        #: The router's loads (no capacity: it does not know the pools).
        self.ledger = Ledger(scenario.fleet.prefill, scenario.fleet.decode)
        #: The router's view of which prefills answer (``kvpush router``'s
        #: health: down on a refused or broken leg, probed back with backoff).
        self.health = Health(scenario.fleet.prefill)
        self._health_rng = random.Random(f"{seed}/health")
        self._reads: dict[tuple[str, int], list[StartRead]] = {}
        kv_blocks = hw.kv_blocks(self.model)
        self.prefills = [
            PrefillInstance(self, i, self.make_producer(i, 1), kv_blocks)
            for i in range(scenario.fleet.prefill)
        ]
        self.decodes = [
            DecodeInstance(self, i, self._consumer(i), kv_blocks)
            for i in range(scenario.fleet.decode)
        ]
        self.owner = [{} for _ in self.decodes]
        self._by_name = {p.name: p for p in self.prefills}
        self._d_by_name = {d.name: d for d in self.decodes}
        for d in self.decodes:
            for p in self.prefills:
                d.consumer.connect(0.0, p.name)
            self.touch_d(d)

    # --- construction ----------------------------------------------------------------

    def _identity(self, name: str, instance: int) -> Identity:
        return Identity(name, instance, tp=self.s.hardware.tp, num_kv_heads=self.model.kv_heads)

    def make_producer(self, index: int, instance: int) -> Producer:
        return Producer(ProducerConfig(self._identity(f"p{index}", instance)))

    def _consumer(self, index: int) -> Consumer:
        return Consumer(ConsumerConfig(self._identity(f"d{index}", 1)))

    # --- cost model ------------------------------------------------------------------

    def prefill_chunks(self, tokens: int) -> list[tuple[int, float]]:
        return self.s.hardware.prefill_chunks(self.model, tokens, self.s.control.chunk_tokens)

    def prefill_s(self, tokens: int) -> float:
        t = self._prefill_cache.get(tokens)
        if t is None:
            t = self._prefill_cache[tokens] = self.s.hardware.prefill_s(self.model, tokens)
        return t

    def step_s(self, batch: int, context: int) -> float:
        return self.s.hardware.step_s(self.model, batch, context)

    def descriptors(self, src: tuple[int, ...], dst: tuple[int, ...], merged: bool) -> int:
        """Descriptors one rank posts: one per block (or run) per region."""
        regions = self.model.layers * self.s.control.desc_regions
        return (runs(src, dst) if merged else len(src)) * regions

    def prep_s(self, ndesc: int) -> float:
        ctl = self.s.control
        return ctl.prep_fixed_ms / 1e3 + ndesc * ctl.prep_per_desc_us / 1e6

    def flow_work(self, blocks: int, ndesc: int) -> float:
        hw = self.s.hardware
        nbytes = blocks * self.model.tokens_per_block * self.model.kv_bytes_per_token
        return nbytes / hw.nic_bytes_per_s() + ndesc * hw.wire_op_us / 1e6

    def tokenize_s(self, tokens: int) -> float:
        return tokens * self.s.control.tokenize_us_per_token / 1e6

    def count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    # --- the router --------------------------------------------------------------------

    def arrive(self, r: Request) -> None:
        """Route ``r`` as ``kvpush router`` does (:mod:`kvpush.routing`): both
        instances are charged its blocks until their leg ends. Like that
        router, this one skips the prefills it saw fail (:class:`Health`):
        a leg that finds its prefill dead is refused, the prefill is down
        until a probe answers, and the request is tried again on another
        prefill with a new transfer id (its decode leg, which had sent the
        client nothing, cancelled and rebuilt). With every prefill down the
        request is refused at once (``no_prefill_up``, the router's 503)."""
        choice = self.ledger.acquire(self.model.blocks(r.input_tokens))
        if choice is None:  # no capacity: only when every prefill is down
            self._refuse(r, "no_prefill_up")
            return
        r.prefill, r.decode = choice.prefill, choice.decode
        p, attempt = self.prefills[r.prefill], r.attempt
        leg = self.hop + self.frontend + self.tokenize_s(r.input_tokens)
        self.loop.after(leg, lambda: self._prefill_leg(p, r, attempt))
        if not self.sequential:
            self._dispatch_decode(r, leg)

    def _prefill_leg(self, p: PrefillInstance, r: Request, attempt: int) -> None:
        if r.ended or r.attempt != attempt:
            return
        if p.alive:
            p.submit(r)
            return
        # Connection refused: the router marks p down and tries again.
        self.prefill_down(p.index, "connection refused")
        blocks = self.model.blocks(r.input_tokens)
        self.ledger.release_prefill(r.prefill, blocks)
        self.ledger.release_decode(r.decode, blocks)
        self.decodes[r.decode].requests.pop(r.tid, None)
        r.attempt += 1
        r.tid = f"{r.tid.split('.')[0]}.{r.attempt}"
        self.count("router_retries")
        self.loop.after(self.hop, lambda: self.arrive(r))

    def prefill_down(self, index: int, why: str) -> None:
        """The router saw prefill ``index`` fail: down, probed with backoff."""
        if self.health.up(index):
            when = self.health.failed(index, self.loop.now, self._health_rng.random(), why)
            self.ledger.mark("prefill", index, up=False)
            self.loop.at(when, lambda: self._probe(index))

    def _probe(self, index: int) -> None:
        if self.prefills[index].alive:
            self.health.answered(index)
            self.ledger.mark("prefill", index, up=True)
        else:
            when = self.health.probe_failed(index, self.loop.now, self._health_rng.random())
            self.loop.at(when, lambda: self._probe(index))

    def _refuse(self, r: Request, reason: str) -> None:
        r.failed = reason
        r.ended = True
        self.ended += 1
        self.count(f"failed_{reason}")

    def _dispatch_decode(self, r: Request, delay: float) -> None:
        d, attempt = self.decodes[r.decode], r.attempt
        d.requests[r.tid] = r
        self.loop.after(delay, lambda: self.admit(d, r) if r.attempt == attempt else None)

    def prefill_chunk(self, p: PrefillInstance, r: Request, part: tuple[int, ...]) -> None:
        """Progressive: ``part``, the whole blocks so far, is computed."""
        if not r.ended:
            r.increments += 1
            p.producer.kv_ready(self.loop.now, r.tid, (part,), final=False)
            self.touch_p(p)

    def prefill_done(self, p: PrefillInstance, r: Request, blocks: tuple[int, ...]) -> None:
        r.kv_ready = self.loop.now
        if r.ended:
            if r.increments:  # the producer holds the source: it ends where it is
                p.producer.abort(self.loop.now, r.tid)
                self.touch_p(p)
            else:
                p.pool.give(blocks)
            return
        self.ledger.release_prefill(p.index, self.model.blocks(r.input_tokens))  # P answered
        self.health.served(p.index)
        self.ledger.mark("prefill", p.index, up=True)
        p.producer.kv_ready(self.loop.now, r.tid, (blocks,))
        self.touch_p(p)
        if self.sequential:  # the proxy hears P answer, then calls D
            self._dispatch_decode(r, 2 * self.hop + self.tokenize_s(r.input_tokens))

    # --- the decode side ---------------------------------------------------------------

    def admit(self, d: DecodeInstance, r: Request) -> None:
        if r.ended:
            return
        if d.waiting or not self._reserve(d, r):
            d.waiting.append(r)

    def _reserve(self, d: DecodeInstance, r: Request) -> bool:
        need = self.model.blocks(r.input_tokens)
        grow = self.model.blocks(r.input_tokens + r.output_tokens) - need
        if len(d.pool.free) < need + (0 if r.growth else grow):
            return False
        blocks = d.pool.take(need)
        assert blocks is not None
        if not r.growth:
            r.growth = d.pool.take(grow) or ()
        peer = f"p{r.prefill}"
        res = d.consumer.reserve(self.loop.now, r.tid, peer, (blocks,), mode=self.core_mode)
        if not isinstance(res, Reserved):
            d.pool.give(blocks)
            self.fail(r, f"refused_{res.reason.value}")
            return True
        r.epoch = res.epoch
        if r.reserved < 0:
            r.reserved = self.loop.now
        owner = self.owner[d.index]
        key = (r.tid, res.epoch)
        for b in blocks:
            owner[b] = key
        self.touch_d(d)
        return True

    def _admit_waiting(self, d: DecodeInstance) -> None:
        while d.waiting:
            r = d.waiting[0]
            if not r.ended and not self._reserve(d, r):
                return
            d.waiting.popleft()

    def preempt(self, d: DecodeInstance, r: Request, requeue_s: float) -> None:
        """Decode preemption of a request waiting for its KV: withdraw the
        reservation (a new epoch follows after ``requeue_s``)."""
        if d.consumer.preempt(self.loop.now, r.tid):
            r.preemptions += 1
            r.epoch = 0
            self.count("preemptions")
            self.touch_d(d)
            self.loop.after(requeue_s, lambda: self.admit(d, r))

    def decode_finished(self, d: DecodeInstance, r: Request) -> None:
        r.finished = self.loop.now
        owner = self.owner[d.index]
        for b in r.blocks:
            owner.pop(b, None)
        d.pool.give(r.growth)
        d.pool.give(r.blocks)
        r.growth = r.blocks = ()
        self._end(r)
        self._admit_waiting(d)

    def fail(self, r: Request, reason: str) -> None:
        if r.ended:
            return
        r.failed = reason
        self.count(f"failed_{reason}")
        self.decodes[r.decode].pool.give(r.growth)
        r.growth = ()
        self._end(r)

    def _end(self, r: Request) -> None:
        r.ended = True
        self.ended += 1
        self.decodes[r.decode].requests.pop(r.tid, None)
        blocks = self.model.blocks(r.input_tokens)
        if r.kv_ready < 0:  # the prefill leg ends with the request
            self.ledger.release_prefill(r.prefill, blocks)
        self.ledger.release_decode(r.decode, blocks)

    # --- pumping the core ---------------------------------------------------------------

    def touch_d(self, d: DecodeInstance) -> None:
        outs = d.consumer.drain()
        while outs:
            for out in outs:
                self._route_d(d, out)
            outs = d.consumer.drain()
        self._arm(d, d.consumer)

    def touch_p(self, p: PrefillInstance) -> None:
        if not p.alive:
            return
        outs = p.producer.drain()
        while outs:
            writes: dict[tuple[str, int, tuple[int, ...], int], list[StartWrite]] = {}
            for out in outs:
                if isinstance(out, StartWrite):  # the ranks of one write move together
                    key = (out.transfer_id, out.epoch, out.first, len(out.src_blocks[0]))
                    writes.setdefault(key, []).append(out)
                else:
                    self._route_p(p, out)
            for ops in writes.values():
                self._start_writes(p, ops)
            outs = p.producer.drain()
        self._arm(p, p.producer)

    def _arm(self, inst: PrefillInstance | DecodeInstance, ep: Producer | Consumer) -> None:
        when = ep.next_deadline()
        if when is None or (inst.timer_at is not None and inst.timer_at <= when):
            return
        inst.timer_at = when
        self.loop.at(when, lambda: self._timer(inst, ep, when))

    def _timer(
        self, inst: PrefillInstance | DecodeInstance, ep: Producer | Consumer, when: float
    ) -> None:
        if inst.timer_at != when:
            return
        inst.timer_at = None
        if isinstance(inst, PrefillInstance):
            if not inst.alive or inst.producer is not ep:
                return
            ep.handle_timer(self.loop.now)
            self.touch_p(inst)
        else:
            ep.handle_timer(self.loop.now)
            self.touch_d(inst)

    def send(self, src: str, msg: Send) -> None:
        def deliver() -> None:
            self.deliver(src, msg.peer, msg.message)

        self.loop.after(self.ctl_latency, deliver)

    def deliver(self, src: str, dst: str, message: ControlMessage) -> None:
        now = self.loop.now
        p = self._by_name.get(dst)
        if p is not None:
            if p.alive:
                p.producer.receive(now, src, message)
                self.touch_p(p)
            return
        d = self._d_by_name[dst]
        if self._by_name[src].alive:
            d.consumer.receive(now, src, message)
            self.touch_d(d)

    def _route_p(self, p: PrefillInstance, out: object) -> None:
        if isinstance(out, Send):
            self.send(p.name, out)
        elif isinstance(out, SourceReleased):
            p.pool.give(out.blocks[0])
            p.kick()
            tl = out.timeline
            if out.outcome is ReleaseOutcome.DELIVERED and tl.write_done:
                assert tl.kv_ready is not None and tl.released is not None
                last = max(t for _, t in tl.write_done)
                self.source_holds.append((tl.released - tl.kv_ready, tl.released - last))

    def _route_d(self, d: DecodeInstance, out: object) -> None:
        if isinstance(out, Send):
            self.send(d.name, out)
        elif isinstance(out, StartRead):
            self._start_read(d, out)
        elif isinstance(out, Ready):
            self._ready(d, out)
        elif isinstance(out, Failed):
            r = d.requests.get(out.transfer_id)
            if r is not None and r.epoch == out.epoch:
                self.fail(r, out.reason.value)
        elif isinstance(out, Released):
            owner = self.owner[d.index]
            for b in out.blocks[0]:
                owner.pop(b, None)
            d.pool.give(out.blocks[0])
            self._admit_waiting(d)

    def _ready(self, d: DecodeInstance, out: Ready) -> None:
        key = (out.transfer_id, out.epoch)
        landed = self.landed.pop(key, {})
        routes = self._expected_routes()
        if any(landed.get(b, 0) < routes for b in out.blocks[0]):
            self.count("stale_pairings")  # ready, but some of this epoch's KV never landed
        r = d.requests.get(out.transfer_id)
        if r is None or r.epoch != out.epoch or r.ended:
            self.count("ready_orphan")
            owner = self.owner[d.index]
            for b in out.blocks[0]:
                owner.pop(b, None)
            d.pool.give(out.blocks[0])
            return
        r.ready = self.loop.now
        r.blocks = out.blocks[0]
        d.join(r)

    def _expected_routes(self) -> int:
        return self.s.hardware.tp  # tp -> tp: one route per consumer rank

    def land(self, d: DecodeInstance, op: Op, nroutes: int) -> None:
        """The bytes of ``op`` (all its routes) are in ``d``'s memory now."""
        key = (op.transfer_id, op.epoch)
        owner = self.owner[d.index]
        blocks = _moved(op)[1]
        if any(owner.get(b) != key for b in blocks):
            self.count("corrupt_writes")  # landed in blocks someone else owns
        landed = self.landed.setdefault(key, {})
        for b in blocks:
            landed[b] = landed.get(b, 0) + nroutes

    # --- the data plane: writes (push) and reads (pull) -----------------------------------

    def _start_writes(self, p: PrefillInstance, ops: list[StartWrite]) -> None:
        op = ops[0]
        d = self._d_by_name[op.peer]
        r = d.requests.get(op.transfer_id)
        if r is not None and r.prep_start < 0:
            r.prep_start = self.loop.now
        src, dst = _moved(op)
        ndesc = self.descriptors(src, dst, self.s.control.merge_push)
        self.count("write_posts")
        producer = p.producer
        p.thread.run(self, self.prep_s(ndesc), lambda: self._post(p, producer, d, ops, ndesc))

    def _post(
        self,
        p: PrefillInstance,
        producer: Producer,
        d: DecodeInstance,
        ops: list[StartWrite],
        ndesc: int,
    ) -> None:
        if not p.alive or p.producer is not producer:
            return  # the instance died (and maybe restarted) meanwhile
        now = self.loop.now
        op = ops[0]
        if now > op.not_after:
            self._writes_settled(p, ops, False, "posted after not_after")
            return
        r = d.requests.get(op.transfer_id)
        if r is not None and r.epoch == op.epoch:
            r.transfer_start = now

        def done(ok: bool) -> None:
            if ok:
                self.land(d, op, len(ops))
            if p.alive and p.producer is producer:
                self._writes_settled(p, ops, ok, "link failed")

        work = self.flow_work(len(_moved(op)[0]), ndesc)
        self.links.start(work, p.nic, d.nic, done, self.op_bound)

    def _writes_settled(
        self, p: PrefillInstance, ops: list[StartWrite], ok: bool, why: str
    ) -> None:
        now = self.loop.now
        d = self._d_by_name[ops[0].peer]
        order = list(ops)
        self.rng.shuffle(order)  # per-rank completions arrive in any order
        for op in order:
            rt = op.route
            if ok:
                p.producer.write_done(now, op.transfer_id, op.epoch, rt.source, rt.consumer_rank)
                if op.notice is not None:  # an increment before the last has none
                    d.consumer.completion_received(now, p.name, op.notice)
            else:
                p.producer.write_failed(
                    now, op.transfer_id, op.epoch, rt.source, rt.consumer_rank, why
                )
        self.touch_p(p)
        self.touch_d(d)

    def _start_read(self, d: DecodeInstance, op: StartRead) -> None:
        key = (op.transfer_id, op.epoch)
        pending = self._reads.setdefault(key, [])
        pending.append(op)
        if len(pending) < self._expected_routes():
            return
        del self._reads[key]
        r = d.requests.get(op.transfer_id)
        if r is not None and r.prep_start < 0:
            r.prep_start = self.loop.now
        merged = self.mode == "bg-pull" and self.s.control.merge_bg_pull
        ndesc = self.descriptors(op.src_blocks[0], op.dst_blocks[0], merged)
        then: Callable[[], None] = lambda: self._post_read(d, pending, ndesc)  # noqa: E731
        if self.mode == "pull":
            d.on_loop(self.prep_s(ndesc), then)
        else:
            d.thread.run(self, self.prep_s(ndesc), then)

    def _post_read(self, d: DecodeInstance, ops: list[StartRead], ndesc: int) -> None:
        op = ops[0]
        p = self._by_name[op.peer]
        now = self.loop.now
        if now > op.not_after or not p.alive:
            self._reads_settled(d, ops, False)
            return
        r = d.requests.get(op.transfer_id)
        if r is not None and r.epoch == op.epoch:
            r.transfer_start = now

        def done(ok: bool) -> None:
            if ok:
                self.land(d, op, len(ops))
            self._reads_settled(d, ops, ok)

        work = self.flow_work(len(op.src_blocks[0]), ndesc)
        self.links.start(work, p.nic, d.nic, done, self.op_bound)

    def _reads_settled(self, d: DecodeInstance, ops: list[StartRead], ok: bool) -> None:
        now = self.loop.now
        for op in ops:
            rt = op.route
            d.consumer.read_done(now, op.transfer_id, op.epoch, rt.source, rt.consumer_rank, ok)
        self.touch_d(d)
