"""The ``kvpush`` command line (``kvpush demo ...``, ``kvpush router ...``,
``kvpush simulate ...``; also ``python -m kvpush ...``). ``router`` is the vLLM
router of ``kvpush_vllm`` and ``simulate`` the fleet simulator of
``kvpush.sim``, each imported only when asked for: this is the application
layer, the one place that composes the packages."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ("main",)


def build_parser() -> argparse.ArgumentParser:
    from kvpush import __version__
    from kvpush.demo import add_arguments

    parser = argparse.ArgumentParser(
        prog="kvpush", description="Push-mode KV-cache handoff between prefill and decode."
    )
    parser.add_argument("--version", action="version", version=f"kvpush {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = commands.add_parser(
        "demo",
        help="run prefill and decode instances on loopback and hand off KV between them",
        description="Start a router and prefill and decode instances (one of each unless "
        "--prefills/--decodes/--preset say otherwise; a leader process plus one process per "
        "TP rank each) on this machine, hand off the KV of --requests requests over NIXL or "
        "shared memory, check every block, and report the phase timeline.",
    )
    add_arguments(demo)
    router = commands.add_parser(
        "router",
        help="OpenAI-compatible proxy for disaggregated vLLM: each request to a prefill "
        "and a decode instance at once",
        description="Proxy /v1/completions and /v1/chat/completions: dispatch every request "
        "to a prefill instance (max_tokens=1) and a decode instance at the same time, with "
        "one kvpush transfer id, and stream the decode's answer back (docs/router.md).",
    )
    simulate = commands.add_parser(
        "simulate",
        help="simulate a P/D fleet (pull, push, bg-pull) on the real protocol core",
        description="Discrete-event model of prefill and decode instances, links and a "
        "router, with the real kvpush producer and consumer on a simulated clock; prints "
        "TTFT and TPOT per mode, QPS and input length (docs/simulation.md).",
    )
    _simulate_arguments(simulate)
    try:
        from kvpush_vllm._router import add_router_arguments
    except ImportError as exc:  # h11 missing: say so when the command is used
        router.set_defaults(router_missing=str(exc))
    else:
        add_router_arguments(router)
    return parser


def _simulate_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpush.sim._cli import add_arguments

    add_arguments(parser)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "simulate":
        from kvpush.sim._cli import run as run_simulation

        return run_simulation(args)
    if args.command == "router":
        missing = getattr(args, "router_missing", None)
        if missing:
            import sys

            print(f"kvpush router: {missing}; install kvpush[router]", file=sys.stderr)
            return 2
        from kvpush_vllm._router import run_router

        return run_router(args)
    from kvpush.demo import run

    status: int = run(args)
    return status
