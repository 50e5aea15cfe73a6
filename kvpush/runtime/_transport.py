"""The data-plane transport interface the runtime drives (one object per rank).

Implementations live a layer up and register under the ``kvpush.transports``
entry-point group (:func:`~kvpush.runtime.transport_kind`). The runtime calls
every method from ONE thread (its data-plane thread), so implementations need
no locking of their own. Descriptors are the planner's ``(N, 3)`` uint64 rows
of ``(address, length, device id)``. A completion notice is opaque bytes that
travel *with* the data: delivered only after the bytes of its transfer, and of
every write to the same agent that completed before it was posted, are
visible at the target (docs/runtime.md, "A commit's notice follows every
increment"). ``b""``: no notice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from kvpush.protocol import KVLayout, KvpushError

__all__ = (
    "Completed",
    "Descriptors",
    "Indices",
    "Notice",
    "PreppedTransport",
    "Transport",
    "TransportError",
)

#: ``(N, 3)`` uint64 rows of (address, length, device id).
Descriptors = NDArray[np.uint64]
#: Indices into a prepared descriptor list.
Indices = NDArray[np.int64]


class TransportError(KvpushError):
    """A transfer could not be posted, or a peer is unknown or gone."""


@dataclass(frozen=True, slots=True)
class Completed:
    """A posted transfer settled: ``error`` is ``None`` on success. Either way
    nothing of it moves any more."""

    handle: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Notice:
    """A completion notice that arrived from ``peer`` (its data is visible)."""

    peer: str
    payload: bytes


@runtime_checkable
class Transport(Protocol):
    """One rank's data plane."""

    @property
    def agent(self) -> str:
        """This rank's transport name, unique in the fleet."""
        ...

    def register(self, layout: KVLayout) -> None:
        """Register every region of this rank's KV memory (once)."""
        ...

    def metadata(self) -> bytes:
        """What a peer needs to reach this rank (carried by the handshake)."""
        ...

    def add_peer(self, metadata: bytes, layout: KVLayout | None = None) -> str:
        """Accept a peer's metadata (and the layout of the rank it describes:
        memory types, regions); returns its agent name. Metadata of a new
        instance of a known agent replaces the old one: handles and
        descriptors made for the old instance are never reused, and its
        transfers still posted fail."""
        ...

    def remove_peer(self, agent: str) -> None:
        """Forget a peer; transfers to it that are still posted fail."""
        ...

    def write(self, agent: str, src: Descriptors, dst: Descriptors, notice: bytes) -> int:
        """Post a WRITE of local ``src`` rows into ``agent``'s ``dst`` rows,
        delivering ``notice`` to it after the data (``b""``: none). Returns a
        handle; raises :class:`TransportError` if it cannot be posted."""
        ...

    def read(self, agent: str, local: Descriptors, remote: Descriptors) -> int:
        """Post a READ of ``agent``'s ``remote`` rows into local ``local`` rows."""
        ...

    def poll(self) -> tuple[list[Completed], list[Notice]]:
        """Make progress; return settled transfers and received notices.
        Never blocks. A target must keep polling for writes to it to finish."""
        ...

    def close(self) -> None:
        """Release every resource (memory registrations, connections)."""
        ...

    # Optional: ``cancel(handle) -> bool``. Stop a posted transfer; True once
    # nothing of it can move any more (its ``Completed``, an error or done if
    # it finished first, comes from the next poll); False if the transport
    # cannot confirm that (it then stays posted). The data plane calls it for
    # the core's ``Cancel`` (an op past its ``op_bound``).


@runtime_checkable
class PreppedTransport(Transport, Protocol):
    """A transport that can also post by index into descriptor lists prepared
    once per (peer, route): NIXL's ``prep_xfer_dlist`` / ``make_prepped_xfer``
    (docs/operations.md, "Posting: descriptor rows or prepared lists"). The
    data plane prepares a route's lists the first time it posts on it and
    forgets them when the peer's metadata is replaced."""

    def prefers_prepped(self, merged_rows: int, pieces: int) -> bool:
        """Whether a plan of ``merged_rows`` merged descriptors (``pieces``
        unmerged) is faster posted by index than as descriptor rows."""
        ...

    def prep(self, agent: str, key: object, local: Descriptors, remote: Descriptors) -> None:
        """Prepare the local rows and ``agent``'s rows of one route under
        ``key`` (hashable). Preparing a key again replaces it."""
        ...

    def write_prepped(
        self, agent: str, key: object, local: Indices, remote: Indices, notice: bytes
    ) -> int:
        """:meth:`Transport.write` by index: local row ``local[k]`` of ``key``'s
        list into the peer's row ``remote[k]``. :class:`TransportError` if
        ``key`` is not prepared for this instance of ``agent``."""
        ...

    def read_prepped(self, agent: str, key: object, local: Indices, remote: Indices) -> int:
        """:meth:`Transport.read` by index."""
        ...
