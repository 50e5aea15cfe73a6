"""The CPU tile format kvpush_vllm/_tensors.py describes, checked against vLLM's kernel.

tests/test_cpu_tile.py proves the connector exact (or refusing) over an *emulation* of
the ``vec`` ISA's tile; this checks the emulation against ``cpu_attn_reshape_and_cache``
itself (tile_format.py, in a subprocess: the pytest process never imports torch), and
that the AMX ISA's format differs (why ``cpu_attn_isa`` is in the handshake) where
the CPU has AMX; where it has not, the kernel refuses AMX, which is checked instead.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from e2e_lib import HERE, skip_unless_e2e_venv

skip_unless_e2e_venv()

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_the_kernel_keeps_k_channel_major_and_v_token_major() -> None:
    run = subprocess.run(
        [sys.executable, str(HERE / "tile_format.py")],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(rows, indent=1))
    assert len(rows) == 12, rows
    for r in rows:
        if r["isa"] in ("vec", "vec16"):  # every CPU vLLM runs on has these
            assert "refused" not in r and r["bad_k"] == r["bad_v"] == 0, r
        elif "refused" in r:  # a CPU without AMX tiles: the kernel says so
            assert "Unsupported CPU attention configuration" in r["refused"], r
        else:  # AMX packs the tile otherwise: never the same format as vec
            assert r["bad_k"] + r["bad_v"] > 0, r
