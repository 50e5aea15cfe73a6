"""The vLLM connector's two halves without vLLM: a prefill and a decode
:class:`SchedulerSide`, each with its :class:`WorkerSide` ranks over real NIXL
(UCX on loopback), the per-step metadata shuttled by hand the way vLLM's
engine does (scheduler -> workers, workers -> scheduler). Bytes verified;
what vLLM would hear (finished sending / receiving, load errors) checked.
The same classes under vLLM's real scheduler: tests/vllm/."""

from __future__ import annotations

import json
import pathlib
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed (make test installs it)")

from kvpush.protocol import (
    Codec,
    ConfigError,
    HeadOrder,
    MemoryType,
    Mode,
    PeerState,
    Role,
    Staging,
)
from kvpush.runtime import CostModel, HostCopier
from kvpush_nixl import NixlTransport
from kvpush_vllm._config import ConnectorConfig
from kvpush_vllm._contract import NIXL_PREFILL_LEG, Contract
from kvpush_vllm._params import ParamsError, TransferParams
from kvpush_vllm._scheduler import Reports, SchedulerSide
from kvpush_vllm._tensors import layer_index, layout_from_tensors, token_scale
from kvpush_vllm._worker import WorkerSide

BS, HEADS, HEAD, LAYERS, BLOCKS = 16, 4, 64, 2, 32  # HEADS: the model's KV heads


class FakeTensor:
    """The part of torch.Tensor the layout code reads, over a numpy array."""

    def __init__(self, arr: np.ndarray, device: str = "cpu") -> None:
        self.arr = arr
        self.device = type("Device", (), {"type": device, "index": 0})()

    @property
    def shape(self) -> tuple[int, ...]:
        return self.arr.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.arr.itemsize for s in self.arr.strides)

    def data_ptr(self) -> int:
        return int(self.arr.ctypes.data)

    def element_size(self) -> int:
        return int(self.arr.itemsize)


def kv_tensors(order: str, heads: int = HEADS) -> dict[str, FakeTensor]:
    """Per-layer (2, blocks, tokens, heads, channels) tensors, logically; HND
    stores heads before tokens (a permuted view, as vLLM's stride order does)."""
    out = {}
    for layer in range(LAYERS):
        if order == "NHD":
            arr = np.zeros((2, BLOCKS, BS, heads, HEAD), dtype=np.float16)
        else:
            arr = np.zeros((2, BLOCKS, heads, BS, HEAD), dtype=np.float16).transpose(0, 1, 3, 2, 4)
        out[f"model.layers.{layer}.self_attn.attn"] = FakeTensor(arr)
    return out


def test_params_round_trip_and_refusals() -> None:
    p = TransferParams("kvp-1", "decode", Mode.PUSH, "127.0.0.1:9100")
    assert TransferParams.from_params(p.to_params()) == p
    assert TransferParams.from_params(None) is None
    assert TransferParams.from_params({"other": 1}) is None
    for bad in (
        {"kvpush": "x"},
        {"kvpush": {**p.to_params()["kvpush"], "role": "both"}},
        {"kvpush": {**p.to_params()["kvpush"], "mode": "fast"}},
        {"kvpush": {**p.to_params()["kvpush"], "peer": "no-port"}},
        {"kvpush": {**p.to_params()["kvpush"], "transfer_id": ""}},
    ):
        with pytest.raises(ParamsError):
            TransferParams.from_params(bad)


def test_config_parses_and_refuses_typos() -> None:
    cfg = ConnectorConfig.from_extra({"port": 9100, "mode": "pull", "secret": "s" * 16})
    assert (cfg.engine_id, cfg.mode, cfg.secret) == ("127.0.0.1:9100", Mode.PULL, b"s" * 16)
    assert ConnectorConfig.from_extra(None).engine_id.startswith("kvpush-")
    for bad in ({"prot": 1}, {"port": -1}, {"secret": "short"}, {"op_bound": 0}, {"mode": "x"}):
        with pytest.raises(ConfigError):
            ConnectorConfig.from_extra(bad)


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_layout_is_read_from_sizes_and_strides(order: str) -> None:
    tensors = kv_tensors(order)
    layout = layout_from_tensors(
        tensors, tokens_per_block=BS, num_kv_heads=HEADS, head_size=HEAD, platform="cuda"
    )
    assert [(r.layer, r.kind) for r in layout.regions] == [(0, "K"), (0, "V"), (1, "K"), (1, "V")]
    t = tensors["model.layers.0.self_attn.attn"]
    k, v = layout.regions[:2]
    assert k.base == t.data_ptr() and v.base == t.data_ptr() + BLOCKS * BS * HEADS * HEAD * 2
    assert k.order is HeadOrder[order] and k.block_len == BS * HEADS * HEAD * 2
    assert layer_index("model.layers.12.attn") == 12
    # A layout it cannot prove is refused, not guessed.
    odd = {
        "model.layers.0.attn": FakeTensor(np.zeros((2, BLOCKS, BS, HEADS, HEAD))[:, :, ::1, :, :32])
    }
    with pytest.raises(ConfigError, match="no dimension order"):
        layout_from_tensors(
            odd, tokens_per_block=BS, num_kv_heads=HEADS, head_size=32, platform="cuda"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Instance:
    """One vLLM instance's connector halves: scheduler side plus TP ranks."""

    def __init__(
        self,
        role: Role,
        tp: int,
        port: int = 0,
        transport: Callable[[str], Any] = NixlTransport,
        **extra_config: Any,
    ) -> None:
        extra: dict[str, Any] = {"port": port, **extra_config}
        self.config = ConnectorConfig.from_extra(extra)
        #: Staging pools (``staging_mib``), numpy here as the connector's are torch.
        self.pools: list[np.ndarray] = []
        self.sched = SchedulerSide(role, self.config, tp, HEADS, BS)
        heads = HEADS // tp
        # HND, as vLLM's CPU backend stores it: a TP mismatch sends head slices.
        self.tensors = [kv_tensors("HND", heads) for _ in range(tp)]
        self.workers = []
        blobs = {}
        for r in range(tp):
            layout = layout_from_tensors(
                self.tensors[r],
                tokens_per_block=BS,
                num_kv_heads=heads,
                head_size=HEAD,
                head_start=r * heads,
                platform="cuda",
            )
            w = WorkerSide(role, r, tp, Codec(), transport(f"{self.config.engine_id}-r{r}"))
            if self.config.staging_mib:
                pool = np.zeros(self.config.staging_mib << 20, dtype=np.uint8)
                self.pools.append(pool)
                nbytes = pool.size
                stage = Staging(base=pool.ctypes.data, nbytes=nbytes, memory=MemoryType.DRAM)
                layout = replace(layout, staging=stage)
                always = CostModel(0.0, 1.0, 0.0, 0.0, 0.0, margin=0.0)
                blobs[r] = w.register(layout, HostCopier(), always)
            else:
                blobs[r] = w.register(layout)
            self.workers.append(w)
        self.sched.start(blobs)
        self.seen = Reports()

    def step(self) -> None:
        """One engine step: metadata down, worker results up."""
        out, reports = self.sched.step()
        self.seen.sending |= reports.sending
        self.seen.recving |= reports.recving
        self.seen.failed.update(reports.failed)
        results = []
        for w in self.workers:
            w.step(out.actions, out.peers, self.sched.expecting(), self.sched.doorbell, out.staging)
            results += w.take_results()
        heard = self.sched.results(results)  # vLLM hears these in the same step
        self.seen.sending |= heard.sending
        self.seen.recving |= heard.recving

    def close(self) -> None:
        self.sched.close()
        for w in self.workers:
            w.close()


def run_until(instances: list[Instance], done: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, [i.seen for i in instances]
        for i in instances:
            i.step()
        time.sleep(0.002)


def blocks_of(inst: Instance, layer: int, ids: list[int]) -> np.ndarray:
    arrs = [t[f"model.layers.{layer}.self_attn.attn"].arr for t in inst.tensors]
    return np.concatenate([a[:, ids] for a in arrs], axis=3)  # heads of all ranks


@pytest.mark.parametrize(("p_tp", "d_tp", "mode"), [(1, 1, "push"), (2, 1, "push"), (1, 2, "pull")])
def test_a_request_moves_between_the_two_sides(p_tp: int, d_tp: int, mode: str) -> None:
    prefill = Instance(Role.PRODUCER, p_tp, port=free_port())
    decode = Instance(Role.CONSUMER, d_tp)
    try:
        peer = prefill.config.engine_id
        assert peer == f"127.0.0.1:{prefill.sched.port}"
        tid = "kvp-req-1"
        src, dst = [3, 4, 5, 9], [10, 2, 7, 8]
        rng = np.random.default_rng(0)
        for t in prefill.tensors:
            for layer in range(LAYERS):
                a = t[f"model.layers.{layer}.self_attn.attn"].arr
                a[:, src] = rng.standard_normal(a[:, src].shape).astype(np.float16)
        params_d = TransferParams(tid, "decode", Mode(mode), peer)
        assert decode.sched.tokens_to_load("d-1", params_d, 64, 0) == 64
        decode.sched.reserve("d-1", params_d, dst, 0)
        assert decode.sched.tokens_to_load("d-1", params_d, 64, 0) == 0  # asked again: no
        params_p = TransferParams(tid, "prefill", Mode(mode), "decode-url")
        assert prefill.sched.kv_ready("p-1", params_p, src) is True
        run_until(
            [prefill, decode],
            lambda: "d-1" in decode.seen.recving and "p-1" in prefill.seen.sending,
        )
        assert decode.seen.failed == {}
        for layer in range(LAYERS):
            assert np.array_equal(blocks_of(decode, layer, dst), blocks_of(prefill, layer, src))
        assert not prefill.sched.pending_push_work()
        assert decode.sched.tokens_to_load("d-1", params_d, 64, 0) == 0  # done: never again
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
def test_a_request_moves_staged_between_the_two_sides(p_tp: int, d_tp: int) -> None:
    """Issue 27 through the connector's halves: both sides have a staging pool
    (``staging_mib``), the decode's reservation takes a slot, its records reach
    the workers with the step's metadata, every write is gathered, sent as
    spans and scattered before the decode's core hears it."""
    prefill = Instance(Role.PRODUCER, p_tp, port=free_port(), staging_mib=1)
    decode = Instance(Role.CONSUMER, d_tp, staging_mib=1)
    try:
        peer = prefill.config.engine_id
        src, dst = [3, 4, 5, 9], [10, 2, 7, 8]
        rng = np.random.default_rng(1)
        for t in prefill.tensors:
            for layer in range(LAYERS):
                a = t[f"model.layers.{layer}.self_attn.attn"].arr
                a[:, src] = rng.standard_normal(a[:, src].shape).astype(np.float16)
        params_d = TransferParams("kvp-st", "decode", Mode.PUSH, peer)
        decode.sched.reserve("d-s", params_d, dst, 0)
        params_p = TransferParams("kvp-st", "prefill", Mode.PUSH, "decode-url")
        assert prefill.sched.kv_ready("p-s", params_p, src) is True
        run_until(
            [prefill, decode],
            lambda: "d-s" in decode.seen.recving and "p-s" in prefill.seen.sending,
        )
        assert decode.seen.failed == {}
        for layer in range(LAYERS):
            assert np.array_equal(blocks_of(decode, layer, dst), blocks_of(prefill, layer, src))
        staged = sum(w._dataplane.stager.staged_writes for w in prefill.workers)  # type: ignore[union-attr]
        scattered = sum(w._dataplane.stager.scatters for w in decode.workers)  # type: ignore[union-attr]
        assert staged == scattered == max(p_tp, d_tp)  # one per rank pair
        run_until([prefill, decode], lambda: not decode.sched.pending_push_work())
        for w in decode.workers:
            assert not w._dataplane.stager._records  # type: ignore[union-attr]
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("how", ["deadline", "finished"])
def test_a_released_staged_load_frees_its_blocks_only_once_the_workers_dropped_it(
    how: str,
) -> None:
    """A staged reservation released (its KV never came, or vLLM finished the
    request while it loaded): vLLM hears of it, and may reuse the blocks, only
    after its record left every worker, so no late scatter can write into
    blocks vLLM gave to another request. The finished case is heard through
    ``results`` in the very step the core released it, before the next step's
    metadata could carry the drop: without the scheduler's delay it is heard
    with the record still on the worker."""
    prefill = Instance(Role.PRODUCER, 1, port=free_port(), max_transit=0.2, staging_mib=1)
    decode = Instance(
        Role.CONSUMER, 1, ready_timeout=0.5, max_transit=0.2, op_bound=0.3, staging_mib=1
    )
    try:
        params = TransferParams("kvp-lost-st", "decode", Mode.PUSH, prefill.config.engine_id)
        decode.sched.reserve("d-l", params, [1, 2], 0)
        records = decode.workers[0]._dataplane.stager._records  # type: ignore[union-attr]
        heard = decode.seen.recving if how == "deadline" else decode.seen.sending
        held_when_heard: list[bool] = []
        recorded = False
        deadline = time.monotonic() + 10
        while "d-l" not in heard:
            assert time.monotonic() < deadline
            for inst in (prefill, decode):
                inst.step()
            held = any(k[0] == "kvp-lost-st" for k in records)
            recorded |= held
            if recorded and how == "finished" and decode.sched.finished_decode("d-l"):
                how = "asked"  # once: vLLM finished the request while it loaded
            if "d-l" in heard:
                held_when_heard.append(held)
                break
            time.sleep(0.01)
            # vLLM's update_connector_output: what it hears before the next step.
            now = decode.sched.results([])
            heard |= now.sending | now.recving
            if "d-l" in heard:
                held_when_heard.append(any(k[0] == "kvp-lost-st" for k in records))
        assert recorded, "the reservation's record never reached the worker"
        assert held_when_heard == [False], "vLLM heard of the release before the record left"
    finally:
        prefill.close()
        decode.close()


def test_kv_that_never_comes_fails_the_load_at_its_deadline() -> None:
    """The decode registers with a prefill whose KV never becomes ready: the
    load fails at its deadline, and vLLM hears of it (finished + load errors)
    only once the blocks are safe to reuse: here at once, since the prefill
    answers the abort with Settled (it never started a write)."""
    prefill = Instance(Role.PRODUCER, 1, port=free_port(), max_transit=0.2)  # must match
    decode = Instance(Role.CONSUMER, 1, ready_timeout=0.5, max_transit=0.2, op_bound=0.3)
    try:
        peer = prefill.config.engine_id
        params = TransferParams("kvp-lost", "decode", Mode.PUSH, peer)
        started = time.monotonic()
        decode.sched.reserve("d-2", params, [1, 2], 0)
        run_until([prefill, decode], lambda: "d-2" in decode.seen.recving)
        assert decode.seen.failed == {"d-2": [1, 2]}
        assert time.monotonic() - started >= 0.5 - 0.05
        # A decode request finished while loading keeps its blocks until released.
        decode.sched.reserve("d-3", TransferParams("kvp-3", "decode", Mode.PUSH, peer), [5], 0)
        assert decode.sched.finished_decode("d-3") is True
        run_until([prefill, decode], lambda: "d-3" in decode.seen.sending)
        assert "d-3" not in decode.seen.failed
    finally:
        prefill.close()
        decode.close()


def test_a_preempted_load_registers_again_under_a_new_epoch() -> None:
    """Preempted while loading: the old epoch is withdrawn (never reported to
    vLLM), the re-admitted request registers again, and only the new epoch's
    bytes make the request ready."""
    prefill = Instance(Role.PRODUCER, 1, port=free_port())
    decode = Instance(Role.CONSUMER, 1)
    try:
        peer = prefill.config.engine_id
        params = TransferParams("kvp-pre", "decode", Mode.PUSH, peer)
        src = [1, 2]
        for layer in range(LAYERS):
            prefill.tensors[0][f"model.layers.{layer}.self_attn.attn"].arr[:, src] = layer + 1
        decode.sched.reserve("d-p", params, [3, 4], 0)
        decode.step()
        decode.sched.preempted("d-p")
        assert decode.sched.tokens_to_load("d-p", params, 32, 0) == 32  # asks again
        decode.sched.reserve("d-p", params, [5, 6], 0)  # new blocks, new epoch
        prefill.sched.kv_ready("p-p", TransferParams("kvp-pre", "prefill", Mode.PUSH, "d"), src)
        run_until([prefill, decode], lambda: "d-p" in decode.seen.recving)
        assert decode.seen.failed == {} and decode.seen.sending == set()
        for layer in range(LAYERS):
            assert np.array_equal(blocks_of(decode, layer, [5, 6]), blocks_of(prefill, layer, src))
            assert not blocks_of(decode, layer, [3, 4]).any()  # the old epoch got nothing
        run_until([prefill, decode], lambda: not decode.sched.pending_push_work())
    finally:
        prefill.close()
        decode.close()


def test_the_cpu_backends_k_then_v_tiles_are_one_region_of_virtual_tokens() -> None:
    """vLLM 0.33 on CPU: (blocks, heads, tokens, 2 x head_size), each (block,
    head) tile K rows then V rows: one "tile" region, HND, 2 x block_size rows.
    Only the platform tells it from vLLM 0.33's packed GPU view of the same shape."""
    arr = np.zeros((BLOCKS, HEADS, BS, 2 * HEAD), dtype=np.float32)
    tensors = {"model.layers.0.attn": FakeTensor(arr)}
    shape = {"tokens_per_block": BS, "num_kv_heads": HEADS, "head_size": HEAD}
    (packed,) = layout_from_tensors(tensors, **shape, platform="cuda").regions
    assert (packed.kind, packed.order, packed.tokens_per_block, packed.head_bytes) == (
        "KV", HeadOrder.HND, BS, 2 * HEAD * 4,
    )  # fmt: skip
    layout = layout_from_tensors(tensors, **shape, platform="cpu")
    (r,) = layout.regions
    assert (r.kind, r.order, r.tokens_per_block, r.num_heads) == (
        "tile",
        HeadOrder.HND,
        2 * BS,
        HEADS,
    )
    assert r.block_len == arr[0].nbytes and r.stride == arr.strides[0]
    assert token_scale(layout, BS) == 2
    with pytest.raises(ConfigError, match=r"refuses kv_layout: .* CPU backend's cache must be"):
        layout_from_tensors(
            {"model.layers.0.attn": FakeTensor(arr.transpose(0, 2, 1, 3))},
            tokens_per_block=HEADS,
            num_kv_heads=BS,
            head_size=HEAD,
            platform="cpu",
        )


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_the_breakdown_has_every_moment_of_a_request_in_order(
    mode: str, tmp_path: pathlib.Path
) -> None:
    """With ``timeline_file``, each side writes one line per transfer whose
    moments (one clock for both processes) follow the request through both
    engines: the issue-15 breakdown that benchmarks/vllm_peer.py joins."""
    path = tmp_path / "timeline.jsonl"
    prefill = Instance(Role.PRODUCER, 1, port=free_port(), timeline_file=str(path))
    decode = Instance(Role.CONSUMER, 1, timeline_file=str(path))
    try:
        tid, peer = f"kvp-bd-{mode}", prefill.config.engine_id
        params_d = TransferParams(tid, "decode", Mode(mode), peer)
        params_p = TransferParams(tid, "prefill", Mode(mode), "decode-url")
        prefill.sched.breakdown.stamp("p-1", "scheduled", transfer_id=tid)  # as the connector
        assert decode.sched.tokens_to_load("d-1", params_d, 64, 0) == 64
        decode.sched.reserve("d-1", params_d, [10, 2, 7, 8], 0)
        assert prefill.sched.kv_ready("p-1", params_p, [3, 4, 5, 9]) is True
        run_until(
            [prefill, decode],
            lambda: "d-1" in decode.seen.recving and "p-1" in prefill.seen.sending,
        )
        # As the connector does: a first step ends the line only once vLLM's
        # scheduler saw the load finished, and only for a reported load.
        bd = decode.sched.breakdown
        assert not bd.waiting("d-1", "recving_seen")  # no line yet
        for req_id in ("d-1", "other"):
            if bd.waiting(req_id, "reported"):
                bd.stamp(req_id, "recving_seen")
        assert not bd.waiting("other", "recving_seen")
        assert bd.waiting("d-1", "recving_seen")
        bd.stamp("d-1", "first_step")
        bd.write("d-1", outcome="ready")
    finally:
        prefill.close()
        decode.close()
    lines = {rec["side"]: rec for rec in map(json.loads, path.read_text().splitlines())}
    assert sorted(lines) == ["decode", "prefill"]
    d, p = lines["decode"], lines["prefill"]
    assert (d["transfer_id"], d["req_id"], d["outcome"], d["mode"]) == (tid, "d-1", "ready", mode)
    assert (p["transfer_id"], p["req_id"], p["outcome"]) == (tid, "p-1", "delivered")
    order_d = ["arrived", "reserved", "registration_sent", "ready", "delivered", "reported"]
    order_d += ["recving_seen", "first_step"]
    assert [d[k] for k in order_d] == sorted(d[k] for k in order_d)
    order_p = ["scheduled", "kv_ready", "write_started", "released"]
    assert [p[k] for k in order_p] == sorted(p[k] for k in order_p)
    side_ops = p if mode == "push" else d  # the side whose data plane posts
    ops = ["op_plan_started", "op_planned", "op_posted", "op_done"]
    assert [side_ops[k] for k in ops] == sorted(side_ops[k] for k in ops)
    if mode == "push":
        assert p["kv_ready"] <= p["op_posted"] <= d["notice_seen"] <= d["ready"]
    else:
        assert p["kv_ready"] <= d["op_posted"] <= d["ready"]


def test_an_idle_decode_step_waits_for_its_kv_and_wakes_on_the_channel() -> None:
    """vLLM steps a decode that only waits for remote KV without pause (about
    1.5 cores on CPU); an empty step waits up to ``idle_wait`` instead, and an
    Announce (pull) ends the wait at once with the read to post."""
    prefill = Instance(Role.PRODUCER, 1, port=free_port())
    decode = Instance(Role.CONSUMER, 1, idle_wait=0.5)
    try:
        peer = prefill.config.engine_id
        t0 = time.monotonic()
        out, _ = decode.sched.step(idle=True)
        assert time.monotonic() - t0 < 0.2 and not out.actions  # nothing loading: no wait
        for tid in ("kvp-idle-push", "kvp-idle-pull"):
            mode = Mode.PUSH if tid.endswith("push") else Mode.PULL
            params = TransferParams(tid, "decode", mode, peer)
            decode.sched.reserve(f"d-{tid}", params, [1, 2], 0)
        run_until([prefill, decode], lambda: bool(prefill.sched._sync and decode.sched._key_of))
        time.sleep(0.2)  # both registrations are at the prefill
        t0 = time.monotonic()
        decode.sched.step(idle=False)  # vLLM ran a batch: no wait
        assert time.monotonic() - t0 < 0.2
        t0 = time.monotonic()
        out, _ = decode.sched.step(idle=True)  # loads in flight, nothing comes: the whole wait
        assert time.monotonic() - t0 >= 0.45 and not out.actions
        params_p = TransferParams("kvp-idle-pull", "prefill", Mode.PULL, "decode-url")
        prefill.sched.kv_ready("p-1", params_p, [3, 4])  # the prefill announces
        t0 = time.monotonic()
        out, _ = decode.sched.step(idle=True)
        assert time.monotonic() - t0 < 0.4
        assert [a.transfer_id for a in out.actions] == ["kvp-idle-pull"]
    finally:
        prefill.close()
        decode.close()


def _fill(inst: Instance, ids: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for t in inst.tensors:
        for layer in range(LAYERS):
            a = t[f"model.layers.{layer}.self_attn.attn"].arr
            a[:, ids] = rng.standard_normal(a[:, ids].shape).astype(np.float16)


def test_llmd_sidecar_push_exchange_with_an_identity_change_and_the_resend() -> None:
    """The exchange llm-d's sidecar performs in NIXL push mode
    (pkg/sidecar/proxy: nixl_push_identity.go and its parallel dispatch),
    replayed against the two real connector halves through the contract:

    1. first request to the endpoint, serial: the prefill leg
       (``do_remote_decode`` and a ``transfer_id``), then the decode leg = the
       prefill's answer verbatim;
    2. parallel: the decode leg built from the cached identity, sent before
       the prefill answers;
    3. the prefill restarts (same address, new instance): the parallel decode
       leg carries the stale identity, the prefill's answer does not match it,
       so the sidecar cancels that decode request and sends it again with the
       answer's parameters, under the same transfer id.

    Every load lands byte-exact, the cancelled one loads nothing, and no
    block is held anywhere at the end."""
    port = free_port()
    fast = {"max_transit": 0.2, "op_bound": 0.3}
    prefill = Instance(Role.PRODUCER, 1, port=port, **fast)
    # The cancelled leg was registered with the instance that went away: its
    # blocks drain by its deadline's quarantine (ready_timeout + max_transit +
    # op_bound), kept short here.
    decode = Instance(
        Role.CONSUMER, 1, allowed_peers=[f"127.0.0.1:{port}"], ready_timeout=3.0, **fast
    )
    trust = Contract(allowed_peers=frozenset({f"127.0.0.1:{port}"}))
    identity_keys = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "transfer_mode")

    def prefill_answers(p: Instance, tid: str, src: list[int]) -> dict[str, Any]:
        leg = trust.parse(
            {**NIXL_PREFILL_LEG, "transfer_id": tid}, f"p-{tid}", "prefill"
        )  # what request_finished parses
        assert leg is not None and p.sched.kv_ready(f"p-{tid}", leg, src)
        engine = f"{p.config.engine_id}#{p.sched.instance:016x}"
        answer = trust.answer(leg, f"p-{tid}", p.sched.control_address(), engine, 1)
        assert answer is not None
        return json.loads(json.dumps(answer))  # through JSON, as the sidecar sees it

    def decode_leg(req: str, params: dict[str, Any], dst: list[int]) -> None:
        leg = trust.parse(params, req, "decode")
        assert leg is not None and leg.mode is Mode.PUSH
        assert decode.sched.tokens_to_load(req, leg, 32, 0) == 32
        decode.sched.reserve(req, leg, dst, 0)

    def loaded(p: Instance, req: str, src: list[int], dst: list[int]) -> None:
        run_until([p, decode], lambda: req in decode.seen.recving)
        assert req not in decode.seen.failed
        for layer in range(LAYERS):
            assert np.array_equal(blocks_of(decode, layer, dst), blocks_of(p, layer, src))

    try:
        # 1. Serial: the answer verbatim (it carries the transfer id).
        _fill(prefill, [1, 2], seed=1)
        answer = prefill_answers(prefill, "xfer-1", [1, 2])
        cached = {k: answer[k] for k in identity_keys}
        decode_leg("d-1", answer, [3, 4])
        loaded(prefill, "d-1", [1, 2], [3, 4])
        # 2. Parallel: decode first, from the cached identity.
        per_request = {"do_remote_prefill": True, "do_remote_decode": False}
        decode_leg("d-2", {**cached, **per_request, "transfer_id": "xfer-2"}, [5, 6])
        _fill(prefill, [7, 8], seed=2)
        assert (
            prefill_answers(prefill, "xfer-2", [7, 8])["remote_engine_id"]
            == cached["remote_engine_id"]
        )
        loaded(prefill, "d-2", [7, 8], [5, 6])
        run_until([prefill, decode], lambda: not prefill.sched.pending_push_work())
        # 3. The prefill restarts on the same address: a new instance.
        prefill.close()
        prefill = Instance(Role.PRODUCER, 1, port=port, **fast)
        decode_leg("d-3a", {**cached, **per_request, "transfer_id": "xfer-3"}, [9, 10])
        _fill(prefill, [11, 12], seed=3)
        fresh = prefill_answers(prefill, "xfer-3", [11, 12])
        assert {k: fresh[k] for k in identity_keys} != cached  # the sidecar sees a change
        assert decode.sched.finished_decode("d-3a") is True  # vLLM aborts the cancelled leg
        # The sidecar's HTTP round trip: by the time the resend reaches the
        # decode, its channel has met the new instance (reserve never waits for
        # the channel's loop, so the test waits here as the real hop does).
        rt = decode.sched._running()[0].runtime

        def knows_new_prefill() -> bool:
            with rt.lock:
                hello = rt.endpoint.peer(f"127.0.0.1:{port}").hello
            return hello is not None and hello.instance == prefill.sched.instance

        run_until([prefill, decode], knows_new_prefill)
        decode_leg("d-3b", fresh, [13, 14])  # sent again, same transfer id
        loaded(prefill, "d-3b", [11, 12], [13, 14])
        run_until([prefill, decode], lambda: "d-3a" in decode.seen.sending)  # blocks freed

        run_until(
            [prefill, decode],
            lambda: not prefill.sched.pending_push_work() and not decode.sched.pending_push_work(),
        )
        for layer in range(LAYERS):
            assert not blocks_of(decode, layer, [9, 10]).any()  # the cancelled leg got nothing
        assert decode.sched.stats().get("g:reserved") == 0
        assert prefill.sched.stats().get("g:held", 0) == 0
    finally:
        prefill.close()
        decode.close()


def test_a_refused_reservation_tells_the_prefill_which_releases_its_kv_at_once() -> None:
    """Issue 28, item 4, through the runtime pair: the decode's core refuses a
    reservation of a trusted leg (its block budget, here), so the decode
    recomputes the request and tells the prefill (``Consumer.decline``): the
    prefill's producer releases the held KV within a round trip, not at its
    ``kv_hold_timeout``. Without a handshake with the leg's prefill nothing is
    sent (and nothing dialed): counted, that prefill holds until its timeout."""
    prefill = Instance(Role.PRODUCER, 1, port=free_port(), kv_hold_timeout=20.0)
    decode = Instance(Role.CONSUMER, 1, kv_hold_timeout=20.0)
    try:
        peer = prefill.config.engine_id
        # A first transfer: the decode's handshake with the prefill is done.
        decode.sched.reserve("d-1", TransferParams("kvp-1", "decode", Mode.PUSH, peer), [1], 0)
        prefill.sched.kv_ready("p-1", TransferParams("kvp-1", "prefill", Mode.PUSH, "d"), [1])
        run_until([prefill, decode], lambda: "p-1" in prefill.seen.sending)
        # The prefill holds the next transfer's KV; the decode's core refuses it.
        prefill.sched.kv_ready("p-2", TransferParams("kvp-2", "prefill", Mode.PUSH, "d"), [2, 3])
        rt = decode.sched._running()[0].runtime
        rt.endpoint.config = replace(rt.endpoint.config, max_reserved_blocks=1)
        started = time.monotonic()
        decode.sched.reserve("d-2", TransferParams("kvp-2", "decode", Mode.PUSH, peer), [4, 5], 0)
        run_until([prefill, decode], lambda: "p-2" in prefill.seen.sending, timeout=5.0)
        assert time.monotonic() - started < 2.0
        assert decode.seen.failed == {"d-2": [4, 5]}  # vLLM recomputes it
        assert prefill.sched.stats().get("g:held") == 0
        # A prefill never met: not told, not dialed; counted.
        far = f"127.0.0.1:{free_port()}"
        decode.sched.reserve("d-3", TransferParams("kvp-3", "decode", Mode.PUSH, far), [6, 7], 0)
        counts = decode.sched.stats()
        assert (counts.get("declined"), counts.get("decline_unsent")) == (1, 1), counts
        with rt.lock:
            assert rt.endpoint.peer(far).state is PeerState.DISCONNECTED
    finally:
        prefill.close()
        decode.close()


def test_a_release_frees_the_prefills_kv_held_or_yet_to_come() -> None:
    """The router's release (its decode leg failed before the decode's engine
    saw it): a held transfer is released at once; one released before its KV
    is ready gives the KV back as soon as it is (the core's tombstone)."""
    prefill = Instance(Role.PRODUCER, 1, port=free_port(), kv_hold_timeout=20.0)
    try:
        prefill.sched.kv_ready("p-1", TransferParams("kvp-r1", "prefill", Mode.PUSH, "d"), [1, 2])
        prefill.step()
        assert "p-1" not in prefill.seen.sending  # held for its decode
        prefill.sched.release("kvp-r1")
        run_until([prefill], lambda: "p-1" in prefill.seen.sending, timeout=2.0)
        prefill.sched.release("kvp-r2")  # before its KV is ready
        prefill.sched.kv_ready("p-2", TransferParams("kvp-r2", "prefill", Mode.PUSH, "d"), [3])
        run_until([prefill], lambda: "p-2" in prefill.seen.sending, timeout=2.0)
        assert prefill.sched.stats()["release_legs"] == 2
        assert not prefill.sched.pending_push_work()
    finally:
        prefill.close()
