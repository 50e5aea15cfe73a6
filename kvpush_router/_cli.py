"""``kvpush router``'s command line: :class:`RouterOptions`, one field per flag,
and :func:`router_main`.

Run it with ``kvpush router --prefill http://p:8100@p:9100 --decode http://d:8200``
or from Python with :func:`router_main`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import anyio

from kvpush.protocol import (
    ConfigError,
    Mode,
    add_arguments,
    check_options,
    from_arguments,
    option,
    option_specs,
)

from ._core import DecodeSpec, PrefillSpec
from ._server import Router, RouterConfig, RouterStats

__all__ = (
    "DecodeSpec",
    "PrefillSpec",
    "Router",
    "RouterConfig",
    "RouterOptions",
    "RouterStats",
    "add_router_arguments",
    "read_secret",
    "router_main",
    "run_router",
)

log = logging.getLogger("kvpush.router")
#: The environment variable that carries the shared secret when no --secret-file is given.
SECRET_ENV = "KVPUSH_SECRET"


def _as(name: str) -> Any:
    """:class:`RouterConfig`'s setting ``name`` as a flag: its default, range and help."""
    (setting,) = (f for f in fields(RouterConfig) if f.name == name)
    return field(default=setting.default, metadata=setting.metadata)


@dataclass(frozen=True, slots=True)
class RouterOptions:
    """``kvpush router``'s flags, one field each (``--timeout``: ``timeout``;
    ``--block-size``, vLLM's name: ``tokens_per_block``). Where a flag sets a
    :class:`RouterConfig` setting, the setting declares it."""

    prefill: tuple[str, ...] = option(
        help="a prefill instance: its HTTP URL and its kvpush control address, "
        "e.g. http://10.0.0.1:8100@10.0.0.1:9100 (repeat or list several)",
        cli=False,
    )
    decode: tuple[str, ...] = option(
        help="a decode instance: its HTTP URL, optionally @NAME, the engine name the "
        "prefill leg's peer carries (default: the URL) (repeat or list several)",
        cli=False,
    )
    host: str = _as("host")
    port: int = _as("port")
    mode: Mode = _as("mode")  # noqa: RUF009 (a field, as option() makes)
    tokens_per_block: int = _as("tokens_per_block")
    timeout: float = _as("timeout")
    prefill_timeout: float | None = _as("prefill_timeout")
    connect_timeout: float = _as("connect_timeout")
    max_inflight: int = _as("max_inflight")
    max_body_bytes: int = _as("max_body")
    log_level: str = option(
        "INFO", "DEBUG, INFO, WARNING or ERROR", choices=("DEBUG", "INFO", "WARNING", "ERROR")
    )
    secret_file: str | None = option(
        None,
        "a file holding the connectors' shared secret (>= 16 bytes; one trailing newline "
        "dropped); the router seals its decode legs with it, so decodes trust them without "
        f"allowed_peers (None: ${SECRET_ENV}, else unsealed)",
    )
    metrics_interval: float = _as("metrics_interval")
    timeline_file: str | None = _as("timeline_file")

    def __post_init__(self) -> None:
        check_options(self)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterOptions:
        """The options :func:`add_router_arguments`' flags parsed into ``args``
        (raises ``ConfigError``)."""
        prefill, decode = (tuple(getattr(args, name, None) or ()) for name in ("prefill", "decode"))
        return from_arguments(cls, args, what="kvpush router", prefill=prefill, decode=decode)

    def config(self) -> RouterConfig:
        """The router's :class:`RouterConfig` (reads the secret; raises ``ConfigError``)."""
        return RouterConfig(
            prefills=tuple(map(PrefillSpec.parse, self.prefill)),
            decodes=tuple(map(DecodeSpec.parse, self.decode)),
            host=self.host,
            port=self.port,
            mode=self.mode,
            tokens_per_block=self.tokens_per_block,
            timeout=self.timeout,
            prefill_timeout=self.prefill_timeout,
            connect_timeout=self.connect_timeout,
            max_inflight=self.max_inflight,
            max_body=self.max_body_bytes,
            timeline_file=self.timeline_file,
            secret=read_secret(self.secret_file),
            metrics_interval=self.metrics_interval,
        )


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the router's flags to ``parser`` (``kvpush router`` uses this)."""
    helps = {f.name: spec.help for f, spec, _ in option_specs(RouterOptions)}
    # Repeatable and required, which add_arguments' flags are not.
    for name, metavar in (("prefill", "URL@CTRL"), ("decode", "URL[@NAME]")):
        parser.add_argument(
            f"--{name}",
            action="extend",
            nargs="+",
            required=True,
            metavar=metavar,
            help=helps[name],
        )
    add_arguments(parser, RouterOptions)


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
    try:
        options = RouterOptions.from_args(args)
        config = options.config()
    except ConfigError as exc:
        print(f"kvpush router: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=options.log_level, format="%(asctime)s %(levelname)s %(message)s")
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
