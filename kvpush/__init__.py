"""kvpush: push-mode KV-cache handoff between prefill and decode instances.

``kvpush.protocol`` is the sans-IO core; everything it exports is re-exported
here. ``kvpush.testing`` (the ``testing`` extra) holds the fake network, fake
clock, invariant checks and hypothesis strategies. Above the core sit the
runtime (``kvpush.runtime``), the transports (``kvpush.shm``, ``kvpush_nixl``),
the vLLM shim (``kvpush_vllm``) and the applications (``kvpush demo``,
``kvpush simulate``, ``kvpush router``); docs/architecture.md says what each
may import.
"""

from __future__ import annotations

from .protocol import *  # noqa: F403
from .protocol import __all__ as _protocol_all

__version__ = "0.1.0"
__all__ = (*_protocol_all, "__version__")  # noqa: PLE0604
