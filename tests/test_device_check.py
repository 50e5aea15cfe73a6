"""scripts/device_check.py without a GPU: both checks on their CPU path, end to end.

The model check (real transformers, real NIXL over UCX on loopback, DRAM): a
Llama's prompt KV computed by prefill rank processes into vLLM 0.33's packed GPU
layout, moved by kvpush's connector halves, and the decode's greedy tokens equal
to one process's alone, per case (TP 1 and 2 -> 1, push and pull, block sizes
equal and not, progressive push); the KV really moved (bytes posted, the decode's
KV bit-equal to the reference's) and the check can tell (the same decode from
zeroed KV generates other tokens). The wire check: two processes, push and pull
verified, its torch code on CPU tensors where torch is installed. And the
refusal of ``--gpu`` where torch or CUDA is missing, and the wheel slimming
``scripts/device-check.sh fetch`` relies on. The GPU path itself runs only on a
device machine (docs/operations.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device_check.py"
SMALL = ["--total-mib", "1", "--block-kib", "16", "--reps", "2"]  # 16 blocks per region
WIRE = ["--checks", "wire", *SMALL]


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


def report(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line
    return out


def check_report(proc: subprocess.CompletedProcess[str], mode: str, path: str) -> None:
    out = report(proc)
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
    check_report(run("--cpu", "--path", path, *WIRE), "cpu", posted)


@pytest.mark.nixl
def test_torch_code_on_cpu_tensors() -> None:
    """The GPU path's torch code (fill, zero, gather, compare, copy_) on DRAM."""
    pytest.importorskip("torch", reason="torch is not installed")
    check_report(run("--torch-dram", *WIRE), "torch-dram", "rows")


@pytest.mark.nixl
def test_model_check_cpu_path() -> None:
    """The model check's CPU cases, then the wire check, in one run: one JSON
    report, ``ok`` only because both passed."""
    pytest.importorskip("torch", reason="torch is not installed")
    pytest.importorskip("transformers", reason="transformers is not installed")
    out = report(run("--cpu", "--checks", "model,wire", *SMALL, timeout=280))
    assert out["ok"] and out["checks"] == ["model", "wire"] and out["verified"]
    model = out["model"]
    assert model["ok"] and model["device"] == "cpu" and model["spec"]["dtype"] == "float32"
    spec = model["spec"]
    assert spec["kv_heads"] < spec["heads"]  # GQA
    names = [case["case"] for case in model["cases"]]
    assert names == [
        "tp1to1-push-16to16-LBNHC",
        "tp2to1-push-16to32-LBHNC-chunk32-progressive",
        "tp2to1-pull-32to16-LBHNC",
    ]
    for case in model["cases"]:
        name = case["case"]
        assert case["ok"], case
        # The decode's tokens are one process's alone: the first one (the
        # prefill's) and every greedy one after it.
        assert case["tokens"] == case["reference"], name
        assert len(case["tokens"]) == spec["new_tokens"] + 1
        # The KV went over kvpush: the decode read exactly the reference's KV
        # from its blocks, nothing else in its cache changed, the posting side
        # posted at least the prompt's KV.
        assert case["kv_equal"] and case["kv_max_abs_diff"] == 0.0, name
        assert case["elsewhere_zero"], name
        assert case["bytes_posted"] >= case["kv_bytes"] > 0, name
        assert case["ops_posted"] > 0 and case["failed_posts"] == 0, name
        # The check can tell: without the KV the decode generates other tokens.
        assert case["zero_kv_tokens"] != case["reference"], name
    progressive = model["cases"][1]
    assert 0 < progressive["bytes_before_kv_ready"] < progressive["bytes_posted"]


@pytest.mark.nixl
def test_staging_check_runs_the_gpu_code_on_cpu_tensors() -> None:
    """The staging check (benchmarks/staging.py) with the GPU's copier on CPU
    tensors: five variants both ways, every one verified, the cost model's
    choice and the staging memory reported, block sizes that fit 1 MiB."""
    pytest.importorskip("torch", reason="torch is not installed")
    args = ("--torch-dram", "--checks", "staging", "--total-mib", "1", "--staging-reps", "1")
    out = report(run(*args, timeout=280))
    st = out["staging"]
    assert out["ok"] and st["verified"] and st["memory"] == "DRAM"
    assert [e["block_bytes"] for e in st["entries"]] == [4096, 16384, 65536]
    for e in st["entries"]:
        for side in ("push", "pull"):
            assert set(e[side]["gbps"]) == {
                "raw_per_block", "raw_best", "kvpush_direct", "kvpush_staged"
            }  # fmt: skip
            assert all(v > 0 for v in e[side]["gbps"].values()) and e[side]["verified"]
        assert e["cost_model"]["choice"] in ("direct", "staged")
        assert e["staging_bytes"]["consumer"] == 1 << 20
        assert e["descriptors"]["staged_spans"] == 1  # one route, one span
        assert e["device_copy_gbps"] > 0
    assert set(st["goals"]) >= {"pull_ge_0.8_push", "kvpush_chosen_ge_raw_per_block"}


def test_model_check_refused_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model check needs torch and transformers; the message says which is missing."""
    script = load_script()
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "transformers" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert script.model_missing().startswith("transformers is not installed")
    assert "transformers is not installed" in script.cannot_run("cpu", ("model", "wire"))


def test_model_case_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GPU case has its own name; ``--model-cases`` takes names, ``all`` and
    ``ci``; an unknown name is refused, naming the known ones."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    handoff = pytest.importorskip("device_handoff", reason="torch is not installed")
    names = [c.name for c in handoff.CASES]
    assert len(set(names)) == len(names) == 16
    assert [c.name for c in handoff.cases_for("ci")] == [c.name for c in handoff.CPU_CASES]
    assert handoff.cases_for(names[0]) == [handoff.CASES[0]]
    with pytest.raises(ValueError, match="unknown model cases"):
        handoff.cases_for("nope")


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
