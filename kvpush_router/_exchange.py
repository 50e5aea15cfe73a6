"""One proxied request: both legs at once, the decode's response relayed as it
arrives, either leg's failure cancelling the other.

The exchange runs in one task group: the prefill leg and a watcher of the
client connection as child tasks, the decode leg in the group's own task
(it writes to the client). Cancelling a leg leaves its ``upstream`` block,
which closes that connection; vLLM aborts a request whose client went away.

A prefill leg that fails as a down instance does (no connection, a broken
exchange, a 5xx) before the client got a byte is **retried**: the decode
leg is cancelled (it has sent the client nothing) and the request starts
again as a new attempt, with a new transfer id, on the pair the router
picks next (:class:`Upstreams`). A decode leg is never sent again: once it
is under way it may have generated.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import anyio

from kvpush.routing import Side

from ._core import (
    Failure,
    FailureKind,
    UpstreamUrl,
    error_body,
    failure_status,
    sse_error_event,
    upstream_message,
)
from ._http import ClientGone, ServerConn, UpstreamError, upstream

__all__ = ("Attempt", "Exchange", "LegPlan", "Timeouts", "Upstreams")

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
    #: The instance's index on its side.
    index: int = 0


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try at a request: a transfer id and its two legs."""

    transfer_id: str
    prefill: LegPlan
    decode: LegPlan
    #: The transfer mode (``"push"`` or ``"pull"``) and the client's model, for a release leg.
    mode: str = "push"
    model: object = None


class Upstreams(Protocol):
    """What an exchange tells the router, and asks of it."""

    def failed(self, failure: Failure, index: int) -> None:
        """A leg on instance ``index`` of ``failure.leg``'s side failed."""

    def served(self, leg: Side, index: int) -> None:
        """A leg on instance ``index`` answered whole."""

    def retry(self, attempt: Attempt) -> Attempt | None:
        """A new attempt for a request whose prefill leg failed (``None``: no other prefill)."""

    def release(self, attempt: Attempt) -> None:
        """The decode leg failed: tell the prefill to release the KV (fire and forget)."""


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
        attempt: Attempt,
        headers: Iterable[tuple[str, str]],
        timeouts: Timeouts,
        upstreams: Upstreams,
        retries: int = 1,
    ) -> None:
        self._conn, self._path = conn, path
        self._client_headers = tuple(headers)
        self._timeouts = timeouts
        self._upstreams = upstreams
        self._retries = retries
        self.failure: Failure | None = None
        #: Attempts retried (a prefill leg failed before the client got a byte).
        self.retried = 0
        self._client_gone = False
        self._decoded = False
        self._sse = False
        self._start(attempt)

    def _start(self, attempt: Attempt) -> None:
        self.attempt = attempt
        self._tid, self._prefill, self._decode = (
            attempt.transfer_id,
            attempt.prefill,
            attempt.decode,
        )
        self._headers = (
            ("content-type", "application/json"),
            ("x-request-id", self._tid),
            *self._client_headers,
        )
        self._released: set[Side] = set()
        self._decode_scope = anyio.CancelScope()
        self._prefill_done = anyio.Event()
        self._retry = False

    async def run(self) -> bool:
        """Proxy the request; True when the connection can carry another one.
        Raises :class:`ClientGone` when the client left (both legs cancelled)."""
        while True:
            await self._run_attempt()
            if not self._retry or self._client_gone:
                break
            failure, self.failure = self.failure, None
            nxt = self._upstreams.retry(self.attempt)
            if nxt is None:
                self.failure = failure
                break
            log.info("kvpush router: %s: retried as %s", self._tid, nxt.transfer_id)
            self.retried += 1
            self._start(nxt)
        if self._client_gone:
            raise ClientGone("client closed the connection")
        if self.failure is None:
            return True
        return await self._report(self.failure)

    async def _run_attempt(self) -> None:
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

    def _release(self, leg: Side) -> None:
        if leg not in self._released:
            self._released.add(leg)
            (self._prefill if leg == "prefill" else self._decode).release()

    def _fail(self, failure: Failure) -> None:
        if self._decoded:  # the client has its whole answer: nothing to undo
            log.info("kvpush router: %s: after the decode finished: %s", self._tid, failure.detail)
        elif self.failure is None:
            retry = (
                failure.leg == "prefill"
                and failure.down
                and failure.kind is not FailureKind.TIMEOUT
                and self.retried < self._retries
                and self._conn.can_respond  # the client has not had a byte
            )
            log.warning(
                "kvpush router: %s: %s%s", self._tid, failure.detail, "; retrying" if retry else ""
            )
            self.failure = failure
            self._retry = retry
            self._decode_scope.cancel()

    async def _watch_client(self, scope: anyio.CancelScope) -> None:
        await self._conn.wait_gone()
        self._client_gone = True
        if not self._decoded:  # after a whole answer, the prefill leg keeps its grace
            scope.cancel()

    async def _call(self, leg: Side, plan: LegPlan) -> tuple[int, bytes]:
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

    def _limit(self, leg: Side) -> float:
        return self._timeouts.prefill if leg == "prefill" else self._timeouts.total

    async def _leg(self, leg: Side, plan: LegPlan) -> Failure | None:
        failure = await self._try_leg(leg, plan)
        if failure is None:
            self._upstreams.served(leg, plan.index)
        else:
            self._upstreams.failed(failure, plan.index)
        return failure

    async def _try_leg(self, leg: Side, plan: LegPlan) -> Failure | None:
        where = str(plan.url)
        try:
            status, body = await self._call(leg, plan)
        except TimeoutError:
            detail = f"{leg} {where}: no answer within {self._limit(leg):g} s"
            if leg == "decode" and not self._prefill_done.is_set():
                detail += f"; prefill {self._prefill.url} had not answered either"
            return Failure(leg, FailureKind.TIMEOUT, detail, instance=where)
        except UpstreamError as exc:
            return Failure(leg, exc.kind, f"{leg} {where}: {exc.detail}", instance=where)
        if not 200 <= status < 300:
            message = upstream_message(body)
            detail = f"{leg} {where} answered {status}: {message}"
            return Failure(leg, FailureKind.STATUS, detail, status, where, message)
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
            prefill_failed = self.failure is not None and self.failure.leg == "prefill"
            if failure.kind is not FailureKind.TIMEOUT and not prefill_failed:
                # The decode will not take this KV: the prefill releases it now
                # rather than after its kv_hold_timeout.
                self._upstreams.release(self.attempt)
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
        cause = {**failure.cause(), "transfer_id": self._tid}
        if self._conn.can_respond:
            body = error_body(status, failure.detail, cause)
            await self._conn.respond(status, body, [("x-request-id", self._tid)])
            return True
        if self._sse:
            await self._conn.send_data(sse_error_event(status, failure.detail, cause))
            await self._conn.end()
        return False
