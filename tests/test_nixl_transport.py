"""NixlTransport: real NIXL over UCX on loopback (no mocks).

Two transports in this process over numpy buffers for almost everything; a
killed peer runs in child processes (UCX may abort at exit after a peer was
killed, so the whole scenario is isolated). Every wait polls against a
deadline and fails instead of hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import numpy as np
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")
pytest.importorskip(
    "nixl._api",
    reason="NIXL is not installed (pip install --no-deps nixl nixl-cu12)",
    exc_type=ImportError,
)

from kvpush.protocol import (
    ConfigError,
    HeadSlice,
    KVLayout,
    MemoryType,
    Region,
    Role,
    Route,
    Source,
    layer_regions,
)
from kvpush.runtime import (
    Completed,
    Notice,
    PreppedTransport,
    TransferPlanner,
    Transport,
    TransportError,
)
from kvpush_nixl import NixlTransport
from kvpush_nixl._memory import MemoryMap, Span, layout_spans
from kvpush_nixl._meta import decode_metadata

DEADLINE_S = 10.0
SIZE = 4 << 20
BLOCK = 4096

# --- helpers ---------------------------------------------------------------------------


def flat_layout(buf: np.ndarray, memory: MemoryType = MemoryType.DRAM) -> KVLayout:
    """One region over the whole buffer, 4 KiB blocks."""
    region = Region(
        layer=0,
        kind="K",
        base=buf.ctypes.data,
        num_blocks=buf.nbytes // BLOCK,
        block_len=BLOCK,
        tokens_per_block=16,
        num_heads=1,
        head_bytes=BLOCK // 16,
        memory=memory,
    )
    return KVLayout((region,))


@dataclass
class Rank:
    t: NixlTransport
    buf: np.ndarray
    layout: KVLayout

    def rows(self, *pairs: tuple[int, int]) -> np.ndarray:
        """``(offset, length)`` pairs in this rank's buffer as descriptor rows."""
        base = self.buf.ctypes.data
        return np.array([(base + o, n, 0) for o, n in pairs], dtype=np.uint64).reshape(-1, 3)

    def at(self, rows: np.ndarray) -> bytes:
        """The bytes of rows in this rank's buffer, concatenated."""
        base = self.buf.ctypes.data
        return b"".join(self.buf[a - base : a - base + n].tobytes() for a, n, _ in rows.tolist())


Make = Callable[..., Rank]


@pytest.fixture
def make() -> Iterator[Make]:
    made: list[Rank] = []

    def make(
        name: str,
        size: int = SIZE,
        layout: Callable[[np.ndarray], KVLayout] = flat_layout,
        **kw: Any,
    ) -> Rank:
        buf = np.zeros(size, dtype=np.uint8)
        t = NixlTransport(name, **kw)
        lay = layout(buf)
        t.register(lay)
        rank = Rank(t, buf, lay)
        made.append(rank)
        return rank

    yield make
    for rank in reversed(made):  # buffers outlive their registrations
        rank.t.close()


def connect(a: Rank, b: Rank) -> None:
    assert a.t.add_peer(b.t.metadata(), b.layout) == b.t.agent
    assert b.t.add_peer(a.t.metadata(), a.layout) == a.t.agent


def fill(rank: Rank, salt: int) -> None:
    rank.buf[:] = (np.arange(rank.buf.size, dtype=np.uint64) * 31 + salt * 17) % 251


@dataclass
class Pump:
    """Polls transports, keeping what each reported; waits against a deadline."""

    ranks: tuple[Rank, ...]
    done: dict[str, list[Completed]] = field(default_factory=dict)
    notes: dict[str, list[Notice]] = field(default_factory=dict)

    def once(self) -> None:
        for r in self.ranks:
            c, n = r.t.poll()
            self.done.setdefault(r.t.agent, []).extend(c)
            self.notes.setdefault(r.t.agent, []).extend(n)

    def until(self, cond: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.once()
            if cond():
                return
        pytest.fail(f"timed out after {timeout} s waiting for {what}")

    def completed(self, rank: Rank, handle: int) -> Completed | None:
        return next((c for c in self.done.get(rank.t.agent, []) if c.handle == handle), None)

    def settle(self, rank: Rank, handle: int) -> Completed:
        self.until(lambda: self.completed(rank, handle) is not None, f"handle {handle}")
        got = self.completed(rank, handle)
        assert got is not None
        return got


# --- basics ----------------------------------------------------------------------------


def test_is_a_prepped_transport(make: Make) -> None:
    a = make("prefill-r0")
    assert isinstance(a.t, Transport)
    assert isinstance(a.t, PreppedTransport)
    assert a.t.agent == "prefill-r0"
    assert a.t.nixl_agent_name.startswith("prefill-r0#")
    info = decode_metadata(a.t.metadata())
    assert (info.agent, info.nixl_name) == ("prefill-r0", a.t.nixl_agent_name)
    assert info.spans == (Span("DRAM", 0, a.buf.ctypes.data, a.buf.nbytes),)


def test_write_delivers_bytes_before_its_notice(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    # Fragmented rows, 1 MiB in all, each write with its own content.
    src = a.rows(*((i * 2 * BLOCK, BLOCK) for i in range(256)))
    dst = b.rows(*(((255 - i) * BLOCK, BLOCK) for i in range(256)))
    pump = Pump((a, b))
    for salt in range(8):
        fill(a, salt)
        want = a.at(src)
        h = a.t.write("b", src, dst, b"n%d" % salt)
        seen: list[bytes] = []

        def arrived(salt: int = salt, want: bytes = want, seen: list[bytes] = seen) -> bool:
            for note in pump.notes.pop("b", []):
                assert note == Notice("a", b"n%d" % salt)
                seen.append(b.at(dst))  # the bytes as they are when the notice is seen
            return bool(seen)

        pump.until(arrived, f"notice {salt}")
        assert seen[0] == want
        assert pump.settle(a, h) == Completed(h)


def test_read_copies_remote_rows_without_a_notice(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    fill(b, 3)
    remote = b.rows((0, 3 * BLOCK), (10 * BLOCK, 100))
    local = a.rows((BLOCK, 3 * BLOCK), (50 * BLOCK, 100))
    h = a.t.read("b", local, remote)
    pump = Pump((a, b))
    assert pump.settle(a, h) == Completed(h)
    assert a.at(local) == b.at(remote)
    pump.once()
    assert not pump.notes.get("a") and not pump.notes.get("b")


def test_zero_rows_write_sends_the_notice_alone(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    empty = np.zeros((0, 3), dtype=np.uint64)
    h = a.t.write("b", empty, empty, b"nothing to move")
    r = a.t.read("b", empty, empty)
    pump = Pump((a, b))
    pump.until(lambda: bool(pump.notes.get("b")), "the notice")
    assert pump.notes["b"] == [Notice("a", b"nothing to move")]
    assert pump.completed(a, h) == Completed(h) and pump.completed(a, r) == Completed(r)


def test_empty_notice_moves_bytes_and_the_commit_notice_sees_both_writes(make: Make) -> None:
    """A progressive increment posts with ``b""``: its bytes land with no notice;
    the commit posted after it completed is seen only with both writes' bytes."""
    a, b = make("a"), make("b")
    connect(a, b)
    fill(a, 5)
    first, rest = a.rows((0, 4 * BLOCK)), a.rows((8 * BLOCK, 4 * BLOCK))
    to_first, to_rest = b.rows((20 * BLOCK, 4 * BLOCK)), b.rows((40 * BLOCK, 4 * BLOCK))
    pump = Pump((a, b))
    h = a.t.write("b", first, to_first, b"")
    assert pump.settle(a, h) == Completed(h)
    assert b.at(to_first) == a.at(first)
    pump.once()
    assert not pump.notes.get("b"), "an empty notice must send nothing"
    h = a.t.write("b", rest, to_rest, b"commit")
    seen: list[bytes] = []

    def arrived() -> bool:
        for note in pump.notes.pop("b", []):
            assert note == Notice("a", b"commit")
            seen.append(b.at(to_first) + b.at(to_rest))
        return bool(seen)

    pump.until(arrived, "the commit notice")
    assert seen == [a.at(first) + a.at(rest)]
    assert pump.settle(a, h) == Completed(h)


# --- plans: rows and prepped lists ------------------------------------------------------

HEADS, HEAD_BYTES = 2, 64


def producer_layout(buf: np.ndarray) -> KVLayout:
    """Two layers, FlashAttention packing (K then V), 16-token blocks, 32 blocks."""
    layer = 2 * 32 * 16 * HEADS * HEAD_BYTES
    bases = [buf.ctypes.data + 4096, buf.ctypes.data + 4096 + layer]
    return KVLayout(
        layer_regions(
            bases,
            num_blocks=32,
            tokens_per_block=16,
            num_heads=HEADS,
            head_bytes=HEAD_BYTES,
            memory=MemoryType.DRAM,
        )
    )


def consumer_layout(buf: np.ndarray) -> KVLayout:
    """Two layers, FlashInfer packing (K and V interleaved: regions overlap), 32-token blocks."""
    layer = 2 * 16 * 32 * HEADS * HEAD_BYTES
    bases = [buf.ctypes.data + 8192, buf.ctypes.data + 8192 + layer]
    return KVLayout(
        layer_regions(
            bases,
            num_blocks=16,
            tokens_per_block=32,
            num_heads=HEADS,
            head_bytes=HEAD_BYTES,
            packing="interleaved",
            memory=MemoryType.DRAM,
        )
    )


ROUTE = Route(Source(0), 0, HeadSlice(0, HEADS))
SRC_BLOCKS = [[3, 4, 9, 10, 11, 12, 20, 21]]  # 128 tokens, partly contiguous
DST_BLOCKS = [[7, 2, 3, 15]]


@pytest.fixture
def planned(make: Make) -> tuple[Rank, Rank, TransferPlanner]:
    prod = make("prefill", size=1 << 20, layout=producer_layout)
    cons = make("decode", size=1 << 20, layout=consumer_layout)
    connect(prod, cons)
    return prod, cons, TransferPlanner(prod.layout, cons.layout, ROUTE)


def test_consumer_layout_regions_overlap_and_register_as_one_span() -> None:
    buf = np.zeros(1 << 20, dtype=np.uint8)
    spans = layout_spans(consumer_layout(buf))
    assert len(spans) == 2  # K and V of each layer merged, layers touching but apart


def test_planned_write_by_rows_and_by_index_give_identical_bytes(
    planned: tuple[Rank, Rank, TransferPlanner],
) -> None:
    prod, cons, planner = planned
    plan = planner.plan(SRC_BLOCKS, DST_BLOCKS)
    assert plan.num_descriptors < plan.num_pieces  # merging happened
    fill(prod, 5)
    pump = Pump((prod, cons))
    h = prod.t.write("decode", plan.src, plan.dst, b"rows")
    assert pump.settle(prod, h).error is None
    pump.until(lambda: Notice("prefill", b"rows") in pump.notes.get("decode", []), "notice")
    by_rows = cons.buf.copy()
    assert cons.at(plan.dst) == prod.at(plan.src)

    cons.buf[:] = 0
    prod.t.prep(
        "decode", ("route", 0), planner.prepped(Role.PRODUCER), planner.prepped(Role.CONSUMER)
    )
    si, di = plan.indices()
    h = prod.t.write_prepped("decode", ("route", 0), si, di, b"index")
    assert pump.settle(prod, h).error is None
    pump.until(lambda: Notice("prefill", b"index") in pump.notes.get("decode", []), "notice")
    assert np.array_equal(cons.buf, by_rows)


def test_planned_read_by_rows_and_by_index_give_identical_bytes(
    planned: tuple[Rank, Rank, TransferPlanner],
) -> None:
    prod, cons, planner = planned
    plan = planner.plan(SRC_BLOCKS, DST_BLOCKS, skip_tokens=0)
    fill(prod, 9)
    pump = Pump((prod, cons))
    h = cons.t.read("prefill", plan.dst, plan.src)  # pull mode: the consumer initiates
    assert pump.settle(cons, h).error is None
    by_rows = cons.buf.copy()
    assert cons.at(plan.dst) == prod.at(plan.src)

    cons.buf[:] = 0
    cons.t.prep("prefill", "r", planner.prepped(Role.CONSUMER), planner.prepped(Role.PRODUCER))
    si, di = plan.indices()
    h = cons.t.read_prepped("prefill", "r", di, si)
    assert pump.settle(cons, h).error is None
    assert np.array_equal(cons.buf, by_rows)


def test_prefers_prepped_only_for_large_plans_that_merged_little(make: Make) -> None:
    t = make("a").t
    assert not t.prefers_prepped(2, 2048)  # contiguous: rows
    assert not t.prefers_prepped(128, 128)  # small: rows
    assert not t.prefers_prepped(2048, 2048)  # fragmented but small: rows
    assert t.prefers_prepped(32768, 32768)  # large and fragmented: by index
    assert t.prefers_prepped(16384, 32768)  # large, runs of two blocks: by index
    assert not t.prefers_prepped(8192, 32768)  # merged 4:1: rows


# --- peers: restart, removal, notices before add_peer -----------------------------------


def test_target_not_polling_stalls_the_write_until_it_polls(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    h = a.t.write("b", a.rows((0, 1 << 20)), b.rows((0, 1 << 20)), b"n")
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # only the initiator polls
        assert not a.t.poll()[0], "the write finished though its target never polled"
    pump = Pump((a, b))
    assert pump.settle(a, h) == Completed(h)


def test_peer_restart_fails_old_transfers_and_refuses_old_keys(make: Make) -> None:
    a, b1 = make("a"), make("b")
    connect(a, b1)
    a.t.prep("b", "k", a.rows((0, BLOCK)), b1.rows((0, BLOCK)))
    stuck = a.t.write("b", a.rows((0, 1 << 20)), b1.rows((0, 1 << 20)), b"old")  # b1 never polls
    assert not a.t.poll()[0]

    b2 = make("b")  # the same logical rank, restarted
    assert b2.t.nixl_agent_name != b1.t.nixl_agent_name
    assert a.t.add_peer(b2.t.metadata()) == "b"
    completed, _ = a.t.poll()
    assert len(completed) == 1 and completed[0].handle == stuck
    assert completed[0].error is not None and "restarted" in completed[0].error
    idx = np.array([0], dtype=np.int64)
    with pytest.raises(TransportError, match="not prepared for this instance"):
        a.t.write_prepped("b", "k", idx, idx, b"x")

    b2.t.add_peer(a.t.metadata())
    fill(a, 1)
    h = a.t.write("b", a.rows((0, 2 * BLOCK)), b2.rows((BLOCK, 2 * BLOCK)), b"new")
    pump = Pump((a, b1, b2))
    assert pump.settle(a, h) == Completed(h)
    pump.until(lambda: bool(pump.notes.get("b")), "the notice at the new instance")
    assert b2.at(b2.rows((BLOCK, 2 * BLOCK))) == a.at(a.rows((0, 2 * BLOCK)))
    a.t.prep("b", "k", a.rows((0, BLOCK)), b2.rows((0, BLOCK)))  # prepared anew: works
    assert pump.settle(a, a.t.write_prepped("b", "k", idx, idx, b"k")).error is None


def test_same_instance_again_is_a_no_op(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    h = a.t.write("b", a.rows((0, 1 << 20)), b.rows((0, 1 << 20)), b"n")
    assert a.t.add_peer(b.t.metadata()) == "b"
    assert Pump((a, b)).settle(a, h) == Completed(h)


def test_remove_peer_fails_posted_transfers_and_forgets_it(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    h = a.t.write("b", a.rows((0, 1 << 20)), b.rows((0, 1 << 20)), b"n")
    a.t.remove_peer("b")
    a.t.remove_peer("b")  # unknown now: a no-op
    completed, _ = a.t.poll()
    assert [c.handle for c in completed] == [h] and "removed" in str(completed[0].error)
    assert a.t.peers == ()
    with pytest.raises(TransportError, match="unknown peer"):
        a.t.write("b", a.rows((0, 8)), b.rows((0, 8)), b"n")


def test_notices_wait_for_their_senders_add_peer(make: Make) -> None:
    a, b = make("a"), make("b")
    assert a.t.add_peer(b.t.metadata()) == "b"  # b has not heard of a yet
    h = a.t.write("b", a.rows((0, BLOCK)), b.rows((0, BLOCK)), b"early")
    pump = Pump((a, b))
    pump.settle(a, h)
    for _ in range(50):
        pump.once()
    assert not pump.notes["b"]
    b.t.add_peer(a.t.metadata())
    pump.once()
    assert pump.notes["b"] == [Notice("a", b"early")]


def test_one_thread_posting_while_another_polls_does_not_hang(make: Make) -> None:
    """NIXL's default lock mode hung 3/3 here; the transport passes STRICT and locks."""
    a, b = make("a"), make("b")
    connect(a, b)
    handles: list[int] = []
    errors: list[BaseException] = []

    def post() -> None:
        try:
            for i in range(200):
                handles.append(a.t.write("b", a.rows((i * 64, 64)), b.rows((i * 64, 64)), b"n"))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    pump = Pump((a, b))
    pump.until(lambda: len(pump.notes.get("b", [])) == 200 and not thread.is_alive(), "200")
    thread.join(1)
    assert not errors
    pump.until(lambda: len(pump.done.get("a", [])) == 200, "200 completions")
    assert sorted(c.handle for c in pump.done["a"]) == sorted(handles)


def test_progress_thread_on_still_works(make: Make) -> None:
    a, b = make("a", progress_thread=True), make("b", progress_thread=True)
    connect(a, b)
    fill(a, 2)
    h = a.t.write("b", a.rows((0, 1 << 20)), b.rows((0, 1 << 20)), b"n")
    pump = Pump((a, b))
    assert pump.settle(a, h) == Completed(h)
    assert b.at(b.rows((0, 1 << 20))) == a.at(a.rows((0, 1 << 20)))


# --- refusals ----------------------------------------------------------------------------


def test_refusals_raise_before_anything_is_posted(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    ok_l, ok_r = a.rows((0, BLOCK)), b.rows((0, BLOCK))
    bad_rows = {
        "an \\(N, 3\\) array": np.zeros((2, 2), dtype=np.uint64),
        "non-negative integers": np.array([[a.buf.ctypes.data, 8, 0]], dtype=np.float64),
        "length 0": a.rows((0, 0)),
    }
    for message, rows in bad_rows.items():
        with pytest.raises(TransportError, match=message):
            a.t.write("b", rows, ok_r, b"n")
    with pytest.raises(TransportError, match="differ in count or lengths"):
        a.t.write("b", a.rows((0, BLOCK)), b.rows((0, BLOCK - 1)), b"n")
    with pytest.raises(TransportError, match=r"rows of 'b' row 1 .* not inside"):
        a.t.write("b", a.rows((0, 8), (8, 8)), b.rows((0, 8), (SIZE - 4, 8)), b"n")
    with pytest.raises(TransportError, match=r"local rows row 0 .* device 3"):
        a.t.read("b", np.array([[a.buf.ctypes.data, 8, 3]], dtype=np.uint64), b.rows((0, 8)))
    with pytest.raises(TransportError, match="unknown peer"):
        a.t.write("c", ok_l, ok_r, b"n")
    for notice in ("str", b"x" * (1 << 17)):
        with pytest.raises(TransportError, match="notice must be"):
            a.t.write("b", ok_l, ok_r, notice)  # type: ignore[arg-type]
    idx = np.array([0], dtype=np.int64)
    with pytest.raises(TransportError, match="not prepared"):
        a.t.write_prepped("b", "nope", idx, idx, b"n")
    with pytest.raises(TransportError, match="hashable"):
        a.t.prep("b", [], ok_l, ok_r)
    a.t.prep("b", "k", a.rows((0, BLOCK), (BLOCK, 8)), b.rows((0, BLOCK), (BLOCK, 16)))
    for li, ri, message in (
        (np.array([2]), idx, r"local indices must lie in \[0, 2\)"),
        (idx, np.array([-1]), "remote indices must lie"),
        (np.array([0.0]), idx, "1-D integer array"),
        (np.array([0, 1]), idx, "2 local indices but 1"),
        (np.array([1]), np.array([1]), "entry 0: local row 1 is 8 bytes, remote row 1 16"),
    ):
        with pytest.raises(TransportError, match=message):
            a.t.write_prepped("b", "k", li, ri, b"n")
    assert Pump((a, b)).settle(a, a.t.write("b", ok_l, ok_r, b"n")).error is None  # all fine


def test_malformed_metadata_changes_nothing(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    md = msgpack.unpackb(b.t.metadata())
    cases: dict[str, Any] = {
        "malformed": b"\xc1garbage",
        "wrong kind": msgpack.packb({**md, "kind": "kvpush.shm"}),
        "keys": msgpack.packb({**{k: v for k, v in md.items() if k != "mem"}, "extra": 1}),
        "version": msgpack.packb({**md, "version": 2}),
        "bad instance": msgpack.packb({**md, "instance": b"x"}),
        "bad mem entry": msgpack.packb({**md, "mem": [["HBM", 0, 1, 1]]}),
        "refused the peer's metadata": msgpack.packb(
            {**md, "instance": b"\x01" * 8, "nixl": b"\x00" * 64}
        ),
        "own agent": a.t.metadata(),
        "must be bytes": "text",
    }
    for message, blob in cases.items():
        with pytest.raises(TransportError, match=message):
            a.t.add_peer(blob)
        assert a.t.peers == ("b",)
    spoofed = msgpack.packb({**md, "agent": "z"})  # NIXL's metadata still names b's agent
    with pytest.raises(TransportError, match="NIXL metadata names agent"):
        a.t.add_peer(spoofed)
    elsewhere = KVLayout((Region(**{**_region_kwargs(b.layout), "base": 16}),))
    with pytest.raises(TransportError, match="not in memory its metadata registers"):
        a.t.add_peer(b.t.metadata(), elsewhere)
    assert a.t.peers == ("b",)
    assert (
        Pump((a, b)).settle(a, a.t.write("b", a.rows((0, 8)), b.rows((0, 8)), b"n")).error is None
    )


def _region_kwargs(layout: KVLayout) -> dict[str, Any]:
    r = layout.regions[0]
    return {f: getattr(r, f) for f in Region.__dataclass_fields__}


def test_register_and_metadata_order() -> None:
    t = NixlTransport("lonely")
    try:
        with pytest.raises(TransportError, match=r"register\(\) the KV layout before metadata"):
            t.metadata()
        buf = np.zeros(SIZE, dtype=np.uint8)
        t.register(flat_layout(buf))
        t.register(flat_layout(buf))  # equal: a no-op
        with pytest.raises(TransportError, match="different KV layout"):
            t.register(flat_layout(buf[BLOCK:]))
    finally:
        t.close()


def test_closed_transport_refuses_everything(make: Make) -> None:
    a, b = make("a"), make("b")
    connect(a, b)
    h = a.t.write("b", a.rows((0, 1 << 20)), b.rows((0, 1 << 20)), b"n")  # still posted
    with a.t as t:
        assert t is a.t
    a.t.close()  # idempotent
    assert a.t.closed and h
    rows = a.rows((0, 8))
    idx = np.array([0])
    for call in (
        a.t.poll,
        a.t.metadata,
        lambda: a.t.register(a.layout),
        lambda: a.t.add_peer(b.t.metadata()),
        lambda: a.t.write("b", rows, rows, b"n"),
        lambda: a.t.read("b", rows, rows),
        lambda: a.t.prep("b", "k", rows, rows),
        lambda: a.t.write_prepped("b", "k", idx, idx, b"n"),
        lambda: a.t.read_prepped("b", "k", idx, idx),
    ):
        with pytest.raises(TransportError, match="is closed"):
            call()
    a.t.remove_peer("b")  # quietly nothing
    assert not b.t.poll()[0]


def test_constructor_misuse_is_a_config_error() -> None:
    for kwargs in (
        {"agent": ""},
        {"agent": "x" * 300},
        {"agent": "a", "backends": "UCX"},
        {"agent": "a", "backends": ()},
        {"agent": "a", "backends": ("UCX", "UCX")},
        {"agent": "a", "backend_params": {"LIBFABRIC": {}}},
        {"agent": "a", "backend_params": {"UCX": {"num_threads": 1.5}}},
        {"agent": "a", "progress_thread": 1},
        {"agent": "a", "sync_mode": "NONE"},
        {"agent": "a", "close_timeout": -1},
    ):
        with pytest.raises(ConfigError):
            NixlTransport(**kwargs)


def test_backend_params_pass_through_and_unknown_backends_are_refused() -> None:
    params = {"UCX": {"num_workers": 1, "ucx_error_handling_mode": "peer"}}
    with NixlTransport("a", backend_params=params) as t:
        got = t.backend_params("UCX")
        assert got["num_workers"] == "1" and got["ucx_error_handling_mode"] == "peer"
    with pytest.raises(TransportError, match="no 'NOPE' plugin"):
        NixlTransport("a", backends=("NOPE",))


def test_vram_spans_only_need_a_type_and_a_device() -> None:
    """CI has no GPU: check the VRAM path up to NIXL (types, devices, bounds)."""
    mem = MemoryMap((Span("DRAM", 0, 1 << 20, 1 << 20), Span("VRAM", 1, 1 << 40, 1 << 30)))
    vram = np.array([[(1 << 40) + 64, 4096, 1]], dtype=np.uint64)
    dram = np.array([[(1 << 20) + 64, 4096, 0]], dtype=np.uint64)
    assert mem.classify(vram, "rows") == "VRAM" and mem.classify(dram, "rows") == "DRAM"
    with pytest.raises(TransportError, match="mix DRAM and VRAM"):
        mem.classify(np.concatenate([vram, dram]), "rows")
    with pytest.raises(TransportError, match="device 0"):
        mem.classify(np.array([[(1 << 40) + 64, 4096, 0]], dtype=np.uint64), "rows")
    buf = np.zeros(SIZE, dtype=np.uint8)
    layout = flat_layout(buf, MemoryType.VRAM)
    assert layout_spans(layout) == (Span("VRAM", 0, buf.ctypes.data, SIZE),)


def test_import_without_nixl_fails_only_at_construction() -> None:
    code = (
        "import sys; sys.modules['nixl'] = None; sys.modules['nixl._api'] = None\n"
        "import kvpush_nixl\n"
        "try:\n"
        "    kvpush_nixl.NixlTransport('a')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.startswith("TransportError NIXL is not installed")
    assert "pip install --no-deps nixl nixl-cu12" in out.stdout
    assert "pip install 'kvpush[nixl]'" in out.stdout


# --- a peer killed mid-transfer (child processes) ------------------------------------------


def _victim(conn: Connection) -> None:
    """Registers memory, hands over its metadata, then never polls."""
    buf = np.zeros(SIZE, dtype=np.uint8)
    t = NixlTransport("victim")
    t.register(flat_layout(buf))
    conn.send((t.metadata(), buf.ctypes.data))
    conn.recv()  # blocks until killed


def _killer(report: Connection) -> None:
    """The initiator, in its own process: UCX may abort at exit after a peer dies."""
    results: dict[str, Any] = {}
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    victim = ctx.Process(target=_victim, args=(theirs,), daemon=True)
    victim.start()
    buf = np.ones(SIZE, dtype=np.uint8)
    t = NixlTransport("killer")
    t.register(flat_layout(buf))
    if not mine.poll(30):
        report.send({"error": "the victim did not start"})
        os._exit(1)
    md, base = mine.recv()
    t.add_peer(md)
    src = np.array([[buf.ctypes.data, 1 << 20, 0]], dtype=np.uint64)
    dst = np.array([[base, 1 << 20, 0]], dtype=np.uint64)
    h = t.write("victim", src, dst, b"n")
    results["stalled"] = not t.poll()[0]
    os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
    victim.join(10)
    t0 = time.monotonic()
    while time.monotonic() - t0 < DEADLINE_S and "settled" not in results:
        for c in t.poll()[0]:
            results["settled"] = (c.handle == h, c.error)
    results["settle_s"] = time.monotonic() - t0
    try:  # posting again: refused now, or posted and failed soon
        t.write("victim", src, dst, b"n")
        while time.monotonic() - t0 < 2 * DEADLINE_S and "again" not in results:
            for c in t.poll()[0]:
                results["again"] = c.error
    except TransportError as exc:
        results["again"] = f"refused: {exc}"
    t.close()
    results["closed"] = True
    report.send(results)
    report.close()
    os._exit(0)  # skip UCX's exit-time teardown, which may abort after a peer died


def test_peer_killed_mid_transfer_reports_an_error_never_hangs() -> None:
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_killer, args=(theirs,))  # not a daemon: it has a child
    proc.start()
    try:
        end = time.monotonic() + 60
        while not mine.poll(0.1):
            assert proc.is_alive(), f"the initiator process died (exit code {proc.exitcode})"
            assert time.monotonic() < end, "the initiator process reported nothing in 60 s"
        results = mine.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert results.get("stalled") is True, results
    same, error = results["settled"]
    assert same and error, results
    assert results["settle_s"] < 5, results
    assert results["again"], results
    assert results["closed"], results


class _Releases:
    """A NIXL agent stand-in that can or cannot release a running transfer."""

    def __init__(self, can: bool) -> None:
        self.can = can

    def release(self, xfer: object) -> bool:
        return self.can

    def state(self, xfer: object) -> str:
        return "PROC"  # it never settles on its own


@pytest.mark.parametrize("can", [True, False])
def test_a_cancel_fails_a_transfer_only_once_nixl_released_it(can: bool) -> None:
    """Issue 28: a transfer NIXL never settles is reported failed only once
    NIXL released (cancelled) it; one NIXL cannot release stays posted."""
    from kvpush_nixl._books import Transfers

    books = Transfers(_Releases(can))  # type: ignore[arg-type]
    handle = books.track(object(), "peer")  # type: ignore[arg-type]
    assert books.cancel(handle) is can
    completed = books.poll()
    if can:
        assert [c.handle for c in completed] == [handle] and completed[0].error
        assert len(books) == 0
        assert books.cancel(handle) is True  # settled: nothing to cancel
    else:
        assert completed == [] and len(books) == 1
