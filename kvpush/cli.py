"""The ``kvpush`` command line (``kvpush demo ...``, ``kvpush router ...``,
``kvpush simulate ...``; also ``python -m kvpush ...``).

Each command is an entry of the ``kvpush.commands`` registry (entry points in
``pyproject.toml``; docs/architecture.md): ``demo`` is :mod:`kvpush.demo`'s,
``simulate`` :mod:`kvpush.sim`'s and ``router`` :mod:`kvpush_router`'s. This
module imports none of them by name, so a package above ``kvpush`` (the
router) adds its command without ``kvpush`` depending on it. A
command whose optional dependencies are missing is still listed; running it
says what is missing and how to install it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Protocol

__all__ = ("COMMANDS_GROUP", "Command", "build_parser", "main")

#: The entry-point group commands register under.
COMMANDS_GROUP = "kvpush.commands"


class Command(Protocol):
    """What a ``kvpush.commands`` entry point names: a module (or any object)
    with these four names. ``add_arguments`` may raise
    :class:`ModuleNotFoundError` for a missing optional dependency; the
    command's ``INSTALL_HINT`` string, if it has one, is printed with it."""

    HELP: str
    DESCRIPTION: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def build_parser() -> argparse.ArgumentParser:
    """The parser of every installed command."""
    from kvpush import __version__

    parser = argparse.ArgumentParser(
        prog="kvpush", description="Push-mode KV-cache handoff between prefill and decode."
    )
    parser.add_argument("--version", action="version", version=f"kvpush {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name):
        _add(commands, ep)
    return parser


def _add(commands: argparse._SubParsersAction[argparse.ArgumentParser], ep: EntryPoint) -> None:
    try:
        command: Command = ep.load()
    except ModuleNotFoundError as exc:  # its package, or a library it needs, is not installed
        sub = commands.add_parser(ep.name, help=f"(unavailable: {exc})")
        _unavailable(sub, f"{ep.value} cannot be imported: {exc}")
        return
    sub = commands.add_parser(ep.name, help=command.HELP, description=command.DESCRIPTION)
    try:
        command.add_arguments(sub)
    except ModuleNotFoundError as exc:  # an optional dependency: say so when the command is used
        hint = getattr(command, "INSTALL_HINT", "")
        _unavailable(sub, f"{exc}; {hint}" if hint else str(exc))
        return
    sub.set_defaults(kvpush_command=command)


def _unavailable(sub: argparse.ArgumentParser, why: str) -> None:
    sub.set_defaults(kvpush_command=None, kvpush_unavailable=why)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    # Known args only, so that an unavailable command's flags reach the message below.
    args, extra = parser.parse_known_args(argv)
    command: Command | None = args.kvpush_command
    if command is None:
        print(f"kvpush {args.command}: {args.kvpush_unavailable}", file=sys.stderr)
        return 2
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(command.run(args))
