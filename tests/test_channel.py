"""The control channel over loopback TCP: framing, round trips, HMAC, reconnects,
peer loss, garbage, backpressure and shutdown. Every test has a hard time limit."""

from __future__ import annotations

import ast
import dataclasses
import random
import struct
import typing
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.memory import MemoryObjectSendStream

import kvpush.runtime
from kvpush.protocol import (
    Abort,
    Announce,
    AuthenticationError,
    Codec,
    ConfigError,
    ControlMessage,
    Extend,
    Heartbeat,
    Hello,
    HelloReject,
    LocalProtocolError,
    Mode,
    ReadDone,
    Register,
    Rejected,
    RejectReason,
    RemoteProtocolError,
    Renew,
    Role,
    Settled,
    Source,
    Withdraw,
    WriteFailed,
)
from kvpush.runtime._channel import (
    Backoff,
    ChannelBusy,
    ChannelClosed,
    ChannelEvent,
    ControlChannel,
    Garbage,
    PeerConnected,
    PeerLost,
    PeerUnreachable,
    Received,
)
from kvpush.runtime._framing import (
    MAX_HANDSHAKE_BYTES,
    MAX_PREAMBLE_BYTES,
    Ack,
    FramingError,
    Preamble,
    encode_frame,
    read_frame,
    seal,
    unseal,
    write_frame,
)

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"
CODEC = Codec()
SECRET = b"0123456789abcdef-shared-secret"

ALL_MESSAGES: list[ControlMessage] = [
    Hello(
        "prefill-0",
        12345,
        Role.PRODUCER,
        2,
        1,
        8,
        False,
        1,
        10.0,
        2.0,
        fingerprint=(("model", "llama"), ("dtype", "bf16")),
    ),
    HelloReject("tp", "4 != 2"),
    Register("t-1", 3, "decode-0", ((1, 2, 3), (7,)), 1.5, Mode.PUSH, 16),
    Withdraw("t-1", 3),
    Abort("t-1", 0),
    Settled("t-1", 3),
    Rejected("t-1", 3, RejectReason.LEASE_EXPIRED),
    WriteFailed("t-1", 3, Source(1, 0), 0, "boom"),
    Announce("t-2", 1, ((5, 6),), 2.0),
    ReadDone("t-2", 1, True),
    Renew("t-3", 4),
    Renew("t-3", 0),  # a consumer's keep request
    Extend("t-3", 4, 2, 12.5),
    Heartbeat(7),
]


# --- helpers -------------------------------------------------------------------------


async def wait_for(
    ch: ControlChannel, pred: Callable[[ChannelEvent], bool], timeout: float = 3.0
) -> tuple[ChannelEvent, list[ChannelEvent]]:
    """The first event matching ``pred``, and the ones skipped before it."""
    skipped: list[ChannelEvent] = []
    with anyio.fail_after(timeout):
        while True:
            ev = await ch.events().receive()
            if pred(ev):
                return ev, skipped
            skipped.append(ev)


async def received(ch: ControlChannel, peer: str, timeout: float = 3.0) -> ControlMessage:
    ev, _ = await wait_for(ch, lambda e: isinstance(e, Received) and e.peer == peer, timeout)
    assert isinstance(ev, Received)
    return ev.message


def drain(ch: ControlChannel) -> list[ChannelEvent]:
    out: list[ChannelEvent] = []
    while True:
        try:
            out.append(ch.events().receive_nowait())
        except anyio.WouldBlock:
            return out


async def closed_by_peer(stream: anyio.abc.SocketStream) -> bool:
    """Read until the other end closes (every read here runs under a time limit)."""
    try:
        while True:
            await stream.receive()
    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
        return True


async def free_port() -> int:
    listener = await anyio.create_tcp_listener(local_host=HOST)
    port: int = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    return port


@asynccontextmanager
async def pair(**kw: typing.Any) -> AsyncIterator[tuple[ControlChannel, ControlChannel]]:
    """``a`` dials ``b`` (b has no route back); both connected and drained."""
    async with ControlChannel("a", CODEC, **kw) as a, ControlChannel("b", CODEC, **kw) as b:
        a.add_route("b", HOST, await b.listen(HOST))
        await wait_for(a, lambda e: e == PeerConnected("b"))
        await wait_for(b, lambda e: e == PeerConnected("a"))
        yield a, b


class Proxy:
    """A TCP relay whose connections the test can cut (closing sockets under both ends)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.scopes: list[anyio.CancelScope] = []

    async def start(self, tg: anyio.abc.TaskGroup) -> int:
        listener = await anyio.create_tcp_listener(local_host=HOST)
        tg.start_soon(self._serve, listener)
        port: int = listener.extra(anyio.abc.SocketAttribute.local_port)
        return port

    async def _serve(self, listener: anyio.abc.Listener[anyio.abc.SocketStream]) -> None:
        async with listener:
            await listener.serve(self._relay)

    async def _relay(self, client: anyio.abc.SocketStream) -> None:
        async with client:
            try:
                server = await anyio.connect_tcp(HOST, self.target)
            except OSError:
                return
            async with server, anyio.create_task_group() as tg:
                self.scopes.append(tg.cancel_scope)
                tg.start_soon(self._pipe, client, server, tg.cancel_scope)
                tg.start_soon(self._pipe, server, client, tg.cancel_scope)

    @staticmethod
    async def _pipe(
        src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream, scope: anyio.CancelScope
    ) -> None:
        try:
            async for chunk in src:
                await dst.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        scope.cancel()

    def cut(self) -> None:
        for scope in self.scopes:
            scope.cancel()
        self.scopes.clear()


# --- framing -------------------------------------------------------------------------


def _feeder(chunks: list[bytes]) -> tuple[MemoryObjectSendStream[bytes], BufferedByteReceiveStream]:
    send, recv = anyio.create_memory_object_stream[bytes](len(chunks) + 1)
    for c in chunks:
        send.send_nowait(c)
    return send, BufferedByteReceiveStream(recv)


async def test_frames_survive_any_chunking() -> None:
    with anyio.fail_after(2):
        payloads = [b"", b"x", b"hello" * 100, bytes(range(256))]
        wire = b"".join(encode_frame(p) for p in payloads)
        for step in (1, 3, 7, len(wire)):
            chunks = [wire[i : i + step] for i in range(0, len(wire), step)]
            send, recv = _feeder(chunks)
            async with send, recv:
                got = [await read_frame(recv, max_frame_bytes=1000) for _ in payloads]
                assert got == payloads
                send.close()
                with pytest.raises(anyio.IncompleteRead):
                    await read_frame(recv, max_frame_bytes=1000)


async def test_oversized_length_is_refused_before_the_payload_is_read() -> None:
    with anyio.fail_after(2):
        # Only the prefix arrives and the stream stays open: a reader that waited
        # for (or allocated) the payload would hang here.
        send, recv = _feeder([struct.pack(">I", 0xFFFFFFFF)])
        async with send, recv:
            with pytest.raises(FramingError, match="exceeds the limit"):
                await read_frame(recv, max_frame_bytes=1 << 20)
        assert issubclass(FramingError, RemoteProtocolError)


async def test_write_frame_refuses_oversized_payloads() -> None:
    sent: list[bytes] = []

    class Sink(anyio.abc.ByteSendStream):
        async def send(self, item: bytes) -> None:
            sent.append(item)

        async def send_eof(self) -> None:
            pass

        async def aclose(self) -> None:
            pass

    with anyio.fail_after(2):
        await write_frame(Sink(), b"abc", max_frame_bytes=3)
        assert sent == [b"\x00\x00\x00\x03abc"]
        with pytest.raises(LocalProtocolError):
            await write_frame(Sink(), b"abcd", max_frame_bytes=3)


def test_preamble_and_ack_round_trip_and_refuse_junk() -> None:
    pre = Preamble("decode-0", 2**64 - 1, 5, 4)
    assert Preamble.decode(pre.encode()) == pre
    ack = Ack("prefill-ü", 1, 5)
    assert Ack.decode(ack.encode()) == ack
    longest = Preamble("x" * 256, 1, 1).encode()
    assert len(longest) == MAX_PREAMBLE_BYTES
    for junk in (b"", b"KVPCH1", pre.encode()[:30], b"GET / HTTP/1.1\r\n\r\n" * 3, ack.encode()):
        with pytest.raises(FramingError):
            Preamble.decode(junk)
    with pytest.raises(FramingError):
        Preamble.decode(pre.encode()[:30] + b"\xff\xfe")
    with pytest.raises(FramingError):
        Ack.decode(pre.encode())


# --- configuration and misuse --------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"max_queue": 0},
        {"max_queue_bytes": -1},
        {"send_timeout": 0},
        {"connect_timeout": float("inf")},
        {"peer_lost_after": float("nan")},
        {"max_age": True},
        {"max_events": 0},
        {"idle_timeout": -1.0},
        {"backoff": "fast"},
    ],
)
def test_bad_configuration_is_refused(kw: dict[str, typing.Any]) -> None:
    with pytest.raises(ConfigError):
        ControlChannel("a", CODEC, **kw)


def test_bad_names_and_backoff_are_refused() -> None:
    for name in ("", "x" * 257):
        with pytest.raises(ConfigError):
            ControlChannel(name, CODEC)
    with pytest.raises(ConfigError):
        ControlChannel("a", "codec")  # type: ignore[arg-type]
    for bad in ({"initial": 0}, {"initial": 3.0}, {"factor": 0.5}, {"jitter": 1.0}):
        with pytest.raises(ConfigError):
            Backoff(**bad)
    b = Backoff(initial=0.1, maximum=1.0, factor=2.0, jitter=0.0)
    rng = random.Random(1)
    assert [b.delay(n, rng) for n in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert b.delay(10**9, rng) == 1.0
    assert Backoff(factor=1.0, jitter=0.0).delay(10**9, rng) == 0.05
    assert Backoff(factor=1e300, jitter=0.0).delay(10**9, rng) == 2.0
    jittery = Backoff(initial=1.0, maximum=1.0, jitter=0.5)
    assert all(0.5 <= jittery.delay(0, rng) <= 1.5 for _ in range(100))


async def test_misuse_raises_the_channel_errors() -> None:
    with anyio.fail_after(3):
        ch = ControlChannel("a", CODEC)
        ch.add_route("b", HOST, 1)  # routes may be added before entering
        with pytest.raises(ChannelClosed):
            ch.send_nowait("b", Heartbeat(1))
        with pytest.raises(ChannelClosed):
            ch.events()
        with pytest.raises(ConfigError):
            ch.add_route("a", HOST, 1)
        with pytest.raises(ConfigError):
            ch.add_route("b", HOST, 70000)
        async with ch:
            with pytest.raises(PeerUnreachable):
                ch.send_nowait("nobody", Heartbeat(1))
            with pytest.raises(PeerUnreachable):
                await ch.send("nobody", Heartbeat(1))
            with pytest.raises(LocalProtocolError):
                ch.send_nowait("b", Heartbeat(-1))
            with pytest.raises(ChannelClosed):
                await ch.__aenter__()
        with pytest.raises(ChannelClosed):
            await ch.send("b", Heartbeat(1))
        with pytest.raises(ChannelClosed):
            await ch.listen(HOST)
        assert not ch.statistics().open


# --- traffic -------------------------------------------------------------------------


async def test_every_message_type_round_trips_both_ways_on_one_connection() -> None:
    assert {type(m) for m in ALL_MESSAGES} == set(typing.get_args(ControlMessage))
    with anyio.fail_after(5):
        async with pair() as (a, b):
            for m in ALL_MESSAGES:
                await a.send("b", m)
            assert [await received(b, "a") for _ in ALL_MESSAGES] == ALL_MESSAGES
            # b has no route to a: it answers over the connection a dialed.
            for m in ALL_MESSAGES:
                b.send_nowait("a", m)
            assert [await received(a, "b") for _ in ALL_MESSAGES] == ALL_MESSAGES
            sa, sb = a.statistics(), b.statistics()
            assert sa.peers["b"].sent == sa.peers["b"].received == len(ALL_MESSAGES)
            assert sb.peers["a"].sent == sb.peers["a"].received == len(ALL_MESSAGES)
            assert sa.peers["b"].connects == sb.peers["a"].connects == 1
            assert sb.peers["a"].route is None
            assert sa.peers["b"].route == (HOST, sa.peers["b"].route[1])  # type: ignore[index]
            assert sb.ports and sa.ports == ()
            assert drain(a) == drain(b) == []
            with pytest.raises(dataclasses.FrozenInstanceError):
                sa.open = False  # type: ignore[misc]
            with pytest.raises(TypeError):
                sa.peers["x"] = sa.peers["b"]  # type: ignore[index]
            await a.send("b", Heartbeat(1))
            await received(b, "a")
            assert sa.peers["b"].sent == len(ALL_MESSAGES)  # a snapshot: it did not move
            assert a.statistics().peers["b"].sent == len(ALL_MESSAGES) + 1


async def test_idle_timeout_drops_a_silent_connection_and_it_is_redialed() -> None:
    with anyio.fail_after(5):
        async with (
            ControlChannel("a", CODEC) as a,
            ControlChannel("b", CODEC, idle_timeout=0.2, peer_lost_after=2.0) as b,
        ):
            a.add_route("b", HOST, await b.listen(HOST))
            await wait_for(b, lambda e: e == PeerConnected("a"))
            with anyio.fail_after(2):
                while b.statistics().peers["a"].connects < 2:
                    await anyio.sleep(0.02)
            # A reconnect within the window: no loss reported.
            assert not any(isinstance(e, PeerLost) for e in drain(a) + drain(b))


async def test_hmac_peers_with_a_wrong_or_missing_secret_are_refused_at_the_handshake() -> None:
    """With a secret the preamble and ack are sealed too: a dialer with another
    secret or none never becomes a peer (counted and logged as a failed
    handshake), and frames with a bad MAC on a sealed connection are garbage."""
    with anyio.fail_after(5):
        async with (
            ControlChannel("a", Codec(secret=SECRET)) as a,
            ControlChannel("b", Codec(secret=SECRET)) as b,
            ControlChannel("m", Codec(secret=b"another-secret-of-16+bytes")) as m,
            ControlChannel("p", Codec()) as p,
        ):
            port = await a.listen(HOST)
            for ch in (b, m, p):
                ch.add_route("a", HOST, port)
            await b.send("a", Heartbeat(1))
            assert await received(a, "b") == Heartbeat(1)
            with anyio.fail_after(3):
                # (the dialers see the close a moment after the acceptor counts it)
                while a.statistics().handshake_failures < 2 or not all(
                    ch.statistics().peers["a"].connect_failures for ch in (m, p)
                ):
                    await anyio.sleep(0.01)
            assert a.statistics().handshake_refusals["unauthenticated"] >= 2
            assert set(a.statistics().peers) == {"b"}
            # A sealed connection whose frames carry a wrong MAC: garbage, and it stays.
            raw = await anyio.connect_tcp(HOST, port)
            async with raw:
                reader = BufferedByteReceiveStream(raw)
                codec = Codec(secret=SECRET)
                await raw.send(encode_frame(seal(Preamble("q", 1, 7).encode(), codec)))
                frame = await read_frame(reader, max_frame_bytes=MAX_HANDSHAKE_BYTES)
                assert Ack.decode(unseal(frame, codec)).conn_id == 7
                for other in (Codec(secret=b"another-secret-of-16+bytes"), Codec()):
                    await raw.send(encode_frame(other.encode(Heartbeat(2))))
                    ev, skipped = await wait_for(a, lambda e: isinstance(e, Garbage))
                    assert isinstance(ev, Garbage)
                    assert ev.peer == "q"
                    assert isinstance(ev.error, AuthenticationError)
                    assert not any(isinstance(e, Received) for e in skipped)
                await raw.send(encode_frame(codec.encode(Heartbeat(3))))
                assert await received(a, "q") == Heartbeat(3)
            # The right secret still gets through.
            await b.send("a", Heartbeat(4))
            assert await received(a, "b") == Heartbeat(4)
            stats = a.statistics()
            assert stats.garbage == 2
            assert stats.peers["b"].received == 2


async def test_a_dropped_connection_is_redialed_and_delivery_resumes() -> None:
    with anyio.fail_after(8):
        async with (
            anyio.create_task_group() as tg,
            ControlChannel("a", CODEC, peer_lost_after=3.0) as a,
            ControlChannel("b", CODEC, peer_lost_after=3.0) as b,
        ):
            proxy = Proxy(await b.listen(HOST))
            a.add_route("b", HOST, await proxy.start(tg))
            await a.send("b", Heartbeat(1))
            assert await received(b, "a") == Heartbeat(1)
            await b.send("a", Heartbeat(2))
            assert await received(a, "b") == Heartbeat(2)

            proxy.cut()
            seq = 100
            with anyio.fail_after(3):  # frames sent into the dying connection may be lost
                while True:
                    seq += 1
                    await a.send("b", Heartbeat(seq))
                    with anyio.move_on_after(0.1):
                        message = await received(b, "a")
                        assert isinstance(message, Heartbeat)
                        if message.seq > 100:
                            break
            # b (no route) answers over the new connection a dialed.
            await b.send("a", Heartbeat(3))
            assert await received(a, "b") == Heartbeat(3)
            assert a.statistics().peers["b"].reconnects >= 1
            assert b.statistics().peers["a"].connects >= 2
            # A reconnect within the window is not a loss, for either side.
            for ch in (a, b):
                assert not any(isinstance(e, (PeerLost, PeerConnected)) for e in drain(ch))
            tg.cancel_scope.cancel()


async def test_a_peer_that_never_comes_back_is_lost_exactly_once() -> None:
    window = 0.5
    with anyio.fail_after(6):
        async with ControlChannel("a", CODEC, peer_lost_after=window) as a:
            port = await a.listen(HOST)
            b = ControlChannel("b", CODEC, peer_lost_after=window)
            c = ControlChannel("c", CODEC, peer_lost_after=window)
            async with b, c:
                a.add_route("b", HOST, await b.listen(HOST))  # a dials b
                c.add_route("a", HOST, port)  # c dials a (a has no route to c)
                await a.send("b", Heartbeat(1))
                await c.send("a", Heartbeat(2))
                assert await received(b, "a") == Heartbeat(1)
                assert await received(a, "c") == Heartbeat(2)
                closed_at = anyio.current_time()
            lost: dict[str, float] = {}
            with anyio.move_on_after(window * 4):
                async for ev in a.events():
                    if isinstance(ev, PeerLost):
                        assert ev.peer not in lost, f"second PeerLost for {ev.peer}"
                        lost[ev.peer] = anyio.current_time() - closed_at
            assert set(lost) == {"b", "c"}
            for elapsed in lost.values():
                assert window * 0.9 <= elapsed <= window + 1.0
            stats = a.statistics()
            # The routed peer is kept (and redialed); the unrouted one is forgotten.
            assert not stats.peers["b"].up
            assert stats.peers["b"].connect_failures >= 1
            assert "c" not in stats.peers
            with pytest.raises(PeerUnreachable):
                a.send_nowait("c", Heartbeat(3))
            a.send_nowait("b", Heartbeat(3))  # queued: b may come back


async def test_a_peer_restarting_on_the_same_port_is_redialed() -> None:
    with anyio.fail_after(8):
        async with ControlChannel("a", CODEC, peer_lost_after=3.0) as a:
            async with ControlChannel("b", CODEC) as b1:
                port = await b1.listen(HOST)
                a.add_route("b", HOST, port)
                await a.send("b", Heartbeat(1))
                assert await received(b1, "a") == Heartbeat(1)
                await b1.send("a", Heartbeat(2))
                assert await received(a, "b") == Heartbeat(2)
            async with ControlChannel("b", CODEC) as b2:
                assert await b2.listen(HOST, port) == port
                ev, skipped = await wait_for(a, lambda e: isinstance(e, PeerConnected))
                assert ev == PeerConnected("b")
                # The old instance is reported gone exactly once, before the new one.
                assert [e for e in skipped if isinstance(e, PeerLost)] == [skipped[-1]]
                await a.send("b", Heartbeat(3))
                assert await received(b2, "a") == Heartbeat(3)
                await b2.send("a", Heartbeat(4))
                assert await received(a, "b") == Heartbeat(4)
                assert a.statistics().peers["b"].up


async def test_simultaneous_dials_settle_on_one_connection() -> None:
    with anyio.fail_after(6):
        async with ControlChannel("a", CODEC) as a, ControlChannel("b", CODEC) as b:
            pa, pb = await a.listen(HOST), await b.listen(HOST)
            a.add_route("b", HOST, pb)
            b.add_route("a", HOST, pa)
            for i in range(20):
                a.send_nowait("b", Heartbeat(i))
                b.send_nowait("a", Heartbeat(i))
                await anyio.sleep(0.01)
            with anyio.fail_after(3):
                while a.statistics().peers["b"].sent < 20 or b.statistics().peers["a"].sent < 20:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.2)
            got_a = [e for e in drain(a) if isinstance(e, Received)]
            got_b = [e for e in drain(b) if isinstance(e, Received)]
            # One connection each way at the end, and it carries both directions.
            for i in range(3):
                await a.send("b", Heartbeat(100 + i))
                await b.send("a", Heartbeat(100 + i))
                assert await received(b, "a") == Heartbeat(100 + i)
                assert await received(a, "b") == Heartbeat(100 + i)
            sa, sb = a.statistics().peers["b"], b.statistics().peers["a"]
            assert sa.connected and sb.connected
            assert sa.write_failures == sb.write_failures == 0
            assert len(got_a) == len(got_b) == 20


async def test_garbage_from_raw_sockets_is_counted_and_others_are_unaffected() -> None:
    with anyio.fail_after(6):
        async with pair() as (a, b):  # a dials b; the raw sockets attack b too
            port = b.statistics().ports[0]

            junk = await anyio.connect_tcp(HOST, port)
            async with junk:
                await junk.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                assert await closed_by_peer(junk)
            assert b.statistics().handshake_failures == 1

            raw = await anyio.connect_tcp(HOST, port)
            async with raw:
                reader = BufferedByteReceiveStream(raw)
                await raw.send(encode_frame(Preamble("mallory", 1, 99).encode()))
                ack = Ack.decode(await read_frame(reader, max_frame_bytes=MAX_PREAMBLE_BYTES))
                assert (ack.name, ack.conn_id) == ("b", 99)
                await wait_for(b, lambda e: e == PeerConnected("mallory"))

                await raw.send(encode_frame(b"KVP\x01\x0b\x00not msgpack"))  # framed garbage
                ev, _ = await wait_for(b, lambda e: isinstance(e, Garbage))
                assert isinstance(ev, Garbage)
                assert ev.peer == "mallory"
                assert not isinstance(ev.error, FramingError)
                # Well-framed garbage keeps the connection.
                await raw.send(encode_frame(CODEC.encode(Heartbeat(9))))
                assert await received(b, "mallory") == Heartbeat(9)

                await raw.send(struct.pack(">I", 0xFFFFFFF0) + b"x" * 100)  # oversized
                ev, _ = await wait_for(b, lambda e: isinstance(e, Garbage))
                assert isinstance(ev, Garbage)
                assert isinstance(ev.error, FramingError)
                assert await closed_by_peer(raw)

            stats = b.statistics()
            assert stats.garbage == 2
            assert stats.peers["mallory"].garbage == 2
            assert not stats.peers["mallory"].connected
            # Everyone else is served as before.
            await a.send("b", Heartbeat(1))
            assert await received(b, "a") == Heartbeat(1)
            await b.send("a", Heartbeat(2))
            assert await received(a, "b") == Heartbeat(2)
            assert b.statistics().peers["a"].garbage == 0


async def test_frames_older_than_max_age_are_dropped_not_sent_late() -> None:
    with anyio.fail_after(5):
        async with (
            ControlChannel("a", CODEC, max_queue=3, max_age=0.3) as a,
            ControlChannel("b", CODEC) as b,
        ):
            a.add_route("b", HOST, await free_port())  # nobody there yet
            for i in range(3):
                a.send_nowait("b", Heartbeat(i))
            with pytest.raises(ChannelBusy):
                a.send_nowait("b", Heartbeat(99))
            await anyio.sleep(0.4)
            a.send_nowait("b", Heartbeat(3))  # room: the three expired
            stats = a.statistics().peers["b"]
            assert (stats.dropped_old, stats.queued) == (3, 1)
            a.add_route("b", HOST, await b.listen(HOST))
            assert await received(b, "a") == Heartbeat(3)
            await anyio.sleep(0.1)
            assert not any(isinstance(e, Received) for e in drain(b))


async def test_backpressure_from_a_peer_that_does_not_read() -> None:
    big = Register("t", 1, "c", (tuple(range(200_000)),), 1.0)
    frame_bytes = len(CODEC.encode(big))
    with anyio.fail_after(10):
        async with (
            ControlChannel("a", CODEC, max_queue=4, send_timeout=0.3, max_age=30) as a,
            # b never consumes its events: its readers stop, TCP fills up.
            ControlChannel("b", CODEC, max_events=1, max_age=30) as b,
        ):
            a.add_route("b", HOST, await b.listen(HOST))
            await wait_for(a, lambda e: e == PeerConnected("b"))
            accepted = 0
            while True:
                try:
                    a.send_nowait("b", big)
                    accepted += 1
                    await anyio.sleep(0)
                    continue
                except ChannelBusy:
                    pass
                before = a.statistics().peers["b"].sent
                await anyio.sleep(0.3)
                if a.statistics().peers["b"].sent == before:
                    break  # the writer is stuck: the queue is full for good
            with pytest.raises(ChannelBusy):
                a.send_nowait("b", big)
            started = anyio.current_time()
            with pytest.raises(ChannelBusy, match="stayed full"):
                await a.send("b", big)
            assert 0.25 <= anyio.current_time() - started < 2.0
            stats = a.statistics().peers["b"]
            assert stats.queued == 4
            assert stats.queued_bytes == 4 * frame_bytes
            # Bounded: the queue plus what the kernels buffer, nowhere near "all of it".
            assert accepted < 100
            assert b.statistics().events_queued == 1
            assert stats.write_failures == stats.dropped_old == 0


async def test_shutdown_fails_pending_senders_promptly() -> None:
    results: list[BaseException | None] = []

    async def sender(ch: ControlChannel, seq: int) -> None:
        try:
            await ch.send("b", Heartbeat(seq))
        except ChannelClosed as exc:
            results.append(exc)
        else:
            results.append(None)

    with anyio.fail_after(5):
        async with (
            anyio.create_task_group() as tg,
            ControlChannel("a", CODEC, max_queue=2, send_timeout=30) as a,
        ):
            a.add_route("b", HOST, await free_port())  # never answers
            a.send_nowait("b", Heartbeat(1))
            a.send_nowait("b", Heartbeat(2))
            for i in range(3):
                tg.start_soon(sender, a, 10 + i)
            await anyio.sleep(0.2)
            assert results == []
            started = anyio.current_time()
            await a.aclose()
            with anyio.fail_after(0.5):
                while len(results) < 3:
                    await anyio.sleep(0.01)
            assert anyio.current_time() - started < 0.5
            assert all(isinstance(r, ChannelClosed) for r in results)
            stats = a.statistics()
            assert not stats.open
            assert stats.discarded == 2
            with pytest.raises(ChannelClosed):
                a.send_nowait("b", Heartbeat(3))
            assert [ev async for ev in a.events()] == []  # the stream has ended
            await a.aclose()  # idempotent


def test_the_runtime_modules_import_no_private_names_from_each_other() -> None:
    """The channel's parts (framing, links, peers) meet through the names their
    modules declare, not through each other's underscored internals."""
    imported = [
        f"{path.name}: {node.module}.{a.name}"
        for path in Path(kvpush.runtime.__file__).parent.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and (node.level > 0 or (node.module or "").startswith("kvpush"))
        for a in node.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]
    assert imported == []
