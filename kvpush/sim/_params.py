"""Scenario parameters: a named set of numbers loaded from a JSON data file.

Every number lives in ``scenarios/<name>.json`` next to this module, with its
source. This module only types them, validates them and derives the costs the
simulator uses from them (prefill time, decode step time, descriptor counts,
bytes per token), so that the mechanisms, not per-point fitting, shape the
results.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from kvpush.protocol import ConfigError, build_options, check_options, option

__all__ = (
    "Control",
    "Faults",
    "FleetParams",
    "Hardware",
    "Model",
    "Scenario",
    "ScenarioError",
    "available_scenarios",
    "load_scenario",
)


T = TypeVar("T")


class ScenarioError(ValueError):
    """A scenario file or an override is missing, malformed or out of range."""


@dataclass(frozen=True, slots=True)
class Model:
    """The served model's shape (what KV bytes and FLOPs follow from)."""

    name: str = option()
    params_b: float = option(low=0)
    layers: int = option(low=0)
    kv_heads: int = option(low=0)
    q_heads: int = option(low=0)
    head_dim: int = option(low=0)
    dtype_bytes: int = option(low=0)
    tokens_per_block: int = option(low=1)

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: 2 * L * H_kv * d * bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.dtype_bytes

    def prefill_flops(self, tokens: int, cached: float = 0.0) -> float:
        """Dense matmuls (2 * params per new token) plus causal attention of
        the new tokens (QK^T and PV: 2 * L * q_heads * head_dim per query-key
        pair); the first ``cached`` fraction of the prompt is a prefix-cache hit."""
        return self.span_flops(int(tokens * cached), tokens)

    def span_flops(self, start: int, end: int) -> float:
        """The FLOPs of computing tokens ``start..end`` with ``0..start`` in cache."""
        dense = 2.0 * self.params_b * 1e9 * (end - start)
        pairs = (end * end - start * start) / 2
        return dense + 4.0 * self.layers * pairs * self.q_heads * self.head_dim

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.tokens_per_block)


@dataclass(frozen=True, slots=True)
class Hardware:
    """One instance's accelerators and its network interface."""

    tp: int = option(low=1)
    peak_tflops: float = option(low=0)
    prefill_mfu: float = option(above=0)
    prefill_fixed_ms: float = option(low=0)
    prefill_cached_fraction: float = option(low=0)
    hbm_tb_s: float = option(low=0)
    hbm_efficiency: float = option(above=0)
    hbm_gb: float = option(low=0)
    kv_memory_fraction: float = option(low=0)
    decode_fixed_ms: float = option(low=0)
    decode_per_seq_ms: float = option(low=0)
    nic_gbit_s: float = option(low=0)
    nic_efficiency: float = option(above=0)
    transfer_latency_us: float = option(low=0)
    wire_op_us: float = option(low=0)

    def __post_init__(self) -> None:
        check_options(self)

    def prefill_s(self, model: Model, tokens: int) -> float:
        return self.prefill_chunks(model, tokens, tokens)[-1][1]

    def prefill_chunks(self, model: Model, tokens: int, chunk: int) -> list[tuple[int, float]]:
        """(tokens computed, seconds since the prefill began) at the end of each
        chunk of ``chunk`` tokens: the cached prefix first (free), then the rest
        in chunks, the fixed cost paid once before the first. The last entry is
        the whole prefill, whatever ``chunk`` is."""
        rate = self.tp * self.peak_tflops * 1e12 * self.prefill_mfu
        start = int(tokens * self.prefill_cached_fraction)
        out: list[tuple[int, float]] = []
        t = self.prefill_fixed_ms / 1e3
        while True:
            end = min(tokens, start + chunk)
            t += model.span_flops(start, end) / rate
            out.append((end, t))
            if end >= tokens:
                return out
            start = end

    def step_s(self, model: Model, batch: int, context_tokens: int) -> float:
        """One decode step: fixed cost (weights read, collectives, launch),
        a per-sequence cost, and reading every running sequence's KV."""
        hbm = self.hbm_tb_s * 1e12 * self.hbm_efficiency
        weights = model.weight_bytes / self.tp / hbm
        kv = context_tokens * model.kv_bytes_per_token / self.tp / hbm
        return weights + kv + (self.decode_fixed_ms + self.decode_per_seq_ms * batch) / 1e3

    def kv_blocks(self, model: Model) -> int:
        """Blocks of KV one instance can hold (all ranks together)."""
        free = self.hbm_gb * 1e9 * self.tp * self.kv_memory_fraction - model.weight_bytes
        if free <= 0:
            raise ScenarioError("the model does not fit: no memory left for KV")
        return int(free // (model.kv_bytes_per_token * model.tokens_per_block))

    def nic_bytes_per_s(self) -> float:
        """Effective bytes per second of one instance's NICs (all ranks)."""
        return self.nic_gbit_s * 1e9 / 8 * self.nic_efficiency


@dataclass(frozen=True, slots=True)
class Control:
    """Control-path costs: descriptor preparation, hops, tokenisation."""

    prep_fixed_ms: float = option(low=0)
    prep_per_desc_us: float = option(low=0)
    desc_regions: int = option(low=0)
    merge_push: bool = option()
    merge_bg_pull: bool = option()
    hop_ms: float = option(low=0)
    frontend_ms: float = option(low=0)
    control_latency_ms: float = option(low=0)
    tokenize_us_per_token: float = option(low=0)
    #: Progressive push: the prefill's chunk (tokens per ``kv_ready(final=False)``).
    chunk_tokens: int = option(8192, low=1)

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, slots=True)
class FleetParams:
    """Sizes and routing."""

    prefill: int = option(low=1, high=1024)
    decode: int = option(low=1, high=1024)
    output_tokens: int = option(low=1)
    router: str = option(choices=("auto", "sequential", "concurrent"))

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, slots=True)
class Faults:
    """Fault injection; all off by default (rates 0, times < 0)."""

    preempt_per_s: float = option(0.0, low=0)
    requeue_ms: float = option(5.0, low=0)
    kill_prefill_at_s: float = option(-1.0)
    restart_after_s: float = option(5.0, low=0)
    detect_s: float = option(0.5, low=0)
    slow_link_at_s: float = option(-1.0)
    slow_link_for_s: float = option(5.0, low=0)
    slow_link_factor: float = option(10.0, low=0)

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    model: Model
    hardware: Hardware
    control: Control
    fleet: FleetParams
    faults: Faults
    sources: tuple[tuple[str, str], ...] = ()

    def with_fleet(self, **changes: Any) -> Scenario:
        return replace(self, fleet=replace(self.fleet, **changes))

    def with_faults(self, **changes: Any) -> Scenario:
        return replace(self, faults=replace(self.faults, **changes))

    def with_control(self, **changes: Any) -> Scenario:
        return replace(self, control=replace(self.control, **changes))


def _build(cls: type[T], name: str, raw: object) -> T:
    if not isinstance(raw, dict):
        raise ScenarioError(f"section {name!r} must be an object")
    values = {k: v.get("value") if isinstance(v, dict) else v for k, v in raw.items()}
    try:  # "_" keys: comments and sources
        return build_options(cls, {k: v for k, v in values.items() if k[:1] != "_"}, what=name)
    except (ConfigError, TypeError) as exc:
        raise ScenarioError(f"section {name!r}: {exc}") from None


def _sources(raw: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for section, body in raw.items():
        if isinstance(body, dict):
            for key, entry in body.items():
                if isinstance(entry, dict) and "source" in entry:
                    out.append((f"{section}.{key}", str(entry["source"])))
    return tuple(out)


def _scenario_dir() -> Path:
    return Path(str(resources.files("kvpush.sim") / "scenarios"))


def available_scenarios() -> list[str]:
    """Names of the scenario files shipped with the package."""
    return sorted(p.stem for p in _scenario_dir().glob("*.json"))


def load_scenario(name_or_path: str) -> Scenario:
    """Load a shipped scenario by name, or a JSON file by path."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = _scenario_dir() / f"{name_or_path}.json"
        if not path.is_file():
            names = ", ".join(available_scenarios())
            raise ScenarioError(f"unknown scenario {name_or_path!r} (known: {names})")
    raw = _read(path, depth=0)
    scenario = Scenario(
        name=str(raw.get("name", path.stem)),
        model=_build(Model, "model", raw.get("model")),
        hardware=_build(Hardware, "hardware", raw.get("hardware")),
        control=_build(Control, "control", raw.get("control")),
        fleet=_build(FleetParams, "fleet", raw.get("fleet")),
        faults=_build(Faults, "faults", raw.get("faults", {})),
        sources=_sources(raw),
    )
    check_scenario(scenario)
    return scenario


def _read(path: Path, depth: int) -> dict[str, Any]:
    """A scenario file's JSON; ``"extends": "<name>"`` starts from another
    shipped scenario and overrides it section by section, key by key."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ScenarioError(f"cannot read scenario {str(path)!r}: {exc}") from None
    if not isinstance(raw, dict):
        raise ScenarioError(f"scenario {str(path)!r} must be a JSON object")
    base_name = raw.pop("extends", None)
    if base_name is None:
        return raw
    base_path = _scenario_dir() / f"{base_name}.json"
    if depth > 4 or not isinstance(base_name, str) or not base_path.is_file():
        raise ScenarioError(f"scenario {str(path)!r} extends unknown {base_name!r}")
    merged = _read(base_path, depth + 1)
    for key, value in raw.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def check_scenario(s: Scenario) -> None:
    """Raise :class:`ScenarioError` if ``s`` cannot be simulated (each section
    checked its own ranges)."""
    if s.model.kv_heads % s.hardware.tp:
        raise ScenarioError("hardware.tp must divide model.kv_heads")
    if not s.hardware.prefill_cached_fraction < 1:
        raise ScenarioError("hardware.prefill_cached_fraction must lie in [0, 1)")
    s.hardware.kv_blocks(s.model)
