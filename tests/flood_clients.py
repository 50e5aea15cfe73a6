"""Slowloris clients for the handshake-flood test and benchmark (a subprocess).

    python tests/flood_clients.py PORT CLIENTS SECONDS

Each of CLIENTS connections to 127.0.0.1:PORT sends one byte of a length
prefix (a preamble that never comes), waits until the server closes it, and
redials at once; every client stops after SECONDS. Prints one JSON line:
connections made and dials that failed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def _client(port: int, until: float, tally: dict[str, int]) -> None:
    while time.monotonic() < until:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            tally["failed"] += 1
            await asyncio.sleep(0.01)
            continue
        tally["connections"] += 1
        try:
            writer.write(b"\x00")
            await writer.drain()
            await asyncio.wait_for(reader.read(1 << 16), max(0.001, until - time.monotonic()))
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()


async def _main(port: int, clients: int, seconds: float) -> None:
    until = time.monotonic() + seconds
    tally = {"connections": 0, "failed": 0}
    await asyncio.gather(*(_client(port, until, tally) for _ in range(clients)))
    print(json.dumps(tally), flush=True)


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
