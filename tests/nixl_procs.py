"""Driving two-process kvpush runs over real NIXL from a test: a
:class:`Proc` per side (``nixl_side.side_main`` in a spawned process, commands
over a pipe, every reply bounded), :func:`sides` for a connected prefill and
decode pair, and :func:`transfer` for one verified request."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from nixl_side import SideSpec, side_main

from kvpush.protocol import Role

CTX = mp.get_context("spawn")
REPLY_S = 30.0


class Proc:
    """A side process and its command pipe."""

    def __init__(self, spec: SideSpec) -> None:
        self.spec = spec
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=side_main, args=(spec, child), daemon=True)
        self.proc.start()
        child.close()
        up = self.reply()
        assert up[0] == "up", up
        self.port: int = up[1]

    def reply(self, timeout: float = REPLY_S) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.spec.name}: no reply in {timeout} s")
        return self.conn.recv()

    def __call__(self, *msg: Any, timeout: float = REPLY_S) -> Any:
        self.conn.send(msg)
        return self.reply(timeout)

    def wait(
        self, kinds: tuple[str, ...], tid: str, timeout: float, nth: int = 1
    ) -> tuple[dict[str, Any], float]:
        out = self("wait", kinds, tid, timeout, nth, timeout=timeout + REPLY_S)
        assert out[0] == "event", f"{self.spec.name}: no {kinds} for {tid}: {out[1]}"
        return out[1], out[2]

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
                self.reply(10)
            except (OSError, EOFError, TimeoutError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


@contextmanager
def sides(prefill: SideSpec, decode: SideSpec) -> Iterator[tuple[Proc, Proc]]:
    procs: list[Proc] = []
    try:
        procs.append(Proc(prefill))
        procs.append(Proc(decode))
        p, d = procs
        assert d("route", "127.0.0.1", p.port) == ("ok",)
        yield p, d
    finally:
        for proc in procs:
            proc.stop()


def spec(role: Role, tp: int, tokens: int, **kw: Any) -> SideSpec:
    name, peer = ("prefill", "decode") if role is Role.PRODUCER else ("decode", "prefill")
    return SideSpec(role, name, peer, tp, tokens, blocks=64, **kw)


def transfer(
    p: Proc, d: Proc, tid: str, src: list[int], dst: list[int], mode: str, skip: int = 0
) -> dict[str, Any]:
    """Fill, reserve first (decode registers while prefill computes), then KV
    ready; wait for Ready and check every destination byte."""
    salt = len(tid)
    assert p("fill", src, salt) == ("ok",)
    assert d("reserve", tid, dst, mode, skip)[0] == "reserved"
    assert p("kv_ready", tid, src) == ("ok",)
    ev, _ = d.wait(("Ready", "Failed"), tid, 20)
    assert ev["type"] == "Ready", ev
    assert d("bad_blocks", dst, salt, skip) == ("bad", [])
    out, _ = p.wait(("SourceReleased",), tid, 20)
    assert out["outcome"] == "delivered", out
    return ev
