"""The shared-memory transport: :class:`ShmTransport`, one POSIX shared-memory
segment per rank, for processes on one machine (the demo's ``--transport
memory``, the runtime's tests).

A transport like ``kvpush_nixl``, one layer above the runtime: it implements
:class:`kvpush.runtime.Transport` and registers itself as ``shm`` in the
``kvpush.transports`` registry (:data:`TRANSPORT`). :class:`Segment` maps a
named segment without a transport (the demo registers the rank segments with
NIXL through it). See docs/runtime.md and docs/architecture.md.
"""

from __future__ import annotations

from kvpush.runtime import TransportKind

from ._ring import Segment
from ._ring import posix_shm as _posix_shm
from ._transport import DEFAULT_MAILBOX_BYTES, ShmTransport

__all__ = ("DEFAULT_MAILBOX_BYTES", "TRANSPORT", "Segment", "ShmTransport")

#: The ``shm`` entry of the ``kvpush.transports`` registry:
#: ``factory(agent, size, *, create=True, name=None, verify=False, mailbox_bytes=...)``.
TRANSPORT = TransportKind(ShmTransport, probe=_posix_shm)
