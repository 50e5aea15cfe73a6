"""xPyD on one machine: 2 prefill instances with TP 2 hand off to 2 decode
instances with TP 1 (heterogeneous TP: each decode rank takes its KV from two
prefill ranks), over real NIXL on loopback, one process per instance. A
round-robin "router" spreads requests over every prefill x decode pair; every
byte is checked and nothing stays reserved or held."""

from __future__ import annotations

import itertools
import time

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed (make test installs it)")

from nixl_procs import Proc
from nixl_side import SideSpec

from kvpush.protocol import Role


def test_two_tp2_prefills_feed_two_tp1_decodes_through_a_router() -> None:
    prefills = [Proc(SideSpec(Role.PRODUCER, f"prefill-{x}", "", 2, 16, 64)) for x in "ab"]
    decodes: list[Proc] = []
    try:
        decodes += [Proc(SideSpec(Role.CONSUMER, f"decode-{x}", "", 1, 16, 64)) for x in "ab"]
        for d in decodes:
            for p in prefills:
                assert d("route", "127.0.0.1", p.port, p.spec.name) == ("ok",)
            d.wait(("PeerReady",), "", 20, nth=2)
        pairs = itertools.cycle(itertools.product(range(2), range(2)))
        inflight = []
        for i in range(24):  # 6 per pair, 4 at a time
            pi, di = next(pairs)
            p, d = prefills[pi], decodes[di]
            tid, salt, src = f"req-{i}", 20 + i, [4 * (i % 8) + k for k in range(4)]
            dst = [32 + 4 * (i % 8) + k for k in range(4)]
            assert p("fill", src, salt) == ("ok",)
            assert d("reserve", tid, dst, "push", 0, p.spec.name)[0] == "reserved"
            assert p("kv_ready", tid, src) == ("ok",)
            inflight.append((p, d, tid, salt, dst))
            if len(inflight) == 4:
                for p_, d_, tid_, salt_, dst_ in inflight:
                    ev, _ = d_.wait(("Ready", "Failed"), tid_, 20)
                    assert ev["type"] == "Ready", ev
                    assert d_("bad_blocks", dst_, salt_, 0) == ("bad", [])
                    out, _ = p_.wait(("SourceReleased",), tid_, 20)
                    assert out["outcome"] == "delivered", out
                inflight.clear()
        served = {(p.spec.name, d.spec.name) for p in prefills for d in decodes}
        assert len(served) == 4
        deadline = time.monotonic() + 10
        while any(d("counts")[1] for d in decodes) or any(p("counts")[2] for p in prefills):
            assert time.monotonic() < deadline, "blocks still reserved or held"
            time.sleep(0.05)
        # Each prefill rank wrote its half of the heads: two writes per request.
        assert sum(p("counts")[3] for p in prefills) == 2 * 24
    finally:
        for proc in [*prefills, *decodes]:
            proc.stop()
