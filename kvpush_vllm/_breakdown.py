"""Per-request breakdown: where one request's time went inside the engines
(docs/performance.md, "Per-request breakdown").

With ``timeline_file`` set, each finished transfer is one JSON line there: the
core's :class:`~kvpush.protocol.Timeline` and the moments only vLLM's side
sees, on ``time.monotonic()``. Off, nothing is stamped or kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import IO, Any

from kvpush.protocol import Timeline

__all__ = ("Breakdown", "timeline_fields")

log = logging.getLogger("kvpush.vllm")

#: Transfers stamped but not yet written; beyond this the oldest is dropped
#: (a request vLLM forgot without telling the connector must not grow memory).
MAX_OPEN = 4096


def timeline_fields(t: Timeline) -> dict[str, Any]:
    """The timeline as flat JSON fields: one time per moment (the last of the
    per-rank ones: the moment the transfer as a whole passed it)."""
    out: dict[str, Any] = {"epoch": t.epoch}
    for name in (
        "reserved", "registration_sent", "registration_received", "kv_ready",
        "write_started", "ready", "failed", "released", "delivered",
    ):  # fmt: skip
        value = getattr(t, name)
        if value is not None:
            out[name] = value
    if t.write_done:
        out["write_done"] = max(when for _, when in t.write_done)
    if t.notice_seen:
        out["notice_seen"] = max(when for _, when in t.notice_seen)
    for name in ("plan_started", "planned", "posted", "done"):
        if t.ops:
            out[f"op_{name}"] = max(getattr(st, name) for _, st in t.ops)
    return out


class Breakdown:
    """Stamps per request id, written as one JSON line per transfer."""

    def __init__(
        self, path: str | None, side: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.side, self._clock = side, clock
        self._open: dict[str, dict[str, Any]] = {}
        self._file: IO[str] | None = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def stamp(self, req_id: str, name: str, **fields: Any) -> None:
        """Record ``name`` at now for ``req_id`` (the first stamp of a name wins)."""
        if self._file is None:
            return
        rec = self._open.get(req_id)
        if rec is None:
            if len(self._open) >= MAX_OPEN:
                del self._open[next(iter(self._open))]
            rec = self._open[req_id] = {}
        if name not in rec:
            rec[name] = self._clock()
        for key, value in fields.items():
            rec.setdefault(key, value)

    def keep(self, req_id: str, timeline: Timeline) -> None:
        """Hold ``timeline`` for the line :meth:`write` writes later."""
        if self._file is not None:
            self._open.setdefault(req_id, {})["_timeline"] = timeline

    def waiting(self, req_id: str, name: str) -> bool:
        """True if ``req_id`` is stamped ``name`` and not written yet."""
        return name in self._open.get(req_id, ())

    def write(self, req_id: str, timeline: Timeline | None = None, **fields: Any) -> None:
        """Write ``req_id``'s line (its stamps, ``timeline`` or the one kept,
        ``fields``) and forget it."""
        if self._file is None:
            return
        rec = self._open.pop(req_id, {})
        kept = rec.pop("_timeline", None)
        timeline = kept if timeline is None else timeline
        line = {"side": self.side, "req_id": req_id, **rec, **fields}
        if timeline is not None:
            line.setdefault("transfer_id", timeline.transfer_id)
            line.update(timeline_fields(timeline))
        try:
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._file.flush()
        except OSError as exc:  # a full disk must not fail a request
            log.warning("kvpush: timeline_file: %s; no more lines", exc)
            self.close()

    def close(self) -> None:
        f, self._file = self._file, None
        self._open.clear()
        if f is not None:
            with contextlib.suppress(OSError):  # what a full disk kept unwritten
                f.close()
