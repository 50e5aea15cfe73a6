"""The supervisor: starts every instance, dispatches requests, collects results.

It runs in the demo's main process, synchronously, over its children's pipes
(:class:`~._children.Children`: a child that dies is noticed at once). It
starts ``--prefills`` prefill and ``--decodes`` decode instances (a leader
process plus one process per TP rank each), has every decode dial every
prefill, then sends both legs of each request at once to the pair that
:mod:`kvpush.routing` picks (the policy ``kvpush router`` uses), with each
instance's block pool as its capacity. Whatever happens (success, an error,
Ctrl-C), :meth:`Supervisor.shutdown` stops and reaps every child and removes
any shared memory of the run a killed child left.
"""

from __future__ import annotations

import os
import random
import secrets
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Protocol

from kvpush.protocol import Mode, Role, check_options, option
from kvpush.routing import Ledger

from ._children import Child, Children
from ._instance import leader_main
from ._leader import LeaderSpec
from ._model import DEFAULT_MAX_MEMORY_MIB, MODELS, DemoError, PoolPlan, SideGeometry, plan_pool
from ._rank import RankSpec, rank_main
from ._wire import (
    ConsumerResult,
    Dial,
    Dispatch,
    Drop,
    Finish,
    LeaderUp,
    PeerUp,
    ProducerResult,
    RankUp,
    Stats,
)

__all__ = (
    "MAX_INSTANCES",
    "TRANSPORTS",
    "DemoConfig",
    "Instance",
    "Observer",
    "RequestRecord",
    "RunResult",
    "Supervisor",
)

_STARTUP_TIMEOUT = 60.0
_HANDSHAKE_TIMEOUT = 15.0
_STATS_TIMEOUT = 10.0

#: ``--transport`` choices: NIXL (UCX on loopback) or POSIX shared memory.
TRANSPORTS = ("nixl", "memory")
#: Instances per side at most (``--prefills``, ``--decodes``).
MAX_INSTANCES = 8


def check_nixl() -> None:
    """Refuse ``--transport nixl`` up front, with the fix, if NIXL is missing;
    set the environment the leaders inherit (unless the caller set it): UCX on
    loopback only (the demo never leaves the host), NIXL's INFO lines off."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from kvpush.runtime import TransportError, transport_kind

    try:
        transport_kind("nixl").probe()  # kvpush_nixl's, found through the registry
    except TransportError as exc:
        raise DemoError(f"--transport nixl needs NIXL: {exc}") from None


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What ``kvpush demo`` was asked to do: its flags (``kvpush demo --help``)."""

    mode: Mode = option(
        Mode.PUSH, "push: the prefill writes into the decode's blocks; pull: the decode reads"
    )
    transport: str = option(
        "nixl",
        "nixl: NIXL over UCX on loopback, one agent per rank; memory: POSIX shared memory copies",
        choices=TRANSPORTS,
    )
    requests: int = option(32, "requests to run", low=1)
    qps: float = option(
        50.0, "Poisson arrival rate; 0 dispatches as fast as free blocks allow", low=0
    )
    prompt_tokens: int = option(512, "prompt length of every request", low=1)
    #: Prefill and decode instances (each decode dials every prefill), and their TP.
    prefills: int = option(1, "prefill instances, or the preset's", low=1, high=MAX_INSTANCES)
    decodes: int = option(
        1,
        "decode instances, or the preset's; each dials every prefill, and the router spreads "
        "requests over every pair",
        low=1,
        high=MAX_INSTANCES,
    )
    tp_prefill: int = option(1, "tensor-parallel ranks of each prefill, or the preset's", low=1)
    tp_decode: int = option(1, "tensor-parallel ranks of each decode, or the preset's", low=1)
    model: str = option(
        "small",
        "KV shape: small (4 layers, 8 KV heads, head_dim 64, fp16) or qwen3-32b (64 layers, "
        "8 KV heads, head_dim 128, bf16: 256 KiB per token)",
        choices=tuple(sorted(MODELS)),
    )
    compute_us_per_token: float = option(
        20.0, "simulated prefill time per prompt token", unit="us", low=0
    )
    progressive: bool = option(
        False,
        "progressive push: the prefill computes the prompt in chunks of --chunk-tokens and "
        "hands each chunk's whole blocks to the core, which writes them while the rest is "
        "computed; the last chunk commits (push only)",
    )
    chunk_tokens: int = option(128, "the prefill's chunk with --progressive", unit="tokens", low=1)
    link_gbps: float | None = option(
        None,
        "with --transport memory: model each rank's link at this rate, so that the wire "
        "takes time (None: memory speed)",
        unit="Gb/s",
        above=0,
    )
    max_memory_mib: int = option(
        DEFAULT_MAX_MEMORY_MIB,
        "cap on the KV memory of every instance together; the block pools hold --requests "
        "prompts at once, or as many as fit",
        low=1,
    )
    timeout: float = option(
        60.0, "give up when no request settles for this many seconds", unit="s", above=0
    )
    seed: int = option(0, "seeds arrivals, block placement and the KV pattern")
    metrics_port: int | None = option(
        None,
        "serve Prometheus metrics on 127.0.0.1: the decode leader on this port, the prefill "
        "on the next (more instances: the decodes on this port and the next, then the prefills)",
        low=0,
        high=65535,
    )

    def __post_init__(self) -> None:
        check_options(self)


class Observer(Protocol):
    """Told what happens, e.g. to drive a progress bar."""

    def started(self, processes: str) -> None: ...

    def settled(self, ok: bool) -> None: ...


@dataclass(slots=True)
class RequestRecord:
    """One request as the supervisor saw it."""

    transfer_id: str
    dispatched: float
    #: The instances that served it.
    prefill: str = ""
    decode: str = ""
    producer: ProducerResult | None = None
    consumer: ConsumerResult | None = None


@dataclass(slots=True)
class RunResult:
    """What the run produced, for the report."""

    plan: PoolPlan
    records: list[RequestRecord]
    #: Each instance's closing stats, by name.
    stats: dict[str, Stats]
    wall: float
    #: Shared-memory names of the run found (and removed) after every child stopped.
    leftovers: list[str] = field(default_factory=list)
    #: The instances of each side, name -> TP, in order.
    prefills: dict[str, int] = field(default_factory=dict)
    decodes: dict[str, int] = field(default_factory=dict)


@dataclass(eq=False, slots=True)
class Instance:
    """One prefill or decode instance: its leader and its rank processes."""

    name: str
    role: Role
    #: Position among the instances of its side (its index for the routing policy).
    index: int
    geometry: SideGeometry
    segments: tuple[str, ...]
    ranks: list[Child] = field(default_factory=list)
    leader: Child | None = None

    def lead(self) -> Child:
        if self.leader is None:
            raise DemoError(f"{self.name} has no leader yet")
        return self.leader


def instance_names(side: str, n: int) -> list[str]:
    """``side`` alone for one instance, ``side-0`` ... ``side-(n-1)`` for more."""
    return [side] if n == 1 else [f"{side}-{i}" for i in range(n)]


class Supervisor:
    """One run of the demo. :meth:`run` then, always, :meth:`shutdown`."""

    def __init__(self, cfg: DemoConfig, observer: Observer) -> None:
        if cfg.progressive and cfg.mode is not Mode.PUSH:
            raise DemoError(
                "--progressive needs --mode push: a pull epoch is lent only the whole "
                "source, so there is nothing to stream"
            )
        if cfg.link_gbps is not None and cfg.transport != "memory":
            raise DemoError(
                "--link-gbps needs --transport memory (NIXL moves at the rate of its "
                "own fabric; on loopback, memory speed)"
            )
        if cfg.transport == "nixl":
            check_nixl()
        self.cfg = cfg
        self.observer = observer
        self.model = MODELS[cfg.model]
        self.plan = plan_pool(
            self.model,
            cfg.prompt_tokens,
            cfg.requests,
            cfg.max_memory_mib << 20,
            cfg.prefills,
            cfg.decodes,
        )
        self.geometry = {
            Role.PRODUCER: SideGeometry(self.model, cfg.tp_prefill, self.plan.num_blocks),
            Role.CONSUMER: SideGeometry(self.model, cfg.tp_decode, self.plan.num_blocks),
        }
        self.prefix = "kvpd" + secrets.token_hex(4)
        self.secret = secrets.token_bytes(32)
        self.children = Children(self.prefix)
        self.prefills = self._instances(Role.PRODUCER, cfg.prefills)
        self.decodes = self._instances(Role.CONSUMER, cfg.decodes)

    def _instances(self, role: Role, n: int) -> list[Instance]:
        side = "prefill" if role is Role.PRODUCER else "decode"
        geo = self.geometry[role]
        return [
            Instance(
                name, role, i, geo, tuple(f"{self.prefix}-{side[0]}{i}-{r}" for r in range(geo.tp))
            )
            for i, name in enumerate(instance_names(side, n))
        ]

    def _metrics_port(self, inst: Instance) -> int | None:
        """Decodes on PORT, PORT+1, ...; then the prefills."""
        base = self.cfg.metrics_port
        if base is None:
            return None
        return base + inst.index + (len(self.decodes) if inst.role is Role.PRODUCER else 0)

    # --- the run -------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Start everything, push every request through, collect the numbers."""
        cfg, children = self.cfg, self.children
        instances = [*self.prefills, *self.decodes]
        leader_ends: dict[Instance, list[Connection]] = {}
        for inst in instances:
            leader_ends[inst] = []
            for r, segment in enumerate(inst.segments):
                lead, work = children.ctx.Pipe()
                spec = RankSpec(f"{inst.name}-owner{r}", segment, inst.geometry, r)
                label = f"{inst.name} rank {r}"
                inst.ranks.append(children.start(label, rank_main, (spec, work), leader=False))
                work.close()
                leader_ends[inst].append(lead)
        ranks = [c for inst in instances for c in inst.ranks]
        children.gather(ranks, RankUp, "the rank processes", _STARTUP_TIMEOUT)
        for inst in instances:
            spec_ = LeaderSpec(
                inst.role,
                inst.name,
                inst.geometry,
                inst.segments,
                self.secret,
                cfg.mode,
                cfg.compute_us_per_token,
                cfg.seed,
                rank_timeout=cfg.timeout,
                metrics_port=self._metrics_port(inst),
                transport=cfg.transport,
                chunk_tokens=cfg.chunk_tokens if cfg.progressive else 0,
                link_gbps=cfg.link_gbps,
            )
            args = (spec_, leader_ends[inst])
            inst.leader = children.start(f"{inst.name} leader", leader_main, args, leader=True)
            for lead in leader_ends[inst]:
                lead.close()
        leaders = [inst.lead() for inst in instances]
        ups = children.gather(leaders, LeaderUp, "the leaders", _STARTUP_TIMEOUT)
        for d in self.decodes:
            for p in self.prefills:
                children.send(d.lead(), Dial(p.name, "127.0.0.1", ups[p.lead()].port))
        self._handshakes()
        self.observer.started(self._describe())
        records, wall = self._dispatch_all()
        for c in leaders:
            children.send(c, Finish())
        stats = children.gather(leaders, Stats, "closing stats", _STATS_TIMEOUT)
        by_name = {inst.name: stats[inst.lead()] for inst in instances}
        return RunResult(
            self.plan,
            records,
            by_name,
            wall,
            prefills={p.name: p.geometry.tp for p in self.prefills},
            decodes={d.name: d.geometry.tp for d in self.decodes},
        )

    def _handshakes(self) -> None:
        """Wait until every decode completed its handshake with every prefill."""
        want = {(d.lead(), p.name) for d in self.decodes for p in self.prefills}
        deadline = time.monotonic() + _HANDSHAKE_TIMEOUT
        while want:
            left = deadline - time.monotonic()
            if left <= 0:
                late = ", ".join(sorted(f"{c.label} with {p}" for c, p in want))
                raise DemoError(
                    f"timed out after {_HANDSHAKE_TIMEOUT:.0f} s waiting for the handshakes "
                    f"({late})"
                )
            for c, m in self.children.poll(left):
                if isinstance(m, PeerUp):
                    want.discard((c, m.peer))

    def _describe(self) -> str:
        parts = [f"run {self.prefix}: router pid {os.getpid()}"]
        for inst in [*self.prefills, *self.decodes]:
            ranks = ",".join(str(c.process.pid) for c in inst.ranks)
            parts.append(f"{inst.name} leader pid {inst.lead().process.pid} (ranks {ranks})")
        return ", ".join(parts)

    def _dispatch_all(self) -> tuple[list[RequestRecord], float]:
        cfg, children = self.cfg, self.children
        rng = random.Random(cfg.seed)
        blocks = self.plan.blocks_per_request
        ledger = Ledger(len(self.prefills), len(self.decodes), self.plan.num_blocks)
        records: dict[str, RequestRecord] = {}
        pairs: dict[str, tuple[Instance, Instance]] = {}
        issued, settled, in_flight = 0, 0, 0
        start = next_at = last_progress = time.monotonic()
        while settled < cfg.requests:
            now, full = time.monotonic(), False
            while issued < cfg.requests and in_flight < self.plan.slots and now >= next_at:
                pick = ledger.acquire(blocks)
                if pick is None:  # every pool of a side is full
                    full = True
                    break
                p, d = self.prefills[pick.prefill], self.decodes[pick.decode]
                tid = f"req-{issued:06d}"
                records[tid] = RequestRecord(tid, time.monotonic(), p.name, d.name)
                pairs[tid] = (p, d)
                children.send(d.lead(), Dispatch(tid, cfg.prompt_tokens, p.name))  # both legs
                children.send(p.lead(), Dispatch(tid, cfg.prompt_tokens))  # at once
                issued, in_flight, last_progress = issued + 1, in_flight + 1, now
                next_at += rng.expovariate(cfg.qps) if cfg.qps > 0 else 0.0
            room = issued < cfg.requests and in_flight < self.plan.slots and not full
            wake = next_at - now if room else 0.25
            for _, m in children.poll(min(max(wake, 0.0), 0.25)):
                if self._settle(m, records, pairs, ledger):
                    settled, in_flight = settled + 1, in_flight - 1
                    last_progress = time.monotonic()
            if time.monotonic() - last_progress > cfg.timeout:
                raise DemoError(
                    f"no request settled for {cfg.timeout:.0f} s ({issued - settled} in flight); "
                    "stopping the demo"
                )
        return list(records.values()), time.monotonic() - start

    def _settle(
        self,
        m: object,
        records: dict[str, RequestRecord],
        pairs: dict[str, tuple[Instance, Instance]],
        ledger: Ledger,
    ) -> bool:
        """Take a leg's result; True when it settles its request (both legs in)."""
        if not isinstance(m, (ProducerResult, ConsumerResult)) or m.transfer_id not in records:
            return False
        rec, (p, d) = records[m.transfer_id], pairs[m.transfer_id]
        if isinstance(m, ProducerResult):
            rec.producer = m
        else:
            rec.consumer = m
            if not m.ok and rec.producer is None:
                self.children.send(p.lead(), Drop(m.transfer_id))
        if rec.producer is None or rec.consumer is None:
            return False
        ledger.release_prefill(p.index, self.plan.blocks_per_request)
        ledger.release_decode(d.index, self.plan.blocks_per_request)
        self.observer.settled(rec.consumer.ok and not rec.consumer.corrupt_blocks)
        return True

    def shutdown(self) -> list[str]:
        """Stop every child (leaders first), whatever state they are in, and
        remove the run's leftover shared memory; returns the names removed."""
        return self.children.shutdown()
