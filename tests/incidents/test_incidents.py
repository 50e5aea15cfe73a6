"""Push-mode failures others shipped, replayed against the real runtime: two
processes, real NIXL on loopback (``tests/nixl_side.py``). One test per
scenario; each docstring names the incident. Each asserts that no block a
request was told is ready holds wrong bytes, that the failing request is
reported failed in time (or completes correctly), that every reserved and held
block comes back, and that other requests are not affected.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import replace

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed (make test installs it)")

from nixl_procs import Proc, sides, spec, transfer

from kvpush.protocol import Role

REUSED = 9  # the salt of "another request's" bytes in reused blocks


def settle(p: Proc, d: Proc) -> None:
    """Nothing reserved on the decode, nothing held on the prefill (bounded wait)."""
    deadline = time.monotonic() + 10
    while (d("counts")[1], p("counts")[2]) != (0, 0):
        assert time.monotonic() < deadline, (d("counts"), p("counts"))
        time.sleep(0.05)


def still_reused(d: Proc, blocks: list[int]) -> None:
    assert d("bad_blocks", blocks, REUSED, 0) == ("bad", []), "a late write landed in reused blocks"


def becomes_suspect(d: Proc, tid: str, within: float) -> None:
    """The decode holds the blocks of ``tid`` as suspect (its quarantine
    passed, the producer connected and silent) and has not released them."""
    deadline = time.monotonic() + within
    while d("counts")[7] == 0:
        assert time.monotonic() < deadline, d("counts")
        time.sleep(0.05)
    assert d("wait", ("Released",), tid, 0.1, 1)[0] == "timeout"


@pytest.mark.parametrize("when", ["computing", "in flight"])
def test_01_decode_aborts_after_registering(when: str) -> None:
    """vLLM C1; SGLang #35049 / #27372: the decode aborts after its registration
    went out (while the prefill computes, or while the write is in flight); the
    aborted write must never land in blocks that were handed back and reused."""
    with sides(spec(Role.PRODUCER, 1, 16), spec(Role.CONSUMER, 1, 16, ready_timeout=3.0)) as (p, d):
        transfer(p, d, "warm", [1, 2], [1, 2], "push")
        src, dst = list(range(10, 26)), list(range(30, 46))
        assert p("fill", src, 3) == ("ok",)
        assert d("reserve", "victim", dst, "push", 0)[0] == "reserved"
        if when == "in flight":
            assert d("pause", True) == ("ok",)  # the decode does not see the write finish
            assert p("kv_ready", "victim", src) == ("ok",)
        assert d("abort", "victim") == ("aborted", True)
        # In flight: the write waits for the decode's progress. Past its
        # op_bound (1.0 s) the prefill cancels it (issue 28; before, the
        # blocks turned suspect at the quarantine and were held until the
        # decode polled again); only once NIXL confirms the cancel is it
        # reported failed, and the decode releases. Then the blocks are
        # reused *before* the decode polls again: nothing of the cancelled
        # write may land in them when it does.
        released, _ = d.wait(("Released",), "victim", 10)
        assert released["ready_after_reserve"] is None
        assert d("fill", dst, REUSED) == ("ok",)  # the blocks go to another request
        assert d("pause", False) == ("ok",)
        if when == "computing":
            assert p("kv_ready", "victim", src) == ("ok",)  # the KV is ready too late
        time.sleep(0.5)
        still_reused(d, dst)
        settle(p, d)
        transfer(p, d, "next", [50, 51], [50, 51], "push")  # others unaffected


@pytest.mark.parametrize("tls", ["default", "tcp"])
@pytest.mark.parametrize("when", ["before it reads the registration", "with the write posted"])
def test_04_a_stopped_prefill_never_writes_into_released_blocks(
    when: str, tls: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM L1, #46283, #55470: the prefill goes silent (SIGSTOP, not kill).
    The decode fails the request at its deadline; at the quarantine (deadline
    + max_transit + op_bound) the prefill is still connected and has not
    settled the epoch, so the blocks become *suspect*: held, not reused, with
    no timing assumption. Then SIGCONT: the prefill wakes up to a stale
    registration (dropped by the stall rule and refused) or finishes its
    posted write, which lands in the still-held blocks; only that proof
    releases them, and only then are they reused. Over UCX's TCP transport
    (``tls="tcp"``) the posted write sits in the stopped prefill's UCX and
    lands when it resumes: before the suspect hold the decode had released
    and reused the blocks by then (``benchmarks/stopped_producer.py --tls
    tcp``: 48 of 48 corrupt)."""
    if tls != "default":
        monkeypatch.setenv("UCX_TLS", tls)
        monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    with sides(spec(Role.PRODUCER, 1, 16), spec(Role.CONSUMER, 1, 16, ready_timeout=3.0)) as (p, d):
        transfer(p, d, "warm", [1, 2], [1, 2], "push")
        tid, src, dst = "stopped", list(range(10, 26)), list(range(30, 46))
        assert p("fill", src, len(tid)) == ("ok",)
        if when == "with the write posted":
            assert d("reserve", tid, dst, "push", 0)[0] == "reserved"
            assert d("pause", True) == ("ok",)  # the decode does not see the write finish
            assert p("kv_ready", tid, src) == ("ok",)
            time.sleep(0.3)
        os.kill(p.proc.pid, signal.SIGSTOP)
        try:
            if when == "before it reads the registration":
                assert d("reserve", tid, dst, "push", 0)[0] == "reserved"
            assert d("pause", False) == ("ok",)
            _, took = d.wait(("Failed",), tid, 10)
            # FAST timing: deadline 3.0 s, quarantine 3.0 + 0.5 + 1.0 s.
            assert took < 3.5, took
            becomes_suspect(d, tid, 6.0)
            time.sleep(1.0)  # however long the prefill stays stopped
            assert d("wait", ("Released",), tid, 0.1, 1)[0] == "timeout"
            if when == "before it reads the registration":
                p.conn.send(("kv_ready", tid, src))  # handled once it runs again
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)
        if when == "before it reads the registration":
            assert p.reply() == ("ok",)
        released, _ = d.wait(("Released",), tid, 10)
        assert released["released_after_reserve"] > 5.5, released
        assert released["failed_after_reserve"] < 3.5, released
        assert d("counts")[7] == 0
        assert d("fill", dst, REUSED) == ("ok",)  # another request's KV, after the proof
        out, _ = p.wait(("SourceReleased",), tid, 10)
        assert out["outcome"] != "delivered", out
        time.sleep(0.5)
        still_reused(d, dst)
        assert d("wait", ("Ready",), tid, 0.1, 1)[0] == "timeout"
        settle(p, d)
        transfer(p, d, "after", [50, 51], [50, 51], "push")  # the pair works again


def test_02_a_write_that_fails_to_post_is_reported_at_once() -> None:
    """vLLM C2, #50754: a WRITE that fails to post was never reported to the
    decode, which waited for its lease. Here the producer's data plane turns the
    failure into ``WriteFailed`` and the decode fails the request at once."""
    ready_timeout = 20.0
    cons = spec(Role.CONSUMER, 1, 16, ready_timeout=ready_timeout)
    with sides(spec(Role.PRODUCER, 1, 16), cons) as (p, d):
        transfer(p, d, "warm", [1, 2], [1, 2], "push")
        assert p("drop_agents") == ("ok",)  # the next post has no NIXL agent to go to
        assert d("reserve", "victim", [5, 6], "push", 0)[0] == "reserved"
        assert p("fill", [7, 8], 3) == ("ok",)
        assert p("kv_ready", "victim", [7, 8]) == ("ok",)
        failed, _ = d.wait(("Failed", "Ready"), "victim", 10)
        assert failed["type"] == "Failed" and failed["reason"] == "transfer_failed", failed
        assert "not posted" in failed["detail"]
        released, _ = d.wait(("Released",), "victim", 10)
        assert released["failed_after_reserve"] < 3.0  # not the 20 s deadline
        settle(p, d)


def test_03_partial_prefix_hit_with_fragmented_blocks() -> None:
    """vLLM C3: a partial prefix hit on the decode front-trimmed wrongly and
    silently corrupted KV. Exactly the blocks past the hit are written; the
    decode's own prefix blocks are untouched."""
    with sides(spec(Role.PRODUCER, 1, 16), spec(Role.CONSUMER, 1, 16)) as (p, d):
        prefix, rest = [60, 45], [33, 7, 52, 20]  # fragmented on purpose
        assert d("fill", prefix, 5) == ("ok",)  # the decode's own cached prefix
        src = [11, 3, 40, 41, 42, 9]  # the prefill's whole prompt, fragmented
        transfer(p, d, "hit", src, rest, "push", 32)
        assert d("bad_blocks", prefix, 5, 0) == ("bad", [])
        settle(p, d)


def test_08_registration_after_the_prefills_lease_expired_is_rejected() -> None:
    """Tombstones: the prefill finished and held its KV until its lease ran out;
    a registration arriving after that gets a fast, explicit rejection, and
    nothing is written."""
    prod = spec(Role.PRODUCER, 1, 16, kv_hold_timeout=1.0)
    with sides(prod, spec(Role.CONSUMER, 1, 16)) as (p, d):
        transfer(p, d, "warm", [1, 2], [1, 2], "push")
        assert p("fill", [3, 4], 3) == ("ok",)
        assert p("kv_ready", "late", [3, 4]) == ("ok",)
        released, _ = p.wait(("SourceReleased",), "late", 10)
        assert released["outcome"] != "delivered"
        assert d("fill", [8, 9], REUSED) == ("ok",)
        assert d("reserve", "late", [8, 9], "push", 0)[0] == "reserved"
        failed, _ = d.wait(("Failed", "Ready"), "late", 5)
        assert failed["type"] == "Failed", failed
        d.wait(("Released",), "late", 5)
        still_reused(d, [8, 9])
        settle(p, d)


def test_10_an_incompatible_peer_fails_on_both_sides_and_nothing_hangs() -> None:
    """llm-d #2433: a TP or layout mismatch surfaced on one side only, and the
    client hung. Both sides see the refusal; the request fails in time."""
    prod = spec(Role.PRODUCER, 1, 16, heads=8)  # the decode has 4
    with sides(prod, spec(Role.CONSUMER, 1, 16)) as (p, d):
        answer = d("reserve", "mismatch", [1, 2], "push", 0)
        if answer[0] == "refused":  # the handshake had failed already: refused at once
            assert answer == ("refused", "peer_failed"), answer
        else:  # registered while the handshake ran: it fails when the handshake does
            assert answer[0] == "reserved", answer
            failed, took = d.wait(("Failed",), "mismatch", 10)
            assert failed["reason"] == "handshake_failed", failed
            assert took < 5
        d.wait(("PeerFailed",), "", 5)
        p.wait(("PeerFailed",), "", 5)
        assert d("counts")[1] == 0


def test_11_a_burst_over_the_reservation_budget_is_refused_not_deadlocked() -> None:
    """SGLang #6857: a burst exhausted the decode's reservation budget and the
    system deadlocked. Over-budget reservations are refused at once (the caller
    defers or falls back); the admitted ones complete and free the budget."""
    with sides(spec(Role.PRODUCER, 1, 16), spec(Role.CONSUMER, 1, 16, max_reserved_blocks=8)) as (
        p,
        d,
    ):
        answers = [
            d("reserve", f"burst-{i}", [4 * i + j for j in range(4)], "push", 0) for i in range(4)
        ]
        assert [a[0] for a in answers] == ["reserved", "reserved", "refused", "refused"]
        assert answers[2] == ("refused", "budget")
        for i in range(2):
            src = [40 + 4 * i + j for j in range(4)]
            assert p("fill", src, len(f"burst-{i}")) == ("ok",)
            assert p("kv_ready", f"burst-{i}", src) == ("ok",)
            ready, _ = d.wait(("Ready", "Failed"), f"burst-{i}", 10)
            assert ready["type"] == "Ready", ready
        transfer(p, d, "after-burst", [60, 61], [20, 21], "push")  # budget is back
        settle(p, d)


def test_05_an_unreachable_peer_does_not_delay_transfers_to_others() -> None:
    """vLLM S2: handshakes blocked the head of the line. A peer that accepts the
    connection and never answers stalls only its own requests."""
    with socket.socket() as blackhole:  # listens, never accepts, never answers
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(8)
        host, port = blackhole.getsockname()
        with sides(spec(Role.PRODUCER, 1, 16), spec(Role.CONSUMER, 1, 16, ready_timeout=3.0)) as (
            p,
            d,
        ):
            transfer(p, d, "warm", [1, 2], [1, 2], "push")
            assert d("route", host, port, "blackhole:1") == ("ok",)
            assert d("reserve", "stuck", [10, 11], "push", 0, "blackhole:1")[0] == "reserved"
            started = time.monotonic()
            for i in range(3):
                transfer(p, d, f"others-{i}", [20 + i], [30 + i], "push")
            assert time.monotonic() - started < 2.5  # long before the stuck one's deadline
            failed, _ = d.wait(("Failed", "Ready"), "stuck", 10)
            assert failed["type"] == "Failed", failed
            d.wait(("Released",), "stuck", 10)
            settle(p, d)


def test_06_one_failed_write_of_several_releases_only_after_all_settle() -> None:
    """vLLM #56104: with several write handles per request, the first error
    freed the blocks while sibling writes still landed. Here TP 2 -> 1 posts two
    writes per request; one fails to post. The decode fails the request, takes
    its blocks back only once both writes settled, and nothing lands after."""
    with sides(spec(Role.PRODUCER, 2, 16), spec(Role.CONSUMER, 1, 16)) as (p, d):
        transfer(p, d, "warm", [1, 2], [1, 2], "push")
        assert p("drop_agents", 1) == ("ok",)  # producer rank 1's write cannot post
        src, dst = list(range(10, 18)), list(range(20, 28))
        assert p("fill", src, 3) == ("ok",)
        assert d("reserve", "split", dst, "push", 0)[0] == "reserved"
        assert p("kv_ready", "split", src) == ("ok",)
        failed, _ = d.wait(("Failed", "Ready"), "split", 10)
        assert failed["type"] == "Failed" and failed["reason"] == "transfer_failed", failed
        d.wait(("Released",), "split", 10)
        out, _ = p.wait(("SourceReleased",), "split", 10)
        assert out["outcome"] != "delivered"
        assert d("fill", dst, REUSED) == ("ok",)
        time.sleep(0.5)
        still_reused(d, dst)
        settle(p, d)


@pytest.mark.parametrize("when", ["before the KV is ready", "with the old write in flight"])
def test_07_a_preempted_and_re_reserved_request_gets_only_new_epoch_bytes(when: str) -> None:
    """Epochs: the decode preempts a request and reserves it again (a new
    epoch, new blocks) while the old epoch's registration or write is out.
    Ready names the new epoch and its blocks only, and the old blocks, reused
    meanwhile, are never written."""
    with sides(spec(Role.PRODUCER, 1, 16), spec(Role.CONSUMER, 1, 16, ready_timeout=3.0)) as (p, d):
        transfer(p, d, "warm", [1, 2], [1, 2], "push")
        tid, src, old, new = "again", [40, 41], [10, 11], [20, 21]
        assert p("fill", src, len(tid)) == ("ok",)
        assert d("reserve", tid, old, "push", 0) == ("reserved", 2)
        if when == "with the old write in flight":
            assert d("pause", True) == ("ok",)  # the target does not progress the write
            assert p("kv_ready", tid, src) == ("ok",)
            time.sleep(0.2)
        assert d("preempt", tid) == ("preempted", True)
        if when == "before the KV is ready":
            d.wait(("Released",), tid, 10)  # nothing was written: Settled at once
            assert d("fill", old, REUSED) == ("ok",)
        assert d("reserve", tid, new, "push", 0) == ("reserved", 3)
        assert d("pause", False) == ("ok",)
        if when == "before the KV is ready":
            assert p("kv_ready", tid, src) == ("ok",)
        else:
            # The old write lands once the decode polls again; only its
            # completion (or Settled) gives the old blocks back.
            d.wait(("Released",), tid, 10)
            assert d("fill", old, REUSED) == ("ok",)
        # The prefill still holds the KV (the old epoch was withdrawn, not
        # delivered) and writes it to the new epoch's blocks.
        ready, _ = d.wait(("Ready", "Failed"), tid, 10)
        assert ready == {**ready, "type": "Ready", "epoch": 3}, ready
        assert d("bad_blocks", new, len(tid), 0) == ("bad", [])
        still_reused(d, old)
        settle(p, d)


def test_12_a_decode_that_stops_polling_for_a_while_loses_nothing() -> None:
    """A long step on the decode: its data plane does not poll for a while. No
    corruption, and the prefill's write completes once polling resumes."""
    with sides(spec(Role.PRODUCER, 1, 16), spec(Role.CONSUMER, 1, 16, ready_timeout=10.0)) as (
        p,
        d,
    ):
        transfer(p, d, "warm", [1, 2], [1, 2], "push")
        src, dst = list(range(10, 26)), list(range(30, 46))
        assert p("fill", src, len("long-step")) == ("ok",)
        assert d("reserve", "long-step", dst, "push", 0)[0] == "reserved"
        assert d("pause", True) == ("ok",)
        assert p("kv_ready", "long-step", src) == ("ok",)
        # The long step, shorter than the producer's op_bound (1.0 s): a
        # longer one gets the write cancelled and the transfer failed (issue
        # 28), as test 01 shows.
        time.sleep(0.6)
        assert d("wait", ("Ready", "Failed"), "long-step", 0.1, 1)[0] == "timeout"
        assert d("pause", False) == ("ok",)
        ready, _ = d.wait(("Ready", "Failed"), "long-step", 10)
        assert ready["type"] == "Ready", ready
        assert d("bad_blocks", dst, len("long-step"), 0) == ("bad", [])
        out, _ = p.wait(("SourceReleased",), "long-step", 10)
        assert out["outcome"] == "delivered"
        settle(p, d)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_09_a_prefill_restarted_on_the_same_port_gets_fresh_agents(mode: str) -> None:
    """vLLM #50047: stale agent state was reused after a peer restarted. Same
    host and port, new process (new NIXL agents, new memory): the decode
    redials, learns the new metadata in the handshake, and never uses a
    handle or prepared list of the old instance: the bytes prove it."""
    prod = spec(Role.PRODUCER, 1, 16)
    with sides(prod, spec(Role.CONSUMER, 1, 16)) as (p, d):
        transfer(p, d, "before", [1, 2, 3], [4, 5, 6], mode)
        port = p.port
        p.kill()
        p2 = Proc(replace(prod, port=port))
        try:
            assert p2.port == port
            # Reserving before the new handshake may fail fast (peer lost) by
            # design; an engine retries. Here: wait for the new instance.
            d.wait(("PeerReady",), "", 20, nth=2)
            transfer(p2, d, "after1", [1, 2, 3], [7, 8, 9], mode)  # same source blocks
            transfer(p2, d, "after22", [9, 8], [10, 11], mode)
        finally:
            p2.stop()
