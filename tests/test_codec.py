"""The wire codec: round trips, the size bounds, and that any byte string decodes
to a valid message or raises RemoteProtocolError (nothing else escapes)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import re
import tracemalloc
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush import protocol as protocol_module
from kvpush.protocol import (
    MAX_REGIONS,
    PROTOCOL_VERSION,
    Abort,
    Announce,
    Completion,
    ConfigError,
    ControlMessage,
    Extend,
    HeadOrder,
    Heartbeat,
    Hello,
    HelloReject,
    KVLayout,
    LocalProtocolError,
    MemoryType,
    Mode,
    ReadDone,
    Region,
    Register,
    Rejected,
    RejectReason,
    RemoteProtocolError,
    Renew,
    Role,
    Settled,
    Source,
    Withdraw,
    WriteFailed,
    layer_regions,
)
from kvpush.protocol import _codec as codec_module
from kvpush.protocol import _errors as errors_module
from kvpush.protocol._codec import (
    MAX_NOTICE_BYTES,
    WIRE_VERSION,
    AuthenticationError,
    Codec,
    CodecLimits,
    UnsupportedVersionError,
)
from kvpush.protocol._codec_fields import TYPE_CODES, schemas

SECRET = b"0123456789abcdef-shared-secret"
PLAIN = Codec()
SIGNED = Codec(secret=SECRET)
CODECS = [PLAIN, SIGNED]
MESSAGE_TYPES = typing.get_args(ControlMessage)
CLASS_OF = {code: cls for cls, code in TYPE_CODES.items()}
SCHEMAS = schemas(CodecLimits())
HELLO_FIELDS = [name for name, _ in SCHEMAS[Hello]]
LAYOUT_AT = HELLO_FIELDS.index("layout")  # where Hello's layout sits in its wire body
RANKS_AT = HELLO_FIELDS.index("ranks")  # the last field (after the layout)

# --- strategies for valid messages --------------------------------------------

# 64 code points are at most 256 UTF-8 bytes (MAX_ID_LEN); surrogates are excluded.
ids = st.text(min_size=1, max_size=64)
names = st.text(max_size=64)
details = st.text(max_size=200)
epochs = st.integers(0, (1 << 63) - 1)
u64s = st.integers(0, (1 << 64) - 1)
ranks = st.integers(0, 1023)
sizes = st.integers(1, 1024)
leases = st.floats(min_value=0, allow_infinity=False) | st.integers(0, 10_000)
op_bounds = st.floats(min_value=0, exclude_min=True, allow_infinity=False)
sources = st.builds(Source, ranks, ranks)
block_ids = st.lists(
    st.lists(st.integers(0, (1 << 32) - 1), unique=True, max_size=40).map(tuple),
    min_size=1,
    max_size=4,
).map(tuple)
fingerprints = st.dictionaries(names, names, max_size=6).map(lambda d: tuple(d.items()))
modes = st.lists(st.sampled_from(Mode), min_size=1, unique=True).map(tuple)
skip_tokens = st.integers(0, (1 << 63) - 1)
attempts = st.integers(0, 0xFF)
#: Hello.ranks: opaque per-rank blobs (0-8 of 0-512 random bytes).
rank_blobs = st.lists(st.binary(max_size=512), max_size=8).map(tuple)
no_ranks: st.SearchStrategy[tuple[bytes, ...]] = st.just(())
region_kinds = st.text(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-", min_size=1, max_size=32
)
# Strategies for layouts, built once: drawing from a prebuilt strategy is much
# cheaper than building one per draw.
_layer_starts = st.integers(0, 1000) | st.just((1 << 20) - 9)  # Region.layer <= 2**20
_num_blocks = st.integers(1, 1 << 12)
_tokens = st.sampled_from([1, 16, 64]) | st.integers(1, 1 << 16)
_heads = st.integers(1, 16)
_head_bytes = st.sampled_from([2, 128, 256, 1152]) | st.integers(1, 1 << 10)
_head_starts = st.integers(0, (1 << 16) - 1)
_devices = st.integers(0, 7) | st.just((1 << 31) - 1)
_layer_bases = st.lists(st.integers(0, 1 << 48), min_size=1, max_size=3)
_packings: st.SearchStrategy[typing.Literal["split", "interleaved", "mla"]] = st.sampled_from(
    ["split", "interleaved", "mla"]
)
_kind_sets = st.lists(region_kinds, min_size=1, max_size=3, unique=True)
_paddings = st.sampled_from([0, 0, 64, -1])  # -1: stride twice the block length
_bases = st.integers(0, 1 << 48) | st.just(-1)  # -1: end exactly at 2**63


@st.composite
def layouts(draw: st.DrawFn) -> KVLayout:
    """A valid KVLayout: 1-3 KV groups, each either vLLM-style per-layer tensors
    (``layer_regions``: split, interleaved or MLA packing) or hand-built regions
    (any kind name, padded strides, a base up to the 2**63 ceiling); both head
    orders, DRAM and VRAM; the regions in any order."""
    regions: list[Region] = []
    layer = draw(_layer_starts)
    for group in range(draw(st.sampled_from([1, 1, 2, 3]))):
        num_blocks, tokens = draw(_num_blocks), draw(_tokens)
        heads, head_bytes = draw(_heads), draw(_head_bytes)
        order, memory = draw(st.sampled_from(HeadOrder)), draw(st.sampled_from(MemoryType))
        device = draw(_devices)
        if draw(st.booleans()):
            bases = draw(_layer_bases)
            regions += layer_regions(
                bases,
                num_blocks=num_blocks,
                tokens_per_block=tokens,
                num_heads=heads,
                head_bytes=head_bytes,
                head_start=draw(_head_starts) // 1024,
                packing=draw(_packings),
                order=order,
                memory=memory,
                device=device,
                group=group,
                first_layer=layer,
            )
            layer += len(bases)
            continue
        block_len = tokens * heads * head_bytes
        for kind in draw(_kind_sets):
            pad = draw(_paddings)
            stride = block_len + (block_len if pad < 0 else pad)
            base = draw(_bases)
            if base < 0:
                base = (1 << 63) - (num_blocks - 1) * stride - block_len
            regions.append(
                Region(
                    layer=layer,
                    kind=kind,
                    base=base,
                    num_blocks=num_blocks,
                    block_len=block_len,
                    block_stride=stride,
                    tokens_per_block=tokens,
                    num_heads=heads,
                    head_bytes=head_bytes,
                    head_start=draw(_head_starts),
                    order=order,
                    memory=memory,
                    device=device,
                    group=group,
                )
            )
        layer += 1
    # Any order (it is local and must survive the round trip): rotate, maybe reverse.
    turn = draw(st.integers(0, len(regions) - 1))
    regions = regions[turn:] + regions[:turn]
    return KVLayout(tuple(regions[::-1] if draw(st.booleans()) else regions))


def hellos(
    layout: st.SearchStrategy[KVLayout | None],
    ranks: st.SearchStrategy[tuple[bytes, ...]] = no_ranks,
) -> st.SearchStrategy[Hello]:
    return st.builds(
        Hello,
        ids,
        u64s,
        st.sampled_from(Role),
        sizes,
        sizes,
        st.integers(1, 1 << 16),
        st.booleans(),
        st.integers(1, 64),
        op_bounds,
        op_bounds,  # max_transit
        fingerprints,
        modes,
        st.integers(0, 0xFFFF),
        layout,
        ranks,
    )


messages: st.SearchStrategy[ControlMessage] = st.one_of(
    hellos(st.none() | layouts(), rank_blobs),
    st.builds(HelloReject, names, details),
    st.builds(
        Register, ids, epochs, ids, block_ids, leases, st.sampled_from(Mode), skip_tokens, attempts
    ),
    st.builds(Withdraw, ids, epochs),
    st.builds(Abort, ids, epochs),
    st.builds(Settled, ids, epochs),
    st.builds(Rejected, ids, epochs, st.sampled_from(RejectReason), attempts),
    st.builds(WriteFailed, ids, epochs, sources, ranks, details),
    st.builds(Announce, ids, epochs, block_ids, leases),
    st.builds(ReadDone, ids, epochs, st.booleans()),
    st.builds(Renew, ids, epochs),
    st.builds(Extend, ids, epochs, attempts, leases),
    st.builds(Heartbeat, u64s),
)
completions = st.builds(
    Completion,
    ids,
    epochs,
    sources,
    ranks,
    st.lists(st.integers(0, (1 << 32) - 1), max_size=7).map(tuple),
)

#: Any value msgpack can carry, for swapping into fields of valid frames.
wire_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)

# --- helpers ---------------------------------------------------------------


def bad(obj: Any, **changes: Any) -> Any:
    """``obj`` with ``changes``, typed loosely so that invalid values type-check."""
    return dataclasses.replace(obj, **changes)


def sign(data: bytes, size: int = 32) -> bytes:
    """``data`` with its flags set to "MAC" and a MAC under SECRET appended."""
    data = data[:5] + b"\x01" + data[6:] if data[:3] == b"KVP" else data[:4] + b"\x01" + data[5:]
    return data + hmac.new(SECRET, data, hashlib.sha256).digest()[:size]


def frame(code: int, fields: Any, flags: int = 0, version: int = WIRE_VERSION) -> bytes:
    body: bytes = msgpack.packb(fields, use_bin_type=True)
    return b"KVP" + bytes((version, code, flags)) + body


def body_of(codec: Codec, data: bytes) -> Any:
    end = len(data) - (32 if codec.authenticated else 0)
    return msgpack.unpackb(data[6:end])


def check_decode(codec: Codec, data: bytes) -> None:
    """Decode: a result must be a valid message (it round-trips), an error must
    be a RemoteProtocolError; anything else fails the test."""
    try:
        msg = codec.decode(data)
    except RemoteProtocolError:
        return
    assert type(msg) in MESSAGE_TYPES
    assert codec.decode(codec.encode(msg)) == msg


def check_decode_notice(codec: Codec, data: bytes) -> None:
    try:
        notice = codec.decode_notice(data)
    except RemoteProtocolError:
        return
    assert type(notice) is Completion
    assert codec.decode_notice(codec.encode_notice(notice)) == notice


REGISTER = Register("req-1", 3, "decode-0", (tuple(range(1000, 1064)),), 5.0)
NOTICE = Completion("req-1", 3, Source(1, 0), 2)
#: Two layers of split K/V (four regions), as a TP-1 producer of a small model.
LAYOUT = KVLayout(
    layer_regions([0, 1 << 30], num_blocks=4, tokens_per_block=16, num_heads=2, head_bytes=128)
)
HELLO = Hello("e", 1, Role.PRODUCER, 1, 1, 8, False, 1, 10.0, 2.0)


def packed(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def layout_doc(**changes: Any) -> dict[str, Any]:
    """LAYOUT's wire document with top-level ``changes`` (None deletes a key)."""
    doc = {**LAYOUT.to_wire(), **changes}
    return {k: v for k, v in doc.items() if v is not None}


def region_doc(i: int = 0, **changes: Any) -> dict[str, Any]:
    """LAYOUT's wire document with region ``i`` changed (None deletes a key)."""
    doc = LAYOUT.to_wire()
    item = {**doc["regions"][i], **changes}
    doc["regions"][i] = {k: v for k, v in item.items() if v is not None}
    return doc


# --- round trips and the format ----------------------------------------------


@pytest.mark.parametrize("codec", CODECS, ids=["plain", "signed"])
@given(msg=messages)
def test_round_trip(codec: Codec, msg: ControlMessage) -> None:
    data = codec.encode(msg)
    assert codec.decode(data) == msg
    assert codec.decode(bytearray(data)) == msg
    assert codec.decode(memoryview(data)) == msg
    assert len(data) <= codec.limits.max_frame_bytes


@pytest.mark.parametrize("codec", CODECS, ids=["plain", "signed"])
@given(notice=completions)
def test_notice_round_trip_and_size_bound(codec: Codec, notice: Completion) -> None:
    data = codec.encode_notice(notice)
    assert codec.decode_notice(data) == notice
    assert len(data) <= 64 + len(notice.transfer_id.encode()) <= MAX_NOTICE_BYTES


def test_a_staged_notice_names_its_tokens_and_a_malformed_count_is_refused() -> None:
    plain = Completion("t", 3, Source(1, 0), 2)
    staged = Completion("t", 3, Source(1, 0), 2, (48, 16))
    data = PLAIN.encode_notice(staged)
    assert data[4] == 0x02 and data[19:28] == b"\x02" + bytes([48, 0, 0, 0, 16, 0, 0, 0])
    assert PLAIN.decode_notice(data) == staged
    assert PLAIN.decode_notice(PLAIN.encode_notice(plain)) == plain
    for count in (0, 8, 3):  # none, too many, more than the bytes hold
        with pytest.raises(RemoteProtocolError, match="staged"):
            PLAIN.decode_notice(data[:19] + bytes([count]) + data[20:])
    with pytest.raises(LocalProtocolError, match="staged"):
        PLAIN.encode_notice(Completion("t", 3, Source(1, 0), 2, (1,) * 8))


def test_golden_bytes() -> None:
    """Pins the wire format: a change here breaks mixed-version deployments."""
    assert PLAIN.encode(Heartbeat(5)) == b"KVP\x01\x0b\x00\x91\x05"
    assert PLAIN.encode(Abort("t", 0)) == b"KVP\x01\x05\x00\x92\xa1t\x00"
    # Register: fixarray of 9; ids as a bin of uint32 LE; lease float64; mode by
    # value; skip_tokens (16 a positive fixint; 2**40 a uint64); attempt; the
    # staging slot last (an empty array: none).
    reg = Register("t", 1, "c", ((7,),), 0.5, Mode.PULL, 16)
    reg_body = (
        b"\x99\xa1t\x01\xa1c\x91\xc4\x04\x07\x00\x00\x00\xcb?\xe0" + b"\x00" * 6 + b"\xa4pull"
    )
    assert PLAIN.encode(reg) == b"KVP\x01\x03\x00" + reg_body + b"\x10\x00\x90"
    assert PLAIN.encode(bad(reg, skip_tokens=1 << 40, attempt=2, stage=(0, 65536))) == (
        b"KVP\x01\x03\x00"
        + reg_body
        + b"\xcf"
        + (1 << 40).to_bytes(8, "big")
        + b"\x02\x92\x00\xce\x00\x01\x00\x00"
    )
    # Rejected: the reason by value, then the attempt.
    rejected = Rejected("t", 1, RejectReason.STALLED, 1)
    assert PLAIN.encode(rejected) == b"KVP\x01\x07\x00\x94\xa1t\x01\xa7stalled\x01"
    # Renew (type 12): the key only; epoch 0 is a consumer's keep request.
    assert PLAIN.encode(Renew("t", 2)) == b"KVP\x01\x0c\x00\x92\xa1t\x02"
    assert PLAIN.encode(Renew("t", 0)) == b"KVP\x01\x0c\x00\x92\xa1t\x00"
    # Extend (type 13): the key, the attempt, then the lease as a float64.
    assert PLAIN.encode(Extend("t", 2, 1, 0.5)) == (
        b"KVP\x01\x0d\x00\x94\xa1t\x02\x01\xcb?\xe0" + b"\x00" * 6
    )
    # Hello: fixarray of 15; op_bound then max_transit (float64 each); no
    # layout is an empty bin (c4 00), then the ranks last: an array of bins,
    # here empty (90).
    hello_head = (
        b"\x9f\xa1e\x01\xa8producer\x01\x01\x08\xc2\x01\xcb@$"
        + b"\x00" * 6
        + b"\xcb@"
        + b"\x00" * 7
        + b"\x90\x92\xa4push\xa4pull\x03"  # the protocol version, 3 since Renew and Extend
    )
    assert PLAIN.encode(HELLO) == b"KVP\x01\x01\x00" + hello_head + b"\xc4\x00\x90"
    # Rank blobs are bins in rank order, as given: bin8 up to 255 bytes, then bin16.
    assert PLAIN.encode(bad(HELLO, ranks=(b"", b"\x01\x02", b"r" * 256))) == (
        b"KVP\x01\x01\x00"
        + hello_head
        + b"\xc4\x00"
        + b"\x93\xc4\x00\xc4\x02\x01\x02\xc5\x01\x00"
        + b"r" * 256
    )
    # A layout is a bin (here bin8, 167 bytes) holding a msgpack map: version 1
    # and the regions, each a map of 14 keys in this order, enums by value.
    one = KVLayout(
        (
            Region(
                layer=0,
                kind="K",
                base=0,
                num_blocks=1,
                block_len=1,
                tokens_per_block=1,
                num_heads=1,
                head_bytes=1,
            ),
        )
    )
    doc = (
        b"\x82\xa7version\x01\xa7regions\x91\x8e\xa5layer\x00\xa4kind\xa1K\xa4base\x00"
        b"\xaanum_blocks\x01\xa9block_len\x01\xacblock_stride\x01\xb0tokens_per_block\x01"
        b"\xa9num_heads\x01\xaahead_start\x00\xaahead_bytes\x01\xa5order\xa3NHD"
        b"\xa6memory\xa4VRAM\xa6device\x00\xa5group\x00"
    )
    assert len(doc) == 167
    assert PLAIN.encode(bad(HELLO, layout=one)) == (
        b"KVP\x01\x01\x00" + hello_head + b"\xc4\xa7" + doc + b"\x90"
    )
    assert PLAIN.encode_notice(Completion("t", 1, Source(2, 3), 4)) == (
        b"KVN\x01\x00" + (1).to_bytes(8, "little") + b"\x02\x00\x03\x00\x04\x00t"
    )
    signed = SIGNED.encode(Heartbeat(5))
    assert signed[:-32] == b"KVP\x01\x0b\x01\x91\x05"
    assert signed[-32:] == hmac.new(SECRET, signed[:-32], hashlib.sha256).digest()


def test_typical_sizes() -> None:
    # Register with 64 ids: header 6 + fixarray 1 + "req-1" 6 + epoch 1 +
    # "decode-0" 9 + blocks (fixarray 1 + bin16 header 3 + 256) + lease float64 9
    # + "push" 5 + skip_tokens 0 and attempt 0 as fixints 1 + 1 + no staging
    # slot (an empty fixarray) 1 = 300 (297 before skip_tokens, 298 before
    # attempt, 299 before the slot).
    assert len(PLAIN.encode(REGISTER)) == 300
    assert len(SIGNED.encode(REGISTER)) == 300 + 32
    # A skip_tokens past 127 costs what msgpack's int needs: 3, 5 or 9 bytes.
    assert len(PLAIN.encode(bad(REGISTER, skip_tokens=4096))) == 300 + 2
    assert len(PLAIN.encode(bad(REGISTER, skip_tokens=(1 << 63) - 1))) == 300 + 8
    # A staging slot: [offset, nbytes] in the fixarray (0 a fixint, 2**20 a uint32).
    assert len(PLAIN.encode(bad(REGISTER, stage=(0, 1 << 20)))) == 300 + 1 + 5
    # Hello without a layout or ranks: header 6 + fixarray 1 + "e" 2 +
    # instance 1 + "producer" 9 + tp, pp, heads, mla, kv_groups 5 + op_bound 9 +
    # max_transit 9 + [] 1 + ["push", "pull"] 11 + version 1 + empty bin 2 +
    # empty ranks array 1 = 58 (49 before max_transit, 48 before ranks).
    assert len(PLAIN.encode(HELLO)) == 58
    # With LAYOUT the empty bin becomes a bin16 (3-byte header) + the document:
    # 19 bytes (fixmap, "version" 1, "regions", fixarray) + 4 regions of 153
    # bytes (the 148 of the one-region document in test_golden_bytes, + 2 + 2
    # for block_len and block_stride 4096 as uint16, + 1 for head_bytes 128 as
    # uint8) + 10 for the bases (16384 a uint16; 2**30, 2**30 + 16384 uint32s).
    doc = packed(LAYOUT.to_wire())
    assert len(doc) == 19 + 4 * 153 + 10 == 641
    assert len(PLAIN.encode(bad(HELLO, layout=LAYOUT))) == 58 - 2 + 3 + 641
    # Ranks: each blob costs its length plus a bin header (2 bytes up to 255,
    # 3 up to 65535, else 5); TP 8 with 300-byte blobs: 58 - 1 + 1 + 8 * 303.
    tp8 = bad(HELLO, tp=8, ranks=tuple(bytes([i]) * 300 for i in range(8)))
    assert len(PLAIN.encode(tp8)) == 58 + 8 * 303 == 2482
    big = bad(HELLO, ranks=(bytes(255), bytes(65536)))
    assert len(PLAIN.encode(big)) == 58 + (2 + 255) + (5 + 65536)
    assert len(PLAIN.encode_notice(NOTICE)) == 19 + 5
    assert len(SIGNED.encode_notice(NOTICE)) == 19 + 5 + 16


def test_every_message_has_a_schema_in_field_order() -> None:
    table = schemas(CodecLimits())
    assert set(TYPE_CODES) == set(table) == set(MESSAGE_TYPES)
    assert len(set(TYPE_CODES.values())) == len(TYPE_CODES)
    for cls, schema in table.items():
        assert [name for name, _ in schema] == [f.name for f in dataclasses.fields(cls)]


def test_module_exports() -> None:
    for name in codec_module.__all__:
        assert hasattr(codec_module, name)
    assert issubclass(UnsupportedVersionError, RemoteProtocolError)
    assert issubclass(AuthenticationError, RemoteProtocolError)
    # Defined in _errors; the package and _codec re-export the same classes.
    for name in ("UnsupportedVersionError", "AuthenticationError"):
        cls = getattr(errors_module, name)
        assert getattr(protocol_module, name) is cls
        assert getattr(codec_module, name) is cls
    err = UnsupportedVersionError(7, WIRE_VERSION)
    assert err.version == 7
    assert str(err) == f"unsupported wire version 7 (this side speaks {WIRE_VERSION})"


def test_core_hello_round_trips() -> None:
    hello = Hello("prefill-0", 12345, Role.PRODUCER, 4, 2, 8, False, 1, 10, 2)  # int seconds
    decoded = PLAIN.decode(PLAIN.encode(hello))
    assert decoded == hello
    assert isinstance(decoded, Hello)
    assert decoded.version == PROTOCOL_VERSION
    assert decoded.layout is None
    assert decoded.ranks == ()
    assert type(decoded.op_bound) is float


def test_layouts_round_trip() -> None:
    for layout in (
        LAYOUT,
        KVLayout(
            layer_regions(
                [4096],
                num_blocks=9,
                tokens_per_block=64,
                num_heads=1,
                head_bytes=1152,
                packing="mla",
                memory=MemoryType.DRAM,
            )
        ),
        KVLayout(
            layer_regions(
                [0, 1 << 40],
                num_blocks=2,
                tokens_per_block=16,
                num_heads=4,
                head_bytes=256,
                packing="interleaved",
                order=HeadOrder.HND,
                device=3,
            )
        ),
    ):
        hello = bad(HELLO, layout=layout)
        for codec in CODECS:
            decoded = codec.decode(codec.encode(hello))
            assert decoded == hello
            assert isinstance(decoded, Hello)
            assert decoded.layout == layout
            assert decoded.layout.regions == layout.regions  # same order too
    # The bin holds exactly the layout's to_wire() document; the ranks follow it.
    body = body_of(PLAIN, PLAIN.encode(bad(HELLO, layout=LAYOUT)))
    assert body[LAYOUT_AT] == packed(LAYOUT.to_wire())
    assert body[RANKS_AT] == []
    assert body_of(PLAIN, PLAIN.encode(HELLO))[LAYOUT_AT] == b""


def test_ranks_round_trip() -> None:
    blobs = (b"", b"\x00", bytes(range(256)) * 3, b"\xc1\x90\xdd\xff\xff\xff\xff", b"x" * 70_000)
    for ranks in ((), blobs, (b"",) * 1024, (b"nixl-agent-0", b"nixl-agent-1")):
        hello = bad(HELLO, layout=LAYOUT, ranks=ranks)
        for codec in CODECS:
            decoded = codec.decode(codec.encode(hello))
            assert decoded == hello
            assert isinstance(decoded, Hello)
            assert decoded.ranks == ranks
            assert decoded.layout == LAYOUT
            assert all(type(b) is bytes for b in decoded.ranks)
        # Opaque: each blob travels as a bin of exactly its bytes, in rank order.
        assert body_of(PLAIN, PLAIN.encode(hello))[RANKS_AT] == list(ranks)


def test_skip_tokens_round_trip() -> None:
    for skip in (0, 16, 4096, (1 << 63) - 1):
        reg = bad(REGISTER, skip_tokens=skip)
        assert SIGNED.decode(SIGNED.encode(reg)) == reg
        assert body_of(PLAIN, PLAIN.encode(reg))[-3:] == [skip, 0, []]
    assert PLAIN.decode(PLAIN.encode(REGISTER)).skip_tokens == 0  # type: ignore[union-attr]


def largest_layout(max_bytes: int) -> KVLayout:
    """A layout of the widest regions with the most of them that fits ``max_bytes``."""
    widest = Region(
        layer=1 << 20,
        kind="k" * 32,
        base=1 << 62,
        num_blocks=1 << 31,
        block_len=1 << 20,
        tokens_per_block=1 << 16,
        num_heads=1,
        head_bytes=16,
        head_start=(1 << 16) - 1,
        block_stride=1 << 30,
        order=HeadOrder.HND,
        memory=MemoryType.DRAM,
        device=(1 << 31) - 1,
    )
    each = len(packed(widest.to_wire()))  # every region below packs to this size
    n = min(MAX_REGIONS, max_bytes // each)
    regions = [dataclasses.replace(widest, layer=(1 << 20) - i) for i in range(n)]
    while len(packed(KVLayout(tuple(regions)).to_wire())) > max_bytes:
        regions.pop()
    layout = KVLayout(tuple(regions))
    assert max_bytes - each < len(packed(layout.to_wire())) <= max_bytes
    return layout


def test_largest_messages_fit_the_frame_bound() -> None:
    lim = CodecLimits(
        max_block_ids=1000,
        max_kv_groups=8,
        max_fingerprint_entries=5,
        max_layout_bytes=100_000,  # over 65535: the layout needs a bin32 header
        max_ranks_bytes=100_000,  # all of it in max_ranks blobs, one a bin32
    )
    plain, signed = Codec(limits=lim), Codec(limits=lim, secret=SECRET)
    wide = "\U0010ffff" * 64  # 256 UTF-8 bytes
    groups = tuple(tuple(range(g * 125, g * 125 + 125)) for g in range(8))
    # Rank blobs with the most header bytes the limits allow: one bin32 (65536
    # bytes or more), as many bin16 (256 bytes) as the rest holds, and empty
    # bin8s up to max_ranks entries.
    n16 = (lim.max_ranks_bytes - 65536) // 256
    blobs = (
        bytes(lim.max_ranks_bytes - 256 * n16),
        *(bytes(256),) * n16,
        *(b"",) * (lim.max_ranks - 1 - n16),
    )
    assert len(blobs) == lim.max_ranks and sum(map(len, blobs)) == lim.max_ranks_bytes
    biggest: list[ControlMessage] = [
        Register(wide, (1 << 63) - 1, wide, groups, 1e300, Mode.PULL, (1 << 63) - 1),
        Announce(wide, (1 << 63) - 1, groups, 1e300),
        Hello(
            wide,
            (1 << 64) - 1,
            Role.CONSUMER,
            1024,
            1024,
            1 << 16,
            True,
            8,
            1e300,
            1e300,
            tuple((wide[:-i] + "k", wide) for i in range(1, 6)),
            (Mode.PULL, Mode.PUSH),
            0xFFFF,
            largest_layout(lim.max_layout_bytes),
            blobs,
        ),
        HelloReject(wide, "\U0010ffff" * 1024),
        WriteFailed(wide, (1 << 63) - 1, Source(1023, 1023), 1023, "\U0010ffff" * 1024),
    ]
    for msg in biggest:
        assert len(plain.encode(msg)) < len(signed.encode(msg)) <= lim.largest_frame()
        assert signed.decode(signed.encode(msg)) == msg


def test_largest_frame_counts_the_ranks() -> None:
    # The ranks add their total, a bin header of at most 5 bytes per entry and
    # the array's header; a frame limit that holds them admits the largest blob.
    lim = CodecLimits()
    roomy = CodecLimits(max_ranks_bytes=2 << 20, max_frame_bytes=8 << 20)
    assert roomy.largest_frame() == lim.largest_frame() + (1 << 20)
    few = CodecLimits(max_ranks=2)
    assert lim.largest_frame() - few.largest_frame() == 5 * (lim.max_ranks - 2)
    codec = Codec(limits=roomy)
    hello = bad(HELLO, ranks=(bytes(roomy.max_ranks_bytes),))  # over the other bins' limit
    assert codec.decode(codec.encode(hello)) == hello
    with pytest.raises(RemoteProtocolError, match="malformed body"):
        PLAIN.decode(codec.encode(hello))


def test_default_limits_take_the_most_block_ids() -> None:
    lim = CodecLimits()
    msg = Register("t", 1, "c", (tuple(range(lim.max_block_ids)),), 1.0)
    data = SIGNED.encode(msg)
    assert len(data) <= lim.max_frame_bytes
    assert SIGNED.decode(data) == msg
    over = Register("t", 1, "c", (tuple(range(lim.max_block_ids + 1)),), 1.0)
    with pytest.raises(LocalProtocolError, match="blocks"):
        PLAIN.encode(over)


def test_default_limits_take_the_largest_hello() -> None:
    """The most fingerprint entries, the largest layout and max_ranks blobs of
    max_ranks_bytes in all, together in one frame (2.1 MB, hence the 4 MiB
    default frame limit)."""
    lim = CodecLimits()
    layout = largest_layout(lim.max_layout_bytes)
    fp = tuple((f"k{i}", "v" * 256) for i in range(lim.max_fingerprint_entries))
    each = lim.max_ranks_bytes // lim.max_ranks
    ranks = tuple(bytes([i % 256]) * each for i in range(lim.max_ranks))
    assert sum(map(len, ranks)) == lim.max_ranks_bytes
    hello = bad(HELLO, fingerprint=fp, layout=layout, ranks=ranks)
    data = SIGNED.encode(hello)
    assert 1 << 21 < len(data) <= lim.largest_frame() <= lim.max_frame_bytes
    assert SIGNED.decode(data) == hello
    last = layout.regions[-1]  # one more region of the same size no longer fits
    more = KVLayout((*layout.regions, dataclasses.replace(last, layer=last.layer - 1)))
    with pytest.raises(LocalProtocolError, match=r"Hello\.layout: KV layout of \d+ bytes exceeds"):
        PLAIN.encode(bad(HELLO, layout=more))


# --- configuration ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_frame_bytes": 0},
        {"max_frame_bytes": 4096},  # cannot hold 2**18 block ids
        {"max_frame_bytes": 1 << 21},  # the old default: not a layout and ranks of 1 MiB each
        {"max_ranks_bytes": 0},
        {"max_ranks_bytes": True},
        {"max_ranks_bytes": (1 << 30) + 1},
        {"max_ranks_bytes": 3 << 20},  # more than the default frame holds besides the rest
        {"max_block_ids": 0},
        {"max_ranks": 1025},
        {"max_id_len": 257},
        {"max_id_len": True},
        {"max_kv_groups": 2.0},
        {"max_detail_len": -1},
    ],
)
def test_bad_limits(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        CodecLimits(**kwargs)


@pytest.mark.parametrize("secret", [b"", b"short", "a str secret of some length"])
def test_bad_secret(secret: Any) -> None:
    with pytest.raises(ConfigError):
        Codec(secret=secret)


def test_bad_limits_object() -> None:
    with pytest.raises(ConfigError):
        Codec(limits=object())  # type: ignore[arg-type]


def test_repr_hides_the_secret() -> None:
    assert "0123" not in repr(SIGNED)
    assert "authenticated=True" in repr(SIGNED)


# --- encoding invalid messages -------------------------------------------------

LONG = "x" * 257
R = REGISTER
H = HELLO


@pytest.mark.parametrize(
    "msg",
    [
        bad(R, transfer_id=LONG),
        bad(R, transfer_id="é" * 129),  # 258 bytes
        bad(R, transfer_id=""),
        bad(R, transfer_id="\udc80"),  # lone surrogate
        bad(R, transfer_id=b"t"),
        bad(R, epoch=-1),
        bad(R, epoch=1 << 63),
        bad(R, epoch=True),
        bad(R, epoch=1.0),
        bad(R, consumer=""),
        bad(R, lease=math.nan),
        bad(R, lease=math.inf),
        bad(R, lease=-0.5),
        bad(R, lease=-1),
        bad(R, lease=1 << 60),
        bad(R, lease=10**400),
        bad(R, lease="5"),
        bad(R, lease=True),
        bad(R, blocks=()),
        bad(R, blocks=((1, 1),)),
        bad(R, blocks=((1 << 32,),)),
        bad(R, blocks=((-1,),)),
        bad(R, blocks=((True,),)),
        bad(R, blocks=((1.0,),)),
        bad(R, blocks=(([1],),)),
        bad(R, blocks=((1,),) * 65),
        bad(R, blocks=(1, 2)),
        bad(R, blocks="ab"),
        bad(R, mode="push"),
        bad(R, skip_tokens=-1),
        bad(R, skip_tokens=1 << 63),
        bad(R, skip_tokens=True),
        bad(R, skip_tokens=16.0),
        bad(R, skip_tokens=None),
        bad(H, op_bound=0.0),
        bad(H, op_bound=math.nan),
        bad(H, op_bound=-math.inf),
        bad(H, tp=0),
        bad(H, tp=1025),
        bad(H, pp=-1),
        bad(H, num_kv_heads=0),
        bad(H, kv_groups=65),
        bad(H, instance=-1),
        bad(H, instance=1 << 64),
        bad(H, version=-1),
        bad(H, role="producer"),
        bad(H, mla=1),
        bad(H, modes=()),
        bad(H, modes=(Mode.PUSH, Mode.PUSH)),
        bad(H, modes=("push",)),
        bad(H, fingerprint=(("a", "1"), ("a", "2"))),
        bad(H, fingerprint=(("a", LONG),)),
        bad(H, fingerprint=(("a", "1", "2"),)),
        bad(H, fingerprint=(("a", 1),)),
        bad(H, fingerprint=tuple((str(i), "") for i in range(65))),
        bad(H, layout=LAYOUT.regions),
        bad(H, layout=LAYOUT.to_wire()),
        bad(H, layout=packed(LAYOUT.to_wire())),
        bad(H, layout=b""),
        bad(H, ranks=None),
        bad(H, ranks=b"blob"),  # bytes, not a sequence of them
        bad(H, ranks="ab"),
        bad(H, ranks=("x",)),  # a str, not bytes
        bad(H, ranks=(b"a", bytearray(b"b"))),  # only bytes itself
        bad(H, ranks=(memoryview(b"m"),)),
        bad(H, ranks=(None,)),
        bad(H, ranks=(0,)),
        bad(H, ranks=((b"a",),)),
        bad(H, ranks=(b"",) * 1025),  # more than max_ranks entries
        bad(H, ranks=(bytes(1 << 20), b"\x00")),  # max_ranks_bytes + 1 in all
        bad(H, ranks=(b"x" * ((1 << 20) + 1),)),
        HelloReject("f", "d" * 4097),
        WriteFailed("t", 1, Source(1024, 0), 0),
        WriteFailed("t", 1, Source(0, 0), 1024),
        WriteFailed("t", 1, (0, 0), 0),  # type: ignore[arg-type]
        Rejected("t", 1, "released"),  # type: ignore[arg-type]
        ReadDone("t", 1, None),  # type: ignore[arg-type]
        Renew("t", -1),
        Renew("", 1),
        Extend("t", 1, 256, 1.0),
        Extend("t", 1, 0, -1.0),
        Extend("t", 1, 0, math.nan),
        Heartbeat(-1),
        NOTICE,  # a notice is not a control message
        "not a message",
    ],
)
def test_encode_invalid_raises_local_error(msg: Any) -> None:
    with pytest.raises(LocalProtocolError):
        PLAIN.encode(msg)


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (bad(R, skip_tokens=-1), "Register.skip_tokens"),
        (bad(R, skip_tokens=True), "Register.skip_tokens"),
        (bad(R, skip_tokens=0.0), "Register.skip_tokens"),
        (bad(H, layout=LAYOUT.regions), "Hello.layout"),
        (bad(H, layout=0), "Hello.layout"),
        (bad(H, ranks=("x",)), "Hello.ranks"),
        (bad(H, ranks=(b"",) * 1025), "Hello.ranks"),
        (bad(H, ranks=(bytes(1 << 20), b"\x00")), "Hello.ranks"),
    ],
)
def test_encode_names_the_new_fields(msg: Any, field: str) -> None:
    with pytest.raises(LocalProtocolError, match=re.escape(field + ":")):
        SIGNED.encode(msg)


def test_layout_size_limit_is_exact_on_both_sides() -> None:
    hello = bad(HELLO, layout=LAYOUT)
    size = len(packed(LAYOUT.to_wire()))
    fits = Codec(limits=CodecLimits(max_layout_bytes=size))
    short = Codec(limits=CodecLimits(max_layout_bytes=size - 1))
    assert fits.decode(fits.encode(hello)) == hello
    with pytest.raises(LocalProtocolError, match=r"Hello\.layout: KV layout of \d+ bytes exceeds"):
        short.encode(hello)
    with pytest.raises(
        RemoteProtocolError, match=r"Hello\.layout: expected a KV layout of at most"
    ):
        short.decode(fits.encode(hello))
    assert short.decode(short.encode(HELLO)) == HELLO  # no layout: always fits


def test_ranks_limits_are_exact_on_both_sides() -> None:
    """max_ranks bounds the count, max_ranks_bytes the blobs' total length
    (not each blob, not the headers): the limit itself is accepted, one more
    is refused by encode (LocalProtocolError) and decode (RemoteProtocolError)."""
    hello = bad(HELLO, ranks=(b"a" * 100, b"", b"b" * 28))  # 3 blobs, 128 bytes
    fits = Codec(limits=CodecLimits(max_ranks=3, max_ranks_bytes=128))
    assert fits.decode(fits.encode(hello)) == hello
    for lim, encode_error, decode_error in [
        (
            CodecLimits(max_ranks_bytes=127),
            r"Hello\.ranks: rank descriptions exceed 127 bytes in all",
            r"Hello\.ranks: rank descriptions exceed 127 bytes in all",
        ),
        (
            CodecLimits(max_ranks=2),
            r"Hello\.ranks: ranks: expected 0 to 2 entries",
            r"Hello\.ranks: ranks: expected an array of 0 to 2 entries",
        ),
    ]:
        for secret in (None, SECRET):
            short = Codec(limits=lim, secret=secret)
            sender = Codec(limits=fits.limits, secret=secret)
            with pytest.raises(LocalProtocolError, match=encode_error):
                short.encode(hello)
            with pytest.raises(RemoteProtocolError, match=decode_error):
                short.decode(sender.encode(hello))
            assert short.decode(short.encode(HELLO)) == HELLO  # no ranks: always fits
    # The defaults: max_ranks (1024) blobs of max_ranks_bytes (1 MiB) in all
    # round-trip, and so does one blob of all of it (a bin32).
    lim = CodecLimits()
    each = lim.max_ranks_bytes // lim.max_ranks
    full = bad(HELLO, ranks=(b"r" * each,) * lim.max_ranks)
    one = bad(HELLO, ranks=(bytes(lim.max_ranks_bytes),))
    for msg in (full, one):
        for codec in CODECS:
            assert codec.decode(codec.encode(msg)) == msg
    # One byte more: refused on encode, and on decode when a roomier peer sent it.
    over = bad(full, ranks=(*full.ranks[:-1], full.ranks[-1] + b"!"))
    with pytest.raises(LocalProtocolError, match=r"Hello\.ranks: rank descriptions exceed"):
        PLAIN.encode(over)
    roomy = Codec(limits=CodecLimits(max_ranks_bytes=lim.max_ranks_bytes + 1))
    with pytest.raises(RemoteProtocolError, match=r"Hello\.ranks: rank descriptions exceed"):
        PLAIN.decode(roomy.encode(over))
    # One entry more cannot be encoded by any codec (max_ranks is capped at
    # 1024); crafted, it is over the unpacker's array limit (max_ranks).
    with pytest.raises(LocalProtocolError, match=r"Hello\.ranks: ranks: expected 0 to 1024"):
        PLAIN.encode(bad(HELLO, ranks=(b"",) * (lim.max_ranks + 1)))
    with pytest.raises(RemoteProtocolError, match="Hello: malformed body"):
        PLAIN.decode(frame(1, hello_wire(ranks=[b""] * (lim.max_ranks + 1))))


@pytest.mark.parametrize(
    "notice",
    [
        bad(NOTICE, transfer_id=LONG),
        bad(NOTICE, transfer_id=""),
        bad(NOTICE, epoch=-1),
        bad(NOTICE, epoch=1 << 63),
        bad(NOTICE, consumer_rank=1024),
        bad(NOTICE, source=Source(0, 1024)),
        REGISTER,
    ],
)
def test_encode_invalid_notice_raises_local_error(notice: Any) -> None:
    with pytest.raises(LocalProtocolError):
        SIGNED.encode_notice(notice)


def test_encoding_accepts_lists_and_normalises() -> None:
    msg = Register("t", 1, "c", [[3, 1], []], 2, Mode.PULL)  # type: ignore[arg-type]
    assert PLAIN.decode(PLAIN.encode(msg)) == Register("t", 1, "c", ((3, 1), ()), 2.0, Mode.PULL)
    hello = bad(HELLO, ranks=[b"a", b""])
    assert PLAIN.decode(PLAIN.encode(hello)) == bad(HELLO, ranks=(b"a", b""))


def test_decode_rejects_non_bytes_as_local_misuse() -> None:
    with pytest.raises(LocalProtocolError):
        PLAIN.decode("KVP")  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError):
        PLAIN.decode_notice(None)  # type: ignore[arg-type]


# --- hostile frames ---------------------------------------------------------------


def test_forged_mac() -> None:
    data = bytearray(SIGNED.encode(REGISTER))
    data[-1] ^= 1
    with pytest.raises(AuthenticationError, match="bad MAC"):
        SIGNED.decode(bytes(data))
    other = Codec(secret=b"another secret of 16+ bytes")
    with pytest.raises(AuthenticationError, match="bad MAC"):
        SIGNED.decode(other.encode(REGISTER))
    tampered = bytearray(SIGNED.encode(REGISTER))
    tampered[8] ^= 1  # in the body: the MAC no longer matches
    with pytest.raises(AuthenticationError):
        SIGNED.decode(bytes(tampered))


def test_missing_mac() -> None:
    with pytest.raises(AuthenticationError, match="no MAC"):
        SIGNED.decode(PLAIN.encode(REGISTER))
    stripped = SIGNED.encode(REGISTER)[:-32]
    with pytest.raises(AuthenticationError):
        SIGNED.decode(stripped)
    with pytest.raises(AuthenticationError, match="too short"):
        SIGNED.decode(b"KVP\x01\x03\x01" + b"\x00" * 10)


def test_mac_without_secret_is_refused() -> None:
    with pytest.raises(AuthenticationError, match="no secret"):
        PLAIN.decode(SIGNED.encode(REGISTER))
    with pytest.raises(AuthenticationError, match="no secret"):
        PLAIN.decode_notice(SIGNED.encode_notice(NOTICE))


def test_notice_mac() -> None:
    data = bytearray(SIGNED.encode_notice(NOTICE))
    data[-1] ^= 0x80
    with pytest.raises(AuthenticationError, match="bad MAC"):
        SIGNED.decode_notice(bytes(data))
    with pytest.raises(AuthenticationError, match="no MAC"):
        SIGNED.decode_notice(PLAIN.encode_notice(NOTICE))
    with pytest.raises(AuthenticationError):
        SIGNED.decode_notice(PLAIN.encode_notice(NOTICE)[:4] + b"\x01" + b"\x00" * 20)


def test_oversized_frame() -> None:
    lim = CodecLimits()
    data = frame(3, ["t", 1, "c", [b"\x00" * 4 * lim.max_block_ids], 1.0, "push", 0, 0, []])
    data += b"\x00" * (lim.max_frame_bytes - len(data) + 1)
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        PLAIN.decode(data)
    hello = frame(1, hello_wire(b"\x00" * lim.max_layout_bytes))
    hello += b"\x00" * (lim.max_frame_bytes - len(hello) + 1)
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        PLAIN.decode(hello)
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        PLAIN.decode_notice(b"KVN" + b"\x00" * MAX_NOTICE_BYTES)


@pytest.mark.parametrize(
    "body",
    [
        b"\xdd\xff\xff\xff\xff",  # array32 claiming 4G entries
        b"\xdc\xff\xff" + b"\x00" * 100,  # array16 claiming 65535
        b"\xdf\xff\xff\xff\xff",  # map32
        b"\x81\xa1a\x01",  # any map
        b"\xc6\xff\xff\xff\xff",  # bin32 claiming 4 GiB
        b"\xdb\xff\xff\xff\xff",  # str32 claiming 4 GiB
        b"\xc9\xff\xff\xff\xff\x01",  # ext32
        b"\xd6\xff\x00\x00\x00\x00",  # a timestamp ext
        b"\x91" * 50_000,  # deep nesting
        b"\xc1",  # never used
        b"",  # nothing
    ],
)
def test_frame_claiming_huge_or_odd_structures(body: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="malformed"):
        PLAIN.decode(b"KVP\x01\x03\x00" + body)


def test_many_small_arrays_allocate_little() -> None:
    # 64 arrays of 64 empty arrays: 4,161 lists from 4 KiB; the codec stops early.
    body = b"\xdc\x00\x40" + (b"\xdc\x00\x40" + b"\x90" * 64) * 64
    data = b"KVP\x01\x01\x00" + body
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError, match="too many arrays"):
            PLAIN.decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200_000


def test_unknown_version() -> None:
    for version in (0, 2, 255):
        data = bytearray(PLAIN.encode(REGISTER))
        data[3] = version
        with pytest.raises(UnsupportedVersionError, match=f"version {version}") as info:
            PLAIN.decode(bytes(data))
        assert info.value.version == version
        with pytest.raises(UnsupportedVersionError, match=f"version {version}"):
            SIGNED.decode(bytes(data))  # reported before the MAC is looked at
        notice = bytearray(PLAIN.encode_notice(NOTICE))
        notice[3] = version
        with pytest.raises(UnsupportedVersionError):
            PLAIN.decode_notice(bytes(notice))


@pytest.mark.parametrize("code", [0, 14, 99, 255])
def test_unknown_type_byte(code: int) -> None:
    with pytest.raises(RemoteProtocolError, match=f"unknown message type {code}"):
        PLAIN.decode(frame(code, ["t", 1]))
    with pytest.raises(RemoteProtocolError, match=f"unknown message type {code}"):
        SIGNED.decode(sign(frame(code, ["t", 1])))


def test_unknown_flags() -> None:
    with pytest.raises(RemoteProtocolError, match="flags"):
        PLAIN.decode(frame(5, ["t", 1], flags=0x02))
    data = bytearray(PLAIN.encode_notice(NOTICE))
    data[4] = 0x80
    with pytest.raises(RemoteProtocolError, match="flags"):
        PLAIN.decode_notice(bytes(data))


def test_trailing_garbage() -> None:
    with pytest.raises(RemoteProtocolError, match="malformed"):
        PLAIN.decode(PLAIN.encode(REGISTER) + b"\x00")
    with pytest.raises(AuthenticationError):
        SIGNED.decode(SIGNED.encode(REGISTER) + b"\x00")
    with pytest.raises(RemoteProtocolError, match="malformed"):
        SIGNED.decode(sign(PLAIN.encode(REGISTER) + b"\xc0"))
    # A notice's transfer id runs to the end: garbage there is a different id
    # (the MAC catches it when a secret is set).
    with pytest.raises(AuthenticationError):
        SIGNED.decode_notice(SIGNED.encode_notice(NOTICE) + b"x")


@pytest.mark.parametrize(
    "data", [b"", b"K", b"KVP", b"KVP\x01\x03", b"XVP\x01\x03\x00\x90", b"KVN\x01" + b"\x00" * 30]
)
def test_bad_magic_or_short_frame(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        PLAIN.decode(data)


@pytest.mark.parametrize("data", [b"", b"KVN\x01\x00", PLAIN.encode(REGISTER)[:40]])
def test_bad_magic_or_short_notice(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        PLAIN.decode_notice(data)


# Valid wire bodies, one per message type. Each crafted case below has its
# type's arity and one invalid field, the one it names: with that field put
# back to the valid body's value it decodes (checked in the test), so no case
# can pass by failing on the field count or on some other field.
VALID_WIRE: dict[type[Any], list[Any]] = {
    Hello: ["e", 1, "producer", 1, 1, 8, False, 1, 1.0, 2.0, [], ["push"], 3, b"", []],
    HelloReject: ["f", "d"],
    Register: ["t", 1, "c", [b""], 1.0, "push", 0, 0, []],
    Withdraw: ["t", 1],
    Abort: ["t", 1],
    Settled: ["t", 1],
    Rejected: ["t", 1, "released", 0],
    WriteFailed: ["t", 1, [0, 0], 0, ""],
    Announce: ["t", 1, [b""], 1.0],
    ReadDone: ["t", 1, True],
    Renew: ["t", 1],
    Extend: ["t", 1, 0, 1.0],
    Heartbeat: [1],
}


def hello_wire(layout: Any = b"", **changes: Any) -> list[Any]:
    """The valid Hello body with ``layout`` (any msgpack value) as the layout
    and the fields named in ``changes`` (``ranks=[...]``) set to their values."""
    body = list(VALID_WIRE[Hello])
    body[LAYOUT_AT] = layout
    for name, value in changes.items():
        body[HELLO_FIELDS.index(name)] = value
    return body


DECODE_CASES: list[tuple[int, list[Any], str]] = [
    (3, ["t", True, "c", [b""], 1.0, "push", 0, 0, []], "epoch"),  # bool is not an int
    (3, ["t", -1, "c", [b""], 1.0, "push", 0, 0, []], "epoch"),
    (3, ["t", 1 << 63, "c", [b""], 1.0, "push", 0, 0, []], "epoch"),
    (3, ["t", 1, "c", [b""], 1, "push", 0, 0, []], "lease"),  # seconds travel as floats
    (3, ["t", 1, "c", [b""], math.nan, "push", 0, 0, []], "lease"),
    (3, ["t", 1, "c", [b""], math.inf, "push", 0, 0, []], "lease"),
    (3, ["t", 1, "c", [b""], -1.0, "push", 0, 0, []], "lease"),
    (3, ["t", 1, "c", [b""], 1.0, "PUSH", 0, 0, []], "mode"),
    (3, ["t", 1, "c", [b"\x00\x00\x00"], 1.0, "push", 0, 0, []], "blocks"),  # not whole uint32s
    (3, ["t", 1, "c", [b"\x01\x00\x00\x00" * 2], 1.0, "push", 0, 0, []], "blocks"),  # duplicate id
    (3, ["t", 1, "c", [], 1.0, "push", 0, 0, []], "blocks"),
    (3, ["t", 1, "c", [[1, 2]], 1.0, "push", 0, 0, []], "blocks"),  # ids as ints, not bin
    (3, ["t", 1, "c", b"", 1.0, "push", 0, 0, []], "blocks"),
    (3, ["", 1, "c", [b""], 1.0, "push", 0, 0, []], "transfer_id"),
    (3, ["x" * 257, 1, "c", [b""], 1.0, "push", 0, 0, []], "transfer_id"),
    (3, [b"t", 1, "c", [b""], 1.0, "push", 0, 0, []], "transfer_id"),
    (3, ["t", 1, "", [b""], 1.0, "push", 0, 0, []], "consumer"),
    (3, ["t", 1, "c", [b""], 1.0, "push", -1, 0, []], "skip_tokens"),
    (3, ["t", 1, "c", [b""], 1.0, "push", -(1 << 63), 0, []], "skip_tokens"),
    (3, ["t", 1, "c", [b""], 1.0, "push", 1 << 63, 0, []], "skip_tokens"),
    (3, ["t", 1, "c", [b""], 1.0, "push", (1 << 64) - 1, 0, []], "skip_tokens"),
    (3, ["t", 1, "c", [b""], 1.0, "push", True, 0, []], "skip_tokens"),  # bool is not an int
    (3, ["t", 1, "c", [b""], 1.0, "push", False, 0, []], "skip_tokens"),
    (3, ["t", 1, "c", [b""], 1.0, "push", 0.0, 0, []], "skip_tokens"),  # nor is a float
    (3, ["t", 1, "c", [b""], 1.0, "push", 16.0, 0, []], "skip_tokens"),
    (3, ["t", 1, "c", [b""], 1.0, "push", None, 0, []], "skip_tokens"),
    (3, ["t", 1, "c", [b""], 1.0, "push", "0", 0, []], "skip_tokens"),
    (3, ["t", 1, "c", [b""], 1.0, "push", 0, -1, []], "attempt"),
    (3, ["t", 1, "c", [b""], 1.0, "push", 0, 256, []], "attempt"),
    (3, ["t", 1, "c", [b""], 1.0, "push", 0, True, []], "attempt"),
    (3, ["t", 1, "c", [b""], 1.0, "push", 0, 0, [0]], "stage"),  # [offset, nbytes] or []
    (3, ["t", 1, "c", [b""], 1.0, "push", 0, 0, [0, 0]], "stage"),  # an empty slot
    (3, ["t", 1, "c", [b""], 1.0, "push", 0, 0, [-1, 8]], "stage"),
    (3, ["t", 1, "c", [b""], 1.0, "push", 0, 0, [0, 1.0]], "stage"),
    (3, ["t", 1, "c", [b""], 1.0, "push", 0, 0, None], "stage"),
    (7, ["t", 1, "stalled", -1], "attempt"),
    (7, ["t", 1, "stalled", 1.0], "attempt"),
    (1, hello_wire(op_bound=0.0), "op_bound"),
    (1, hello_wire(max_transit=0.0), "max_transit"),
    (1, hello_wire(max_transit=-1.0), "max_transit"),
    (1, hello_wire(max_transit=math.nan), "max_transit"),
    (1, hello_wire(max_transit=2), "max_transit"),  # seconds travel as floats
    (1, hello_wire(tp=0), "tp"),
    (1, hello_wire(mla=0), "mla"),  # an int is not a bool
    (1, hello_wire(fingerprint=[["a", "b", "c"]]), "fingerprint"),
    (1, hello_wire(fingerprint=[["a", "b"], ["a", "c"]]), "fingerprint"),
    (1, hello_wire(modes=[]), "modes"),
    (1, hello_wire(modes=["push", "push"]), "modes"),
    (1, hello_wire(role="decoder"), "role"),
    (1, hello_wire(instance=-1), "instance"),
    (1, hello_wire(version=1 << 16), "version"),
    # The ranks field: an array of bins (any bytes) and nothing else.
    (1, hello_wire(ranks=None), "ranks"),
    (1, hello_wire(ranks=b""), "ranks"),  # a bin, not an array of them
    (1, hello_wire(ranks=0), "ranks"),
    (1, hello_wire(ranks=[""]), "ranks"),  # a str, not a bin
    (1, hello_wire(ranks=[b"a", "b"]), "ranks"),
    (1, hello_wire(ranks=[0]), "ranks"),
    (1, hello_wire(ranks=[None]), "ranks"),
    (1, hello_wire(ranks=[True]), "ranks"),
    (1, hello_wire(ranks=[1.0]), "ranks"),
    (1, hello_wire(ranks=[[]]), "ranks"),
    (1, hello_wire(ranks=[[b"a"]]), "ranks"),
    (1, hello_wire(ranks=[b"a", [b"b"]]), "ranks"),
    (1, hello_wire(ranks=[bytes(1 << 20), b"\x00"]), "ranks"),  # 1 MiB + 1 in all
    (1, hello_wire(ranks=[bytes(1 << 19), bytes(1 << 19), b"x"]), "ranks"),  # ... over 3 blobs
    # The layout field: not a bin, or a bin that is not one msgpack document.
    (1, hello_wire(None), "layout"),
    (1, hello_wire(""), "layout"),  # a str, not a bin
    (1, hello_wire(0), "layout"),
    (1, hello_wire([]), "layout"),
    (1, hello_wire(b"\xc1"), "layout"),  # never-used msgpack byte
    (1, hello_wire(b"\x82\xa7version\x01"), "layout"),  # truncated map
    (1, hello_wire(packed(LAYOUT.to_wire())[:-1]), "layout"),  # truncated
    (1, hello_wire(packed(LAYOUT.to_wire()) + b"\x00"), "layout"),  # trailing data
    (1, hello_wire(packed(LAYOUT.to_wire()) * 2), "layout"),  # two documents
    # ... (documents beyond the inner unpacker's limits: test_layout_document_limits)
    # ... or a document KVLayout.from_wire refuses.
    (1, hello_wire(packed(1)), "layout"),
    (1, hello_wire(packed([LAYOUT.to_wire()])), "layout"),
    (1, hello_wire(packed({})), "layout"),
    (1, hello_wire(packed(layout_doc(version=2))), "layout"),
    (1, hello_wire(packed(layout_doc(version=True))), "layout"),
    (1, hello_wire(packed(layout_doc(version=None))), "layout"),  # missing key
    (1, hello_wire(packed(layout_doc(extra=1))), "layout"),  # unknown key
    (1, hello_wire(packed(layout_doc(regions=[]))), "layout"),
    (1, hello_wire(packed(layout_doc(regions={}))), "layout"),
    (1, hello_wire(packed(layout_doc(regions=[0]))), "layout"),
    (1, hello_wire(packed(region_doc(base=None))), "layout"),  # missing key
    (1, hello_wire(packed(region_doc(extra=0))), "layout"),  # unknown key
    (1, hello_wire(packed(region_doc(layer=True))), "layout"),
    (1, hello_wire(packed(region_doc(layer=-1))), "layout"),
    (1, hello_wire(packed(region_doc(base=1.0))), "layout"),
    (1, hello_wire(packed(region_doc(base=1 << 63))), "layout"),
    (1, hello_wire(packed(region_doc(base=(1 << 63) - 1))), "layout"),  # ends past 2**63
    (1, hello_wire(packed(region_doc(block_len=4095))), "layout"),  # != tokens*heads*bytes
    (1, hello_wire(packed(region_doc(block_stride=4095))), "layout"),  # < block_len
    (1, hello_wire(packed(region_doc(kind="K V"))), "layout"),
    (1, hello_wire(packed(region_doc(kind=7))), "layout"),
    (1, hello_wire(packed(region_doc(order="nhd"))), "layout"),
    (1, hello_wire(packed(region_doc(memory="HBM"))), "layout"),
    (1, hello_wire(packed(region_doc(group=2))), "layout"),  # groups 0, 2: not 0..n-1
    (1, hello_wire(packed(region_doc(num_blocks=5))), "layout"),  # differs within group 0
    (1, hello_wire(packed(region_doc(1, kind="K"))), "layout"),  # duplicate layer0.K
    (8, ["t", 1, [0, -1], 0, ""], "source"),  # negative rank
    (8, ["t", 1, [1024, 0], 0, ""], "source"),
    (8, ["t", 1, [0], 0, ""], "source"),
    (8, ["t", 1, [0, 0], 1024, ""], "consumer_rank"),
    (8, ["t", 1, [0, 0], 0, 1], "detail"),
    (10, ["t", 1, 1], "ok"),
    (12, ["t", -1], "epoch"),
    (12, ["", 0], "transfer_id"),
    (13, ["t", 1, -1, 1.0], "attempt"),
    (13, ["t", 1, 256, 1.0], "attempt"),
    (13, ["t", 1, True, 1.0], "attempt"),
    (13, ["t", 1, 0, 1], "lease"),  # seconds travel as floats
    (13, ["t", 1, 0, -1.0], "lease"),
    (13, ["t", 1, 0, math.nan], "lease"),
    (13, ["t", 1, 0, math.inf], "lease"),
    (11, [-1], "seq"),
    (11, [-(1 << 63)], "seq"),
    (7, ["t", 1, "no_such_reason", 0], "reason"),
]


@pytest.mark.parametrize(
    ("doc", "reason"),
    [
        (packed(region_doc(kind="k" * 65)), "malformed"),  # str over 64 bytes
        (packed(region_doc(kind=b"K")), "malformed"),  # a bin inside
        (packed(region_doc(kind=msgpack.ExtType(1, b"K"))), "malformed"),
        (packed({str(i): i for i in range(33)}), "malformed"),  # a map of 33
        (packed({1: 1}), "malformed"),  # a non-str map key
        (b"\xdd\xff\xff\xff\xff", "malformed"),  # array32 claiming 4G entries
        (b"\xdf\xff\xff\xff\xff", "malformed"),  # map32 claiming 4G entries
        (b"\xdc\x20\x01" + b"\x00" * 8193, "malformed"),  # an array of 8193
        (packed(region_doc(layer=[1])), "too many arrays"),  # a valid layout has one
        (b"\xdc\x20\x00" + b"\x90" * 8192, "too many arrays"),  # 8193 arrays
        (b"\x91" * 5000 + b"\x80", "malformed"),  # deeper than msgpack's stack
        # 2 * 4097 + 1 maps; a valid layout has at most MAX_REGIONS + 1.
        (packed({"version": 1, "regions": [{"a": {}}] * (MAX_REGIONS // 2 + 1)}), "too many maps"),
        (b"\x81\xa1a" * 5000 + b"\x80", "malformed|too many maps"),  # deep maps
    ],
)
def test_layout_document_limits(doc: bytes, reason: str) -> None:
    fields = hello_wire(doc)
    assert len(fields) == len(SCHEMAS[Hello])
    with pytest.raises(RemoteProtocolError, match=f"^Hello\\.layout: .*({reason})"):
        PLAIN.decode(frame(1, fields))


def test_a_layout_of_max_regions_round_trips_given_room() -> None:
    """The inner limits (one array, MAX_REGIONS + 1 maps, MAX_REGIONS entries)
    admit the largest valid layout (about 1.2 MB here, over the default
    max_layout_bytes of 1 MiB, hence the roomier limits)."""
    regions = layer_regions(
        range(MAX_REGIONS // 2), num_blocks=1, tokens_per_block=1, num_heads=1, head_bytes=1
    )
    layout = KVLayout(regions)
    assert len(layout.regions) == MAX_REGIONS
    size = len(packed(layout.to_wire()))
    roomy = Codec(limits=CodecLimits(max_layout_bytes=size, max_frame_bytes=2 * size))
    hello = bad(HELLO, layout=layout)
    assert roomy.decode(roomy.encode(hello)) == hello


@pytest.mark.parametrize(("code", "fields", "field"), DECODE_CASES)
def test_decode_validates_fields(code: int, fields: list[Any], field: str) -> None:
    cls = CLASS_OF[code]
    names = [name for name, _ in SCHEMAS[cls]]
    # The body has the right arity, so decoding gets to the fields at all ...
    assert len(fields) == len(names) == len(VALID_WIRE[cls])
    # ... and with only the named field made valid again, it decodes: so the
    # case fails for that field and no other.
    at = names.index(field)
    assert PLAIN.decode(frame(code, [*fields[:at], VALID_WIRE[cls][at], *fields[at + 1 :]]))
    expect = re.escape(f"{cls.__name__}.{field}:")
    with pytest.raises(RemoteProtocolError, match=expect):
        PLAIN.decode(frame(code, fields))
    with pytest.raises(RemoteProtocolError, match=expect):
        SIGNED.decode(sign(frame(code, fields)))


def test_valid_wire_bodies_decode() -> None:
    assert set(VALID_WIRE) == set(MESSAGE_TYPES)
    for cls, fields in VALID_WIRE.items():
        assert len(fields) == len(SCHEMAS[cls])
        msg = PLAIN.decode(frame(TYPE_CODES[cls], fields))
        assert type(msg) is cls
        assert body_of(PLAIN, PLAIN.encode(msg)) == fields
    assert PLAIN.decode(frame(1, hello_wire(packed(LAYOUT.to_wire())))) == bad(
        HELLO, op_bound=1.0, kv_groups=1, modes=(Mode.PUSH,), layout=LAYOUT
    )
    ranks = [b"", b"\x00", b"\xc4\x00", bytes(300)]  # opaque: any bytes, even msgpack
    assert PLAIN.decode(frame(1, hello_wire(ranks=ranks))) == bad(
        HELLO, op_bound=1.0, kv_groups=1, modes=(Mode.PUSH,), ranks=tuple(ranks)
    )


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_decode_checks_the_field_count(cls: type[Any]) -> None:
    n = len(SCHEMAS[cls])
    valid = VALID_WIRE[cls]
    for fields in (valid[:-1], [*valid, 0], [*valid, b""], []):
        with pytest.raises(RemoteProtocolError, match=f"expected {n} fields"):
            PLAIN.decode(frame(TYPE_CODES[cls], fields))
    for body in ({"t": 1}, "t", 1, None):
        with pytest.raises(RemoteProtocolError, match=r"malformed|fields"):
            PLAIN.decode(frame(TYPE_CODES[cls], body))


def test_bodies_of_older_formats_are_refused() -> None:
    # A peer that predates Hello.max_transit sends 14 Hello fields (the
    # fingerprint after op_bound), one that predates Hello.ranks 13 (the layout
    # last), one that predates Hello.layout / Register.skip_tokens 12 and 6,
    # one that predates Register.attempt / Rejected.attempt 7 and 3: refused
    # for the count, never misread (a layout bin taken for the ranks, the
    # fingerprint for max_transit).
    assert RANKS_AT == len(HELLO_FIELDS) - 1 == 14
    at = HELLO_FIELDS.index("max_transit")
    before_transit = VALID_WIRE[Hello][:at] + VALID_WIRE[Hello][at + 1 :]
    assert before_transit == ["e", 1, "producer", 1, 1, 8, False, 1, 1.0, [], ["push"], 3, b"", []]
    before_ranks = before_transit[:-1]
    old_hellos = [
        before_transit,
        before_ranks,
        [*before_ranks[:-1], packed(LAYOUT.to_wire())],  # with a layout
        before_ranks[:-1],  # before layout too
    ]
    old_registers = [
        ["t", 1, "c", [b""], 1.0, "push"],
        ["t", 1, "c", [b""], 1.0, "push", 0],
        ["t", 1, "c", [b""], 1.0, "push", 0, 0],  # before the staging slot
    ]
    for old_hello in old_hellos:
        for codec, data in ((PLAIN, frame(1, old_hello)), (SIGNED, sign(frame(1, old_hello)))):
            with pytest.raises(RemoteProtocolError, match=r"^Hello: expected 15 fields$"):
                codec.decode(data)
    for old_register in old_registers:
        with pytest.raises(RemoteProtocolError, match="Register: expected 9 fields"):
            PLAIN.decode(frame(3, old_register))
    with pytest.raises(RemoteProtocolError, match="Rejected: expected 4 fields"):
        PLAIN.decode(frame(7, ["t", 1, "released"]))


def test_decode_respects_configured_limits() -> None:
    lim = CodecLimits(
        max_block_ids=4, max_kv_groups=2, max_ranks=4, max_id_len=8, max_ranks_bytes=8
    )
    small = Codec(limits=lim)
    assert small.decode(frame(4, ["12345678", 1])) == Withdraw("12345678", 1)
    for code, fields, field in [
        (4, ["123456789", 1], "Withdraw.transfer_id"),
        (3, ["t", 1, "c", [bytes(range(20))], 1.0, "push", 0, 0, []], "Register.blocks"),  # 5 ids
        (
            3,
            ["t", 1, "c", [b"\x00\x00\x00\x00", b"\x01\x00\x00\x00", b""], 1.0, "push", 0, 0, []],
            "Register.blocks",
        ),
        (8, ["t", 1, [4, 0], 0, ""], "WriteFailed.source"),
        (1, hello_wire(tp=5), "Hello.tp"),
        (1, hello_wire(ranks=[b""] * 5), "Hello.ranks"),  # 5 blobs, max_ranks 4
        (1, hello_wire(ranks=[b"1234", b"56789"]), "Hello.ranks"),  # 9 bytes in all
        (1, hello_wire(ranks=[b"123456789"]), "Hello.ranks"),
    ]:
        assert len(fields) == len(SCHEMAS[CLASS_OF[code]])
        assert PLAIN.decode(frame(code, fields))  # only the small limits refuse it
        with pytest.raises(RemoteProtocolError, match=re.escape(field + ":")):
            small.decode(frame(code, fields))


def test_values_over_the_unpacker_limits_are_refused_as_malformed() -> None:
    # The outer unpacker's str and bin limits equal the largest valid field, and
    # its array limit the longest valid array (max_ranks rank blobs), so one
    # byte or entry more is refused before the fields are looked at.
    lim = CodecLimits()
    for code, fields in [
        (8, ["t", 1, [0, 0], 0, "x" * (lim.max_detail_len + 1)]),
        (3, ["t", 1, "c", [bytes(4 * lim.max_block_ids + 4)], 1.0, "push", 0, 0, []]),
        (1, hello_wire(bytes(lim.max_layout_bytes + 1))),
        (1, hello_wire(ranks=[bytes(lim.max_ranks_bytes + 1)])),
        (1, hello_wire(ranks=[b""] * (lim.max_ranks + 1))),
        (1, hello_wire(fingerprint=[0] * (lim.max_ranks + 1))),  # any array
    ]:
        assert len(fields) == len(SCHEMAS[CLASS_OF[code]])
        with pytest.raises(RemoteProtocolError, match="malformed body"):
            PLAIN.decode(frame(code, fields))


def test_layout_bombs_allocate_little() -> None:
    """A 1 MiB layout of nested empty arrays would build ~1M lists (~64 MiB);
    one of maps builds at most MAX_REGIONS + 1 dicts before it is refused."""
    inner = b"\xdc\x20\x00" + b"\x90" * 8192  # an array of 8192 empty arrays
    n = (1 << 20) // len(inner) - 1
    arrays = b"\xdc" + n.to_bytes(2, "big") + inner * n
    entry = b"\xde\x00\x20" + b"".join(b"\xa3" + b"k%02d" % i + b"\xc0" for i in range(32))
    n = (1 << 20) // len(entry) - 1
    maps = b"\xdc" + n.to_bytes(2, "big") + entry * n
    for doc, error in ((arrays, "too many arrays"), (maps, "too many maps|must be a dict")):
        data = frame(1, hello_wire(doc))
        tracemalloc.start()
        try:
            with pytest.raises(RemoteProtocolError, match=f"Hello.layout: .*({error})"):
                PLAIN.decode(data)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 8 * len(data)


def hello_frame_with_ranks(ranks: bytes) -> bytes:
    """A plain Hello frame of VALID_WIRE's fields with ``ranks`` (raw msgpack,
    which may claim more than it holds) as the ranks field."""
    assert len(HELLO_FIELDS) - 1 == RANKS_AT  # the ranks come last
    head = packed(VALID_WIRE[Hello])[:-1]  # fixarray of 14, ..., without the empty ranks
    assert head[0] == 0x90 + len(HELLO_FIELDS)
    return b"KVP\x01\x01\x00" + head + ranks


def test_rank_bombs_allocate_little() -> None:
    """Rank blobs are bounded in count (the unpacker's array limit, then
    max_ranks) and in total (max_bin_len each, then max_ranks_bytes in all):
    frames claiming huge bins or arrays, holding arrays where bins belong, or
    blobs over the total are refused having allocated about their own size."""
    lim = CodecLimits()
    n = lim.max_ranks
    malformed = r"^Hello: malformed body"
    over = rf"^Hello\.ranks: rank descriptions exceed {lim.max_ranks_bytes} bytes in all$"
    too_many = r"^Hello: malformed body: too many arrays$"
    array16 = b"\xdc" + n.to_bytes(2, "big")  # an array of n entries
    cases = [
        # max_ranks bin32 headers each claiming 4 GiB: refused at the first.
        (array16 + b"\xc6\xff\xff\xff\xff" * n, malformed),
        # An array32 claiming 4G entries, then 1 MiB of empty bins.
        (b"\xdd\xff\xff\xff\xff" + b"\xc4\x00" * (1 << 19), malformed),
        # max_ranks nested arrays of max_ranks empty arrays (~1M lists in 1 MiB).
        (array16 + (array16 + b"\x90" * n) * n, too_many),
        # max_ranks blobs of 1025 bytes: each small, in all over 1 MiB.
        (packed([bytes(lim.max_ranks_bytes // n + 1)] * n), over),
        # Three blobs of the largest bin (1 MiB each) in a 3 MiB frame.
        (packed([bytes(lim.max_ranks_bytes)] * 3), over),
        # A blob over the largest bin, claimed but absent, and present.
        (b"\x91\xc6" + (lim.max_ranks_bytes + 1).to_bytes(4, "big"), malformed),
        (packed([bytes(lim.max_ranks_bytes + 1)]), malformed),
    ]
    for ranks, error in cases:
        data = hello_frame_with_ranks(ranks)
        assert len(data) <= lim.max_frame_bytes
        tracemalloc.start()
        try:
            with pytest.raises(RemoteProtocolError, match=error):
                PLAIN.decode(data)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # Refused early: a few KiB. Refused for the total: the blobs themselves
        # (msgpack copies each bin into a bytes), never a multiple of the frame.
        assert peak < (1 << 16) + len(data) + len(data) // 8


@pytest.mark.parametrize(
    "data",
    [
        b"KVN\x01\x00" + (1 << 63).to_bytes(8, "little") + b"\x00" * 6 + b"t",
        b"KVN\x01\x00" + b"\x00" * 8 + b"\x00\x04\x00\x00\x00\x00t",  # tp 1024
        b"KVN\x01\x00" + b"\x00" * 8 + b"\x00\x00\x00\x00\xff\xfft",  # rank 65535
        b"KVN\x01\x00" + b"\x00" * 14,  # empty transfer id
        b"KVN\x01\x00" + b"\x00" * 14 + b"\xff",  # not UTF-8
        b"KVN\x01\x00" + b"\x00" * 14 + b"x" * 257,
        b"KVN\x01\x00" + b"\x00" * 13,  # short
    ],
)
def test_decode_notice_validates(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        PLAIN.decode_notice(data)
    with pytest.raises(RemoteProtocolError):
        SIGNED.decode_notice(sign(data, 16))


# --- properties over hostile input ---------------------------------------------

headers = st.sampled_from(
    [b""]
    + [b"KVP\x01" + bytes((code, flags)) for code in range(13) for flags in (0, 1)]
    + [b"KVN\x01\x00", b"KVN\x01\x01"]
)


@given(data=st.tuples(headers, st.binary(max_size=300)).map(b"".join))
def test_any_bytes_decode_or_raise_remote_error(data: bytes) -> None:
    for codec in CODECS:
        check_decode(codec, data)
        check_decode(codec, sign(data) if len(data) >= 6 else data)
        check_decode_notice(codec, data)
        check_decode_notice(codec, sign(data, 16) if len(data) >= 5 else data)


@given(
    header=st.sampled_from([b"KVP\x01" + bytes((code, 0)) for code in range(1, 12)]),
    body=wire_values | st.lists(wire_values, min_size=1, max_size=12),
)
def test_any_msgpack_body_decodes_or_raises_remote_error(header: bytes, body: Any) -> None:
    data = header + msgpack.packb(body, use_bin_type=True)
    check_decode(PLAIN, data)
    check_decode(SIGNED, sign(data))


@st.composite
def mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with one to three random edits."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "set", "truncate", "extend", "insert", "delete"]))
        pos = draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[pos] = draw(st.integers(0, 255))
        elif op == "truncate":
            del buf[pos:]
        elif op == "extend":
            buf += draw(st.binary(min_size=1, max_size=16))
        elif op == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del buf[pos : pos + draw(st.integers(1, 4))]
    return bytes(buf)


@given(msg=messages, data=st.data())
def test_mutated_frames_decode_or_raise_remote_error(msg: ControlMessage, data: Any) -> None:
    plain = data.draw(mutations(PLAIN.encode(msg)))
    check_decode(PLAIN, plain)
    check_decode(SIGNED, plain)
    # Re-signed after the edit, so the mutation gets past the MAC.
    check_decode(SIGNED, sign(plain) if len(plain) >= 6 else plain)
    signed = data.draw(mutations(SIGNED.encode(msg)))
    if signed != SIGNED.encode(msg):
        with pytest.raises(RemoteProtocolError):
            SIGNED.decode(signed)


@given(msg=messages, data=st.data())
def test_type_swapped_fields_decode_or_raise_remote_error(msg: ControlMessage, data: Any) -> None:
    body = body_of(PLAIN, PLAIN.encode(msg))
    i = data.draw(st.integers(0, len(body) - 1))
    if isinstance(body[i], list) and body[i] and data.draw(st.booleans()):
        j = data.draw(st.integers(0, len(body[i]) - 1))
        body[i][j] = data.draw(wire_values)
    else:
        body[i] = data.draw(wire_values)
    swapped = PLAIN.encode(msg)[:6] + msgpack.packb(body, use_bin_type=True)
    check_decode(PLAIN, swapped)
    check_decode(SIGNED, sign(swapped))


@given(layout=layouts(), ranks=rank_blobs, data=st.data())
def test_mutated_layouts_decode_or_raise_remote_error(
    layout: KVLayout, ranks: tuple[bytes, ...], data: Any
) -> None:
    """Edits inside the layout document, re-wrapped in a well-formed bin, so
    they reach the inner unpacker and KVLayout.from_wire (edits of the whole
    frame mostly break the outer framing first). The ranks after it stay."""
    msg = bad(HELLO, layout=layout, ranks=ranks)
    body = body_of(PLAIN, PLAIN.encode(msg))
    doc = msgpack.unpackb(body[LAYOUT_AT])
    how = data.draw(st.sampled_from(["bytes", "region value", "region key", "top level"]))
    if how == "bytes":
        body[LAYOUT_AT] = data.draw(mutations(body[LAYOUT_AT]))
    else:
        if how == "top level":
            target = doc
        else:
            target = doc["regions"][data.draw(st.integers(0, len(doc["regions"]) - 1))]
        key = data.draw(st.sampled_from(sorted(target)))
        if how == "region key" and data.draw(st.booleans()):
            del target[key]
        elif how == "region key":
            target[data.draw(st.text(max_size=16))] = data.draw(wire_values)
        else:
            target[key] = data.draw(wire_values)
        body[LAYOUT_AT] = packed(doc)
    edited = PLAIN.encode(msg)[:6] + packed(body)
    check_decode(PLAIN, edited)
    check_decode(SIGNED, sign(edited))


@given(notice=completions, data=st.data())
def test_mutated_notices_decode_or_raise_remote_error(notice: Completion, data: Any) -> None:
    plain = data.draw(mutations(PLAIN.encode_notice(notice)))
    check_decode_notice(PLAIN, plain)
    check_decode_notice(SIGNED, sign(plain, 16) if len(plain) >= 5 else plain)
    signed = data.draw(mutations(SIGNED.encode_notice(notice)))
    if signed != SIGNED.encode_notice(notice):
        with pytest.raises(RemoteProtocolError):
            SIGNED.decode_notice(signed)


def test_most_fingerprint_entries_round_trip() -> None:
    lim = CodecLimits()
    fp = tuple((f"k{i}", "v" * 256) for i in range(lim.max_fingerprint_entries))
    hello = Hello("e", 1, Role.CONSUMER, 1, 1, 8, True, 64, 1.0, 1.0, fp)
    assert SIGNED.decode(SIGNED.encode(hello)) == hello
