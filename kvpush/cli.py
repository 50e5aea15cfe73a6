"""The ``kvpush`` command line (``kvpush demo ...``, ``python -m kvpush demo ...``)."""

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
        help="run a prefill and a decode instance on loopback and hand off KV between them",
        description="Start a router, a prefill instance and a decode instance (a leader "
        "process plus one process per TP rank each) on this machine, hand off the KV of "
        "--requests requests over shared memory, check every block, and report the phase "
        "timeline.",
    )
    add_arguments(demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    from kvpush.demo import run

    status: int = run(args)
    return status
