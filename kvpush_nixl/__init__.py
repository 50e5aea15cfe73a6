"""NIXL transport for kvpush: :class:`NixlTransport`, one NIXL agent per rank.

Importing this package never imports NIXL; building a :class:`NixlTransport`
does, and says how to install it if it is missing (CPU hosts:
``pip install --no-deps nixl nixl-cu12``; GPU hosts: ``pip install 'kvpush[nixl]'``).
See ``docs/operations.md``.
"""

from __future__ import annotations

from ._agent import INSTALL_HINT
from ._options import PrepRule
from ._transport import MAX_NOTICE_BYTES, NixlTransport

__all__ = ("INSTALL_HINT", "MAX_NOTICE_BYTES", "NixlTransport", "PrepRule")
