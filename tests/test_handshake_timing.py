"""The timing bounds in the handshake: ``max_transit`` must match, ``op_bound``
is the peer's, and neither may be unusable (docs/protocol.md, "Handshake")."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgpack
import pytest

from kvpush.protocol import (
    Codec,
    Consumer,
    ConsumerConfig,
    Hello,
    HelloReject,
    Identity,
    IncompatiblePeerError,
    PeerFailed,
    PeerReady,
    PeerState,
    Producer,
    ProducerConfig,
    RemoteProtocolError,
    Role,
    Send,
    Timing,
    check_compatible,
)
from kvpush.protocol._errors import LocalProtocolError

P, D = "prefill", "decode"


def pair(p_timing: Timing, d_timing: Timing) -> tuple[Producer, Consumer]:
    return (
        Producer(ProducerConfig(Identity(P, 1), p_timing)),
        Consumer(ConsumerConfig(Identity(D, 1), d_timing)),
    )


def shake(p: Producer, c: Consumer, initiator: str) -> dict[str, list[object]]:
    """Connect from ``initiator``, deliver every frame until none is left;
    each side's events."""
    ends: dict[str, Producer | Consumer] = {P: p, D: c}
    events: dict[str, list[object]] = {P: [], D: []}
    ends[initiator].connect(0.0, D if initiator == P else P)
    moved = True
    while moved:
        moved = False
        for name, end in ends.items():
            for out in end.drain():
                if isinstance(out, Send):
                    ends[out.peer].receive(0.0, name, out.message)
                    moved = True
                else:
                    events[name].append(out)
    return events


@pytest.mark.parametrize("initiator", [D, P])
def test_a_max_transit_mismatch_is_refused_on_both_sides_with_both_values(initiator: str) -> None:
    p, c = pair(Timing(max_transit=2.0), Timing(max_transit=4.0))
    events = shake(p, c, initiator)
    for name, end, other in ((P, p, D), (D, c, P)):
        failed = [e for e in events[name] if isinstance(e, PeerFailed)]
        assert [(f.peer, f.field) for f in failed] == [(other, "max_transit")], name
        assert "2.0" in failed[0].detail and "4.0" in failed[0].detail, failed[0].detail
        assert not any(isinstance(e, PeerReady) for e in events[name])
        assert end.peer(other).state is PeerState.FAILED


def test_equal_max_transit_and_different_op_bounds_shake_hands() -> None:
    """``op_bound`` may differ: each quarantine takes the peer's."""
    p, c = pair(Timing(max_transit=1.5, op_bound=7.0), Timing(max_transit=1.5, op_bound=3.0))
    shake(p, c, D)
    assert p.peer(D).state is PeerState.READY and c.peer(P).state is PeerState.READY
    assert p.peer(D).hello.op_bound == 3.0  # type: ignore[union-attr]
    assert c.peer(P).hello.op_bound == 7.0  # type: ignore[union-attr]
    assert c.peer(P).hello.max_transit == 1.5  # type: ignore[union-attr]


def test_the_consumers_quarantine_adds_the_producers_op_bound() -> None:
    p, c = pair(Timing(max_transit=1.5, op_bound=7.0), Timing(max_transit=1.5, op_bound=3.0))
    shake(p, c, D)
    c.reserve(0.0, "t1", P, [[1, 2]])
    c.drain()
    (rec,) = c._res.values()
    assert rec.quarantine_at == rec.deadline + 1.5 + 7.0


@pytest.mark.parametrize("name", ["op_bound", "max_transit"])
@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_an_unusable_bound_from_the_peer_is_refused(name: str, bad: float) -> None:
    """The codec refuses these on the wire; a Hello fed to the core directly
    is refused by the handshake too, naming the field, and answered."""
    p = Producer(ProducerConfig(Identity(P, 1)))
    good = Identity(D, 1).hello(Role.CONSUMER, 10.0)
    kw: dict[str, Any] = {name: bad}
    hello = dataclasses.replace(good, **kw)
    p.receive(0.0, D, hello)
    out = p.drain()
    rejects = [o.message for o in out if isinstance(o, Send)]
    assert len(rejects) == 1 and isinstance(rejects[0], HelloReject)
    assert rejects[0].field == name
    assert [(o.peer, o.field) for o in out if isinstance(o, PeerFailed)] == [(D, name)]
    assert p.peer(D).state is PeerState.FAILED


def test_check_compatible_names_max_transit_symmetrically() -> None:
    a = Identity(P, 1).hello(Role.PRODUCER, 10.0, 2.0)
    b = Identity(D, 1).hello(Role.CONSUMER, 10.0, 3.0)
    for local, remote in ((a, b), (b, a)):
        with pytest.raises(IncompatiblePeerError) as info:
            check_compatible(local, remote)
        assert info.value.field == "max_transit"
        # The same text on both sides: each value named by its own side.
        want = "2.0 on the producer 'prefill', 3.0 on the consumer 'decode'"
        assert str(info.value).endswith(want)


def test_an_endpoints_hello_carries_its_timing() -> None:
    p = Producer(ProducerConfig(Identity(P, 1), Timing(max_transit=0.75, op_bound=4.0)))
    p.connect(0.0, D)
    (send,) = p.drain()
    assert isinstance(send, Send) and isinstance(send.message, Hello)
    assert (send.message.max_transit, send.message.op_bound) == (0.75, 4.0)


# --- the codec ---------------------------------------------------------------------


def test_max_transit_round_trips_through_the_codec() -> None:
    codec = Codec(secret=b"0123456789abcdef")
    hello = Identity(P, 1).hello(Role.PRODUCER, 10.0, 0.125)
    decoded = codec.decode(codec.encode(hello))
    assert decoded == hello
    assert isinstance(decoded, Hello) and decoded.max_transit == 0.125


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_an_unusable_max_transit_is_refused_both_ways(bad: float) -> None:
    codec = Codec()
    good = Identity(P, 1).hello(Role.PRODUCER, 10.0)
    with pytest.raises(LocalProtocolError, match="max_transit"):
        codec.encode(dataclasses.replace(good, max_transit=bad))
    frame = codec.encode(good)
    body = msgpack.unpackb(frame[6:])
    index = [f.name for f in dataclasses.fields(Hello)].index("max_transit")
    assert body[index] == good.max_transit
    body[index] = bad
    with pytest.raises(RemoteProtocolError, match="max_transit"):
        codec.decode(frame[:6] + msgpack.packb(body, use_bin_type=True))
