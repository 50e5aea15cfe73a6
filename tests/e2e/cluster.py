"""Processes for the end-to-end test: vLLM engines and the kvpush router on loopback.

Every process is started in its own session (process group), with stdout and stderr in
a log file, so that ``stop`` can end it together with the children vLLM spawns
(engine core, worker) and ``tail`` can show what it said. Stdlib only: the pytest
process never imports vLLM or torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

#: What took how long (seconds), printed at the end of the run (conftest.py).
TIMINGS: dict[str, float] = {}

#: The environment every vLLM engine gets (shared/reference/vllm-on-cpu.md).
ENGINE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "UCX_NET_DEVICES": "lo",
    "NIXL_LOG_LEVEL": "WARN",
    "PYTHONUNBUFFERED": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_LOW = range(10000, max(_ephemeral_start(), 14000))
_PORTS = iter(random.Random(os.getpid()).sample(_LOW, 4000))


def free_port() -> int:
    """A free port *below* the kernel's ephemeral range. A port from ``bind(0)`` is
    an ephemeral one: between this pick and the engine's bind, any outgoing
    connection (ZMQ, torch.distributed, UCX) of an engine starting beside it may
    take it (a CI run lost a whole cluster to ``EADDRINUSE`` so). Ports below the
    range are only ever taken by an explicit bind; each is handed out once."""
    for port in _PORTS:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    env: dict[str, str]
    started: float = 0.0
    healthy_after: float | None = None
    popen: subprocess.Popen[bytes] | None = None
    _log_file: TextIO | None = field(default=None, repr=False)

    def start(self) -> None:
        self._log_file = self.log.open("w")
        self._log_file.write("$ " + " ".join(self.argv) + "\n")
        self._log_file.flush()
        self.started = time.monotonic()
        self.popen = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``grace`` seconds; reap."""
        p = self.popen
        if p is not None:
            pgid = p.pid  # start_new_session: the group id is the leader's pid
            if p.poll() is None:
                _signal_group(pgid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(grace)
            # The leader may be gone while its children (engine core, workers) linger.
            _signal_group(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"({self.log}: {exc})"
        # vLLM prints its whole route table at startup: not worth a tail's space.
        text = [t for t in text if "Route: " not in t]
        return "\n".join(text[-lines:])


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post_json(url: str, body: Mapping[str, Any], timeout: float) -> tuple[int, Any]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


def wait_healthy(procs: Sequence[tuple[Proc, str]], timeout: float) -> None:
    """Wait until every ``(proc, health_url)`` answers 200; RuntimeError if one exits
    or ``timeout`` passes (the caller prints the logs' tails)."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for item in list(pending):
            proc, url = item
            if not proc.alive():
                raise RuntimeError(
                    f"{proc.name} exited with status {proc.popen and proc.popen.returncode} "
                    f"before it was healthy (log: {proc.log})"
                )
            try:
                status, _ = get(url, timeout=2.0)
            except OSError:
                continue
            if status == 200:
                proc.healthy_after = time.monotonic() - proc.started
                pending.remove(item)
        if pending and time.monotonic() > deadline:
            names = ", ".join(p.name for p, _ in pending)
            raise RuntimeError(f"not healthy after {timeout:.0f} s: {names}")
        if pending:
            time.sleep(1.0)


def metrics(base_url: str) -> dict[str, float]:
    """A Prometheus text page as {"name{labels}": value}, without the model_name label's noise."""
    status, raw = get(base_url + "/metrics", timeout=10.0)
    if status != 200:
        return {}
    out: dict[str, float] = {}
    for line in raw.decode(errors="replace").splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric_sum(page: Mapping[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for key, value in page.items():
        metric, _, rest = key.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total
