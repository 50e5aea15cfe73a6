"""pytest-asyncio fixtures: a producer and consumer runtime pair on loopback.

Load it from a ``conftest.py`` (it is not registered automatically, so that a
pytest run in an environment that merely has kvpush installed never imports
the test kit)::

    pytest_plugins = ["kvpush.testing.pytest_plugin"]

It works under pytest-asyncio's strict mode (and auto mode); the tests that
use it are ``@pytest.mark.asyncio`` coroutines. The fixtures:

``kvpush_loopback_config``
    The pair's :class:`~kvpush.testing.LoopbackConfig` (the default one).
    Override it in a conftest or a module, or parametrize it directly:
    ``@pytest.mark.parametrize("kvpush_loopback_config", [LoopbackConfig(producer_tp=2)])``.
``kvpush_pair``
    A :class:`~kvpush.testing.LoopbackPair`, shaken hands and pumping; stopped
    and its shared memory freed after the test.
``kvpush_producer``, ``kvpush_consumer``
    Its two :class:`~kvpush.testing.LoopbackSide` objects.

The pair runs on the event loop of the fixture's loop scope
(``asyncio_default_fixture_loop_scope``, "function" unless configured): the
test must run on the same loop, i.e. with the same loop scope. See
docs/testing.md, "A runtime pair on loopback".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TypeVar

import pytest

try:
    import pytest_asyncio
except ImportError as exc:  # pragma: no cover - only without pytest-asyncio
    raise ImportError(
        "kvpush.testing.pytest_plugin needs pytest-asyncio: pip install pytest-asyncio"
    ) from exc

from kvpush.runtime import ConsumerRuntime, ProducerRuntime

from ._loopback import LoopbackConfig, LoopbackPair, LoopbackSide, loopback_pair

__all__ = ("kvpush_consumer", "kvpush_loopback_config", "kvpush_pair", "kvpush_producer")

_T = TypeVar("_T")


@asynccontextmanager
async def _held(cm: AbstractAsyncContextManager[_T]) -> AsyncIterator[_T]:
    """Enter and exit ``cm`` in one task of its own. pytest-asyncio runs an
    async fixture's setup and teardown as separate steps, and the pair's task
    group (anyio's cancel scopes) must be entered and left in one task."""
    loop = asyncio.get_running_loop()
    entered: asyncio.Future[_T] = loop.create_future()
    stop = asyncio.Event()

    async def hold() -> None:
        try:
            async with cm as value:
                entered.set_result(value)
                await stop.wait()
        except BaseException as exc:
            if entered.done():
                raise
            entered.set_exception(exc)

    task = asyncio.create_task(hold(), name="kvpush loopback pair")
    try:
        yield await entered
    finally:
        stop.set()
        # A pump that failed during the test surfaces here, at teardown.
        await task


@pytest.fixture
def kvpush_loopback_config() -> LoopbackConfig:
    """The shape of :func:`kvpush_pair`'s pair: override to change it."""
    return LoopbackConfig()


@pytest_asyncio.fixture
async def kvpush_pair(kvpush_loopback_config: LoopbackConfig) -> AsyncIterator[LoopbackPair]:
    """A producer and a consumer runtime on loopback, handshaken and pumping."""
    async with _held(loopback_pair(kvpush_loopback_config)) as pair:
        yield pair


@pytest.fixture
def kvpush_producer(kvpush_pair: LoopbackPair) -> LoopbackSide[ProducerRuntime]:
    """The pair's producer (prefill) side."""
    return kvpush_pair.producer


@pytest.fixture
def kvpush_consumer(kvpush_pair: LoopbackPair) -> LoopbackSide[ConsumerRuntime]:
    """The pair's consumer (decode) side."""
    return kvpush_pair.consumer
