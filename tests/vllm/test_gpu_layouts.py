"""The GPU layout matrix: vLLM 0.33's own KV cache, read back the way its kernels read it.

Every cell builds both engines' KV caches with **vLLM's own code** on CPU tensors: a
``FullAttentionSpec`` (the dtype from vLLM's ``kv_cache_dtype_str_to_dtype``), vLLM's
planner (``get_kv_cache_config_from_groups``, in the resolved ``KVCacheLayout``) and its
allocator (``allocate_kv_cache``: one int8 buffer, one ``as_strided`` view per layer, with
kernel block sizes where given), one cache per TP rank. The prefill ranks' K and V are
written, and the decode ranks' read, through the view vLLM's attention backends read
(FlashAttention and Triton: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``;
FlashInfer: ``kv_cache.permute(*layout.layer_view_order)`` then the same split). In
between runs what the connector runs: the start-up check (``check_proven`` on the
platform ``cuda``, ``layout_from_tensors``), the handshake (``check_compatible`` with
``handshake_fingerprint``), the topology, and per route the data plane's planner, whose
rows are copied byte for byte (bounds-checked against each rank's buffer first).

A cell passes when the outcome is the one :func:`expected` names, decided from vLLM's
facts alone: either every K and V value of every token, head and layer lands where the
decode's backend reads it and nothing else in the decode's buffers changed, or the case
is refused naming the field (``kv_layout`` at start-up, ``kv.order`` / ``kv.strided`` /
``kv_dtype`` at handshake or planning). docs/vllm.md, "Supported and refused", lists
the matrix.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvpush.protocol import (
    ConfigError,
    Identity,
    IncompatiblePeerError,
    KVLayout,
    Role,
    check_compatible,
)
from kvpush.runtime import TransferPlanner, stage_bytes
from kvpush.runtime._stage import scatter_chunks, staged_pieces, write_chunks
from kvpush_vllm._copier import TorchCopier
from kvpush_vllm._proven import PROVEN, Facts, check_proven, handshake_fingerprint
from kvpush_vllm._proven import kv_layout_kind as kind_of
from kvpush_vllm._tensors import layout_from_tensors

LAYOUTS = tuple(m.name for m in KVCacheLayout)  # LBHNC LBNHC LHBNC BLHNC BLNHC BHLNC
DTYPES = ("bfloat16", "float16", "float32", "fp8")
HEAD_SIZES = (64, 128, 256)
BLOCK_SIZES = (16, 32, 64, 128)
TPS = (1, 2, 4, 8)
LAYERS = 2
#: Layouts whose blocks are not one run of memory (heads outside the block).
SCATTERED = {"LHBNC", "BHLNC"}


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir: Any) -> VllmConfig:
    """A real VllmConfig: vLLM's planner reads the layout and block overrides from it."""
    model = ModelConfig(model=str(tiny_model_dir), tokenizer=str(tiny_model_dir), seed=0)
    return VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=16),
        device_config=DeviceConfig("cpu"),
    )  # fmt: skip


@dataclass(frozen=True)
class Engine:
    """One side's configuration, as vLLM states it."""

    layout: str = "LBHNC"
    dtype: str = "bfloat16"
    head_size: int = 128
    block_size: int = 16
    tp: int = 1
    heads: int = 2  # the model's KV heads (all ranks)
    kernel_block_size: int | None = None

    @property
    def per_rank(self) -> int:
        return max(1, self.heads // self.tp)

    def head_start(self, rank: int) -> int:
        """The first global KV head vLLM's QKV projection gives ``rank`` (replicated
        when TP exceeds the heads)."""
        return rank * self.heads // self.tp if self.tp >= self.heads else rank * self.per_rank

    def facts(self) -> Facts:
        return Facts(
            platform="cuda", kv_dtype=self.dtype, block_size=self.block_size,
            head_size=self.head_size, tensor_parallel_size=self.tp, pipeline_parallel_size=1,
            use_mla=False, kv_cache_groups=("FullAttentionSpec",), cpu_attn_isa="",
        )  # fmt: skip


def allocate(cfg: VllmConfig, e: Engine, num_blocks: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's per-layer KV views, planned and allocated by vLLM."""
    cfg.cache_config.kv_cache_layout = e.layout
    spec = FullAttentionSpec(
        block_size=e.block_size,
        num_kv_heads=e.per_rank,
        head_size=e.head_size,
        dtype=kv_cache_dtype_str_to_dtype(e.dtype, cfg.model_config),
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    plan = get_kv_cache_config_from_groups(
        cfg, [KVCacheGroupSpec(names, spec)], num_blocks * LAYERS * spec.page_size_bytes
    )
    assert plan.num_blocks == num_blocks
    kernel = None if e.kernel_block_size is None else [e.kernel_block_size]
    layout = KVCacheLayout[e.layout]
    return [allocate_kv_cache(plan, torch.device("cpu"), layout, kernel) for _ in range(e.tp)]


def kv_of(cache: torch.Tensor, e: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as FlashAttention reads them, ``(blocks, tokens, heads, bytes)``, with
    manager blocks regrouped from kernel blocks as vLLM's ``group_kernel_blocks`` does."""
    k, v = cache.transpose(1, 2).split(e.head_size, dim=-1)
    if k.shape[1] != e.block_size:  # kernel blocks: (blocks * r, n, ...) -> (blocks, r * n, ...)
        k, v = (x.unflatten(0, (-1, e.block_size // x.shape[1])).flatten(1, 2) for x in (k, v))
    return k.view(torch.uint8), v.view(torch.uint8)


def expected(p: Engine, d: Engine) -> str | None:
    """The field a correct kvpush refuses the pair with, from vLLM's facts alone; None:
    the KV must land exactly."""
    for e in (p, d):
        if e.layout in SCATTERED:
            return "kv_layout"
        if e.kernel_block_size not in (None, e.block_size) and _head_major(e):
            return "kv_layout"  # a head-major block split into kernel blocks
    if _head_major(p) != _head_major(d):
        return "kv.order"
    if p.dtype != d.dtype:
        return "kv_dtype" if _elem(p) == _elem(d) else "kv.head_bytes"
    if not _head_major(p) and p.per_rank != d.per_rank:
        return "kv.strided"  # a head slice of token-major blocks: one piece per token
    return None


def _head_major(e: Engine) -> bool:
    return e.layout.index("H") < e.layout.index("N")


def _elem(e: Engine) -> int:
    return torch.tensor([], dtype=kv_cache_dtype_str_to_dtype(e.dtype, None)).element_size()


def startup(e: Engine, caches: list[dict[str, torch.Tensor]]) -> list[KVLayout]:
    """What the connector does at start-up on every rank (raises ConfigError)."""
    check_proven("cuda", e.facts().values(), (), "test")
    layouts = []
    for rank, views in enumerate(caches):
        layout = layout_from_tensors(
            views, tokens_per_block=e.block_size, num_kv_heads=e.per_rank,
            head_size=e.head_size, head_start=e.head_start(rank), platform="cuda",
        )  # fmt: skip
        check_proven("cuda", {"kv_layout": kind_of(layout)}, (), f"rank {rank}")
        layouts.append(layout)
    return layouts


def hello(e: Engine, layouts: list[KVLayout], role: Role) -> Any:
    ident = Identity(
        role.value, 1, tp=e.tp, num_kv_heads=e.heads,
        fingerprint=handshake_fingerprint(e.facts(), layouts[0]), layout=layouts[0],
    )  # fmt: skip
    return ident.hello(role, 10.0)


def _storage(views: dict[str, torch.Tensor]) -> tuple[int, int]:
    s = next(iter(views.values())).untyped_storage()
    return s.data_ptr(), s.nbytes()


def _copy(plan: Any, src: tuple[int, int], dst: tuple[int, int]) -> None:
    """Apply a plan's rows as the transport would, refusing any row outside a buffer."""
    for (sa, n, _), (da, m, _) in zip(plan.src.tolist(), plan.dst.tolist(), strict=True):
        assert n == m
        assert src[0] <= sa and sa + n <= src[0] + src[1], "source row outside the buffer"
        assert dst[0] <= da and da + n <= dst[0] + dst[1], "destination row outside the buffer"
        ctypes.memmove(da, sa, n)


def _staged(
    planner: TransferPlanner,
    p_views: dict[str, torch.Tensor],
    d_views: dict[str, torch.Tensor],
    d_pool: torch.Tensor,
    p_blocks: list[int],
    d_blocks: list[int],
    skip: int,
) -> None:
    """One route staged, as the data planes run it: the producer's gather into
    its pool (the device copier), the spans into the decode's slot (the wire),
    the decode's scatter into its blocks."""
    chunks, reach = write_chunks(planner, [p_blocks], [d_blocks], skip, (), False)
    pieces = staged_pieces(planner, Role.PRODUCER, [len(d_blocks)], chunks)
    p_pool = torch.zeros(max(1, pieces.nbytes), dtype=torch.uint8)
    compact = p_pool.data_ptr() + torch.tensor(pieces.kv[:, 1].astype("int64")).cumsum(0)
    local = pieces.kv.copy()
    local[:, 0] = (compact - torch.tensor(pieces.kv[:, 1].astype("int64"))).numpy()
    TorchCopier([*p_views.values(), p_pool]).copy(pieces.kv, local)
    at, offs, lengths = pieces.spans()
    for a, o, n in zip(at.tolist(), offs.tolist(), lengths.tolist(), strict=True):
        assert a + n <= d_pool.numel(), "a span leaves the decode's slot"
        ctypes.memmove(d_pool.data_ptr() + a, p_pool.data_ptr() + o, n)
    back = scatter_chunks(planner, [d_blocks], reach)
    assert not isinstance(back, str), back
    landing = staged_pieces(planner, Role.CONSUMER, [len(d_blocks)], back)
    src = landing.kv.copy()
    src[:, 0] = d_pool.data_ptr() + landing.image
    TorchCopier([*d_views.values(), d_pool]).copy(src, landing.kv)


def handoff(
    cfg: VllmConfig,
    p: Engine,
    d: Engine,
    tokens: int,
    skip: int = 0,
    seed: int = 0,
    staged: bool = False,
) -> str | None:
    """Run one cell; return the refused field, or None when every value landed."""
    gen = torch.Generator().manual_seed(seed)
    p_need, d_need = -(-tokens // p.block_size), -(-tokens // d.block_size)
    p_caches, d_caches = allocate(cfg, p, p_need + 3), allocate(cfg, d, d_need + 3)
    try:
        p_layouts, d_layouts = startup(p, p_caches), startup(d, d_caches)
        topo = check_compatible(
            hello(d, d_layouts, Role.CONSUMER), hello(p, p_layouts, Role.PRODUCER)
        )
        routes = [
            (r, TransferPlanner(p_layouts[r.source.tp], d_layouts[r.consumer_rank], r))
            for r in topo.routes
        ]
    except ConfigError as exc:
        return "kv_layout" if "refuses kv_layout" in str(exc) else str(exc)
    except IncompatiblePeerError as exc:
        return exc.field
    p_blocks = torch.randperm(p_need + 3, generator=gen)[:p_need].tolist()
    d_blocks = torch.randperm(d_need + 3, generator=gen)[:d_need].tolist()
    hb = p.head_size * _elem(p)
    want = torch.randint(0, 256, (LAYERS, 2, p.heads, tokens, hb), dtype=torch.uint8, generator=gen)
    t = torch.arange(tokens)
    for rank, views in enumerate(p_caches):  # the prefill's forward writes its heads
        for layer, name in enumerate(sorted(views)):
            for i, x in enumerate(kv_of(views[name], p)):
                for h in range(p.per_rank):
                    g = p.head_start(rank) + h
                    x[torch.tensor(p_blocks)[t // p.block_size], t % p.block_size, h] = want[
                        layer, i, g
                    ]
    want_blocks = d_blocks[skip // d.block_size :]
    pools = [torch.zeros(stage_bytes(lay, [want_blocks]), dtype=torch.uint8) for lay in d_layouts]
    for route, planner in routes:
        if staged:
            p_views, d_views = p_caches[route.source.tp], d_caches[route.consumer_rank]
            pool = pools[route.consumer_rank]
            _staged(planner, p_views, d_views, pool, p_blocks, want_blocks, skip)
            continue
        plan = planner.plan([p_blocks], [want_blocks], skip_tokens=skip)
        _copy(plan, _storage(p_caches[route.source.tp]), _storage(d_caches[route.consumer_rank]))
    rows = t[skip:]
    blocks = torch.tensor(d_blocks)[rows // d.block_size]
    for rank, views in enumerate(d_caches):  # the decode's attention reads its heads
        for layer, name in enumerate(sorted(views)):
            for i, x in enumerate(kv_of(views[name], d)):
                for h in range(d.per_rank):
                    g = d.head_start(rank) + h
                    got = x[blocks, rows % d.block_size, h]
                    assert torch.equal(got, want[layer, i, g, skip:]), (layer, "KV"[i], g)
                    x[blocks, rows % d.block_size, h] = 0
        whole = torch.empty(0, dtype=torch.uint8).set_(next(iter(views.values())).untyped_storage())
        assert not torch.any(whole), f"decode rank {rank}: bytes written outside the request"
    return None


def _cell(
    cfg: VllmConfig,
    p: Engine,
    d: Engine,
    tokens: int | None = None,
    skip: int = 0,
    staged: bool = False,
) -> str | None:
    """One cell: its outcome must be :func:`expected`'s (returned: None when exact)."""
    n = tokens if tokens is not None else 2 * max(p.block_size, d.block_size) + 3
    try:
        got = handoff(cfg, p, d, n, skip, staged=staged)
    except AssertionError as exc:
        raise AssertionError(f"{p} -> {d}, {n} tokens, {skip} held: {exc}") from None
    assert got == expected(p, d), (p, d)
    return got


# --- the matrix ------------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "dtype"), list(itertools.product(LAYOUTS, DTYPES)))
def test_every_layout_dtype_and_head_size(vllm_config: VllmConfig, layout: str, dtype: str) -> None:
    """Every KVCacheLayout x kv dtype x head size, TP 1 -> 1, blocks 16 -> 32 and 32 -> 16."""
    outcomes = {
        _cell(vllm_config, Engine(layout, dtype, hs, bp), Engine(layout, dtype, hs, bd))
        for hs, (bp, bd) in itertools.product(HEAD_SIZES, ((16, 32), (32, 16)))
    }
    assert outcomes == ({"kv_layout"} if layout in SCATTERED else {None})


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_every_proven_layout_staged(vllm_config: VllmConfig, layout: str) -> None:
    """Issue 27: the staged path (gather, spans, scatter through the device
    copier on CPU tensors) over every dtype, block-size pair, TP pair and a
    prefix hit, byte for byte and nothing outside the request."""
    for dtype, hs in itertools.product(DTYPES, (64, 128)):
        e = Engine(layout, dtype, hs, 16)
        assert None is _cell(vllm_config, e, Engine(layout, dtype, hs, 32), staged=True)
    for bp, bd in itertools.product(BLOCK_SIZES, BLOCK_SIZES):
        p = Engine(layout=layout, block_size=bp, heads=4, head_size=64)
        d = Engine(layout=layout, block_size=bd, heads=4, head_size=64)
        assert None is _cell(vllm_config, p, d, staged=True)
    exact = 0
    for ptp, dtp in itertools.product(TPS, TPS):
        p = Engine(layout=layout, tp=ptp, heads=8, head_size=64, block_size=32)
        d = Engine(layout=layout, tp=dtp, heads=8, head_size=64, block_size=16)
        exact += _cell(vllm_config, p, d, tokens=70, staged=True) is None
    assert exact == (16 if layout in ("LBHNC", "BLHNC") else 4)
    p = Engine(layout=layout, block_size=16, heads=4, head_size=64)
    assert None is _cell(vllm_config, p, p, tokens=80, skip=32, staged=True)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_every_block_size_pair(vllm_config: VllmConfig, layout: str) -> None:
    """All 16 (prefill, decode) block-size pairs: a packed row splits at token boundaries."""
    for bp, bd in itertools.product(BLOCK_SIZES, BLOCK_SIZES):
        assert None is _cell(
            vllm_config,
            Engine(layout=layout, block_size=bp, heads=4, head_size=64),
            Engine(layout=layout, block_size=bd, heads=4, head_size=64),
        )


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_every_tp_pair_where_heads_divide(vllm_config: VllmConfig, layout: str, heads: int) -> None:
    """TP (P x D) in {1, 2, 4, 8}^2, 1 to 8 KV heads per rank (replicated when TP > heads):
    head-major blocks take any pair, token-major ones equal heads per rank only."""
    exact = 0
    for ptp, dtp in itertools.product(TPS, TPS):
        p = Engine(layout=layout, tp=ptp, heads=heads, head_size=64, block_size=32)
        d = Engine(layout=layout, tp=dtp, heads=heads, head_size=64, block_size=16)
        exact += _cell(vllm_config, p, d, tokens=70) is None
    assert exact == (16 if layout == "LBHNC" or heads == 1 else sum(
        max(1, heads // a) == max(1, heads // b) for a, b in itertools.product(TPS, TPS)
    ))  # fmt: skip


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("kernel", [16, 32, 64])
def test_kernel_blocks_inside_a_manager_block(
    vllm_config: VllmConfig, layout: str, kernel: int
) -> None:
    """A 128-token block the attention kernel reads as kernel blocks: one block when
    token-major and dense (LBNHC), refused naming kv_layout when head-major."""
    p = Engine(layout=layout, block_size=128, kernel_block_size=kernel, heads=2, head_size=64)
    want = None if layout == "LBNHC" else "kv_layout"
    assert (
        _cell(vllm_config, p, Engine(layout=layout, block_size=32, heads=2, head_size=64)) == want
    )
    assert (
        _cell(vllm_config, Engine(layout=layout, block_size=64, heads=2, head_size=64), p) == want
    )


def test_pairs_that_must_agree_are_refused_at_handshake(vllm_config: VllmConfig) -> None:
    """Different head orders, and different dtypes of one size or of two."""
    for p, d in [
        (Engine(layout="LBHNC"), Engine(layout="LBNHC")),
        (Engine(layout="BLNHC"), Engine(layout="LBHNC")),
        (Engine(dtype="bfloat16"), Engine(dtype="float16")),
        (Engine(dtype="bfloat16"), Engine(dtype="fp8")),
        (Engine(layout="LBNHC", tp=2, heads=4), Engine(layout="LBNHC", tp=1, heads=4)),
    ]:
        assert expected(p, d) is not None
        _cell(vllm_config, p, d)


def test_flashinfer_reads_the_same_k_and_v(vllm_config: VllmConfig) -> None:
    """FlashInfer permutes the view to its layout's physical order (``layer_view_order``)
    before the split: the same K and V as FlashAttention's transpose."""
    for name in ("LBHNC", "BLHNC", "LBNHC", "BLNHC"):
        e = Engine(layout=name, heads=4, head_size=64)
        (views,) = allocate(vllm_config, e, 6)
        cache = next(iter(views.values()))
        cache.view(torch.uint8).copy_(torch.randint(0, 256, cache.view(torch.uint8).shape,
                                                    dtype=torch.uint8))  # fmt: skip
        order = KVCacheLayout[name].layer_view_order
        k_fi, v_fi = cache.permute(*order).split(e.head_size, dim=-1)
        k_fa, v_fa = cache.transpose(1, 2).split(e.head_size, dim=-1)
        back = [order.index(i) for i in (0, 2, 1, 3)]  # FlashInfer's axes -> (B, N, H, C)
        for fi, fa in ((k_fi, k_fa), (v_fi, v_fa)):
            assert torch.equal(fi.permute(*back).view(torch.uint8), fa.view(torch.uint8))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    layouts=st.tuples(st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS)),
    dtype=st.sampled_from(DTYPES),
    head_size=st.sampled_from(HEAD_SIZES),
    blocks=st.tuples(st.sampled_from(BLOCK_SIZES), st.sampled_from(BLOCK_SIZES)),
    tps=st.tuples(st.sampled_from(TPS), st.sampled_from(TPS)),
    heads=st.sampled_from([1, 2, 4, 8]),
    tokens=st.integers(1, 300),
    skip_blocks=st.integers(0, 3),
)
def test_any_cell(
    vllm_config: VllmConfig,
    layouts: tuple[str, str],
    dtype: str,
    head_size: int,
    blocks: tuple[int, int],
    tps: tuple[int, int],
    heads: int,
    tokens: int,
    skip_blocks: int,
) -> None:
    """Any mix of the axes, with a prefix the decode already holds."""
    p, d = (
        Engine(layout=lay, dtype=dtype, head_size=head_size, block_size=bs, tp=tp, heads=heads)
        for lay, bs, tp in zip(layouts, blocks, tps, strict=True)
    )
    skip = min(skip_blocks * d.block_size, (tokens - 1) // d.block_size * d.block_size)
    _cell(vllm_config, p, d, tokens, skip)


def test_the_cuda_envelope_is_what_the_matrix_runs() -> None:
    """Start-up accepts every value the matrix proves with no allow_unproven, and
    refuses the rest naming the field."""
    cuda = PROVEN["cuda"]
    assert cuda["kv_dtype"] >= set(DTYPES) and cuda["head_size"] == {str(h) for h in HEAD_SIZES}
    assert cuda["block_size"] == {str(b) for b in BLOCK_SIZES}
    assert cuda["tensor_parallel_size"] == {str(t) for t in TPS}
    assert cuda["kv_layout"] == {"packed-HND", "packed-NHD"}
    for e in (
        Engine(dtype=dt, head_size=hs, block_size=bs, tp=tp)
        for dt, hs, bs, tp in itertools.product(DTYPES, HEAD_SIZES, BLOCK_SIZES, TPS)
    ):
        check_proven("cuda", e.facts().values(), (), "test")  # fmt: skip
    for field, e in [
        ("kv_dtype", Engine(dtype="fp8_per_token_head")),
        ("kv_dtype", Engine(dtype="nvfp4")),
        ("block_size", Engine(block_size=8)),
        ("head_size", Engine(head_size=80)),
        ("tensor_parallel_size", Engine(tp=16)),
    ]:
        with pytest.raises(ConfigError, match=f"refuses {field} = "):
            check_proven("cuda", e.facts().values(), (), "test")
    with pytest.raises(ConfigError, match="refuses platform = xpu"):
        check_proven("xpu", Engine().facts().values(), (), "test")


def test_an_mla_latent_cache_is_refused_by_name(vllm_config: VllmConfig) -> None:
    """MLA keeps one latent vector per token (vLLM's MLAAttentionSpec: one "head",
    no V half): nothing here proves it, so it is refused naming MLA, not misread."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    plan = get_kv_cache_config_from_groups(
        vllm_config, [KVCacheGroupSpec(names, spec)], 4 * LAYERS * spec.page_size_bytes
    )
    views = allocate_kv_cache(plan, torch.device("cpu"), KVCacheLayout.LBHNC)
    assert next(iter(views.values())).shape == (4, 1, 16, 576)
    with pytest.raises(ConfigError, match=r"refuses kv_layout: .*MLA latent cache \(use_mla\)"):
        layout_from_tensors(
            views, tokens_per_block=16, num_kv_heads=1, head_size=576, platform="cuda"
        )
