"""The runtime over real NIXL (UCX on loopback) between two processes: push
and pull, TP 1->1, 2->1 and 1->2, a block-size ratio of 2, fragmented block
tables and a prefix hit, bytes verified at the destination; then a prefill
killed mid-write, a decode killed mid-write, and a prefill restarted on the
same port.

Each side is a spawned process (``tests/nixl_side.py``): a kill takes NIXL
and UCX down with the process, and the reference saw UCX abort at exit about
once in 15 runs after a peer kill, so nothing of the kind runs in pytest's
own process. Every wait is bounded.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed (make test installs it)")

from nixl_procs import Proc, sides, spec, transfer

from kvpush.protocol import Role


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "p_tokens", "d_tokens", "mode", "prepped"),
    [
        (1, 1, 16, 16, "push", False),
        (1, 1, 16, 16, "staged", False),  # gathered, one span per route, scattered
        (2, 1, 16, 16, "staged", False),  # two producer ranks into one slot
        (1, 2, 16, 16, "staged", False),  # one producer rank into two slots
        (1, 1, 16, 8, "staged", False),  # block-size ratio 2
        (2, 1, 8, 16, "staged", False),
        (1, 1, 16, 16, "push", True),  # by index into lists prepared once per route
        (2, 1, 16, 16, "push", False),  # two producer ranks into one: an exact set of two
        (1, 2, 16, 16, "pull", False),
        (1, 2, 16, 16, "pull", True),
        (1, 1, 16, 8, "push", True),  # block-size ratio 2
        (2, 1, 8, 16, "pull", False),
    ],
)
def test_transfers_over_nixl_between_two_processes(
    p_tp: int, d_tp: int, p_tokens: int, d_tokens: int, mode: str, prepped: bool
) -> None:
    tokens = 64
    staging = 1 << 20 if mode == "staged" else 0
    mode = "push" if staging else mode
    prod = spec(Role.PRODUCER, p_tp, p_tokens, prepped=prepped, staging=staging)
    cons = spec(Role.CONSUMER, d_tp, d_tokens, prepped=prepped, staging=staging)
    with sides(prod, cons) as (p, d):
        # Fragmented tables on both sides (runs of 1-3 blocks, out of order).
        src = [5, 9, 10, 11, 0, 1, 2, 30][: tokens // p_tokens]
        dst = [20, 3, 4, 17, 30, 31, 1, 2][: tokens // d_tokens]
        transfer(p, d, "req-a", src, dst, mode)
        # A second request reuses the prepared lists; a third is a prefix hit.
        transfer(p, d, "req-bb", [40, 41, 43, 42, 50, 51, 52, 53][: tokens // p_tokens],
                 [40, 42, 41, 43, 50, 52, 51, 53][: tokens // d_tokens], mode)  # fmt: skip
        skip = 2 * max(p_tokens, d_tokens)  # whole blocks on both sides
        transfer(p, d, "req-ccc", src, dst[skip // d_tokens :], mode, skip)
        for side in (p, d):
            counts = side("counts")
            assert counts[1:3] == (0, 0), counts  # nothing reserved or held
        mover = p if mode == "push" else d
        posts = 3 * p_tp * d_tp // min(p_tp, d_tp)  # one per rank pair per request
        assert mover("counts")[3:5] == (posts, posts if prepped else 0)
        # Staged: every write gathered and scattered, every slot back, nothing dropped.
        assert p("counts")[8][0] == (posts if staging else 0)
        assert d("counts")[8][1:] == (posts if staging else 0, 0, 0)
        assert p("counts")[8][2] == 0


def test_prefill_killed_mid_write_fails_the_request_and_frees_blocks_after_quarantine() -> None:
    """The write is held in flight (the decode's transport is not polled, so the
    target does not progress), then the prefill dies: the decode fails the
    request by its deadline, and hands its blocks back only after the
    quarantine (deadline + max_transit + op_bound), with nothing else hanging."""
    ready_timeout = 3.0
    cons = spec(Role.CONSUMER, 1, 16, ready_timeout=ready_timeout)
    with sides(spec(Role.PRODUCER, 1, 16), cons) as (p, d):
        transfer(p, d, "warm", [1, 2], [1, 2], "push")  # the handshake is done
        src, dst = list(range(10, 42)), list(range(20, 52))
        assert p("fill", src, 3) == ("ok",)
        assert d("reserve", "victim", dst, "push", 0)[0] == "reserved"
        assert d("pause", True) == ("ok",)
        assert p("kv_ready", "victim", src) == ("ok",)
        p.kill()
        assert d("pause", False) == ("ok",)
        failed, _ = d.wait(("Failed", "Ready"), "victim", ready_timeout + 5)
        assert failed["type"] == "Failed", failed
        released, _ = d.wait(("Released",), "victim", 10)
        timing = cons.timing
        quarantine = ready_timeout + timing.max_transit + timing.op_bound
        # Failed by the deadline (the lost peer is noticed sooner); the blocks
        # come back at the quarantine, not a moment before.
        assert released["failed_after_reserve"] <= ready_timeout + 0.5, released
        assert quarantine <= released["released_after_reserve"] <= quarantine + 2.0, released
        assert d("counts")[1] == 0  # every reserved block is back
        assert released["tid"] == "victim"


def test_decode_killed_mid_write_frees_the_prefill_blocks() -> None:
    """A write in flight to a decode that dies: the prefill's transfer fails
    (NIXL reports the disconnect, or the lease runs out) and its held blocks
    are released; a new decode on a new port then works."""
    hold = 3.0
    with sides(spec(Role.PRODUCER, 1, 16, kv_hold_timeout=hold), spec(Role.CONSUMER, 1, 16)) as (
        p,
        d,
    ):
        transfer(p, d, "warm", [1, 2], [1, 2], "push")
        src = list(range(10, 42))
        assert p("fill", src, 3) == ("ok",)
        assert d("reserve", "victim", list(range(20, 52)), "push", 0)[0] == "reserved"
        assert d("pause", True) == ("ok",)
        assert p("kv_ready", "victim", src) == ("ok",)
        d.kill()
        released, _ = p.wait(("SourceReleased",), "victim", 20)
        assert released["outcome"] != "delivered", released
        assert p("counts")[2] == 0  # nothing held
        # The prefill is still healthy: a fresh decode process gets its KV.
        d2 = Proc(spec(Role.CONSUMER, 1, 16))
        try:
            assert d2("route", "127.0.0.1", p.port) == ("ok",)
            transfer(p, d2, "after", [3, 4, 5], [7, 8, 9], "push")
        finally:
            d2.stop()
