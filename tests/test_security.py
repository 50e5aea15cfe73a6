"""Control-plane security (issue: layouts, codec, handshake): every attempt to
redirect a write or smuggle a frame is refused, over the real wire codec."""

from __future__ import annotations

import pytest

from kvpush.protocol import (
    AuthenticationError,
    Codec,
    CodecLimits,
    Consumer,
    ConsumerConfig,
    Identity,
    KVLayout,
    Output,
    PeerFailed,
    Producer,
    ProducerConfig,
    PState,
    ReadDone,
    Register,
    Rejected,
    RejectReason,
    RemoteProtocolError,
    Send,
    StartWrite,
    layer_regions,
)

SECRET = b"a-deployment-shared-secret-0123"
P, D = "prefill-0", "decode-0"


def layout(
    num_blocks: int = 16, heads: int = 8, tokens: int = 16, head_bytes: int = 256
) -> KVLayout:
    regions = layer_regions(
        [1 << 20, 1 << 24],
        num_blocks=num_blocks,
        tokens_per_block=tokens,
        num_heads=heads,
        head_bytes=head_bytes,
    )
    return KVLayout(regions)


class Pair:
    """A producer and a consumer whose every control frame crosses the codec."""

    def __init__(self, d_layout: KVLayout, p_layout: KVLayout | None = None) -> None:
        self.codec = Codec(secret=SECRET)
        p_id = Identity(P, 11, tp=1, num_kv_heads=8, layout=p_layout or d_layout)
        d_id = Identity(D, 22, tp=1, num_kv_heads=8, layout=d_layout)
        self.producer = Producer(ProducerConfig(p_id))
        self.consumer = Consumer(ConsumerConfig(d_id))
        self.p_out: list[Output] = []
        self.d_out: list[Output] = []

    def pump(self, now: float = 0.0) -> None:
        for _ in range(20):
            moved = False
            for src, dst, name, log in (
                (self.consumer, self.producer, D, self.d_out),
                (self.producer, self.consumer, P, self.p_out),
            ):
                for out in src.drain():
                    log.append(out)
                    if isinstance(out, Send):
                        moved = True
                        frame = self.codec.encode(out.message)
                        dst.receive(now, name, self.codec.decode(frame))
            if not moved:
                return

    def inject(self, message: Register, now: float = 0.0) -> None:
        """A frame that did not come from the consumer's endpoint."""
        self.producer.receive(now, D, self.codec.decode(self.codec.encode(message)))
        self.pump(now)

    def writes(self) -> list[StartWrite]:
        return [o for o in self.p_out if isinstance(o, StartWrite)]

    def rejections(self) -> list[Rejected]:
        sent = [o.message for o in self.p_out if isinstance(o, Send)]
        return [m for m in sent if isinstance(m, Rejected)]


def test_registration_outside_declared_regions_is_rejected() -> None:
    pair = Pair(layout(num_blocks=16))
    pair.consumer.connect(0.0, P)
    pair.pump()
    pair.producer.kv_ready(0.0, "t", [[1, 2]])
    pair.inject(Register("t", 7, D, ((3, 16),), 5.0))  # block 16 is past the region
    assert pair.writes() == []
    assert [(r.epoch, r.reason) for r in pair.rejections()] == [(7, RejectReason.INVALID)]
    assert pair.producer.stats()["register_invalid"] == 1


def test_registration_inside_regions_is_written() -> None:
    pair = Pair(layout(num_blocks=16))
    pair.producer.kv_ready(0.0, "t", [[1, 2]])
    pair.consumer.reserve(0.0, "t", P, [[14, 15]])
    pair.pump()
    assert [w.dst_blocks for w in pair.writes()] == [((14, 15),)]


def test_replayed_old_epoch_registration_cannot_redirect_the_new_epoch() -> None:
    pair = Pair(layout())
    pair.consumer.reserve(0.0, "t", P, [[1, 2]])
    pair.pump()
    sent = [o.message for o in pair.d_out if isinstance(o, Send)]
    old = next(m for m in sent if isinstance(m, Register))
    pair.consumer.preempt(0.1, "t")
    pair.consumer.reserve(0.1, "t", P, [[5, 6]])
    pair.pump(0.1)
    pair.inject(old, 0.2)  # an attacker (or the network) replays epoch 1
    pair.producer.kv_ready(0.3, "t", [[9, 10]])
    pair.pump(0.3)
    assert [(w.epoch, w.dst_blocks) for w in pair.writes()] == [(old.epoch + 1, ((5, 6),))]
    assert (old.epoch, RejectReason.SUPERSEDED) in [(r.epoch, r.reason) for r in pair.rejections()]


def test_replay_after_release_hits_the_tombstone() -> None:
    pair = Pair(layout())
    pair.consumer.reserve(0.0, "t", P, [[1, 2]])
    pair.producer.kv_ready(0.0, "t", [[9, 10]])
    pair.pump()
    (write,) = pair.writes()
    pair.producer.write_done(0.1, "t", write.epoch, write.route.source, write.route.consumer_rank)
    pair.pump(0.1)
    assert pair.producer.transfers() == [("t", PState.DELIVERED)]  # held until acknowledged
    # The notice lands: the consumer is ready and its ReadDone (over the codec)
    # ends the producer's hold; only now is the record a tombstone.
    pair.consumer.completion_received(0.15, P, write.notice)
    pair.pump(0.15)
    acks = [o.message for o in pair.d_out if isinstance(o, Send)]
    assert ReadDone("t", write.epoch, True) in acks
    assert pair.producer.transfers() == [("t", PState.RELEASED)]
    pair.inject(Register("t", write.epoch + 5, D, ((3, 4),), 5.0), 0.2)
    assert len(pair.writes()) == 1
    assert pair.rejections()[-1].reason is RejectReason.RELEASED


def test_forged_and_missing_macs_are_refused() -> None:
    honest = Codec(secret=SECRET)
    forger = Codec(secret=b"not-the-deployment-secret-xyz")
    frame = forger.encode(Register("t", 1, D, ((1,),), 1.0))
    with pytest.raises(AuthenticationError):
        honest.decode(frame)
    with pytest.raises(AuthenticationError):
        honest.decode(Codec().encode(Register("t", 1, D, ((1,),), 1.0)))
    tampered = bytearray(honest.encode(Register("t", 1, D, ((1,),), 1.0)))
    tampered[10] ^= 0x01
    with pytest.raises(AuthenticationError):
        honest.decode(bytes(tampered))


def test_oversized_frames_are_refused_before_parsing() -> None:
    limits = CodecLimits()
    codec = Codec(limits=limits)
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        codec.decode(b"KVP\x01\x03\x00" + b"\x00" * limits.max_frame_bytes)


def test_incompatible_layout_fails_on_both_sides() -> None:
    pair = Pair(layout(head_bytes=256), p_layout=layout(head_bytes=128))  # dtype differs
    pair.consumer.connect(0.0, P)
    pair.pump()
    failures = [o for o in pair.p_out + pair.d_out if isinstance(o, PeerFailed)]
    assert {f.peer for f in failures} == {P, D}
    assert len({f.field for f in failures}) == 1
    assert failures[0].field.startswith("kv.")
