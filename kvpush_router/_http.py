"""HTTP/1.1 for the router: h11 does all the parsing, these are its thin pumps
over anyio byte streams, one for the client side of the router (``ServerConn``)
and one for each upstream leg (:func:`upstream`).

Errors are sorted where they arise: a client that is gone becomes
:class:`ClientGone`, an upstream that fails becomes :class:`UpstreamError`
with a :class:`FailureKind`, so the pump never has to guess whose socket broke.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from http import HTTPStatus

import anyio
import h11
from anyio.abc import ByteStream

from ._core import FailureKind, UpstreamUrl

__all__ = (
    "BodyTooLarge",
    "ClientGone",
    "Incoming",
    "ServerConn",
    "UpstreamError",
    "UpstreamResponse",
    "upstream",
)

_RECEIVE = 65536
_MAX_HEAD = 64 * 1024
_KNOWN_STATUS = frozenset(HTTPStatus)
_STREAM_ERRORS = (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError)
Headers = Iterable[tuple[str, str]]


class ClientGone(Exception):
    """The client closed its connection, or stopped reading for a whole send timeout."""


class BodyTooLarge(Exception):
    """The request body is over the limit (answered with 413)."""


class UpstreamError(Exception):
    """An upstream call failed: ``kind`` says how."""

    def __init__(self, kind: FailureKind, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


async def _next_event(conn: h11.Connection, stream: ByteStream) -> h11.Event:
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Event):
            return event
        if event is h11.PAUSED:
            raise h11.LocalProtocolError("next_event() while paused")
        try:
            data = await stream.receive(_RECEIVE)
        except anyio.EndOfStream:
            data = b""
        conn.receive_data(data)


def _header(headers: Iterable[tuple[bytes, bytes]], name: str) -> str | None:
    key = name.lower().encode()
    for k, v in headers:
        if k == key:
            return v.decode("latin-1")
    return None


@dataclass(frozen=True, slots=True)
class Incoming:
    """A client's request, read whole."""

    method: str
    path: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        return _header(self.headers, name)


class ServerConn:
    """One client connection: read requests, write responses (h11 server side)."""

    def __init__(self, stream: ByteStream, *, send_timeout: float) -> None:
        self._stream = stream
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        self._send_timeout = send_timeout

    async def next_request(self, max_body: int) -> Incoming | None:
        """The next request, or ``None`` when the client closed between requests.

        Raises :class:`BodyTooLarge`, :class:`ClientGone` or
        ``h11.RemoteProtocolError`` (malformed request; answer 400 and close)."""
        try:
            event = await _next_event(self._conn, self._stream)
            if isinstance(event, h11.ConnectionClosed):
                return None
            if not isinstance(event, h11.Request):
                raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}")
            length = _header(event.headers, "content-length")
            if length is not None and int(length) > max_body:
                raise BodyTooLarge
            if self._conn.they_are_waiting_for_100_continue:
                await self._send(h11.InformationalResponse(status_code=100, headers=[]))
            body = bytearray()
            while True:
                part = await _next_event(self._conn, self._stream)
                if isinstance(part, h11.EndOfMessage):
                    break
                if isinstance(part, h11.Data):
                    body += part.data
                    if len(body) > max_body:
                        raise BodyTooLarge
        except _STREAM_ERRORS as exc:
            raise ClientGone(str(exc)) from None
        target = event.target.decode("latin-1")
        path = target.split("?", 1)[0]
        return Incoming(event.method.decode("ascii"), path, tuple(event.headers), bytes(body))

    @property
    def can_respond(self) -> bool:
        """No response head sent yet for the current request."""
        return self._conn.our_state in (h11.IDLE, h11.SEND_RESPONSE)

    async def _send(self, event: h11.Event) -> None:
        data = self._conn.send(event)
        if not data:
            return
        # Shielded so a cancelled exchange never leaves half an HTTP frame
        # behind, bounded so a client that stops reading cannot hold it.
        with anyio.CancelScope(shield=True):
            try:
                with anyio.fail_after(self._send_timeout):
                    await self._stream.send(data)
            except (TimeoutError, *_STREAM_ERRORS) as exc:
                self._conn.send_failed()
                raise ClientGone(str(exc) or type(exc).__name__) from None

    async def start(self, status: int, headers: Headers, *, close: bool = False) -> None:
        """Send the response head (the body follows with :meth:`send_data`)."""
        head = [(k.encode(), v.encode()) for k, v in headers]
        if close:
            head.append((b"connection", b"close"))
        reason = HTTPStatus(status).phrase if status in _KNOWN_STATUS else ""
        await self._send(h11.Response(status_code=status, headers=head, reason=reason))

    async def send_data(self, data: bytes) -> None:
        if data:
            await self._send(h11.Data(data=data))

    async def end(self) -> None:
        await self._send(h11.EndOfMessage())

    async def respond(
        self, status: int, body: bytes, headers: Headers = (), *, close: bool = False
    ) -> None:
        """A whole response with a JSON body."""
        head = [("content-type", "application/json"), ("content-length", str(len(body)))]
        await self.start(status, [*head, *headers], close=close)
        await self.send_data(body)
        await self.end()

    async def wait_gone(self) -> None:
        """Return once the client has closed (read while a response is produced;
        bytes of a pipelined next request are kept for h11)."""
        while True:
            try:
                data = await self._stream.receive(_RECEIVE)
            except (anyio.EndOfStream, *_STREAM_ERRORS):
                return
            self._conn.receive_data(data)
            if len(self._conn.trailing_data[0]) > _MAX_HEAD:
                await anyio.sleep_forever()  # stop reading; the peer is misbehaving

    def next_cycle(self) -> bool:
        """Get ready for the next request on this connection, if it can carry one."""
        if self._conn.our_state is h11.DONE and self._conn.their_state is h11.DONE:
            self._conn.start_next_cycle()
            return True
        return False

    async def close(self, *, linger: float = 0.0) -> None:
        """Close; with ``linger``, first half-close and drain the client's input
        for up to that long, so an unread request does not turn into a reset
        that destroys the response still in flight."""
        if linger > 0:
            with anyio.move_on_after(linger), suppress(Exception):
                await self._stream.send_eof()
                while await self._stream.receive(_RECEIVE):
                    pass
        await anyio.aclose_forcefully(self._stream)


class UpstreamResponse:
    """An upstream's response: the head is here, the body is read on demand."""

    def __init__(self, conn: h11.Connection, stream: ByteStream, head: h11.Response) -> None:
        self._conn, self._stream = conn, stream
        self.status: int = head.status_code
        self.headers: tuple[tuple[bytes, bytes], ...] = tuple(head.headers)

    def header(self, name: str) -> str | None:
        return _header(self.headers, name)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, chunk by chunk as it arrives."""
        while True:
            try:
                event = await _next_event(self._conn, self._stream)
            except (h11.ProtocolError, *_STREAM_ERRORS) as exc:
                why = str(exc) or type(exc).__name__
                raise UpstreamError(FailureKind.BROKEN, f"response broke off: {why}") from None
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                raise UpstreamError(FailureKind.BROKEN, f"unexpected {type(event).__name__}")

    async def read(self, limit: int) -> bytes:
        """The whole body (at most ``limit`` bytes)."""
        body = bytearray()
        async for chunk in self.chunks():
            body += chunk
            if len(body) > limit:
                raise UpstreamError(FailureKind.BROKEN, f"response over {limit} bytes")
        return bytes(body)


@asynccontextmanager
async def upstream(
    url: UpstreamUrl,
    method: str,
    path: str,
    *,
    headers: Headers = (),
    body: bytes = b"",
    connect_timeout: float,
) -> AsyncIterator[UpstreamResponse]:
    """Send one request on a fresh connection; yield the response once its head
    arrived. Leaving the block closes the connection, which vLLM takes as the
    client going away: it aborts the request if it is still running."""
    try:
        with anyio.fail_after(connect_timeout):
            stream: ByteStream = await anyio.connect_tcp(url.host, url.port)
    except TimeoutError:
        raise UpstreamError(FailureKind.TIMEOUT, "connect timed out") from None
    except OSError as exc:
        raise UpstreamError(FailureKind.CONNECT, f"cannot connect: {exc}") from None
    try:
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEAD)
        head = [
            ("host", url.authority),
            ("content-length", str(len(body))),
            ("connection", "close"),
            *headers,
        ]
        try:
            request = h11.Request(method=method, target=url.target(path), headers=head)
            for event in (request, h11.Data(data=body), h11.EndOfMessage()):
                data = conn.send(event)
                if data:
                    await stream.send(data)
            response = await _next_event(conn, stream)
            while isinstance(response, h11.InformationalResponse):
                response = await _next_event(conn, stream)
        except (h11.ProtocolError, *_STREAM_ERRORS) as exc:
            why = str(exc) or type(exc).__name__
            raise UpstreamError(FailureKind.BROKEN, f"connection lost: {why}") from None
        if not isinstance(response, h11.Response):
            raise UpstreamError(FailureKind.BROKEN, "closed without a response")
        yield UpstreamResponse(conn, stream, response)
    finally:
        await anyio.aclose_forcefully(stream)
