"""``kvpush demo``: the arguments, the progress bar and the exit status (the
``demo`` entry of the ``kvpush.commands`` registry: :data:`HELP`,
:data:`DESCRIPTION`, :func:`add_arguments`, :func:`run`)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any

from kvpush.protocol import ConfigError, from_arguments
from kvpush.protocol import add_arguments as add_options

from ._children import interrupts
from ._model import DemoError
from ._report import problems, render, summarize
from ._supervisor import DemoConfig, Supervisor

__all__ = ("DESCRIPTION", "HELP", "PRESETS", "add_arguments", "run")

HELP = "run prefill and decode instances on loopback and hand off KV between them"
DESCRIPTION = (
    "Start a router and prefill and decode instances (one of each unless "
    "--prefills/--decodes/--preset say otherwise; a leader process plus one process per "
    "TP rank each) on this machine, hand off the KV of --requests requests over NIXL or "
    "shared memory, check every block, and report the phase timeline."
)

_DEFAULTS = DemoConfig()

#: ``--preset`` name -> the options it stands for. An option given explicitly
#: alongside a preset overrides the preset's value.
PRESETS: dict[str, dict[str, int]] = {
    "xpyd": {"prefills": 2, "decodes": 2, "tp_prefill": 2, "tp_decode": 1},
}
#: The options a preset may set.
_SHAPE = ("prefills", "decodes", "tp_prefill", "tp_decode")

#: Exit statuses: the run passed its own checks / did not / bad usage / interrupted.
OK, FAILED, USAGE, INTERRUPTED = 0, 1, 2, 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``demo`` subcommand's options: one per :class:`DemoConfig` field, and these."""
    parser.epilog = (
        "With --prefills N / --decodes M (or --preset xpyd) every decode instance dials "
        "every prefill instance, and the router sends each request to the least-loaded "
        "instance of each side (the least-used pair among ties)."
    )
    add_options(parser, DemoConfig)
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="xpyd: --prefills 2 --decodes 2 --tp-prefill 2 --tp-decode 1 (heterogeneous "
        "TP, every decode routed to every prefill); any of those four options given as "
        "well overrides the preset's value",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout instead of the progress bar and table",
    )


class _Quiet:
    """--json: the process line on stderr, nothing else."""

    def started(self, processes: str) -> None:
        print(f"kvpush demo: {processes}", file=sys.stderr, flush=True)

    def settled(self, ok: bool) -> None:
        pass

    def close(self) -> None:
        pass


class _Bar:
    """A rich progress bar on stderr."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("requests"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("failed {task.fields[failed]}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task("requests", total=total, failed=0)
        self.failed = 0

    def started(self, processes: str) -> None:
        self.console.print(f"kvpush demo: {processes}", highlight=False)
        self.progress.start()

    def settled(self, ok: bool) -> None:
        self.failed += not ok
        self.progress.update(self.task, advance=1, failed=self.failed)

    def close(self) -> None:
        self.progress.stop()


def shape_of(args: argparse.Namespace) -> dict[str, int]:
    """Instances and TP per side: the options given, else the preset's, else the defaults."""
    preset = PRESETS.get(getattr(args, "preset", None) or "", {})
    out = {}
    for key in _SHAPE:
        given = getattr(args, key, None)
        out[key] = given if given is not None else preset.get(key, getattr(_DEFAULTS, key))
    return out


def run(args: argparse.Namespace) -> int:
    """Run the demo as ``args`` say; returns the exit status."""
    try:
        shaped = argparse.Namespace(**{**vars(args), **shape_of(args)})
        cfg = from_arguments(DemoConfig, shaped, what="demo")
    except ConfigError as exc:
        return _fail(None, args.json, str(exc), USAGE)
    if not args.json and importlib.util.find_spec("rich") is None:
        print(
            "kvpush demo: the progress bar and the table need rich: "
            "pip install 'kvpush[demo]' (or use --json)",
            file=sys.stderr,
        )
        return USAGE
    observer: _Quiet | _Bar = _Quiet() if args.json else _Bar(cfg.requests)
    # Ctrl-C and SIGTERM: one KeyboardInterrupt, then every child is stopped.
    with interrupts():
        try:
            supervisor = Supervisor(cfg, observer)  # imports NIXL: seconds
        except DemoError as exc:
            return _fail(cfg, args.json, str(exc), USAGE)
        except KeyboardInterrupt:
            return _fail(cfg, args.json, "interrupted", INTERRUPTED)
        error, status = "", OK
        try:
            result = supervisor.run()
        except DemoError as exc:
            error, status = str(exc), FAILED
        except KeyboardInterrupt:
            error, status = "interrupted; stopped every child process", INTERRUPTED
        finally:
            try:
                leftovers = supervisor.shutdown()
            finally:
                observer.close()
    if error:
        return _fail(cfg, args.json, error, status, run=supervisor.prefix)
    result.leftovers = leftovers
    summary = summarize(cfg, supervisor.model, result)
    failures = problems(summary)
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        from rich.console import Console

        Console().print(render(summary))
    if failures:
        print(f"kvpush demo: FAILED: {'; '.join(failures)}", file=sys.stderr)
        return FAILED
    return OK


def _fail(cfg: DemoConfig | None, as_json: bool, error: str, status: int, run: str = "") -> int:
    """Say why on stderr (and in JSON with ``--json``: what was asked, once
    valid; ``run`` is the run's shared-memory prefix, once it has one)."""
    print(f"kvpush demo: error: {error}", file=sys.stderr, flush=True)
    if as_json:
        out: dict[str, Any] = {"error": error}
        if cfg is not None:
            out = {
                "mode": cfg.mode.value,
                "transport": cfg.transport,
                "requests": cfg.requests,
                **out,
            }
        if run:
            out["run"] = run
        print(json.dumps(out), flush=True)
    return status
