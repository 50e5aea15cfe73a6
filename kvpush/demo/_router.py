"""The router: starts both instances, dispatches requests, collects results.

It runs in the demo's main process, synchronously: every wait is a
:func:`multiprocessing.connection.wait` over the children's pipes *and* their
process sentinels, with a timeout, so a child that dies is noticed at once.
Whatever happens (success, an error, Ctrl-C), :meth:`Router.shutdown` stops
the leaders, then the ranks (Stop, then SIGTERM, then SIGKILL, each with a
timeout) and removes any shared-memory name of the run a killed child left.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import random
import secrets
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Protocol, TypeVar

from kvpush.protocol import Mode, Role

from ._instance import leader_main
from ._leader import LeaderSpec
from ._model import MODELS, DemoError, PoolPlan, SideGeometry, plan_pool
from ._rank import RankSpec, rank_main
from ._wire import (
    Abort,
    ConsumerResult,
    Dispatch,
    Finish,
    LeaderError,
    LeaderUp,
    PeerUp,
    ProducerResult,
    RankUp,
    Route,
    Stats,
    Stop,
)

__all__ = ("DemoConfig", "Observer", "Record", "Router", "RunResult")

_STARTUP_TIMEOUT = 60.0
_HANDSHAKE_TIMEOUT = 15.0
_STATS_TIMEOUT = 10.0
_STOP_TIMEOUT = 5.0
_SEND_TIMEOUT = 5.0
_KILL_TIMEOUT = 2.0
_SHM_DIR = "/dev/shm"

T = TypeVar("T")

#: ``--transport`` choices: NIXL (UCX on loopback) or POSIX shared memory.
TRANSPORTS = ("nixl", "memory")


def check_nixl() -> None:
    """Refuse ``--transport nixl`` up front, with the fix, if NIXL is missing;
    set the environment the leaders inherit (unless the caller set it): UCX on
    loopback only (the demo never leaves the host), NIXL's INFO lines off."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        from kvpush_nixl import INSTALL_HINT

        raise DemoError(f"--transport nixl needs NIXL ({exc}); {INSTALL_HINT}") from None


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What ``kvpush demo`` was asked to do (see ``kvpush demo --help``)."""

    mode: Mode = Mode.PUSH
    transport: str = "nixl"
    requests: int = 32
    qps: float = 50.0
    prompt_tokens: int = 512
    tp_prefill: int = 1
    tp_decode: int = 1
    seed: int = 0
    model: str = "small"
    compute_us_per_token: float = 20.0
    max_memory_mib: int = 512
    #: Abort when no request settles for this many seconds.
    timeout: float = 60.0
    #: Decode leader's metrics port (the prefill leader's is the next one).
    metrics_port: int | None = None


class Observer(Protocol):
    """Told what happens, e.g. to drive a progress bar."""

    def started(self, processes: str) -> None: ...

    def settled(self, ok: bool) -> None: ...


@dataclass(slots=True)
class Record:
    """One request as the router saw it."""

    transfer_id: str
    dispatched: float
    producer: ProducerResult | None = None
    consumer: ConsumerResult | None = None


@dataclass(slots=True)
class RunResult:
    """What the run produced, for the report."""

    plan: PoolPlan
    records: list[Record]
    stats: dict[str, Stats]
    wall: float
    #: Shared-memory names of the run found (and removed) after every child stopped.
    leftovers: list[str] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class _Child:
    label: str
    process: BaseProcess
    conn: Connection
    leader: bool
    open: bool = True


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class Router:
    """One run of the demo. :meth:`run` then, always, :meth:`shutdown`."""

    def __init__(self, cfg: DemoConfig, observer: Observer) -> None:
        if cfg.transport not in TRANSPORTS:
            raise DemoError(f"unknown transport {cfg.transport!r}; choose from {TRANSPORTS}")
        if cfg.transport == "nixl":
            check_nixl()
        if cfg.model not in MODELS:
            raise DemoError(f"unknown model {cfg.model!r}; choose from {', '.join(MODELS)}")
        if cfg.qps < 0 or not math.isfinite(cfg.qps):
            raise DemoError("--qps must be a finite number >= 0 (0: as fast as blocks allow)")
        if cfg.compute_us_per_token < 0 or not math.isfinite(cfg.compute_us_per_token):
            raise DemoError("--compute-us-per-token must be a finite number >= 0")
        if not cfg.timeout > 0 or not math.isfinite(cfg.timeout):
            raise DemoError("--timeout must be a positive number of seconds")
        self.cfg = cfg
        self.observer = observer
        self.model = MODELS[cfg.model]
        self.plan = plan_pool(self.model, cfg.prompt_tokens, cfg.requests, cfg.max_memory_mib << 20)
        self.geometry = {
            Role.PRODUCER: SideGeometry(self.model, cfg.tp_prefill, self.plan.num_blocks),
            Role.CONSUMER: SideGeometry(self.model, cfg.tp_decode, self.plan.num_blocks),
        }
        self.prefix = "kvpd" + secrets.token_hex(4)
        self.secret = secrets.token_bytes(32)
        self._ctx = multiprocessing.get_context("spawn")
        self._children: list[_Child] = []
        self._leaders: dict[Role, _Child] = {}
        self._stopped = False

    # --- children ------------------------------------------------------------------

    def _start(self, label: str, target: Callable[..., None], args: tuple[Any, ...]) -> _Child:
        parent, child = self._ctx.Pipe()
        name = "kvpush-demo-" + label.replace(" ", "-")
        process = self._ctx.Process(target=target, args=(*args, child), name=name, daemon=True)
        # Born ignoring SIGINT (a terminal's Ctrl-C reaches the whole process
        # group; the router alone handles it), also while it imports.
        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            process.start()
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)
        child.close()  # so that the child's death closes the pipe for us
        c = _Child(label, process, parent, leader=target is leader_main)
        self._children.append(c)
        return c

    def _poll(self, timeout: float) -> list[tuple[_Child, object]]:
        """Messages that arrived within ``timeout``; :class:`DemoError` if a child
        reported an error or exited."""
        waitables: list[Any] = [c.conn for c in self._children if c.open]
        waitables += [c.process.sentinel for c in self._children]
        ready = set(wait(waitables, max(0.0, timeout)))
        out: list[tuple[_Child, object]] = []
        for c in self._children:
            if c.open and (c.conn in ready or c.process.sentinel in ready):
                out += [(c, m) for m in self._drain(c)]
        for c, m in out:
            if isinstance(m, LeaderError):
                raise DemoError(f"{m.text} (pid {c.process.pid})")
        for c in self._children:
            if c.process.sentinel in ready:
                c.process.join(0.1)
                raise DemoError(
                    f"{c.label} (pid {c.process.pid}) exited unexpectedly "
                    f"({_exit_text(c.process.exitcode)}); stopping the demo"
                )
        return out

    def _send(self, c: _Child, msg: object, timeout: float = _SEND_TIMEOUT) -> None:
        """Send unless the child stopped reading (a full pipe would block us)."""
        _, writable, _ = select.select([], [c.conn.fileno()], [], timeout)
        if not writable:
            raise DemoError(f"{c.label} (pid {c.process.pid}) stopped reading its pipe")
        c.conn.send(msg)

    def _drain(self, c: _Child) -> list[object]:
        msgs: list[object] = []
        try:
            while c.conn.poll():
                msgs.append(c.conn.recv())
        except (EOFError, OSError):
            c.open = False
        return msgs

    def _gather(
        self, children: Iterable[_Child], kind: type[T], what: str, timeout: float
    ) -> dict[_Child, T]:
        """One ``kind`` message from each of ``children``, within ``timeout``."""
        want = set(children)
        got: dict[_Child, T] = {}
        deadline = time.monotonic() + timeout
        while want - got.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                late = ", ".join(sorted(c.label for c in want - got.keys()))
                raise DemoError(f"timed out after {timeout:.0f} s waiting for {what} ({late})")
            for c, m in self._poll(left):
                if c in want and isinstance(m, kind):
                    got[c] = m
        return got

    # --- the run -------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Start everything, push every request through, collect the numbers."""
        cfg = self.cfg
        ranks: list[_Child] = []
        leader_ends: dict[Role, list[Connection]] = {}
        segments: dict[Role, list[str]] = {}
        for role, side in ((Role.PRODUCER, "prefill"), (Role.CONSUMER, "decode")):
            geo = self.geometry[role]
            segments[role] = [f"{self.prefix}-{side[0]}{r}" for r in range(geo.tp)]
            leader_ends[role] = []
            for r, segment in enumerate(segments[role]):
                lead, work = self._ctx.Pipe()
                spec = RankSpec(f"{side}-owner{r}", segment, geo, r)
                ranks.append(self._start(f"{side} rank {r}", rank_main, (spec, work)))
                work.close()
                leader_ends[role].append(lead)
        self._gather(ranks, RankUp, "the rank processes", _STARTUP_TIMEOUT)
        for role, name, peer in (
            (Role.PRODUCER, "prefill", "decode"),
            (Role.CONSUMER, "decode", "prefill"),
        ):
            spec_ = LeaderSpec(
                role,
                name,
                peer,
                self.geometry[role],
                tuple(segments[role]),
                self.secret,
                cfg.mode,
                cfg.compute_us_per_token,
                cfg.seed,
                rank_timeout=cfg.timeout,
                metrics_port=None
                if cfg.metrics_port is None
                else cfg.metrics_port + (role is Role.PRODUCER),
                transport=cfg.transport,
            )
            args = (spec_, leader_ends[role])
            self._leaders[role] = self._start(f"{name} leader", leader_main, args)
            for lead in leader_ends[role]:
                lead.close()
        prefill, decode = self._leaders[Role.PRODUCER], self._leaders[Role.CONSUMER]
        ups = self._gather(self._leaders.values(), LeaderUp, "the leaders", _STARTUP_TIMEOUT)
        self._send(decode, Route("127.0.0.1", ups[prefill].port))
        self._gather([decode], PeerUp, "the handshake", _HANDSHAKE_TIMEOUT)
        self.observer.started(self._describe(ranks))
        records, wall = self._dispatch_all(prefill, decode)
        for c in self._leaders.values():
            self._send(c, Finish())
        stats = self._gather(self._leaders.values(), Stats, "closing stats", _STATS_TIMEOUT)
        by_role = {"prefill": stats[prefill], "decode": stats[decode]}
        return RunResult(self.plan, records, by_role, wall)

    def _describe(self, ranks: list[_Child]) -> str:
        def pids(side: str) -> str:
            return ",".join(str(c.process.pid) for c in ranks if c.label.startswith(side))

        p, d = self._leaders[Role.PRODUCER], self._leaders[Role.CONSUMER]
        return (
            f"run {self.prefix}: router pid {os.getpid()}, prefill leader pid {p.process.pid} "
            f"(ranks {pids('prefill')}), decode leader pid {d.process.pid} "
            f"(ranks {pids('decode')})"
        )

    def _dispatch_all(self, prefill: _Child, decode: _Child) -> tuple[list[Record], float]:
        cfg = self.cfg
        rng = random.Random(cfg.seed)
        records: dict[str, Record] = {}
        free, issued, settled = self.plan.slots, 0, 0
        start = next_at = last_progress = time.monotonic()
        while settled < cfg.requests:
            now = time.monotonic()
            while issued < cfg.requests and free > 0 and now >= next_at:
                tid = f"req-{issued:06d}"
                records[tid] = Record(tid, time.monotonic())
                leg = Dispatch(tid, cfg.prompt_tokens)
                self._send(decode, leg)  # both legs at once: reserve + register ...
                self._send(prefill, leg)  # ... while the prefill computes
                free, issued, last_progress = free - 1, issued + 1, now
                next_at += rng.expovariate(cfg.qps) if cfg.qps > 0 else 0.0
            wake = next_at - now if issued < cfg.requests and free > 0 else 0.25
            for _, m in self._poll(min(max(wake, 0.0), 0.25)):
                if not isinstance(m, (ProducerResult, ConsumerResult)):
                    continue
                rec = records.get(m.transfer_id)
                if rec is None:
                    continue
                if isinstance(m, ProducerResult):
                    rec.producer = m
                else:
                    rec.consumer = m
                    if not m.ok and rec.producer is None:
                        self._send(prefill, Abort(m.transfer_id))
                if rec.producer is not None and rec.consumer is not None:
                    free, settled = free + 1, settled + 1
                    last_progress = time.monotonic()
                    self.observer.settled(rec.consumer.ok and not rec.consumer.corrupt_blocks)
            if time.monotonic() - last_progress > cfg.timeout:
                raise DemoError(
                    f"no request settled for {cfg.timeout:.0f} s ({issued - settled} in flight); "
                    "stopping the demo"
                )
        return list(records.values()), time.monotonic() - start

    # --- shutdown ------------------------------------------------------------------------

    def shutdown(self) -> list[str]:
        """Stop every child (leaders first), whatever state they are in, and
        remove the run's leftover shared memory; returns the names removed."""
        if self._stopped:
            return []
        self._stopped = True
        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            leaders = [c for c in self._children if c.leader]
            ranks = [c for c in self._children if not c.leader]
            for group in (leaders, ranks):
                self._stop(group)
            for c in self._children:
                c.conn.close()
            return sweep(self.prefix)
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)

    def _stop(self, group: list[_Child]) -> None:
        for c in group:
            if c.process.is_alive():
                with suppress(OSError, ValueError, DemoError):
                    self._send(c, Stop(), timeout=0.0)
        _join(group, _STOP_TIMEOUT)
        for c in group:
            if c.process.is_alive():
                c.process.terminate()
        _join(group, _KILL_TIMEOUT)
        for c in group:
            if c.process.is_alive():
                c.process.kill()
        _join(group, _KILL_TIMEOUT)


def _join(group: list[_Child], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for c in group:
        c.process.join(max(0.0, deadline - time.monotonic()))


def sweep(prefix: str) -> list[str]:
    """Unlink every shared-memory name starting with ``prefix`` (what a killed
    child could not remove), and drop it from the resource tracker that its
    creator registered it with (every child shares the router's tracker)."""
    try:
        names = sorted(n for n in os.listdir(_SHM_DIR) if n.startswith(prefix))
    except OSError:
        return []
    for name in names:
        with suppress(FileNotFoundError):
            os.unlink(os.path.join(_SHM_DIR, name))
        with suppress(Exception):
            resource_tracker.unregister("/" + name, "shared_memory")
    return names
