"""The router's child processes: start them, hear from them, stop them.

Every wait is a :func:`multiprocessing.connection.wait` over the children's
pipes *and* their process sentinels, with a timeout, so a child that dies is
noticed at once. :meth:`Children.shutdown` stops the leaders, then the ranks
(Stop, then SIGTERM, then SIGKILL, each with a timeout) and removes any
shared-memory name of the run a killed child left.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from ._model import DemoError
from ._wire import LeaderError, Stop

__all__ = ("Child", "Children", "sweep")

_STOP_TIMEOUT = 5.0
_SEND_TIMEOUT = 5.0
_KILL_TIMEOUT = 2.0
_SHM_DIR = "/dev/shm"

T = TypeVar("T")


@dataclass(eq=False, slots=True)
class Child:
    """One child process and the router's end of its pipe."""

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


class Children:
    """Every child of one run (spawned), whose shared memory starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.ctx = multiprocessing.get_context("spawn")
        self._children: list[Child] = []
        self._stopped = False

    def start(
        self, label: str, target: Callable[..., None], args: tuple[Any, ...], *, leader: bool
    ) -> Child:
        """Start ``target(*args, conn)``, ``conn`` being the child's end of a new pipe."""
        parent, child = self.ctx.Pipe()
        name = "kvpush-demo-" + label.replace(" ", "-")
        process = self.ctx.Process(target=target, args=(*args, child), name=name, daemon=True)
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
        c = Child(label, process, parent, leader=leader)
        self._children.append(c)
        return c

    def poll(self, timeout: float) -> list[tuple[Child, object]]:
        """Messages that arrived within ``timeout``; :class:`DemoError` if a child
        reported an error or exited."""
        waitables: list[Any] = [c.conn for c in self._children if c.open]
        waitables += [c.process.sentinel for c in self._children]
        ready = set(wait(waitables, max(0.0, timeout)))
        out: list[tuple[Child, object]] = []
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

    def send(self, c: Child, msg: object, timeout: float = _SEND_TIMEOUT) -> None:
        """Send unless the child stopped reading (a full pipe would block us)."""
        _, writable, _ = select.select([], [c.conn.fileno()], [], timeout)
        if not writable:
            raise DemoError(f"{c.label} (pid {c.process.pid}) stopped reading its pipe")
        c.conn.send(msg)

    def _drain(self, c: Child) -> list[object]:
        msgs: list[object] = []
        try:
            while c.conn.poll():
                msgs.append(c.conn.recv())
        except (EOFError, OSError):
            c.open = False
        return msgs

    def gather(
        self, children: Iterable[Child], kind: type[T], what: str, timeout: float
    ) -> dict[Child, T]:
        """One ``kind`` message from each of ``children``, within ``timeout``."""
        want = set(children)
        got: dict[Child, T] = {}
        deadline = time.monotonic() + timeout
        while want - got.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                late = ", ".join(sorted(c.label for c in want - got.keys()))
                raise DemoError(f"timed out after {timeout:.0f} s waiting for {what} ({late})")
            for c, m in self.poll(left):
                if c in want and isinstance(m, kind):
                    got[c] = m
        return got

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

    def _stop(self, group: list[Child]) -> None:
        for c in group:
            if c.process.is_alive():
                with suppress(OSError, ValueError, DemoError):
                    self.send(c, Stop(), timeout=0.0)
        _join(group, _STOP_TIMEOUT)
        for c in group:
            if c.process.is_alive():
                c.process.terminate()
        _join(group, _KILL_TIMEOUT)
        for c in group:
            if c.process.is_alive():
                c.process.kill()
        _join(group, _KILL_TIMEOUT)


def _join(group: list[Child], timeout: float) -> None:
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
