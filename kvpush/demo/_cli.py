"""``kvpush demo``: the arguments, the progress bar and the exit status (the
``demo`` entry of the ``kvpush.commands`` registry: :data:`HELP`,
:data:`DESCRIPTION`, :func:`add_arguments`, :func:`run`)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any

from kvpush.protocol import Mode

from ._children import interrupts
from ._model import DEFAULT_MAX_MEMORY_MIB, MODELS, DemoError
from ._report import problems, render, summarize
from ._router import MAX_INSTANCES, TRANSPORTS, DemoConfig, DemoRouter

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
#: The options a preset may set, and their values without one.
_SHAPE = {
    "prefills": _DEFAULTS.prefills,
    "decodes": _DEFAULTS.decodes,
    "tp_prefill": _DEFAULTS.tp_prefill,
    "tp_decode": _DEFAULTS.tp_decode,
}

#: Exit statuses: the run passed its own checks / did not / bad usage / interrupted.
OK, FAILED, USAGE, INTERRUPTED = 0, 1, 2, 130


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _instances(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_INSTANCES:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_INSTANCES}, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``demo`` subcommand's options."""
    parser.epilog = (
        "With --prefills N / --decodes M (or --preset xpyd) every decode instance dials "
        "every prefill instance, and the router sends each request to the least-loaded "
        "instance of each side (the least-used pair among ties)."
    )
    add = parser.add_argument
    add(
        "--mode",
        choices=[m.value for m in Mode],
        default=_DEFAULTS.mode.value,
        help="push: the prefill writes into the decode's blocks; pull: the decode reads "
        "(default: %(default)s)",
    )
    add(
        "--transport",
        choices=TRANSPORTS,
        default=_DEFAULTS.transport,
        help="nixl: NIXL over UCX on loopback, one agent per rank; memory: POSIX shared "
        "memory copies (default: %(default)s)",
    )
    add(
        "--requests",
        type=_positive_int,
        default=_DEFAULTS.requests,
        help="requests to run (default: %(default)s)",
    )
    add(
        "--qps",
        type=float,
        default=_DEFAULTS.qps,
        help="Poisson arrival rate; 0 dispatches as fast as free blocks allow "
        "(default: %(default)s)",
    )
    add(
        "--prompt-tokens",
        type=_positive_int,
        default=_DEFAULTS.prompt_tokens,
        help="prompt length of every request (default: %(default)s)",
    )
    add(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="xpyd: --prefills 2 --decodes 2 --tp-prefill 2 --tp-decode 1 (heterogeneous "
        "TP, every decode routed to every prefill); any of those four options given as "
        "well overrides the preset's value",
    )
    add(
        "--prefills",
        type=_instances,
        default=None,
        help=f"prefill instances, 1 to {MAX_INSTANCES} (default: {_DEFAULTS.prefills}, "
        "or the preset's)",
    )
    add(
        "--decodes",
        type=_instances,
        default=None,
        help=f"decode instances, 1 to {MAX_INSTANCES}; each dials every prefill, and the "
        f"router spreads requests over every pair (default: {_DEFAULTS.decodes}, or the "
        "preset's)",
    )
    add(
        "--tp-prefill",
        type=_positive_int,
        default=None,
        help="tensor-parallel ranks of each prefill instance "
        f"(default: {_DEFAULTS.tp_prefill}, or the preset's)",
    )
    add(
        "--tp-decode",
        type=_positive_int,
        default=None,
        help="tensor-parallel ranks of each decode instance "
        f"(default: {_DEFAULTS.tp_decode}, or the preset's)",
    )
    add(
        "--model",
        choices=sorted(MODELS),
        default=_DEFAULTS.model,
        help="KV shape: small (4 layers, 8 KV heads, head_dim 64, fp16) or qwen3-32b "
        "(64 layers, 8 KV heads, head_dim 128, bf16: 256 KiB per token) "
        "(default: %(default)s)",
    )
    add(
        "--compute-us-per-token",
        type=float,
        default=_DEFAULTS.compute_us_per_token,
        help="simulated prefill time per prompt token, microseconds (default: %(default)s)",
    )
    add(
        "--progressive",
        action="store_true",
        help="progressive push: the prefill computes the prompt in chunks of "
        "--chunk-tokens and hands each chunk's whole blocks to the core, which writes "
        "them while the rest is computed; the last chunk commits (push only)",
    )
    add(
        "--chunk-tokens",
        type=_positive_int,
        default=128,
        help="the prefill's chunk with --progressive, tokens (default: %(default)s)",
    )
    add(
        "--link-gbps",
        type=float,
        default=None,
        help="with --transport memory: model each rank's link at this rate, Gb/s, so "
        "that the wire takes time (default: memory speed)",
    )
    add(
        "--max-memory-mib",
        type=_positive_int,
        default=DEFAULT_MAX_MEMORY_MIB,
        help="cap on the KV memory of every instance together; the block pools hold "
        "--requests prompts at once, or as many as fit (default: %(default)s)",
    )
    add(
        "--timeout",
        type=float,
        default=_DEFAULTS.timeout,
        help="give up when no request settles for this many seconds (default: %(default)s)",
    )
    add(
        "--seed",
        type=int,
        default=_DEFAULTS.seed,
        help="seeds arrivals, block placement and the KV pattern (default: %(default)s)",
    )
    add(
        "--json",
        action="store_true",
        help="print one JSON object on stdout instead of the progress bar and table",
    )
    add(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on 127.0.0.1: decode leader on PORT, prefill on "
        "PORT+1 (more instances: the decodes on PORT, PORT+1, ..., then the prefills)",
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
    for key, default in _SHAPE.items():
        given = getattr(args, key, None)
        out[key] = given if given is not None else preset.get(key, default)
    return out


def run(args: argparse.Namespace) -> int:
    """Run the demo as ``args`` say; returns the exit status."""
    shape = shape_of(args)
    cfg = DemoConfig(
        mode=Mode(args.mode),
        transport=args.transport,
        requests=args.requests,
        qps=args.qps,
        prompt_tokens=args.prompt_tokens,
        seed=args.seed,
        model=args.model,
        compute_us_per_token=args.compute_us_per_token,
        chunk_tokens=args.chunk_tokens if args.progressive else 0,
        link_gbps=args.link_gbps,
        max_memory_mib=args.max_memory_mib,
        timeout=args.timeout,
        metrics_port=args.metrics_port,
        **shape,
    )
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
            router = DemoRouter(cfg, observer)  # imports NIXL: seconds
        except DemoError as exc:
            return _fail(cfg, args.json, str(exc), USAGE)
        except KeyboardInterrupt:
            return _fail(cfg, args.json, "interrupted", INTERRUPTED)
        error, status = "", OK
        try:
            result = router.run()
        except DemoError as exc:
            error, status = str(exc), FAILED
        except KeyboardInterrupt:
            error, status = "interrupted; stopped every child process", INTERRUPTED
        finally:
            try:
                leftovers = router.shutdown()
            finally:
                observer.close()
    if error:
        return _fail(cfg, args.json, error, status, run=router.prefix)
    result.leftovers = leftovers
    summary = summarize(cfg, router.model, result)
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


def _fail(cfg: DemoConfig, as_json: bool, error: str, status: int, run: str = "") -> int:
    """Say why on stderr (and in JSON with ``--json``: ``run`` is the run's
    shared-memory prefix, once it has one)."""
    print(f"kvpush demo: error: {error}", file=sys.stderr, flush=True)
    if as_json:
        out: dict[str, Any] = {
            "mode": cfg.mode.value,
            "transport": cfg.transport,
            "requests": cfg.requests,
            "error": error,
        }
        if run:
            out["run"] = run
        print(json.dumps(out), flush=True)
    return status
