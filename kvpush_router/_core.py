"""The router's decisions, without I/O: upstream specs, the load estimate,
the two legs' bodies, and the client-facing errors (the choice of upstreams
is :mod:`kvpush.routing`'s).

Nothing here touches a socket or a clock; the pump (``_server``) feeds
requests in and carries the results out.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvpush.protocol import ConfigError, Mode
from kvpush.routing import Side
from kvpush_vllm import PARAMS_KEY, Contract, TransferParams, parse_host_port

__all__ = (
    "DecodeSpec",
    "Failure",
    "FailureKind",
    "PrefillSpec",
    "RequestError",
    "UpstreamUrl",
    "error_body",
    "estimate_blocks",
    "estimate_prompt_tokens",
    "failure_status",
    "split_request",
    "sse_error_event",
    "take_mode",
    "upstream_message",
)

#: The body field that overrides ``--mode`` for one request (stripped before forwarding).
MODE_FIELD = "kvpush_mode"
#: Characters per token when a prompt comes as text (a rough, tokenizer-free estimate).
CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class UpstreamUrl:
    """An upstream's base URL: ``http://host:port[/prefix]`` (no TLS, no user info)."""

    host: str
    port: int
    prefix: str = ""

    @classmethod
    def parse(cls, text: str) -> UpstreamUrl:
        try:
            parts = urlsplit(text)
            port = parts.port
        except ValueError as exc:
            raise ConfigError(f"bad upstream URL {text!r}: {exc}") from None
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError(f"upstream URL must be http://host[:port][/prefix], got {text!r}")
        if parts.username is not None or parts.query or parts.fragment:
            raise ConfigError(f"upstream URL takes no user info, query or fragment: {text!r}")
        return cls(parts.hostname, port or 80, parts.path.rstrip("/"))

    def target(self, path: str) -> str:
        """The request target for ``path`` (``/v1/...``) on this upstream."""
        return self.prefix + path

    @property
    def authority(self) -> str:
        """``host:port`` for the Host header (IPv6 bracketed)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"http://{self.authority}{self.prefix}"


@dataclass(frozen=True, slots=True)
class PrefillSpec:
    """A prefill instance: its HTTP URL and its kvpush control address (``host:port``)."""

    url: UpstreamUrl
    control: str

    @classmethod
    def parse(cls, text: str) -> PrefillSpec:
        """``http://host:port@ctrlhost:ctrlport`` (the last ``@`` splits)."""
        url, sep, control = text.rpartition("@")
        if not sep:
            raise ConfigError(f"prefill must be URL@CONTROL_HOST:PORT, got {text!r}")
        try:
            parse_host_port(control)
        except ConfigError as exc:
            raise ConfigError(f"prefill {text!r}: control address: {exc}") from None
        return cls(UpstreamUrl.parse(url), control)


@dataclass(frozen=True, slots=True)
class DecodeSpec:
    """A decode instance: its HTTP URL and the name the prefill leg's ``peer`` carries."""

    url: UpstreamUrl
    name: str

    @classmethod
    def parse(cls, text: str) -> DecodeSpec:
        """``http://host:port`` (named by its URL) or ``http://host:port@NAME``."""
        url, sep, name = text.rpartition("@")
        if not sep:
            parsed = UpstreamUrl.parse(text)
            return cls(parsed, str(parsed))
        if not name:
            raise ConfigError(f"decode name after '@' is empty in {text!r}")
        return cls(UpstreamUrl.parse(url), name)


def _text_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _prompt_tokens(prompt: object) -> int:
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    if isinstance(prompt, list):
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)  # one prompt as token ids
        return sum(_prompt_tokens(p) for p in prompt)  # a batch of prompts
    return 0


def _content_tokens(content: object) -> int:
    if isinstance(content, str):
        return _text_tokens(content)
    if isinstance(content, list):  # content parts: count the text ones
        return sum(
            _text_tokens(part["text"])
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return 0


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """Prompt length without a tokenizer: token-id lists count exactly, text
    as ``ceil(chars / 4)``; chat messages sum their text contents."""
    tokens = _prompt_tokens(body.get("prompt"))
    messages = body.get("messages")
    if isinstance(messages, list):
        tokens += sum(_content_tokens(m.get("content")) for m in messages if isinstance(m, dict))
    return tokens


def estimate_blocks(tokens: int, tokens_per_block: int) -> int:
    """KV blocks a prompt of ``tokens`` holds: ``ceil(tokens / tokens_per_block)``, at least 1."""
    return max(1, math.ceil(tokens / tokens_per_block))


class RequestError(Exception):
    """The client's request is refused before any upstream sees it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def take_mode(body: dict[str, Any], default: Mode) -> Mode:
    """Pop ``kvpush_mode`` from ``body``: the request's mode, else ``default``."""
    if MODE_FIELD not in body:
        return default
    raw = body.pop(MODE_FIELD)
    try:
        return Mode(raw)
    except ValueError:
        raise RequestError(400, f"{MODE_FIELD} must be 'push' or 'pull', got {raw!r}") from None


def split_request(
    body: Mapping[str, Any],
    *,
    transfer_id: str,
    mode: Mode,
    prefill: PrefillSpec,
    decode: DecodeSpec,
    secret: bytes | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prefill and decode bodies for one client body (``kvpush_mode`` already taken).

    Prefill: one token, not streamed (``stream_options`` and ``min_tokens``
    dropped, vLLM refuses them then). Decode: the body as sent. Both get
    ``kv_transfer_params`` replaced by kvpush's (:class:`kvpush_vllm.TransferParams`); with a
    ``secret`` the decode leg carries the contract's seal (docs/contract.md,
    "Trust"), so a decode with the same secret trusts it without ``allowed_peers``.
    """
    p_params = TransferParams(transfer_id, "prefill", mode, decode.name)
    d_params = TransferParams(transfer_id, "decode", mode, prefill.control)
    pre = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    pre["max_tokens"] = 1
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    pre["stream"] = False
    pre["kv_transfer_params"] = p_params.to_params()
    dec = dict(body)
    dec["kv_transfer_params"] = d_params.to_params()
    if secret is not None:
        dec["kv_transfer_params"][PARAMS_KEY]["seal"] = Contract(secret).seal(d_params)
    return pre, dec


class FailureKind(enum.Enum):
    """How an upstream leg failed."""

    #: Could not connect (refused, unreachable).
    CONNECT = "connect"
    #: A connect or total timeout ran out.
    TIMEOUT = "timeout"
    #: Answered with a non-2xx status.
    STATUS = "status"
    #: The connection broke or spoke bad HTTP mid-exchange.
    BROKEN = "broken"


@dataclass(frozen=True, slots=True)
class Failure:
    """One leg's failure, as the client will hear it."""

    leg: Side
    kind: FailureKind
    detail: str
    #: The upstream's status, for :attr:`FailureKind.STATUS`.
    status: int | None = None
    #: The instance (its URL) that failed.
    instance: str = ""
    #: The upstream's own error message (its body's), for :attr:`FailureKind.STATUS`.
    message: str = ""

    @property
    def down(self) -> bool:
        """The instance looks down: no connection, a timeout, a broken
        exchange or a 5xx (a 4xx is the request's fault, not the instance's)."""
        return self.kind is not FailureKind.STATUS or (self.status or 0) >= 500

    def cause(self) -> dict[str, Any]:
        """The failure for the error body's ``kvpush`` object (:func:`error_body`)."""
        return {
            "leg": self.leg,
            "instance": self.instance,
            "cause": self.kind.value,
            "upstream_status": self.status,
            "upstream_message": self.message,
        }


def failure_status(failure: Failure) -> int:
    """504 for a timeout; the upstream's own 4xx (a client error, retrying will
    not help); 502 otherwise."""
    if failure.kind is FailureKind.TIMEOUT:
        return 504
    if failure.kind is FailureKind.STATUS and failure.status and 400 <= failure.status < 500:
        return failure.status
    return 502


_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "GatewayTimeout",
}


def _error(status: int, message: str, cause: Mapping[str, Any] | None) -> dict[str, Any]:
    kind = _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    error: dict[str, Any] = {"message": message, "type": kind, "param": None, "code": status}
    if cause is not None:
        error["kvpush"] = dict(cause)
    return {"error": error}


def error_body(status: int, message: str, cause: Mapping[str, Any] | None = None) -> bytes:
    """An OpenAI-style JSON error body; ``cause`` (which leg, which instance,
    how it failed, the upstream's status and message) goes in ``error.kvpush``."""
    return json.dumps(_error(status, message, cause)).encode()


def sse_error_event(status: int, message: str, cause: Mapping[str, Any] | None = None) -> bytes:
    """The same error as one server-sent event, for a stream already under way."""
    return b"data: " + json.dumps(_error(status, message, cause)).encode() + b"\n\n"


def upstream_message(body: bytes) -> str:
    """The message of an upstream's error body (OpenAI-style or not), clipped."""
    try:
        parsed = json.loads(body)
        message = parsed["error"]["message"] if isinstance(parsed.get("error"), dict) else None
        message = message or parsed.get("message") or parsed.get("detail")
    except (ValueError, AttributeError, TypeError, KeyError):
        message = None
    text = str(message) if message else body.decode(errors="replace").strip()
    return text[:500]
