"""The kvpush router (``kvpush router``): an OpenAI-compatible HTTP proxy for
disaggregated vLLM, an application on kvpush's top floor (docs/architecture.md).

Each completion request goes to a prefill and a decode instance **at once**,
with one transfer id, so the decode reserves and registers its KV blocks while
the prefill computes (the point of push; see docs/router.md). The parts:
``_core`` (decisions, no I/O), ``_http`` (h11 pumps), ``_exchange`` (one
request), ``_server`` (the server), ``_cli`` (the command line) and
``_command`` (its entry in the ``kvpush.commands`` registry).

Importing this package needs only kvpush, so that ``kvpush --help`` lists the
command where h11 is missing (``_command``); the names below import the
router, and h11, when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._cli import RouterOptions, add_router_arguments, read_secret, router_main, run_router
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


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import _cli  # the router: h11

    return getattr(_cli, name)
