"""``step_profile_file``: vLLM's calls into a connector instance, timed per step."""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvpush_vllm._steps import StepClock


class Instance:
    """Stands in for a connector: a boundary call begins each step."""

    def bind(self) -> str:
        return "bound"

    def work(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_each_step_is_one_line_of_its_calls_and_kvpush_s_threads_are_named(
    tmp_path: Path,
) -> None:
    path = tmp_path / "steps.jsonl"
    hops = iter([0, 3, 5])
    clock = StepClock(str(path), "decode", "worker", lambda: next(hops), lambda: {"dataplane": 42})
    inst = Instance()
    clock.wrap(inst, ("bind", "work"), "bind")
    assert inst.bind() == "bound"  # the first step begins (nothing before it: no line)
    assert inst.work(0.002) == 0.002 and inst.work(0.0) == 0.0
    clock.scheduled(7)
    inst.bind()  # the next step begins: the first one's line
    inst.work(0.0)
    clock.flush()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    steps = [ln for ln in lines if "kind" not in ln]
    assert [s["scheduled"] for s in steps] == [7]
    (step,) = steps
    assert step["calls"] == {"bind": 1, "work": 2}
    assert step["ns"]["work"] >= 2_000_000 and step["hops"] == 3
    assert (step["side"], step["role"]) == ("decode", "worker")
    assert [ln["threads"] for ln in lines if ln.get("kind") == "threads"] == [{"dataplane": 42}]
    # The open step (the second bind and its work) waits for the next boundary.
    inst.bind()
    clock.flush()
    steps = [json.loads(x) for x in path.read_text().splitlines() if '"kind"' not in x]
    assert [s["calls"] for s in steps] == [{"bind": 1, "work": 2}, {"bind": 1, "work": 1}]
    assert steps[1]["hops"] == 2  # round trips since the line before
