"""UCX settings kvpush applies when a transport registers VRAM.

UCX reads its ``UCX_*`` environment when NIXL creates the backend, so these
are set in the process environment before :class:`~kvpush_nixl.NixlTransport`
creates its agent (``vram=True``), each only where the user set nothing: a
user's own setting always wins. Each one applied is logged. docs/operations.md
("UCX on GPUs") has the measurements behind them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping

__all__ = ("VRAM_DEFAULTS", "apply_vram_defaults")

log = logging.getLogger("kvpush.nixl")

#: Setting -> (value, why). On a host without NVLink, UCX turns cuda_ipc's GET
#: zero-copy off and reads between two processes' VRAM fall back to "software
#: emulation" over TCP: pull at 0.5 GB/s on an H200, 5.3 / 84 / 384 GB/s at
#: 16 KiB / 256 KiB / 2 MiB blocks with it on (shared/reference/gpu-h200.md).
VRAM_DEFAULTS: Mapping[str, tuple[str, str]] = {
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": (
        "y",
        "cuda_ipc reads (pull) otherwise fall back to TCP on hosts without NVLink",
    ),
}


def apply_vram_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set every :data:`VRAM_DEFAULTS` entry absent from ``environ`` (default:
    ``os.environ``); return what was set."""
    env = os.environ if environ is None else environ
    applied: dict[str, str] = {}
    for name, (value, why) in VRAM_DEFAULTS.items():
        if name in env:
            continue
        env[name] = applied[name] = value
        log.info("kvpush: set %s=%s for VRAM (%s; set it yourself to override)", name, value, why)
    return applied
