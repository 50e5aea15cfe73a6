"""KV layouts: local validation, the wire form, and the handshake fingerprint."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.protocol._config import Identity
from kvpush.protocol._endpoint import check_compatible
from kvpush.protocol._errors import ConfigError, IncompatiblePeerError, RemoteProtocolError
from kvpush.protocol._layout import (
    MAX_REGIONS,
    HeadOrder,
    KVLayout,
    MemoryType,
    Region,
    Staging,
    layer_regions,
)
from kvpush.protocol._types import Role

_EXAMPLES = int(os.environ.get("KVPUSH_LAYOUT_EXAMPLES", "0"))
_settings = settings(deadline=None, **({"max_examples": _EXAMPLES} if _EXAMPLES else {}))

GOOD: dict[str, Any] = {
    "layer": 0,
    "kind": "K",
    "base": 4096,
    "num_blocks": 8,
    "block_len": 16 * 2 * 256,
    "tokens_per_block": 16,
    "num_heads": 2,
    "head_bytes": 256,
}


def region(**changes: Any) -> Region:
    return Region(**{**GOOD, **changes})


def llama(*, tp: int = 1, rank: int = 0, tpb: int = 16, base: int = 0, **kw: Any) -> KVLayout:
    """An 8-KV-head, 4-layer model's layout on one rank of a TP group."""
    heads = 8 // tp
    return KVLayout(
        layer_regions(
            [base + i * (1 << 24) for i in range(4)],
            num_blocks=64,
            tokens_per_block=tpb,
            num_heads=heads,
            head_start=rank * heads,
            head_bytes=kw.pop("head_bytes", 256),
            **kw,
        )
    )


# --- local construction -------------------------------------------------------------


def test_block_stride_defaults_to_the_block_length() -> None:
    r = region()
    assert r.block_stride == r.stride == r.block_len
    assert r == region(block_stride=r.block_len)
    assert r.extent == 8 * r.block_len
    assert region(block_stride=3 * r.block_len).extent == 7 * 3 * r.block_len + r.block_len


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("layer", -1),
        ("layer", True),
        ("kind", ""),
        ("kind", "K V"),
        ("kind", 3),
        ("base", -1),
        ("base", 1 << 63),
        ("base", 4096.0),
        ("num_blocks", 0),
        ("tokens_per_block", 0),
        ("num_heads", 0),
        ("head_bytes", 0),
        ("head_start", -2),
        ("device", -1),
        ("group", 64),
        ("block_len", 8192 + 1),
        ("block_stride", 8192 - 1),
        ("order", "NHD"),
        ("memory", "VRAM"),
    ],
)
def test_bad_region_fields_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        region(**{field: value})


def test_a_region_may_not_end_past_2_63() -> None:
    with pytest.raises(ConfigError, match="2\\*\\*63"):
        region(base=(1 << 63) - 4096)


def test_layout_invariants() -> None:
    with pytest.raises(ConfigError, match="1 to"):
        KVLayout(())
    with pytest.raises(ConfigError, match=r"duplicate region layer0\.K"):
        KVLayout((region(), region(base=1 << 20)))
    with pytest.raises(ConfigError, match=r"numbered 0\.\.n-1"):
        KVLayout((region(group=1),))
    with pytest.raises(ConfigError, match="num_blocks differs within KV group 0"):
        KVLayout((region(), region(kind="V", num_blocks=9)))
    with pytest.raises(ConfigError, match="tokens_per_block differs"):
        KVLayout((region(), region(kind="V", tokens_per_block=8, block_len=8 * 2 * 256)))
    with pytest.raises(ConfigError, match="not a Region"):
        KVLayout((region(), "region"))  # type: ignore[arg-type]
    two = KVLayout((region(), region(kind="V", group=1, num_blocks=3)))
    assert two.num_groups == 2 and two.num_layers == 1
    assert KVLayout([region()]).regions == (region(),)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("packing", "kinds", "v_offset", "stride_blocks"),
    [("split", ["K", "V"], 64, 1), ("interleaved", ["K", "V"], 1, 2), ("mla", ["MLA"], 0, 1)],
)
def test_layer_regions_describe_vllm_tensors(
    packing: Any, kinds: list[str], v_offset: int, stride_blocks: int
) -> None:
    heads = 1 if packing == "mla" else 2
    regions = layer_regions(
        [1 << 20, 2 << 20],
        num_blocks=64,
        tokens_per_block=16,
        num_heads=heads,
        head_bytes=64,
        packing=packing,
    )
    block_len = 16 * heads * 64
    assert [r.kind for r in regions] == kinds * 2
    assert [r.layer for r in regions] == [0] * len(kinds) + [1] * len(kinds)
    assert regions[0].base == 1 << 20
    assert regions[-1].base == (2 << 20) + v_offset * block_len
    assert {r.stride for r in regions} == {stride_blocks * block_len}
    with pytest.raises(ConfigError, match="packing"):
        layer_regions(
            [0], num_blocks=1, tokens_per_block=1, num_heads=1, head_bytes=1, packing="paged"
        )  # type: ignore[arg-type]


# --- the wire form ------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> KVLayout:
    regions: list[Region] = []
    for g in range(draw(st.integers(1, 3))):
        regions += layer_regions(
            draw(st.lists(st.integers(0, 1 << 48), min_size=1, max_size=3)),
            num_blocks=draw(st.integers(1, 1 << 20)),
            tokens_per_block=draw(st.sampled_from([1, 16, 64])),
            num_heads=draw(st.integers(1, 16)),
            head_start=draw(st.integers(0, 64)),
            head_bytes=draw(st.sampled_from([64, 128, 1152])),
            packing=draw(st.sampled_from(["split", "interleaved", "mla"])),
            order=draw(st.sampled_from(HeadOrder)),
            memory=draw(st.sampled_from(MemoryType)),
            device=draw(st.integers(0, 7)),
            group=g,
            first_layer=10 * g,
        )
    return KVLayout(tuple(regions))


def _plain(obj: object) -> bool:
    if isinstance(obj, dict):
        return all(type(k) is str and _plain(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(_plain(v) for v in obj)
    return type(obj) in (int, str)


@_settings
@given(layouts())
def test_wire_round_trip_through_msgpack(layout: KVLayout) -> None:
    wire = layout.to_wire()
    assert _plain(wire)
    assert KVLayout.from_wire(wire) == layout
    assert KVLayout.from_wire(msgpack.unpackb(msgpack.packb(wire))) == layout
    assert KVLayout.from_wire(wire).fingerprint() == layout.fingerprint()


def _wire(**changes: Any) -> dict[str, Any]:
    wire = llama().to_wire()
    wire["regions"][0] = {**wire["regions"][0], **changes}
    return wire


@pytest.mark.parametrize(
    "wire",
    [
        None,
        [],
        "layout",
        {"regions": []},
        {"version": 1, "regions": []},
        {"version": 2, "regions": llama().to_wire()["regions"]},
        {"version": True, "regions": llama().to_wire()["regions"]},
        {"version": 1, "regions": {}},
        {"version": 1, "regions": [1]},
        {"version": 1, "regions": llama().to_wire()["regions"], "extra": 0},
        {"version": 1, "regions": [GOOD] * (MAX_REGIONS + 1)},
        _wire(base=-1),
        _wire(base=1 << 64),
        _wire(base=1.5),
        _wire(num_blocks=True),
        _wire(num_blocks="8"),
        _wire(kind=None),
        _wire(order="NCHW"),
        _wire(memory="GPU"),
        _wire(block_len=1),
        _wire(block_stride=0),
        _wire(head_bytes=128),
        _wire(extra=1),
        {
            "version": 1,
            "regions": [{k: v for k, v in _wire()["regions"][0].items() if k != "group"}],
        },
        {"version": 1, "regions": [_wire()["regions"][0]] * 2},  # duplicate region
        {"version": 1, "regions": [_wire(group=1)["regions"][0]]},  # group 0 missing
    ],
)
def test_bad_wire_input_raises_remote_protocol_error(wire: object) -> None:
    with pytest.raises(RemoteProtocolError):
        KVLayout.from_wire(wire)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


@_settings
@given(_json)
def test_from_wire_never_raises_anything_but_remote_protocol_error(obj: object) -> None:
    with pytest.raises(RemoteProtocolError):
        KVLayout.from_wire(obj)


@_settings
@given(st.data())
def test_mutated_wire_is_accepted_valid_or_refused_cleanly(data: st.DataObject) -> None:
    wire = llama(tp=2, rank=1).to_wire()
    item = data.draw(st.integers(0, len(wire["regions"]) - 1))
    key = data.draw(st.sampled_from(sorted(wire["regions"][item])))
    wire["regions"][item][key] = data.draw(_json | st.integers(-(1 << 65), 1 << 65))
    try:
        layout = KVLayout.from_wire(wire)
    except RemoteProtocolError:
        return
    assert layout.to_wire() == wire


# --- the fingerprint ----------------------------------------------------------------


def test_fingerprint_ignores_what_the_planner_handles() -> None:
    a = llama(tp=4, rank=3, tpb=16)
    b = llama(tp=2, rank=0, tpb=32, base=1 << 40, memory=MemoryType.DRAM, device=3)
    assert a.fingerprint() == b.fingerprint()
    assert dict(a.fingerprint())["kv.layers"] == "4"
    assert dict(a.fingerprint())["kv.order"] == "NHD"


@pytest.mark.parametrize(
    ("other", "field"),
    [
        (llama(head_bytes=128), "kv.head_bytes"),
        (llama(order=HeadOrder.HND), "kv.order"),
        (llama(packing="interleaved"), None),
        (KVLayout(llama().regions[:6]), "kv.layers"),
        (KVLayout(llama().regions[::-1]), None),  # order is local; pairs go by (layer, kind)
        (KVLayout(tuple(replace(r, layer=r.layer + 10) for r in llama().regions)), "kv.region_map"),
    ],
)
def test_fingerprint_names_what_differs(other: KVLayout, field: str | None) -> None:
    mine, theirs = dict(llama().fingerprint()), dict(other.fingerprint())
    differs = sorted(k for k in mine if mine[k] != theirs[k])
    assert differs[:1] == ([field] if field else [])


def test_the_handshake_refuses_a_different_fingerprint() -> None:
    def hello(layout: KVLayout, role: Role, engine: str) -> Any:
        identity = Identity(engine, 1, fingerprint=layout.fingerprint())
        return identity.hello(role, 1.0)

    check_compatible(hello(llama(), Role.PRODUCER, "p"), hello(llama(), Role.CONSUMER, "d"))
    with pytest.raises(IncompatiblePeerError) as err:
        check_compatible(
            hello(llama(), Role.PRODUCER, "p"), hello(llama(head_bytes=128), Role.CONSUMER, "d")
        )
    assert err.value.field == "kv.head_bytes"


# --- the staging pool (issue 27) ------------------------------------------------------


def test_a_staging_pool_travels_with_the_layout_and_leaves_the_fingerprint_alone() -> None:
    pool = Staging(base=1 << 30, nbytes=1 << 20, memory=MemoryType.DRAM, device=0)
    with_pool = replace(llama(), staging=pool)
    wire = msgpack.unpackb(msgpack.packb(with_pool.to_wire()))
    assert KVLayout.from_wire(wire) == with_pool and wire["staging"]["nbytes"] == 1 << 20
    assert with_pool.fingerprint() == llama().fingerprint()  # either side may go without
    assert "staging" not in llama().to_wire()


@pytest.mark.parametrize(
    "staging",
    [
        [1 << 30, 1 << 20, "DRAM", 0],  # a list, not the map
        {"base": 1 << 30, "nbytes": 0, "memory": "DRAM", "device": 0},  # empty
        {"base": -1, "nbytes": 8, "memory": "DRAM", "device": 0},
        {"base": 0, "nbytes": 8, "memory": "HBM", "device": 0},
        {"base": 0, "nbytes": 8, "memory": "DRAM"},
        {"base": 0, "nbytes": 8, "memory": "DRAM", "device": 0, "extra": 1},
        {"base": (1 << 63) - 4, "nbytes": 8, "memory": "DRAM", "device": 0},  # past 2**63
        {"base": 0, "nbytes": 8.0, "memory": "DRAM", "device": 0},
    ],
)
def test_a_malformed_staging_pool_is_refused_as_remote_input(staging: object) -> None:
    wire = {**llama().to_wire(), "staging": staging}
    with pytest.raises(RemoteProtocolError, match="staging"):
        KVLayout.from_wire(wire)


def test_a_layout_refuses_a_staging_pool_of_the_wrong_type() -> None:
    with pytest.raises(ConfigError, match="staging"):
        KVLayout(llama().regions, (0, 8))  # type: ignore[arg-type]
