"""Model shapes, per-rank KV layouts and the block pool the demo sizes from them.

A side (prefill or decode) with tensor parallelism ``tp`` splits the model's KV
heads evenly over its ranks; every rank holds every layer, in vLLM's
FlashAttention packing (``(2, num_blocks, ...)`` per layer: all K blocks, then
all V blocks) with the HND order inside a block, in one shared-memory segment
per rank (offsets are addresses, DRAM, device 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpush.protocol import HeadOrder, KVLayout, MemoryType, layer_regions

__all__ = (
    "DEFAULT_MAX_MEMORY_MIB",
    "MODELS",
    "DemoError",
    "ModelShape",
    "PoolPlan",
    "SideGeometry",
    "plan_pool",
)

#: Default cap on the KV memory of one run (every instance, every rank).
DEFAULT_MAX_MEMORY_MIB = 512


class DemoError(Exception):
    """The demo cannot run, or stopped: the message says why, for a person."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The KV-cache shape of one model."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    #: Element type of the cache, for display ("fp16", "bf16").
    dtype: str
    dtype_bytes: int = 2
    tokens_per_block: int = 16

    @property
    def head_bytes(self) -> int:
        """Bytes of one token of one head."""
        return self.head_dim * self.dtype_bytes

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token over every layer and head (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_bytes

    @property
    def block_bytes(self) -> int:
        """KV bytes of one block over every layer and head (one side in all)."""
        return self.tokens_per_block * self.token_bytes


MODELS: dict[str, ModelShape] = {
    # Small enough that the demo's pattern checks cost nothing.
    "small": ModelShape("small", num_layers=4, num_kv_heads=8, head_dim=64, dtype="fp16"),
    # Qwen3-32B: 64 layers, 8 KV heads (GQA), head_dim 128, bf16: 256 KiB per token.
    "qwen3-32b": ModelShape("qwen3-32b", num_layers=64, num_kv_heads=8, head_dim=128, dtype="bf16"),
}


@dataclass(frozen=True, slots=True)
class SideGeometry:
    """Where the KV of one side's ranks lives: ``num_blocks`` blocks per rank."""

    model: ModelShape
    tp: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.model.num_kv_heads % self.tp:
            raise DemoError(
                f"TP {self.tp} does not divide the {self.model.num_kv_heads} KV heads of "
                f"{self.model.name}"
            )

    @property
    def heads_per_rank(self) -> int:
        return self.model.num_kv_heads // self.tp

    @property
    def block_len(self) -> int:
        """Bytes of one block of one region on one rank."""
        return self.model.tokens_per_block * self.heads_per_rank * self.model.head_bytes

    @property
    def segment_bytes(self) -> int:
        """Bytes of one rank's segment."""
        return self.model.num_layers * 2 * self.num_blocks * self.block_len

    def layout(self, rank: int, base: int = 0) -> KVLayout:
        """The KV layout of ``rank`` (its heads start at ``rank * heads_per_rank``)
        in a segment at address ``base`` (0: addresses are segment offsets)."""
        span = 2 * self.num_blocks * self.block_len
        return KVLayout(
            layer_regions(
                [base + layer * span for layer in range(self.model.num_layers)],
                num_blocks=self.num_blocks,
                tokens_per_block=self.model.tokens_per_block,
                num_heads=self.heads_per_rank,
                head_bytes=self.model.head_bytes,
                head_start=rank * self.heads_per_rank,
                order=HeadOrder.HND,
                memory=MemoryType.DRAM,
            )
        )


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """How many requests may be in flight at once, and the blocks that takes."""

    blocks_per_request: int
    #: Requests in flight at most, over every instance (each holds its blocks on
    #: its prefill and on its decode instance).
    slots: int
    #: Blocks per instance (every rank of an instance has this many).
    num_blocks: int
    #: KV bytes of every instance together.
    total_bytes: int
    #: Requests one instance holds at most (``num_blocks // blocks_per_request``).
    instance_slots: int


def plan_pool(
    model: ModelShape,
    prompt_tokens: int,
    requests: int,
    max_bytes: int,
    prefills: int = 1,
    decodes: int = 1,
) -> PoolPlan:
    """A block pool per instance, the same on each of the ``prefills +
    decodes`` instances, so that ``requests`` prompts can be in flight at once
    when spread evenly, or as many as ``max_bytes`` (every instance together)
    allows; :class:`DemoError` if not even one request per instance fits."""
    if prompt_tokens < 1 or requests < 1:
        raise DemoError("--prompt-tokens and --requests must be at least 1")
    if prefills < 1 or decodes < 1:
        raise DemoError("there must be at least one prefill and one decode instance")
    per_request = math.ceil(prompt_tokens / model.tokens_per_block)
    instances = prefills + decodes
    per_slot = instances * per_request * model.block_bytes  # one request on every instance
    fit = max_bytes // per_slot
    if fit < 1:
        each = "each side" if instances == 2 else f"each of the {instances} instances"
        raise DemoError(
            f"one request of {prompt_tokens} tokens of {model.name} needs "
            f"{_mib(per_slot // instances)} of KV on {each} ({_mib(per_slot)} in all), over "
            f"the {_mib(max_bytes)} memory cap: lower --prompt-tokens or raise --max-memory-mib"
        )
    pairs = min(prefills, decodes)  # a request is in flight on one instance of each side
    instance_slots = min(math.ceil(requests / pairs), fit)
    num_blocks = instance_slots * per_request
    slots = min(requests, instance_slots * pairs)
    total = instances * num_blocks * model.block_bytes
    return PoolPlan(per_request, slots, num_blocks, total, instance_slots)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"
