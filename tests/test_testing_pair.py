"""The kit's runtime pair on loopback as an integrator's suite uses it: the
pytest-asyncio fixtures of ``kvpush.testing.pytest_plugin`` (loaded by
tests/conftest.py) in strict mode, beside this suite's anyio-marked tests; and
a separate pytest run that loads the plugin from its own conftest."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvpush.protocol import Mode, PeerReady, Ready, ReleaseOutcome, Reserved, SourceReleased
from kvpush.runtime import ConsumerRuntime, ProducerRuntime
from kvpush.testing import LoopbackConfig, LoopbackPair, LoopbackSide


@pytest.mark.asyncio
async def test_the_pair_is_shaken_hands_and_moves_checked_bytes(
    kvpush_producer: LoopbackSide[ProducerRuntime], kvpush_consumer: LoopbackSide[ConsumerRuntime]
) -> None:
    # Handshaken before the test began, on the test's own loop.
    assert [type(e) for e in kvpush_consumer.events] == [PeerReady]
    assert [type(e) for e in kvpush_producer.events] == [PeerReady]
    assert asyncio.get_running_loop() is not None
    src, dst = [3, 4, 5, 6], [10, 11, 12, 13]
    kvpush_producer.fill(src)
    reserved = kvpush_consumer.runtime.reserve("req-1", kvpush_producer.name, [dst])
    assert isinstance(reserved, Reserved)
    kvpush_producer.runtime.kv_ready("req-1", [src])
    (ready,) = await kvpush_consumer.wait_for(Ready)
    assert isinstance(ready, Ready) and ready.transfer_id == "req-1"
    kvpush_consumer.check(dst)
    (released,) = await kvpush_producer.wait_for(SourceReleased)
    assert isinstance(released, SourceReleased)
    assert released.outcome is ReleaseOutcome.DELIVERED
    assert kvpush_consumer.runtime.endpoint.reserved_blocks == 0
    assert kvpush_producer.runtime.endpoint.held_blocks == 0
    with pytest.raises(AssertionError, match="block 20"):
        kvpush_consumer.check([20])  # never written


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "kvpush_loopback_config",
    [LoopbackConfig(producer_tp=2, consumer_tp=1, consumer_tokens_per_block=8, verify=False)],
)
async def test_a_reshaped_pair_pulls(kvpush_pair: LoopbackPair) -> None:
    """The config fixture parametrized directly: TP 2 -> 1, blocks of 16 -> 8
    tokens, in pull mode."""
    producer, consumer = kvpush_pair.producer, kvpush_pair.consumer
    assert len(producer.transports) == 2 and len(consumer.transports) == 1
    src, dst = [0, 1], [7, 8, 9, 10]
    producer.fill(src)
    producer.runtime.kv_ready("req-2", [src])
    consumer.runtime.reserve("req-2", producer.name, [dst], mode=Mode.PULL)
    await consumer.wait_for(Ready)
    consumer.check(dst)
    await producer.wait_for(SourceReleased)


def test_an_integrators_strict_mode_suite_loads_the_plugin(tmp_path: Path) -> None:
    """What docs/testing.md tells an integrator to write, run by a pytest of
    its own (strict mode, warnings as errors, no anyio marks, no conftest of
    this repository)."""
    (tmp_path / "pytest.ini").write_text(
        textwrap.dedent(
            """\
            [pytest]
            asyncio_mode = strict
            asyncio_default_fixture_loop_scope = function
            asyncio_default_test_loop_scope = function
            filterwarnings = error
            """
        )
    )
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["kvpush.testing.pytest_plugin"]\n')
    (tmp_path / "test_integration.py").write_text(
        textwrap.dedent(
            """\
            import pytest

            from kvpush.protocol import Ready


            @pytest.mark.asyncio
            async def test_handoff(kvpush_producer, kvpush_consumer):
                kvpush_producer.fill([1, 2])
                kvpush_consumer.runtime.reserve("r", kvpush_producer.name, [[5, 6]])
                kvpush_producer.runtime.kv_ready("r", [[1, 2]])
                await kvpush_consumer.wait_for(Ready)
                kvpush_consumer.check([5, 6])
            """
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:anyio"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
