"""The routing policy: which prefill and which decode instance take the next
request. The router (``kvpush router``), the demo and the simulator all use it.
It is pure: no I/O, clock or randomness; the same loads give the same pick.

Each side takes its least-loaded instances by **(reserved blocks, outstanding
requests)**. Among the pairs of those the least-used pair wins, then the first
in a fixed round over every pair: on an idle fleet request ``k < P x D`` goes
to ``(k mod P, (k + k // lcm(P, D)) mod D)``, then the round repeats. So a
burst uses every pair within one of every other, each side within one request
of even. An instance with a ``capacity`` (blocks) takes only what fits; when
no instance of a side has room, :func:`pick` returns ``None`` (a policy cannot
make room: the caller waits for a release, or refuses).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvpush.protocol import ConfigError, LocalProtocolError

__all__ = ("InstanceLoad", "Ledger", "Pick", "pick")


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """One instance's load as its router counts it (a snapshot)."""

    #: Requests dispatched to it and not yet settled.
    outstanding: int = 0
    #: KV blocks those requests hold (the router's estimate).
    reserved_blocks: int = 0
    #: Blocks it can hold at most; ``None``: no limit known to the router.
    capacity: int | None = None

    def __post_init__(self) -> None:
        if min(self.outstanding, self.reserved_blocks, self.capacity or 0) < 0:
            raise ConfigError(f"a load is never negative: {self}")

    def fits(self, blocks: int) -> bool:
        """Room for a request of ``blocks`` more."""
        return self.capacity is None or self.reserved_blocks + blocks <= self.capacity


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
    ``None`` when every instance of a side is too full for ``blocks``."""
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
    """The indices of the least-loaded instances with room for ``blocks``."""
    room = {i: (x.reserved_blocks, x.outstanding) for i, x in enumerate(loads) if x.fits(blocks)}
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

    def _charge(self, side: int, index: int, blocks: int, n: int) -> None:
        x = self._loads[side][index]
        outstanding, reserved = x.outstanding + n, x.reserved_blocks + n * blocks
        if outstanding < 0 or reserved < 0:
            raise LocalProtocolError(f"release of instance {index} without a matching acquire")
        self._loads[side][index] = replace(x, outstanding=outstanding, reserved_blocks=reserved)
