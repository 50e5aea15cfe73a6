"""NIXL transport for kvpush: :class:`NixlTransport`, one NIXL agent per rank.

Importing this package never imports NIXL; building a :class:`NixlTransport`
does, and says how to install it if it is missing (CPU hosts:
``pip install --no-deps nixl nixl-cu12``; GPU hosts: ``pip install 'kvpush[nixl]'``).
It registers itself as ``nixl`` in the runtime's ``kvpush.transports``
registry (:data:`TRANSPORT`), which is how ``kvpush`` reaches it without
importing it. See ``docs/operations.md`` and ``docs/architecture.md``.
"""

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
