"""The fleet simulator (kvpush.sim): determinism, conservation, monotonicity,
the real core's epoch check, light-load fidelity and faults."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvpush.protocol import Consumer, StartWrite
from kvpush.routing import InstanceLoad
from kvpush.sim import Result, Scenario, load_scenario, simulate

MODES = ("pull", "push", "bg-pull", "progressive")


@pytest.fixture(scope="module")
def seed() -> Scenario:
    return load_scenario("seed")


def small(s: Scenario, **faults: float) -> Scenario:
    """Two prefill and two decode instances (routing, several peers), chunks of
    256 tokens (several increments a request in progressive mode)."""
    return s.with_fleet(prefill=2, decode=2).with_faults(**faults).with_control(chunk_tokens=256)


def assert_conserved(result: Result) -> None:
    fleet = result.fleet
    assert all(r.ended for r in result.requests)
    assert sum(not r.failed for r in result.requests) == result.row.completed
    for d in fleet.decodes:
        assert d.consumer.reserved_blocks == 0
        assert d.consumer.reservations() == []
        assert len(d.pool.free) == d.pool.size, f"{d.name} leaked blocks"
        assert not d.requests and not d.waiting and not d.running
    for p in fleet.prefills:
        if p.alive:
            assert p.producer.held_blocks == 0
            assert len(p.pool.free) == p.pool.size, f"{p.name} leaked blocks"
    assert result.row.stale_pairings == 0
    assert result.row.corrupt_writes == 0
    # the router gave back every charge: its loads are the idle fleet's
    assert {*fleet.ledger.prefills, *fleet.ledger.decodes} == {InstanceLoad()}


def test_kv_bytes_per_token_from_model_shape(seed: Scenario) -> None:
    # K and V x 64 layers x 8 KV heads x 128 dims x 2 bytes (BF16)
    assert seed.model.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2 == 262_144


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_result(seed: Scenario, mode: str) -> None:
    s = small(seed, preempt_per_s=2.0)
    a = simulate(s, mode, 6, 4096, requests=80, seed=7)
    b = simulate(s, mode, 6, 4096, requests=80, seed=7)
    assert a.row == b.row
    assert [r.first_token for r in a.requests] == [r.first_token for r in b.requests]
    assert a.events == b.events
    c = simulate(s, mode, 6, 4096, requests=80, seed=8)
    assert c.row != a.row


@pytest.mark.parametrize("mode", MODES)
def test_every_request_ends_and_no_block_leaks(seed: Scenario, mode: str) -> None:
    result = simulate(small(seed, preempt_per_s=5.0), mode, 8, 4096, requests=150, seed=1)
    assert result.row.preemptions > 0
    assert_conserved(result)
    increments = sum(r.increments for r in result.requests)
    assert (increments > 150) == (mode == "progressive")


def test_more_qps_never_lowers_pull_ttft(seed: Scenario) -> None:
    ttft = [
        simulate(seed, "pull", q, 4096, requests=150, seed=2).row.ttft_ms_mean
        for q in (1, 2, 4, 6, 8)
    ]
    assert ttft == sorted(ttft), ttft


def test_without_control_costs_pull_and_push_converge(seed: Scenario) -> None:
    def gap(s: Scenario) -> float:
        pull = simulate(s, "pull", 8, 16384, requests=200, seed=3).row
        push = simulate(s, "push", 8, 16384, requests=200, seed=3).row
        return abs(pull.ttft_ms_mean - push.ttft_ms_mean) / push.ttft_ms_mean

    free = seed.with_control(
        prep_fixed_ms=0.0, prep_per_desc_us=0.0, hop_ms=0.0, tokenize_us_per_token=0.0
    )
    free = dataclasses.replace(free, hardware=dataclasses.replace(free.hardware, wire_op_us=0.0))
    assert gap(seed) > 0.5
    assert gap(free) < 0.02


def _bypass_epochs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the consumer match a completion by transfer id alone, as vLLM's
    push connector does: a notice of an old epoch counts for the live one."""
    original = Consumer.completion_received

    def by_transfer_id(self: Consumer, now: float, peer: str | None, notice: object) -> None:
        live = self._live.get(notice.transfer_id)  # type: ignore[attr-defined]
        if live is not None:
            notice = dataclasses.replace(notice, epoch=live.epoch)  # type: ignore[type-var]
        original(self, now, peer, notice)  # type: ignore[arg-type]

    monkeypatch.setattr(Consumer, "completion_received", by_transfer_id)


def _preempt_during_writes(s: Scenario) -> Scenario:
    # a slow link keeps writes in flight long enough for preemptions to hit them
    return s.with_faults(
        preempt_per_s=20.0, slow_link_at_s=0.0, slow_link_for_s=1e6, slow_link_factor=5.0
    )


def test_epoch_check_keeps_stale_writes_out(seed: Scenario) -> None:
    result = simulate(_preempt_during_writes(seed), "push", 2, 16384, requests=120, seed=4)
    assert result.row.preemptions > 10
    assert_conserved(result)


def test_bypassing_the_epoch_check_is_detected(
    seed: Scenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    _bypass_epochs(monkeypatch)
    result = simulate(_preempt_during_writes(seed), "push", 2, 16384, requests=120, seed=4)
    assert result.row.stale_pairings > 0


def test_light_load_modes_within_ten_percent(seed: Scenario) -> None:
    rows = {m: simulate(seed, m, 1, 1024, requests=300, seed=0).row for m in MODES}
    push = rows["push"]
    for m in ("pull", "bg-pull"):
        assert abs(rows[m].ttft_ms_mean - push.ttft_ms_mean) <= 0.10 * push.ttft_ms_mean
        assert abs(rows[m].tpot_ms_mean - push.tpot_ms_mean) <= 0.10 * push.tpot_ms_mean
    assert 5.4 <= push.tpot_ms_mean <= 6.0  # seed: 5.6-5.8 ms


def test_loaded_16k_tpot_and_ttft_gap(seed: Scenario) -> None:
    # TPOT is stable across seeds: within 15% of the seed's 10.4 / 7.0 ms.
    # TTFT at 8 QPS x 16k is queueing near saturation; its +-15% check
    # averages five seeds (benchmarks/sim_fidelity.py).
    pull = simulate(seed, "pull", 8, 16384, requests=300, seed=0).row
    push = simulate(seed, "push", 8, 16384, requests=300, seed=0).row
    assert abs(pull.tpot_ms_mean - 10.4) <= 0.15 * 10.4
    assert abs(push.tpot_ms_mean - 7.0) <= 0.15 * 7.0
    assert pull.ttft_ms_mean > 1.5 * push.ttft_ms_mean


def test_bg_pull_takes_preparation_off_the_decode_loop(seed: Scenario) -> None:
    pull = simulate(seed, "pull", 8, 16384, requests=200, seed=0).row
    bg = simulate(seed, "bg-pull", 8, 16384, requests=200, seed=0).row
    push = simulate(seed, "push", 8, 16384, requests=200, seed=0).row
    assert bg.tpot_ms_mean < pull.tpot_ms_mean
    assert abs(bg.tpot_ms_mean - push.tpot_ms_mean) < 0.05 * push.tpot_ms_mean


@pytest.mark.parametrize("mode", MODES)
def test_prefill_death_fails_then_recovers(seed: Scenario, mode: str) -> None:
    # one prefill instance: requests arriving while it is down fail too
    s = (
        seed.with_fleet(decode=2)
        .with_control(chunk_tokens=256)
        .with_faults(kill_prefill_at_s=5.0, restart_after_s=3.0, detect_s=0.5)
    )
    result = simulate(s, mode, 4, 4096, requests=100, seed=5)
    assert result.row.failed > 0
    assert result.row.recovery_s is not None and 0 <= result.row.recovery_s < 20
    assert result.fleet.prefills[0].producer.identity.instance == 2
    assert_conserved(result)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_2p2d_kill_fails_only_the_requests_already_on_the_dead_prefill(
    seed: Scenario, mode: str
) -> None:
    """The router's health (kvpush.routing.Health, as ``kvpush router``): the
    dead prefill gets no new request, legs that reach it after its death are
    tried again on the other one, and it is probed back after its restart.
    Before the router had health, 16 QPS here failed 37-48 requests (every
    request routed to p0 while it was dead: holding nothing, it looked least
    loaded); now 0-1 (its queue at the moment it died)."""
    kill_at = 5.0
    s = seed.with_fleet(prefill=2, decode=2).with_faults(kill_prefill_at_s=kill_at)
    for seed_ in range(3):
        result = simulate(s, mode, 16, 1024, requests=300, seed=seed_)
        failed = [r for r in result.requests if r.failed]
        assert len(failed) <= 2, result.row.failures
        for r in failed:  # on p0 when it died: queued, computing or moving its KV
            assert r.prefill == 0 and r.arrival < kill_at, r
        later = [r for r in result.requests if r.arrival >= kill_at]
        assert later and not any(r.failed for r in later)
        assert all(r.prefill == 1 for r in later if r.arrival < kill_at + 5.0)  # p0 restarting
        assert any(r.prefill == 0 for r in later)  # p0 back after its restart and a probe
        assert result.fleet.health.up(0)
        assert_conserved(result)


def test_slow_link_recovers_without_failures(seed: Scenario) -> None:
    s = seed.with_faults(slow_link_at_s=5.0, slow_link_for_s=3.0, slow_link_factor=50.0)
    result = simulate(s, "push", 2, 16384, requests=60, seed=6)
    assert result.row.failed == 0
    assert result.row.recovery_s is not None and result.row.recovery_s > 0
    assert_conserved(result)


def test_sequential_router_costs_push_its_overlap(seed: Scenario) -> None:
    concurrent = simulate(seed, "push", 4, 16384, requests=150, seed=0).row
    s = seed.with_fleet(router="sequential")
    sequential = simulate(s, "push", 4, 16384, requests=150, seed=0).row
    assert sequential.ttft_ms_mean > concurrent.ttft_ms_mean


# --- progressive push ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tcp100() -> Scenario:
    return load_scenario("tcp100")


def test_progressive_overlaps_the_wire_with_the_prefill(tcp100: Scenario) -> None:
    # 16k on 100 Gb/s: ~380 ms of wire against ~390 ms of prefill, 8 chunks.
    push = simulate(tcp100, "push", 1, 16384, requests=100, seed=0)
    prog = simulate(tcp100, "progressive", 1, 16384, requests=100, seed=0)
    assert prog.row.ttft_ms_p50 < 0.8 * push.row.ttft_ms_p50
    assert prog.row.handoff_ms < 0.3 * push.row.handoff_ms
    assert prog.row.tpot_ms_mean == pytest.approx(push.row.tpot_ms_mean, rel=0.02)
    assert prog.fleet.stats["write_posts"] > 2 * push.fleet.stats["write_posts"]
    assert_conserved(prog)


def test_progressive_is_push_when_the_prompt_is_one_chunk(seed: Scenario) -> None:
    # seed, 1 QPS x 1k: one chunk, no increment: the very same run as push.
    push = simulate(seed, "push", 1, 1024, requests=300, seed=1).row
    prog = simulate(seed, "progressive", 1, 1024, requests=300, seed=1).row
    assert dataclasses.replace(prog, mode="push") == push


def test_progressive_under_preemption_keeps_every_byte(tcp100: Scenario) -> None:
    s = small(tcp100, preempt_per_s=2.0)
    result = simulate(s, "progressive", 2, 16384, requests=120, seed=2)
    assert result.row.preemptions > 20 and result.row.completed > 100
    assert_conserved(result)


def test_an_increment_left_unwritten_is_detected(
    tcp100: Scenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seeded bug: the data plane skips each increment's first block; the
    # fleet's own landing check (not the core) must see the hole.
    from kvpush.sim import _fleet

    moved = _fleet._moved

    def lossy(op: _fleet.Op) -> tuple[tuple[int, ...], tuple[int, ...]]:
        src, dst = moved(op)
        return (src[1:], dst[1:]) if isinstance(op, StartWrite) and op.first else (src, dst)

    monkeypatch.setattr(_fleet, "_moved", lossy)
    result = simulate(tcp100, "progressive", 1, 16384, requests=20, seed=0)
    assert result.row.stale_pairings > 0


def test_a_scenario_error_names_the_section_and_the_key(tmp_path: Path) -> None:
    """Each section is checked by the one validator (``build_options``): its
    ranges, its types, unknown keys; an override is checked the same way."""
    from kvpush.protocol import ConfigError
    from kvpush.sim import ScenarioError

    path = tmp_path / "bad.json"
    for body, message in (
        ({"fleet": {"prefill": 0}}, "section 'fleet': prefill must be an int in [1, 1024], got 0"),
        ({"hardware": {"tp": {"value": 2.5}}}, "section 'hardware': tp must be an int >= 1"),
        ({"hardware": {"nic_efficiency": 0}}, "nic_efficiency must be a number > 0, got 0.0"),
        ({"control": {"merge_push": 1}}, "section 'control': merge_push must be true or false"),
        ({"control": {"hop": 1}}, "section 'control': unknown control key(s) ['hop']"),
        ({"fleet": {"router": "fast"}}, "router must be one of 'auto', 'sequential'"),
        ({"hardware": {"prefill_cached_fraction": 1}}, "prefill_cached_fraction must lie in"),
    ):
        path.write_text(json.dumps({"extends": "seed", **body}))
        with pytest.raises(ScenarioError) as info:
            load_scenario(str(path))
        assert message in str(info.value)
    with pytest.raises(ConfigError, match=r"^decode must be an int in \[1, 1024\], got 2000$"):
        load_scenario("seed").with_fleet(decode=2000)
