"""A fence at the target: can a decode, in its own process, stop a late WRITE
from one prefill from landing in blocks it is about to reuse?

    .venv/bin/python benchmarks/fence.py                 # UCX_TLS=tcp, UCX_NET_DEVICES=lo
    .venv/bin/python benchmarks/fence.py --runs 5 --reg-mib 64 1024

Three processes, each a raw NIXL agent (UCX backend, no progress thread, no
listener) over one numpy buffer: the *target* (decode), the *producer* whose
write goes late and a *bystander* (a second producer). Both producers load the
target's metadata and the target loads both of theirs, as kvpush does. Per
candidate and run, fresh processes:

1. a 64 KiB warm-up WRITE from each producer (connections are up);
2. the producer posts a ``--write-mib`` WRITE (pattern 0xAB, ``--block-kib``
   blocks) with a notification and polls ``check_xfer_state`` every 1 ms (as
   kvpush's pump does); the target does *not* progress for 0.5 s, so over TCP
   the write stalls in the producer's UCX queue;
3. the producer is SIGSTOPped; the target progresses (``get_new_notifs``) for
   0.3 s, draining what reached its sockets, and counts the blocks landed;
4. the target applies the fence (timed) and reuses the blocks (fills 0x55);
5. SIGCONT; the target progresses for ``--settle`` s; blocks not 0x55 are
   ``late_write_landed_blocks``. ``initiator_saw`` is the producer's last
   ``check_xfer_state`` (or exception); ``bystander_ok`` whether a WRITE from
   the bystander posted after the fence still landed with its notification.

Candidates: ``baseline`` (no fence: must land, else the rest means nothing),
``remove_remote_agent`` (the target drops the producer's agent:
invalidateRemoteMD, which closes the target's UCX endpoints to it),
``dereg_rereg`` (deregister and re-register the target's whole buffer),
``agent_restart`` (drop the target's NIXL agent, start a new one, register
again: the old UCX worker and all its sockets go; every peer needs new
metadata, so the bystander's write fails), ``peer_agent_restart`` (the same,
with a second target agent over the same buffer serving the bystander alone:
one agent per producer) and ``mem_view`` (``prep_mem_view`` /
``release_mem_view``, UCX's GPU device API: availability only).
``reg_cost_us`` times dereg+rereg alone on ``--reg-mib`` buffers. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

CTX = mp.get_context("spawn")
OLD, LATE, REUSED, BYSTANDER = 0x00, 0xAB, 0x55, 0x3C
WARM = 64 << 10


def _agent(name: str) -> Any:
    import nixl._api as api

    config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False)
    return api.nixl_agent(name, config)


def _register(agent: Any, buf: np.ndarray) -> Any:
    return agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")


def _descs(agent: Any, base: int, length: int) -> Any:
    return agent.get_xfer_descs([(base, length, 0)], "DRAM")


def producer(name: str, size: int, fill: int, conn: Connection) -> None:
    """Answer ("write", target base, length, notif) with the final state."""
    agent = _agent(name)
    buf = np.full(size, fill, dtype=np.uint8)
    _register(agent, buf)
    conn.send(bytes(agent.get_agent_metadata()))
    target = agent.add_remote_agent(conn.recv())
    target = target.decode() if isinstance(target, bytes) else str(target)
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        _, base, length, notif = msg
        try:
            src, dst = _descs(agent, buf.ctypes.data, length), _descs(agent, base, length)
            handle = agent.initialize_xfer("WRITE", src, dst, target, notif)
            conn.send(("posted", agent.transfer(handle)))
        except Exception as exc:  # the post itself refused
            conn.send(("posted", "ERR"))
            conn.send(("state", f"post: {type(exc).__name__}: {exc}"))
            continue
        deadline, state = time.monotonic() + 20.0, "PROC"
        while state == "PROC" and time.monotonic() < deadline:
            try:
                state = agent.check_xfer_state(handle)
            except Exception as exc:  # NIXL raises nixl*Error on a failed peer
                state = f"{type(exc).__name__}: {exc}"
            time.sleep(0.001)
        conn.send(("state", state))


class Target:
    """The decode: one agent, or with ``per_peer`` a second one (same buffer
    registered in both) that serves the bystander alone."""

    def __init__(self, size: int, name: str = "decode", per_peer: bool = False) -> None:
        self.buf = np.full(size, OLD, dtype=np.uint8)
        self.agent = _agent(name)
        self.reg = _register(self.agent, self.buf)
        self.second = _agent(f"{name}-b") if per_peer else None
        if self.second is not None:
            _register(self.second, self.buf)
        self.notifs: dict[str, list[bytes]] = {}
        self.old_gone: bool | None = None  # after a restart: the old agent was destroyed

    @property
    def other(self) -> Any:
        """The agent the bystander talks to (holding no other reference: a
        restarted agent must really go)."""
        return self.agent if self.second is None else self.second

    def progress(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            agents = [self.agent] if self.second is None else [self.agent, self.second]
            for k, v in (kv for a in agents for kv in a.get_new_notifs().items()):
                self.notifs.setdefault(str(k), []).extend(bytes(m) for m in v)
            if time.monotonic() >= end:
                return
            time.sleep(0.001)

    def wait_notif(self, peer: str, notif: bytes, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.progress(0.0)
            if notif in self.notifs.get(peer, []):
                return True
            time.sleep(0.001)
        return False

    def blocks(self, start: int, length: int, block: int, value: int) -> int:
        """How many blocks of [start, start + length) are all ``value``."""
        rows = self.buf[start : start + length].reshape(-1, block)
        return int(np.all(rows == value, axis=1).sum())


def fence(target: Target, how: str, peer: str) -> tuple[bool, float]:
    """Apply a fence against ``peer``: (available, seconds it took)."""
    agent = target.agent
    t0 = time.perf_counter()
    if how == "baseline":
        pass
    elif how == "remove_remote_agent":
        agent.remove_remote_agent(peer)
    elif how == "dereg_rereg":
        agent.deregister_memory(target.reg)
        target.reg = _register(agent, target.buf)
    elif how in ("agent_restart", "peer_agent_restart"):  # its peers need new metadata
        name, core = agent.name, weakref.ref(agent.agent)
        agent.deregister_memory(target.reg)
        target.agent = agent = None
        target.agent = _agent(f"{name}-new")
        target.reg = _register(target.agent, target.buf)
        target.old_gone = core() is None  # else its sockets still deliver
    elif how == "mem_view":
        if not hasattr(agent, "prep_mem_view"):
            return False, 0.0
        try:
            agent.release_mem_view(agent.prep_mem_view(_descs(agent, target.buf.ctypes.data, 4096)))
        except Exception:
            return False, time.perf_counter() - t0
    return True, time.perf_counter() - t0


def one_run(how: str, args: argparse.Namespace) -> dict[str, Any]:
    write, block = args.write_mib << 20, args.block_kib << 10
    size = WARM + write + WARM  # [warm-up | the late write | the bystander]
    tag = f"{how}-{os.getpid()}-{time.monotonic_ns()}"
    target = Target(size, f"decode-{tag}", per_peer=how == "peer_agent_restart")
    procs: dict[str, tuple[Any, Connection]] = {}
    names = {"late": f"prefill-{tag}", "bystander": f"prefill-b-{tag}"}
    for role, name in names.items():
        mine, theirs = CTX.Pipe()
        fill = LATE if role == "late" else BYSTANDER
        proc = CTX.Process(target=producer, args=(name, size, fill, theirs), daemon=True)
        proc.start()
        procs[role] = (proc, mine)
        mine_agent = target.agent if role == "late" else target.other
        mine_agent.add_remote_agent(mine.recv())
        mine.send(bytes(mine_agent.get_agent_metadata()))
        del mine_agent  # no stray reference: a restart must destroy the agent
    base = target.buf.ctypes.data
    out: dict[str, Any] = {}
    try:
        for role, (_, conn) in procs.items():  # warm-up: connections up
            conn.send(("write", base, WARM, b"warm-" + role.encode()))
            conn.recv()
            assert target.wait_notif(names[role], b"warm-" + role.encode(), 10), role
            assert conn.recv() == ("state", "DONE")
        target.buf[:] = OLD
        late, conn = procs["late"]
        conn.send(("write", base + WARM, write, b"late"))
        conn.recv()
        time.sleep(0.5)  # the target does not progress: the write stalls
        os.kill(late.pid, signal.SIGSTOP)
        try:
            target.progress(0.3)
            out["landed_before_fence"] = target.blocks(WARM, write, block, LATE)
            out["available"], took = fence(target, how, names["late"])
            out["cost_us"] = took * 1e6
            out["old_agent_gone"] = target.old_gone
            target.buf[WARM : WARM + write] = REUSED  # another request's KV
        finally:
            os.kill(late.pid, signal.SIGCONT)
        target.progress(args.settle)
        total = write // block
        out["late_write_landed_blocks"] = total - target.blocks(WARM, write, block, REUSED)
        out["blocks"] = total
        out["late_notif_arrived"] = b"late" in target.notifs.get(names["late"], [])
        out["initiator_saw"] = conn.recv()[1] if conn.poll(args.settle + 20) else "no reply"
        _, bconn = procs["bystander"]
        bconn.send(("write", base + WARM + write, WARM, b"after"))
        bconn.recv()
        got = target.wait_notif(names["bystander"], b"after", 5)
        whole = target.blocks(WARM + write, WARM, WARM, BYSTANDER) == 1
        state = bconn.recv()[1] if bconn.poll(25) else "no reply"
        out["bystander_ok"] = got and whole and state == "DONE"
        out["bystander_saw"] = state
    finally:
        for proc, conn in procs.values():
            with contextlib.suppress(OSError):
                conn.send(("stop",))
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return out


def reg_cost(mib: int, runs: int) -> float:
    agent = _agent("reg-cost")
    buf = np.ones(mib << 20, dtype=np.uint8)
    reg = _register(agent, buf)
    took = []
    for _ in range(runs):
        t0 = time.perf_counter()
        agent.deregister_memory(reg)
        reg = _register(agent, buf)
        took.append(time.perf_counter() - t0)
    agent.deregister_memory(reg)
    return round(statistics.median(took) * 1e6, 1)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    costs = [r["cost_us"] for r in rows]
    return {
        "available": all(r["available"] for r in rows),
        "cost_us_median": round(statistics.median(costs), 1),
        "late_write_landed_blocks": [r["late_write_landed_blocks"] for r in rows],
        "of_blocks": rows[0]["blocks"],
        "landed_before_fence": [r["landed_before_fence"] for r in rows],
        "late_notif_arrived": [r["late_notif_arrived"] for r in rows],
        "initiator_saw": sorted({str(r["initiator_saw"]) for r in rows}),
        "bystander_ok": [r["bystander_ok"] for r in rows],
        "bystander_saw": sorted({str(r["bystander_saw"]) for r in rows}),
        "old_agent_gone": [r["old_agent_gone"] for r in rows],
    }


CANDIDATES = (
    "baseline",
    "remove_remote_agent",
    "dereg_rereg",
    "agent_restart",
    "peer_agent_restart",
    "mem_view",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tls", default="tcp", help="UCX_TLS (default tcp)")
    parser.add_argument("--runs", type=int, default=3, help="runs per candidate")
    parser.add_argument("--write-mib", type=int, default=12, help="size of the late write")
    parser.add_argument("--block-kib", type=int, default=256, help="block size for counting")
    parser.add_argument("--settle", type=float, default=1.5, help="progress after SIGCONT (s)")
    parser.add_argument("--reg-mib", type=int, nargs="*", default=[64], help="dereg+rereg sizes")
    parser.add_argument("--only", nargs="*", default=list(CANDIDATES), choices=CANDIDATES)
    args = parser.parse_args(argv)
    os.environ["UCX_TLS"] = args.tls
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    result: dict[str, Any] = {"ucx_tls": args.tls, "write_bytes": args.write_mib << 20}
    for how in args.only:
        if how == "mem_view":  # no write needed: is it there at all?
            available, took = fence(Target(1 << 20), how, "")
            result[how] = {"available": available, "cost_us_median": round(took * 1e6, 1)}
            continue
        result[how] = summarize([one_run(how, args) for _ in range(args.runs)])
    result["reg_cost_us"] = {f"{m}MiB": reg_cost(m, args.runs * 3) for m in args.reg_mib}
    print(json.dumps(result))
    base = result.get("baseline")
    return 0 if base is None or min(base["late_write_landed_blocks"]) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
