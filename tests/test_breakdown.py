"""The connector's per-request breakdown file (kvpush_vllm/_breakdown.py)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import pathlib
from typing import Any

import pytest

from kvpush.protocol import OpStamps, Source, Timeline
from kvpush_vllm import _breakdown
from kvpush_vllm._breakdown import Breakdown, timeline_fields

S0 = Source(0)


def test_without_a_file_nothing_is_kept() -> None:
    b = Breakdown(None, "decode")
    b.stamp("r", "arrived")
    assert not b.enabled and not b.waiting("r", "arrived")
    b.write("r")  # no file, no error


def test_a_line_has_first_stamps_fields_and_the_kept_timeline(tmp_path: pathlib.Path) -> None:
    clock = itertools.count(1.0)
    path = tmp_path / "t.jsonl"
    b = Breakdown(str(path), "decode", clock=lambda: float(next(clock)))
    b.stamp("r", "arrived", transfer_id="kvp-1")
    b.stamp("r", "arrived", transfer_id="other")  # the first stamp wins
    t = Timeline(
        "kvp-1", epoch=2, reserved=0.5, ready=0.9,
        ops=(((S0, 0), OpStamps(0.6, 0.61, 0.62, 0.7)), ((S0, 1), OpStamps(0.6, 0.6, 0.65, 0.8))),
        notice_seen=(((S0, 0), 0.71), ((S0, 1), 0.85)),
    )  # fmt: skip
    b.keep("r", t)
    b.stamp("r", "reported")
    assert b.waiting("r", "reported") and not b.waiting("r", "first_step")
    b.write("r", outcome="ready")
    assert not b.waiting("r", "reported")
    b.close()
    (line,) = map(json.loads, path.read_text().splitlines())
    assert line == {
        "side": "decode", "req_id": "r", "transfer_id": "kvp-1", "arrived": 1.0, "reported": 2.0,
        "outcome": "ready", "epoch": 2, "reserved": 0.5, "ready": 0.9, "notice_seen": 0.85,
        "op_plan_started": 0.6, "op_planned": 0.61, "op_posted": 0.65, "op_done": 0.8,
    }  # fmt: skip
    assert timeline_fields(Timeline("x")) == {"epoch": 0}


def test_open_records_are_bounded(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_breakdown, "MAX_OPEN", 3)
    b = Breakdown(str(tmp_path / "t.jsonl"), "prefill")
    for i in range(5):
        b.stamp(f"r{i}", "scheduled")
    assert [b.waiting(f"r{i}", "scheduled") for i in range(5)] == [False] * 2 + [True] * 3
    b.close()


def test_a_write_error_turns_it_off_without_raising(tmp_path: pathlib.Path) -> None:
    b = Breakdown(str(tmp_path / "t.jsonl"), "prefill")
    b.stamp("r", "scheduled")
    assert b._file is not None
    b._file.close()  # the next write fails (ValueError on a closed file is not OSError)
    b._file = open("/dev/full", "w", encoding="utf-8")  # noqa: SIM115
    b.write("r")
    assert not b.enabled


def _bench() -> Any:
    """benchmarks/vllm_breakdown.py (benchmarks is not a package)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_breakdown.py"
    spec = importlib.util.spec_from_file_location("vllm_breakdown", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_the_benchmark_splits_ttft_into_phases_that_sum_to_it(mode: str) -> None:
    vb = _bench()
    chain = vb.CHAINS[mode]
    # One complete request (moments 0, 1, 3, 6, ... s apart) and one missing its first step.
    times = {m: float(i * (i + 1) // 2) for i, m in enumerate(chain)}
    lines = []
    for tid, drop in (("kvp-a", None), ("kvp-b", "decode.first_step")):
        for side in ("router", "prefill", "decode"):
            line: dict[str, Any] = {"side": side, "transfer_id": tid, "outcome": "ok"}
            for m, t in times.items():
                if m.startswith(side + ".") and m != drop:
                    line[m.split(".", 1)[1]] = t
            lines.append(line)
    lines.append({"side": "decode", "transfer_id": "kvp-unknown", "ready": 1.0})
    clients = {tid: {"sent": times["client.sent"], "first_token": times["client.first_token"]}
               for tid in ("kvp-a", "kvp-b")}  # fmt: skip
    s = vb.summary(vb.join(lines, clients), mode)
    assert (s["requests"], s["incomplete"], s["sum_error_max"]) == (1, 1, 0.0)
    assert [r["p50_ms"] for r in s["phases"]] == [1e3 * i for i in range(1, len(chain))]
    assert sum(r["p50_ms"] for r in s["phases"]) == 1e3 * times["client.first_token"]
    assert "| phase |" in vb.table(mode, s)
