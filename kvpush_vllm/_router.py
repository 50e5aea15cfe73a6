"""The kvpush router: an OpenAI-compatible HTTP proxy for disaggregated vLLM.

Each completion request goes to a prefill and a decode instance **at once**,
with one transfer id, so the decode reserves and registers its KV blocks while
the prefill computes (the point of push; see docs/router.md). This module is
the command line and the public face; the parts live in ``_router_core``
(decisions, no I/O), ``_router_http`` (h11 pumps), ``_router_exchange`` (one
request) and ``_router_server`` (the server).

Run it with ``kvpush router --prefill http://p:8100@p:9100 --decode http://d:8200``
or from Python with :func:`router_main`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import anyio

from kvpush.protocol import ConfigError, Mode

from ._params import TransferParams
from ._router_core import DecodeSpec, PrefillSpec
from ._router_server import Router, RouterConfig, RouterStats

__all__ = (
    "DecodeSpec",
    "PrefillSpec",
    "Router",
    "RouterConfig",
    "RouterStats",
    "TransferParams",
    "add_router_arguments",
    "config_from_args",
    "read_secret",
    "router_main",
    "run_router",
)

log = logging.getLogger("kvpush.router")
T = TypeVar("T")
#: The environment variable that carries the shared secret when no --secret-file is given.
SECRET_ENV = "KVPUSH_SECRET"


def _spec(parse: Callable[[str], T]) -> Callable[[str], T]:
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def convert(text: str) -> float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return convert


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the router's flags to ``parser`` (``kvpush router`` uses this)."""
    parser.add_argument(
        "--prefill",
        action="extend",
        nargs="+",
        required=True,
        type=_spec(PrefillSpec.parse),
        metavar="URL@CTRL",
        help="a prefill instance: its HTTP URL and its kvpush control address, "
        "e.g. http://10.0.0.1:8100@10.0.0.1:9100 (repeat or list several)",
    )
    parser.add_argument(
        "--decode",
        action="extend",
        nargs="+",
        required=True,
        type=_spec(DecodeSpec.parse),
        metavar="URL[@NAME]",
        help="a decode instance: its HTTP URL, optionally @NAME, the engine name the "
        "prefill leg's peer carries (default: the URL) (repeat or list several)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any)")
    parser.add_argument(
        "--mode",
        choices=[m.value for m in Mode],
        default=Mode.PUSH.value,
        help="default transfer mode; a request's kvpush_mode field overrides it",
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block, for the load estimate"
    )
    parser.add_argument(
        "--timeout",
        type=_positive(float),
        default=300.0,
        help="seconds an upstream call may take in all (the decode's whole stream included)",
    )
    parser.add_argument(
        "--prefill-timeout",
        type=_positive(float),
        default=None,
        help="seconds the prefill leg may take in all (default: --timeout); a prefill "
        "computes one token, so this can be far shorter than a whole decode stream",
    )
    parser.add_argument(
        "--connect-timeout", type=_positive(float), default=5.0, help="seconds to connect upstream"
    )
    parser.add_argument(
        "--max-inflight", type=int, default=256, help="requests in flight at once; more get 503"
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=16 * 1024 * 1024, help="larger requests get 413"
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    parser.add_argument(
        "--secret-file",
        default=None,
        metavar="PATH",
        help="a file holding the connectors' shared secret (>= 16 bytes; one trailing "
        f"newline dropped); the router seals its decode legs with it, so decodes trust "
        f"them without allowed_peers (default: ${SECRET_ENV}, else unsealed)",
    )
    parser.add_argument(
        "--metrics-interval",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds between reads of each decode's /metrics for its suspect blocks (0: off)",
    )
    parser.add_argument(
        "--timeline-file",
        default=None,
        metavar="PATH",
        help="append one JSON line per request (arrived, legs sent, answered; "
        "time.monotonic) for the per-request breakdown (docs/performance.md)",
    )


def read_secret(path: str | None, environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The shared secret: the file at ``path`` (one trailing newline dropped),
    else ``$KVPUSH_SECRET``, else ``None`` (raises ``ConfigError``)."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                secret = f.read()
        except OSError as exc:
            raise ConfigError(f"cannot read the secret file: {exc}") from None
        secret = secret.removesuffix(b"\n").removesuffix(b"\r")
    else:
        text = environ.get(SECRET_ENV)
        if not text:
            return None
        secret = text.encode()
    if len(secret) < 16:
        raise ConfigError("the shared secret must be at least 16 bytes")
    return secret


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The :class:`RouterConfig` for parsed flags (raises ``ConfigError``)."""
    return RouterConfig(
        prefills=tuple(args.prefill),
        decodes=tuple(args.decode),
        host=args.host,
        port=args.port,
        mode=Mode(args.mode),
        block_size=args.block_size,
        timeout=args.timeout,
        prefill_timeout=args.prefill_timeout,
        connect_timeout=args.connect_timeout,
        max_inflight=args.max_inflight,
        max_body=args.max_body_bytes,
        timeline_file=getattr(args, "timeline_file", None),
        secret=read_secret(getattr(args, "secret_file", None)),
        metrics_interval=getattr(args, "metrics_interval", 2.0),
    )


async def _serve_until_signalled(router: Router) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        listener = await router.listen()  # outside the task group: a plain OSError
        async with anyio.create_task_group() as tg:
            port = await tg.start(router.serve, listener)
            config = router.config
            log.info(
                "kvpush router on http://%s:%d: %d prefill, %d decode, mode %s",
                config.host,
                port,
                len(config.prefills),
                len(config.decodes),
                config.mode.value,
            )
            async for signum in signals:
                log.info("kvpush router: %s, stopping", signal.Signals(signum).name)
                break
            tg.cancel_scope.cancel()


def run_router(args: argparse.Namespace) -> int:
    """Run the router for parsed flags until SIGINT or SIGTERM; the exit status."""
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"), format="%(asctime)s %(levelname)s %(message)s"
    )
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"kvpush router: {exc}", file=sys.stderr)
        return 2
    try:
        anyio.run(_serve_until_signalled, Router(config))
    except OSError as exc:
        where = f"{config.host}:{config.port}"
        print(f"kvpush router: cannot listen on {where}: {exc}", file=sys.stderr)
        return 1
    return 0


def router_main(argv: Sequence[str] | None = None) -> int:
    """``kvpush router [flags]``: parse ``argv`` (default ``sys.argv[1:]``) and run.
    Returns the exit status: 0 after SIGINT/SIGTERM, 2 for bad flags, 1 if it cannot listen."""
    parser = argparse.ArgumentParser(
        prog="kvpush router",
        description="OpenAI-compatible proxy that sends each request to a prefill and a "
        "decode instance at once (see docs/router.md).",
    )
    add_router_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad flag (2)
        return exc.code if isinstance(exc.code, int) else 2
    return run_router(args)
