"""What the connector accepts: only what kvpush's tests prove exact, per platform.

An engine's KV memory is known only by reading what vLLM allocates and what
its attention backend reads, so every fact that decides where KV bytes live
is checked at start-up against :data:`PROVEN` and anything else refused
(unless ``allow_unproven`` lists it); what must also match the peer goes into
:func:`handshake_fingerprint` (docs/vllm.md, "Supported and refused").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvpush.protocol import ConfigError, KVLayout

__all__ = ("FIELDS", "PROVEN", "Facts", "check_proven", "handshake_fingerprint", "kv_layout_kind")

log = logging.getLogger("kvpush.vllm")

#: Platform -> field -> the proven values (docs/vllm.md, "Supported and refused").
PROVEN: Mapping[str, Mapping[str, frozenset[str]]] = {
    "cpu": {
        "kv_layout": frozenset({"cpu-tile"}),
        "cpu_attn_isa": frozenset({"vec"}),
        "kv_dtype": frozenset({"float32"}),
        "block_size": frozenset({"32", "64"}),
        "head_size": frozenset({"64", "128"}),
        # TP 2 -> 1, 1 -> 2 and 2 -> 2 (tests/e2e/test_vllm_e2e_tp.py).
        "tensor_parallel_size": frozenset({"1", "2"}),
        "pipeline_parallel_size": frozenset({"1"}),
        "use_mla": frozenset({"False"}),
        "kv_cache_groups": frozenset({"FullAttentionSpec"}),
        # A CPU forward has written its KV when wait_for_save runs.
        "progressive": frozenset({"cpu"}),
    },
    "cuda": {
        # vLLM 0.33's packed views in LBHNC/BLHNC ("HND") or LBNHC/BLNHC ("NHD") order.
        "kv_layout": frozenset({"packed-HND", "packed-NHD"}),
        # Per-tensor scales only: per-token-head and FP4 formats keep scales beside the cache.
        "kv_dtype": frozenset({"bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"}),
        "block_size": frozenset({"16", "32", "64", "128"}),
        "head_size": frozenset({"64", "128", "256"}),
        "tensor_parallel_size": frozenset({"1", "2", "4", "8"}),
        "pipeline_parallel_size": frozenset({"1"}),
        "use_mla": frozenset({"False"}),
        "kv_cache_groups": frozenset({"FullAttentionSpec"}),
        # A write waits for the CUDA event recorded after the forward (_worker.py).
        "progressive": frozenset({"cuda"}),
    },
}
#: Every field :func:`check_proven` may refuse (the names ``allow_unproven`` takes).
FIELDS = frozenset({"platform"}.union(*PROVEN.values()))


@dataclass(frozen=True, slots=True)
class Facts:
    """What one engine's vLLM config says about where its KV lives."""

    platform: str
    kv_dtype: str
    block_size: int
    head_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    use_mla: bool
    #: Spec class names of the KV cache groups (``"?"`` when vLLM did not say).
    kv_cache_groups: tuple[str, ...]
    #: The CPU backend's attention ISA ("" off CPU; "unknown" if vLLM would not say).
    cpu_attn_isa: str

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any) -> Facts:
        model, cache = vllm_config.model_config, vllm_config.cache_config
        parallel = vllm_config.parallel_config
        dtype = str(model.dtype).removeprefix("torch.")
        cache_dtype = str(getattr(cache, "cache_dtype", "auto") or "auto")
        kv_dtype = dtype if cache_dtype == "auto" else cache_dtype
        platform = str(getattr(vllm_config.device_config, "device_type", "") or "")
        groups: tuple[str, ...] = ("?",)
        if kv_cache_config is not None:
            groups = tuple(type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups)
        isa = ""
        if platform == "cpu":
            isa = _cpu_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache_dtype)
        return cls(
            platform=platform,
            kv_dtype=kv_dtype,
            block_size=int(cache.block_size),
            head_size=int(model.get_head_size()),
            tensor_parallel_size=int(parallel.tensor_parallel_size),
            pipeline_parallel_size=int(parallel.pipeline_parallel_size),
            use_mla=bool(getattr(model, "use_mla", False)),
            kv_cache_groups=groups,
            cpu_attn_isa=isa,
        )

    def values(self) -> dict[str, str]:
        """The start-up fields as checked against :data:`PROVEN` (all but ``kv_layout``)."""
        # kv_dtype .. use_mla, in field order (check_proven names the first refused)
        out = {f.name: str(getattr(self, f.name)) for f in fields(self)[1:-2]}
        out["kv_cache_groups"] = "+".join(self.kv_cache_groups)
        if self.platform == "cpu":
            out["cpu_attn_isa"] = self.cpu_attn_isa
        return out


def _cpu_attn_isa(dtype: Any, block_size: int, head_size: int, cache_dtype: str) -> str:
    """The ISA vLLM's CPU attention picks (its KV tile format depends on it)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:
        return "unknown"
    try:
        return str(_get_attn_isa(dtype, block_size, head_size, cache_dtype))
    except Exception as exc:
        return f"unsupported ({exc})"[:120]


def kv_layout_kind(layout: KVLayout) -> str:
    """``"cpu-tile"`` (the CPU backend's K-then-V tiles), ``"packed-NHD"`` or
    ``"packed-HND"`` (vLLM 0.33's ``[k | v]`` rows), ``"split-NHD"`` or
    ``"split-HND"`` (separate K and V regions), or ``"mixed"``."""
    kinds = {
        "cpu-tile" if r.kind == "tile" else
        f"{'packed' if r.kind == 'KV' else 'split'}-{r.order.value}"
        for r in layout.regions
    }  # fmt: skip
    return kinds.pop() if len(kinds) == 1 else "mixed"


def check_proven(
    platform: str, fields: Mapping[str, str], allow: Iterable[str], where: str
) -> None:
    """Raise :class:`ConfigError` naming the first field (``platform``
    included) outside its :data:`PROVEN` envelope and not in ``allow``; warn
    for each such field that is allowed."""
    allowed = frozenset(allow)
    envelope = PROVEN.get(platform, {})
    checks = [("platform", platform, frozenset(PROVEN))]
    checks += [(name, value, envelope.get(name, frozenset())) for name, value in fields.items()]
    for name, value, proven in checks:
        if value in proven:
            continue
        runs = ", ".join(sorted(proven)) or "nothing"
        if name in allowed:
            log.warning(
                "kvpush: %s %s = %s is not proven on %s (proven: %s); "
                "running it because allow_unproven lists it",
                where, name, value, platform, runs,
            )  # fmt: skip
            continue
        raise ConfigError(
            f"kvpush refuses {name} = {value} ({where}, platform {platform}): not proven "
            f"exact (proven: {{{runs}}}; docs/vllm.md, 'Supported and refused'). To run it "
            f'anyway, list it in kv_connector_extra_config "allow_unproven": ["{name}"]'
        )


def handshake_fingerprint(facts: Facts, layout: KVLayout) -> tuple[tuple[str, str], ...]:
    """Entries the peer's must equal (``Identity.fingerprint``); see the module docs."""
    kind = kv_layout_kind(layout)
    out = [("kv_dtype", facts.kv_dtype), ("kv_layout", kind)]
    if kind == "cpu-tile":
        out += [("cpu_attn_isa", facts.cpu_attn_isa), ("block_size", str(facts.block_size))]
    return tuple(out)
