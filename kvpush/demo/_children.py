"""The supervisor's child processes: start them, hear from them, stop them.

Every wait is a :func:`multiprocessing.connection.wait` over the children's
pipes *and* their process sentinels, with a timeout, so a child that dies is
noticed at once. :meth:`Children.shutdown` stops the leaders, then the ranks
(Stop to a child that said it is up, SIGTERM at once to one still starting,
which cannot read its pipe yet; then SIGTERM, then SIGKILL, all within
:data:`STOP_BUDGET`) and removes any shared-memory name of the run a killed
child left.

Ctrl-C (SIGINT to the whole process group) is the supervisor's alone. A child is
born with SIGINT blocked (the supervisor blocks it around the fork, the child
inherits the mask) and ignores it from its first line; the supervisor's own
handler (:func:`interrupts`) raises :class:`KeyboardInterrupt` once, never
inside :meth:`Children.start` (held there, raised when the child is on the
books) and never again once :meth:`Children.shutdown` began, so a second
Ctrl-C cannot cut the clean-up short.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any, TypeVar

from ._model import DemoError
from ._wire import LeaderError, Stop

__all__ = ("STOP_BUDGET", "Child", "Children", "interrupts", "sweep")

#: Seconds :meth:`Children.shutdown` takes at most, however the children behave:
#: the leaders' share, then the ranks' (who answer a Stop at once), each spent
#: on (Stop or SIGTERM, then SIGTERM, then SIGKILL).
STOP_BUDGET = 4.0
_LEADERS_SHARE = 0.75
#: Of a group's share: waiting on Stop, then on SIGTERM (SIGKILL: the rest).
_STOP_SHARE, _TERM_SHARE = 0.6, 0.25
_SEND_TIMEOUT = 5.0
_SHM_DIR = "/dev/shm"
_SIGINT = {signal.SIGINT}

T = TypeVar("T")


class _Gate:
    """The supervisor's SIGINT and SIGTERM handler: one :class:`KeyboardInterrupt`,
    at a point where it leaves nothing half done."""

    def __init__(self) -> None:
        self.held = 0
        self.pending = False
        self.closed = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.closed:
            return  # a second Ctrl-C: the clean-up under way goes on
        if self.held:
            self.pending = True
            return
        self.closed = True
        raise KeyboardInterrupt

    def release(self) -> None:
        """Leaving a held section: raise the interrupt that came meanwhile."""
        if self.pending and not self.held and not self.closed:
            self.pending, self.closed = False, True
            raise KeyboardInterrupt


def _current_gate() -> _Gate | None:
    handler = signal.getsignal(signal.SIGINT)
    return handler if isinstance(handler, _Gate) else None


@contextmanager
def interrupts() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise :class:`KeyboardInterrupt` in the main
    thread once, as described above (elsewhere than the main thread: no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    gate = _Gate()
    old = {sig: signal.signal(sig, gate) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextmanager
def _held() -> Iterator[None]:
    """No KeyboardInterrupt from :func:`interrupts` within (one that comes is
    raised on the way out); SIGINT blocked in this thread, so that a child
    forked here is born with it blocked."""
    gate = _current_gate()
    if gate is not None:
        gate.held += 1
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGINT)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGINT)
        if gate is not None:
            gate.held -= 1
    if gate is not None:
        gate.release()


def ignore_sigint() -> None:
    """A child's first line: ignore SIGINT (Ctrl-C is the supervisor's), then
    unblock it (blocked since birth, see above; one that came is dropped)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGINT)


@dataclass(eq=False, slots=True)
class Child:
    """One child process and the supervisor's end of its pipe."""

    label: str
    process: BaseProcess
    conn: Connection
    leader: bool
    open: bool = True
    #: It sent its first message (it is up and reads its pipe).
    up: bool = False


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
        if self._stopped:
            raise DemoError("the demo is stopping")
        parent, child = self.ctx.Pipe()
        name = "kvpush-demo-" + label.replace(" ", "-")
        process = self.ctx.Process(target=target, args=(*args, child), name=name, daemon=True)
        # Started before the mask below: starting it unblocks SIGINT.
        resource_tracker.ensure_running()
        # Born with SIGINT blocked (a terminal's Ctrl-C reaches the whole
        # process group; the supervisor alone handles it), also while it imports;
        # a Ctrl-C meanwhile is raised once the child is on the books.
        with _held():
            try:
                process.start()
            finally:
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
                msgs = self._drain(c)
                c.up = c.up or bool(msgs)
                out += [(c, m) for m in msgs]
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
        gate = _current_gate()
        if gate is not None:
            gate.closed = True  # no KeyboardInterrupt from here on
        leaders = [c for c in self._children if c.leader]
        ranks = [c for c in self._children if not c.leader]
        self._stop(leaders, STOP_BUDGET * _LEADERS_SHARE)
        self._stop(ranks, STOP_BUDGET * (1 - _LEADERS_SHARE))
        for c in self._children:
            c.conn.close()
        return sweep(self.prefix)

    def _stop(self, group: list[Child], budget: float) -> None:
        """Stop to the children that are up, SIGTERM to those still starting
        (they read no pipe yet: a Stop would wait for them to be up), then
        SIGTERM, then SIGKILL to any left, all within ``budget`` seconds."""
        start = time.monotonic()
        for c in group:
            if not c.process.is_alive():
                continue
            if c.up and c.open:
                with suppress(OSError, ValueError, DemoError):
                    self.send(c, Stop(), timeout=0.0)
                    continue
            c.process.terminate()
        _join(group, start + budget * _STOP_SHARE)
        for c in group:
            if c.process.is_alive():
                c.process.terminate()
        _join(group, start + budget * (_STOP_SHARE + _TERM_SHARE))
        for c in group:
            if c.process.is_alive():
                c.process.kill()
        _join(group, start + budget)


def _join(group: list[Child], deadline: float) -> None:
    """Join every child of ``group`` that exits by ``deadline`` (monotonic)."""
    for c in group:
        c.process.join(max(0.0, deadline - time.monotonic()))


def sweep(prefix: str) -> list[str]:
    """Unlink every shared-memory name starting with ``prefix`` (what a killed
    child could not remove), and drop it from the resource tracker that its
    creator registered it with (every child shares the supervisor's tracker)."""
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
