"""The data plane's staging: which writes go staged, their slots, the scatters.

Owned by one :class:`~kvpush.runtime.DataPlane`; every method but
:meth:`Stager.stage` and :meth:`Stager.unstage` runs on its thread. The rules
(a producer's slot is lent until its write settles; a progressive epoch's
notice names the staged prefix; a consumer scatters only under its
reservation's record, which is dropped before ``Ready`` or ``Released``
reaches anyone; a notice before its record waits ``park_for`` seconds):
docs/layouts.md, "Staged transfers".
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvpush.protocol import (
    MAX_STAGED_GROUPS,
    Completion,
    KVLayout,
    Role,
    Route,
    SlotPool,
    StartWrite,
)

from ._plan import TransferPlan, TransferPlanner, rows
from ._stage import (
    TRANSPORT_COSTS,
    Copier,
    CostModel,
    calibrate,
    scatter_chunks,
    stage_bytes,
    staged_pieces,
    write_chunks,
)

__all__ = ("StagedWrite", "Stager")

log = logging.getLogger("kvpush.dataplane")

U64 = np.typing.NDArray[np.uint64]
Key = tuple[str, int]

#: Pages of a producer's pool (a write borrows whole pages).
PAGE = 1 << 16
#: Progressive epochs whose way (staged or not) is remembered.
MAX_STREAMS = 4096
#: Row size of the copier's calibration (a small KV block).
PROBE_ROW = 4096


@dataclass(frozen=True, slots=True)
class StagedWrite:
    """A gathered write, ready to post: its span rows."""

    src: U64
    dst: U64
    slot: tuple[int, int, int]  # (rank index, offset, nbytes) of the borrowed slot
    nbytes: int


@dataclass(slots=True)
class _Record:
    blocks: tuple[tuple[int, ...], ...]
    slot: tuple[int, ...]
    #: Sources already scattered: a repeated notice is never scattered again
    #: (its slot bytes may by then belong to nothing).
    done: set[object] = field(default_factory=set)


class Stager:
    """Staging for one data plane (see the module docs)."""

    def __init__(
        self, copier: Copier | None, layouts: dict[int, KVLayout], costs: CostModel | None = None
    ) -> None:
        self.copier = copier
        self.costs = costs
        self._pools = {
            i: SlotPool(layout.staging.nbytes, PAGE)
            for i, layout in layouts.items()
            if copier is not None and layout.staging is not None
        }
        #: Whether this side can stage at all (a copier and a pool).
        self.enabled = bool(self._pools)
        self._bases = {i: layouts[i].staging.base for i in self._pools}  # type: ignore[union-attr]
        self._layouts = layouts
        #: Producer, progressive epochs: (transfer, epoch, route) -> (the tokens
        #: per group its increments left staged, whether more may be staged:
        #: not once one went in place, so the staged part stays a prefix).
        self._streams: OrderedDict[tuple[str, int, Route], tuple[tuple[int, ...], bool]] = (
            OrderedDict()
        )
        #: Consumer: live reservations' blocks and slots, and notices waiting for one.
        self._records: dict[Key, _Record] = {}
        self._lock = threading.Lock()
        #: Notices waiting for their reservation's record, with their deadlines.
        self.parked: list[tuple[float, object]] = []
        #: Seconds a staged notice waits for its reservation's record.
        self.park_for = 30.0
        self.staged_writes = 0
        self.staged_bytes = 0
        self.direct_writes = 0
        self.scatters = 0
        self.dropped_notices = 0

    def calibrate(self) -> None:
        """Unless a cost model was given: measure the copier on the first pool
        (before any transfer: it holds nothing yet) and pair it with the
        transport coefficients of that pool's memory (``TRANSPORT_COSTS``)."""
        if self.costs is not None or not self._pools or self.copier is None:
            return
        index = min(self._pools)
        pool = self._layouts[index].staging
        assert pool is not None
        half = min(pool.nbytes // 2, 8 << 20) // PROBE_ROW * PROBE_ROW
        if half < 2 * PROBE_ROW:
            return
        n = half // PROBE_ROW
        order = np.random.default_rng(0).permutation(n).astype(np.uint64)
        src = rows(pool.base + order * PROBE_ROW, PROBE_ROW, pool.device)
        dst = rows(
            pool.base + half + np.arange(n, dtype=np.uint64) * PROBE_ROW, PROBE_ROW, pool.device
        )
        row, byte = calibrate(self.copier, src, dst)
        post, per_row, wire = TRANSPORT_COSTS[pool.memory.value]
        self.costs = CostModel(post, per_row, wire, copy_row=row, copy_byte=byte)
        log.info("staging cost model: %s", self.costs)

    def pool_used(self) -> int:
        """Bytes of the local pools lent to writes in flight now."""
        return sum(p.used * p.page for p in self._pools.values())

    def need(self, blocks: Sequence[Sequence[int]]) -> int:
        """Consumer: the slot a reservation of ``blocks`` asks for (0: none)."""
        if not self.enabled or len(self._pools) != len(self._layouts):
            return 0
        return max(stage_bytes(layout, blocks) for layout in self._layouts.values())

    def write(
        self,
        action: StartWrite,
        index: int,
        planner: TransferPlanner,
        plan: TransferPlan,
        remote: KVLayout,
    ) -> tuple[StagedWrite | None, Completion | None]:
        """Gather ``action`` into a borrowed slot and return its spans (None:
        write it in place; the cost model, no slot or no pool, never an
        error), and the notice to send with it."""
        if not action.stage or index not in self._pools or remote.staging is None:
            self.direct_writes += 1  # no slot offered, or no pool on either side
            return None, action.notice
        key = (action.transfer_id, action.epoch, action.route)
        prefix, open_ = self._streams.get(key, ((), True))
        chosen = (
            open_
            and plan.nbytes > 0
            and len(action.dst_blocks) <= MAX_STAGED_GROUPS
            and self._worth_it(plan)
        )
        staged = self._gather(action, index, planner, plan, remote) if chosen else None
        reach, result = staged if staged is not None else (prefix, None)
        notice = action.notice
        if notice is None:
            self._remember(key, (reach, result is not None))
        else:
            self._streams.pop(key, None)
            if reach:  # staged now, or by the increments before: it waits in the slot
                notice = replace(notice, staged=reach)
        if result is None:
            self.direct_writes += 1
        else:
            self.staged_writes += 1
            self.staged_bytes += result.nbytes
        return result, notice

    def _remember(self, key: tuple[str, int, Route], value: tuple[tuple[int, ...], bool]) -> None:
        self._streams[key] = value
        self._streams.move_to_end(key)
        while len(self._streams) > MAX_STREAMS:
            self._streams.popitem(last=False)

    def _worth_it(self, plan: TransferPlan) -> bool:
        costs = self.costs
        if costs is None:
            return True
        spans = int(plan.region_rows.size - 1)
        return costs.prefers_staged(plan.num_descriptors, spans, 2 * plan.num_pieces, plan.nbytes)

    def _gather(
        self,
        action: StartWrite,
        index: int,
        planner: TransferPlanner,
        plan: TransferPlan,
        remote: KVLayout,
    ) -> tuple[tuple[int, ...], StagedWrite] | None:
        assert self.copier is not None and remote.staging is not None
        counts = [len(ids) for ids in action.dst_blocks]
        chunks, reach = write_chunks(
            planner,
            action.src_blocks,
            action.dst_blocks,
            action.skip_tokens,
            action.first,
            action.notice is None,
        )
        pieces = staged_pieces(planner, Role.PRODUCER, counts, chunks)
        at, compact, lengths = pieces.spans()
        nbytes = pieces.nbytes
        offset, size = action.stage[0], action.stage[1]
        if offset + size > remote.staging.nbytes:
            log.warning(
                "the slot of %s ends past the consumer's %d-byte pool (its staging_bytes "
                "exceed a rank's pool): in place",
                action.transfer_id,
                remote.staging.nbytes,
            )
            return None
        if not lengths.size or int((at + lengths).max()) > size:
            log.warning("staged write of %s does not fit its slot: in place", action.transfer_id)
            return None
        if self.costs is not None and not self.costs.prefers_staged(
            int(plan.num_descriptors), int(lengths.size), 2 * pieces.kv.shape[0], nbytes
        ):
            return None
        slot = self._pools[index].take(nbytes)
        if slot is None:
            return None
        base = self._bases[index] + slot[0]
        dev = int(pieces.kv[0, 2])
        sizes = pieces.kv[:, 1]
        try:
            self.copier.copy(pieces.kv, rows(base + (np.cumsum(sizes) - sizes), sizes, dev))
        except Exception:
            self._pools[index].give(slot)
            raise
        src = rows(base + compact.astype(np.uint64), lengths, dev)
        dst = rows(
            remote.staging.base + offset + at.astype(np.uint64), lengths, remote.staging.device
        )
        return reach, StagedWrite(src, dst, (index, *slot), nbytes)

    def settled(self, slot: tuple[int, int, int]) -> None:
        """A staged write settled: its borrowed slot is free again."""
        self._pools[slot[0]].give(slot[1:])

    def stage(self, key: Key, blocks: Sequence[Sequence[int]], slot: tuple[int, ...]) -> None:
        """Record a reservation's blocks and slot (any thread)."""
        with self._lock:
            self._records[key] = _Record(tuple(tuple(g) for g in blocks), tuple(slot))

    def unstage(self, key: Key) -> None:
        """Forget a reservation (any thread); returns once no scatter into its
        blocks runs or ever will."""
        with self._lock:
            self._records.pop(key, None)

    def scatter(self, notice: Completion, index: int, planner: TransferPlanner) -> str | None:
        """Scatter a staged notice's bytes from the slot into the blocks;
        ``None`` when done, else why not ("park": no record yet)."""
        assert self.copier is not None
        layout = self._layouts[index]
        with self._lock:
            rec = self._records.get((notice.transfer_id, notice.epoch))
            if rec is None:
                return "park"
            if layout.staging is None or not rec.slot:
                return "no staging slot on this rank"
            if rec.slot[0] + rec.slot[1] > layout.staging.nbytes:
                return f"its slot ends past this rank's {layout.staging.nbytes}-byte pool"
            if (notice.source, notice.consumer_rank) in rec.done:
                return None  # a repeat: the core ignores it too
            chunks = scatter_chunks(planner, rec.blocks, notice.staged)
            if isinstance(chunks, str):
                return chunks
            counts = [len(ids) for ids in rec.blocks]
            pieces = staged_pieces(planner, Role.CONSUMER, counts, chunks)
            if not pieces.kv.shape[0]:
                rec.done.add((notice.source, notice.consumer_rank))
                return None
            ends = pieces.image + pieces.kv[:, 1].astype(np.int64)
            if int(ends.max()) > rec.slot[1]:
                return "the staged bytes overrun the slot"
            at = layout.staging.base + rec.slot[0] + pieces.image.astype(np.uint64)
            self.copier.copy(rows(at, pieces.kv[:, 1], layout.staging.device), pieces.kv)
            rec.done.add((notice.source, notice.consumer_rank))
            self.scatters += 1
        return None

    def park(self, item: object, until: float | None = None) -> None:
        """Keep a notice until ``until`` (default: ``park_for`` from now)."""
        self.parked.append((time.monotonic() + self.park_for if until is None else until, item))

    def unpark(self) -> list[tuple[float, object]]:
        """Parked notices to try again, with their deadlines (expired: dropped)."""
        items, self.parked = self.parked, []
        now = time.monotonic()
        alive = []
        for until, item in items:
            if now > until:
                self.dropped_notices += 1
                log.error("staged notice dropped: no reservation recorded for it in time")
            else:
                alive.append((until, item))
        return alive
