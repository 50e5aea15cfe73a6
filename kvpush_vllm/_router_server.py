"""The router's server: accept connections, route requests, run exchanges.

:class:`Router` serves the OpenAI-compatible endpoints; the decisions are the
sans-IO ``_router_core``'s, the per-request pump is ``_router_exchange``'s,
the HTTP is h11's (``_router_http``).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import anyio
import h11
from anyio.abc import ByteStream, Listener, SocketAttribute, SocketStream, TaskStatus

from kvpush.protocol import ConfigError, Mode
from kvpush.routing import InstanceLoad, Ledger

from ._breakdown import Breakdown
from ._params import new_transfer_id
from ._router_core import (
    DecodeSpec,
    FailureKind,
    PrefillSpec,
    RequestError,
    error_body,
    estimate_blocks,
    estimate_prompt_tokens,
    split_request,
    take_mode,
)
from ._router_exchange import MAX_UPSTREAM_BODY, Exchange, LegPlan, Timeouts
from ._router_http import BodyTooLarge, ClientGone, Incoming, ServerConn, UpstreamError, upstream

__all__ = ("Router", "RouterConfig", "RouterStats")

log = logging.getLogger("kvpush.router")

#: The endpoints proxied to a prefill and a decode instance at once.
PROXIED = ("/v1/completions", "/v1/chat/completions")
#: Client headers passed on to both legs.
FORWARDED_HEADERS = (b"authorization",)
#: How long a connection closed after an error keeps draining unread input.
_LINGER = 1.0


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything the router needs; the CLI builds one from its flags."""

    prefills: tuple[PrefillSpec, ...]
    decodes: tuple[DecodeSpec, ...]
    host: str = "127.0.0.1"
    #: 0 picks a free port (:meth:`Router.serve` reports it).
    port: int = 8000
    #: The mode of requests that do not set ``kvpush_mode``.
    mode: Mode = Mode.PUSH
    #: Tokens per KV block (vLLM's ``--block-size``), for the load estimate.
    block_size: int = 16
    #: Seconds an upstream call may take in all, the decode's whole stream included.
    timeout: float = 300.0
    #: Seconds the prefill leg may take in all (``None``: ``timeout``).
    prefill_timeout: float | None = None
    #: Seconds to connect to an upstream.
    connect_timeout: float = 5.0
    #: Proxied requests in flight at once; more get 503.
    max_inflight: int = 256
    #: Largest request body in bytes; larger gets 413.
    max_body: int = 16 * 1024 * 1024
    #: Seconds to read a request (and to keep an idle connection), and to send to a client.
    client_timeout: float = 60.0
    #: Seconds a finished decode waits for its prefill leg to end before cancelling it.
    prefill_grace: float = 5.0
    #: A file to append one JSON line per request to (when it arrived, when its
    #: legs left, when it ended: the router's part of the per-request breakdown,
    #: docs/performance.md). None: off.
    timeline_file: str | None = None

    def __post_init__(self) -> None:
        if not self.prefills or not self.decodes:
            raise ConfigError("the router needs at least one prefill and one decode")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        for name in ("block_size", "max_inflight", "max_body"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("timeout", "connect_timeout", "client_timeout", "prefill_grace"):
            _check_seconds(name, getattr(self, name))
        if self.prefill_timeout is not None:
            _check_seconds("prefill_timeout", self.prefill_timeout)


def _check_seconds(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value}")


@dataclass(frozen=True, slots=True)
class RouterStats:
    """A snapshot of the router (:meth:`Router.statistics`; ``GET /health``)."""

    inflight: int
    #: Proxied requests accepted, failed (an upstream error) and refused with 503.
    requests: int
    failures: int
    rejected: int
    prefills: tuple[InstanceLoad, ...]
    decodes: tuple[InstanceLoad, ...]


class Router:
    """The kvpush router. ``await router.serve()`` (in a task group:
    ``port = await tg.start(router.serve)``) until cancelled."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        #: No capacity: the router does not know the upstreams' pools.
        self._ledger = Ledger(len(config.prefills), len(config.decodes))
        self._inflight = self._requests = self._failures = self._rejected = 0
        self._timeouts = Timeouts(
            connect=config.connect_timeout,
            total=config.timeout,
            prefill=config.timeout if config.prefill_timeout is None else config.prefill_timeout,
            grace=config.prefill_grace,
        )
        self._breakdown = Breakdown(None, "router")

    def statistics(self) -> RouterStats:
        return RouterStats(
            self._inflight,
            self._requests,
            self._failures,
            self._rejected,
            self._ledger.prefills,
            self._ledger.decodes,
        )

    async def listen(self) -> Listener[SocketStream]:
        """Bind the configured address (raises ``OSError`` if it cannot)."""
        return await anyio.create_tcp_listener(
            local_host=self.config.host, local_port=self.config.port
        )

    async def serve(
        self,
        listener: Listener[SocketStream] | None = None,
        *,
        task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until cancelled, on ``listener`` or a new one from :meth:`listen`
        (closed at the end); reports the bound port to ``task_status``."""
        if listener is None:
            listener = await self.listen()
        self._breakdown = Breakdown(self.config.timeline_file, "router")
        try:
            async with listener:
                task_status.started(listener.extra(SocketAttribute.local_port))
                await listener.serve(self._connection)
        finally:
            self._breakdown.close()

    async def _connection(self, stream: ByteStream) -> None:
        conn = ServerConn(stream, send_timeout=self.config.client_timeout)
        linger = 0.0
        try:
            while True:
                try:
                    with anyio.fail_after(self.config.client_timeout):
                        request = await conn.next_request(self.config.max_body)
                except BodyTooLarge:
                    message = f"request body over {self.config.max_body} bytes"
                    await conn.respond(413, error_body(413, message), close=True)
                    linger = _LINGER
                    break
                except h11.RemoteProtocolError as exc:
                    if conn.can_respond:
                        status = exc.error_status_hint
                        await conn.respond(status, error_body(status, str(exc)), close=True)
                        linger = _LINGER
                    break
                except TimeoutError:
                    break
                if request is None or not await self._route(conn, request):
                    break
                if not conn.next_cycle():
                    break
        except ClientGone:
            pass
        except Exception:
            log.exception("kvpush router: connection handler failed")
        finally:
            await conn.close(linger=linger)

    async def _route(self, conn: ServerConn, request: Incoming) -> bool:
        """Answer one request; True when the connection may carry another."""
        path, method = request.path, request.method
        if path in PROXIED:
            if method != "POST":
                return await _error(conn, 405, f"{path} takes POST")
            return await self._proxy(conn, request)
        if path == "/health":
            if method != "GET":
                return await _error(conn, 405, "/health takes GET")
            await conn.respond(200, json.dumps(self._health()).encode())
            return True
        if path == "/v1/models":
            if method != "GET":
                return await _error(conn, 405, "/v1/models takes GET")
            return await self._models(conn, request)
        return await _error(conn, 404, f"no route for {method} {path}")

    def _health(self) -> dict[str, Any]:
        stats = self.statistics()

        def loads(specs: tuple[Any, ...], values: tuple[InstanceLoad, ...]) -> list[dict[str, Any]]:
            return [
                {
                    "url": str(s.url),
                    "outstanding": v.outstanding,
                    "reserved_blocks": v.reserved_blocks,
                }
                for s, v in zip(specs, values, strict=True)
            ]

        return {
            "status": "ok",
            "inflight": stats.inflight,
            "requests": stats.requests,
            "failures": stats.failures,
            "rejected": stats.rejected,
            "prefills": loads(self.config.prefills, stats.prefills),
            "decodes": loads(self.config.decodes, stats.decodes),
        }

    async def _models(self, conn: ServerConn, request: Incoming) -> bool:
        url = self.config.decodes[0].url
        try:
            with anyio.fail_after(self.config.timeout):
                async with upstream(
                    url,
                    "GET",
                    "/v1/models",
                    headers=_forwarded(request),
                    connect_timeout=self.config.connect_timeout,
                ) as resp:
                    body = await resp.read(MAX_UPSTREAM_BODY)
        except TimeoutError:
            message = f"decode {url}: no answer within {self.config.timeout:g} s"
            return await _error(conn, 504, message)
        except UpstreamError as exc:
            status = 504 if exc.kind is FailureKind.TIMEOUT else 502
            return await _error(conn, status, f"decode {url}: {exc.detail}")
        await conn.respond(resp.status, body)
        return True

    async def _proxy(self, conn: ServerConn, request: Incoming) -> bool:
        if self._inflight >= self.config.max_inflight:
            self._rejected += 1
            return await _error(conn, 503, f"router busy: {self._inflight} requests in flight")
        try:
            body = json.loads(request.body)
            if not isinstance(body, dict):
                raise RequestError(400, "the request body must be a JSON object")
            mode = take_mode(body, self.config.mode)
        except RequestError as exc:
            return await _error(conn, exc.status, exc.message)
        except ValueError as exc:
            return await _error(conn, 400, f"the request body is not JSON: {exc}")
        blocks = estimate_blocks(estimate_prompt_tokens(body), self.config.block_size)
        tid = new_transfer_id()
        self._breakdown.stamp(tid, "received")
        choice = self._ledger.acquire(blocks)
        assert choice is not None  # no capacity: there is always a pick
        p, d = choice.prefill, choice.decode
        prefill, decode = self.config.prefills[p], self.config.decodes[d]
        pre, dec = split_request(body, transfer_id=tid, mode=mode, prefill=prefill, decode=decode)
        log.debug("kvpush router: %s %s -> %s + %s", tid, mode.value, prefill.url, decode.url)
        exchange = Exchange(
            conn,
            request.path,
            tid,
            LegPlan(prefill.url, _json(pre), lambda: self._ledger.release_prefill(p, blocks)),
            LegPlan(decode.url, _json(dec), lambda: self._ledger.release_decode(d, blocks)),
            _forwarded(request),
            self._timeouts,
        )
        self._inflight += 1
        self._requests += 1
        self._breakdown.stamp(tid, "dispatched")
        try:
            return await exchange.run()
        finally:
            self._inflight -= 1
            if exchange.failure is not None:
                self._failures += 1
            self._breakdown.stamp(tid, "answered")
            failure = exchange.failure
            self._breakdown.write(
                tid, transfer_id=tid, mode=mode.value, outcome=failure.detail if failure else "ok"
            )


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _forwarded(request: Incoming) -> list[tuple[str, str]]:
    return [(k.decode(), v.decode("latin-1")) for k, v in request.headers if k in FORWARDED_HEADERS]


async def _error(conn: ServerConn, status: int, message: str) -> bool:
    await conn.respond(status, error_body(status, message))
    return True
