"""The consumer's staging slots: byte ranges of every rank's staging pool.

A slot is owned exactly like the blocks it stands in front of (docs/layouts.md,
"Staged transfers"): by one (transfer, epoch), given back under the same proofs
and quarantine, because a late write into a released slot is the same fault as
one into a released block. A slot names the same range in every rank's pool.
With no free run long enough, the transfer is written in place: staging is
never waited for.
"""

from __future__ import annotations

__all__ = ("SlotPool",)


class SlotPool:
    """First-fit page runs over a pool of ``nbytes`` bytes (``page`` each)."""

    __slots__ = ("_free", "page", "pages", "used")

    def __init__(self, nbytes: int, page: int) -> None:
        self.page = page
        self.pages = nbytes // page
        #: Free runs as ``[first page, count]``, ascending and never adjacent.
        self._free: list[list[int]] = [[0, self.pages]] if self.pages else []
        #: Pages taken now.
        self.used = 0

    def take(self, nbytes: int) -> tuple[int, int] | None:
        """A slot of at least ``nbytes`` as ``(offset, nbytes)``, or None."""
        want = -(-nbytes // self.page)
        if want < 1:
            return None
        for i, run in enumerate(self._free):
            if run[1] >= want:
                first = run[0]
                if run[1] == want:
                    del self._free[i]
                else:
                    run[0] += want
                    run[1] -= want
                self.used += want
                return first * self.page, want * self.page
        return None

    def give(self, slot: tuple[int, ...]) -> None:
        """Return a slot ``take`` handed out (coalescing its neighbours)."""
        first, count = slot[0] // self.page, slot[1] // self.page
        i = 0
        while i < len(self._free) and self._free[i][0] < first:
            i += 1
        self._free.insert(i, [first, count])
        self.used -= count
        if i + 1 < len(self._free) and first + count == self._free[i + 1][0]:
            self._free[i][1] += self._free.pop(i + 1)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == first:
            self._free[i - 1][1] += self._free.pop(i)[1]
