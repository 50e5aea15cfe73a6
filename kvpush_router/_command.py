"""``kvpush router``: the ``router`` entry of the ``kvpush.commands`` registry
(``pyproject.toml``; docs/architecture.md).

This module needs only the standard library, so that ``kvpush --help`` lists
the command even without the router's h11: the router itself
(:mod:`kvpush_router._cli`) is imported when the command's arguments are
added, and an :class:`ImportError` there makes ``kvpush router`` print why,
with :data:`INSTALL_HINT`.
"""

from __future__ import annotations

import argparse

__all__ = ("DESCRIPTION", "HELP", "INSTALL_HINT", "add_arguments", "run")

HELP = (
    "OpenAI-compatible proxy for disaggregated vLLM: each request to a prefill "
    "and a decode instance at once"
)
DESCRIPTION = (
    "Proxy /v1/completions and /v1/chat/completions: dispatch every request "
    "to a prefill instance (max_tokens=1) and a decode instance at the same time, with "
    "one kvpush transfer id, and stream the decode's answer back (docs/router.md)."
)
INSTALL_HINT = "install kvpush[router]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ._cli import add_router_arguments

    add_router_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ._cli import run_router

    return run_router(args)
