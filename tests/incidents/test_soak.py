"""The soak (``benchmarks/soak.py``) for 30 seconds: random faults between a
prefill and a decode process over real NIXL; no corrupt block, no leaked
block, no hung request, and no bystander affected by another's fault."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed (make test installs it)")

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_a_30_second_soak_with_random_faults_loses_nothing() -> None:
    run = subprocess.run(
        [sys.executable, str(SOAK), "--seconds", "30", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    report = json.loads(run.stdout)
    assert run.returncode == 0, (report, run.stderr[-2000:])
    assert report["error"] is None and report["hung"] == 0 and report["corrupt"] == 0
    assert report["leaked_blocks"] == {"decode_reserved": 0, "prefill_held": 0}
    assert "bystander-affected" not in report["failures"]
    assert report["completed"] > 10 and report["reused_block_sets_checked"] > 10
    assert len(report["faults"]) >= 3  # the faults really were injected
