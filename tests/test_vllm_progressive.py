"""kvpush_vllm/_progressive.py: which blocks a chunked prefill has computed.

Scheduler outputs are plain stand-ins with the fields vLLM's ``SchedulerOutput``
has (``scheduled_new_reqs``, ``scheduled_cached_reqs``, ``num_scheduled_tokens``);
the real engines run it in tests/e2e/test_vllm_e2e.py (p32 is progressive).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvpush.protocol import ConfigError
from kvpush_vllm._config import ConnectorConfig
from kvpush_vllm._progressive import Progress


@dataclass
class New:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[Any] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class Out:
    scheduled_new_reqs: list[New]
    scheduled_cached_reqs: Cached
    num_scheduled_tokens: dict[str, int]


def step_one(p: Progress) -> list[tuple[str, int]]:
    return p.plan(Out([New("r", ([1, 2, 3, 4],), 0)], Cached(), {"r": 128}))


def test_a_chunk_is_an_increment_once_every_rank_wrote_it() -> None:
    p = Progress(tokens_per_block=32, tp=2)
    p.track("r", "t", prompt_tokens=300)
    assert step_one(p) == [("r", 128)]
    assert p.computed([(0, "r", 128)]) == []  # rank 1 has not reported
    assert p.computed([(1, "r", 128)]) == [("r", "t", [1, 2, 3, 4])]
    # Step two: 100 more tokens into two new blocks; 228 tokens = 7 whole blocks.
    out = Out([], Cached(["r"], [([5, 6, 7, 8],)], [128]), {"r": 100})
    assert p.plan(out) == [("r", 228)]
    assert p.computed([(0, "r", 228), (1, "r", 228)]) == [("r", "t", [1, 2, 3, 4, 5, 6, 7])]
    assert p.computed([(0, "r", 228), (1, "r", 228)]) == []  # nothing new


def test_the_last_chunk_is_left_to_request_finished() -> None:
    p = Progress(tokens_per_block=32, tp=1)
    p.track("r", "t", prompt_tokens=128)
    assert step_one(p) == []  # 128 of 128: the whole prompt, not an increment


def test_untracked_requests_and_stale_reports_are_ignored() -> None:
    p = Progress(tokens_per_block=32, tp=1)
    assert step_one(p) == []
    assert p.computed([(0, "r", 128)]) == []


def test_a_prefill_preempted_after_an_increment_must_abandon_its_transfer() -> None:
    p = Progress(tokens_per_block=32, tp=1)
    p.track("r", "t", prompt_tokens=300)
    step_one(p)
    assert p.preempted("r") is None  # nothing reached the core yet: just stop
    p.track("r", "t", prompt_tokens=300)
    step_one(p)
    p.computed([(0, "r", 128)])
    assert p.preempted("r") == "t"
    assert p.computed([(0, "r", 256)]) == []  # no more increments of it


def test_progressive_is_a_bool_option() -> None:
    assert ConnectorConfig.from_extra({"progressive": True}).progressive
    assert not ConnectorConfig.from_extra({}).progressive
    with pytest.raises(ConfigError, match="progressive must be true or false"):
        ConnectorConfig.from_extra({"progressive": "yes"})
