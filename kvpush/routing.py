"""The routing policy: which prefill and which decode instance take the next
request; the router, the demo and the simulator all use it (docs/router.md,
"Choosing the instances" and "Health"). Pure: the same loads give the same pick.

The fixed round over the pairs: on an idle fleet request ``k < P x D`` goes to
``(k mod P, (k + k // lcm(P, D)) mod D)``, then the round repeats. When no
instance of a side has room, :func:`pick` returns ``None``: a policy cannot
make room (the caller waits for a release, or refuses).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from kvpush.protocol import ConfigError, LocalProtocolError

__all__ = ("Health", "InstanceLoad", "Ledger", "Pick", "Side", "pick")


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """One instance's load as its router counts it (a snapshot)."""

    #: Requests dispatched to it and not yet settled.
    outstanding: int = 0
    #: KV blocks those requests hold (the router's estimate).
    reserved_blocks: int = 0
    #: Blocks it can hold at most; ``None``: no limit known to the router.
    capacity: int | None = None
    #: It answers (False: down until a probe answers; never picked).
    up: bool = True
    #: Blocks it reports as suspect (a decode); > 0 ranks it after clean ones.
    suspect_blocks: int = 0

    def __post_init__(self) -> None:
        if min(self.outstanding, self.reserved_blocks, self.capacity or 0, self.suspect_blocks) < 0:
            raise ConfigError(f"a load is never negative: {self}")

    def fits(self, blocks: int) -> bool:
        """Up, with room for a request of ``blocks`` more."""
        return self.up and (self.capacity is None or self.reserved_blocks + blocks <= self.capacity)


#: Which side of the fleet an instance is on.
Side = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class Pick:
    """The instances (indices into each side's loads) that take the request."""

    prefill: int
    decode: int


def pick(
    prefills: Sequence[InstanceLoad],
    decodes: Sequence[InstanceLoad],
    pair_used: Sequence[Sequence[int]] | None = None,
    blocks: int = 1,
) -> Pick | None:
    """The pair for a request of ``blocks`` (see the module); ``pair_used[p][d]``
    counts the requests pair ``(p, d)`` took so far (``None``: none yet).
    ``None`` when every instance of a side is down or too full for ``blocks``."""
    if not prefills or not decodes or blocks < 1:
        raise ConfigError(f"need an instance per side and blocks >= 1, got {blocks}")
    ps, ds = _least(prefills, blocks), _least(decodes, blocks)
    if not ps or not ds:
        return None
    n_p, n_d = len(prefills), len(decodes)
    used = pair_used or [[0] * n_d] * n_p
    low = min(min(map(used[p].__getitem__, ds)) for p in ps)
    places, first, best = _places(n_p, n_d), n_p * n_d, (0, 0)
    for p in ps:  # a plain loop: the simulator's 64 x 64 fleets feel this one
        row, place = used[p], places[p]
        for d in ds:
            if row[d] == low and place[d] < first:
                first, best = place[d], (p, d)
    return Pick(*best)


@functools.lru_cache(maxsize=4)
def _places(n_p: int, n_d: int) -> tuple[tuple[int, ...], ...]:
    """``places[p][d]``: the pair's number in the round (a memo, not state)."""
    lcm = math.lcm(n_p, n_d)
    places = [[0] * n_d for _ in range(n_p)]
    for k in range(n_p * n_d):
        places[k % n_p][(k + k // lcm) % n_d] = k
    return tuple(map(tuple, places))


def _least(loads: Sequence[InstanceLoad], blocks: int) -> list[int]:
    """The indices of the least-loaded instances up, with room for ``blocks``
    (one with suspect blocks only when no instance without any has room)."""
    room = {
        i: (x.suspect_blocks > 0, x.reserved_blocks, x.outstanding)
        for i, x in enumerate(loads)
        if x.fits(blocks)
    }
    low = min(room.values(), default=None)
    return [i for i, key in room.items() if key == low]


class Ledger:
    """What a router dispatched, for :func:`pick`: :meth:`acquire` picks and
    charges both instances; each leg gives its charge back when it ends."""

    def __init__(self, prefills: int, decodes: int, capacity: int | None = None) -> None:
        if prefills < 1 or decodes < 1:
            raise ConfigError("routing needs at least one prefill and one decode instance")
        empty = InstanceLoad(capacity=capacity)
        self._loads = ([empty] * prefills, [empty] * decodes)
        self._pairs = [[0] * decodes for _ in range(prefills)]

    @property
    def prefills(self) -> tuple[InstanceLoad, ...]:
        return tuple(self._loads[0])

    @property
    def decodes(self) -> tuple[InstanceLoad, ...]:
        return tuple(self._loads[1])

    def acquire(self, blocks: int = 1) -> Pick | None:
        """Pick a pair for a request of ``blocks`` and charge it (``None``: no room)."""
        choice = pick(*self._loads, self._pairs, blocks)
        if choice is not None:
            self._charge(0, choice.prefill, blocks, 1)
            self._charge(1, choice.decode, blocks, 1)
            self._pairs[choice.prefill][choice.decode] += 1
        return choice

    def release_prefill(self, index: int, blocks: int = 1) -> None:
        """The prefill leg on ``index`` ended: give back what :meth:`acquire` charged."""
        self._charge(0, index, blocks, -1)

    def release_decode(self, index: int, blocks: int = 1) -> None:
        """The decode leg on ``index`` ended: give back what :meth:`acquire` charged."""
        self._charge(1, index, blocks, -1)

    def mark(
        self, side: Side, index: int, *, up: bool | None = None, suspect_blocks: int | None = None
    ) -> None:
        """Set what the router learnt of an instance: up or down, suspect blocks."""
        loads = self._loads[0 if side == "prefill" else 1]
        x = loads[index]
        loads[index] = replace(
            x,
            up=x.up if up is None else up,
            suspect_blocks=x.suspect_blocks if suspect_blocks is None else suspect_blocks,
        )

    def _charge(self, side: int, index: int, blocks: int, n: int) -> None:
        x = self._loads[side][index]
        outstanding, reserved = x.outstanding + n, x.reserved_blocks + n * blocks
        if outstanding < 0 or reserved < 0:
            raise LocalProtocolError(f"release of instance {index} without a matching acquire")
        self._loads[side][index] = replace(x, outstanding=outstanding, reserved_blocks=reserved)


class Health:
    """Which instances of one side are down, and when to probe each again:
    ``first`` seconds, doubling with every failure since the last served
    request, at most ``most``, times ``1 +- jitter``. Pure: ``now`` and the
    jitter draw ``u`` (uniform in [0, 1)) come in."""

    def __init__(self, n: int, first: float = 0.5, most: float = 10.0, jitter: float = 0.2) -> None:
        if n < 1 or not 0 < first <= most or not 0 <= jitter < 1:
            raise ConfigError(
                f"health needs n >= 1, 0 < first <= most, 0 <= jitter < 1, "
                f"got {n}, {first}, {most}, {jitter}"
            )
        self.first, self.most, self.jitter = first, most, jitter
        self._strikes = [0] * n
        #: Down instance -> (when to probe it, why it is down).
        self._down: dict[int, tuple[float, str]] = {}

    def up(self, i: int) -> bool:
        return i not in self._down

    def why(self, i: int) -> str:
        """Why ``i`` is down (``""`` when it is up)."""
        return self._down[i][1] if i in self._down else ""

    @property
    def down(self) -> tuple[int, ...]:
        return tuple(sorted(self._down))

    def failed(self, i: int, now: float, u: float, why: str = "") -> float:
        """A request to ``i`` failed: down (if it was up); returns its probe time.
        Many requests failing at once on a dead instance count as one failure."""
        if i in self._down:
            return self._down[i][0]
        return self.probe_failed(i, now, u, why)

    def probe_failed(self, i: int, now: float, u: float, why: str = "") -> float:
        """A probe of ``i`` failed (or its first request did): probe again later."""
        self._strikes[i] += 1
        base = min(self.most, self.first * 2.0 ** min(self._strikes[i] - 1, 60))
        delay = min(self.most, base * (1 + self.jitter * (2 * u - 1)))
        self._down[i] = (now + delay, why or self.why(i))
        return now + delay

    def answered(self, i: int) -> None:
        """A probe of ``i`` answered: up again (its failure count stays)."""
        self._down.pop(i, None)

    def served(self, i: int) -> None:
        """``i`` served a request: up, and its next failure starts at ``first``."""
        self._down.pop(i, None)
        self._strikes[i] = 0

    def due(self, now: float) -> list[int]:
        """The down instances whose probe time has come."""
        return [i for i, (when, _) in sorted(self._down.items()) if when <= now]

    def next_probe(self) -> float | None:
        """The earliest probe time, ``None`` when every instance is up."""
        return min((when for when, _ in self._down.values()), default=None)
