"""ShmTransport: shared-memory data plane, in one process and across processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import numpy as np
import pytest

from kvpush.protocol import (
    Codec,
    Completion,
    ConfigError,
    HeadSlice,
    KVLayout,
    MemoryType,
    Route,
    Source,
    layer_regions,
)
from kvpush.runtime import (
    Completed,
    Notice,
    TransferPlanner,
    Transport,
    TransportError,
    plan_transfer,
)
from kvpush.shm import ShmTransport
from kvpush.shm import _transport as shm_module

SIZE = 1 << 20
DEADLINE_S = 15.0
_DEV_SHM = "/dev/shm"

Make = Callable[..., ShmTransport]


def _leftovers(prefix: str) -> list[str]:
    if not os.path.isdir(_DEV_SHM):
        return []
    return sorted(n for n in os.listdir(_DEV_SHM) if n.startswith(prefix))


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    """A name prefix unique to the test; no segment under it may outlive it."""
    prefix = f"kvpt{secrets.token_hex(4)}"
    yield prefix
    leaked = _leftovers(prefix)
    for name in leaked:  # clean up before failing, so one failure leaks nothing
        os.unlink(os.path.join(_DEV_SHM, name))
    assert not leaked, f"leaked shared memory: {leaked}"


@pytest.fixture
def make(shm_prefix: str) -> Iterator[Make]:
    made: list[ShmTransport] = []

    def make(agent: str, size: int = SIZE, **kw: Any) -> ShmTransport:
        kw.setdefault("verify", True)
        if kw.get("create", True):
            kw.setdefault("name", f"{shm_prefix}{agent}{len(made)}")
        t = ShmTransport(agent, size, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def rows(*triples: tuple[int, int, int]) -> np.ndarray:
    return np.array(triples, dtype=np.uint64).reshape(-1, 3)


def connect(a: ShmTransport, b: ShmTransport) -> None:
    assert a.add_peer(b.metadata()) == b.agent
    assert b.add_peer(a.metadata()) == a.agent


def fill(memory: np.ndarray, plan_rows: np.ndarray, salt: int) -> None:
    """A position- and salt-dependent pattern in every source row."""
    for off, n, _ in plan_rows.tolist():
        memory[off : off + n] = (np.arange(off, off + n) * 31 + salt * 17) % 251


# --- layouts and plans ---------------------------------------------------------

HEAD_BYTES = 64
HEADS = 2


def producer_layout(num_blocks: int, base: int) -> KVLayout:
    """Two layers, FlashAttention packing, 16-token blocks."""
    layer = 2 * num_blocks * 16 * HEADS * HEAD_BYTES
    bases = [base, base + layer]
    return KVLayout(
        layer_regions(
            bases,
            num_blocks=num_blocks,
            tokens_per_block=16,
            num_heads=HEADS,
            head_bytes=HEAD_BYTES,
            memory=MemoryType.DRAM,
        )
    )


def consumer_layout(num_blocks: int, base: int) -> KVLayout:
    """Two layers, FlashInfer (interleaved) packing, 32-token blocks."""
    layer = 2 * num_blocks * 32 * HEADS * HEAD_BYTES
    bases = [base, base + layer]
    return KVLayout(
        layer_regions(
            bases,
            num_blocks=num_blocks,
            tokens_per_block=32,
            num_heads=HEADS,
            head_bytes=HEAD_BYTES,
            packing="interleaved",
            memory=MemoryType.DRAM,
        )
    )


ROUTE = Route(Source(0), 0, HeadSlice(0, HEADS))


def completion_notice(i: int) -> bytes:
    return Codec().encode_notice(Completion(f"xfer-{i}", 1, Source(0), 0))


# --- one process ---------------------------------------------------------------


def test_is_a_transport(make: Make) -> None:
    t = make("a")
    assert isinstance(t, Transport)
    assert t.agent == "a"
    assert t.segment_name.startswith("kvpt")
    assert t.memory.shape == (SIZE,)
    assert t.memory.dtype == np.uint8


def test_write_merged_plan_delivers_bytes_then_notice(make: Make) -> None:
    prod, cons = make("prefill"), make("decode")
    p_layout, c_layout = producer_layout(32, base=4096), consumer_layout(16, base=8192)
    prod.register(p_layout)
    cons.register(c_layout)
    connect(prod, cons)
    plan = plan_transfer(p_layout, c_layout, ROUTE, [[3, 4, 5, 9, 10, 11, 20, 21]], [[2, 3, 7, 8]])
    assert plan.num_descriptors < plan.num_pieces  # merged rows
    fill(prod.memory, plan.src, salt=5)
    notice = completion_notice(7)

    handle = prod.write(cons.agent, plan.src, plan.dst, notice)

    assert prod.poll() == ([Completed(handle)], [])
    assert prod.poll() == ([], [])
    completed, notices = cons.poll()
    assert completed == []
    assert notices == [Notice("prefill", notice)]
    assert Codec().decode_notice(notices[0].payload).transfer_id == "xfer-7"
    written = np.zeros(SIZE, dtype=bool)
    for (s, n, _), (d, n2, _) in zip(plan.src.tolist(), plan.dst.tolist(), strict=True):
        assert n == n2
        assert np.array_equal(cons.memory[d : d + n], prod.memory[s : s + n])
        written[d : d + n] = True
    assert int(written.sum()) == plan.nbytes
    assert not cons.memory[~written].any()  # nothing written outside the plan
    assert cons.poll() == ([], [])


def test_read_copies_from_peer_without_notice(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    b.memory[1000:1100] = 9
    h = a.read("b", rows((50, 100, 0)), rows((1000, 100, 0)))
    assert a.poll() == ([Completed(h)], [])
    assert b.poll() == ([], [])
    assert (a.memory[50:150] == 9).all()
    assert not a.memory[:50].any()
    assert not a.memory[150:].any()


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        (rows((SIZE - 10, 20, 0)), rows((0, 20, 0)), "outside"),
        (rows((0, 20, 0)), rows((SIZE - 10, 20, 0)), "outside"),
        (rows((0, 20, 0)), rows((SIZE + 1, 0, 0)), "outside"),
        (rows((0, 16, 0)), rows((2**64 - 8, 16, 0)), "outside"),
        (rows((0, 16, 0)), rows((16, 2**64 - 1, 0)), "outside"),
        (rows((0, 16, 0)), rows((0, 16, 1)), "device 0"),
        (rows((0, 16, 0)), rows((0, 17, 0)), "lengths"),
        (rows((0, 16, 0), (16, 16, 0)), rows((0, 16, 0)), "count"),
        (np.array([[-1, 16, 0]], dtype=np.int64), rows((0, 16, 0)), "non-negative"),
        (np.zeros((1, 2), dtype=np.uint64), rows((0, 16, 0)), r"\(N, 3\)"),
        (rows((0, 16, 0)), np.array([[0.0, 16.0, 0.0]]), "integers"),
    ],
)
def test_write_refuses_bad_rows_before_copying(
    make: Make, src: np.ndarray, dst: np.ndarray, match: str
) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    a.memory[:] = 1
    if src.dtype == dst.dtype == np.uint64 and src.shape[1:] == (3,):
        # A valid row first: nothing of a refused write may be copied.
        src = np.concatenate([rows((0, 8, 0)), src])
        dst = np.concatenate([rows((100, 8, 0)), dst])
    with pytest.raises(TransportError, match=match):
        a.write("b", src, dst, b"n")
    assert not b.memory.any()
    assert a.poll() == ([], [])
    assert b.poll() == ([], [])


def test_write_and_read_refusals(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    one = rows((0, 8, 0))
    with pytest.raises(TransportError, match="unknown peer"):
        a.write("nobody", one, one, b"n")
    with pytest.raises(TransportError, match="notice"):
        a.write("b", one, one, b"x" * (1 << 17))
    with pytest.raises(TransportError, match="outside"):
        a.read("b", one, rows((SIZE, 8, 0)))
    assert a.poll() == ([], [])


def test_register_checks_memory_type_and_bounds(make: Make) -> None:
    t = make("a")
    t.register(producer_layout(32, base=0))
    t.register(producer_layout(32, base=0))  # the same again: fine
    with pytest.raises(TransportError, match="different"):
        t.register(producer_layout(16, base=0))
    u = make("b")
    vram = KVLayout(
        layer_regions([0], num_blocks=4, tokens_per_block=16, num_heads=2, head_bytes=64)
    )
    with pytest.raises(TransportError, match="VRAM"):
        u.register(vram)
    with pytest.raises(TransportError, match="does not fit"):
        u.register(producer_layout(32, base=SIZE - 4096))


def test_restart_replaces_the_attachment(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    one, notice = rows((0, 64, 0)), b"first"
    a.memory[:64] = 3
    old = a.write("b", one, one, notice)
    assert a.add_peer(b.metadata()) == "b"  # the same instance again: a no-op
    b.close()
    b2 = make("b")  # a new instance of the same agent, in a new segment
    assert b2.add_peer(a.metadata()) == "a"  # before a knows it: attaches lazily
    assert a.add_peer(b2.metadata()) == "b"
    assert a.peers == ("b",)
    (failed,), _ = a.poll()
    assert failed.handle == old
    assert failed.error is not None
    assert "restarted" in failed.error
    new = a.write("b", one, one, b"second")
    assert new > old  # handles are never reused
    assert a.poll() == ([Completed(new)], [])
    assert b2.poll() == ([], [Notice("a", b"second")])
    assert (b2.memory[:64] == 3).all()


def test_remove_peer_then_add_again(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    one = rows((0, 8, 0))
    h = a.write("b", one, one, b"1")
    a.remove_peer("b")
    a.remove_peer("b")  # unknown: a no-op
    assert a.poll() == ([Completed(h, "peer 'b' was removed")], [])
    with pytest.raises(TransportError, match="unknown peer"):
        a.write("b", one, one, b"2")
    # b still drains what was published, then sees the mailbox closed.
    assert b.poll() == ([], [Notice("a", b"1")])
    a.add_peer(b.metadata())
    a.write("b", one, one, b"3")
    assert b.poll()[1] == [Notice("a", b"3")]  # a new mailbox, sequence from 1


def test_a_rate_limited_link_delivers_in_order_after_the_wire_time(make: Make) -> None:
    # 1 MB at 0.08 Gb/s (10 MB/s) is 100 ms on the wire; a read behind it waits too.
    a, b = make("a", size=4 << 20, link_gbps=0.08), make("b", size=4 << 20)
    connect(a, b)
    n = 1_000_000
    a.memory[:n] = 7
    b.memory[2 * n : 2 * n + 10] = 3
    started = time.monotonic()
    w = a.write("b", rows((0, n, 0)), rows((n, n, 0)), b"w")
    r = a.read("b", rows((3 * n, 10, 0)), rows((2 * n, 10, 0)))
    assert a.poll() == ([], []) and b.poll() == ([], [])  # nothing crossed yet
    assert not b.memory[n : 2 * n].any()
    done: list[Completed] = []
    while len(done) < 2 and time.monotonic() - started < 10:
        done += a.poll()[0]
        time.sleep(0.005)
    assert time.monotonic() - started >= 0.1  # the wire time of 1 MB at 10 MB/s
    assert done == [Completed(w), Completed(r)]
    assert (b.memory[n : 2 * n] == 7).all() and (a.memory[3 * n : 3 * n + 10] == 3).all()
    assert b.poll() == ([], [Notice("a", b"w")])


def test_a_rate_limited_op_fails_when_its_peer_goes(make: Make) -> None:
    a, b = make("a", link_gbps=1e-6), make("b")
    connect(a, b)
    h = a.write("b", rows((0, 8, 0)), rows((0, 8, 0)), b"1")
    a.remove_peer("b")
    assert a.poll() == ([Completed(h, "peer 'b' was removed")], [])
    assert b.poll() == ([], [])  # neither the bytes nor the notice went
    for bad in (0, -1.0, float("nan"), float("inf"), True, "10"):
        with pytest.raises(ConfigError, match="link_gbps"):
            make("c", link_gbps=bad)


def test_mailbox_full_refuses_before_copying(make: Make) -> None:
    a, b = make("a", mailbox_bytes=4096, verify=False), make("b")
    connect(a, b)
    a.memory[:16] = 7
    sent = 4096 // 136  # records of 32 + 100 bytes, 8-aligned, fill the mailbox
    for i in range(sent):
        a.write("b", rows((0, 8, 0)), rows((16 * i, 8, 0)), b"x" * 100)
    with pytest.raises(TransportError, match="mailbox full"):
        a.write("b", rows((0, 8, 0)), rows((16 * sent, 8, 0)), b"x" * 100)
    assert not b.memory[16 * sent : 16 * sent + 8].any()  # the refused write copied nothing
    assert len(b.poll()[1]) == sent
    # Many rounds of the ring: records wrap around its end, sequence stays exact.
    for i in range(200):
        a.write("b", rows((0, 8, 0)), rows((0, 8, 0)), i.to_bytes(4, "little") * 11)
        if i % 7 == 6:
            assert [int.from_bytes(n.payload[:4], "little") for n in b.poll()[1]] == list(
                range(i - 6, i + 1)
            )
    with pytest.raises(TransportError, match="more than"):
        a.write("b", rows(*[(0, 8, 0)] * 300), rows(*[(0, 8, 0)] * 300), b"x" * 5000)


def test_verify_rows_must_fit_the_mailbox(make: Make) -> None:
    a, b = make("a", mailbox_bytes=4096), make("b")
    connect(a, b)
    many = rows(*[(16 * i, 8, 0) for i in range(300)])
    with pytest.raises(TransportError, match="turn verify off"):
        a.write("b", many, many, b"n")
    assert not b.memory.any()


def test_verification_detects_corrupted_destination(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    a.memory[:4096] = 1
    a.write("b", rows((0, 4096, 0)), rows((8192, 4096, 0)), b"n")
    b.memory[8192 + 100] ^= 0xFF  # as if the notice had overtaken the data
    with pytest.raises(TransportError, match="before its data"):
        b.poll()
    with pytest.raises(TransportError, match="failed"):
        b.poll()  # failed for good
    with pytest.raises(TransportError, match="failed"):
        b.write("a", rows((0, 8, 0)), rows((0, 8, 0)), b"n")


def test_verification_detects_a_skipped_copy(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    a.memory[:64] = 5
    monkeypatch.setattr(shm_module, "copy_rows", lambda *args: None)
    a.write("b", rows((0, 64, 0)), rows((0, 64, 0)), b"n")
    with pytest.raises(TransportError, match="before its data"):
        b.poll()


def test_unverified_receiver_accepts_without_checking(make: Make) -> None:
    a, b = make("a"), make("b", verify=False)
    connect(a, b)
    a.write("b", rows((0, 64, 0)), rows((0, 64, 0)), b"n")
    b.memory[0] = 1
    assert b.poll() == ([], [Notice("a", b"n")])


def test_sequence_gap_is_detected(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    one = rows((0, 8, 0))
    a.write("b", one, one, b"1")
    a._peers["b"].outbox._next_seq += 1  # a lost notice
    a.write("b", one, one, b"3")
    with pytest.raises(TransportError, match="sequence 3 where 2 was due"):
        b.poll()


def test_attach_mode_shares_memory_and_never_unlinks(make: Make, shm_prefix: str) -> None:
    owner, b = make("rank0"), make("b")
    leader = make("rank0", create=False, name=owner.segment_name)
    owner.memory[:32] = 4
    assert (leader.memory[:32] == 4).all()
    connect(leader, b)
    leader.write("b", rows((0, 32, 0)), rows((64, 32, 0)), b"n")
    assert b.poll()[1] == [Notice("rank0", b"n")]
    assert (b.memory[64:96] == 4).all()
    view = leader.memory
    leader.close()
    leader.close()
    assert (view[:32] == 4).all()  # a view outlives close: the mapping stays
    assert (owner.memory[:32] == 4).all()
    with pytest.raises(TransportError, match="closed"):
        leader.poll()
    with pytest.raises(TransportError, match="no shared memory"):
        make("x", create=False, name=f"{shm_prefix}missing")


def test_constructor_and_metadata_validation(make: Make) -> None:
    with pytest.raises(ValueError, match="agent"):
        ShmTransport("", SIZE)
    with pytest.raises(ValueError, match="size"):
        ShmTransport("a", 0)
    with pytest.raises(ValueError, match="name"):
        ShmTransport("a", SIZE, name="../x")
    with pytest.raises(ValueError, match="create=False"):
        ShmTransport("a", SIZE, create=False)
    with pytest.raises(ValueError, match="mailbox_bytes"):
        ShmTransport("a", SIZE, mailbox_bytes=100)
    a, b = make("a"), make("b")
    with pytest.raises(TransportError, match="already exists"):
        make("c", name=a.segment_name)
    meta = msgpack.unpackb(b.metadata())
    bad: list[object] = [b"", b"\xc1", msgpack.packb([1, 2]), {**meta, "kind": "nixl"}]
    bad += [{**meta, "version": 2}, {**meta, "segment": "a/b"}, {**meta, "instance": b"x"}]
    bad += [{**meta, "size": 0}, {**meta, "agent": ""}, {**meta, "extra": 1}]
    for item in bad:
        data = item if isinstance(item, bytes) else msgpack.packb(item)
        with pytest.raises(TransportError):
            a.add_peer(data)
    with pytest.raises(TransportError, match="no shared memory"):
        a.add_peer(msgpack.packb({**meta, "segment": "kvpt-none"}))
    assert a.peers == ()


# --- several processes ---------------------------------------------------------

XFERS = 50
P_BLOCKS, C_BLOCKS = 256, 128
P_BASE, C_BASE = 0, 4096
XSIZE = 4 << 20


def _planner() -> TransferPlanner:
    return TransferPlanner(
        producer_layout(P_BLOCKS, P_BASE), consumer_layout(C_BLOCKS, C_BASE), ROUTE
    )


def _blocks(i: int) -> tuple[list[list[int]], list[list[int]]]:
    """Transfer ``i``: 4 producer blocks into 2 consumer blocks, scattered, none reused."""
    p = np.random.default_rng(1).permutation(P_BLOCKS)
    c = np.random.default_rng(2).permutation(C_BLOCKS)
    return [p[4 * i : 4 * i + 4].tolist()], [c[2 * i : 2 * i + 2].tolist()]


def _recv(conn: Connection) -> Any:
    if not conn.poll(DEADLINE_S):
        raise TimeoutError("no message from the other process")
    return conn.recv()


def _writer(conn: Connection, prefix: str) -> dict[str, int]:
    with ShmTransport("writer", XSIZE, name=f"{prefix}w", verify=True) as t:
        t.register(producer_layout(P_BLOCKS, P_BASE))
        conn.send(t.metadata())
        t.add_peer(_recv(conn))
        planner = _planner()
        done: set[int] = set()
        posted = []
        deadline = time.monotonic() + DEADLINE_S
        for i in range(XFERS):
            plan = planner.plan(*_blocks(i))
            fill(t.memory, plan.src, salt=i)
            posted.append(t.write("reader", plan.src, plan.dst, completion_notice(i)))
            done.update(c.handle for c in t.poll()[0] if c.error is None)
        while len(done) < XFERS and time.monotonic() < deadline:
            done.update(c.handle for c in t.poll()[0] if c.error is None)
        assert done == set(posted)
        assert _recv(conn) == "verified"  # keep the mailbox until the reader drained it
        return {"completed": len(done)}


def _reader(conn: Connection, prefix: str) -> dict[str, int]:
    with ShmTransport("reader", XSIZE, name=f"{prefix}r", verify=True) as t:
        t.register(consumer_layout(C_BLOCKS, C_BASE))
        conn.send(t.metadata())
        t.add_peer(_recv(conn))
        planner, codec = _planner(), Codec()
        expected = np.zeros(XSIZE, dtype=np.uint8)  # what the writer's memory holds
        got = 0
        deadline = time.monotonic() + DEADLINE_S
        while got < XFERS:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{got} of {XFERS} notices arrived")
            completed, notices = t.poll()  # verify=True: CRC of every transfer checked
            assert completed == []
            for notice in notices:
                assert notice.peer == "writer"
                i = int(codec.decode_notice(notice.payload).transfer_id.removeprefix("xfer-"))
                assert i == got, "notices out of order"
                plan = planner.plan(*_blocks(i))
                fill(expected, plan.src, salt=i)
                for (s, n, _), (d, _, _) in zip(plan.src.tolist(), plan.dst.tolist(), strict=True):
                    assert np.array_equal(t.memory[d : d + n], expected[s : s + n]), i
                got += 1
            if not notices:
                time.sleep(0.001)
        conn.send("verified")
        return {"verified": got}


def _child(role: str, conn: Connection, report: Connection, prefix: str) -> None:
    try:
        result = (_writer if role == "writer" else _reader)(conn, prefix)
        report.send(("ok", result))
    except BaseException:
        report.send(("error", traceback.format_exc()))
        raise


def test_two_processes_fifty_writes(shm_prefix: str) -> None:
    ctx = mp.get_context("spawn")
    before = _leftovers(shm_prefix)
    w_conn, r_conn = ctx.Pipe()
    reports = {role: ctx.Pipe(duplex=False) for role in ("writer", "reader")}
    procs = {
        role: ctx.Process(
            target=_child, args=(role, conn, reports[role][1], shm_prefix), daemon=True
        )
        for role, conn in (("writer", w_conn), ("reader", r_conn))
    }
    try:
        for p in procs.values():
            p.start()
        results = {}
        for role, (recv_end, _) in reports.items():
            if not recv_end.poll(DEADLINE_S + 5):
                pytest.fail(f"{role} process reported nothing")
            results[role] = recv_end.recv()
        for p in procs.values():
            p.join(5)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(5)
    assert results["writer"] == ("ok", {"completed": XFERS}), results["writer"]
    assert results["reader"] == ("ok", {"verified": XFERS}), results["reader"]
    assert [p.exitcode for p in procs.values()] == [0, 0]
    assert _leftovers(shm_prefix) == before == []


def _attach_and_exit(name: str, size: int) -> None:
    t = ShmTransport("leader", size, create=False, name=name)
    t.memory[0] = 42  # and exit without close()


def test_attaching_process_exit_does_not_unlink(make: Make) -> None:
    owner = make("rank0")
    p = mp.get_context("spawn").Process(target=_attach_and_exit, args=(owner.segment_name, SIZE))
    p.start()
    p.join(DEADLINE_S)
    assert p.exitcode == 0
    assert owner.memory[0] == 42
    other = make("b", create=False, name=owner.segment_name)  # still linked
    assert other.memory[0] == 42
