"""``kvpush simulate`` on the command line: output, --json, --plot, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpush.cli import main

SMALL = ["simulate", "--qps", "1,2", "--input-tokens", "1k", "--requests", "20"]


def test_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--modes", "push,pull"]) == 0
    out = capsys.readouterr().out
    assert "scenario seed: 1P + 1D" in out and "push" in out and "pull" in out
    assert "wall time" in out


def test_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * 3
    keys = {"mode", "qps", "input_tokens", "ttft_ms_mean", "ttft_ms_p50", "tpot_ms_mean", "failed"}
    for row in rows:
        assert keys <= row.keys()
        assert row["input_tokens"] == 1024 and row["failed"] == 0
    assert {r["mode"] for r in rows} == {"pull", "push", "bg-pull"}


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "grid.png"
    assert main([*SMALL, "--json", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scenario", "nope"], "unknown scenario 'nope'"),
        (["--input-tokens", "16q"], "bad token count '16q'"),
        (["--qps", "1,,2"], "empty item"),
        (["--qps", "fast"], "bad QPS 'fast'"),
        (["--qps", "-1"], "must be a positive number"),
        (["--modes", "teleport"], "unknown mode 'teleport'"),
        (["--requests", "0"], "--requests must be >= 1"),
        (["--prefill", "0"], "prefill must be an int in [1, 1024], got 0"),
        (["--preempt-rate", "-1"], "preempt_per_s must be a number >= 0, got -1.0"),
        (["--scenario", "/nonexistent/x.json"], "cannot read scenario"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and err.startswith("kvpush simulate: ")


def test_faults_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--qps", "4", "--input-tokens", "4k", "--modes", "push"]
    assert main([*args, "--requests", "60", "--kill-prefill-at", "3"]) == 0
    out = capsys.readouterr().out
    assert "recovery" in out and "no_prefill_up" in out  # 1P: the router refuses (503)
