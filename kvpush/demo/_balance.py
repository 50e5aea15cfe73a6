"""Which prefill and which decode instance serve the next request.

Each side independently takes its least-outstanding instance (requests
dispatched there and not yet settled). Among the instances tied on a side,
the pair ``(prefill, decode)`` used least so far wins, then the lowest
indices: so a burst spreads over every pair, not only the diagonal that two
independent round-robins in step would give, and an idle fleet cycles through
all the pairs. An instance already holding ``capacity`` requests (its block
pool is full) takes no more until one settles.
"""

from __future__ import annotations

__all__ = ("Balancer",)


class Balancer:
    """Least-outstanding per side, least-used pair among the ties."""

    def __init__(self, prefills: int, decodes: int, capacity: int) -> None:
        if prefills < 1 or decodes < 1 or capacity < 1:
            raise ValueError("need at least one instance per side and a capacity of 1")
        self.capacity = capacity
        #: Requests dispatched to each instance and not yet settled.
        self.prefill_out = [0] * prefills
        self.decode_out = [0] * decodes
        #: Requests dispatched to each (prefill, decode) pair, ever.
        self.pair_used = [[0] * decodes for _ in range(prefills)]

    def pick(self) -> tuple[int, int] | None:
        """The pair for the next request, counted as outstanding; ``None`` when
        every instance of a side is full."""
        ps, ds = _least(self.prefill_out, self.capacity), _least(self.decode_out, self.capacity)
        if not ps or not ds:
            return None
        p, d = min(((p, d) for p in ps for d in ds), key=lambda pd: self.pair_used[pd[0]][pd[1]])
        self.prefill_out[p] += 1
        self.decode_out[d] += 1
        self.pair_used[p][d] += 1
        return p, d

    def settled(self, p: int, d: int) -> None:
        """The request on pair ``(p, d)`` settled: both its instances have room again."""
        self.prefill_out[p] -= 1
        self.decode_out[d] -= 1


def _least(outstanding: list[int], capacity: int) -> list[int]:
    """The indices with the fewest outstanding requests, if below ``capacity``."""
    low = min(outstanding)
    return [i for i, n in enumerate(outstanding) if n == low] if low < capacity else []
