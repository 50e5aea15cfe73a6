"""The router's server: accept connections, route requests, run exchanges.

:class:`Router` serves the OpenAI-compatible endpoints; the decisions are the
sans-IO ``_core``'s, the per-request pump is ``_exchange``'s, the HTTP is
h11's (``_http``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import h11
from anyio.abc import ByteStream, Listener, SocketAttribute, SocketStream, TaskStatus

from kvpush.protocol import ConfigError, Mode, check_options, option
from kvpush.routing import Health, InstanceLoad, Ledger, Side
from kvpush_vllm import Breakdown, new_transfer_id, release_params

from ._core import (
    DecodeSpec,
    Failure,
    FailureKind,
    PrefillSpec,
    RequestError,
    UpstreamUrl,
    error_body,
    estimate_blocks,
    estimate_prompt_tokens,
    split_request,
    take_mode,
)
from ._exchange import MAX_UPSTREAM_BODY, Attempt, Exchange, LegPlan, Timeouts
from ._http import BodyTooLarge, ClientGone, Incoming, ServerConn, UpstreamError, upstream

__all__ = ("Router", "RouterConfig", "RouterStats")

log = logging.getLogger("kvpush.router")

#: The endpoints proxied to a prefill and a decode instance at once.
PROXIED = ("/v1/completions", "/v1/chat/completions")
#: Client headers passed on to both legs.
FORWARDED_HEADERS = (b"authorization",)
#: How long a connection closed after an error keeps draining unread input.
_LINGER = 1.0
#: The header that marks a release leg (``x-kvpush-leg: release``).
LEG_HEADER = "x-kvpush-leg"
#: A decode's suspect-blocks gauge: vLLM's ``vllm:kvpush_blocks`` (the connector)
#: or the runtime's ``kvpush:blocks``, ``kind="suspect"``.
_SUSPECT = re.compile(
    r'^(?:vllm:kvpush_blocks|kvpush:blocks)\{[^}]*kind="suspect"[^}]*\}\s+(\S+)', re.MULTILINE
)
#: How often the router looks for due probes.
_TICK = 0.1


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything the router needs; each setting is declared once here, with
    its range, unit and help (the command line's flags take theirs from it:
    :class:`~kvpush_router.RouterOptions`)."""

    prefills: tuple[PrefillSpec, ...]
    decodes: tuple[DecodeSpec, ...]
    host: str = option("127.0.0.1", "address to listen on")
    #: 0 picks a free port (:meth:`Router.serve` reports it).
    port: int = option(8000, "port to listen on (0: any)", low=0, high=65535)
    mode: Mode = option(
        Mode.PUSH,
        "default transfer mode (push or pull); a request's kvpush_mode field overrides it",
    )
    tokens_per_block: int = option(
        16,
        "tokens per KV block (vLLM's --block-size), for the load estimate",
        low=1,
        cli="block-size",
    )
    timeout: float = option(
        300.0,
        "how long an upstream call may take in all (the decode's whole stream included)",
        unit="s",
        above=0,
    )
    prefill_timeout: float | None = option(
        None,
        "how long the prefill leg may take in all (None: the timeout); a prefill computes "
        "one token, so this can be far shorter than a whole decode stream",
        unit="s",
        above=0,
    )
    connect_timeout: float = option(5.0, "how long connecting upstream may take", unit="s", above=0)
    max_inflight: int = option(256, "requests in flight at once; more get 503", low=1)
    max_body: int = option(16 * 1024 * 1024, "larger requests get 413", unit="bytes", low=1)
    client_timeout: float = option(
        60.0,
        "how long reading a request (and an idle connection), or a send to a client, may take",
        unit="s",
        above=0,
    )
    prefill_grace: float = option(
        5.0, "how long a finished decode waits for its prefill leg to end", unit="s", above=0
    )
    timeline_file: str | None = option(
        None,
        "append one JSON line per request (arrived, legs sent, answered; time.monotonic) "
        "for the per-request breakdown (docs/performance.md)",
    )
    #: The connectors' shared secret: the router seals the decode legs with it
    #: (docs/contract.md, "Trust"). None: legs unsealed (``allowed_peers`` then).
    #: Not an option: an option's error would show its value.
    secret: bytes | None = None
    probe_first: float = option(
        0.5, "a down instance's first probe after this long, doubling", unit="s", above=0
    )
    probe_max: float = option(10.0, "the longest wait between probes", unit="s", above=0)
    metrics_interval: float = option(
        2.0, "time between reads of each decode's /metrics for its suspect blocks (0: off)",
        unit="s", low=0,
    )  # fmt: skip
    release_timeout: float = option(
        2.0, "how long a release leg (the prefill frees a failed decode's KV) may take",
        unit="s", above=0,
    )  # fmt: skip
    retries: int = option(
        1, "times a request whose prefill leg failed is tried on another prefill", low=0
    )

    def __post_init__(self) -> None:
        check_options(self)
        if not self.prefills or not self.decodes:
            raise ConfigError("the router needs at least one prefill and one decode")
        if self.secret is not None and len(self.secret) < 16:
            raise ConfigError("the router's secret must be at least 16 bytes")
        if self.probe_max < self.probe_first:
            raise ConfigError("probe_max must be >= probe_first")


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
    #: Requests tried again on another prefill after their prefill leg failed.
    retries: int = 0
    #: Release legs the prefill answered, and those that failed or found no
    #: ``release_params`` to build.
    releases: int = 0
    release_failures: int = 0


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
        self._probes: dict[Side, Health] = {
            "prefill": Health(len(config.prefills), config.probe_first, config.probe_max),
            "decode": Health(len(config.decodes), config.probe_first, config.probe_max),
        }
        self._rng = random.Random()
        self._busy: set[tuple[str, Side, int]] = set()  # probes and scrapes under way
        self._retries = self._releases = self._release_failures = 0
        self._tg: anyio.abc.TaskGroup | None = None

    def statistics(self) -> RouterStats:
        return RouterStats(
            self._inflight,
            self._requests,
            self._failures,
            self._rejected,
            self._ledger.prefills,
            self._ledger.decodes,
            self._retries,
            self._releases,
            self._release_failures,
        )

    # --- health -----------------------------------------------------------------------

    def _url(self, side: Side, index: int) -> UpstreamUrl:
        specs = self.config.prefills if side == "prefill" else self.config.decodes
        return specs[index].url

    def _failed(self, side: Side, index: int, why: str) -> None:
        health = self._probes[side]
        if not health.up(index):
            return
        when = health.failed(index, anyio.current_time(), self._rng.random(), why)
        self._ledger.mark(side, index, up=False)
        log.warning(
            "kvpush router: %s %s is down (%s); probing it in %.1f s",
            side,
            self._url(side, index),
            why,
            when - anyio.current_time(),
        )

    def _served(self, side: Side, index: int) -> None:
        if not self._probes[side].up(index):
            log.info("kvpush router: %s %s answers again", side, self._url(side, index))
        self._probes[side].served(index)
        self._ledger.mark(side, index, up=True)

    async def _watch(self) -> None:
        """Probe the down instances when due; read the decodes' suspect blocks."""
        next_read = 0.0
        assert self._tg is not None
        while True:
            now = anyio.current_time()
            for side, health in self._probes.items():
                for i in health.due(now):
                    self._spawn("probe", side, i, self._probe)
            if self.config.metrics_interval and now >= next_read:
                next_read = now + self.config.metrics_interval
                for i in range(len(self.config.decodes)):
                    if self._probes["decode"].up(i):
                        self._spawn("metrics", "decode", i, self._read_suspect)
            await anyio.sleep(_TICK)

    def _spawn(self, what: str, side: Side, i: int, fn: Callable[[Side, int], Any]) -> None:
        key = (what, side, i)
        if key in self._busy or self._tg is None:
            return
        self._busy.add(key)

        async def run() -> None:
            try:
                await fn(side, i)
            finally:
                self._busy.discard(key)

        self._tg.start_soon(run)

    async def _get(self, url: UpstreamUrl, path: str) -> tuple[int, bytes]:
        with anyio.fail_after(self.config.connect_timeout * 2):
            async with upstream(
                url, "GET", path, connect_timeout=self.config.connect_timeout
            ) as resp:
                return resp.status, await resp.read(MAX_UPSTREAM_BODY)

    async def _probe(self, side: Side, i: int) -> None:
        """``GET /health`` on a down instance: a 2xx brings it back."""
        url = self._url(side, i)
        try:
            status, _ = await self._get(url, "/health")
            why = "" if 200 <= status < 300 else f"/health answered {status}"
        except TimeoutError:
            why = "/health: no answer"
        except UpstreamError as exc:
            why = f"/health: {exc.detail}"
        why = why and f"{side} {url}: {why}"
        health = self._probes[side]
        if not why:
            health.answered(i)
            self._ledger.mark(side, i, up=True)
            log.info("kvpush router: %s %s answers its probe: back in service", side, url)
        else:
            health.probe_failed(i, anyio.current_time(), self._rng.random(), why)

    async def _read_suspect(self, side: Side, i: int) -> None:
        """A decode's suspect blocks from its ``/metrics`` (absent: 0)."""
        try:
            status, body = await self._get(self._url(side, i), "/metrics")
        except (TimeoutError, UpstreamError):
            return  # its legs, not its metrics, say whether it is down
        if 200 <= status < 300:
            found = _SUSPECT.findall(body.decode(errors="replace"))
            blocks = int(sum(float(x) for x in found if _number(x)))
            self._ledger.mark("decode", i, suspect_blocks=blocks)

    def _release_soon(self, attempt: Attempt) -> None:
        if self._tg is not None:
            self._tg.start_soon(self._release, attempt)

    async def _release(self, attempt: Attempt) -> None:
        """Tell the prefill that the decode will not take ``attempt``'s KV: a
        one-token completion whose ``kv_transfer_params`` are the contract's
        ``release_params`` (fire and forget, bounded by ``release_timeout``)."""
        params = release_params(attempt.transfer_id, attempt.mode, self.config.secret)
        body: dict[str, Any] = {
            "prompt": [0],
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": params,
        }
        if attempt.model is not None:
            body["model"] = attempt.model
        headers = [
            ("content-type", "application/json"),
            ("x-request-id", f"{attempt.transfer_id}-release"),
            (LEG_HEADER, "release"),
        ]
        limit = self.config.release_timeout
        ok = False
        try:
            with anyio.fail_after(limit):
                async with upstream(
                    attempt.prefill.url,
                    "POST",
                    "/v1/completions",
                    headers=headers,
                    body=_json(body),
                    connect_timeout=limit,
                ) as resp:
                    await resp.read(MAX_UPSTREAM_BODY)
                    ok = 200 <= resp.status < 300
        except (TimeoutError, UpstreamError) as exc:
            log.debug("kvpush router: %s: release leg failed: %s", attempt.transfer_id, exc)
        if ok:
            self._releases += 1
        else:
            self._release_failures += 1

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
            async with listener, anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._watch)
                task_status.started(listener.extra(SocketAttribute.local_port))
                await listener.serve(self._connection)
        finally:
            self._tg = None
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

        def loads(side: Side, values: tuple[InstanceLoad, ...]) -> list[dict[str, Any]]:
            return [
                {
                    "url": str(self._url(side, i)),
                    "up": v.up,
                    "down_because": self._probes[side].why(i) or None,
                    "outstanding": v.outstanding,
                    "reserved_blocks": v.reserved_blocks,
                    "suspect_blocks": v.suspect_blocks,
                }
                for i, v in enumerate(values)
            ]

        return {
            "status": "ok",
            "inflight": stats.inflight,
            "requests": stats.requests,
            "failures": stats.failures,
            "rejected": stats.rejected,
            "retries": stats.retries,
            "releases": stats.releases,
            "release_failures": stats.release_failures,
            "prefills": loads("prefill", stats.prefills),
            "decodes": loads("decode", stats.decodes),
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
        blocks = estimate_blocks(estimate_prompt_tokens(body), self.config.tokens_per_block)
        legs = _Legs(self, body, mode, blocks, tuple(_forwarded(request)))
        first = legs.attempt()
        if isinstance(first, str):
            self._rejected += 1
            return await self._all_down(conn, first)
        tid = first.transfer_id
        self._breakdown.stamp(tid, "received")
        exchange = Exchange(
            conn,
            request.path,
            first,
            legs.headers,
            self._timeouts,
            legs,
            self.config.retries,
        )
        self._inflight += 1
        self._requests += 1
        self._breakdown.stamp(tid, "dispatched")
        try:
            return await exchange.run()
        finally:
            self._inflight -= 1
            self._retries += exchange.retried
            if exchange.failure is not None:
                self._failures += 1
            self._breakdown.stamp(tid, "answered")
            failure = exchange.failure
            self._breakdown.write(
                tid, transfer_id=tid, mode=mode.value, outcome=failure.detail if failure else "ok"
            )

    async def _all_down(self, conn: ServerConn, side: Side) -> bool:
        """503 at once: every instance of ``side`` is down (each one's cause named)."""
        health = self._probes[side]
        causes = [health.why(i) for i in health.down]
        message = f"every {side} instance is down ({'; '.join(causes)}); try again later"
        nxt = health.next_probe()
        wait = 1 if nxt is None else max(1, math.ceil(nxt - anyio.current_time()))
        cause = {"leg": side, "cause": "down", "instances": causes}
        body = error_body(503, message, cause)
        await conn.respond(503, body, [("retry-after", str(wait))])
        return True


class _Legs:
    """One client request's attempts: builds each attempt's two legs on the
    pair the ledger picks, and carries the exchange's news to the router."""

    def __init__(
        self,
        router: Router,
        body: dict[str, Any],
        mode: Mode,
        blocks: int,
        headers: tuple[tuple[str, str], ...],
    ) -> None:
        self._router, self._body, self._mode, self._blocks = router, body, mode, blocks
        self.headers = headers

    def attempt(self) -> Attempt | Side:
        """A new attempt, or the side that has no instance up."""
        router, blocks, ledger = self._router, self._blocks, self._router._ledger
        if not any(x.up for x in ledger.prefills):
            return "prefill"
        if not any(x.up for x in ledger.decodes):
            return "decode"
        choice = ledger.acquire(blocks)
        assert choice is not None  # no capacity, and an instance of each side up
        p, d = choice.prefill, choice.decode
        config = router.config
        prefill, decode = config.prefills[p], config.decodes[d]
        tid = new_transfer_id()
        pre, dec = split_request(
            self._body,
            transfer_id=tid,
            mode=self._mode,
            prefill=prefill,
            decode=decode,
            secret=config.secret,
        )
        log.debug("kvpush router: %s %s -> %s + %s", tid, self._mode.value, prefill.url, decode.url)
        return Attempt(
            tid,
            LegPlan(prefill.url, _json(pre), lambda: ledger.release_prefill(p, blocks), p),
            LegPlan(decode.url, _json(dec), lambda: ledger.release_decode(d, blocks), d),
            self._mode.value,
            self._body.get("model"),
        )

    def failed(self, failure: Failure, index: int) -> None:
        if failure.down:
            self._router._failed(failure.leg, index, failure.detail)

    def served(self, leg: Side, index: int) -> None:
        self._router._served(leg, index)

    def retry(self, attempt: Attempt) -> Attempt | None:
        nxt = self.attempt()
        return nxt if isinstance(nxt, Attempt) else None

    def release(self, attempt: Attempt) -> None:
        self._router._release_soon(attempt)


def _number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _forwarded(request: Incoming) -> list[tuple[str, str]]:
    return [(k.decode(), v.decode("latin-1")) for k, v in request.headers if k in FORWARDED_HEADERS]


async def _error(conn: ServerConn, status: int, message: str) -> bool:
    await conn.respond(status, error_body(status, message))
    return True
