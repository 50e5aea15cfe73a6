"""Fuzz the wire codec and time it.

Feeds ``--n`` inputs (seeded; random bytes, frames with a valid header and a
random body, and valid frames and notices after random edits: bit flips, byte
sets, truncation, extension, insertion, deletion, splicing, header edits and
msgpack field type swaps) to ``Codec.decode`` / ``Codec.decode_notice``, with and
without a secret; half the edited frames for the signed codec are re-signed so
the edit gets past the MAC. The seed corpus holds every message type, half the
Hellos with a KV layout (a few regions: vLLM-style split, interleaved or MLA
tensors, or hand-built regions; both head orders, DRAM and VRAM), half with
per-rank blobs (``Hello.ranks``: 1 to 300 of random bytes, a few up to 64 KiB)
and Registers with random ``skip_tokens``; some inputs edit a Hello's layout
document itself (its bytes, or one value or key of it) and re-wrap it in a
well-formed bin, so the edit reaches the nested unpacker and
``KVLayout.from_wire``; others edit a Hello's ranks array (an entry swapped for
any value, entries added, the array repeated past ``max_ranks``, blobs past
``max_ranks_bytes`` in all, which are rare as they are big). Every input
must decode to a message that round-trips or raise ``RemoteProtocolError``;
anything else is counted in ``other_exceptions`` (must be 0) and the first few
are printed to stderr.

Prints one JSON object: the fuzz counts (``layout_edits`` and ``ranks_edits``:
how many inputs were such edits) plus sizes and encode/decode times of a
Register with 64 block ids, of a Hello with a 64-region layout, of a Hello with
8 rank blobs of 300 bytes and of a Completion notice.

    python benchmarks/fuzz_codec.py --n 1000000 [--seed 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import hmac
import json
import random
import sys
import time
import timeit
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack

from kvpush.protocol import (
    Abort,
    Announce,
    Completion,
    HeadOrder,
    Heartbeat,
    Hello,
    HelloReject,
    KVLayout,
    MemoryType,
    Mode,
    ReadDone,
    Region,
    Register,
    Rejected,
    RejectReason,
    RemoteProtocolError,
    Role,
    Settled,
    Source,
    Withdraw,
    WriteFailed,
    layer_regions,
)
from kvpush.protocol._codec import Codec

SECRET = b"fuzz-secret-0123456789abcdef"
PLAIN = Codec()
SIGNED = Codec(secret=SECRET)
#: Counts of what the corpus and the inputs held (reported in the JSON).
STATS: Counter[str] = Counter()
_HELLO_FIELDS = [f.name for f in dataclasses.fields(Hello)]
#: Where a Hello's layout and ranks sit in its wire body (the ranks come last).
_LAYOUT_AT = _HELLO_FIELDS.index("layout")
_RANKS_AT = _HELLO_FIELDS.index("ranks")

# Code point ranges without surrogates: ASCII, 2-, 3- and 4-byte UTF-8.
_RANGES = ((0x20, 0x7E), (0x80, 0x7FF), (0x800, 0xD7FF), (0x10000, 0x10FFFF))


def text(rng: random.Random, lo: int, hi: int) -> str:
    n = rng.randint(lo, hi)
    out = []
    for _ in range(n):
        a, b = _RANGES[0] if rng.random() < 0.8 else rng.choice(_RANGES)
        out.append(chr(rng.randint(a, b)))
    return "".join(out)


def edge_int(rng: random.Random, lo: int, hi: int) -> int:
    r = rng.random()
    if r < 0.2:
        return lo
    if r < 0.4:
        return hi
    if r < 0.7:
        return rng.randint(lo, min(hi, lo + 300))
    return rng.randint(lo, hi)


def seconds(rng: random.Random, positive: bool) -> float:
    choices = [1e-300, 0.001, 1.0, 30.0, 1e300, rng.random() * 100]
    if not positive:
        choices.append(0.0)
    return rng.choice(choices)


def blocks(rng: random.Random) -> tuple[tuple[int, ...], ...]:
    groups = []
    for _ in range(rng.choice([1, 1, 1, 2, 3, 8])):
        n = rng.choice([0, 1, 4, 16, 64, 200])
        hi = rng.choice([255, 1 << 16, (1 << 32) - 1])
        groups.append(tuple(rng.sample(range(hi + 1), n) if hi >= n else range(n)))
    return tuple(groups)


_KIND_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-"


def random_layout(rng: random.Random) -> KVLayout:
    """A valid layout of a few regions in 1-3 KV groups, in a random order."""
    regions: list[Region] = []
    layer = edge_int(rng, 0, (1 << 20) - 12)
    for group in range(rng.choice([1, 1, 1, 2, 3])):
        num_blocks = edge_int(rng, 1, 1 << 16)
        tokens = rng.choice([1, 16, 16, 32, 64, rng.randint(1, 1 << 16)])
        heads = rng.choice([1, 2, 8, rng.randint(1, 64)])
        head_bytes = rng.choice([2, 128, 256, 1152, rng.randint(1, 4096)])
        order = rng.choice(list(HeadOrder))
        memory = rng.choice(list(MemoryType))
        device = edge_int(rng, 0, (1 << 31) - 1)
        if rng.random() < 0.6:
            n = rng.randint(1, 3)
            regions += layer_regions(
                [rng.randrange(1 << 48) for _ in range(n)],
                num_blocks=num_blocks,
                tokens_per_block=tokens,
                num_heads=heads,
                head_bytes=head_bytes,
                head_start=rng.choice([0, heads, rng.randrange(1 << 10)]),
                packing=rng.choice(["split", "interleaved", "mla"]),
                order=order,
                memory=memory,
                device=device,
                group=group,
                first_layer=layer,
            )
            layer += n
            continue
        block_len = tokens * heads * head_bytes
        kinds = {"".join(rng.choices(_KIND_CHARS, k=rng.randint(1, 32))) for _ in range(3)}
        for kind in sorted(kinds)[: rng.randint(1, 3)]:
            stride = block_len + rng.choice([0, 0, 64, block_len])
            extent = (num_blocks - 1) * stride + block_len
            regions.append(
                Region(
                    layer=layer,
                    kind=kind,
                    base=edge_int(rng, 0, (1 << 63) - extent),
                    num_blocks=num_blocks,
                    block_len=block_len,
                    block_stride=stride,
                    tokens_per_block=tokens,
                    num_heads=heads,
                    head_bytes=head_bytes,
                    head_start=edge_int(rng, 0, (1 << 16) - 1),
                    order=order,
                    memory=memory,
                    device=device,
                    group=group,
                )
            )
        layer += 1
    rng.shuffle(regions)
    return KVLayout(tuple(regions))


def random_ranks(rng: random.Random) -> tuple[bytes, ...]:
    """Per-rank blobs: often none, else 1-300 of 0-600 bytes, rarely one of 64 KiB+."""
    if rng.random() < 0.5:
        return ()
    n = rng.choice([1, 1, 2, 4, 8, 8, 16, 64, 300])
    blobs = [rng.randbytes(rng.choice([0, 1, 16, 64, 255, 256, 600])) for _ in range(n)]
    if rng.random() < 0.02:
        blobs[0] = rng.randbytes(rng.choice([65535, 65536, 100_000]))
    return tuple(blobs)


def random_message(rng: random.Random) -> Any:
    tid = text(rng, 1, 64)
    epoch = edge_int(rng, 0, (1 << 63) - 1)
    kind = rng.randrange(11)
    if kind == 0:
        fp = {text(rng, 0, 12): text(rng, 0, 24) for _ in range(rng.randint(0, 6))}
        modes = rng.choice(
            [(Mode.PUSH,), (Mode.PULL,), (Mode.PUSH, Mode.PULL), (Mode.PULL, Mode.PUSH)]
        )
        return Hello(
            text(rng, 1, 32),
            edge_int(rng, 0, (1 << 64) - 1),
            rng.choice(list(Role)),
            edge_int(rng, 1, 1024),
            edge_int(rng, 1, 1024),
            edge_int(rng, 1, 1 << 16),
            rng.random() < 0.5,
            edge_int(rng, 1, 64),
            seconds(rng, True),
            seconds(rng, True),
            tuple(fp.items()),
            modes,
            edge_int(rng, 0, 0xFFFF),
            random_layout(rng) if rng.random() < 0.5 else None,
            random_ranks(rng),
        )
    if kind == 1:
        return HelloReject(text(rng, 0, 20), text(rng, 0, 100))
    if kind == 2:
        mode = rng.choice(list(Mode))
        skip = rng.choice([0, 0, 16 * rng.randint(1, 4096), edge_int(rng, 0, (1 << 63) - 1)])
        return Register(tid, epoch, text(rng, 1, 32), blocks(rng), seconds(rng, False), mode, skip)
    if kind in (3, 4, 5):
        return (Withdraw, Abort, Settled)[kind - 3](tid, epoch)
    if kind == 6:
        return Rejected(tid, epoch, rng.choice(list(RejectReason)))
    if kind == 7:
        src = Source(edge_int(rng, 0, 1023), edge_int(rng, 0, 1023))
        return WriteFailed(tid, epoch, src, edge_int(rng, 0, 1023), text(rng, 0, 60))
    if kind == 8:
        return Announce(tid, epoch, blocks(rng), seconds(rng, False))
    if kind == 9:
        return ReadDone(tid, epoch, rng.random() < 0.5)
    return Heartbeat(edge_int(rng, 0, (1 << 64) - 1))


def random_notice(rng: random.Random) -> Completion:
    src = Source(edge_int(rng, 0, 1023), edge_int(rng, 0, 1023))
    return Completion(
        text(rng, 1, 64), edge_int(rng, 0, (1 << 63) - 1), src, edge_int(rng, 0, 1023)
    )


#: The scalars :func:`wire_value` draws from, one maker each.
_SCALARS: tuple[Callable[[random.Random], Any], ...] = (
    lambda rng: None,
    lambda rng: rng.random() < 0.5,
    lambda rng: rng.choice([0, 1, -1, 1023, 1024, 1 << 16, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]),
    lambda rng: rng.randint(-(1 << 63), (1 << 64) - 1),
    lambda rng: rng.choice(
        [0.0, -0.0, -1.0, 1.5, float("nan"), float("inf"), -float("inf"), 1e308]
    ),
    lambda rng: rng.choice(["", "push", "pull", "producer", "consumer", "released", "x" * 257]),
    lambda rng: text(rng, 0, 10),
    lambda rng: rng.randbytes(rng.choice([0, 1, 3, 4, 8, 12])),
    lambda rng: rng.randbytes(4) * 2,  # a duplicate block id
)


def wire_value(rng: random.Random, depth: int = 0) -> Any:
    """Any msgpack value, biased toward the edges the codec checks."""
    r = rng.randrange(12 if depth < 2 else 9)
    if r < len(_SCALARS):
        return _SCALARS[r](rng)
    if r in (9, 10):
        return [wire_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 2, 2, 3, 6]))]
    return {text(rng, 0, 3): wire_value(rng, depth + 1)}


def sign(data: bytes, size: int) -> bytes:
    flag_at = 5 if size == 32 else 4
    if len(data) <= flag_at:
        return data
    data = data[:flag_at] + b"\x01" + data[flag_at + 1 :]
    return data + hmac.new(SECRET, data, hashlib.sha256).digest()[:size]


def type_swap(rng: random.Random, data: bytes, mac: int) -> bytes:
    """Replace one field (or one element of a field) of a frame's msgpack body."""
    body = msgpack.unpackb(data[6 : len(data) - mac])
    i = rng.randrange(len(body))
    if isinstance(body[i], list) and body[i] and rng.random() < 0.5:
        inner = body[i]
        j = rng.randrange(len(inner))
        if isinstance(inner[j], list) and inner[j] and rng.random() < 0.5:
            inner[j][rng.randrange(len(inner[j]))] = wire_value(rng, 2)
        else:
            inner[j] = wire_value(rng, 1)
    elif rng.random() < 0.1:
        del body[i]
    else:
        body[i] = wire_value(rng)
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return data[:6] + packed


_EDGES = (0, 1, -1, 255, 1 << 16, (1 << 16) - 1, 1 << 20, 1 << 31, (1 << 63) - 1, 1 << 63)


def layout_edit(rng: random.Random, data: bytes, docs: list[bytes]) -> bytes:
    """A plain Hello frame whose layout document is edited, still in a well-formed bin."""
    body = msgpack.unpackb(data[6:])
    r = rng.random()
    if r < 0.35:
        doc = mutate(rng, body[_LAYOUT_AT], docs)
    else:
        obj = msgpack.unpackb(body[_LAYOUT_AT])
        regions = obj["regions"]
        target = obj if rng.random() < 0.1 else rng.choice(regions)
        key = rng.choice(sorted(target))
        if r < 0.55:
            target[key] = wire_value(rng)
        elif r < 0.65:
            del target[key]
        elif r < 0.72:
            target[rng.choice([text(rng, 0, 12), "regions", "layer", "Kind"])] = wire_value(rng)
        elif r < 0.8:
            regions.append(dict(rng.choice(regions)))  # a duplicate region
        elif type(target[key]) is int:  # near-valid: an edge or an off-by-one
            target[key] = rng.choice([target[key] - 1, target[key] + 1, rng.choice(_EDGES)])
        else:
            target[key] = rng.choice(["NHD", "HND", "DRAM", "VRAM", "K", "", "x" * 33])
        doc = msgpack.packb(obj)
    body[_LAYOUT_AT] = doc
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return data[:6] + packed


def ranks_edit(rng: random.Random, data: bytes) -> bytes:
    """A plain Hello frame whose ranks array is edited (the rest left valid)."""
    body = msgpack.unpackb(data[6:])
    ranks = body[_RANKS_AT]
    r = rng.random()
    if r < 0.4 and ranks:
        ranks[rng.randrange(len(ranks))] = wire_value(rng)
    elif r < 0.6:
        ranks.insert(rng.randint(0, len(ranks)), wire_value(rng))
    elif r < 0.75:
        ranks.append(rng.randbytes(rng.choice([0, 1, 300])))
    elif r < 0.97:  # past max_ranks (1024) when there are enough to repeat
        body[_RANKS_AT] = (ranks or [b""]) * rng.choice([2, 4, 1024 // max(len(ranks), 1) + 1])
    else:  # about max_ranks_bytes in all: at, just over, or well over it
        size = rng.choice([1 << 19, (1 << 19) + 1, 1 << 20])
        body[_RANKS_AT] = ranks[: rng.randint(0, 2)] + [bytes(size)] * 2
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return data[:6] + packed


def mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        op = rng.randrange(9)
        pos = rng.randrange(len(buf)) if buf else 0
        if op in (0, 1) and buf:
            _poke(rng, buf, pos, op)
        elif op in (2, 3, 4, 5):
            _resize(rng, buf, pos, op)
        elif op == 6:
            other = rng.choice(pool)
            cut = rng.randrange(len(other) + 1)
            buf = buf[:pos] + bytearray(other[cut:])
        elif op == 7 and len(buf) >= 6:
            buf[rng.choice([3, 4, 5])] = rng.choice([0, 1, 2, 3, 11, 12, 255, rng.randrange(256)])
        elif buf:
            buf[pos:pos] = buf[pos : pos + rng.randint(1, 8)]
    return bytes(buf)


def _poke(rng: random.Random, buf: bytearray, pos: int, op: int) -> None:
    """Flip a bit (op 0) or set an edge byte (op 1) at ``pos``."""
    if op == 0:
        buf[pos] ^= 1 << rng.randrange(8)
    else:
        buf[pos] = rng.choice([0, 1, 0x7F, 0x80, 0xC0, 0xC1, 0xFF, rng.randrange(256)])


def _resize(rng: random.Random, buf: bytearray, pos: int, op: int) -> None:
    """Truncate (2), append (3), insert at ``pos`` (4) or cut at ``pos`` (5)."""
    if op == 2:
        del buf[rng.randrange(len(buf) + 1) :]
    elif op == 3:
        buf += rng.randbytes(rng.choice([1, 2, 4, 32]))
    elif op == 4:
        buf[pos:pos] = rng.randbytes(rng.randint(1, 5))
    else:
        del buf[pos : pos + rng.randint(1, 5)]


def make_input(
    rng: random.Random,
    frames: list[tuple[bytes, bytes]],
    notices: list[tuple[bytes, bytes]],
    layouts: tuple[list[bytes], list[bytes]],
    hellos: list[bytes],
) -> tuple[Codec, bool, bytes]:
    """(codec, is-notice, data) for one fuzz input; ``layouts`` holds plain Hello
    frames with a layout and those layouts' documents, ``hellos`` plain Hello frames."""
    notice = rng.random() < 0.25
    signed = rng.random() < 0.5
    codec = SIGNED if signed else PLAIN
    mac = (16 if notice else 32) if signed else 0
    r = rng.random()
    if not notice and r < 0.06:
        STATS["layout_edits"] += 1
        data = layout_edit(rng, rng.choice(layouts[0]), layouts[1])
        return codec, notice, sign(data, mac) if signed else data
    if not notice and r < 0.1:
        STATS["ranks_edits"] += 1
        data = ranks_edit(rng, rng.choice(hellos))
        return codec, notice, sign(data, mac) if signed else data
    r = rng.random()
    if r < 0.08:
        return codec, notice, rng.randbytes(rng.choice([0, 3, 6, 8, 20, 64, 300]))
    if r < 0.16:
        header = b"KVN\x01" if notice else b"KVP\x01" + bytes((rng.randint(0, 12),))
        data = header + bytes((1 if signed else 0,)) + rng.randbytes(rng.randint(0, 80))
        if signed and rng.random() < 0.5:
            data = sign(data, mac)
        return codec, notice, data
    plain, sig = rng.choice(notices if notice else frames)
    data = sig if signed else plain
    if r < 0.2:
        return codec, notice, data  # unedited
    if not notice and r < 0.55:
        data = type_swap(rng, plain, 0)
        resign = signed
    else:
        pool = [p for p, _ in (notices if notice else frames)[:32]]
        data = mutate(rng, data, pool)
        resign = signed and rng.random() < 0.5
        if resign:
            data = data[: len(data) - mac] if len(data) > mac else data
    if resign:
        data = sign(data, mac)
    return codec, notice, data


def fuzz(n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    messages = [random_message(rng) for _ in range(2000)]
    frames = [(PLAIN.encode(m), SIGNED.encode(m)) for m in messages]
    with_layouts = [m for m in messages if type(m) is Hello and m.layout is not None]
    layouts = (
        [PLAIN.encode(m) for m in with_layouts],
        [msgpack.packb(m.layout.to_wire()) for m in with_layouts if m.layout is not None],
    )
    STATS.clear()
    STATS["corpus_hellos_with_layout"] = len(with_layouts)
    STATS["corpus_layout_regions"] = sum(
        len(m.layout.regions) for m in with_layouts if m.layout is not None
    )
    STATS["corpus_registers_with_skip_tokens"] = sum(
        type(m) is Register and m.skip_tokens > 0 for m in messages
    )
    with_ranks = [m for m in messages if type(m) is Hello and m.ranks]
    STATS["corpus_hellos_with_ranks"] = len(with_ranks)
    STATS["corpus_rank_blobs"] = sum(len(m.ranks) for m in with_ranks)
    STATS["corpus_rank_bytes"] = sum(sum(map(len, m.ranks)) for m in with_ranks)
    hellos = [PLAIN.encode(m) for m in messages if type(m) is Hello]
    notices = [
        (PLAIN.encode_notice(c), SIGNED.encode_notice(c))
        for c in (random_notice(rng) for _ in range(500))
    ]
    ok = rejected = other = invalid = 0
    rejected_by: Counter[str] = Counter()
    rejected_field: Counter[str] = Counter()  # for the new fields only
    start = time.perf_counter()
    for _ in range(n):
        codec, notice, data = make_input(rng, frames, notices, layouts, hellos)
        try:
            if notice:
                c = codec.decode_notice(data)
                if codec.decode_notice(codec.encode_notice(c)) != c:
                    invalid += 1
            else:
                m = codec.decode(data)
                if codec.decode(codec.encode(m)) != m:
                    invalid += 1
            ok += 1
        except RemoteProtocolError as exc:
            rejected += 1
            rejected_by[type(exc).__name__] += 1
            field = str(exc).partition(":")[0]
            if field in ("Hello.layout", "Hello.ranks", "Register.skip_tokens"):
                rejected_field[field] += 1
        except Exception:  # what must never happen
            other += 1
            if other <= 5:
                print(
                    f"input {data!r} (notice={notice}, signed={codec.authenticated})",
                    file=sys.stderr,
                )
                traceback.print_exc()
    seconds_taken = time.perf_counter() - start
    return {
        "inputs": n,
        "decoded_ok": ok,
        "rejected": rejected,
        "other_exceptions": other,
        "invalid_decoded": invalid,
        "rejected_by": dict(rejected_by),
        "rejected_for_new_fields": dict(rejected_field),
        **STATS,
        "seconds": round(seconds_taken, 2),
        "inputs_per_second": round(n / seconds_taken) if seconds_taken else None,
        "seed": seed,
    }


def per_call_us(fn: Any, number: int = 20_000) -> float:
    return round(min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6, 2)


def speed() -> dict[str, Any]:
    reg = Register(
        "req-0123456789abcdef",
        1_700_000_000_123,
        "decode-0",
        (tuple(range(100_000, 100_064)),),
        5.0,
    )
    notice = Completion("req-0123456789abcdef", 1_700_000_000_123, Source(3, 0), 5)
    out: dict[str, Any] = {}
    for name, codec in (("", PLAIN), ("signed_", SIGNED)):
        frame = codec.encode(reg)
        nb = codec.encode_notice(notice)
        out[f"register64_{name}bytes"] = len(frame)
        out[f"register64_{name}encode_us"] = per_call_us(lambda c=codec: c.encode(reg))
        out[f"register64_{name}decode_us"] = per_call_us(lambda c=codec, f=frame: c.decode(f))
        out[f"notice_{name}bytes"] = len(nb)
        out[f"notice_{name}encode_us"] = per_call_us(lambda c=codec: c.encode_notice(notice))
        out[f"notice_{name}decode_us"] = per_call_us(lambda c=codec, b=nb: c.decode_notice(b))
    # A 32-layer model, K and V split: 64 regions.
    bases = [i << 32 for i in range(32)]
    layout = KVLayout(
        layer_regions(bases, num_blocks=4096, tokens_per_block=16, num_heads=8, head_bytes=256)
    )
    hello = Hello("prefill-0", 1, Role.PRODUCER, 1, 1, 8, False, 1, 30.0, 2.0, layout=layout)
    data = PLAIN.encode(hello)
    out["hello_layout64_bytes"] = len(data)
    out["hello_layout64_encode_us"] = per_call_us(lambda: PLAIN.encode(hello), 500)
    out["hello_layout64_decode_us"] = per_call_us(lambda: PLAIN.decode(data), 500)
    # TP 8, each rank's data-plane description 300 bytes.
    ranked = Hello(
        "prefill-0",
        1,
        Role.PRODUCER,
        8,
        1,
        8,
        False,
        1,
        30.0,
        2.0,
        ranks=tuple(bytes([i]) * 300 for i in range(8)),
    )
    data = PLAIN.encode(ranked)
    out["hello_ranks8_bytes"] = len(data)
    out["hello_ranks8_encode_us"] = per_call_us(lambda: PLAIN.encode(ranked), 5000)
    out["hello_ranks8_decode_us"] = per_call_us(lambda: PLAIN.decode(data), 5000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="number of fuzz inputs")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    result = fuzz(args.n, args.seed)
    result.update(speed())
    print(json.dumps(result))
    if result["other_exceptions"] or result["invalid_decoded"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
