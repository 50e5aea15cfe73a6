"""Device check: kvpush on one GPU, three checks, one JSON report.

**model** (:mod:`device_handoff`, run first): a small random-weight Llama
(transformers, GQA) computes a prompt's KV on prefill rank processes, each
writing its heads into a KV cache allocated the way vLLM 0.33 allocates its
packed GPU cache (:mod:`device_kv`); kvpush moves it through the connector's
own halves without vLLM (``SchedulerSide`` per instance, ``WorkerSide`` per
rank, NIXL), TP 1 -> 1 and 2 -> 1, push and pull, block sizes equal and not,
progressive push; the decode rank generates greedily from the KV it received,
and its tokens must equal one process's alone. bf16 in VRAM with ``--gpu``
(every case); float32 on CPU with ``--cpu`` (the CI cases); the GPU's model
and cases on CPU tensors with ``--torch-dram``.

**wire**: kvpush push and pull over NIXL between two processes. This process
is the producer (prefill), a spawned one the consumer (decode). Each registers
its KV memory with a :class:`~kvpush_nixl.NixlTransport` (UCX; VRAM with
``--gpu``, DRAM otherwise). The bytes move the way the ``kvpush`` variant of
``benchmarks/nixl_throughput.py`` moves them, whose geometry this imports (2
layers of split K/V: 4 regions; 50% fragmented block tables): a
:class:`~kvpush.runtime.TransferPlanner` per route, then ``write_prepped`` or
``write`` (push: the producer posts, the notice follows the data) or
``read_prepped`` or ``read`` (pull: the consumer posts), chosen by the
transport's ``prefers_prepped`` as the runtime's data plane chooses (``--path``
forces one). Every round zeroes the consumer, moves the bytes, and checks them
in the consumer: the written blocks against the producer's seeded pattern,
made again there, and every other block still zero; with torch on the device
(``--gpu``), numpy (``--cpu``), or torch on CPU tensors (``--torch-dram``).
Round 0 warms up; the others are timed, push from before planning until the
producer's ``poll()`` reports it done, pull the same in the consumer. The
ceiling is a plain copy of as many bytes in one process: torch's ``copy_`` on
the same device, or ``np.copyto``.

**staging** (issue 27): ``benchmarks/staging.py`` on the same memory: raw NIXL
one row per block, raw NIXL's minimal descriptor set, kvpush in place, kvpush
staged (gather into the producer's pool, one span per route, scatter on the
decode, through ``kvpush_vllm._copier.TorchCopier`` on the GPU) and a plain
device copy, push and pull, 4 KiB to 2 MiB blocks, 50% fragmented, every
variant checked byte for byte once; its JSON under ``staging`` (``entries``,
``goals``, ``cost_model``, ``verified``).

One JSON object is printed last on stdout (progress on stderr): ``ok`` (every
check run passed), ``checks``, ``model`` (``ok``, ``device``, ``spec``,
``cases``: per case ``tokens``, ``reference``, ``tokens_equal``,
``zero_kv_tokens``, ``zero_kv_differs``, ``kv_equal``, ``elsewhere_zero``,
``bytes_posted``, ``kv_bytes``, ``transfer_s``, ``seconds``, ``ok``), and for
the wire check ``verified``, ``push_done``, ``pull_done``, ``entries`` (per
block size: ``push`` and ``pull`` with ``gbps``, ``gbps_min_max``, ``rounds``,
``verified``; ``push.notice_gbps`` until the consumer saw the notice;
``copy_gbps``, ``push_over_copy``, ``pull_over_copy``, ``path``, ``rows``);
``host``, ``env``, and ``error`` if a check failed. GB/s is 10^9 bytes/s.
Exit 0 if every check passed, 1 if not, 2 if the host cannot run it (``--gpu``
without torch, CUDA or NIXL; the model check without torch or transformers:
the message names what is missing). Every wait is bounded; every child
process is stopped and reaped, on SIGTERM too.

Run it with ``scripts/device-check.sh`` (which installs NIXL offline first: see
its header and docs/operations.md) or as ``python scripts/device_check.py
[--gpu | --cpu | --torch-dram] [--checks model,wire,staging] [--model-cases NAMES]
[--total-mib N] [--block-kib K ...] [--reps R]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import time
import zipfile
from importlib.metadata import PackageNotFoundError, version
from multiprocessing.connection import Connection
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# kvpush and benchmarks/ from this tree, installed or not; the device_* modules beside this.
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import numpy as np  # noqa: E402

import benchmarks.nixl_throughput as bench  # noqa: E402

#: The checks, in the order they run.
CHECKS = ("model", "wire", "staging")
from kvpush.protocol import KVLayout, MemoryType, Role, compute_topology, layer_regions  # noqa: E402
from kvpush.runtime import TransferPlanner, TransportError  # noqa: E402
from kvpush_nixl import TRANSPORT, NixlTransport, PrepRule  # noqa: E402

NAP_S = 200e-6  # the consumer's wait for a command between polls (the data plane's interval)
IDLE_S = 300.0  # the consumer gives up after this long without a command
PATHS = {"auto": None, "rows": PrepRule(min_rows=1 << 62), "prepped": PrepRule(0, 0)}
ROUTE = compute_topology(1, 1, 1, bench.HEADS).routes[0]
MODES = ("gpu", "torch-dram", "cpu")  # VRAM and torch; DRAM and torch; DRAM and numpy
Tables = tuple[tuple[int, ...], tuple[int, ...]]


class Terminated(BaseException):
    """SIGTERM (the wrapper's ``timeout``): stop, reap the child processes,
    report. Not an ``Exception``: no check's own error handling swallows it."""


class Mem:
    """One side's KV memory (``MODES``): a uint8 torch tensor, or a numpy array."""

    def __init__(self, mode: str, nbytes: int) -> None:
        self.torch: Any = None
        self.vram = mode == "gpu"
        if mode == "cpu":
            self.buf: Any = np.zeros(nbytes, dtype=np.uint8)
            self.ptr, self.device = int(self.buf.ctypes.data), 0
        else:
            import torch

            self.torch = torch
            self.buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda" if self.vram else "cpu")
            self.ptr, self.device = int(self.buf.data_ptr()), int(self.buf.device.index or 0)
        self.sync()

    def sync(self) -> None:
        if self.vram:
            self.torch.cuda.synchronize()

    def fill(self, seed: int) -> None:
        """The producer's pattern: seeded random bytes (the consumer makes the same)."""
        if self.torch is not None:
            gen = self.torch.Generator(device=self.buf.device).manual_seed(seed)
            self.buf.random_(0, 256, generator=gen)
        else:
            rng = np.random.default_rng(seed)
            self.buf.view(np.uint64)[:] = rng.integers(0, 1 << 63, self.buf.size // 8, np.uint64)
        self.sync()

    def zero(self) -> None:
        self.buf.zero_() if self.torch is not None else self.buf.fill(0)
        self.sync()

    def blocks(self, pool: int, ids: tuple[int, ...]) -> Any:
        """Blocks ``ids`` of every region (region-major), a copy on the same device."""
        view = self.buf.reshape(bench.REGIONS, pool, -1)
        if self.torch is not None:
            return view[:, self.torch.tensor(ids, dtype=self.torch.long, device=view.device)]
        return view[:, np.asarray(ids, dtype=np.int64)]

    def equal(self, a: Any, b: Any) -> bool:
        return bool(self.torch.equal(a, b)) if self.torch is not None else np.array_equal(a, b)


def kv_layout(vram: bool, base: int, device: int, block: int, pool: int) -> KVLayout:
    """The benchmark's geometry (layer ``i`` at ``base + i * 2 * pool * block``)
    in VRAM of ``device`` or in DRAM."""
    regions = layer_regions(
        [base + i * 2 * pool * block for i in range(bench.LAYERS)],
        num_blocks=pool,
        tokens_per_block=bench.tokens_per_block(block),
        num_heads=bench.HEADS,
        head_bytes=bench.HEAD_BYTES,
        memory=MemoryType.VRAM if vram else MemoryType.DRAM,
        device=device,
    )
    return KVLayout(regions)


class Mover:
    """One side's posting path, as the data plane posts: plan, then by index
    into lists prepared once per route, or merged rows (``prefers_prepped``)."""

    def __init__(
        self,
        transport: NixlTransport,
        peer: str,
        planner: TransferPlanner,
        role: Role,
        tables: Tables,
    ) -> None:
        self.transport, self.peer, self.planner, self.role = transport, peer, planner, role
        self.src, self.dst = tables
        plan = planner.plan((self.src,), (self.dst,))
        self.rows, self.pieces = plan.num_descriptors, plan.num_pieces
        self.prepped = transport.prefers_prepped(self.rows, self.pieces)
        if self.prepped:
            theirs = Role.CONSUMER if role is Role.PRODUCER else Role.PRODUCER
            transport.prep(peer, ROUTE, planner.prepped(role), planner.prepped(theirs))

    def move(self, notice: bytes | None) -> tuple[int, int]:
        """Post one transfer (a WRITE with ``notice``, or a READ), wait until
        ``poll()`` reports it; (start, done) in monotonic ns."""
        t0 = time.monotonic_ns()
        plan = self.planner.plan((self.src,), (self.dst,))
        t, write = self.transport, self.role is Role.PRODUCER
        if self.prepped:
            src, dst = plan.indices()
            if write:
                handle = t.write_prepped(self.peer, ROUTE, src, dst, notice or b"")
            else:
                handle = t.read_prepped(self.peer, ROUTE, dst, src)
        elif write:
            handle = t.write(self.peer, plan.src, plan.dst, notice or b"")
        else:
            handle = t.read(self.peer, plan.dst, plan.src)
        end = t0 + int(bench.DEADLINE_S * 1e9)
        while time.monotonic_ns() < end:
            done = next((c for c in t.poll()[0] if c.handle == handle), None)
            if done is not None:
                if done.error is not None:
                    raise RuntimeError(f"{'push' if write else 'pull'} failed: {done.error}")
                return t0, time.monotonic_ns()
        raise TimeoutError(f"{'push' if write else 'pull'} not done in {bench.DEADLINE_S:.0f} s")


def consumer_main(conn: Connection, mode: str, block: int, pool: int, seed: int, path: str) -> None:
    """The consumer process: serves zero / verify / pull / stop, polling NIXL between."""
    bench.set_env()
    transport: NixlTransport | None = None
    try:
        mem = Mem(mode, bench.side_bytes(block, pool))
        # vram: UCX's VRAM defaults (kvpush_nixl/_ucx.py: cuda_ipc GET zero-copy for pull)
        transport = NixlTransport("check-decode", prep_rule=PATHS[path], vram=mem.vram)
        mine = kv_layout(mem.vram, mem.ptr, mem.device, block, pool)
        transport.register(mine)
        conn.send(("ready", transport.metadata(), mem.ptr, mem.device))
        if not conn.poll(bench.START_S):
            raise TimeoutError(f"no word from the producer in {bench.START_S:.0f} s")
        msg = conn.recv()
        if msg[0] == "stop":  # the producer failed before it could start
            conn.send(("stopped",))
            return
        _, meta, base, device, tables = msg
        theirs = kv_layout(mem.vram, base, device, block, pool)
        peer = transport.add_peer(meta, theirs)
        mover = Mover(transport, peer, TransferPlanner(theirs, mine, ROUTE), Role.CONSUMER, tables)
        source = Mem(mode, bench.side_bytes(block, pool))  # the producer's bytes, made again here
        source.fill(seed)
        expected = source.blocks(pool, tables[0])
        del source
        rest = tuple(sorted(set(range(pool)) - set(tables[1])))
        conn.send(("ok",))
        _consumer_serve(conn, transport, mem, mover, expected, (pool, tables[1], rest))
    except (EOFError, BrokenPipeError):  # the producer is gone
        return
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        if transport is not None:
            transport.close()


def _consumer_serve(
    conn: Connection,
    transport: NixlTransport,
    mem: Mem,
    mover: Mover,
    expected: Any,
    blocks: tuple[int, tuple[int, ...], tuple[int, ...]],
) -> None:
    """Serve the producer's commands until ``stop``, polling NIXL between.
    ``blocks``: the pool size, the destination blocks and every other block."""
    pool, dst, rest = blocks
    idle_until = time.monotonic() + IDLE_S
    while True:
        for notice in transport.poll()[1]:
            conn.send(("notice", notice.payload, time.monotonic_ns()))
        if not conn.poll(NAP_S):
            if time.monotonic() > idle_until:
                raise TimeoutError(f"no command for {IDLE_S:.0f} s")
            continue
        cmd = conn.recv()[0]
        idle_until = time.monotonic() + IDLE_S
        if cmd == "zero":
            mem.zero()
            conn.send(("ok",))
        elif cmd == "verify":
            got, others = mem.blocks(pool, dst), mem.blocks(pool, rest)
            conn.send(("verified", mem.equal(got, expected) and not bool(others.any())))
        elif cmd == "pull":
            conn.send(("pulled", *mover.move(None)))
        elif cmd == "stop":
            conn.send(("stopped",))
            return
        else:
            raise RuntimeError(f"unknown command {cmd!r}")


class Consumer:
    """The consumer process and its pipe: every wait bounded, always reaped."""

    def __init__(self, mode: str, block: int, pool: int, seed: int, path: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=consumer_main,
            args=(child, mode, block, pool, seed, path),
            name="device-check-consumer",
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.seen: dict[bytes, int] = {}

    def __enter__(self) -> Consumer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def expect(
        self, kind: str, timeout: float = bench.DEADLINE_S, keep: Any = None
    ) -> tuple[Any, ...]:
        """The next message of ``kind`` (notices on the way are recorded); polls
        transport ``keep`` meanwhile, so that this side progresses a peer's READ."""
        end = time.monotonic() + timeout
        while True:
            if keep is not None:
                keep.poll()
            left = end - time.monotonic()
            if left <= 0:
                state = "alive" if self.proc.is_alive() else f"exited ({self.proc.exitcode})"
                raise TimeoutError(f"no {kind!r} from the consumer in {timeout:.0f} s ({state})")
            if not self.conn.poll(min(left, NAP_S) if keep is not None else left):
                continue
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                raise self.gone() from None
            if msg[0] == kind:
                return tuple(msg)
            if msg[0] == "notice":
                self.seen[msg[1]] = msg[2]
            elif msg[0] == "error":
                raise RuntimeError(f"consumer: {msg[1]}")
            elif kind != "stopped":  # stopping skips the reply to a command cut short
                raise RuntimeError(f"expected {kind!r} from the consumer, got {msg[0]!r}")

    def call(self, cmd: str, reply: str = "ok", keep: Any = None) -> tuple[Any, ...]:
        self.send((cmd,))
        return self.expect(reply, bench.DEADLINE_S, keep)

    def send(self, msg: tuple[Any, ...]) -> None:
        try:
            self.conn.send(msg)
        except OSError:
            raise self.gone() from None

    def gone(self) -> RuntimeError:
        self.proc.join(1.0)
        return RuntimeError(f"the consumer process died (exit code {self.proc.exitcode})")

    def notice_seen(self, payload: bytes) -> int:
        """When the consumer saw ``payload`` (monotonic ns); waits for it."""
        end = time.monotonic() + bench.DEADLINE_S
        while payload not in self.seen:
            msg = self.expect("notice", max(0.0, end - time.monotonic()))
            self.seen[msg[1]] = msg[2]
        return self.seen.pop(payload)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("stop",))
                self.expect("stopped")
        except (OSError, EOFError, TimeoutError, RuntimeError) as exc:
            bench.log(f"stopping the consumer: {exc}")
        finally:
            self.proc.join(bench.DEADLINE_S)
            if self.proc.is_alive():
                bench.log("the consumer did not exit: killing it")
                self.proc.kill()
                self.proc.join(bench.DEADLINE_S)
            self.conn.close()


def copy_samples(mode: str, nbytes: int, reps: int) -> list[float]:
    """Seconds per plain copy of ``nbytes`` in this process (the ceiling): the
    benchmark's ``np.copyto``, or torch's ``copy_`` on the same device."""
    if mode == "cpu":
        return bench.copyto_samples(nbytes, reps)
    a, b = Mem(mode, nbytes), Mem(mode, nbytes)
    a.buf.fill_(1)
    out = []
    for _ in range(reps + 1):  # the first warms up
        a.sync()
        t0 = time.perf_counter()
        b.buf.copy_(a.buf)
        b.sync()
        out.append(time.perf_counter() - t0)
    return out[1:]


def summary(nbytes: int, times: list[float], verified: list[bool]) -> dict[str, Any]:
    return {
        "rounds": len(times),
        "verified": all(verified),
        "gbps": bench.gbps(nbytes, statistics.median(times)),
        "gbps_min_max": [bench.gbps(nbytes, max(times)), bench.gbps(nbytes, min(times))],
    }


def check(mode: str, block: int, total: int, reps: int, seed: int, path: str) -> dict[str, Any]:
    """One block size: a new consumer and new agents, ``reps`` timed rounds of
    push then pull after one warm-up round, every round verified."""
    n = total // (bench.REGIONS * block)
    pool, nbytes = bench.POOL_FACTOR * n, bench.REGIONS * n * block
    with Consumer(mode, block, pool, seed, path) as consumer:
        mem = Mem(mode, bench.side_bytes(block, pool))
        mem.fill(seed)
        with NixlTransport("check-prefill", prep_rule=PATHS[path], vram=mem.vram) as transport:
            mine = kv_layout(mem.vram, mem.ptr, mem.device, block, pool)
            transport.register(mine)
            _, meta, base, device = consumer.expect("ready", bench.START_S)
            theirs = kv_layout(mem.vram, base, device, block, pool)
            peer = transport.add_peer(meta, theirs)
            rng = np.random.default_rng([seed, block])
            lengths = bench.break_pattern(rng, n)
            tables = (bench.place(rng, lengths, pool), bench.place(rng, lengths, pool))
            consumer.send(("peer", transport.metadata(), mem.ptr, mem.device, tables))
            consumer.expect("ok", bench.START_S, keep=transport)
            planner = TransferPlanner(mine, theirs, ROUTE)
            mover = Mover(transport, peer, planner, Role.PRODUCER, tables)
            push: list[float] = []
            notice: list[float] = []
            pull: list[float] = []
            ok: dict[str, list[bool]] = {"push": [], "pull": []}
            for rnd in range(reps + 1):
                consumer.call("zero")
                payload = f"check:{block}:{rnd}:".encode().ljust(bench.NOTICE_BYTES, b".")
                t0, t_done = mover.move(payload)
                seen = consumer.notice_seen(payload)
                ok["push"].append(bool(consumer.call("verify", "verified")[1]))
                consumer.call("zero")
                _, p0, p_done = consumer.call("pull", "pulled", keep=transport)
                ok["pull"].append(bool(consumer.call("verify", "verified", keep=transport)[1]))
                if rnd:  # round 0 warms up
                    push.append((t_done - t0) / 1e9)
                    notice.append((seen - t0) / 1e9)
                    pull.append((p_done - p0) / 1e9)
        del mem
    copy = bench.gbps(nbytes, statistics.median(copy_samples(mode, nbytes, max(reps, 5))))
    entry: dict[str, Any] = {
        "block_bytes": block,
        "blocks_per_region": n,
        "bytes": nbytes,
        "path": "prepped" if mover.prepped else "rows",
        "rows": mover.rows,
        "pieces": mover.pieces,
        "push": summary(nbytes, push, ok["push"]),
        "pull": summary(nbytes, pull, ok["pull"]),
        "copy_gbps": copy,
    }
    entry["push"]["notice_gbps"] = bench.gbps(nbytes, statistics.median(notice))
    entry["push_over_copy"] = round(entry["push"]["gbps"] / copy, 4)
    entry["pull_over_copy"] = round(entry["pull"]["gbps"] / copy, 4)
    return entry


def gpu_missing() -> str | None:
    """Why the GPU path cannot run here (naming what is missing), or ``None``."""
    try:
        import torch
    except ImportError as exc:
        return (
            f"torch is not installed ({exc}); the GPU path uses the machine's CUDA torch: "
            "run it with the interpreter that has it (PYTHON=... scripts/device-check.sh)"
        )
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (
            f"CUDA is not available to torch {torch.__version__} (built for CUDA "
            f"{torch.version.cuda}; CUDA_VISIBLE_DEVICES={visible!r})"
        )
    return None


def model_missing() -> str | None:
    """Why the model check cannot run here, or ``None``."""
    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (the model check needs it; --checks wire does not)"
    return None


def host(mode: str, checks: tuple[str, ...]) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    dists = ["nixl", "nixl-cu12", "nixl-cu13"]
    if mode != "cpu" or "model" in checks:
        dists += ["torch", "transformers"]
    for dist in dists:
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            continue
    if mode == "gpu":
        import torch

        info |= {"cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name()}
    return info


def slim_wheels(folder: Path) -> None:
    """Drop ``nixl_ep_cu*/`` (NIXL's expert-parallel kernels, 27 MB compressed,
    never loaded here) from each ``nixl_cu*`` wheel in ``folder``, RECORD included."""
    for wheel in sorted(folder.glob("nixl_cu*.whl")):
        slim = wheel.with_suffix(".slim")
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w") as out:
            for info in src.infolist():
                if info.filename.startswith("nixl_ep_"):
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = data.splitlines(keepends=True)
                    data = b"".join(x for x in lines if not x.startswith(b"nixl_ep_"))
                out.writestr(info, data)
        slim.replace(wheel)
        bench.log(f"{wheel.name}: {wheel.stat().st_size / bench.MIB:.1f} MiB")


def _terminated(signum: int, frame: object) -> None:
    raise Terminated("SIGTERM: stopped before the end (the time limit?)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gpu", action="store_true", help="VRAM of GPU 0 (refused without one)")
    where.add_argument("--cpu", action="store_true", help="DRAM (default without CUDA)")
    where.add_argument("--torch-dram", action="store_true", help="the GPU path on CPU tensors")
    parser.add_argument(
        "--checks",
        default="model,staging",
        help="comma-separated, run in this order: model (a real model's KV end to end), "
        "wire (kvpush's throughput, bytes verified), staging (benchmarks/staging.py: raw, "
        "in place, staged, device copy); default model,staging",
    )
    parser.add_argument(
        "--staging-reps", type=int, default=3, help="staging: timed rounds per block size"
    )
    parser.add_argument(
        "--model-cases",
        metavar="NAMES",
        help="comma-separated case names, 'all' or 'ci' (default: all with --gpu and "
        "--torch-dram, ci with --cpu)",
    )
    parser.add_argument(
        "--total-mib", type=int, help="wire: bytes per transfer (GPU 1024, else 64)"
    )
    parser.add_argument(
        "--block-kib",
        type=int,
        action="append",
        help="wire: block bytes per region (repeatable; default 16, 256 and 2048)",
    )
    parser.add_argument("--reps", type=int, default=5, help="wire: timed rounds per block size")
    parser.add_argument(
        "--path",
        choices=tuple(PATHS),
        default="auto",
        help="wire: post by rows or by index (default: the transport's rule)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slim-wheels", metavar="DIR", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    given = args.checks.split(",")
    if not given or any(c not in CHECKS for c in given):
        parser.error(f"--checks takes a comma-separated subset of {','.join(CHECKS)}")
    args.checks = tuple(c for c in CHECKS if c in given)  # model first
    if args.gpu or args.cpu or args.torch_dram:
        args.mode = "gpu" if args.gpu else "cpu" if args.cpu else "torch-dram"
    else:
        args.mode = "gpu" if gpu_missing() is None else "cpu"
    blocks = [k * bench.KIB for k in args.block_kib or [b // bench.KIB for b in bench.BLOCK_SIZES]]
    total = (args.total_mib or (1024 if args.mode == "gpu" else 64)) * bench.MIB
    wire = blocks if "wire" in args.checks else []
    if args.reps < 1 or any(
        b <= 0 or total % (bench.REGIONS * b) or total < 2 * bench.REGIONS * b for b in wire
    ):
        parser.error(
            f"--reps must be at least 1, and --total-mib a multiple of {bench.REGIONS} x "
            "every --block-kib, at least 2 blocks per region"
        )
    args.blocks, args.total = blocks, total
    return args


def cannot_run(mode: str, checks: tuple[str, ...]) -> str | None:
    """What this host lacks for ``mode`` and ``checks``, or ``None``."""
    missing = gpu_missing() if mode == "gpu" else None
    if mode == "torch-dram" and importlib.util.find_spec("torch") is None:
        missing = "torch is not installed"
    if missing is None and "model" in checks:
        missing = model_missing()
    try:
        TRANSPORT.probe()
    except TransportError as exc:
        missing = missing or str(exc)
    return missing


def model_cases(mode: str, names: str | None) -> list[Any]:
    """The model check's cases: ``--model-cases``, else all (ci with ``--cpu``)."""
    import device_handoff

    return device_handoff.cases_for(names or ("ci" if mode == "cpu" else "all"))


def run_model(mode: str, cases: list[Any], section: dict[str, Any]) -> None:
    """The model check (module docs), its report filled into ``section``."""
    import device_handoff
    from device_model import CPU_SPEC, GPU_SPEC

    spec = CPU_SPEC if mode == "cpu" else GPU_SPEC
    device = "cuda" if mode == "gpu" else "cpu"
    device_handoff.run_model_check(device, spec, cases, bench.log, section)


def run_staging(mode: str, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """The staging check (module docs): benchmarks/staging.py's rows into ``out``."""
    from benchmarks import staging

    memory = {"gpu": "vram", "cpu": "dram", "torch-dram": "torch-dram"}[mode]
    blocks = staging.blocks_for(args.total)
    started = time.monotonic()
    out["entries"] = []
    try:
        costs = staging.model_for(memory, args.seed)
        out["cost_model"] = costs.__repr__()
        for block in blocks:
            bench.log(f"device-check: staging {memory}, block {block // bench.KIB} KiB ...")
            entry = staging.measure(memory, block, args.total, args.staging_reps, args.seed, costs)
            out["entries"].append(entry)
            bench.log(json.dumps(entry))
        out["goals"] = staging.goals(out["entries"])
    except (Exception, Terminated) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        done = len(out["entries"]) == len(blocks) > 0
        out["verified"] = done and all(
            all(e[d]["verified"].values()) for e in out["entries"] for d in ("push", "pull")
        )
        out |= {
            "memory": "VRAM" if memory == "vram" else "DRAM",
            "total_bytes": args.total,
            "reps": args.staging_reps,
            "staging_s": round(time.monotonic() - started, 1),
        }


def run_wire(mode: str, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """The wire check (module docs): per block size, its entry into ``out``."""
    started = time.monotonic()
    out["entries"] = []
    try:
        for block in args.blocks:
            bench.log(f"device-check: wire {mode}, block {block // bench.KIB} KiB ...")
            out["entries"].append(check(mode, block, args.total, args.reps, args.seed, args.path))
            bench.log(json.dumps(out["entries"][-1]))
    except (Exception, Terminated) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        entries = out["entries"]
        for side in ("push", "pull"):
            runs = [e[side] for e in entries if e[side]["rounds"] == args.reps]
            out[f"{side}_done"] = len(runs) == len(args.blocks)
            out[f"{side}_verified"] = out[f"{side}_done"] and all(r["verified"] for r in runs)
        out["verified"] = out["push_verified"] and out["pull_verified"]
        out |= {
            "memory": "VRAM" if mode == "gpu" else "DRAM",
            "total_bytes": args.total,
            "reps": args.reps,
            "unit": "GB/s = 1e9 bytes per second; medians over reps",
            "wire_s": round(time.monotonic() - started, 1),
        }


def main() -> None:
    args = parse_args()
    if args.slim_wheels is not None:
        slim_wheels(args.slim_wheels)
        return
    bench.set_env()  # before NIXL loads
    mode = args.mode
    missing = cannot_run(mode, args.checks)
    if missing is not None:
        print(f"device-check: --{mode} cannot run here: {missing}", file=sys.stderr)
        sys.exit(2)
    try:
        cases = model_cases(mode, args.model_cases) if "model" in args.checks else []
    except ValueError as exc:
        print(f"device-check: --model-cases: {exc}", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGTERM, _terminated)
    started = time.monotonic()
    out: dict[str, Any] = {"ok": False, "mode": mode, "checks": list(args.checks)}
    try:
        if "model" in args.checks:
            out["model"] = {}
            run_model(mode, cases, out["model"])
        if "wire" in args.checks:
            run_wire(mode, args, out)
        if "staging" in args.checks:
            out["staging"] = {}
            run_staging(mode, args, out["staging"])
    except Terminated as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    passed = [out["model"].get("ok") is True] if "model" in args.checks else []
    passed += [out.get("verified") is True] if "wire" in args.checks else []
    passed += [out["staging"].get("verified") is True] if "staging" in args.checks else []
    out["ok"] = all(passed) and len(passed) == len(args.checks)
    out |= {
        "host": host(mode, args.checks),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_", "CUDA_"))},
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(out), flush=True)
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
