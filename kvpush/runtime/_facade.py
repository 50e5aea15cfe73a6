"""A synchronous facade for engines that run their own loops (vLLM's scheduler
and workers are synchronous): the runtime's event loop in a background thread
(anyio's blocking portal). What runs on which thread, and why no call hands
back events: docs/runtime.md, "Pieces" (sync facade).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from kvpush.protocol import Event, KvpushError

from ._runtime import EndpointRuntime

__all__ = ("SyncRuntime",)

R = TypeVar("R", bound=EndpointRuntime[Any])
T = TypeVar("T")

#: Seconds the runtime may take to start, once built.
_START_TIMEOUT = 10.0


class SyncRuntime(Generic[R]):
    """Owns a background event loop that runs one :class:`EndpointRuntime`.

    ``setup`` is a coroutine function run on the loop that builds the runtime
    (and enters whatever it needs, e.g. a channel) inside ``stack``.
    """

    def __init__(
        self, setup: Callable[[contextlib.AsyncExitStack], Coroutine[Any, Any, R]]
    ) -> None:
        self._cm = start_blocking_portal()
        self._portal: BlockingPortal = self._cm.__enter__()
        self._stop: anyio.Event | None = None
        try:
            self._future, runtime = self._portal.start_task(self._serve, setup)
        except BaseException:
            self._cm.__exit__(None, None, None)
            raise
        self.runtime: R = runtime
        self._closed = False
        #: Calls that waited for the loop's thread (:meth:`call`).
        self.round_trips = 0

    async def _serve(
        self,
        setup: Callable[[contextlib.AsyncExitStack], Coroutine[Any, Any, R]],
        *,
        task_status: anyio.abc.TaskStatus[R],
    ) -> None:
        """One task owns everything the runtime entered, from start to stop."""
        async with contextlib.AsyncExitStack() as stack:
            # No timeout scope around setup: it enters contexts (task groups)
            # that must outlive it.
            runtime = await setup(stack)
            async with anyio.create_task_group() as tg:
                with anyio.fail_after(_START_TIMEOUT):
                    await tg.start(runtime.run)
                self._stop = anyio.Event()
                task_status.started(runtime)
                await self._stop.wait()
                tg.cancel_scope.cancel()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop (e.g. ``runtime.reserve``) and return
        its result. Events it causes wait in the queue for :meth:`events`."""
        if self._closed:
            raise KvpushError("the runtime is closed")
        self.round_trips += 1
        return self._portal.call(fn, *args)

    def events(self) -> list[Event]:
        """Every event so far, oldest first, and forget them (non-blocking;
        no hop onto the loop)."""
        return self.runtime.events_nowait()

    def wait_events(self, timeout: float) -> list[Event]:
        """Block this thread up to ``timeout`` seconds for at least one event
        (the loop goes on meanwhile)."""
        if self._closed:
            raise KvpushError("the runtime is closed")
        return self.runtime.wait_events(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the runtime and the loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._stop is not None:
                self._portal.call(self._stop.set)
            self._future.result(timeout)
        finally:
            self._cm.__exit__(None, None, None)

    def __enter__(self) -> SyncRuntime[R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
