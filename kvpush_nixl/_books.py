"""Bookkeeping of one NixlTransport: posted transfers and arriving notices."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvpush.runtime import Completed, Notice, TransportError

from ._agent import Handle, NixlAgent
from ._meta import split_nixl_name

__all__ = ("Notices", "Transfers")

log = logging.getLogger("kvpush.nixl")

#: Notices held for senders not added yet, all senders together.
MAX_PENDING = 65_536
#: Retired instance names remembered (to drop their late notices).
MAX_RETIRED = 1024


@dataclass(frozen=True, slots=True, eq=False)
class _Posted:
    xfer: Handle
    nixl_name: str


class Transfers:
    """Posted transfers by our integer handle; settled ones waiting to be reported.

    A handle NIXL refuses to release (a transfer it could not cancel) is kept
    to retry later, so nothing is ever checked after release (NIXL's wrapper
    would read freed memory).
    """

    __slots__ = ("_next", "_nixl", "_posted", "_settled", "_zombies")

    def __init__(self, nixl: NixlAgent) -> None:
        self._nixl = nixl
        self._next = 1
        self._posted: dict[int, _Posted] = {}
        self._settled: list[Completed] = []
        self._zombies: list[Handle] = []

    def __len__(self) -> int:
        return len(self._posted)

    def track(self, xfer: Handle, nixl_name: str) -> int:
        handle = self._new()
        self._posted[handle] = _Posted(xfer, nixl_name)
        return handle

    def settled_now(self) -> int:
        """A handle for a transfer with nothing to move (done at once)."""
        handle = self._new()
        self._settled.append(Completed(handle))
        return handle

    def fail_peer(self, nixl_name: str, reason: str) -> None:
        """Cancel and fail every transfer to one peer instance."""
        for handle, posted in list(self._posted.items()):
            if posted.nixl_name == nixl_name:
                del self._posted[handle]
                self._release(posted.xfer)
                self._settled.append(Completed(handle, reason))

    def cancel(self, handle: int) -> bool:
        """Release a posted transfer, which NIXL cancels if it still runs:
        True once it can move nothing more (or had settled), False if NIXL
        refused (it stays posted)."""
        posted = self._posted.get(handle)
        if posted is None:
            return True
        if not self._nixl.release(posted.xfer):
            return False
        del self._posted[handle]
        self._settled.append(Completed(handle, "cancelled past its bound (NIXL released it)"))
        return True

    def poll(self) -> list[Completed]:
        """Check every posted transfer (this is also what sends an initiator's
        notification over TCP); release the settled ones."""
        completed, self._settled = self._settled, []
        for handle, posted in list(self._posted.items()):
            try:
                state = self._nixl.state(posted.xfer)
            except TransportError as exc:
                error: str | None = str(exc)
            else:
                if state == "PROC":
                    continue
                error = None if state == "DONE" else "NIXL reported the transfer failed (ERR)"
            del self._posted[handle]
            self._release(posted.xfer)
            completed.append(Completed(handle, error))
        if self._zombies:
            self._zombies = [x for x in self._zombies if not self._nixl.release(x)]
        completed.sort(key=lambda c: c.handle)
        return completed

    def close(self, timeout: float) -> int:
        """Release (cancel) everything; returns how many NIXL would not release.
        Those get up to ``timeout`` seconds of progress, then NIXL's teardown."""
        left = [p.xfer for p in self._posted.values()] + self._zombies
        self._posted.clear()
        self._settled.clear()
        self._zombies = []
        deadline = time.monotonic() + timeout
        while left:
            left = [x for x in left if not self._nixl.release(x)]
            if not left or time.monotonic() >= deadline:
                break
            for xfer in left:
                with contextlib.suppress(TransportError):
                    self._nixl.state(xfer)
            with contextlib.suppress(TransportError):
                self._nixl.notifs()
            time.sleep(0.001)
        return len(left)

    def _new(self) -> int:
        handle = self._next
        self._next += 1
        return handle

    def _release(self, xfer: Handle) -> None:
        if not self._nixl.release(xfer):
            self._zombies.append(xfer)


class Notices:
    """Notices by logical sender: ready to hand out, held, or dropped.

    NIXL delivers a notification even before the target loaded the sender's
    metadata: such notices wait (bounded) for that exact instance's ``add_peer``;
    those of a retired (restarted or removed) instance are dropped."""

    __slots__ = ("_agent", "_count", "_pending", "_ready", "_retired")

    def __init__(self, agent: str) -> None:
        self._agent = agent
        self._ready: list[Notice] = []
        self._pending: dict[str, list[bytes]] = {}
        self._count = 0
        self._retired: OrderedDict[str, None] = OrderedDict()

    def admit(self, agent: str, nixl_name: str) -> None:
        """An instance was added: what it sent before is ready now."""
        self._retired.pop(nixl_name, None)
        held = self._pending.pop(nixl_name, [])
        self._count -= len(held)
        self._ready.extend(Notice(agent, payload) for payload in held)

    def retire(self, nixl_name: str) -> None:
        """An instance was dropped: forget what it sent, drop what it sends."""
        self._count -= len(self._pending.pop(nixl_name, ()))
        self._retired[nixl_name] = None
        while len(self._retired) > MAX_RETIRED:
            self._retired.popitem(last=False)

    def sort(
        self, arrived: dict[str, list[bytes]], current: Callable[[str], str | None]
    ) -> list[Notice]:
        """The notices to hand out now; ``current(agent)`` is the NIXL name of
        that logical peer's current instance (``None`` if unknown)."""
        out, self._ready = self._ready, []
        for sender, payloads in arrived.items():
            parts = split_nixl_name(sender)
            if parts is not None and current(parts[0]) == sender:
                out.extend(Notice(parts[0], m) for m in payloads)
            elif sender in self._retired:
                log.info(
                    "%s: dropped %d notice(s) of retired %s", self._agent, len(payloads), sender
                )
            elif self._count + len(payloads) <= MAX_PENDING:
                self._pending.setdefault(sender, []).extend(payloads)
                self._count += len(payloads)
            else:
                log.warning(
                    "%s: dropped %d notice(s) of unknown %s", self._agent, len(payloads), sender
                )
        return out

    def clear(self) -> None:
        self._ready.clear()
        self._pending.clear()
        self._count = 0
