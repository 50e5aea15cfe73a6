"""Frame-level fuzz against a live runtime pair (issue 7).

A producer ("prefill") and a consumer ("decode") run for real: their pumps,
the TCP control channel on loopback and the shared-memory data plane, with
lanes of transfers whose bytes are checked. Meanwhile a fuzzer opens raw TCP
connections to both control ports and sends random bytes, preambles that are
wrong (unsealed, sealed with another key, claiming a live peer's name), and
behind a valid preamble: random frames, real frames after random edits (bit
flips, truncation, extension, splices, byte sets, edited length prefixes, ids
and epochs swapped for live ones), and well-formed messages naming live
transfers from a peer that is not their owner. With and without a secret.

The fuzzer knows exactly what it sent, so :func:`expect` replays the channel's
reader over the same bytes and the test checks the channel's counters (and its
log lines) against that *exactly*: every rejected handshake and frame counted
and logged once. The transfers must all end as a fuzz-free run ends them:
``Ready`` with the right bytes, and ``delivered`` on the producer. One
exception, told apart exactly: the pair, the fuzzer and the lanes share one
event loop, and on a loaded machine that loop can miss more than half of
``max_transit``. Then, as they must, the pump's StallWatch drops the
``Register`` frames it handles during or just after the gap, and the sending
channel drops frames that waited in its queue over ``max_age`` (a frame read
late, or a lease measured from a late receipt, is unsafe). :class:`Tap` sees
every frame each pump hands to its channel for the other and every frame the
other pump handles (and whether its StallWatch dropped it): a transfer may
fail only if one of its frames was lost so, and the frames lost between the
channels must be within their ``dropped_old`` counts.

:func:`run_fuzz` is shared with ``benchmarks/fuzz_frames.py`` (the long run).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import struct
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.abc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_runtime import HEADS, Side, check, fill, rank_layout, region_view

from kvpush.protocol import (
    Abort,
    Announce,
    Codec,
    Consumer,
    ConsumerConfig,
    ControlMessage,
    Event,
    Failed,
    FailureReason,
    Heartbeat,
    Hello,
    HelloReject,
    Identity,
    Mode,
    Producer,
    ProducerConfig,
    PState,
    ReadDone,
    Ready,
    Register,
    Rejected,
    RejectReason,
    Released,
    RemoteProtocolError,
    Reserved,
    Role,
    Settled,
    Source,
    SourceReleased,
    Withdraw,
    WriteFailed,
)
from kvpush.runtime import (
    ConsumerRuntime,
    ControlChannel,
    DataPlane,
    ProducerRuntime,
    Rank,
    Received,
    encode_rank,
)
from kvpush.runtime._framing import MAX_HANDSHAKE_BYTES, Preamble, encode_frame, seal, unseal
from kvpush.shm import ShmTransport

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"
SECRET = b"frame-fuzz-shared-secret-0123456789"
OTHER_SECRET = b"some-other-secret-of-16+-bytes"
TOKENS, LANE_BLOCKS, LANES = 16, 4, 4
#: How long a lane waits for progress on one transfer: more than the consumer's
#: ready_timeout plus its quarantine, and the producer's kv_hold_timeout (30 s).
LANE_TIMEOUT = 90.0
CHANNEL_LOG = "kvpush.runtime.channel"


# asyncio only, for the suite's time: it passes on trio too (tests/conftest.py's
# BACKENDS; drop this fixture to run both). The runtime's trio run is test_runtime.py.
@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --- the live pair ---------------------------------------------------------------------


class Tap:
    """What the pump sees of a :class:`ControlChannel`; tells the harness how the
    pump handled each event, once it is done with it: ``handled(event, dropped)``,
    ``dropped`` when the pump's StallWatch dropped it (the only way the pump
    drops a ``Register``; a hello it drops is counted in ``bad_hellos``)."""

    def __init__(self, channel: ControlChannel, peer: str) -> None:
        self.channel = channel
        self.peer = peer  # the real peer
        self.runtime: ProducerRuntime | ConsumerRuntime | None = None
        self.handled: Callable[[object, bool], None] = lambda ev, dropped: None
        self.before: Callable[[object], None] = lambda ev: None
        self.stall_dropped = 0  # must end equal to the runtime's watch.dropped
        #: Frames about each transfer handed to the channel for the real peer,
        #: those from it that the pump handled, and those its StallWatch dropped.
        self.sent: Counter[str] = Counter()
        self.got: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()

    def send_nowait(self, peer: str, message: ControlMessage) -> None:
        self.channel.send_nowait(peer, message)
        tid = getattr(message, "transfer_id", None)
        if peer == self.peer and tid is not None:
            self.sent[tid] += 1

    async def events(self) -> AsyncIterator[object]:
        assert self.runtime is not None
        watch = self.runtime.watch
        async for ev in self.channel.events():
            self.before(ev)
            before = watch.dropped
            yield ev
            # Resumed for the next event: the pump's loop body (no await in it)
            # has handled this one.
            dropped = watch.dropped > before
            self.stall_dropped += dropped
            if isinstance(ev, Received) and ev.peer == self.peer:
                tid = getattr(ev.message, "transfer_id", None)
                if tid is not None:
                    (self.dropped if dropped else self.got)[tid] += 1
            self.handled(ev, dropped)


async def start_side(
    stack: AsyncExitStack, role: Role, name: str, codec: Codec, ready_timeout: float = 30.0
) -> Side:
    """One side of test_runtime's kind (TP1, verifying shared memory), pumping;
    its runtime's channel is a :class:`Tap`."""
    layout = rank_layout(1, 0, TOKENS)
    size = max(r.base + r.num_blocks * r.stride for r in layout.regions)
    transport = ShmTransport(f"{name}-r0", size, verify=True)
    stack.callback(transport.close)
    dataplane = DataPlane(role, {0: Rank(transport, layout)}, 1, codec)
    blob = encode_rank(transport.metadata(), layout)
    identity = Identity(name, 9, tp=1, num_kv_heads=HEADS, layout=layout, ranks=(blob,))
    channel = await stack.enter_async_context(ControlChannel(name, codec))
    port = await channel.listen(HOST, 0)
    tap = Tap(channel, "decode" if role is Role.PRODUCER else "prefill")
    runtime: ProducerRuntime | ConsumerRuntime
    if role is Role.PRODUCER:
        runtime = ProducerRuntime(Producer(ProducerConfig(identity)), tap, dataplane)
    else:
        config = ConsumerConfig(identity, ready_timeout=ready_timeout)
        runtime = ConsumerRuntime(Consumer(config), tap, dataplane)
    tap.runtime = runtime
    tg = await stack.enter_async_context(anyio.create_task_group())
    await tg.start(runtime.run)
    stack.callback(tg.cancel_scope.cancel)
    return Side(runtime, [transport], [layout], port)


@dataclass
class Live:
    """The pair, the transfers' events by id, and what the fuzzer may name."""

    prod: Side
    cons: Side
    codec: Codec
    events: dict[str, list[Event]] = field(default_factory=dict)
    #: (transfer id, epoch) of transfers the producer knows as decode's.
    live: list[tuple[str, int]] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)
    #: Registers from decode the producer's pump handled: transfer id -> whether
    #: its StallWatch dropped the frame.
    arrived: dict[str, bool] = field(default_factory=dict)
    waiters: dict[str, anyio.Event] = field(default_factory=dict)

    def poke(self, tid: str) -> None:
        """Something happened to ``tid``: wake whoever waits on it."""
        waiter = self.waiters.pop(tid, None)
        if waiter is not None:
            waiter.set()

    async def wait(self, tid: str, pred: Callable[[], bool], what: str) -> None:
        """Until ``pred()``, re-checked whenever ``tid`` is poked (no polling)."""
        with anyio.move_on_after(LANE_TIMEOUT):
            while not pred():
                await self.waiters.setdefault(tid, anyio.Event()).wait()
        assert pred(), f"{what}: no progress in {LANE_TIMEOUT} s"

    def tap(self, s: Side) -> Tap:
        tap = s.runtime.channel
        assert isinstance(tap, Tap)
        return tap

    @property
    def producer(self) -> ProducerRuntime:
        assert isinstance(self.prod.runtime, ProducerRuntime)
        return self.prod.runtime

    @property
    def consumer(self) -> ConsumerRuntime:
        assert isinstance(self.cons.runtime, ConsumerRuntime)
        return self.cons.runtime

    def channel(self, s: Side) -> ControlChannel:
        return self.tap(s).channel

    def handled(self, ev: object, dropped: bool) -> None:
        """The producer's pump handled ``ev``."""
        if isinstance(ev, Received) and isinstance(ev.message, Register) and ev.peer == "decode":
            self.arrived.setdefault(ev.message.transfer_id, dropped)
            self.poke(ev.message.transfer_id)


@asynccontextmanager
async def live_pair(secret: bytes | None, ready_timeout: float = 30.0) -> AsyncIterator[Live]:
    codec = Codec(secret=secret)
    async with AsyncExitStack() as stack:
        prod = await start_side(stack, Role.PRODUCER, "prefill", codec)
        cons = await start_side(stack, Role.CONSUMER, "decode", codec, ready_timeout)
        pair = Live(prod, cons, codec)
        pair.tap(prod).handled = pair.handled
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        for s in (prod, cons):
            tg.start_soon(collect, pair, s)
        pair.channel(cons).add_route("prefill", HOST, prod.port)
        for j in range(LANES):  # each lane's source blocks hold tokens 0, 1, ...
            fill(prod, list(range(j * LANE_BLOCKS, (j + 1) * LANE_BLOCKS)))
        yield pair


async def collect(pair: Live, s: Side) -> None:
    while True:
        for e in await s.runtime.next_events(1.0):
            tid = getattr(e, "transfer_id", None)
            if tid is not None:
                pair.events.setdefault(tid, []).append(e)
                pair.poke(tid)


async def until(pred: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not pred():
            await anyio.sleep(0.002)
    assert pred(), what


async def one_transfer(pair: Live, lane: int, n: int, rng: random.Random) -> None:
    """Reserve, wait until the producer's pump handled decode's registration
    (from then on the fuzzer names it), publish, check the bytes and both sides'
    outcomes. Waits are woken by the transfer's events, never by polling."""
    tid = f"t{lane}-{n}-{rng.getrandbits(48):012x}"
    src = list(range(lane * LANE_BLOCKS, (lane + 1) * LANE_BLOCKS))
    dst = [LANES * LANE_BLOCKS + b for b in src]
    for t, layout in zip(pair.cons.transports, pair.cons.layouts, strict=True):
        for r in layout.regions:
            region_view(t.memory, r)[dst] = 0
    events = pair.events.setdefault(tid, [])
    reserved = pair.consumer.reserve(tid, "prefill", [dst])
    assert isinstance(reserved, Reserved), reserved
    # The registration reaches the producer's pump, or the consumer ends the
    # transfer without it (if the frame never came: a failure the checks report).
    await pair.wait(tid, lambda: tid in pair.arrived or any_of(events, Released), f"{tid} sent")
    if pair.arrived.get(tid) is False:
        assert pair.producer.endpoint.timeline(tid) is not None, tid  # registered
        pair.live.append((tid, reserved.epoch))
        pair.producer.kv_ready(tid, [src])
        await pair.wait(tid, lambda: ended(events), f"{tid} ended")
        kinds = sorted(type(e).__name__ for e in events)
        released = [e for e in events if isinstance(e, SourceReleased)]
        if kinds == ["Ready", "SourceReleased"]:
            check(pair.cons, dst)
        pair.outcomes[tid] = f"{'+'.join(kinds)}:{released[0].outcome.value}"
        return
    # The producer never took the registration (its StallWatch dropped it, when
    # arrived[tid]): the consumer alone ends the transfer, at its deadline.
    await pair.wait(tid, lambda: any_of(events, Released), f"{tid} released")
    kinds = sorted(type(e).__name__ for e in events)
    reasons = [e.reason.value for e in events if isinstance(e, Failed)]
    pair.outcomes[tid] = f"{'+'.join(kinds)}:{','.join(reasons)}"


def any_of(events: list[Event], kind: type) -> bool:
    return any(isinstance(e, kind) for e in events)


def ended(events: list[Event]) -> bool:
    """Both sides are done with the transfer (the producer may release first)."""
    done = (Ready, Failed, Released)
    return any(isinstance(e, SourceReleased) for e in events) and any(
        isinstance(e, done) for e in events
    )


async def lanes(pair: Live, stop: anyio.Event, seed: int) -> None:
    async def lane(j: int) -> None:
        rng = random.Random(seed * 1000 + j)
        n = 0
        while not stop.is_set():
            await one_transfer(pair, j, n, rng)
            n += 1

    async with anyio.create_task_group() as tg:
        for j in range(LANES):
            tg.start_soon(lane, j)


# --- what the channel must make of the fuzzer's bytes ----------------------------------


@dataclass
class Tally:
    """Per target port: what was sent, and what the channel must count."""

    sent: Counter[str] = field(default_factory=Counter)  # connections by kind
    #: Frames by kind: each connection's first frame (or its random bytes) and the rest.
    sent_frames: Counter[str] = field(default_factory=Counter)
    frames: int = 0
    handshake_failures: int = 0
    garbage: int = 0
    dropped: int = 0  # connections the channel must drop for a framing error
    delivered: int = 0  # frames that decode (the endpoint gets them)


def split_frames(data: bytes, limit: int) -> tuple[list[bytes], int, bool]:
    """The channel's reader over ``data`` then EOF: the whole frames, the bytes
    they took, and whether a length prefix over ``limit`` ended the stream."""
    out: list[bytes] = []
    i = 0
    while len(data) - i >= 4:
        (n,) = struct.unpack_from(">I", data, i)
        if n > limit:
            return out, i, True
        if len(data) - i - 4 < n:
            break
        out.append(data[i + 4 : i + 4 + n])
        i += 4 + n
    return out, i, False


def expect(data: bytes, codec: Codec, tally: Tally, kind: str) -> None:
    """Add to ``tally`` what one connection carrying ``data`` must cost."""
    tally.sent[kind] += 1
    tally.sent_frames[kind] += 1
    hs, _, _ = split_frames(data, MAX_HANDSHAKE_BYTES)
    try:
        if not hs:
            raise RemoteProtocolError("no preamble")
        Preamble.decode(unseal(hs[0], codec))
    except RemoteProtocolError:
        tally.handshake_failures += 1
        return
    body = data[4 + len(hs[0]) :]
    frames, _, oversized = split_frames(body, codec.limits.max_frame_bytes)
    tally.frames += len(frames)
    tally.sent_frames[kind] += len(frames) + oversized
    for f in frames:
        try:
            codec.decode(f)
        except RemoteProtocolError:
            tally.garbage += 1
        else:
            tally.delivered += 1
    if oversized:
        tally.garbage += 1
        tally.dropped += 1


# --- the fuzzer ------------------------------------------------------------------------


class Fuzzer:
    """Builds one connection's bytes at a time; ``codec`` is the pair's."""

    def __init__(self, pair: Live, rng: random.Random, burst: int = 12) -> None:
        self.pair = pair
        self.burst = burst  # at most this many random or edited frames a connection
        self.codec = pair.codec
        self.rng = rng
        self.outsiders = [Codec(secret=OTHER_SECRET)]
        if self.codec.authenticated:
            self.outsiders.append(Codec())
        self.n = 0

    def name(self) -> str:
        self.n += 1
        return f"fz-{self.n}"

    def preamble(self, name: str) -> bytes:
        pre = Preamble(name, self.rng.getrandbits(64), self.rng.getrandbits(64) | 1)
        return encode_frame(seal(pre.encode(), self.codec))

    def live_ids(self) -> list[tuple[str, int]]:
        return self.pair.live[-16:] or [("t0-0-000000000000", 1)]

    def valid_messages(self, target: Side, me: str) -> list[ControlMessage]:
        """Well-formed messages naming live transfers, sent by ``me`` (not their owner)."""
        r = self.rng
        tid, epoch = r.choice(self.live_ids())
        epoch = r.choice([epoch, epoch + 1, max(0, epoch - 1), 2**63 - 1])
        blocks = (tuple(sorted(set(r.sample(range(32), 4)))),)
        hello = self.hello_for(target, me)
        msgs: list[ControlMessage] = [
            Register(tid, epoch, r.choice([me, "decode"]), blocks, 5.0, Mode.PUSH, 0),
            Withdraw(tid, epoch),
            Abort(tid, epoch),
            ReadDone(tid, epoch, r.random() < 0.5),
            Settled(tid, epoch),
            Rejected(tid, epoch, r.choice(list(RejectReason))),
            WriteFailed(tid, epoch, Source(0, 0), 0, "forged"),
            Announce(tid, epoch, blocks, 5.0),
            Heartbeat(r.getrandbits(64)),
            HelloReject("tp", "forged"),
        ]
        if hello is not None:
            # The real peer's hello (its name inside: refused), or one under our
            # own name, which makes us a ready peer whose messages name live
            # transfers that are not ours.
            msgs.append(hello)
            msgs.append(dataclasses.replace(hello, engine_id=me, instance=r.getrandbits(64)))
        return msgs

    def hello_for(self, target: Side, me: str) -> Hello | None:
        """The hello of ``target``'s real peer, as ``target`` received it."""
        other = "decode" if target is self.pair.prod else "prefill"
        return target.runtime.endpoint.peer(other).hello

    def mutate(self, frame: bytes, pool: list[bytes]) -> bytes:
        r = self.rng
        b = bytearray(frame)
        op = r.randrange(7)
        if op == 0 and b:
            for _ in range(r.randint(1, 4)):
                i = r.randrange(len(b))
                b[i] ^= 1 << r.randrange(8)
        elif op == 1:
            del b[r.randrange(len(b) + 1) :]
        elif op == 2:
            b += r.randbytes(r.randint(1, 40))
        elif op == 3:
            other = r.choice(pool)
            b = b[: r.randrange(len(b) + 1)] + other[r.randrange(len(other) + 1) :]
        elif op == 4 and b:
            for _ in range(r.randint(1, 3)):
                b[r.randrange(len(b))] = r.randrange(256)
        elif op == 5 and len(b) > 6:
            # The message type or flags byte.
            b[r.choice([3, 4, 5])] = r.randrange(256)
        elif len(b) > 8:
            # A msgpack length or header inside the body.
            i = r.randrange(6, len(b))
            b[i] = r.choice([0x90, 0x9F, 0xC4, 0xC5, 0xDC, 0xDD, 0xD9, 0xCF, 0xC0, 0xFF])
        return bytes(b)

    def framed(self, payloads: list[bytes]) -> bytes:
        """Frame ``payloads``; now and then with a wrong length prefix, or ending
        in one over the limit (which must drop the connection)."""
        r = self.rng
        out = bytearray()
        for p in payloads:
            if r.random() < 0.05:
                n = max(0, len(p) + r.choice([-3, -1, 1, 2, 7]))
                out += struct.pack(">I", n) + p
            else:
                out += encode_frame(p)
        if r.random() < 0.1:
            out += struct.pack(">I", r.randrange(self.codec.limits.max_frame_bytes + 1, 1 << 32))
            out += r.randbytes(r.randint(0, 64))
        return bytes(out)

    def connection(self, target: Side) -> tuple[str, bytes]:
        """One connection's kind and bytes."""
        r = self.rng
        kind = r.choice(["random", "outsider", "random_frames", "mutated", "valid"])
        me = self.name()
        if kind == "random":
            return kind, r.randbytes(r.randint(0, 300))
        if kind == "outsider":
            # A preamble without the secret (or, without one, sealed with a key):
            # under a new name, or the name of the target's live peer.
            who = r.choice([me, "decode" if target is self.pair.prod else "prefill"])
            pre = Preamble(who, r.getrandbits(64), r.getrandbits(64) | 1).encode()
            if not self.codec.authenticated:
                who = me
                pre = Preamble(who, r.getrandbits(64), r.getrandbits(64) | 1).encode()
                pre = seal(pre, r.choice(self.outsiders))
            else:
                pre = seal(pre, r.choice(self.outsiders))
            frames = [self.codec.encode(m) for m in self.valid_messages(target, who)]
            return kind, encode_frame(pre) + b"".join(encode_frame(f) for f in frames)
        head = self.preamble(me)
        valid = self.valid_messages(target, me)
        if kind == "random_frames":
            payloads = [r.randbytes(r.randint(0, 200)) for _ in range(r.randint(1, self.burst))]
            if r.random() < 0.5:  # a real header before the junk
                payloads = [
                    b"KVP\x01" + bytes([r.randint(1, 11), r.choice([0, 1])]) + p for p in payloads
                ]
            return kind, head + self.framed(payloads)
        pool = [self.codec.encode(m) for m in valid]
        pool += [r.choice(self.outsiders).encode(m) for m in r.sample(valid, 3)]
        if kind == "mutated":
            # Not our own-name hello: one that decodes with a broken rank blob
            # crashes the pump (test_a_malformed_rank_blob_..., xfail below).
            pool = [f for f, m in zip(pool, valid, strict=False) if not own_hello(m, me)]
            payloads = [self.mutate(r.choice(pool), pool) for _ in range(r.randint(1, self.burst))]
            return kind, head + self.framed(payloads)
        # "valid": well-formed frames naming live transfers, in a random order.
        pool *= r.randint(1, max(1, self.burst // len(pool)))
        r.shuffle(pool)
        return kind, head + b"".join(encode_frame(f) for f in pool)


def own_hello(m: ControlMessage, me: str) -> bool:
    return isinstance(m, Hello) and m.engine_id == me


async def send_connection(port: int, data: bytes) -> None:
    """Send ``data``, half-close, and read until the channel closes (so it has
    read everything before we go: a close with unread data would reset)."""
    with anyio.fail_after(10):
        stream = await anyio.connect_tcp(HOST, port)
        async with stream:
            try:
                await stream.send(data)
                await stream.send_eof()
                while True:
                    await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                pass


@dataclass
class FuzzReport:
    tallies: dict[str, Tally]
    seconds: float
    connections: int


async def fuzz(
    pair: Live,
    rng: random.Random,
    *,
    connections: int | None,
    seconds: float | None,
    workers: int = 3,
    max_frames: int | None = None,
    burst: int = 12,
) -> FuzzReport:
    """Run fuzz connections against both control ports until a budget is spent."""
    fz = Fuzzer(pair, rng, burst)
    tallies = {"prefill": Tally(), "decode": Tally()}
    started = time.monotonic()
    count = 0

    def more() -> bool:
        if connections is not None and count >= connections:
            return False
        if seconds is not None and time.monotonic() - started >= seconds:
            return False
        frames = sum(t.sent_frames.total() for t in tallies.values())
        return max_frames is None or frames < max_frames

    async def worker() -> None:
        nonlocal count
        while more():
            count += 1
            target = rng.choice([pair.prod, pair.cons])
            name = "prefill" if target is pair.prod else "decode"
            kind, data = fz.connection(target)
            expect(data, pair.codec, tallies[name], kind)
            await send_connection(target.port, data)

    async with anyio.create_task_group() as tg:
        for _ in range(workers):
            tg.start_soon(worker)
    return FuzzReport(tallies, time.monotonic() - started, count)


async def settle(pair: Live, tallies: dict[str, Tally]) -> None:
    """Wait until each channel counted what it must, then check it stays there."""
    for s in (pair.prod, pair.cons):
        ch, t = pair.channel(s), tallies[pair.channel(s).name]
        await until(
            lambda ch=ch, t=t: (  # type: ignore[misc]
                ch.statistics().garbage >= t.garbage
                and ch.statistics().handshake_failures >= t.handshake_failures
            ),
            f"{ch.name} counted",
        )
    await anyio.sleep(0.2)
    for s in (pair.prod, pair.cons):
        ch = pair.channel(s)
        stats, t = ch.statistics(), tallies[ch.name]
        assert (stats.garbage, stats.handshake_failures) == (t.garbage, t.handshake_failures), (
            ch.name,
            stats,
            t,
        )


@dataclass
class RunResult:
    report: FuzzReport
    outcomes: dict[str, str]
    dataplane_errors: list[BaseException | None]
    #: Transfers that lost a frame between the pair's pumps: how many.
    lost_frames: dict[str, int]
    #: Gaps over the stall limit the pumps noticed (they share one event loop).
    stalls: int
    #: Frames the pumps' StallWatches dropped (fuzz ones included), and frames
    #: between the pair the channels dropped as too old.
    watch_dropped: int
    dropped_old: int


#: How a transfer whose registration the producer's stall rule dropped ends:
#: refused at once (Rejected(STALLED)), not at its deadline.
STALLED = f"Failed+Released:{FailureReason.REJECTED.value}"


def lost_frames(pair: Live) -> tuple[dict[str, int], int]:
    """Frames about each transfer one pump handed to its channel that the other
    pump never took (dropped by its StallWatch, or by the sending channel as too
    old: nothing else may lose them), and the channels' ``dropped_old`` between
    the pair, which must cover those the StallWatches did not drop."""
    p, c = pair.tap(pair.prod), pair.tap(pair.cons)
    lost = (p.sent - c.got) + (c.sent - p.got)
    watch = p.dropped.total() + c.dropped.total()
    links = [
        pair.channel(pair.prod).statistics().peers["decode"],
        pair.channel(pair.cons).statistics().peers["prefill"],
    ]
    old = sum(s.dropped_old for s in links)
    assert all(s.write_failures == s.discarded == 0 for s in links), links
    assert lost.total() - watch <= old, (lost, watch, links)
    return dict(lost), old


def check_outcomes(outcomes: dict[str, str], lost: dict[str, int]) -> None:
    """Every transfer delivered, but those that lost a frame to a stall."""
    failed = {t: o for t, o in outcomes.items() if o != DELIVERED}
    assert failed.keys() <= lost.keys(), (failed, lost)


async def run_fuzz(
    secret: bytes | None,
    seed: int,
    *,
    connections: int | None = None,
    seconds: float | None = None,
    max_frames: int | None = None,
    workers: int = 3,
    burst: int = 12,
) -> RunResult:
    """Transfers in lanes while the fuzzer runs; then one more transfer (the
    pair still works), exact counters, and every transfer's outcome."""
    rng = random.Random(seed)
    async with live_pair(secret) as pair:
        await one_transfer(pair, 0, -1, rng)  # both sides up, the hellos known
        stop = anyio.Event()
        report: FuzzReport | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(lanes, pair, stop, seed)
            report = await fuzz(
                pair,
                rng,
                connections=connections,
                seconds=seconds,
                max_frames=max_frames,
                workers=workers,
                burst=burst,
            )
            stop.set()
        assert report is not None
        await settle(pair, report.tallies)
        await one_transfer(pair, 1, -2, rng)
        errors = [s.runtime.dataplane.error for s in (pair.prod, pair.cons)]  # type: ignore[union-attr]
        assert pair.producer.endpoint.held_blocks == 0
        assert pair.consumer.endpoint.reserved_blocks == 0
        await anyio.sleep(0.2)  # the last frames between the pair land
        lost, old = lost_frames(pair)
        check_outcomes(pair.outcomes, lost)
        watches = [s.runtime.watch for s in (pair.prod, pair.cons)]
        for s in (pair.prod, pair.cons):  # every drop was seen by the taps
            assert pair.tap(s).stall_dropped == s.runtime.watch.dropped
        if lost:
            assert any(w.stalls for w in watches) or old, lost
        return RunResult(
            report,
            dict(pair.outcomes),
            errors,
            lost,
            max(w.stalls for w in watches),
            sum(w.dropped for w in watches),
            old,
        )


DELIVERED = "Ready+SourceReleased:delivered"


# --- tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "hmac"])
async def test_fuzzed_control_sockets_leave_live_transfers_alone(
    secret: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=CHANNEL_LOG)
    with anyio.fail_after(60):
        result = await run_fuzz(secret, seed=7 if secret else 11, connections=160)
    tallies = result.report.tallies
    sent = sum((t.sent for t in tallies.values()), Counter())
    # Every kind ran, and there was something to reject and something to deliver.
    assert set(sent) == {"random", "outsider", "random_frames", "mutated", "valid"}, sent
    assert all(t.garbage > 0 and t.handshake_failures > 0 for t in tallies.values()), tallies
    assert sum(t.delivered for t in tallies.values()) > 0
    assert sum(t.dropped for t in tallies.values()) > 0
    # The transfers end as a fuzz-free run ends them: all delivered, bytes checked
    # (but any whose registration a stall of this loaded process made the
    # producer drop: those fail by their deadline; run_fuzz told them apart).
    check_outcomes(result.outcomes, result.lost_frames)
    assert Counter(result.outcomes.values())[DELIVERED] >= 2 * LANES
    assert result.dataplane_errors == [None, None]
    # Every rejection was logged (the counters were checked in settle()): each
    # garbage frame once, refused connections as lines of counts at a bounded
    # rate, which add up to every one of them.
    garbage = [r for r in caplog.records if "garbage from" in r.getMessage()]
    refused = [
        int(m[1])
        for r in caplog.records
        if (m := re.search(r"refused (\d+) connection\(s\) before", r.getMessage()))
    ]
    assert len(garbage) == sum(t.garbage for t in tallies.values())
    assert sum(refused) == sum(t.handshake_failures for t in tallies.values())


async def test_a_registration_dropped_in_a_stall_is_told_apart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression (the long run's one crash): the shared event loop missed more
    than the stall limit on a loaded machine, the producer's StallWatch dropped
    a lane's Register ("dropped Register of <id> epoch <e> from decode: this
    process was stalled"), and the lane waited for a registration that never came. Now the
    harness sees the drop, and the producer refuses the dropped registration
    (Rejected(STALLED)), so the transfer ends at once, not at its deadline."""
    caplog.set_level(logging.WARNING, logger="kvpush.runtime")
    rng = random.Random(6)
    async with live_pair(None, ready_timeout=2.0) as pair:
        await one_transfer(pair, 0, 0, rng)
        tap, stall = pair.tap(pair.prod), pair.producer.watch.limit * 1.3
        stalled: list[str] = []

        def stall_on_register(ev: object) -> None:
            if isinstance(ev, Received) and isinstance(ev.message, Register) and not stalled:
                stalled.append(ev.message.transfer_id)
                time.sleep(stall)  # the whole process stalls, the frame in hand

        tap.before = stall_on_register
        await one_transfer(pair, 0, 1, rng)
        tap.before = lambda ev: None
        await anyio.sleep(pair.producer.watch.limit * 1.2)  # past the gap
        await one_transfer(pair, 0, 2, rng)
        await anyio.sleep(0.2)
        lost, _ = lost_frames(pair)
        assert lost == {stalled[0]: 1}
        check_outcomes(pair.outcomes, lost)
        assert list(pair.outcomes.values()) == [DELIVERED, STALLED, DELIVERED]
        assert pair.producer.watch.dropped == tap.stall_dropped == 1
        assert tap.dropped == Counter(stalled)
        said = [r.getMessage() for r in caplog.records]
        assert any(m.startswith(f"dropped Register of {stalled[0]} epoch ") for m in said)


async def test_with_a_secret_nobody_without_it_can_displace_a_live_peer() -> None:
    """Regression: the preamble was not authenticated, so a dial claiming the
    live peer's name with a new instance passed for its restart: the channel
    reported the peer lost and every transfer with it failed. Now the preamble
    is sealed with the secret, and such dials are refused before anything."""
    rng = random.Random(3)
    async with live_pair(SECRET) as pair:
        await one_transfer(pair, 0, 0, rng)
        prod_ch = pair.channel(pair.prod)
        tid = f"held-{rng.getrandbits(48):012x}"
        dst = [31]
        pair.consumer.reserve(tid, "prefill", [dst])
        endpoint = pair.producer.endpoint
        await until(lambda: any(t == tid for t, _ in endpoint.transfers()), "registered")
        for key in (None, OTHER_SECRET):
            pre = Preamble("decode", rng.getrandbits(64), 5).encode()
            data = encode_frame(seal(pre, Codec(secret=key)))
            await send_connection(pair.prod.port, data)
        assert prod_ch.statistics().handshake_failures == 2
        assert prod_ch.statistics().peers["decode"].connects == 1
        pair.producer.kv_ready(tid, [[0]])
        await until(lambda: ended(pair.events.get(tid, [])), "ended on both sides")
        assert [type(e) for e in pair.events[tid]] in (
            [Ready, SourceReleased],
            [SourceReleased, Ready],
        )


async def test_without_a_secret_a_dial_under_a_live_name_counts_as_its_restart() -> None:
    """The documented trust model: without a secret whoever reaches the port is
    trusted, and a new instance under a peer's name is that peer restarting:
    the producer drops the registration it held for it."""
    rng = random.Random(4)
    async with live_pair(None) as pair:
        await one_transfer(pair, 0, 0, rng)
        tid = f"held-{rng.getrandbits(48):012x}"
        pair.consumer.reserve(tid, "prefill", [[31]])
        endpoint = pair.producer.endpoint
        await until(lambda: dict(endpoint.transfers()).get(tid) is PState.WAIT_KV, "registered")
        pre = Preamble("decode", rng.getrandbits(64), 5).encode()
        await send_connection(pair.prod.port, encode_frame(pre))
        await until(lambda: dict(endpoint.transfers()).get(tid) is PState.IDLE, "dropped")
        assert pair.channel(pair.prod).statistics().handshake_failures == 0


@given(payloads=st.lists(st.binary(max_size=64), max_size=8), seal_it=st.booleans())
def test_any_bytes_after_a_handshake_are_counted_exactly(
    payloads: list[bytes], seal_it: bool
) -> None:
    """Any framed payloads on a channel (no runtime): exactly the ones the codec
    refuses are counted, and the channel keeps serving."""

    async def main() -> None:
        codec = Codec(secret=SECRET if seal_it else None)
        async with ControlChannel("srv", codec) as ch:
            port = await ch.listen(HOST)
            pre = Preamble("fz", 1, 3).encode()
            data = encode_frame(seal(pre, codec)) + b"".join(encode_frame(p) for p in payloads)
            tally = Tally()
            expect(data, codec, tally, "hypothesis")
            await send_connection(port, data)
            with anyio.fail_after(5):
                while ch.statistics().garbage < tally.garbage:
                    await anyio.sleep(0.001)
            assert ch.statistics().garbage == tally.garbage

    anyio.run(main)


async def test_a_malformed_rank_blob_in_a_hello_does_not_crash_the_pump() -> None:
    rng = random.Random(5)
    async with live_pair(None) as pair:
        await one_transfer(pair, 0, 0, rng)
        hello = pair.prod.runtime.endpoint.peer("decode").hello
        assert hello is not None
        forged = dataclasses.replace(hello, engine_id="fz", instance=1, ranks=(b"\xc1junk",))
        data = Fuzzer(pair, rng).preamble("fz") + encode_frame(pair.codec.encode(forged))
        await send_connection(pair.prod.port, data)
        await one_transfer(pair, 1, 1, rng)
        assert pair.outcomes[next(iter(pair.outcomes))] == DELIVERED
        assert pair.prod.runtime.bad_hellos == 1  # dropped before the core saw it
