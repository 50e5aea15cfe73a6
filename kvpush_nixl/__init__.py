"""NIXL transport for kvpush: :class:`NixlTransport`, one NIXL agent per rank,
registered as ``nixl`` in ``kvpush.transports``. Importing this package never
imports NIXL; building a transport does, and says how to install it if it is
missing. docs/operations.md."""

from __future__ import annotations

from kvpush.runtime import TransportKind

from ._agent import INSTALL_HINT
from ._agent import load_api as _load_api
from ._options import PrepRule
from ._transport import MAX_NOTICE_BYTES, NixlTransport

__all__ = ("INSTALL_HINT", "MAX_NOTICE_BYTES", "TRANSPORT", "NixlTransport", "PrepRule")

#: The ``nixl`` entry of the ``kvpush.transports`` registry: ``factory(agent,
#: **options)`` is :class:`NixlTransport`; ``probe`` imports NIXL (or raises
#: :class:`~kvpush.runtime.TransportError` with :data:`INSTALL_HINT`).
TRANSPORT = TransportKind(NixlTransport, INSTALL_HINT, probe=_load_api)
