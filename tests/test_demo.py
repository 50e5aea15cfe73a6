"""``kvpush demo`` end to end, as a subprocess (``python -m kvpush demo --json``):
push and pull, TP 1->1, 2->1 and 1->2, every block checked; the xPyD preset (2
TP2 prefills -> 2 TP1 decodes) with every instance and every pair serving;
and a prefill leader killed mid-run, which must end the demo quickly, with a
clear message, no process left behind and no shared memory of the run left
in /dev/shm."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvpush.cli import build_parser, main
from kvpush.demo import MODELS, DemoError
from kvpush.demo._cli import shape_of
from kvpush.demo._model import SideGeometry, plan_pool
from kvpush.demo._pattern import corrupt_blocks, fill, request_seed
from kvpush.demo._report import percentiles

ROOT = Path(__file__).resolve().parent.parent
SHM = Path("/dev/shm")
RUN_LINE = re.compile(
    r"run (?P<prefix>kvpd\w+): router pid (?P<router>\d+), prefill leader pid (?P<pl>\d+) "
    r"\(ranks (?P<pr>[\d,]+)\), decode leader pid (?P<dl>\d+) \(ranks (?P<dr>[\d,]+)\)"
)


def _run_info(stderr: str) -> tuple[str, dict[str, list[int]]]:
    m = RUN_LINE.search(stderr)
    assert m, stderr
    pids = {
        "prefill leader": [int(m["pl"])],
        "decode leader": [int(m["dl"])],
        "prefill ranks": [int(p) for p in m["pr"].split(",")],
        "decode ranks": [int(p) for p in m["dr"].split(",")],
    }
    return m["prefix"], pids


def _alive(pid: int) -> bool:
    """A live (not zombie) process of ours with that pid (psutil-free: /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state != "Z" and b"multiprocessing" in cmdline


def _assert_clean(prefix: str, pids: dict[str, list[int]]) -> None:
    deadline = time.monotonic() + 2.0  # the children were joined; allow for /proc lag
    while True:
        left = [(what, p) for what, ps in pids.items() for p in ps if _alive(p)]
        segments = sorted(p.name for p in SHM.glob(prefix + "*"))
        if (not left and not segments) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert left == []
    assert segments == []


def _demo(*args: str, timeout: float = 180) -> tuple[dict[str, object], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "kvpush", "demo", "--json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0]), proc.stderr


@pytest.mark.parametrize("transport", [pytest.param("nixl", marks=pytest.mark.nixl), "memory"])
@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("tp_prefill", "tp_decode"), [(1, 1), (2, 1), (1, 2)])
def test_demo_hands_off_and_checks_every_block(
    mode: str, tp_prefill: int, tp_decode: int, transport: str
) -> None:
    n, tokens = 6, 200  # 13 blocks, the last one partly used
    out, stderr = _demo(
        "--mode", mode, "--tp-prefill", str(tp_prefill), "--tp-decode", str(tp_decode),
        "--requests", str(n), "--qps", "0", "--prompt-tokens", str(tokens), "--seed", "7",
        "--transport", transport,
    )  # fmt: skip
    assert out["mode"] == mode and out["transport"] == transport
    assert (out["tp_prefill"], out["tp_decode"]) == (tp_prefill, tp_decode)
    assert out["requests"] == out["completed"] == n
    assert out["failed"] == 0 and out["failure_reasons"] == {}
    assert out["corrupt_blocks"] == 0
    assert out["leaked_blocks"] == 0
    model = MODELS["small"]
    assert out["bytes"] == n * math.ceil(tokens / 16) * model.block_bytes
    ttft, overhead = out["ttft_ms"], out["handoff_overhead_ms"]
    assert isinstance(ttft, dict) and isinstance(overhead, dict)
    assert 0 < ttft["p50"] <= ttft["p95"] <= ttft["p99"]
    assert overhead["p50"] is not None
    assert isinstance(out["gbps"], float) and out["gbps"] > 0
    _assert_clean(*_run_info(stderr))


@pytest.mark.parametrize("transport", [pytest.param("nixl", marks=pytest.mark.nixl), "memory"])
@pytest.mark.parametrize(("tp_prefill", "tp_decode"), [(2, 1), (1, 2)])
def test_progressive_push_writes_before_the_prompt_is_done(
    transport: str, tp_prefill: int, tp_decode: int
) -> None:
    # 200 tokens in chunks of 40: a block is often half computed at a chunk's
    # end (it goes in a later increment); the pattern of every block of every
    # increment is checked at the decode.
    n = 6
    common = (
        "--tp-prefill", str(tp_prefill), "--tp-decode", str(tp_decode), "--requests", str(n),
        "--qps", "0", "--prompt-tokens", "200", "--seed", "5", "--transport", transport,
        "--compute-us-per-token", "200",
        *(("--link-gbps", "5") if transport == "memory" else ()),
    )  # fmt: skip
    out, stderr = _demo("--progressive", "--chunk-tokens", "40", *common)
    assert out["progressive"] is True and out["mode"] == "push"
    assert out["completed"] == n and out["failed"] == 0
    assert out["corrupt_blocks"] == 0 and out["leaked_blocks"] == 0
    assert out["written_before_kv_ready"] == n
    assert out["bytes"] == n * math.ceil(200 / 16) * MODELS["small"].block_bytes
    _assert_clean(*_run_info(stderr))
    one_shot, _ = _demo(*common)
    assert one_shot["progressive"] is False and one_shot["written_before_kv_ready"] == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--progressive", "--mode", "pull"], "--progressive needs --mode push"),
        (["--link-gbps", "10", "--transport", "nixl"], "--link-gbps needs --transport memory"),
        (["--link-gbps", "0", "--transport", "memory"], "link_gbps must be a number (Gb/s) > 0"),
    ],
)
def test_progressive_and_link_misuse_is_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--json", *argv]) == 2
    out = json.loads(capsys.readouterr().out)
    assert message in out["error"]


@pytest.mark.parametrize(
    ("transport", "mode"),
    [pytest.param("nixl", "push", marks=pytest.mark.nixl), ("memory", "pull")],
)
def test_every_phase_is_measured_and_they_sum_to_ttft(transport: str, mode: str) -> None:
    """Regression: handoff preparation and ready were 0.000 in every run
    (``write_started`` and ``kv_ready`` were the same float, ``ready`` the
    last completion) and everything between KV ready and Ready counted as
    transfer. Now the data planes stamp planning, posting, settling and each
    notice, the runtime stamps the Ready's delivery, and per request compute,
    preparation, transfer and ready add up to TTFT."""
    out, _ = _demo(
        "--mode", mode, "--transport", transport, "--tp-prefill", "2", "--requests", "12",
        "--qps", "0", "--prompt-tokens", "200", "--seed", "3",
    )  # fmt: skip
    assert out["completed"] == 12
    assert out["unstamped"] == 0
    error = out["phase_sum_error"]
    assert isinstance(error, float) and error <= 0.01
    phases = out["phases_ms"]
    assert isinstance(phases, dict)
    for key in ("compute", "handoff_prep", "planning", "transfer", "posting", "ready", "ttft"):
        assert phases[key]["p50"] > 0, (key, phases)
    assert phases["planning"]["p99"] <= phases["handoff_prep"]["p99"] + 1e-3


def test_the_phases_of_one_request_follow_each_other() -> None:
    """The report's arithmetic on stamps typed in: each phase starts where
    the one before ends (push: the prefill's writes, the decode's notices)."""
    from kvpush.demo._report import CHAIN, _phases, sum_error
    from kvpush.demo._supervisor import RequestRecord
    from kvpush.demo._wire import ConsumerResult, OpsSummary, ProducerResult

    ops = OpsSummary(planned=10.004, planning=0.001, posting=0.002, done=10.007)
    rec = RequestRecord("t", dispatched=9.0)
    rec.producer = ProducerResult("t", "delivered", 9.001, 10.0, 10.002, 10.008, ops, 10.0112)
    rec.consumer = ConsumerResult(
        "t", True, "", 0, 9.0, 10.0095, 10.0097, notice_seen=10.009, delivered=10.0101
    )
    ph = _phases(rec, raw_ms=0.5)
    got = {k: round(v, 3) for k, v in ph.items() if v is not None}
    assert got == {
        "registration": 1.0,
        "compute": 1000.0,
        "handoff_prep": 4.0,
        "planning": 1.0,
        "transfer": 5.0,
        "posting": 2.0,
        "ready": 1.1,
        "ttft": 1010.1,
        "handoff_overhead": 9.6,
        "source_held": 11.2,
        "held_for_ack": 3.2,
    }
    assert sum(ph[k] or 0 for k in CHAIN) == pytest.approx(ph["ttft"])
    assert sum_error(ph) == pytest.approx(0, abs=1e-9)


INSTANCE = re.compile(r"(?P<name>[\w-]+) leader pid (?P<leader>\d+) \(ranks (?P<ranks>[\d,]+)\)")


@pytest.mark.parametrize(
    ("transport", "mode"),
    [pytest.param("nixl", "push", marks=pytest.mark.nixl), ("memory", "pull")],
)
def test_the_xpyd_preset_spreads_requests_over_every_pair(transport: str, mode: str) -> None:
    n = 16
    out, stderr = _demo(
        "--preset", "xpyd", "--transport", transport, "--mode", mode, "--requests", str(n),
        "--qps", "0", "--prompt-tokens", "200",
    )  # fmt: skip
    assert (out["prefills"], out["decodes"], out["tp_prefill"], out["tp_decode"]) == (2, 2, 2, 1)
    assert out["requests"] == out["completed"] == n and out["failed"] == 0
    assert out["corrupt_blocks"] == 0 and out["leaked_blocks"] == 0
    instances = out["instances"]
    assert isinstance(instances, dict)
    assert sorted(instances) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    for name, inst in instances.items():
        assert inst["side"] == name.split("-")[0]
        assert inst["tp"] == (2 if inst["side"] == "prefill" else 1)
        assert inst["served"] > 0, instances
        assert inst["leaked_blocks"] == 0, instances
    for side in ("prefill", "decode"):
        assert sum(i["served"] for i in instances.values() if i["side"] == side) == n
    pairs = out["pairs"]
    assert isinstance(pairs, dict) and len(pairs) == 4
    assert all(v > 0 for v in pairs.values()) and sum(pairs.values()) == n, pairs
    prefix = re.search(r"run (kvpd\w+):", stderr)
    assert prefix, stderr
    found = {m["name"]: m for m in INSTANCE.finditer(stderr)}
    assert sorted(found) == sorted(instances)
    pids = {
        name: [int(m["leader"]), *(int(p) for p in m["ranks"].split(","))]
        for name, m in found.items()
    }
    assert len(pids["prefill-0"]) == 3 and len(pids["decode-1"]) == 2
    _assert_clean(prefix[1], pids)


class _Background:
    """The demo in the background, its stderr in a file."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.err_path = tmp / "stderr.txt"
        with self.err_path.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvpush", "demo", "--json", *args],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=ROOT,
                start_new_session=True,  # its own process group, as under a shell
            )

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait_for_run_line(self) -> tuple[str, dict[str, list[int]]]:
        deadline = time.monotonic() + 30
        while not RUN_LINE.search(self.stderr):
            assert self.proc.poll() is None, self.stderr
            assert time.monotonic() < deadline, self.stderr
            time.sleep(0.05)
        return _run_info(self.stderr)

    def finish(self, timeout: float) -> str:
        try:
            stdout, _ = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            assert self.proc.stdout is not None
            self.proc.stdout.close()  # also after a timeout: no FileIO left to the GC
        return stdout

    def group(self) -> list[int]:
        """Every live (not zombie) process of the demo's process group."""
        return _group(self.proc.pid)


def _group(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids


LONG_RUN = ("--requests", "100000", "--qps", "40", "--max-memory-mib", "32")


@pytest.mark.nixl
def test_killing_the_prefill_leader_ends_the_demo_cleanly(tmp_path: Path) -> None:
    demo = _Background(tmp_path, *LONG_RUN)
    prefix, pids = demo.wait_for_run_line()
    time.sleep(0.5)  # mid-run: requests are flowing
    assert demo.proc.poll() is None
    os.kill(pids["prefill leader"][0], signal.SIGKILL)
    killed = time.monotonic()
    stdout = demo.finish(timeout=20)
    assert time.monotonic() - killed < 10
    assert demo.proc.returncode == 1
    stderr = demo.stderr
    assert "prefill leader" in stderr and "exited unexpectedly (killed by SIGKILL)" in stderr
    assert "Traceback" not in stderr
    assert "error" in json.loads(stdout.strip().splitlines()[-1])
    _assert_clean(prefix, pids)


#: Ctrl-C ends the demo within this many seconds, also on a loaded 2-core host.
CTRL_C_LIMIT = 5.0


@pytest.mark.nixl
@pytest.mark.parametrize("moment", ["starting", "leaders starting", "running", "twice"])
def test_ctrl_c_ends_the_demo_cleanly(tmp_path: Path, moment: str) -> None:
    """Ctrl-C (SIGINT to the whole process group) at any moment ends the demo
    within CTRL_C_LIMIT, exit status 130, no traceback, no process of the
    group and no shared memory of the run left. Regressions: a Ctrl-C while
    the children were still starting waited 5 s for each leader to read a
    Stop it could not read yet (3 to 6 s under load), one during a child's
    fork was dropped (the supervisor ignored SIGINT then), and a second one
    could cut the clean-up short."""
    demo = _Background(tmp_path, *LONG_RUN)
    deadline = time.monotonic() + 60
    if moment in ("starting", "leaders starting"):
        # The supervisor and its first child (the resource tracker, started with
        # the first rank); or also both ranks and a leader (importing NIXL).
        processes = 2 if moment == "starting" else 5
        while len(demo.group()) < processes:
            assert demo.proc.poll() is None, demo.stderr
            assert time.monotonic() < deadline, demo.stderr
            time.sleep(0.005)
    else:
        demo.wait_for_run_line()
        time.sleep(0.3)
    assert demo.proc.poll() is None, demo.stderr
    os.killpg(demo.proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
    sent = time.monotonic()
    if moment == "twice":
        time.sleep(0.05)
        os.killpg(demo.proc.pid, signal.SIGINT)
    stdout = demo.finish(timeout=CTRL_C_LIMIT + 10)
    while demo.group() and time.monotonic() < sent + CTRL_C_LIMIT:
        time.sleep(0.02)  # the resource tracker leaves just after the supervisor
    took = time.monotonic() - sent
    stderr = demo.stderr
    assert took < CTRL_C_LIMIT, (took, demo.group(), stderr)
    assert demo.proc.returncode == 130, stderr
    assert "interrupted" in stderr
    assert "Traceback" not in stderr
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["error"].startswith("interrupted")
    assert demo.group() == []  # every child, the resource tracker too (checked above)
    assert sorted(p.name for p in SHM.glob(out["run"] + "*")) == []


def test_the_supervisor_takes_one_interrupt_and_never_inside_a_start() -> None:
    """In process: a SIGINT while a child is being started is held and
    raised once it is on the books (the old code ignored SIGINT there: a
    Ctrl-C then was lost); after the first, and once the shutdown began,
    further ones are ignored."""
    from kvpush.demo._children import _held, interrupts

    trace: list[str] = []

    def start_with_a_ctrl_c() -> None:
        with _held():
            _signal_and_wait(signal.SIGINT)
            trace.append("held")  # no KeyboardInterrupt inside
        trace.append("after")  # not reached: raised on the way out

    with interrupts():
        with pytest.raises(KeyboardInterrupt):
            start_with_a_ctrl_c()
        assert trace == ["held"]
        _signal_and_wait(signal.SIGINT)  # the second: ignored
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupts(), pytest.raises(KeyboardInterrupt):
        _signal_and_wait(signal.SIGTERM)  # SIGTERM stops it as Ctrl-C does


def _signal_and_wait(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)


# --- the pieces, in process ----------------------------------------------------------


def test_the_pattern_catches_a_flipped_byte_and_a_wrong_request() -> None:
    geo = SideGeometry(MODELS["small"], tp=2, num_blocks=8)
    layout = geo.layout(1)  # heads 4..7
    memory = np.zeros(geo.segment_bytes, dtype=np.uint8)
    blocks, seed = [5, 2, 7], request_seed(0, "req-1")
    fill(memory, layout, blocks, seed)
    assert corrupt_blocks(memory, layout, blocks, seed) == set()
    assert corrupt_blocks(memory, layout, blocks, request_seed(0, "req-2")) == {0, 1, 2}
    assert corrupt_blocks(memory, geo.layout(0), blocks, seed) == {0, 1, 2}  # other heads
    v = layout.regions[5]
    memory[v.base + 2 * v.stride + v.block_len - 1] ^= 1  # the last byte of block 2
    assert corrupt_blocks(memory, layout, blocks, seed) == {1}


def test_qwen3_shape_and_the_memory_cap() -> None:
    qwen = MODELS["qwen3-32b"]
    assert qwen.token_bytes == 64 * 2 * 8 * 128 * 2 == 256 * 1024
    plan = plan_pool(qwen, prompt_tokens=512, requests=32, max_bytes=512 << 20)
    assert plan.blocks_per_request == 32 and plan.slots == 2
    assert plan.total_bytes <= 512 << 20
    with pytest.raises(DemoError, match=r"over the 512\.0 MiB memory cap"):
        plan_pool(qwen, prompt_tokens=4096, requests=1, max_bytes=512 << 20)
    with pytest.raises(DemoError, match="does not divide"):
        SideGeometry(qwen, tp=3, num_blocks=1)


def test_percentiles() -> None:
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert percentiles([3.0, 1.0, 2.0]) == {"p50": 2.0, "p95": 2.9, "p99": 2.98}


def test_nixl_is_the_default_transport() -> None:
    from kvpush.demo import DemoConfig

    parser = build_parser()
    assert parser.parse_args(["demo"]).transport is None  # not given: DemoConfig's default
    assert DemoConfig().transport == "nixl"
    assert "memory copies (default: nixl)" in " ".join(_demo_help(parser).split())


def _demo_help(parser: argparse.ArgumentParser) -> str:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    demo: argparse.ArgumentParser = sub.choices["demo"]
    return demo.format_help()


def test_a_missing_nixl_is_refused_with_the_fix(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # import fails as if absent
    assert main(["demo", "--transport", "nixl"]) == 2
    err = capsys.readouterr().err
    assert "--transport nixl needs NIXL" in err
    assert "pip install --no-deps nixl nixl-cu12" in err


@pytest.mark.nixl
def test_a_pool_over_the_cap_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--json", "--model", "qwen3-32b", "--prompt-tokens", "8192"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "raise --max-memory-mib" in captured.err
    assert "error" in json.loads(captured.out)


def test_the_xpyd_preset_and_explicit_options_override_it() -> None:
    def shape(*argv: str) -> dict[str, int]:
        return shape_of(build_parser().parse_args(["demo", *argv]))

    assert shape() == {"prefills": 1, "decodes": 1, "tp_prefill": 1, "tp_decode": 1}
    xpyd = {"prefills": 2, "decodes": 2, "tp_prefill": 2, "tp_decode": 1}
    assert shape("--preset", "xpyd") == xpyd
    assert shape("--preset", "xpyd", "--decodes", "3", "--tp-prefill", "4") == {
        **xpyd, "decodes": 3, "tp_prefill": 4,
    }  # fmt: skip
    assert shape("--prefills", "3", "--tp-decode", "2")["prefills"] == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefills", "9"], "prefills must be an int in [1, 8], got 9"),
        (["--decodes", "0"], "decodes must be an int in [1, 8], got 0"),
        (["--requests", "0"], "requests must be an int >= 1, got 0"),
        (["--qps", "-1"], "qps must be a number >= 0, got -1.0"),
        (["--model", "big"], "model must be one of 'qwen3-32b', 'small', got 'big'"),
        (["--preset", "x9yd"], "--preset: invalid choice: 'x9yd'"),
    ],
)
def test_bad_instance_options_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        status = main(["demo", *argv])
    except SystemExit as exc:  # argparse's own refusals (--preset)
        status = exc.code  # type: ignore[assignment]
    assert status == 2
    assert message in capsys.readouterr().err


def test_the_memory_cap_counts_every_instance(capsys: pytest.CaptureFixture[str]) -> None:
    small = MODELS["small"]  # 200 tokens: 13 blocks of 128 KiB per request and instance
    plan = plan_pool(small, 200, requests=16, max_bytes=64 << 20, prefills=2, decodes=2)
    assert plan.instance_slots == 8 and plan.slots == 16  # 8 per instance, 2 pairs at once
    assert plan.total_bytes == 4 * 8 * 13 * small.block_bytes <= 64 << 20
    capped = plan_pool(small, 200, requests=16, max_bytes=16 << 20, prefills=2, decodes=2)
    assert capped.instance_slots == 2 and capped.slots == 4
    assert capped.total_bytes <= 16 << 20
    # 1P1D fits in 4 MiB (2 x 1.6 MiB); 2 prefills and 2 decodes do not.
    argv = ["demo", "--json", "--transport", "memory", "--prompt-tokens", "200"]
    assert main([*argv, "--preset", "xpyd", "--max-memory-mib", "4"]) == 2
    err = capsys.readouterr().err
    assert "on each of the 4 instances (6.5 MiB in all), over the 4.0 MiB memory cap" in err
    assert plan_pool(small, 200, requests=1, max_bytes=4 << 20).slots == 1
