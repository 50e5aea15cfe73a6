"""One proxied request: both legs at once, the decode's response relayed as it
arrives, either leg's failure cancelling the other.

The exchange runs in one task group: the prefill leg and a watcher of the
client connection as child tasks, the decode leg in the group's own task
(it writes to the client). Cancelling a leg leaves its ``upstream`` block,
which closes that connection; vLLM aborts a request whose client went away.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import anyio

from ._params import LegRole
from ._router_core import (
    Failure,
    FailureKind,
    UpstreamUrl,
    error_body,
    failure_status,
    sse_error_event,
    upstream_message,
)
from ._router_http import ClientGone, ServerConn, UpstreamError, upstream

__all__ = ("Exchange", "LegPlan", "Timeouts")

log = logging.getLogger("kvpush.router")

#: Largest prefill (or error) body the router reads whole.
MAX_UPSTREAM_BODY = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class LegPlan:
    """Where one leg goes and what it sends."""

    url: UpstreamUrl
    body: bytes
    #: Called once when the leg ends, however it ends (gives its load back).
    release: Callable[[], None]


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect: float
    #: The decode leg's total (its whole stream included).
    total: float
    #: The prefill leg's total.
    prefill: float
    #: How long a finished decode waits for its prefill leg before cancelling it.
    grace: float


class Exchange:
    """Run :meth:`run` once per proxied request."""

    def __init__(
        self,
        conn: ServerConn,
        path: str,
        transfer_id: str,
        prefill: LegPlan,
        decode: LegPlan,
        headers: Iterable[tuple[str, str]],
        timeouts: Timeouts,
    ) -> None:
        self._conn, self._path, self._tid = conn, path, transfer_id
        self._prefill, self._decode = prefill, decode
        self._headers = (
            ("content-type", "application/json"),
            ("x-request-id", transfer_id),
            *headers,
        )
        self._timeouts = timeouts
        self._released: set[LegRole] = set()
        self._decode_scope = anyio.CancelScope()
        self._prefill_done = anyio.Event()
        self.failure: Failure | None = None
        self._client_gone = False
        self._decoded = False
        self._sse = False

    async def run(self) -> bool:
        """Proxy the request; True when the connection can carry another one.
        Raises :class:`ClientGone` when the client left (both legs cancelled)."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._prefill_leg)
                tg.start_soon(self._watch_client, tg.cancel_scope)
                await self._decode_leg()
                if self.failure is None and self._decoded:
                    with anyio.move_on_after(self._timeouts.grace):
                        await self._prefill_done.wait()
                tg.cancel_scope.cancel()
        finally:
            self._release("prefill")
            self._release("decode")
        if self._client_gone:
            raise ClientGone("client closed the connection")
        if self.failure is None:
            return True
        return await self._report(self.failure)

    def _release(self, leg: LegRole) -> None:
        if leg not in self._released:
            self._released.add(leg)
            (self._prefill if leg == "prefill" else self._decode).release()

    def _fail(self, failure: Failure) -> None:
        if self._decoded:  # the client has its whole answer: nothing to undo
            log.info("kvpush router: %s: after the decode finished: %s", self._tid, failure.detail)
        elif self.failure is None:
            log.warning("kvpush router: %s: %s", self._tid, failure.detail)
            self.failure = failure
            self._decode_scope.cancel()

    async def _watch_client(self, scope: anyio.CancelScope) -> None:
        await self._conn.wait_gone()
        self._client_gone = True
        if not self._decoded:  # after a whole answer, the prefill leg keeps its grace
            scope.cancel()

    async def _call(self, leg: LegRole, plan: LegPlan) -> tuple[int, bytes]:
        with anyio.fail_after(self._limit(leg)):
            async with upstream(
                plan.url,
                "POST",
                self._path,
                headers=self._headers,
                body=plan.body,
                connect_timeout=self._timeouts.connect,
            ) as resp:
                if 200 <= resp.status < 300 and leg == "decode":
                    await self._relay(resp.status, resp.header("content-type"), resp.chunks())
                    return resp.status, b""
                return resp.status, await resp.read(MAX_UPSTREAM_BODY)

    def _limit(self, leg: LegRole) -> float:
        return self._timeouts.prefill if leg == "prefill" else self._timeouts.total

    async def _leg(self, leg: LegRole, plan: LegPlan) -> Failure | None:
        try:
            status, body = await self._call(leg, plan)
        except TimeoutError:
            detail = f"{leg} {plan.url}: no answer within {self._limit(leg):g} s"
            if leg == "decode" and not self._prefill_done.is_set():
                detail += f"; prefill {self._prefill.url} had not answered either"
            return Failure(leg, FailureKind.TIMEOUT, detail)
        except UpstreamError as exc:
            return Failure(leg, exc.kind, f"{leg} {plan.url}: {exc.detail}")
        if not 200 <= status < 300:
            detail = f"{leg} {plan.url} answered {status}: {upstream_message(body)}"
            return Failure(leg, FailureKind.STATUS, detail, status)
        return None

    async def _prefill_leg(self) -> None:
        try:
            failure = await self._leg("prefill", self._prefill)
        finally:
            self._release("prefill")
            self._prefill_done.set()
        if failure is not None:
            self._fail(failure)

    async def _decode_leg(self) -> None:
        failure = None
        try:
            with self._decode_scope:
                failure = await self._leg("decode", self._decode)
        except ClientGone:
            self._client_gone = True
        finally:
            self._release("decode")
        if failure is not None:
            self._fail(failure)

    async def _relay(
        self, status: int, content_type: str | None, chunks: AsyncIterator[bytes]
    ) -> None:
        """The decode's body to the client, chunk by chunk. The head goes out with
        the first bytes (the first token: the KV has arrived), so a prefill that
        fails before that still gets the client a clean HTTP error."""
        self._sse = (content_type or "").startswith("text/event-stream")
        head = [("content-type", content_type or "application/json"), ("x-request-id", self._tid)]
        async for chunk in chunks:
            if chunk and self._conn.can_respond:
                await self._conn.start(status, head)
            await self._conn.send_data(chunk)
        if self._conn.can_respond:
            await self._conn.start(status, head)
        # Decoded once the last bytes are handed over: the client may read them
        # and hang up before end() returns, and that hang-up must not count as
        # leaving mid-answer (it would cut the prefill leg's grace short).
        self._decoded = True
        await self._conn.end()

    async def _report(self, failure: Failure) -> bool:
        """Tell the client: an HTTP error if no head went out yet, else an SSE
        error event (streams) or a cut connection (a JSON body half sent)."""
        if self._decoded:  # the prefill failed while the last bytes went out
            return True
        status = failure_status(failure)
        if self._conn.can_respond:
            await self._conn.respond(status, error_body(status, failure.detail))
            return True
        if self._sse:
            await self._conn.send_data(sse_error_event(status, failure.detail))
            await self._conn.end()
        return False
