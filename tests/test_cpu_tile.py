"""vLLM's CPU KV tile, byte for byte, between a prefill and a decode (issue 13 item 1).

The CPU backend's ``(blocks, kv_heads, block_size, 2 * head_size)`` tensors hold, per
(block, head), a K half stored channel-major (value ``c`` of token ``t`` at
``c * block_size + t``) and a V half stored token-major (``t * head_size + c``):
:func:`write_token` / :func:`read_token` emulate the ``vec`` ISA's
``cpu_attn_reshape_and_cache`` (tests/e2e/test_cpu_tile.py checks the emulation against
the kernel). Fake tensors over numpy buffers go through the connector's own path:
``layout_from_tensors``, the handshake fingerprint, ``check_compatible``, the planner;
the plan is then applied as memcpys. Every pair the handshake accepts must give the
decode every K and V value of every token, layer and head; a pair it refuses must be
refused naming the field. Before the fix the 32/64 pairs were accepted and their K
values landed in the wrong places.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest

from kvpush.protocol import (
    ConfigError,
    Identity,
    IncompatiblePeerError,
    Role,
    check_compatible,
)
from kvpush.runtime import TransferPlanner
from kvpush_vllm._config import ConnectorConfig
from kvpush_vllm._proven import Facts, check_proven, handshake_fingerprint, kv_layout_kind
from kvpush_vllm._tensors import layout_from_tensors, token_scale

LAYERS, HEADS, ELEM = 2, 2, 4


@dataclass
class _Device:
    type: str = "cpu"
    index: int | None = None


class FakeTile:
    """A contiguous ``(nb, heads, bs, 2 * hs)`` float32 tensor at address ``base``."""

    def __init__(self, buf: np.ndarray[Any, Any], base: int) -> None:
        self.buf, self.base = buf, base

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.buf.shape)

    @property
    def device(self) -> _Device:
        return _Device()

    def stride(self) -> tuple[int, ...]:
        return tuple(s // ELEM for s in self.buf.strides)

    def data_ptr(self) -> int:
        return self.base

    def element_size(self) -> int:
        return ELEM


def write_token(t: np.ndarray[Any, Any], blk: int, off: int, h: int, k: Any, v: Any) -> None:
    bs, hs = t.shape[2], t.shape[3] // 2
    tile = t[blk, h].reshape(-1)
    tile[np.arange(hs) * bs + off] = k  # K: channel-major
    tile[bs * hs + off * hs : bs * hs + (off + 1) * hs] = v  # V: token-major


def read_token(t: np.ndarray[Any, Any], blk: int, off: int, h: int) -> tuple[Any, Any]:
    bs, hs = t.shape[2], t.shape[3] // 2
    tile = t[blk, h].reshape(-1)
    return tile[np.arange(hs) * bs + off], tile[bs * hs + off * hs : bs * hs + (off + 1) * hs]


def _facts(bs: int, hs: int, isa: str = "vec", dtype: str = "float32") -> Facts:
    return Facts("cpu", dtype, bs, hs, 1, 1, False, ("FullAttentionSpec",), isa)


class Side:
    def __init__(self, bs: int, hs: int, base: int, nb: int = 12, isa: str = "vec") -> None:
        self.bs, self.base = bs, base
        self.tiles = [np.zeros((nb, HEADS, bs, 2 * hs), np.float32) for _ in range(LAYERS)]
        self.stride = self.tiles[0].nbytes
        self.fakes = {
            f"model.layers.{i}.self_attn.attn": FakeTile(t, base + i * self.stride)
            for i, t in enumerate(self.tiles)
        }
        self.layout = layout_from_tensors(
            self.fakes, tokens_per_block=bs, num_kv_heads=HEADS, head_size=hs, platform="cpu"
        )
        self.facts = _facts(bs, hs, isa)

    def hello(self, role: Role, name: str) -> Any:
        ident = Identity(
            name,
            1,
            num_kv_heads=HEADS,
            fingerprint=handshake_fingerprint(self.facts, self.layout),
            layout=self.layout,
        )
        return ident.hello(role, 10.0)

    def view(self, addr: int, n: int) -> np.ndarray[Any, Any]:
        i, off = divmod(addr - self.base, self.stride)
        return self.tiles[i].reshape(-1).view(np.uint8)[off : off + n]


def _handoff(p: Side, d: Side, n: int, skip: int, rng: np.random.Generator) -> None:
    """Prefill ``n`` tokens on ``p``; copy what the plan says into ``d``; check it."""
    hs = p.tiles[0].shape[3] // 2
    src = list(rng.permutation(p.tiles[0].shape[0])[: -(-n // p.bs)])
    dst_all = list(rng.permutation(d.tiles[0].shape[0])[: -(-n // d.bs)])
    want = rng.standard_normal((LAYERS, n, HEADS, 2, hs)).astype(np.float32)
    for layer, tile in enumerate(p.tiles):
        for tok in range(n):
            for h in range(HEADS):
                k, v = want[layer, tok, h]
                write_token(tile, src[tok // p.bs], tok % p.bs, h, k, v)
    topo = check_compatible(d.hello(Role.CONSUMER, "d"), p.hello(Role.PRODUCER, "p"))
    (route,) = topo.routes
    planner = TransferPlanner(p.layout, d.layout, route)
    scale = token_scale(d.layout, d.bs)
    plan = planner.plan([src], [dst_all[skip // d.bs :]], skip_tokens=skip * scale)
    for (sa, sn, _), (da, dn, _) in zip(plan.src.tolist(), plan.dst.tolist(), strict=True):
        assert sn == dn
        d.view(da, dn)[:] = p.view(sa, sn)
    for layer, tile in enumerate(d.tiles):
        for tok in range(skip, n):
            for h in range(HEADS):
                k, v = read_token(tile, dst_all[tok // d.bs], tok % d.bs, h)
                where = f"layer {layer} token {tok} head {h}"
                np.testing.assert_array_equal(k, want[layer, tok, h, 0], err_msg="K " + where)
                np.testing.assert_array_equal(v, want[layer, tok, h, 1], err_msg="V " + where)


PAIRS = [(32, 32), (64, 64), (32, 64), (64, 32), (32, 128), (128, 32)]


@pytest.mark.parametrize("hs", [64, 128])
@pytest.mark.parametrize(("bp", "bc"), PAIRS, ids=[f"{a}to{b}" for a, b in PAIRS])
def test_every_cpu_tile_pair_is_exact_or_refused_naming_block_size(
    bp: int, bc: int, hs: int
) -> None:
    rng = np.random.default_rng(bp * 1000 + bc + hs)
    p, d = Side(bp, hs, 1 << 24), Side(bc, hs, 1 << 32)
    assert kv_layout_kind(p.layout) == kv_layout_kind(d.layout) == "cpu-tile"
    refused: IncompatiblePeerError | None = None
    try:
        check_compatible(d.hello(Role.CONSUMER, "d"), p.hello(Role.PRODUCER, "p"))
    except IncompatiblePeerError as exc:
        refused = exc
    if refused is not None:
        assert bp != bc, refused
        assert refused.field == "block_size", refused
        assert f"'{bp}' on the producer 'p', '{bc}' on the consumer 'd'" in str(refused)
        return
    # Accepted: then every value must arrive (before the fix, 32/64 failed here, on K).
    n = 3 * max(bp, bc) + 5
    for k in (1, bp - 1, bp, bp + 1, n):
        _handoff(p, d, k, 0, rng)
    _handoff(p, d, n, 2 * bc, rng)  # a decode-side prefix hit of two blocks
    assert bp == bc, "a handshake between tiles of different sizes was accepted"


def test_tiles_of_another_attention_isa_are_refused_at_handshake() -> None:
    p, d = Side(32, 64, 1 << 24, isa="amx"), Side(32, 64, 1 << 32)
    with pytest.raises(IncompatiblePeerError) as exc:
        check_compatible(d.hello(Role.CONSUMER, "d"), p.hello(Role.PRODUCER, "p"))
    assert exc.value.field == "cpu_attn_isa"


def test_kv_dtypes_of_one_size_are_refused_at_handshake() -> None:
    """bfloat16 and float16 tiles have the same bytes per head: only the dtype tells."""
    p, d = Side(32, 64, 1 << 24), Side(32, 64, 1 << 32)
    p.facts, d.facts = _facts(32, 64, dtype="bfloat16"), _facts(32, 64, dtype="float16")
    with pytest.raises(IncompatiblePeerError) as exc:
        check_compatible(d.hello(Role.CONSUMER, "d"), p.hello(Role.PRODUCER, "p"))
    assert exc.value.field == "kv_dtype"


@pytest.mark.parametrize(
    ("field", "facts"),
    [
        ("kv_dtype", _facts(32, 64, dtype="bfloat16")),
        ("block_size", _facts(16, 64)),
        ("block_size", _facts(128, 64)),
        ("head_size", _facts(32, 80)),
        ("cpu_attn_isa", _facts(32, 64, isa="amx")),
        ("tensor_parallel_size", replace(_facts(32, 64), tensor_parallel_size=4)),
        ("pipeline_parallel_size", replace(_facts(32, 64), pipeline_parallel_size=2)),
        ("use_mla", replace(_facts(32, 64), use_mla=True)),
        ("kv_cache_groups", replace(_facts(32, 64), kv_cache_groups=("A", "SlidingWindowSpec"))),
    ],
)  # fmt: skip
def test_start_up_refuses_what_make_e2e_does_not_prove(field: str, facts: Facts) -> None:
    with pytest.raises(ConfigError, match=f"refuses {field} = ") as exc:
        check_proven("cpu", facts.values(), (), "kv_consumer")
    assert f'"allow_unproven": ["{field}"]' in str(exc.value)
    check_proven("cpu", facts.values(), (field,), "kv_consumer")  # acknowledged: a warning only


def test_start_up_accepts_the_proven_envelope_and_refuses_other_layouts() -> None:
    for bs in (32, 64):
        for hs in (64, 128):
            check_proven("cpu", _facts(bs, hs).values(), (), "kv_producer")
    check_proven("cpu", {"kv_layout": "cpu-tile"}, (), "rank 0")
    with pytest.raises(ConfigError, match="refuses kv_layout = split-NHD"):
        check_proven("cpu", {"kv_layout": "split-NHD"}, (), "rank 0")


def test_allow_unproven_takes_only_known_fields() -> None:
    cfg = ConnectorConfig.from_extra({"allow_unproven": ["kv_layout", "kv_dtype"]})
    assert cfg.allow_unproven == {"kv_layout", "kv_dtype"}
    with pytest.raises(ConfigError, match="unknown field"):
        ConnectorConfig.from_extra({"allow_unproven": ["block_sise"]})
    with pytest.raises(ConfigError, match="list of field names"):
        ConnectorConfig.from_extra({"allow_unproven": "kv_layout"})
