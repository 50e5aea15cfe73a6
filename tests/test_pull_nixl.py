"""Pull over real NIXL (two processes, UCX on loopback, ``tests/nixl_side.py``):
a lent source stays lent while any epoch's read may still run (issue 13, 3)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed (make test installs it)")

from nixl_procs import Proc, sides, spec, transfer

from kvpush.protocol import Role


def settle(p: Proc, d: Proc) -> None:
    """Nothing reserved on the decode, nothing held on the prefill (bounded wait)."""
    deadline = time.monotonic() + 10
    while (d("counts")[1], p("counts")[2]) != (0, 0):
        assert time.monotonic() < deadline, (d("counts"), p("counts"))
        time.sleep(0.05)


def test_abort_of_a_newer_epoch_keeps_the_source_while_the_older_read_runs() -> None:
    """Register(e1), Announce(e1), the decode's read of e1 posted (its data plane
    does not see it finish: paused), preempt, reserve again (Register(e2)),
    abort (Abort(e2)). The prefill used to take Abort(e2) as the end of the
    whole transfer and release the source KV at once, under the running read.
    Now it keeps it lent until the decode reports that read settled."""
    with sides(spec(Role.PRODUCER, 1, 16), spec(Role.CONSUMER, 1, 16, ready_timeout=5.0)) as (
        p,
        d,
    ):
        transfer(p, d, "warm", [1, 2], [1, 2], "pull")
        tid, src = "victim", list(range(10, 14))
        assert p("fill", src, len(tid)) == ("ok",)
        assert d("pause", True) == ("ok",)  # reads run, their completions wait
        posted = d("counts")[3]
        assert d("reserve", tid, list(range(30, 34)), "pull", 0)[0] == "reserved"
        assert p("kv_ready", tid, src) == ("ok",)
        deadline = time.monotonic() + 10
        while d("counts")[3] == posted:  # the Announce arrived, the read is posted
            assert time.monotonic() < deadline, "the read was never posted"
            time.sleep(0.02)
        assert d("preempt", tid) == ("preempted", True)
        assert d("reserve", tid, list(range(40, 44)), "pull", 0)[0] == "reserved"
        time.sleep(0.2)  # Register(e2) reaches the prefill
        assert d("abort", tid) == ("aborted", True)
        time.sleep(0.5)  # Abort(e2) reaches the prefill
        assert p("wait", ("SourceReleased",), tid, 0.5, 1)[0] == "timeout"  # still lent
        assert p("counts")[2] == len(src)  # held
        assert d("pause", False) == ("ok",)  # the read is reported: Withdraw(e1)
        out, _ = p.wait(("SourceReleased",), tid, 10)
        assert out["outcome"] == "aborted", out
        settle(p, d)
        transfer(p, d, "after", [50, 51], [50, 51], "pull")  # the pair works on
