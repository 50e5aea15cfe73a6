"""Progressive push on a prefill instance: which blocks each step computed.

With chunked prefill and ``progressive``, each step's chunk goes to the core
as an increment (``Producer.kv_ready(final=False)``) once every rank echoed it
after its ``wait_for_save``, so its KV is known written. A preempted prefill
loses its blocks while a source can only grow: its transfer is abandoned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ("Increment", "Progress")

#: (request id, transfer id, whole source blocks so far).
Increment = tuple[str, str, list[int]]


@dataclass(slots=True)
class _Req:
    transfer_id: str
    prompt_tokens: int
    blocks: list[int] = field(default_factory=list)
    #: Whole blocks already given to the core.
    published: int = 0
    #: rank -> tokens its forward computed.
    reported: dict[int, int] = field(default_factory=dict)


class Progress:
    """The prefill requests sent progressively, and their computed blocks."""

    def __init__(self, tokens_per_block: int, tp: int) -> None:
        self._tokens_per_block, self._tp = tokens_per_block, tp
        self._reqs: dict[str, _Req] = {}

    def track(self, req_id: str, transfer_id: str, prompt_tokens: int) -> None:
        """``req_id``'s KV goes to ``transfer_id`` in increments."""
        if req_id not in self._reqs:
            self._reqs[req_id] = _Req(transfer_id, prompt_tokens)

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def preempted(self, req_id: str) -> str | None:
        """Stop tracking a preempted ``req_id``; its transfer id if an
        increment was given to the core already (it must be abandoned)."""
        rec = self._reqs.pop(req_id, None)
        return rec.transfer_id if rec is not None and rec.published else None

    def plan(self, scheduler_output: Any) -> list[tuple[str, int]]:
        """(request id, tokens computed once this step's forward is done) for
        each tracked request this step computes, short of its whole prompt."""
        steps: dict[str, int] = scheduler_output.num_scheduled_tokens
        out: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            rec = self._reqs.get(new.req_id)
            if rec is not None:
                rec.blocks = list(new.block_ids[0])
                out.append((new.req_id, new.num_computed_tokens + steps.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            rec = self._reqs.get(req_id)
            if rec is None:
                continue
            added = cached.new_block_ids[i]
            if added:
                rec.blocks += added[0]
            out.append((req_id, cached.num_computed_tokens[i] + steps.get(req_id, 0)))
        return [(r, n) for r, n in out if n < self._reqs[r].prompt_tokens]

    def computed(self, reports: list[tuple[int, str, int]]) -> list[Increment]:
        """The workers' echoes ``(rank, request id, tokens)``; the increments
        every rank has now computed."""
        touched: set[str] = set()
        for rank, req_id, tokens in reports:
            rec = self._reqs.get(req_id)
            if rec is not None:
                rec.reported[rank] = max(rec.reported.get(rank, 0), tokens)
                touched.add(req_id)
        out: list[Increment] = []
        for req_id in sorted(touched):
            rec = self._reqs[req_id]
            if len(rec.reported) < self._tp:
                continue
            whole = min(min(rec.reported.values()) // self._tokens_per_block, len(rec.blocks))
            if whole > rec.published:
                rec.published = whole
                out.append((req_id, rec.transfer_id, rec.blocks[:whole]))
        return out
