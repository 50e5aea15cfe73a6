"""The kvpush router (kvpush_router) against fake prefill and decode servers.

The fakes are tiny h11 servers that behave like vLLM where it matters: the
prefill answers after a delay (its "compute") and marks the transfer's KV
ready; the decode sends its SSE head at once (as Starlette does) and its
tokens only once the KV is ready; both notice when the router closes their
connection (vLLM aborts the request then) and record when it happened.
Every wait is bounded (``fail_after``).
"""

from __future__ import annotations

import json
import pathlib
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import h11
import pytest
from anyio.abc import ByteStream, TaskStatus

from kvpush.protocol import Mode
from kvpush_router import Router, RouterConfig, RouterOptions, router_main
from kvpush_router._core import (
    DecodeSpec,
    PrefillSpec,
    UpstreamUrl,
    estimate_blocks,
    estimate_prompt_tokens,
    split_request,
)
from kvpush_vllm import Contract, ParamsError, TransferParams, new_transfer_id, parse_host_port

pytestmark = pytest.mark.anyio
LIMIT = 8.0  # every test's whole budget


def now() -> float:
    return anyio.current_time()


# --------------------------------------------------------------------------- fakes


@dataclass
class Seen:
    """One request a fake upstream received."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    arrived: float
    finished: float | None = None  # the fake sent its whole response
    gone: anyio.Event = field(default_factory=anyio.Event)  # the router closed the connection
    gone_at: float | None = None
    sent: list[float] = field(default_factory=list)

    @property
    def params(self) -> dict[str, str]:
        kvpush: dict[str, str] = self.body["kv_transfer_params"]["kvpush"]
        return kvpush

    @property
    def aborted(self) -> bool:
        """The router hung up before the response was complete."""
        return self.gone.is_set() and self.finished is None


class Reply:
    def __init__(self, conn: h11.Connection, stream: ByteStream, seen: Seen) -> None:
        self.conn, self.stream, self.seen = conn, stream, seen

    async def _send(self, event: h11.Event) -> None:
        data = self.conn.send(event)
        if data:
            await self.stream.send(data)

    async def start(self, status: int, content_type: str) -> None:
        await self._send(h11.Response(status_code=status, headers=[("content-type", content_type)]))

    async def send(self, data: bytes) -> None:
        await self._send(h11.Data(data=data))
        self.seen.sent.append(now())

    async def end(self) -> None:
        # Finished once the last byte is handed over, before the router can
        # hang up on it (so a complete response never reads as aborted).
        data = self.conn.send(h11.EndOfMessage())
        self.seen.finished = now()
        if data:
            await self.stream.send(data)

    async def json(self, status: int, obj: object) -> None:
        await self.start(status, "application/json")
        await self.send(json.dumps(obj).encode())
        await self.end()


Handler = Callable[[Seen, Reply], Awaitable[None]]


class World:
    """The KV handoff the fakes pretend to do: ready per transfer id."""

    def __init__(self) -> None:
        self._ready: dict[str, anyio.Event] = {}

    def ready(self, tid: str) -> anyio.Event:
        return self._ready.setdefault(tid, anyio.Event())


class Fake:
    """A fake vLLM HTTP server: every request recorded, answered by ``handler``."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.seen: list[Seen] = []
        self.port = 0
        #: What GET /metrics answers; GET /health answers ``health`` (vLLM's 200).
        self.metrics = ""
        self.health = 200
        self.probes: list[float] = []
        #: Release legs (``x-kvpush-leg: release``), answered 200 at once.
        self.releases: list[Seen] = []

    async def serve(self, *, task_status: TaskStatus[None]) -> None:
        async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
            self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
            task_status.started()
            await listener.serve(self._conn)

    async def _conn(self, stream: ByteStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            head, body = None, b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    try:
                        conn.receive_data(await stream.receive())
                    except anyio.EndOfStream:
                        return  # the router hung up before a whole request
                elif isinstance(event, h11.Request):
                    head = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
            assert head is not None
            headers = {k.decode(): v.decode() for k, v in head.headers}
            parsed = json.loads(body) if body else {}
            seen = Seen(head.target.decode(), headers, parsed, now())
            if seen.path in ("/health", "/metrics") or headers.get("x-kvpush-leg") == "release":
                reply = Reply(conn, stream, seen)
                if seen.path == "/health":
                    self.probes.append(now())
                    await reply.json(self.health, {})
                elif seen.path == "/metrics":
                    await reply.start(200, "text/plain")
                    await reply.send(self.metrics.encode())
                    await reply.end()
                else:
                    self.releases.append(seen)
                    await reply.json(200, {"id": "cmpl-release", "choices": []})
                return
            self.seen.append(seen)
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    try:
                        while await stream.receive():
                            pass
                    except (
                        anyio.EndOfStream,
                        anyio.BrokenResourceError,
                        anyio.ClosedResourceError,
                        OSError,
                    ):
                        pass
                    seen.gone_at = now()
                    seen.gone.set()
                    tg.cancel_scope.cancel()  # vLLM aborts the request

                tg.start_soon(watch)
                try:
                    await self.handler(seen, Reply(conn, stream, seen))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    return
                if seen.finished is None:
                    seen.finished = now()
                with anyio.move_on_after(1):  # the router hangs up after the response
                    await seen.gone.wait()
                tg.cancel_scope.cancel()


def prefill(world: World, delay: float = 0.0, status: int = 200, late: bool = False) -> Handler:
    """Answers ``status`` after ``delay`` (marking the KV ready first if 200, or
    at once with ``late``: the KV went out, then the HTTP leg failed or hung)."""

    async def handle(seen: Seen, reply: Reply) -> None:
        if late:
            world.ready(seen.params["transfer_id"]).set()
        await anyio.sleep(delay)
        if status != 200:
            await reply.json(status, {"error": {"message": "prefill exploded", "code": status}})
            return
        world.ready(seen.params["transfer_id"]).set()
        await reply.json(200, {"id": "cmpl-p", "choices": [{"index": 0, "text": "A"}]})

    return handle


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def decode(
    world: World,
    *,
    tokens: int = 3,
    gap: float = 0.0,
    status: int = 200,
    early: bool = False,
    break_after: int | None = None,
) -> Handler:
    """Streams ``tokens`` SSE chunks ``gap`` apart once the KV is ready (the head at
    once; with ``early`` one chunk before the KV); JSON when not streaming;
    ``break_after`` chunks then hangs up."""

    async def handle(seen: Seen, reply: Reply) -> None:
        if status != 200:
            await reply.json(status, {"error": {"message": "decode exploded", "code": status}})
            return
        ready = world.ready(seen.params["transfer_id"])
        if not seen.body.get("stream"):
            with anyio.fail_after(LIMIT):
                await ready.wait()
            await reply.json(200, {"id": "cmpl-d", "choices": [{"index": 0, "text": "ABC"}]})
            return
        await reply.start(200, "text/event-stream; charset=utf-8")
        if early:
            await reply.send(sse({"early": True}))
        with anyio.fail_after(LIMIT):
            await ready.wait()
        for i in range(tokens):
            if break_after is not None and i == break_after:
                await reply.stream.aclose()
                raise anyio.ClosedResourceError
            await reply.send(sse({"choices": [{"index": 0, "text": str(i)}]}))
            await anyio.sleep(gap)
        await reply.send(b"data: [DONE]\n\n")
        await reply.end()

    return handle


@dataclass
class Stack:
    router: Router
    port: int
    prefills: list[Fake]
    decodes: list[Fake]

    @property
    def p(self) -> Fake:
        return self.prefills[0]

    @property
    def d(self) -> Fake:
        return self.decodes[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@asynccontextmanager
async def stack(
    prefills: list[Handler | None], decodes: list[Handler | None], **config: Any
) -> AsyncIterator[Stack]:
    """Fakes (``None``: a port nobody listens on) and a router in front of them."""
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            fakes: list[list[Fake]] = [[], []]
            ports: list[list[int]] = [[], []]
            for side, handlers in enumerate((prefills, decodes)):
                for handler in handlers:
                    if handler is None:
                        fakes[side].append(Fake(prefill(World())))
                        ports[side].append(free_port())
                        continue
                    fake = Fake(handler)
                    await tg.start(fake.serve)
                    fakes[side].append(fake)
                    ports[side].append(fake.port)
            config.setdefault("timeout", 3.0)
            config.setdefault("connect_timeout", 1.0)
            router = Router(
                RouterConfig(
                    prefills=tuple(
                        PrefillSpec(UpstreamUrl("127.0.0.1", port), f"127.0.0.1:{9100 + i}")
                        for i, port in enumerate(ports[0])
                    ),
                    decodes=tuple(
                        DecodeSpec.parse(f"http://127.0.0.1:{port}@decode-{i}")
                        for i, port in enumerate(ports[1])
                    ),
                    port=0,
                    **config,
                )
            )
            port = await tg.start(router.serve)
            yield Stack(router, port, fakes[0], fakes[1])
            tg.cancel_scope.cancel()


# --------------------------------------------------------------------------- client


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    chunks: list[tuple[float, bytes]]
    complete: bool  # the body ended properly (not a cut connection)
    done_at: float

    @property
    def body(self) -> bytes:
        return b"".join(c for _, c in self.chunks)

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[str]:
        return [e[len("data: ") :] for e in self.body.decode().split("\n\n") if e]


async def send_request(
    stream: ByteStream, conn: h11.Connection, method: str, path: str, body: object
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode() if body else b""
    head = [("host", "router"), ("content-length", str(len(data)))]
    for event in (h11.Request(method=method, target=path, headers=head), h11.Data(data=data)):
        await stream.send(conn.send(event) or b"")
    await stream.send(conn.send(h11.EndOfMessage()) or b"")


async def read_answer(stream: ByteStream, conn: h11.Connection) -> Answer:
    status, headers, chunks, complete = 0, {}, [], False
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:  # cut mid-body
            break
        if event is h11.NEED_DATA:
            try:
                conn.receive_data(await stream.receive())
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                conn.receive_data(b"")
        elif isinstance(event, h11.Response):
            status = event.status_code
            headers = {k.decode(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.Data):
            chunks.append((now(), bytes(event.data)))
        elif isinstance(event, h11.EndOfMessage):
            complete = True
            break
        else:
            break
    return Answer(status, headers, chunks, complete, now())


async def call(port: int, method: str, path: str, body: object = None) -> Answer:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        conn = h11.Connection(h11.CLIENT)
        await send_request(stream, conn, method, path, body)
        return await read_answer(stream, conn)


async def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (the caller's ``fail_after`` bounds it)."""
    while not condition():
        await anyio.sleep(0.01)


def completion(stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hello world " * 8, "max_tokens": 16, "stream": stream, **extra}


# --------------------------------------------------------------------------- dispatch


async def test_both_legs_at_once_with_one_transfer_id() -> None:
    world = World()
    async with stack([prefill(world, delay=0.4)], [decode(world)]) as s:
        answer = await call(s.port, "POST", "/v1/completions", completion(max_completion_tokens=9))
        assert answer.status == 200, answer.body
        assert answer.json()["choices"][0]["text"] == "ABC"
        (p,), (d,) = s.p.seen, s.d.seen
        assert p.finished is not None
        # The decode leg started while the prefill still computed, not after it.
        assert d.arrived < p.finished - 0.3
        assert abs(d.arrived - p.arrived) < 0.2
        tid = p.params["transfer_id"]
        assert tid.startswith("kvp-") and d.params["transfer_id"] == tid
        assert p.headers["x-request-id"] == d.headers["x-request-id"] == tid
        assert answer.headers["x-request-id"] == tid
        assert p.params == {
            "transfer_id": tid,
            "role": "prefill",
            "mode": "push",
            "peer": "decode-0",
        }
        assert d.params == {
            "transfer_id": tid,
            "role": "decode",
            "mode": "push",
            "peer": "127.0.0.1:9100",
        }
        # Both parse with the connector's parser.
        assert TransferParams.from_params(d.body["kv_transfer_params"]) == TransferParams(
            tid, "decode", Mode.PUSH, "127.0.0.1:9100"
        )
        assert p.body["max_tokens"] == 1 and p.body["max_completion_tokens"] == 1
        assert p.body["stream"] is False
        assert d.body["max_tokens"] == 16 and d.body["max_completion_tokens"] == 9
        assert d.body["prompt"] == p.body["prompt"] == completion()["prompt"]
        await until(lambda: s.router.statistics().inflight == 0)  # its bookkeeping follows
        stats = s.router.statistics()
        assert (stats.inflight, stats.requests, stats.failures) == (0, 1, 0)
        assert stats.prefills[0].outstanding == stats.decodes[0].reserved_blocks == 0


async def test_the_timeline_file_has_one_line_per_request(tmp_path: pathlib.Path) -> None:
    world, path = World(), tmp_path / "router.jsonl"
    async with stack([prefill(world)], [decode(world)], timeline_file=str(path)) as s:
        ok = await call(s.port, "POST", "/v1/completions", completion())
        bad = await call(s.port, "POST", "/v1/completions", completion(kvpush_mode="x"))
        assert (ok.status, bad.status) == (200, 400)
        await until(lambda: s.router.statistics().inflight == 0)
    (line,) = map(json.loads, path.read_text().splitlines())  # a refused request has none
    assert line["side"] == "router" and line["transfer_id"] == ok.headers["x-request-id"]
    assert (line["mode"], line["outcome"]) == ("push", "ok")
    assert line["received"] <= line["dispatched"] <= line["answered"]


async def test_mode_per_request_overrides_the_default() -> None:
    world = World()
    async with stack([prefill(world)], [decode(world)], mode=Mode.PUSH) as s:
        answer = await call(s.port, "POST", "/v1/completions", completion(kvpush_mode="pull"))
        assert answer.status == 200
        answer = await call(s.port, "POST", "/v1/completions", completion())
        assert answer.status == 200
        modes = [
            (p.params["mode"], d.params["mode"]) for p, d in zip(s.p.seen, s.d.seen, strict=True)
        ]
        assert modes == [("pull", "pull"), ("push", "push")]
        assert all("kvpush_mode" not in x.body for x in s.p.seen + s.d.seen)
        bad = await call(s.port, "POST", "/v1/completions", completion(kvpush_mode="teleport"))
        assert bad.status == 400 and "kvpush_mode" in bad.json()["error"]["message"]
        assert len(s.p.seen) == 2


async def test_sse_chunks_reach_the_client_as_they_are_made() -> None:
    world = World()
    async with stack([prefill(world, delay=0.1)], [decode(world, tokens=3, gap=0.25)]) as s:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        answer = await call(s.port, "POST", "/v1/chat/completions", chat)
        assert answer.status == 200 and answer.complete
        assert answer.headers["content-type"].startswith("text/event-stream")
        assert answer.events()[-1] == "[DONE]"
        assert [json.loads(e)["choices"][0]["text"] for e in answer.events()[:-1]] == [
            "0",
            "1",
            "2",
        ]
        (d,) = s.d.seen
        assert d.finished is not None and d.body["stream"] is True
        assert s.p.seen[0].path == "/v1/chat/completions" and s.p.seen[0].body["stream"] is False
        first = answer.chunks[0][0]
        assert first < d.finished - 0.4  # the first token arrived long before the last left


async def test_keep_alive_carries_several_requests() -> None:
    world = World()
    async with stack([prefill(world)], [decode(world)]) as s:
        async with await anyio.connect_tcp("127.0.0.1", s.port) as stream:
            conn = h11.Connection(h11.CLIENT)
            for _ in range(2):
                await send_request(stream, conn, "POST", "/v1/completions", completion())
                answer = await read_answer(stream, conn)
                assert answer.status == 200 and answer.complete
                conn.start_next_cycle()
        assert len(s.d.seen) == 2


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize(("kind", "status"), [("500", 502), ("refused", 502), ("timeout", 504)])
async def test_failed_prefill_cancels_the_decode(kind: str, status: int) -> None:
    world = World()
    handler = {
        "500": prefill(world, delay=0.1, status=500),
        "refused": None,
        "timeout": prefill(world, delay=30),
    }[kind]
    async with stack([handler], [decode(world)], prefill_timeout=0.6) as s:
        start = now()
        answer = await call(s.port, "POST", "/v1/completions", completion(stream=True))
        assert answer.status == status and answer.complete
        error = answer.json()["error"]
        assert error["code"] == status and "prefill" in error["message"]
        assert answer.done_at - start < 1.5
        # The decode leg was cut, not left waiting for KV (or never got there:
        # a refused connect is quicker than the decode leg's request).
        for d in s.d.seen:
            with anyio.fail_after(1):
                await d.gone.wait()
            assert d.aborted
        if kind != "refused":
            assert len(s.d.seen) == 1
        if kind == "timeout":
            await s.p.seen[0].gone.wait()
            assert s.p.seen[0].aborted
        await until(lambda: s.router.statistics().inflight == 0)
        assert s.router.statistics().failures == 1
        assert s.router.statistics().decodes[0].outstanding == 0


@pytest.mark.parametrize(("kind", "status"), [("500", 502), ("refused", 502), ("400", 400)])
async def test_failed_decode_cancels_the_prefill(kind: str, status: int) -> None:
    world = World()
    handler = {"500": decode(world, status=500), "400": decode(world, status=400), "refused": None}
    async with stack([prefill(world, delay=3)], [handler[kind]]) as s:
        start = now()
        answer = await call(s.port, "POST", "/v1/completions", completion())
        assert answer.status == status
        assert "decode" in answer.json()["error"]["message"]
        assert answer.done_at - start < 1.0
        for p in s.p.seen:  # (a refused decode may beat the prefill's request)
            with anyio.fail_after(1):
                await p.gone.wait()
            assert p.aborted and p.gone_at is not None and p.gone_at - start < 1.0
        if kind != "refused":
            assert len(s.p.seen) == 1
        await until(lambda: s.router.statistics().inflight == 0)
        assert s.router.statistics().prefills[0].outstanding == 0


async def test_prefill_failing_after_the_stream_started_ends_it_with_an_error_event() -> None:
    world = World()
    async with stack([prefill(world, delay=0.3, status=503)], [decode(world, early=True)]) as s:
        answer = await call(s.port, "POST", "/v1/completions", completion(stream=True))
        assert answer.status == 200  # the head went out with the first chunk
        events = answer.events()
        assert json.loads(events[0]) == {"early": True}
        error = json.loads(events[-1])["error"]
        assert error["code"] == 502 and "prefill" in error["message"]
        assert "[DONE]" not in events
        with anyio.fail_after(1):
            await s.d.seen[0].gone.wait()
        assert s.d.seen[0].aborted


async def test_decode_breaking_mid_stream_ends_it_with_an_error_event() -> None:
    world = World()
    async with stack([prefill(world, delay=0.1)], [decode(world, break_after=1)]) as s:
        answer = await call(s.port, "POST", "/v1/completions", completion(stream=True))
        assert answer.status == 200
        events = answer.events()
        assert json.loads(events[0])["choices"][0]["text"] == "0"
        assert json.loads(events[-1])["error"]["code"] == 502


@pytest.mark.parametrize("status", [500, 200])
async def test_prefill_leg_ending_after_the_decode_finished(status: int) -> None:
    """A prefill leg that fails (500) after the client got its whole answer
    changes nothing; one that hangs (30 s) is cut after the grace."""
    world = World()
    handler = prefill(world, delay=0.2 if status == 500 else 30, status=status, late=True)
    async with stack([handler], [decode(world)], prefill_grace=1.0) as s:
        start = now()
        answer = await call(s.port, "POST", "/v1/completions", completion(stream=True))
        assert answer.status == 200 and answer.complete and answer.events()[-1] == "[DONE]"
        assert answer.done_at - start < 0.5  # not held up by the prefill leg
        (p,) = s.p.seen
        with anyio.fail_after(1.5):
            await p.gone.wait()
        assert p.aborted is (status == 200)
        await until(lambda: s.router.statistics().inflight == 0)
        assert s.router.statistics().failures == 0
        assert now() - start < 1.8


async def test_client_hanging_up_cancels_both_legs() -> None:
    world = World()
    async with stack([prefill(world, delay=5)], [decode(world)]) as s:
        async with await anyio.connect_tcp("127.0.0.1", s.port) as stream:
            await send_request(
                stream, h11.Connection(h11.CLIENT), "POST", "/v1/completions", completion()
            )
            while not (s.p.seen and s.d.seen):
                await anyio.sleep(0.01)
        with anyio.fail_after(1):
            await s.p.seen[0].gone.wait()
            await s.d.seen[0].gone.wait()
        assert s.p.seen[0].aborted and s.d.seen[0].aborted
        await until(lambda: s.router.statistics().inflight == 0)
        assert s.router.statistics().decodes[0].outstanding == 0


# --------------------------------------------------------------------------- load


async def test_2p2d_spreads_concurrent_requests_by_load() -> None:
    world = World()
    async with stack([prefill(world, delay=0.3)] * 2, [decode(world)] * 2) as s:
        answers = []

        async def one() -> None:
            answers.append(await call(s.port, "POST", "/v1/completions", completion()))

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(one)
            while len(s.prefills[0].seen) + len(s.prefills[1].seen) < 4:
                await anyio.sleep(0.01)
            stats = s.router.statistics()
            assert [x.outstanding for x in stats.prefills] == [2, 2]
            assert [x.outstanding for x in stats.decodes] == [2, 2]
        assert [a.status for a in answers] == [200] * 4
        assert [len(f.seen) for f in s.prefills + s.decodes] == [2, 2, 2, 2]
        peers = {
            (d.params["peer"], p.params["peer"])
            for f in s.decodes
            for d in f.seen
            for g in s.prefills
            for p in g.seen
            if p.params["transfer_id"] == d.params["transfer_id"]
        }
        assert {a for a, _ in peers} == {"127.0.0.1:9100", "127.0.0.1:9101"}
        assert {b for _, b in peers} == {"decode-0", "decode-1"}


async def test_a_long_prompt_weighs_more_than_a_short_one() -> None:
    world = World()
    async with stack([prefill(world, delay=0.5)], [decode(world)] * 2, tokens_per_block=16) as s:
        async with anyio.create_task_group() as tg:
            long = completion(prompt=list(range(1600)))  # 100 blocks
            tg.start_soon(call, s.port, "POST", "/v1/completions", long)
            while not s.decodes[0].seen:
                await anyio.sleep(0.01)
            for _ in range(3):
                tg.start_soon(call, s.port, "POST", "/v1/completions", completion())
            while sum(len(f.seen) for f in s.decodes) < 4:
                await anyio.sleep(0.01)
            assert s.router.statistics().decodes[0].reserved_blocks == 100
        assert [len(f.seen) for f in s.decodes] == [1, 3]


def test_prompt_estimate() -> None:
    assert estimate_prompt_tokens({"prompt": "x" * 41}) == 11
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens({"prompt": [[1, 2], [3]]}) == 3
    assert estimate_prompt_tokens({"prompt": ["abcd", "abcdefgh"]}) == 3
    chat = [
        {"role": "system", "content": "x" * 8},
        {"role": "user", "content": [{"type": "text", "text": "y" * 4}, {"type": "image_url"}]},
    ]
    assert estimate_prompt_tokens({"messages": chat}) == 3
    assert estimate_prompt_tokens({}) == 0
    assert [estimate_blocks(t, 16) for t in (0, 1, 16, 17)] == [1, 1, 1, 2]


# --------------------------------------------------------------------------- edges


async def test_health_models_and_refusals() -> None:
    world = World()

    async def models(seen: Seen, reply: Reply) -> None:
        await reply.json(200, {"object": "list", "data": [{"id": "m"}]})

    async with stack([prefill(world)], [models], max_body=1000) as s:
        health = await call(s.port, "GET", "/health")
        assert health.status == 200 and health.json()["status"] == "ok"
        assert health.json()["decodes"][0]["url"].startswith("http://127.0.0.1:")
        listed = await call(s.port, "GET", "/v1/models")
        assert listed.status == 200 and listed.json()["data"] == [{"id": "m"}]
        assert s.d.seen[0].path == "/v1/models"
        missing = await call(s.port, "GET", "/v1/nope")
        assert missing.status == 404 and missing.json()["error"]["code"] == 404
        assert (await call(s.port, "GET", "/v1/completions")).status == 405
        big = await call(s.port, "POST", "/v1/completions", completion(prompt="x" * 2000))
        assert big.status == 413 and big.json()["error"]["type"] == "RequestTooLarge"
        assert (await call(s.port, "POST", "/v1/completions", b"{not json")).status == 400
        assert (await call(s.port, "POST", "/v1/completions", b"[1]")).status == 400
        assert len(s.p.seen) == 0


async def test_models_upstream_down_is_502() -> None:
    async with stack([None], [None]) as s:
        answer = await call(s.port, "GET", "/v1/models")
        assert answer.status == 502 and "decode" in answer.json()["error"]["message"]


async def test_busy_router_answers_503() -> None:
    world = World()
    async with stack([prefill(world, delay=0.5)], [decode(world)], max_inflight=1) as s:
        async with anyio.create_task_group() as tg:
            first: list[Answer] = []

            async def slow() -> None:
                first.append(await call(s.port, "POST", "/v1/completions", completion()))

            tg.start_soon(slow)
            while not s.p.seen:
                await anyio.sleep(0.01)
            busy = await call(s.port, "POST", "/v1/completions", completion())
            assert busy.status == 503 and busy.json()["error"]["type"] == "ServiceUnavailable"
        assert first[0].status == 200
        assert s.router.statistics().rejected == 1


# --------------------------------------------------------------------------- params, specs


def test_params_round_trip_and_validation() -> None:
    tid = new_transfer_id()
    for role, peer in (("prefill", "http://d:8200"), ("decode", "[::1]:9100")):
        params = TransferParams(tid, role, Mode.PULL, peer)  # type: ignore[arg-type]
        raw = json.loads(json.dumps(params.to_params()))
        assert TransferParams.from_params({**raw, "other": {}}) == params
    assert TransferParams(tid, "decode", Mode.PUSH, "[::1]:9100").peer_address() == ("::1", 9100)
    assert TransferParams.from_params(None) is None
    assert TransferParams.from_params({"nixl": {}}) is None
    good = {"transfer_id": tid, "role": "decode", "mode": "push", "peer": "h:1"}
    bad = [
        ([1], "must be an object"),
        ({"kvpush": "x"}, "must be an object"),
        ({"kvpush": {k: v for k, v in good.items() if k != "peer"}}, r"missing \['peer'\]"),
        ({"kvpush": {**good, "epoch": 1}}, r"unknown \['epoch'\]"),
        ({"kvpush": {**good, "role": "both"}}, "role must be"),
        ({"kvpush": {**good, "mode": "teleport"}}, "mode must be"),
        ({"kvpush": {**good, "peer": "h"}}, "host:port"),
        ({"kvpush": {**good, "peer": "h:0"}}, "host:port"),
        ({"kvpush": {**good, "peer": "::1:80"}}, "bracketed"),
        ({"kvpush": {**good, "transfer_id": ""}}, "transfer_id"),
        ({"kvpush": {**good, "transfer_id": "a b"}}, "transfer_id"),
        ({"kvpush": {**good, "transfer_id": 7}}, "must be a string"),
    ]
    for value, message in bad:
        with pytest.raises(ParamsError, match=message):
            TransferParams.from_params(value)
    with pytest.raises(ParamsError, match="only the decode"):
        TransferParams(tid, "prefill", Mode.PUSH, "d").peer_address()
    assert parse_host_port("example.com:80") == ("example.com", 80)


def test_split_request_bodies() -> None:
    body = completion(stream=True, stream_options={"include_usage": True}, min_tokens=4)
    body["kv_transfer_params"] = {"stale": 1}
    pre, dec = split_request(
        body,
        transfer_id="kvp-1",
        mode=Mode.PULL,
        prefill=PrefillSpec.parse("http://p:8100@p:9100"),
        decode=DecodeSpec.parse("http://d:8200"),
    )
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "max_completion_tokens" not in pre
    assert "stream_options" not in pre and "min_tokens" not in pre
    assert pre["kv_transfer_params"]["kvpush"]["peer"] == "http://d:8200"
    assert dec == {**body, "kv_transfer_params": dec["kv_transfer_params"]}
    assert dec["kv_transfer_params"] == {
        "kvpush": {"transfer_id": "kvp-1", "role": "decode", "mode": "pull", "peer": "p:9100"}
    }
    assert body["kv_transfer_params"] == {"stale": 1}  # the client's body is not touched


def test_specs() -> None:
    spec = PrefillSpec.parse("http://h:8100/base@h:9100")
    assert (spec.url.host, spec.url.port, spec.url.target("/v1/x"), spec.control) == (
        "h",
        8100,
        "/base/v1/x",
        "h:9100",
    )
    assert str(DecodeSpec.parse("http://[::1]:8200").url) == "http://[::1]:8200"
    assert DecodeSpec.parse("http://d:8200@engine-7").name == "engine-7"


def test_router_main_argument_errors(capsys: pytest.CaptureFixture[str]) -> None:
    ok = ["--prefill", "http://p:8100@p:9100", "--decode", "http://d:8200"]
    cases = [
        (["--prefill", "http://p:8100@p:9100"], "--decode"),
        (["--prefill", "http://p:8100", "--decode", "http://d:8200"], "URL@CONTROL"),
        (["--prefill", "http://p:8100@p", "--decode", "http://d:8200"], "host:port"),
        (["--prefill", "https://p@p:1", "--decode", "http://d:8200"], "http://host"),
        ([*ok, "--mode", "teleport"], "mode must be one of 'push', 'pull', got 'teleport'"),
        ([*ok, "--timeout", "0"], "timeout must be a number (s) > 0, got 0.0"),
        ([*ok, "--prefill-timeout", "-1"], "prefill_timeout must be a number (s) > 0"),
        ([*ok, "--block-size", "0"], "tokens_per_block must be an int >= 1, got 0"),
        ([*ok, "--port", "70000"], "port must be an int in [0, 65535], got 70000"),
        ([*ok, "--log-level", "LOUD"], "log_level must be one of 'DEBUG'"),
        ([*ok, "--metrics-interval", "-1"], "metrics_interval must be a number (s) >= 0"),
    ]
    for argv, message in cases:
        assert router_main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert router_main(["--help"]) == 0
    assert "--prefill URL@CTRL" in capsys.readouterr().out


def test_the_flags_are_the_options_fields() -> None:
    """One flag per :class:`RouterOptions` field, with the default and help of
    the :class:`RouterConfig` setting it sets; repeated upstream flags add up."""
    import argparse

    from kvpush_router import add_router_arguments

    parser = argparse.ArgumentParser(prog="kvpush router")
    add_router_arguments(parser)
    flags = [a.option_strings[0] for a in parser._actions if a.dest != "help"]
    assert flags == [
        "--prefill", "--decode", "--host", "--port", "--mode", "--block-size", "--timeout",
        "--prefill-timeout", "--connect-timeout", "--max-inflight", "--max-body-bytes",
        "--log-level", "--secret-file", "--metrics-interval", "--timeline-file",
    ]  # fmt: skip
    text = parser.format_help()
    for shown in ("(default: 300.0)", "(default: 16777216)", "(default: push)", "[s]"):
        assert shown in text
    argv = ["--prefill", "http://p:1@p:2", "http://q:1@q:2", "--decode", "http://d:3"]
    args = parser.parse_args([*argv, "--prefill", "http://r:1@r:2", "--max-body-bytes", "99"])
    options = RouterOptions.from_args(args)
    assert options.prefill == ("http://p:1@p:2", "http://q:1@q:2", "http://r:1@r:2")
    config = options.config()
    assert [p.control for p in config.prefills] == ["p:2", "q:2", "r:2"]
    assert (config.max_body, config.timeout, config.mode) == (99, 300.0, Mode.PUSH)
    assert config == RouterConfig(config.prefills, config.decodes, max_body=99)


def test_the_config_is_checked_by_the_one_validator() -> None:
    from kvpush.protocol import ConfigError

    spec = PrefillSpec.parse("http://p:1@p:2"), DecodeSpec.parse("http://d:3")
    bad = [
        ({"connect_timeout": 0}, "connect_timeout must be a number (s) > 0, got 0"),
        ({"retries": -1}, "retries must be an int >= 0, got -1"),
        ({"client_timeout": float("inf")}, "client_timeout must be a number (s) > 0"),
        ({"probe_first": 2.0, "probe_max": 1.0}, "probe_max must be >= probe_first"),
        ({"secret": b"short"}, "the router's secret must be at least 16 bytes"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            RouterConfig((spec[0],), (spec[1],), **kwargs)
    with pytest.raises(ConfigError, match="at least one prefill and one decode"):
        RouterConfig((), (spec[1],))


def test_router_main_cannot_listen(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        argv = ["--prefill", "http://p:1@p:2", "--decode", "http://d:3", "--port", port]
        assert router_main(argv) == 1
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err


async def test_router_main_stops_cleanly_on_sigterm() -> None:
    code = "import sys; from kvpush_router import router_main; sys.exit(router_main(sys.argv[1:]))"
    argv = [
        "--prefill",
        "http://127.0.0.1:1@127.0.0.1:2",
        "--decode",
        "http://127.0.0.1:3",
        "--port",
        "0",
    ]
    with anyio.fail_after(LIMIT):
        async with await anyio.open_process([sys.executable, "-c", code, *argv]) as proc:
            assert proc.stderr is not None
            log = b""
            async for data in proc.stderr:
                log += data
                if b"kvpush router on http://127.0.0.1:" in log:
                    break
            proc.send_signal(signal.SIGTERM)
            assert await proc.wait() == 0


# --------------------------------------------------------------------------- health (issue 28)


def ids(fake: Fake) -> list[str]:
    return [x.params["transfer_id"] for x in fake.seen]


async def test_a_down_prefill_is_retried_elsewhere_skipped_and_probed_back() -> None:
    world = World()
    broken = [True]

    async def flaky(seen: Seen, reply: Reply) -> None:  # p0: a 503 while "down"
        if broken[0]:
            await reply.json(503, {"error": {"message": "engine dead"}})
            return
        await prefill(world)(seen, reply)

    async with stack([flaky, prefill(world, delay=0.05)], [decode(world)]) as s:
        p0, p1 = s.prefills
        p0.health = 503
        first = await call(s.port, "POST", "/v1/completions", completion())
        # Round order sends the first request to p0: it fails, and the request
        # is tried again on p1 with a new transfer id and a decode leg to match.
        assert first.status == 200, first.body
        (t0,) = ids(p0)
        (t1,) = ids(p1)
        assert t0 != t1 and first.headers["x-request-id"] == t1
        d_legs = s.d.seen
        assert [x.params["transfer_id"] for x in d_legs] == [t0, t1]
        assert [x.params["peer"] for x in d_legs] == ["127.0.0.1:9100", "127.0.0.1:9101"]
        await until(d_legs[0].gone.is_set)
        assert d_legs[0].aborted  # the first decode leg was cut, never answered twice
        await until(lambda: s.router.statistics().inflight == 0)
        stats = s.router.statistics()
        assert stats.retries == 1 and stats.failures == 0
        assert [x.up for x in stats.prefills] == [False, True]
        for _ in range(3):  # p0 is down: it gets nothing new
            assert (await call(s.port, "POST", "/v1/completions", completion())).status == 200
        assert len(p0.seen) == 1 and len(p1.seen) == 4
        health = (await call(s.port, "GET", "/health")).json()
        assert health["prefills"][0]["up"] is False
        assert "503" in health["prefills"][0]["down_because"]
        # Probed with backoff: ~0.5 s, then ~1 s later (+-20%).
        await until(lambda: len(p0.probes) >= 2)
        gap = p0.probes[1] - p0.probes[0]
        assert 0.75 <= gap <= 1.3, p0.probes
        broken[0], p0.health = False, 200
        await until(lambda: s.router.statistics().prefills[0].up)
        answers = [await call(s.port, "POST", "/v1/completions", completion()) for _ in range(2)]
        assert [a.status for a in answers] == [200, 200]
        assert len(p0.seen) == 3  # back, and behind on the round: it takes both


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_every_instance_of_a_side_down_is_a_prompt_503(side: str) -> None:
    world = World()
    handlers: tuple[list[Handler | None], list[Handler | None]] = (
        ([None], [decode(world)]) if side == "prefill" else ([prefill(world)], [None])
    )
    async with stack(*handlers) as s:
        first = await call(s.port, "POST", "/v1/completions", completion())
        assert first.status == 502  # it was up when the request left: its failure, named
        cause = first.json()["error"]["kvpush"]
        assert cause["leg"] == side and cause["cause"] == "connect"
        start = now()
        answer = await call(s.port, "POST", "/v1/completions", completion())
        assert now() - start < 0.2
        assert answer.status == 503 and int(answer.headers["retry-after"]) >= 1
        error = answer.json()["error"]
        assert f"every {side} instance is down" in error["message"]
        assert "cannot connect" in error["message"]
        assert error["kvpush"]["leg"] == side and error["kvpush"]["cause"] == "down"
        await until(lambda: s.router.statistics().inflight == 0)
        assert s.router.statistics().rejected == 1


async def test_a_failed_decode_leg_is_never_sent_again_and_its_cause_is_named() -> None:
    world = World()

    async def refused(seen: Seen, reply: Reply) -> None:
        message = "KV load failed: handshake refused: block_size: '32' here, '64' there"
        await reply.json(500, {"error": {"message": message, "code": 500}})

    async with stack([prefill(world, delay=0.3)] * 2, [refused, decode(world)]) as s:
        answer = await call(s.port, "POST", "/v1/completions", completion())
        assert answer.status == 502
        error = answer.json()["error"]
        assert "block_size: '32' here, '64' there" in error["message"]
        assert error["kvpush"] == {
            "leg": "decode",
            "instance": f"http://127.0.0.1:{s.decodes[0].port}",
            "cause": "status",
            "upstream_status": 500,
            "upstream_message": (
                "KV load failed: handshake refused: block_size: '32' here, '64' there"
            ),
            "transfer_id": answer.headers["x-request-id"],
        }
        assert len(s.decodes[0].seen) == 1 and not s.decodes[1].seen  # not retried
        # The decode answering 5xx is down: the next request goes to the other.
        assert (await call(s.port, "POST", "/v1/completions", completion())).status == 200
        assert len(s.decodes[0].seen) == 1 and len(s.decodes[1].seen) == 1


async def test_a_decode_reporting_suspect_blocks_gets_requests_only_when_no_other_can() -> None:
    world = World()
    async with stack([prefill(world)], [decode(world)] * 2, metrics_interval=0.05) as s:
        d0, d1 = s.decodes
        d0.metrics = (
            "# TYPE vllm:kvpush_blocks gauge\n"
            'vllm:kvpush_blocks{engine="0",kind="reserved",model_name="m"} 40.0\n'
            'vllm:kvpush_blocks{engine="0",kind="suspect",model_name="m"} 12.0\n'
        )
        await until(lambda: s.router.statistics().decodes[0].suspect_blocks == 12)
        for _ in range(3):
            assert (await call(s.port, "POST", "/v1/completions", completion())).status == 200
        assert len(d0.seen) == 0 and len(d1.seen) == 3
        health = (await call(s.port, "GET", "/health")).json()
        assert [x["suspect_blocks"] for x in health["decodes"]] == [12, 0]
        d0.metrics = 'kvpush:blocks{role="consumer",engine="d0",kind="suspect"} 0.0\n'
        await until(lambda: s.router.statistics().decodes[0].suspect_blocks == 0)
        assert (await call(s.port, "POST", "/v1/completions", completion())).status == 200
        assert len(d0.seen) == 1


SECRET = b"sixteen-bytes-or-more!"


async def test_sealed_decode_legs_are_trusted_without_allowed_peers() -> None:
    world = World()
    async with stack([prefill(world)], [decode(world)], secret=SECRET) as s:
        assert (await call(s.port, "POST", "/v1/completions", completion())).status == 200
        (d,) = s.d.seen
        leg = TransferParams(d.params["transfer_id"], "decode", Mode.PUSH, "127.0.0.1:9100")
        assert d.params["seal"] == Contract(SECRET).seal(leg)
        trusted = Contract(SECRET).parse(d.body["kv_transfer_params"], "r", "decode")
        assert isinstance(trusted, TransferParams) and trusted.peer == "127.0.0.1:9100"
        with pytest.raises(ParamsError, match="seal is missing or wrong"):
            Contract(b"another-secret-of-16b").parse(d.body["kv_transfer_params"], "r", "decode")
        assert "seal" not in s.p.seen[0].params  # the prefill leg needs none


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path: pathlib.Path) -> None:
    from kvpush.protocol import ConfigError
    from kvpush_router import read_secret

    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert read_secret(str(path), {}) == SECRET
    assert read_secret(None, {"KVPUSH_SECRET": SECRET.decode()}) == SECRET
    assert read_secret(None, {}) is None
    path.write_bytes(b"short\n")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        read_secret(str(path), {})
    with pytest.raises(ConfigError, match="cannot read"):
        read_secret(str(tmp_path / "missing"), {})


@pytest.mark.parametrize("kind", ["500", "400", "refused"])
async def test_a_failed_decode_leg_releases_the_prefill_kv_at_once(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release leg; ``kvpush_vllm.release_params`` is stubbed here
    (the connector's side is tested with the connector)."""
    import kvpush_router._server as server

    calls: list[tuple[str, str, bytes | None]] = []

    def release_params(transfer_id: str, mode: str, secret: bytes | None) -> dict[str, object]:
        calls.append((transfer_id, mode, secret))
        return {"kvpush": {"transfer_id": transfer_id, "role": "release", "mode": mode}}

    monkeypatch.setattr(server, "release_params", release_params)
    world = World()
    handler = {"500": decode(world, status=500), "400": decode(world, status=400), "refused": None}
    async with stack([prefill(world, delay=0.05)], [handler[kind]], secret=SECRET) as s:
        start = now()
        answer = await call(s.port, "POST", "/v1/completions", completion(model="mx"))
        assert answer.status in (400, 502)
        await until(lambda: bool(s.p.releases))
        assert now() - start < 0.5  # a round trip, not a kv_hold_timeout
        (release,) = s.p.releases
        tid = answer.json()["error"]["kvpush"]["transfer_id"]
        assert calls == [(tid, "push", SECRET)]
        assert release.path == "/v1/completions"
        assert release.body == {
            "prompt": [0],
            "max_tokens": 1,
            "stream": False,
            "model": "mx",
            "kv_transfer_params": {
                "kvpush": {"transfer_id": tid, "role": "release", "mode": "push"}
            },
        }
        await until(lambda: s.router.statistics().releases == 1)
        assert (await call(s.port, "GET", "/health")).json()["releases"] == 1


async def test_no_release_leg_when_the_decode_answers() -> None:
    world = World()
    async with stack([prefill(world)], [decode(world)]) as s:
        assert (await call(s.port, "POST", "/v1/completions", completion())).status == 200
        await anyio.sleep(0.1)
        stats = s.router.statistics()
        assert not s.p.releases and stats.releases == stats.release_failures == 0


async def test_the_release_leg_parses_at_a_prefill_with_the_same_secret() -> None:
    world = World()
    async with stack([prefill(world, delay=0.05)], [decode(world, status=500)], secret=SECRET) as s:
        answer = await call(s.port, "POST", "/v1/completions", completion())
        assert answer.status == 502
        await until(lambda: bool(s.p.releases))
        leg = Contract(SECRET).parse(s.p.releases[0].body["kv_transfer_params"], "r", "prefill")
        assert leg is not None and not isinstance(leg, TransferParams)
        assert leg.transfer_id == answer.headers["x-request-id"]
