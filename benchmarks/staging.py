"""Staged wire transfers against direct ones and raw NIXL, push and pull, DRAM or VRAM.

Two processes over NIXL/UCX: this one is the prefill (producer), a spawned one
the decode (consumer); commands and ``time.monotonic_ns()`` stamps (one clock
for both) travel over a ``multiprocessing`` Pipe. One JSON object on stdout.

**Geometry** (``benchmarks/nixl_throughput.py``'s, imported): 2 layers of split
K and V (4 regions), 8 KV heads of 256 bytes per token, a block of one region is
``block`` bytes; 50% fragmented block tables, the same break pattern on both
sides, runs placed independently. Block sizes 4 KiB to 2 MiB, ``--total-mib``
per transfer (64 on DRAM, 1024 on VRAM in the device check).

**Variants**, each ending when the decode can read the KV where it reads it:

* ``raw_per_block``: ``nixl_agent`` directly, one row per block per region;
* ``raw_best``: ``nixl_agent`` directly, the minimal descriptor set (one row
  per run contiguous on both sides), ``initialize_xfer``;
* ``kvpush_direct``: ``TransferPlanner`` + ``NixlTransport`` as the data plane
  posts a plan (merged rows, or by index where the transport prefers it);
* ``kvpush_staged``: the data plane's ``Stager``: the producer gathers the
  pieces into its staging pool (the copier), writes them as one span per
  contiguous run of the consumer's slot image, and the consumer scatters them
  into its blocks on the notice (push). Pull: the producer gathers into its
  pool, the consumer reads the spans into its slot and scatters them (the
  protocol serves pull in place today; this row measures what staging would
  give it, with the same geometry code);
* ``device_copy``: one copy of the same bytes on the device (the copier, one
  row): the ceiling.

Push ends when the decode has seen the notice (and scattered); pull when the
decode's read completed (and it scattered), timed from the prefill's command
(and gather). Every variant is checked once, untimed, byte for byte (a digest
of the destination blocks in token order against the source's), then
``--reps`` rounds rotate the order; medians are reported. The cost model's
choice (``kvpush.runtime.CostModel`` with the copier's measured coefficients
and the memory's transport coefficients) and the staging memory each side
used are reported per row.

    UCX_NET_DEVICES=lo .venv/bin/python benchmarks/staging.py [--quick]
    python benchmarks/staging.py --memory vram --total-mib 1024   # on a GPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

# The repository root, for ``benchmarks.*`` when run as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.nixl_throughput import (
    HEAD_BYTES,
    HEADS,
    LAYERS,
    REGIONS,
    block_rows,
    break_pattern,
    merge_runs,
    place,
    raw_agent,
    set_env,
    tokens_per_block,
)
from kvpush.protocol import (
    Codec,
    Completion,
    KVLayout,
    MemoryType,
    Role,
    Source,
    Staging,
    StartWrite,
    compute_topology,
    layer_regions,
)
from kvpush.runtime import CostModel, HostCopier, TransferPlanner, stage_bytes
from kvpush.runtime._stage import TRANSPORT_COSTS, calibrate, scatter_chunks, staged_pieces
from kvpush.runtime._stager import Stager
from kvpush_nixl import NixlTransport

KIB, MIB = 1024, 1024 * 1024
BLOCKS = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 2 * MIB)
VARIANTS = ("raw_per_block", "raw_best", "kvpush_direct", "kvpush_staged")
DEADLINE_S = 60.0
START_S = 120.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- memory: numpy on the host, torch on the GPU ------------------------------------------


class Memory:
    """One process's buffer: the KV pool, the staging pool and a scratch area."""

    def __init__(self, kind: str, nbytes: int, seed: int) -> None:
        self.kind = kind
        self.nbytes = nbytes
        if kind == "dram":
            self.buf: Any = np.zeros(nbytes, dtype=np.uint8)
            self.base = int(self.buf.ctypes.data)
            self.copier: Any = HostCopier()
            rng = np.random.default_rng(seed)
            self.buf.view(np.uint64)[:] = rng.integers(0, 1 << 63, nbytes // 8, np.uint64)
        else:  # "vram", or "torch-dram": the GPU's code on CPU tensors
            import torch

            from kvpush_vllm._copier import TorchCopier

            device = "cuda" if kind == "vram" else "cpu"
            gen = torch.Generator(device=device).manual_seed(seed)
            self.buf = torch.randint(
                0, 255, (nbytes,), dtype=torch.uint8, device=device, generator=gen
            )
            self.base = int(self.buf.data_ptr())
            self.copier = TorchCopier([self.buf])
            if kind == "vram":
                torch.cuda.synchronize()

    @property
    def memory(self) -> MemoryType:
        return MemoryType.VRAM if self.kind == "vram" else MemoryType.DRAM

    def digest(self, rows: np.ndarray, scratch: int) -> str:
        """A hash of ``rows``' bytes in order (gathered at ``scratch`` first)."""
        total = int(rows[:, 1].sum())
        dst = np.empty_like(rows)
        dst[:, 0] = scratch + np.concatenate(([0], np.cumsum(rows[:-1, 1]))).astype(np.uint64)
        dst[:, 1:] = rows[:, 1:]
        self.copier.copy(rows, dst)
        off = scratch - self.base
        if self.kind == "dram":
            data = self.buf[off : off + total].tobytes()
            return hashlib.blake2b(data, digest_size=16).hexdigest()
        if self.kind == "torch-dram":
            data = self.buf[off : off + total].numpy().tobytes()
            return hashlib.blake2b(data, digest_size=16).hexdigest()
        # On the device: a position-weighted sum of 8-byte words (a misplaced
        # word changes it), so 1 GiB never crosses to the host.
        import torch

        words = self.buf[off : off + total].view(torch.int64)
        weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
        return str(int((words * weights).sum()))

    def zero(self, lo: int, hi: int) -> None:
        if self.kind == "dram":
            self.buf[lo:hi] = 0
        else:
            self.buf[lo:hi].zero_()


def geometry(block: int, total: int) -> dict[str, int]:
    n = total // (REGIONS * block)
    pool = 2 * n
    kv = REGIONS * pool * block
    return {"n": n, "pool": pool, "kv": kv, "stage": total, "scratch": total}


def layout(mem: Memory, block: int, pool: int, kv: int, stage: int) -> KVLayout:
    return KVLayout(
        layer_regions(
            [mem.base + i * 2 * pool * block for i in range(LAYERS)],
            num_blocks=pool,
            tokens_per_block=tokens_per_block(block),
            num_heads=HEADS,
            head_bytes=HEAD_BYTES,
            memory=mem.memory,
        ),
        Staging(base=mem.base + kv, nbytes=stage, memory=mem.memory),
    )


def register_raw(agent: Any, mem: Memory) -> Any:
    return agent.register_memory([(mem.base, mem.nbytes, 0, "")], mem.memory.value)


# --- the decode process ------------------------------------------------------------------


class Decode:
    """The consumer side: answers commands, polls the agent being measured."""

    def __init__(self, conn: Connection, kind: str, block: int, total: int, seed: int) -> None:
        g = geometry(block, total)
        self.g, self.block, self.conn = g, block, conn
        self.mem = Memory(kind, g["kv"] + g["stage"] + g["scratch"], seed + 1)
        self.mine = layout(self.mem, block, g["pool"], g["kv"], g["stage"])
        self.transport = NixlTransport("stage-decode", vram=kind == "vram")
        self.transport.register(self.mine)
        self.raw = raw_agent(f"stage-raw-decode-{block}")
        self.raw_reg = register_raw(self.raw, self.mem)
        self.codec = Codec()
        self.stager = Stager(self.mem.copier, {0: self.mine})
        self.polls = "kvpush"

    def serve(self) -> None:
        conn = self.conn
        conn.send(("ready", self.transport.metadata(), bytes(self.raw.get_agent_metadata()),
                   self.mem.base))  # fmt: skip
        while True:
            self._poll()
            if conn.poll() and not self._command(conn.recv()):
                return

    def _poll(self) -> None:
        if self.polls == "kvpush":
            _, notices = self.transport.poll()
            for n in notices:
                self._notice(n.payload)
        else:
            for msgs in (self.raw.get_new_notifs() or {}).values():
                for m in msgs:
                    self.conn.send(("seen", bytes(m), time.monotonic_ns()))

    def _command(self, msg: tuple[Any, ...]) -> bool:
        """Run one command from the driver; False once told to stop."""
        conn = self.conn
        cmd = msg[0]
        if cmd == "peer":
            _, kv_md, raw_md, theirs, src_ids, dst_ids = msg
            self.peer = self.transport.add_peer(kv_md, theirs)
            remote = self.raw.add_remote_agent(raw_md)
            self.remote = remote.decode() if isinstance(remote, bytes) else str(remote)
            self.theirs, self.src_ids, self.dst_ids = theirs, src_ids, dst_ids
            self.route = compute_topology(1, 1, 1, HEADS).routes[0]
            self.planner = TransferPlanner(theirs, self.mine, self.route)
            conn.send(("ok",))
        elif cmd == "polls":
            self.polls = msg[1]
            conn.send(("ok",))
        elif cmd == "stage":  # the reservation's record, as the runtime keeps it
            self.stager.unstage((msg[2], 1))
            self.stager.stage((msg[1], 1), [list(self.dst_ids)], (0, self.g["stage"]))
            conn.send(("ok",))
        elif cmd == "pull":
            conn.send(("done", self._pull(msg[1], msg[2])))
        elif cmd == "zero":
            self.mem.zero(0, self.g["kv"])
            conn.send(("ok",))
        elif cmd == "digest":
            rows = block_rows(self.mine, tuple(self.dst_ids), self.block)
            conn.send(
                (
                    "digest",
                    self.mem.digest(rows, self.mem.base + self.g["kv"] + self.g["stage"]),
                )
            )
        elif cmd == "stop":
            conn.send(("stopped",))
            return False
        return True

    def _notice(self, payload: bytes) -> None:
        if payload.startswith(b"KVN"):
            notice = self.codec.decode_notice(payload)
            if notice.staged:
                error = self.stager.scatter(notice, 0, self.planner)
                assert error is None, error
            tag = notice.transfer_id.encode()
        else:
            tag = payload
        self.conn.send(("seen", tag, time.monotonic_ns()))

    def _pull(self, variant: str, tag: int) -> int:
        """One READ of ``variant``; returns when the bytes are in the blocks."""
        if variant in {"raw_per_block", "raw_best"}:
            src = block_rows(self.theirs, tuple(self.src_ids), self.block)
            dst = block_rows(self.mine, tuple(self.dst_ids), self.block)
            if variant == "raw_best":
                src, dst = merge_runs(src, dst)
            kind = self.mem.memory.value
            local = self.raw.get_xfer_descs(dst, kind)
            remote = self.raw.get_xfer_descs(src, kind)
            handle = self.raw.initialize_xfer("READ", local, remote, self.remote)
            state = self.raw.transfer(handle)
            end = time.monotonic() + DEADLINE_S
            while state != "DONE":
                assert state != "ERR" and time.monotonic() < end, "raw READ failed"
                state = self.raw.check_xfer_state(handle)
            self.raw.release_xfer_handle(handle)
            return time.monotonic_ns()
        plan = self.planner.plan((self.src_ids,), (self.dst_ids,))
        if variant == "kvpush_direct":
            self._read(plan.dst, plan.src)
            return time.monotonic_ns()
        # Staged pull: the producer gathered into its pool; read the spans into
        # our slot, then scatter.
        counts = [len(self.dst_ids)]
        tokens = (len(self.dst_ids) * tokens_per_block(self.block),)
        chunks = scatter_chunks(self.planner, [list(self.dst_ids)], tokens)
        assert not isinstance(chunks, str), chunks
        pieces = staged_pieces(self.planner, Role.CONSUMER, counts, chunks)
        at, compact, lengths = pieces.spans()
        stage = self.mine.staging
        theirs = self.theirs.staging
        assert stage is not None and theirs is not None
        local = np.stack([stage.base + at, lengths, np.zeros_like(at)], 1).astype(np.uint64)
        remote = np.stack([theirs.base + compact, lengths, np.zeros_like(at)], 1).astype(np.uint64)
        self._read(local, remote)
        src = np.empty_like(pieces.kv)
        src[:, 0] = stage.base + pieces.image.astype(np.uint64)
        src[:, 1:] = pieces.kv[:, 1:]
        self.mem.copier.copy(src, pieces.kv)
        return time.monotonic_ns()

    def _read(self, local: np.ndarray, remote: np.ndarray) -> None:
        handle = self.transport.read(self.peer, local, remote)
        end = time.monotonic() + DEADLINE_S
        while True:
            done, _ = self.transport.poll()
            if any(c.handle == handle for c in done):
                assert all(c.error is None for c in done), done
                return
            assert time.monotonic() < end, "kvpush READ not done in time"

    def close(self) -> None:
        self.raw.deregister_memory(self.raw_reg)
        self.transport.close()


def decode_main(conn: Connection, kind: str, block: int, total: int, seed: int) -> None:
    set_env()
    d = Decode(conn, kind, block, total, seed)
    try:
        d.serve()
    except (EOFError, BrokenPipeError):
        pass
    finally:
        d.close()


# --- the prefill process (this one) --------------------------------------------------------


class Prefill:
    def __init__(self, kind: str, block: int, total: int, seed: int, costs: CostModel) -> None:
        g = geometry(block, total)
        self.g, self.block, self.kind, self.total = g, block, kind, total
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=decode_main, args=(child, kind, block, total, seed),
                                daemon=True)  # fmt: skip
        self.proc.start()
        child.close()
        self.mem = Memory(kind, g["kv"] + g["stage"] + g["scratch"], seed)
        self.mine = layout(self.mem, block, g["pool"], g["kv"], g["stage"])
        self.transport = NixlTransport("stage-prefill", vram=kind == "vram")
        self.transport.register(self.mine)
        self.raw = raw_agent(f"stage-raw-prefill-{block}")
        self.raw_reg = register_raw(self.raw, self.mem)
        _, kv_md, raw_md, base = self.expect("ready", START_S)
        d_mem = type("M", (), {"base": base, "memory": self.mem.memory})()
        self.theirs = layout(d_mem, block, g["pool"], g["kv"], g["stage"])
        self.peer = self.transport.add_peer(kv_md, self.theirs)
        remote = self.raw.add_remote_agent(raw_md)
        self.remote = remote.decode() if isinstance(remote, bytes) else str(remote)
        rng = np.random.default_rng([seed, block])
        lengths = break_pattern(rng, g["n"])
        self.src_ids = place(rng, lengths, g["pool"])
        self.dst_ids = place(rng, lengths, g["pool"])
        self.route = compute_topology(1, 1, 1, HEADS).routes[0]
        self.planner = TransferPlanner(self.mine, self.theirs, self.route)
        self.conn.send(("peer", self.transport.metadata(), bytes(self.raw.get_agent_metadata()),
                        self.mine, self.src_ids, self.dst_ids))  # fmt: skip
        self.expect("ok", DEADLINE_S)
        self.block_src = block_rows(self.mine, self.src_ids, block)
        self.block_dst = block_rows(self.theirs, self.dst_ids, block)
        self.best_src, self.best_dst = merge_runs(self.block_src, self.block_dst)
        # No cost model: the staged row stages (the model's choice is reported apart).
        self.stager = Stager(self.mem.copier, {0: self.mine})
        self.codec = Codec()
        self.count = 0
        self.polls = ""
        self.mem_kind = self.mem.memory.value

    def expect(self, kind: str, timeout: float) -> tuple[Any, ...]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no {kind!r} from the decode in {timeout:.0f} s")
        msg = self.conn.recv()
        if msg[0] != kind:
            raise RuntimeError(f"expected {kind!r}, got {msg[0]!r}")
        return msg  # type: ignore[no-any-return]

    def decode_polls(self, which: str) -> None:
        if which != self.polls:
            self.conn.send(("polls", which))
            self.expect("ok", DEADLINE_S)
            self.polls = which

    # --- push -----------------------------------------------------------------------

    def push(self, variant: str) -> float:
        self.count += 1
        tag = f"t{self.count}"
        self.decode_polls("raw" if variant.startswith("raw") else "kvpush")
        if variant == "kvpush_staged":
            self.conn.send(("stage", tag, f"t{self.count - 1}"))
            self.expect("ok", DEADLINE_S)
        t0 = time.monotonic_ns()
        if variant.startswith("raw"):
            src, dst = (self.block_src, self.block_dst) if variant == "raw_per_block" else (
                self.best_src, self.best_dst)  # fmt: skip
            local = self.raw.get_xfer_descs(src, self.mem_kind)
            remote = self.raw.get_xfer_descs(dst, self.mem_kind)
            handle = self.raw.initialize_xfer("WRITE", local, remote, self.remote, tag.encode())
            state = self.raw.transfer(handle)
            while state != "DONE":
                assert state != "ERR", "raw WRITE failed"
                state = self.raw.check_xfer_state(handle)
            self.raw.release_xfer_handle(handle)
        else:
            self._kvpush(variant, tag)
        seen = self._seen(tag.encode())
        return (seen - t0) / 1e9

    def _kvpush(self, variant: str, tag: str) -> None:
        plan = self.planner.plan((self.src_ids,), (self.dst_ids,))
        notice = Completion(tag, 1, Source(0), 0)
        slot = None
        if variant == "kvpush_staged":
            action = StartWrite(
                tag,
                1,
                "decode",
                self.route,
                (self.src_ids,),
                (self.dst_ids,),
                time.monotonic() + DEADLINE_S,
                notice,
                stage=(0, self.g["stage"]),
            )
            staged, note = self.stager.write(action, 0, self.planner, plan, self.theirs)
            assert staged is not None and note is not None
            slot = staged.slot
            handle = self.transport.write(self.peer, staged.src, staged.dst,
                                          self.codec.encode_notice(note))  # fmt: skip
        elif self.transport.prefers_prepped(plan.num_descriptors, plan.num_pieces):
            src, dst = plan.indices()
            if not getattr(self, "prepped", False):
                self.transport.prep(self.peer, self.route, self.planner.prepped(Role.PRODUCER),
                                    self.planner.prepped(Role.CONSUMER))  # fmt: skip
                self.prepped = True
            handle = self.transport.write_prepped(self.peer, self.route, src, dst,
                                                  self.codec.encode_notice(notice))  # fmt: skip
        else:
            handle = self.transport.write(self.peer, plan.src, plan.dst,
                                          self.codec.encode_notice(notice))  # fmt: skip
        end = time.monotonic() + DEADLINE_S
        while True:
            done, _ = self.transport.poll()
            if any(c.handle == handle for c in done):
                assert all(c.error is None for c in done), done
                break
            assert time.monotonic() < end, "kvpush WRITE not done in time"
        if slot is not None:
            self.stager.settled(slot)

    def _seen(self, tag: bytes) -> int:
        while True:
            until = time.monotonic() + DEADLINE_S
            while not self.conn.poll() and time.monotonic() < until:
                self.transport.poll()
            msg = self.expect("seen", DEADLINE_S)
            if msg[1] == tag:
                return int(msg[2])

    # --- pull -----------------------------------------------------------------------

    def pull(self, variant: str) -> float:
        self.decode_polls("kvpush")
        t0 = time.monotonic_ns()
        if variant == "kvpush_staged":
            counts = [len(self.dst_ids)]
            chunks, _ = _write_chunks(self.planner, self.src_ids, self.dst_ids)
            pieces = staged_pieces(self.planner, Role.PRODUCER, counts, chunks)
            stage = self.mine.staging
            assert stage is not None
            local = np.empty_like(pieces.kv)
            local[:, 0] = stage.base + np.concatenate(([0], np.cumsum(pieces.kv[:-1, 1]))).astype(
                np.uint64
            )
            local[:, 1:] = pieces.kv[:, 1:]
            self.mem.copier.copy(pieces.kv, local)
        self.conn.send(("pull", variant, self.count))
        # A NIXL target must keep progressing for a READ of its memory to finish.
        until = time.monotonic() + DEADLINE_S
        while not self.conn.poll() and time.monotonic() < until:
            self.transport.poll()
            self.raw.get_new_notifs()
        end = int(self.expect("done", DEADLINE_S)[1])
        return (end - t0) / 1e9

    # --- checks and figures -------------------------------------------------------------

    def verify(self, direction: str, variant: str) -> bool:
        self.conn.send(("zero",))
        self.expect("ok", DEADLINE_S)
        (self.push if direction == "push" else self.pull)(variant)
        self.conn.send(("digest",))
        got = self.expect("digest", DEADLINE_S)[1]
        scratch = self.mem.base + self.g["kv"] + self.g["stage"]
        return bool(got == self.mem.digest(self.block_src, scratch))

    def device_copy(self) -> float:
        src = np.array([[self.mem.base, self.total, 0]], dtype=np.uint64)
        dst = np.array([[self.mem.base + self.g["kv"] + self.g["stage"], self.total, 0]],
                       dtype=np.uint64)  # fmt: skip
        self.mem.copier.copy(src, dst)
        t0 = time.perf_counter()
        self.mem.copier.copy(src, dst)
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
            self.expect("stopped", DEADLINE_S)
        except (OSError, EOFError, TimeoutError, RuntimeError) as exc:
            log(f"stopping the decode: {exc}")
        self.proc.join(DEADLINE_S)
        if self.proc.is_alive():
            self.proc.kill()
        self.raw.deregister_memory(self.raw_reg)
        self.transport.close()


def _write_chunks(planner: TransferPlanner, src: tuple[int, ...], dst: tuple[int, ...]) -> Any:
    from kvpush.runtime._stage import write_chunks

    return write_chunks(planner, (src,), (dst,), 0, (), False)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def measure(
    kind: str, block: int, total: int, reps: int, seed: int, costs: CostModel
) -> dict[str, Any]:
    p = Prefill(kind, block, total, seed, costs)
    try:
        plan = p.planner.plan((p.src_ids,), (p.dst_ids,))
        chunks, _ = _write_chunks(p.planner, p.src_ids, p.dst_ids)
        spans = staged_pieces(p.planner, Role.PRODUCER, [len(p.dst_ids)], chunks).spans()[0].size
        choice = (
            "staged"
            if costs.prefers_staged(plan.num_descriptors, spans, 2 * plan.num_pieces, plan.nbytes)
            else "direct"
        )
        out: dict[str, Any] = {
            "block_bytes": block,
            "descriptors": {
                "per_block": int(p.block_src.shape[0]),
                "minimal": int(p.best_src.shape[0]),
                "kvpush_rows": plan.num_descriptors,
                "staged_spans": spans,
            },
            "cost_model": {
                "choice": choice,
                "direct_ms": round(costs.direct(plan.num_descriptors, plan.nbytes) * 1e3, 3),
                "staged_ms": round(costs.staged(spans, 2 * plan.num_pieces, plan.nbytes) * 1e3, 3),
            },
            "staging_bytes": {
                "producer": plan.nbytes,
                "consumer": stage_bytes(p.theirs, [p.dst_ids]),
            },
        }
        copies = []
        for direction in ("push", "pull"):
            verified = {v: p.verify(direction, v) for v in VARIANTS}
            samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for rnd in range(reps):
                k = rnd % len(VARIANTS)
                for v in VARIANTS[k:] + VARIANTS[:k]:
                    samples[v].append(p.push(v) if direction == "push" else p.pull(v))
                copies.append(p.device_copy())
            med = {v: statistics.median(samples[v]) for v in VARIANTS}
            rates = {v: gbps(total, med[v]) for v in VARIANTS}
            best = max(rates["kvpush_direct"], rates["kvpush_staged"])
            picked = rates["kvpush_staged" if choice == "staged" else "kvpush_direct"]
            out[direction] = {
                "gbps": rates,
                "gbps_min_max": {
                    v: [gbps(total, max(samples[v])), gbps(total, min(samples[v]))]
                    for v in VARIANTS
                },
                "kvpush_chosen_gbps": picked,
                "kvpush_best_over_raw_best": round(best / rates["raw_best"], 3),
                "kvpush_chosen_over_raw_best": round(picked / rates["raw_best"], 3),
                "kvpush_chosen_over_per_block": round(picked / rates["raw_per_block"], 3),
                "staged_over_direct": round(rates["kvpush_staged"] / rates["kvpush_direct"], 3),
                "verified": verified,
            }
        out["device_copy_gbps"] = gbps(total, statistics.median(copies))
        faster = "staged" if out["push"]["staged_over_direct"] > 1 else "direct"
        out["cost_model"]["measured_faster"] = faster
        return out
    finally:
        p.close()


def blocks_for(total: int) -> list[int]:
    """The block sizes of ``BLOCKS`` with at least two blocks per region in ``total``."""
    return [b for b in BLOCKS if total // (REGIONS * b) >= 2]


def model_for(memory: str, seed: int) -> CostModel:
    """The cost model the data plane would use: the copier measured here (4 KiB
    rows over 8 MiB, then one row), the transport from ``TRANSPORT_COSTS``."""
    probe = Memory(memory, 2 * (8 * MIB), seed)
    n = (8 * MIB) // (4 * KIB)
    offs = np.random.default_rng(0).permutation(n) * (4 * KIB)
    src = np.stack([probe.base + offs, np.full(n, 4 * KIB), np.zeros(n)], 1).astype(np.uint64)
    dst = np.stack(
        [probe.base + 8 * MIB + np.arange(n) * 4 * KIB, np.full(n, 4 * KIB), np.zeros(n)], 1
    ).astype(np.uint64)
    copy_row, copy_byte = calibrate(probe.copier, src, dst)
    post, row, wire = TRANSPORT_COSTS["VRAM" if memory == "vram" else "DRAM"]
    return CostModel(post, row, wire, copy_row, copy_byte)


def goals(entries: list[dict[str, Any]]) -> dict[str, bool]:
    """Issue 27's goals, over the rows measured."""
    return {
        "dram_kvpush_chosen_ge_0.95_raw_best": all(
            e["push"]["kvpush_chosen_over_raw_best"] >= 0.95 for e in entries
        ),
        "kvpush_chosen_ge_raw_per_block": all(
            e[d]["kvpush_chosen_over_per_block"] >= 1.0 for e in entries for d in ("push", "pull")
        ),
        "vram_push_ge_300_gbps_at_4k_16k": all(
            e["push"]["kvpush_chosen_gbps"] >= 300 for e in entries if e["block_bytes"] <= 16 * KIB
        ),
        "kvpush_ge_0.9_best_of_direct_and_staged": all(
            e[d]["kvpush_chosen_gbps"]
            >= 0.9 * max(e[d]["gbps"]["kvpush_direct"], e[d]["gbps"]["kvpush_staged"])
            for e in entries
            for d in ("push",)
        ),
        "pull_ge_0.8_push": all(
            e["pull"]["kvpush_chosen_gbps"] >= 0.8 * e["push"]["kvpush_chosen_gbps"]
            for e in entries
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--memory", choices=("dram", "vram", "torch-dram"), default="dram")
    parser.add_argument("--total-mib", type=int, default=None, help="64 (DRAM), 1024 (VRAM)")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds (default 5)")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 3 rounds (CI)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    total = (args.total_mib or (16 if args.quick else 64 if args.memory == "dram" else 1024)) * MIB
    reps = args.reps or (3 if args.quick else 5)
    set_env()
    started = time.monotonic()
    costs = model_for(args.memory, args.seed)
    entries = []
    for block in blocks_for(total):
        log(f"{args.memory} block {block // KIB} KiB ...")
        entry = measure(args.memory, block, total, reps, args.seed, costs)
        log(json.dumps(entry))
        entries.append(entry)
    verified = all(all(e[d]["verified"].values()) for e in entries for d in ("push", "pull"))
    out = {
        "memory": args.memory,
        "total_bytes": total,
        "reps": reps,
        "entries": entries,
        "cost_model": {
            "post_s": costs.post,
            "row_s": costs.row,
            "wire_byte_s": costs.wire_byte,
            "copy_row_s": costs.copy_row,
            "copy_byte_s": costs.copy_byte,
        },
        "goals": goals(entries),
        "verified": verified,
        "unit": "GB/s = 1e9 bytes per second; medians over reps",
        "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))},
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(out))
    if not verified:
        sys.exit("a transfer did not deliver the right bytes (see entries[].push/pull.verified)")


if __name__ == "__main__":
    main()
