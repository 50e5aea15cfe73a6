"""The connector's scheduler side: one kvpush endpoint per vLLM instance.

A :class:`SchedulerSide` runs in vLLM's engine-core process and owns the
instance's control channel and protocol endpoint, pumped on a background loop
(:class:`~kvpush.runtime.SyncRuntime`). It translates requests into the core's
inputs and events into what vLLM hears (docs/vllm.md, "What happens to a
request"): a decode's ``Failed`` only at ``Released``, as no late write can land
in the blocks after. vLLM's scheduler thread runs the core under the runtime's
lock and never waits for its loop, but for the first leg to a new prefill.
:class:`Registrar`: vllm-router's ZMQ discovery (docs/contract.md).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvpush.protocol import (
    Codec,
    Consumer,
    ConsumerConfig,
    Event,
    Failed,
    Identity,
    PeerFailed,
    Producer,
    ProducerConfig,
    Ready,
    Refused,
    Released,
    Role,
    SourceReleased,
)
from kvpush.runtime import (
    ConsumerRuntime,
    ControlChannel,
    EndpointRuntime,
    ProducerRuntime,
    Result,
    SyncRuntime,
    decode_rank,
)

from ._breakdown import Breakdown
from ._bridge import Doorbell, Outbound, WorkerBridge
from ._config import ConnectorConfig
from ._contract import REFUSALS, host_port
from ._params import ParamsError, TransferParams
from ._tensors import token_scale

__all__ = ("PERIOD", "Registrar", "Reports", "SchedulerSide", "registration")

log = logging.getLogger("kvpush.vllm")


@dataclass(slots=True)
class Reports:
    """What the workers report to vLLM at the next step."""

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    #: req id -> its blocks that failed to load (also in ``recving``).
    failed: dict[str, list[int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.sending or self.recving or self.failed)


@dataclass(slots=True)
class _Transfer:
    req_id: str
    blocks: list[int]
    #: decode: loading, failed, aborted (vLLM finished it), preempted; prefill: sending.
    state: str
    failure: str = ""
    #: Decode: its reservation owns a staging slot (its workers keep a record).
    staged: bool = False


#: Seconds between checks for a transfer to ship while an idle step waits.
_SLICE = 0.002
#: Bytes per page of the decode's staging pool (a slot is whole pages).
STAGING_PAGE = 1 << 16

#: A transfer's key: (transfer id, epoch); epoch 0 on the prefill side.
_Key = tuple[str, int]


class SchedulerSide:
    """One instance's endpoint, driven from vLLM's scheduler thread."""

    def __init__(
        self, role: Role, config: ConnectorConfig, tp: int, num_kv_heads: int, tokens_per_block: int
    ) -> None:
        self.role, self.config, self.tp, self.num_kv_heads = role, config, tp, num_kv_heads
        self.tokens_per_block = tokens_per_block
        self._scale = 1  # rows per token in the layout's blocks (_tensors.token_scale)
        self.bridge = WorkerBridge()
        self._sync: SyncRuntime[Any] | None = None
        self._channel: ControlChannel | None = None
        self._lock = threading.Lock()
        self._by_key: dict[_Key, _Transfer] = {}
        self._key_of: dict[str, _Key] = {}  # req id -> its live transfer
        self._done: set[str] = set()  # decode req ids whose load ended
        #: Decode req ids not allocated for yet -> when we last asked (``_keep``).
        self._waiting: dict[str, float] = {}
        self._reports = Reports()
        side = "prefill" if role is Role.PRODUCER else "decode"
        self.breakdown = Breakdown(config.timeline_file, side)
        self.port = 0
        #: This instance's id in its Hello: a restart changes it.
        self.instance = secrets.randbits(63)
        #: What :meth:`stats` reports next.
        self._phases: list[tuple[str, float]] = []
        self._gauges: dict[str, int] = {}
        self._counts: collections.Counter[str] = collections.Counter()
        #: Refusal classes already logged at ERROR (:meth:`refused`).
        self._refusals_logged: set[str] = set()
        self._registrar: Registrar | None = None
        #: Prefill -> the address its channel route was given (``_route``).
        self._routes: dict[str, tuple[str, int]] = {}
        #: Engine steps so far, and decode reservations released with a staging
        #: record on the workers, freed from a later step (:meth:`_event`).
        self._steps = 0
        self._releasing: list[tuple[int, Released, _Transfer, _Key]] = []
        #: Decode: what the workers ring when they have results (``_idle_wait``).
        self._doorbell: Doorbell | None = None
        if role is Role.CONSUMER and config.idle_wait > 0:
            self._doorbell = Doorbell(config.host)

    # --- set-up ------------------------------------------------------------------

    def start(
        self, rank_blobs: Mapping[int, bytes], fingerprint: tuple[tuple[str, str], ...] = ()
    ) -> None:
        """Build the endpoint once every worker rank described itself."""
        if self._sync is not None:
            return
        if sorted(rank_blobs) != list(range(self.tp)):
            raise ValueError(
                f"expected handshake metadata of ranks 0..{self.tp - 1}, got {sorted(rank_blobs)}"
            )
        blobs = tuple(rank_blobs[r] for r in range(self.tp))
        layouts = [decode_rank(b)[1] for b in blobs]
        if self.role is Role.CONSUMER and all(lay.staging is not None for lay in layouts):
            self.bridge.staging_layouts = layouts
        self._scale = token_scale(layouts[0], self.tokens_per_block)
        cfg = self.config
        identity = Identity(
            cfg.engine_id,
            self.instance,
            tp=self.tp,
            num_kv_heads=self.num_kv_heads,
            fingerprint=fingerprint,
            layout=layouts[0],
            ranks=blobs,
        )
        codec = Codec(secret=cfg.secret)

        async def setup(stack: contextlib.AsyncExitStack) -> EndpointRuntime[Any]:
            channel = await stack.enter_async_context(
                ControlChannel(cfg.engine_id, codec, max_age=cfg.timing.max_transit / 2)
            )
            self.port = await channel.listen(cfg.host, cfg.port)
            self._channel = channel
            if self.role is Role.PRODUCER:
                pc = ProducerConfig(identity, cfg.timing, kv_hold_timeout=cfg.kv_hold_timeout)
                return ProducerRuntime(Producer(pc), channel, self.bridge)
            pools = [lay.staging.nbytes for lay in self.bridge.staging_layouts if lay.staging]
            cc = ConsumerConfig(
                identity,
                cfg.timing,
                ready_timeout=cfg.ready_timeout,
                staging_bytes=min(pools, default=0),
                staging_page=STAGING_PAGE,
            )
            return ConsumerRuntime(Consumer(cc), channel, self.bridge)

        self._sync = SyncRuntime(setup)
        if cfg.router_discovery is not None:
            router, http = cfg.router_discovery
            message = registration(self.role is Role.PRODUCER, http, self.control_address())
            self._registrar = Registrar(router, message)

    def threads(self) -> dict[str, int]:
        if self._sync is None or self._sync.runtime.native_id is None:
            return {}
        return {"runtime": self._sync.runtime.native_id}

    @property
    def round_trips(self) -> int:
        return 0 if self._sync is None else self._sync.round_trips

    def control_address(self) -> str:
        return host_port(self.config.host, self.port)

    def stats(self) -> dict[str, Any]:
        """The ``_stats.py`` keys since the last call (gauges when they changed)."""
        out: dict[str, Any] = {}
        with self._lock:
            phases, self._phases = self._phases, []
            counts, self._counts = self._counts, collections.Counter()
        for phase, seconds in phases:
            out.setdefault(f"h:{phase}", []).append(seconds)
        out.update(counts)
        if self._sync is not None:
            # Every step: an engine going idle steps no more, so the step that
            # released the last blocks must report them.
            rt = self._sync.runtime
            with rt.lock:
                ep = rt.endpoint
                gauges = (
                    {"held": ep.held_blocks}
                    if isinstance(ep, Producer)
                    else {"reserved": ep.reserved_blocks, "suspect": ep.suspect_blocks}
                )
            if gauges != self._gauges:
                self._gauges = gauges
                out.update({f"g:{kind}": n for kind, n in gauges.items()})
        return out

    @property
    def doorbell(self) -> tuple[str, int] | None:
        return None if self._doorbell is None else self._doorbell.address

    def close(self) -> None:
        if self._doorbell is not None:
            self._doorbell.close()
        registrar, self._registrar = self._registrar, None
        if registrar is not None:
            registrar.close()
        sync, self._sync = self._sync, None
        if sync is not None:
            sync.close()
        self.breakdown.close()

    # --- decode ------------------------------------------------------------------

    def tokens_to_load(
        self, req_id: str, params: TransferParams | None, prompt: int, computed: int
    ) -> int:
        """How many tokens the prefill will push (0: none, or already done)."""
        if params is None or params.role != "decode" or req_id in self._done:
            return 0
        if req_id in self._key_of:
            return 0  # already registered: vLLM asks again while it waits
        if req_id in self._waiting:
            self._keep(req_id, params)  # asked again: no blocks for it yet
        else:
            self._waiting[req_id] = time.monotonic()
            self.breakdown.stamp(
                req_id, "arrived", transfer_id=params.transfer_id, mode=params.mode.value
            )
        return max(0, prompt - computed)

    def refused(self, req_id: str, exc: ParamsError) -> None:
        """Counted and logged by class; only a trusted leg's prefill is told."""
        with self._lock:
            self._counts[f"r:{exc.reason}"] += 1
            first = exc.reason not in self._refusals_logged
            self._refusals_logged.add(exc.reason)
        if first:
            log.error(
                "kvpush: request %s: kv_transfer_params refused (%s): %s. To fix: %s. The "
                "request is served without kvpush. Further refusals of this kind are logged "
                "at DEBUG and counted in vllm:kvpush_params_refused_total{reason=%r}",
                req_id,
                exc.reason,
                exc,
                REFUSALS.get(exc.reason, REFUSALS["malformed"]),
                exc.reason,
            )
        else:
            log.debug("kvpush: request %s: kv_transfer_params refused: %s", req_id, exc)
        if exc.leg is not None:
            self.decline(exc.leg)

    def decline(self, params: TransferParams) -> None:
        """Tell a trusted prefill to release the KV now, never dialing it."""
        sent = False
        if self._sync is not None and params.peer in self._routes:
            sent = self._sync.runtime.decline(params.transfer_id, params.peer)
        with self._lock:
            self._counts["declined" if sent else "decline_unsent"] += 1
        told = "told to release its KV" if sent else "not told (no handshake with it yet)"
        log.debug("kvpush: %s: prefill %s %s", params.transfer_id, params.peer, told)

    def _keep(self, req_id: str, params: TransferParams) -> None:
        """Ask the prefill to keep the KV every third of ``kv_hold_timeout``."""
        now = time.monotonic()
        if now - self._waiting[req_id] < self.config.kv_hold_timeout / 3:
            return
        self._waiting[req_id] = now
        self._route(params).runtime.keep(params.transfer_id, params.peer)

    def reserve(
        self, req_id: str, params: TransferParams, blocks: list[int], skip_tokens: int
    ) -> None:
        """Reserve ``blocks`` and register them with ``params.peer``."""
        self._waiting.pop(req_id, None)
        rt = self._route(params).runtime
        # Under the lock from the call to the bookkeeping: a step() on another
        # thread cannot see this transfer's events before it is known.
        with self._lock:
            result = rt.reserve(
                params.transfer_id,
                params.peer,
                [blocks],
                mode=params.mode,
                skip_tokens=skip_tokens * self._scale,
            )
            if isinstance(result, Refused):  # nothing registered, nothing can land
                self._done.add(req_id)
                self._reports.recving.add(req_id)
                self._reports.failed[req_id] = list(blocks)
                log.warning("kvpush: load of %s refused: %s", req_id, result.reason.value)
                self.breakdown.write(req_id, outcome=f"refused: {result.reason.value}")
            else:
                key = (params.transfer_id, result.epoch)
                tr = _Transfer(req_id, list(blocks), "loading", staged=bool(result.stage))
                self._by_key[key] = tr
                self._key_of[req_id] = key
        if isinstance(result, Refused):  # a trusted leg we will not load
            self.decline(params)

    def preempted(self, req_id: str) -> None:
        """Withdraw a load in flight; a re-admission registers a newer epoch."""
        with self._lock:
            key = self._key_of.get(req_id)
            tr = self._by_key.get(key) if key is not None else None
            if key is None or tr is None or tr.state != "loading":
                return
            tr.state = "preempted"
            del self._key_of[req_id]
        self._runtime().preempt(key[0])

    def finished_decode(self, req_id: str) -> bool:
        """vLLM finished the request; True if its blocks must wait (a load in flight)."""
        self._waiting.pop(req_id, None)
        with self._lock:
            key = self._key_of.get(req_id)
            tr = self._by_key.get(key) if key is not None else None
            self._done.discard(req_id)
            if key is None or tr is None:
                return False
            was, tr.state = tr.state, "aborted"
            if was != "loading":
                return True  # failed: its blocks wait for Released
        self._runtime().abort(key[0])
        return True

    # --- prefill -----------------------------------------------------------------

    def kv_ready(self, req_id: str, params: TransferParams, blocks: list[int]) -> bool:
        """The request's KV is complete in ``blocks``; True: keep them until sent."""
        if not blocks:
            self.breakdown.write(req_id, outcome="no blocks")
            return False
        with self._lock:
            key = (params.transfer_id, 0)
            self._by_key[key] = _Transfer(req_id, list(blocks), "sending")
            self._key_of[req_id] = key
        self._runtime().kv_ready(params.transfer_id, [blocks])
        return True

    def kv_increment(self, transfer_id: str, blocks: list[int]) -> None:
        self._runtime().kv_ready(transfer_id, [blocks], final=False)

    def abandon(self, req_id: str, params: TransferParams) -> None:
        """The prefill request ended without its KV: tell a registered decode now."""
        self.breakdown.write(req_id, outcome="aborted")
        self._runtime().abort(params.transfer_id)

    def release(self, transfer_id: str) -> None:
        """The router's release: held KV or yet to come (an abort's tombstone)."""
        with self._lock:
            self._counts["release_legs"] += 1
        log.debug("kvpush: release of %s from the router", transfer_id)
        if self._sync is not None:  # not started: this instance holds nothing
            self._sync.runtime.abort(transfer_id)

    def expecting(self) -> bool:
        with self._lock:
            return bool(self._by_key)

    def pending_push_work(self) -> bool:
        with self._lock:
            return bool(self._by_key) or bool(self._reports) or bool(self._releasing)

    # --- every step ----------------------------------------------------------------

    def step(self, idle: bool = False) -> tuple[Outbound, Reports]:
        """Drain protocol events; what goes to the workers this step."""
        with self._lock:
            self._steps += 1
            if self._sync is not None:
                events = self._sync.events()
                if not events and idle and self._should_wait():
                    events = self._idle_wait(self._sync)
                for ev in events:
                    self._event(ev)
            due = [r for r in self._releasing if r[0] <= self._steps]
            self._releasing = [r for r in self._releasing if r[0] > self._steps]
            for _, ev, tr, key in due:
                self._released(ev, tr, key)
            reports, self._reports = self._reports, Reports()
        return self.bridge.take(), reports

    def _should_wait(self) -> bool:
        """A decode whose only work is loads in flight, nothing to report."""
        if self._doorbell is None or self._reports:
            return False
        return any(tr.state == "loading" for tr in self._by_key.values())

    def _idle_wait(self, sync: SyncRuntime[Any]) -> list[Event]:
        """Wait up to ``idle_wait``, as vLLM's empty steps while a load waits cost
        the decode a core (docs/performance.md): a worker's ring ends it at
        once, an event or a transfer to ship within ``_SLICE``."""
        assert self._doorbell is not None  # _should_wait
        deadline = time.monotonic() + self.config.idle_wait
        while (left := deadline - time.monotonic()) > 0 and not self.bridge.has_actions():
            rung = self._doorbell.wait(min(left, _SLICE))
            events = sync.events()
            if events or rung:
                return events
        return []

    def results(self, results: list[Result]) -> Reports:
        """Feed the workers' results; returns what vLLM hears in this very step
        (it reads ``finished_*`` after ``update_connector_output``, but load
        errors before it: a failed load stays on the workers' path)."""
        if self._sync is None:  # not started: no transfer was ever shipped
            return Reports()
        rt = self._sync.runtime
        rt.feed(results)
        with self._lock:
            for ev in rt.events_nowait():
                self._event(ev)
            r = self._reports
            now = Reports(r.sending, {req for req in r.recving if req not in r.failed})
            r.sending, r.recving = set(), r.recving - now.recving
        return now

    # --- internals -----------------------------------------------------------------

    def _running(self) -> tuple[SyncRuntime[Any], ControlChannel]:
        if self._sync is None or self._channel is None:
            raise RuntimeError("kvpush: the workers have not registered their KV caches yet")
        return self._sync, self._channel

    def _runtime(self) -> Any:
        return self._running()[0].runtime

    def _route(self, params: TransferParams) -> SyncRuntime[Any]:
        sync, channel = self._running()
        address = params.peer_address()
        if self._routes.get(params.peer) != address:
            sync.call(channel.add_route, params.peer, *address)
            self._routes[params.peer] = address
        return sync

    def _event(self, ev: Event) -> None:
        if isinstance(ev, PeerFailed):
            log.error("kvpush: handshake with %s failed: %s: %s", ev.peer, ev.field, ev.detail)
            return
        if not isinstance(ev, (Ready, Failed, Released, SourceReleased)):
            return
        key = (ev.transfer_id, 0 if isinstance(ev, SourceReleased) else ev.epoch)
        tr = self._by_key.get(key)
        if tr is None:
            # Every transfer is booked before its input reaches the core, so
            # this is one whose request vLLM has forgotten (e.g. abandoned).
            log.debug("kvpush: %s for an unknown transfer", type(ev).__name__)
            return
        r = self._reports
        if isinstance(ev, Ready):
            self._phase(("load", ev.timeline.reserved, ev.timeline.ready))
            r.recving.add(tr.req_id)
            self.breakdown.keep(tr.req_id, ev.timeline)
            self.breakdown.stamp(tr.req_id, "reported")
            self._forget(key, tr)
        elif isinstance(ev, Failed):
            tr.failure = f"{ev.reason.value}: {ev.detail}" if ev.detail else ev.reason.value
            if tr.state == "loading":
                tr.state = "failed"
            log.warning("kvpush: load of %s failed (%s)", tr.req_id, tr.failure)
        elif isinstance(ev, Released) and tr.staged:
            # Its workers may scatter into these blocks until they dropped its
            # record: shipped with the next step's metadata and applied before
            # that step's forward, which is done once two more steps were
            # built (one may be in flight under async scheduling).
            self._releasing.append((self._steps + 2, ev, tr, key))
        elif isinstance(ev, Released):
            self._released(ev, tr, key)
        else:  # SourceReleased
            t = ev.timeline
            self._phase(
                ("wait_registration", t.kv_ready, t.write_started),
                ("write", t.write_started, max((w for _, w in t.write_done), default=None)),
                ("source_held", t.kv_ready, t.released),
            )
            r.sending.add(tr.req_id)
            self._forget(key, tr)
            self.breakdown.write(tr.req_id, ev.timeline, outcome=ev.outcome.value)

    def _released(self, ev: Released, tr: _Transfer, key: _Key) -> None:
        r = self._reports
        if tr.state == "aborted":
            r.sending.add(tr.req_id)  # the delayed free of a finished request
        elif tr.state == "failed":
            r.recving.add(tr.req_id)
            r.failed[tr.req_id] = tr.blocks
        self._forget(key, tr)  # "preempted": vLLM has moved on already
        self.breakdown.write(tr.req_id, ev.timeline, outcome=f"{tr.state}: {tr.failure}")

    def _phase(self, *spans: tuple[str, float | None, float | None]) -> None:
        for phase, start, end in spans:
            if start is not None and end is not None and end >= start:
                self._phases.append((phase, end - start))

    def _forget(self, key: _Key, tr: _Transfer) -> None:
        del self._by_key[key]
        if self._key_of.get(tr.req_id) == key:
            del self._key_of[tr.req_id]
        if tr.state in ("loading", "failed") and self.role is Role.CONSUMER:
            self._done.add(tr.req_id)  # its load ended: never again


#: Seconds between heartbeats (vllm-router drops an entry 5 s after the last).
PERIOD = 1.0


def registration(prefill: bool, http: str, control: str) -> dict[str, str]:
    """The map vllm-router 0.1.17 takes (exact: lower-case values are dropped)."""
    return {
        "type": "P" if prefill else "D",
        "http_address": http,
        "zmq_address": control,
        "transfer_mode": "WRITE",
    }


class Registrar:
    """Sends ``message`` every ``period`` on its own thread until :meth:`close`
    (a router down or restarting is reached when back: ZMQ reconnects)."""

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
