"""The transit budget: the sender's queue age (``max_age``) and the reader's
stall limit share ``Timing.max_transit`` (docs/runtime.md, "The transit budget")."""

from __future__ import annotations

import multiprocessing

import pytest

from kvpush.demo import MODELS
from kvpush.demo._instance import DecodeLeader, PrefillLeader
from kvpush.demo._leader import LeaderSpec
from kvpush.demo._model import SideGeometry
from kvpush.protocol import (
    Codec,
    ConfigError,
    Consumer,
    ConsumerConfig,
    Identity,
    Mode,
    Producer,
    ProducerConfig,
    Role,
    Timing,
)
from kvpush.runtime import ConsumerRuntime, ControlChannel, ProducerRuntime

CODEC = Codec()


def producer(timing: Timing) -> Producer:
    return Producer(ProducerConfig(Identity("prefill", 1), timing))


def test_the_channel_exposes_its_max_age_read_only() -> None:
    ch = ControlChannel("a", CODEC, max_age=0.3)
    assert ch.max_age == 0.3
    assert ControlChannel("b", CODEC).max_age == Timing().max_transit / 2
    with pytest.raises(AttributeError):
        ch.max_age = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("max_transit", "max_age", "stall_limit"),
    [
        (1.0, 1.0, None),  # the default channel under a tighter Timing: 1 + 0.5 > 1
        (2.0, 1.5, None),  # 1.5 + 1 > 2
        (2.0, 0.5, 1.6),  # 0.5 + 1.6 > 2
        # 0.2 + 1.2 fits one side, but against a peer whose max_age is 1.8 and
        # stall_limit 0.2 (also a fitting sum) the pair has 1.8 + 1.2 > 2.
        (2.0, 0.2, 1.2),
        (2.0, 1.8, 0.2),
    ],
)
def test_a_runtime_over_the_budget_is_refused_naming_the_fields(
    max_transit: float, max_age: float, stall_limit: float | None
) -> None:
    channel = ControlChannel("prefill", CODEC, max_age=max_age)
    with pytest.raises(ConfigError) as info:
        ProducerRuntime(producer(Timing(max_transit=max_transit)), channel, stall_limit=stall_limit)
    for name in ("max_age", "stall_limit", "max_transit"):
        assert name in str(info.value), info.value


@pytest.mark.parametrize("max_transit", [0.5, 2.0, 10.0])
def test_half_and_half_is_within_the_budget(max_transit: float) -> None:
    timing = Timing(max_transit=max_transit)
    channel = ControlChannel("decode", CODEC, max_age=max_transit / 2)
    consumer = Consumer(ConsumerConfig(Identity("decode", 1), timing))
    runtime = ConsumerRuntime(consumer, channel)
    assert runtime.watch.limit + channel.max_age == max_transit
    ProducerRuntime(producer(timing), channel, stall_limit=max_transit / 4)


def spec(role: Role, timing: Timing) -> LeaderSpec:
    geo = SideGeometry(MODELS["small"], tp=1, num_blocks=8)
    return LeaderSpec(
        role, "prefill-0", geo, ("seg",), b"k" * 16, Mode.PUSH, 1.0, 0, 1.0, timing=timing
    )


@pytest.mark.parametrize("role", [Role.PRODUCER, Role.CONSUMER])
def test_the_demo_leaders_channel_and_endpoint_share_one_timing(role: Role) -> None:
    """The leader's channel gets max_age from its endpoint's Timing, so a
    demo with a tighter Timing stays within the budget (the default channel
    would not: 1 s + 0.25 s > 0.5 s)."""
    from kvpush.demo._leader import leader_channel

    timing = Timing(max_transit=0.5)
    s = spec(role, timing)
    channel = leader_channel(s, CODEC)
    assert channel.max_age == 0.25
    ends = multiprocessing.Pipe()
    try:
        kind = PrefillLeader if role is Role.PRODUCER else DecodeLeader
        leader = kind(s, [], ends[0])
        runtime = leader.make_runtime(Identity("prefill-0", 1), channel, None)  # type: ignore[arg-type]
        assert runtime.endpoint.config.timing == timing
    finally:
        for end in ends:
            end.close()
