"""scripts/device_check.py without a GPU: its CPU path end to end (two processes,
NIXL over UCX on loopback, DRAM, push and pull verified), its torch code on CPU
tensors where torch is installed, its refusal of ``--gpu`` where torch or CUDA
is missing, and the wheel slimming ``scripts/device-check.sh fetch`` relies on.
The GPU path itself runs only on a device machine (docs/operations.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device_check.py"
SMALL = ["--total-mib", "1", "--block-kib", "16", "--reps", "2"]  # 16 blocks per region


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def load_script() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_report(proc: subprocess.CompletedProcess[str], mode: str, path: str) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])  # the JSON is the last line
    assert out["ok"] and out["verified"] and out["mode"] == mode and out["memory"] == "DRAM"
    assert out["push_done"] and out["pull_done"]
    assert [e["block_bytes"] for e in out["entries"]] == [16 * 1024]
    for entry in out["entries"]:
        assert entry["path"] == path
        assert entry["bytes"] == 1024 * 1024
        assert entry["copy_gbps"] > 0
        for side in ("push", "pull"):
            assert entry[side]["verified"] is True
            assert entry[side]["rounds"] == 2
            assert entry[side]["gbps"] > 0
            assert all(v > 0 for v in entry[side]["gbps_min_max"])
            assert entry[f"{side}_over_copy"] > 0
        assert entry["push"]["notice_gbps"] > 0


@pytest.mark.nixl
@pytest.mark.parametrize(("path", "posted"), [("auto", "rows"), ("prepped", "prepped")])
def test_cpu_path(path: str, posted: str) -> None:
    """Two processes, push and pull, a warm-up and two timed rounds each verified;
    ``auto`` posts these small plans as rows, ``prepped`` by index."""
    check_report(run("--cpu", "--path", path, *SMALL), "cpu", posted)


@pytest.mark.nixl
def test_torch_code_on_cpu_tensors() -> None:
    """The GPU path's torch code (fill, zero, gather, compare, copy_) on DRAM."""
    pytest.importorskip("torch", reason="torch is not installed")
    check_report(run("--torch-dram", *SMALL), "torch-dram", "rows")


def test_gpu_refused_without_cuda() -> None:
    """No GPU here: --gpu exits 2 before starting anything and says what is missing."""
    proc = run("--gpu", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--gpu cannot run here" in proc.stderr
    assert "torch is not installed" in proc.stderr or "CUDA is not available" in proc.stderr
    assert proc.stdout == ""


def test_gpu_missing_names_torch_and_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script()
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert script.gpu_missing().startswith("torch is not installed")
    fake = types.SimpleNamespace(
        __version__="9.9",
        version=types.SimpleNamespace(cuda="13.0"),
        cuda=types.SimpleNamespace(is_available=lambda: False),
    )
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert script.gpu_missing().startswith("CUDA is not available to torch 9.9")
    fake.cuda.is_available = lambda: True
    assert script.gpu_missing() is None


def test_slim_wheels(tmp_path: Path) -> None:
    """nixl_ep_cu13/ leaves the wheel and its RECORD; everything else stays."""
    wheel = tmp_path / "nixl_cu13-1.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    record = "nixl_cu13/_api.py,sha256=a,1\nnixl_ep_cu13/ep.so,sha256=b,2\n"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("nixl_cu13/_api.py", "x = 1\n")
        z.writestr("nixl_ep_cu13/ep.so", b"\0" * 4096)
        z.writestr("nixl_cu13-1.0.dist-info/RECORD", record)
    load_script().slim_wheels(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        assert z.namelist() == ["nixl_cu13/_api.py", "nixl_cu13-1.0.dist-info/RECORD"]
        assert z.read("nixl_cu13/_api.py") == b"x = 1\n"
        assert z.read("nixl_cu13-1.0.dist-info/RECORD") == b"nixl_cu13/_api.py,sha256=a,1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [wheel.name]
