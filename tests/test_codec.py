"""The wire codec: round trips, the size bounds, and that any byte string decodes
to a valid message or raises RemoteProtocolError (nothing else escapes)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import tracemalloc
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Announce,
    Completion,
    ConfigError,
    ControlMessage,
    Heartbeat,
    Hello,
    HelloReject,
    LocalProtocolError,
    Mode,
    ReadDone,
    Register,
    Rejected,
    RejectReason,
    RemoteProtocolError,
    Role,
    Settled,
    Source,
    Withdraw,
    WriteFailed,
)
from kvpush.protocol import _codec as codec_module
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

messages: st.SearchStrategy[ControlMessage] = st.one_of(
    st.builds(
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
        fingerprints,
        modes,
        st.integers(0, 0xFFFF),
    ),
    st.builds(HelloReject, names, details),
    st.builds(Register, ids, epochs, ids, block_ids, leases, st.sampled_from(Mode)),
    st.builds(Withdraw, ids, epochs),
    st.builds(Abort, ids, epochs),
    st.builds(Settled, ids, epochs),
    st.builds(Rejected, ids, epochs, st.sampled_from(RejectReason)),
    st.builds(WriteFailed, ids, epochs, sources, ranks, details),
    st.builds(Announce, ids, epochs, block_ids, leases),
    st.builds(ReadDone, ids, epochs, st.booleans()),
    st.builds(Heartbeat, u64s),
)
completions = st.builds(Completion, ids, epochs, sources, ranks)

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


def test_golden_bytes() -> None:
    """Pins the wire format: a change here breaks mixed-version deployments."""
    assert PLAIN.encode(Heartbeat(5)) == b"KVP\x01\x0b\x00\x91\x05"
    assert PLAIN.encode(Abort("t", 0)) == b"KVP\x01\x05\x00\x92\xa1t\x00"
    assert PLAIN.encode_notice(Completion("t", 1, Source(2, 3), 4)) == (
        b"KVN\x01\x00" + (1).to_bytes(8, "little") + b"\x02\x00\x03\x00\x04\x00t"
    )
    signed = SIGNED.encode(Heartbeat(5))
    assert signed[:-32] == b"KVP\x01\x0b\x01\x91\x05"
    assert signed[-32:] == hmac.new(SECRET, signed[:-32], hashlib.sha256).digest()


def test_typical_sizes() -> None:
    assert len(PLAIN.encode(REGISTER)) == 297
    assert len(SIGNED.encode(REGISTER)) == 297 + 32
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


def test_core_hello_round_trips() -> None:
    hello = Hello("prefill-0", 12345, Role.PRODUCER, 4, 2, 8, False, 1, 10)  # int op_bound
    decoded = PLAIN.decode(PLAIN.encode(hello))
    assert decoded == hello
    assert isinstance(decoded, Hello)
    assert decoded.version == PROTOCOL_VERSION
    assert type(decoded.op_bound) is float


def test_largest_messages_fit_the_frame_bound() -> None:
    lim = CodecLimits(max_block_ids=1000, max_kv_groups=8, max_fingerprint_entries=5)
    plain, signed = Codec(limits=lim), Codec(limits=lim, secret=SECRET)
    wide = "\U0010ffff" * 64  # 256 UTF-8 bytes
    groups = tuple(tuple(range(g * 125, g * 125 + 125)) for g in range(8))
    biggest: list[ControlMessage] = [
        Register(wide, (1 << 63) - 1, wide, groups, 1e300, Mode.PULL),
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
            tuple((wide[:-i] + "k", wide) for i in range(1, 6)),
            (Mode.PULL, Mode.PUSH),
            0xFFFF,
        ),
        HelloReject(wide, "\U0010ffff" * 1024),
        WriteFailed(wide, (1 << 63) - 1, Source(1023, 1023), 1023, "\U0010ffff" * 1024),
    ]
    for msg in biggest:
        assert len(plain.encode(msg)) < len(signed.encode(msg)) <= lim.largest_frame()
        assert signed.decode(signed.encode(msg)) == msg


def test_default_limits_take_the_most_block_ids() -> None:
    lim = CodecLimits()
    msg = Register("t", 1, "c", (tuple(range(lim.max_block_ids)),), 1.0)
    data = SIGNED.encode(msg)
    assert len(data) <= lim.max_frame_bytes
    assert SIGNED.decode(data) == msg
    over = Register("t", 1, "c", (tuple(range(lim.max_block_ids + 1)),), 1.0)
    with pytest.raises(LocalProtocolError, match="blocks"):
        PLAIN.encode(over)


# --- configuration ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_frame_bytes": 0},
        {"max_frame_bytes": 4096},  # cannot hold 2**18 block ids
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
H = Hello("e", 1, Role.PRODUCER, 1, 1, 8, False, 1, 10.0)


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
        HelloReject("f", "d" * 4097),
        WriteFailed("t", 1, Source(1024, 0), 0),
        WriteFailed("t", 1, Source(0, 0), 1024),
        WriteFailed("t", 1, (0, 0), 0),  # type: ignore[arg-type]
        Rejected("t", 1, "released"),  # type: ignore[arg-type]
        ReadDone("t", 1, None),  # type: ignore[arg-type]
        Heartbeat(-1),
        NOTICE,  # a notice is not a control message
        "not a message",
    ],
)
def test_encode_invalid_raises_local_error(msg: Any) -> None:
    with pytest.raises(LocalProtocolError):
        PLAIN.encode(msg)


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
    data = frame(3, ["t", 1, "c", [b"\x00" * 4 * lim.max_block_ids], 1.0, "push"])
    data += b"\x00" * (lim.max_frame_bytes - len(data) + 1)
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        PLAIN.decode(data)
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


@pytest.mark.parametrize("code", [0, 12, 99, 255])
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


@pytest.mark.parametrize(
    ("code", "fields"),
    [
        (3, ["t", True, "c", [b""], 1.0, "push"]),  # bool is not an int
        (3, ["t", -1, "c", [b""], 1.0, "push"]),
        (3, ["t", 1 << 63, "c", [b""], 1.0, "push"]),
        (3, ["t", 1, "c", [b""], 1, "push"]),  # seconds travel as floats
        (3, ["t", 1, "c", [b""], math.nan, "push"]),
        (3, ["t", 1, "c", [b""], math.inf, "push"]),
        (3, ["t", 1, "c", [b""], -1.0, "push"]),
        (3, ["t", 1, "c", [b""], 1.0, "PUSH"]),
        (3, ["t", 1, "c", [b"\x00\x00\x00"], 1.0, "push"]),  # not whole uint32s
        (3, ["t", 1, "c", [b"\x01\x00\x00\x00" * 2], 1.0, "push"]),  # duplicate id
        (3, ["t", 1, "c", [], 1.0, "push"]),
        (3, ["t", 1, "c", [[1, 2]], 1.0, "push"]),  # ids as ints, not bin
        (3, ["t", 1, "c", b"", 1.0, "push"]),
        (3, ["", 1, "c", [b""], 1.0, "push"]),
        (3, ["x" * 257, 1, "c", [b""], 1.0, "push"]),
        (3, [b"t", 1, "c", [b""], 1.0, "push"]),
        (3, ["t", 1, "c", [b""], 1.0]),  # a field short
        (3, ["t", 1, "c", [b""], 1.0, "push", 0]),  # a field long
        (3, {"t": 1}),
        (3, "t"),
        (1, ["e", 1, "producer", 1, 1, 8, False, 1, 0.0, [], ["push"], 1]),  # op_bound 0
        (1, ["e", 1, "producer", 0, 1, 8, False, 1, 1.0, [], ["push"], 1]),
        (1, ["e", 1, "producer", 1, 1, 8, 0, 1, 1.0, [], ["push"], 1]),  # mla int
        (1, ["e", 1, "producer", 1, 1, 8, False, 1, 1.0, [["a", "b", "c"]], ["push"], 1]),
        (1, ["e", 1, "producer", 1, 1, 8, False, 1, 1.0, [["a", "b"], ["a", "c"]], ["push"], 1]),
        (1, ["e", 1, "producer", 1, 1, 8, False, 1, 1.0, [], [], 1]),
        (1, ["e", 1, "producer", 1, 1, 8, False, 1, 1.0, [], ["push", "push"], 1]),
        (1, ["e", 1, "decoder", 1, 1, 8, False, 1, 1.0, [], ["push"], 1]),
        (1, ["e", -1, "producer", 1, 1, 8, False, 1, 1.0, [], ["push"], 1]),
        (8, ["t", 1, [0, -1], 0, ""]),  # negative rank
        (8, ["t", 1, [1024, 0], 0, ""]),
        (8, ["t", 1, [0], 0, ""]),
        (8, ["t", 1, [0, 0], 0, "x" * 4097]),
        (10, ["t", 1, 1]),
        (11, [-1]),
        (11, [-(1 << 63)]),
        (7, ["t", 1, "no_such_reason"]),
    ],
)
def test_decode_validates_fields(code: int, fields: Any) -> None:
    with pytest.raises(RemoteProtocolError):
        PLAIN.decode(frame(code, fields))
    with pytest.raises(RemoteProtocolError):
        SIGNED.decode(sign(frame(code, fields)))


def test_decode_respects_configured_limits() -> None:
    lim = CodecLimits(max_block_ids=4, max_kv_groups=2, max_ranks=4, max_id_len=8)
    small = Codec(limits=lim)
    assert small.decode(frame(4, ["12345678", 1])) == Withdraw("12345678", 1)
    for code, fields in [
        (4, ["123456789", 1]),
        (3, ["t", 1, "c", [b"\x00" * 20], 1.0, "push"]),
        (3, ["t", 1, "c", [b"\x00\x00\x00\x00", b"\x01\x00\x00\x00", b""], 1.0, "push"]),
        (8, ["t", 1, [4, 0], 0, ""]),
    ]:
        with pytest.raises(RemoteProtocolError):
            small.decode(frame(code, fields))


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
    hello = Hello("e", 1, Role.CONSUMER, 1, 1, 8, True, 64, 1.0, fp)
    assert SIGNED.decode(SIGNED.encode(hello)) == hello
