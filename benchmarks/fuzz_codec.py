"""Fuzz the wire codec and time it.

Feeds ``--n`` inputs (seeded; random bytes, frames with a valid header and a
random body, and valid frames and notices after random edits: bit flips, byte
sets, truncation, extension, insertion, deletion, splicing, header edits and
msgpack field type swaps) to ``Codec.decode`` / ``Codec.decode_notice``, with and
without a secret; half the edited frames for the signed codec are re-signed so
the edit gets past the MAC. Every input must decode to a message that
round-trips or raise ``RemoteProtocolError``; anything else is counted in
``other_exceptions`` (must be 0) and the first few are printed to stderr.

Prints one JSON object: the fuzz counts plus sizes and encode/decode times of a
Register with 64 block ids and of a Completion notice.

    python benchmarks/fuzz_codec.py --n 1000000 [--seed 1]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import random
import sys
import time
import timeit
import traceback
from collections import Counter
from typing import Any

import msgpack

from kvpush.protocol import (
    Abort,
    Announce,
    Completion,
    Heartbeat,
    Hello,
    HelloReject,
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
from kvpush.protocol._codec import Codec

SECRET = b"fuzz-secret-0123456789abcdef"
PLAIN = Codec()
SIGNED = Codec(secret=SECRET)

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
            tuple(fp.items()),
            modes,
            edge_int(rng, 0, 0xFFFF),
        )
    if kind == 1:
        return HelloReject(text(rng, 0, 20), text(rng, 0, 100))
    if kind == 2:
        mode = rng.choice(list(Mode))
        return Register(tid, epoch, text(rng, 1, 32), blocks(rng), seconds(rng, False), mode)
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


def wire_value(rng: random.Random, depth: int = 0) -> Any:
    """Any msgpack value, biased toward the edges the codec checks."""
    r = rng.randrange(12 if depth < 2 else 9)
    if r == 0:
        return None
    if r == 1:
        return rng.random() < 0.5
    if r == 2:
        return rng.choice([0, 1, -1, 1023, 1024, 1 << 16, (1 << 63) - 1, 1 << 63, (1 << 64) - 1])
    if r == 3:
        return rng.randint(-(1 << 63), (1 << 64) - 1)
    if r == 4:
        return rng.choice([0.0, -0.0, -1.0, 1.5, float("nan"), float("inf"), -float("inf"), 1e308])
    if r == 5:
        return rng.choice(["", "push", "pull", "producer", "consumer", "released", "x" * 257])
    if r == 6:
        return text(rng, 0, 10)
    if r == 7:
        return rng.randbytes(rng.choice([0, 1, 3, 4, 8, 12]))
    if r == 8:
        return rng.randbytes(4) * 2  # a duplicate block id
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


def mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        op = rng.randrange(9)
        pos = rng.randrange(len(buf)) if buf else 0
        if op == 0 and buf:
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:
            buf[pos] = rng.choice([0, 1, 0x7F, 0x80, 0xC0, 0xC1, 0xFF, rng.randrange(256)])
        elif op == 2:
            del buf[rng.randrange(len(buf) + 1) :]
        elif op == 3:
            buf += rng.randbytes(rng.choice([1, 2, 4, 32]))
        elif op == 4:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 5))
        elif op == 5:
            del buf[pos : pos + rng.randint(1, 5)]
        elif op == 6:
            other = rng.choice(pool)
            cut = rng.randrange(len(other) + 1)
            buf = buf[:pos] + bytearray(other[cut:])
        elif op == 7 and len(buf) >= 6:
            buf[rng.choice([3, 4, 5])] = rng.choice([0, 1, 2, 3, 11, 12, 255, rng.randrange(256)])
        elif buf:
            buf[pos:pos] = buf[pos : pos + rng.randint(1, 8)]
    return bytes(buf)


def make_input(
    rng: random.Random, frames: list[tuple[bytes, bytes]], notices: list[tuple[bytes, bytes]]
) -> tuple[Codec, bool, bytes]:
    """(codec, is-notice, data) for one fuzz input."""
    notice = rng.random() < 0.25
    signed = rng.random() < 0.5
    codec = SIGNED if signed else PLAIN
    mac = (16 if notice else 32) if signed else 0
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
    notices = [
        (PLAIN.encode_notice(c), SIGNED.encode_notice(c))
        for c in (random_notice(rng) for _ in range(500))
    ]
    ok = rejected = other = invalid = 0
    rejected_by: Counter[str] = Counter()
    start = time.perf_counter()
    for _ in range(n):
        codec, notice, data = make_input(rng, frames, notices)
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
