"""The shared-memory transport for processes on one machine: :class:`ShmTransport`
(one POSIX segment per rank, registered as ``shm`` in ``kvpush.transports``) and
:class:`Segment` (a named segment without a transport). docs/runtime.md."""

from __future__ import annotations

from kvpush.runtime import TransportKind

from ._ring import Segment
from ._ring import posix_shm as _posix_shm
from ._transport import DEFAULT_MAILBOX_BYTES, ShmTransport

__all__ = ("DEFAULT_MAILBOX_BYTES", "TRANSPORT", "Segment", "ShmTransport")

#: The ``shm`` entry of the ``kvpush.transports`` registry:
#: ``factory(agent, size, *, create=True, name=None, verify=False, mailbox_bytes=...)``.
TRANSPORT = TransportKind(ShmTransport, probe=_posix_shm)
