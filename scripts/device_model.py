"""The device check's model: a small Llama built offline, its KV, greedy decoding.

A ``LlamaForCausalLM`` from a ``LlamaConfig`` with random weights from a fixed
seed (every process builds the same model), GQA, bf16 on a GPU (float32 on
CPU: exact and fast there). Weights are drawn from N(0, 0.1), wider than
Llama's 0.02, so that the next token depends on the context (a decode given
the wrong KV, or none, generates other tokens: the check's sanity case).

Prefill runs in chunks (``chunk`` tokens per forward, as a chunked prefill
does) into a transformers ``DynamicCache``; :func:`chunk_kv` gives a chunk's K
and V per layer for the packed cache, :func:`cache_from_kv` builds the decode's
``DynamicCache`` from K and V read back from it, and :func:`greedy` generates.
The reference is one process doing the same: :func:`reference`.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = (
    "CPU_SPEC",
    "GPU_SPEC",
    "ModelSpec",
    "build_model",
    "cache_from_kv",
    "chunk_kv",
    "greedy",
    "last_token",
    "new_cache",
    "prefill",
    "reference",
)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The model, the prompt and the generation of one run of the check."""

    layers: int
    heads: int
    kv_heads: int
    head_size: int
    vocab: int
    dtype: str
    prompt: int
    new_tokens: int
    seed: int = 0

    @property
    def torch_dtype(self) -> Any:
        return getattr(torch, self.dtype)


#: The CPU path (CI): 2 layers, head_dim 64, float32, an 80-token prompt.
CPU_SPEC = ModelSpec(
    layers=2, heads=8, kv_heads=4, head_size=64, vocab=512, dtype="float32",
    prompt=80, new_tokens=12,
)  # fmt: skip
#: The GPU: 4 layers, head_dim 128, bf16, a 200-token prompt.
GPU_SPEC = ModelSpec(
    layers=4, heads=8, kv_heads=4, head_size=128, vocab=1024, dtype="bfloat16",
    prompt=200, new_tokens=24,
)  # fmt: skip


def build_model(spec: ModelSpec, device: str) -> Any:
    """The same random-weight Llama in every process (seeded, built on CPU)."""
    hf = _transformers()
    config = hf.LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.heads * spec.head_size,
        intermediate_size=2 * spec.heads * spec.head_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_size,
        max_position_embeddings=4 * (spec.prompt + spec.new_tokens),
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = hf.LlamaForCausalLM(config)
    return model.eval().to(device=device, dtype=spec.torch_dtype)


def _transformers() -> Any:
    """transformers, offline (typed ``Any``: its types are its own)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    return importlib.import_module("transformers")


def new_cache(model: Any) -> Any:
    """An empty transformers ``DynamicCache`` for ``model``."""
    return _transformers().DynamicCache(config=model.config)


def last_token(logits: Any) -> int:
    """The greedy next token after the last position of ``logits``."""
    return int(logits[0, -1].argmax())


def prefill(model: Any, ids: list[int], start: int, end: int, cache: Any) -> Any:
    """Tokens ``start .. end`` of ``ids`` through the model into ``cache``
    (which holds ``0 .. start``); the logits, left on the device (on a GPU the
    kernels may still run: :func:`last_token` waits for them)."""
    device = next(model.parameters()).device
    x = torch.tensor([ids[start:end]], device=device)
    with torch.no_grad():
        return model(input_ids=x, past_key_values=cache, use_cache=True).logits


def chunk_kv(
    cache: Any, start: int, end: int, head_start: int, heads: int
) -> list[tuple[Any, Any]]:
    """Per layer, K and V of tokens ``start .. end`` for KV heads ``head_start ..
    head_start + heads``: ``(tokens, heads, head_size)`` each."""
    out = []
    for layer in cache.layers:
        k = layer.keys[0, head_start : head_start + heads, start:end].transpose(0, 1)
        v = layer.values[0, head_start : head_start + heads, start:end].transpose(0, 1)
        out.append((k, v))
    return out


def cache_from_kv(model: Any, kv: list[tuple[Any, Any]]) -> Any:
    """A ``DynamicCache`` holding per layer ``(tokens, heads, head_size)`` K and V."""
    cache = new_cache(model)
    for layer, (k, v) in enumerate(kv):
        cache.update(k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), layer)
    return cache


def greedy(model: Any, cache: Any, first: int, n: int) -> list[int]:
    """``first`` then ``n`` tokens, greedily, from ``cache`` (the prompt's KV)."""
    device = next(model.parameters()).device
    out, token = [first], first
    for _ in range(n):
        x = torch.tensor([[token]], device=device)
        with torch.no_grad():
            logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits
        token = last_token(logits)
        out.append(token)
    return out


def reference(model: Any, ids: list[int], chunk: int, n: int) -> tuple[list[int], Any]:
    """One process alone: chunked prefill of ``ids`` then ``n`` greedy tokens;
    (tokens, the prompt's KV as :func:`chunk_kv` gives it for every head)."""
    cache = new_cache(model)
    logits = None
    for start in range(0, len(ids), chunk):
        logits = prefill(model, ids, start, min(start + chunk, len(ids)), cache)
    first = last_token(logits)
    heads = cache.layers[0].keys.shape[1]
    kv = [(k.clone(), v.clone()) for k, v in chunk_kv(cache, 0, len(ids), 0, heads)]
    return greedy(model, cache, first, n), kv
