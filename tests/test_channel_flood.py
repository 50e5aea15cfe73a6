"""Handshake flood: hundreds of unauthenticated slowloris clients on the same
address as a real peer cannot keep it out, and the channel logs the flood as
a few lines of counts, not a line per connection (issue 13, item 4)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from kvpush.protocol import Codec
from kvpush.runtime import ControlChannel, PeerConnected

pytestmark = pytest.mark.anyio

CLIENTS = Path(__file__).resolve().parent / "flood_clients.py"
SECRET = b"flood-test-shared-secret-0123456789"
CHANNEL_LOG = "kvpush.runtime.channel"
REFUSED = re.compile(r"refused (\d+) connection\(s\) before their preamble")


# asyncio only, for the suite's time: it passes on trio too (tests/conftest.py's
# BACKENDS; drop this fixture to run both). The channel's trio run is test_channel.py.
@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Flood:
    """What one run measured."""

    attackers: int
    #: Seconds from the real peer's add_route to its PeerConnected, per try.
    connect_s: list[float]
    #: Warning lines the listening channel logged about refused connections.
    warnings: int
    #: The connections those lines say were refused, and the channel's count.
    logged_refusals: int
    handshake_failures: int
    refusals: dict[str, int]
    waiting_peak: int
    #: The attackers' own tally: connections made, dials that failed.
    attack: dict[str, int]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def legit_connects_under_flood(
    attackers: int, tries: int = 3, *, seconds: float = 6.0, warmup: float = 1.0
) -> Flood:
    """A prefill's channel listens on loopback; ``attackers`` slowloris clients
    (another process, same 127.0.0.1) flood it; meanwhile ``tries`` fresh
    decode channels with the right secret dial it one after another. Each
    connect time is measured (``inf`` if it did not connect within the run)."""
    lines = _Lines()
    logger = logging.getLogger(CHANNEL_LOG)
    logger.addHandler(lines)
    connect: list[float] = []
    attack: dict[str, int] = {}
    try:
        async with ControlChannel("prefill", Codec(secret=SECRET)) as prefill:
            port = await prefill.listen("127.0.0.1", 0)
            flood = None
            if attackers:
                flood = subprocess.Popen(
                    [sys.executable, str(CLIENTS), str(port), str(attackers), str(seconds)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
            try:
                await anyio.sleep(warmup if attackers else 0)
                budget = (seconds - warmup) / tries
                for i in range(tries):
                    started = anyio.current_time()
                    async with ControlChannel(f"decode-{i}", Codec(secret=SECRET)) as decode:
                        decode.add_route("prefill", "127.0.0.1", port)
                        took = float("inf")
                        with anyio.move_on_after(budget):
                            async for ev in decode.events():
                                if isinstance(ev, PeerConnected):
                                    took = anyio.current_time() - started
                                    break
                        connect.append(took)
                        rest = budget - (anyio.current_time() - started)
                        await anyio.sleep(max(0.0, min(rest, 0.2)))
            finally:
                if flood is not None:
                    out, _ = await anyio.to_thread.run_sync(flood.communicate)
                    attack = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
            await anyio.sleep(0.1)
        # Leaving the block logged what the rate limit still held back; the
        # counters are read after it, so a refusal in between is in both.
        stats = prefill.statistics()
    finally:
        logger.removeHandler(lines)
    refused = [int(m[1]) for line in lines.lines if (m := REFUSED.search(line))]
    old = ("refused a connection", "too many connections in handshake")  # the old log
    refused += [1 for line in lines.lines if any(o in line for o in old)]
    return Flood(
        attackers,
        connect,
        len(refused),
        sum(refused),
        stats.handshake_failures,
        # (getattr: the benchmark also measures code from before these counters)
        dict(getattr(stats, "handshake_refusals", {})),
        getattr(stats, "handshakes_waiting_peak", -1),
        attack,
    )


async def test_a_real_peer_gets_through_300_slowloris_clients_on_its_own_address() -> None:
    """Regression: 70 clients sending one byte of a preamble and redialling
    held every one of the 64 pre-authentication slots, keeping a decode with
    the right secret out for 12 s, and the prefill logged a warning per
    refused connection (~2,500 in 13 s). Now a connection's preamble has a
    short deadline, a flood from one address only evicts itself (oldest
    first), and refusals are logged as one line of counts per interval."""
    with anyio.fail_after(60):
        run = await legit_connects_under_flood(300, tries=3, seconds=7.0)
    print(run)
    assert run.attack.get("connections", 0) > 1000, run  # it was a flood
    assert max(run.connect_s) < 1.5, run
    assert run.handshake_failures > 1000, run
    # The log: a few lines, whose counts add up to every refusal.
    assert run.warnings <= 3, run
    assert run.logged_refusals == run.handshake_failures == sum(run.refusals.values()), run
    assert set(run.refusals) <= {"evicted_source", "evicted_full", "timeout", "closed"}, run
    assert run.waiting_peak <= 64, run


async def test_a_silent_connection_is_closed_at_the_preamble_deadline() -> None:
    async with ControlChannel("prefill", Codec(), preamble_timeout=0.2) as prefill:
        port = await prefill.listen("127.0.0.1", 0)
        stream = await anyio.connect_tcp("127.0.0.1", port)
        async with stream:
            started = time.monotonic()
            await stream.send(b"\x00")
            with anyio.fail_after(2), pytest.raises((anyio.EndOfStream, OSError)):
                await stream.receive()
            assert 0.15 < time.monotonic() - started < 1.0
        assert dict(prefill.statistics().handshake_refusals) == {"timeout": 1}
        assert prefill.statistics().handshakes_waiting == 0


async def test_a_full_source_evicts_its_own_oldest_connection() -> None:
    """Per-source bound: the third silent connection from one address pushes
    out the first; a real peer from the same address still connects."""
    async with ControlChannel(
        "prefill", Codec(), max_handshakes_per_source=2, preamble_timeout=30
    ) as prefill:
        port = await prefill.listen("127.0.0.1", 0)
        first = await anyio.connect_tcp("127.0.0.1", port)
        others = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(2)]
        with anyio.fail_after(2), pytest.raises((anyio.EndOfStream, OSError)):
            await first.receive()
        await first.aclose()
        assert dict(prefill.statistics().handshake_refusals) == {"evicted_source": 1}
        async with ControlChannel("decode", Codec()) as decode:
            decode.add_route("prefill", "127.0.0.1", port)
            with anyio.fail_after(2):
                async for ev in decode.events():
                    if isinstance(ev, PeerConnected):
                        break
        stats = prefill.statistics()
        assert stats.handshake_refusals["evicted_source"] == 2  # the decode pushed one out
        assert stats.handshakes_waiting == 1
        for s in others:
            await s.aclose()
