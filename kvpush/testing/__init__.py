"""Test kit for kvpush and for the frameworks that embed it.

Needs the ``testing`` extra (hypothesis). It holds the fake clock and network,
the model world that wires a producer and a consumer through them, the
invariant checker (I1-I5), hypothesis strategies, the stateful machines and an
exhaustive explorer; and a real producer and consumer runtime pair on
loopback (:func:`loopback_pair`, served as pytest-asyncio fixtures by
``kvpush.testing.pytest_plugin``). See docs/testing.md.
"""

from __future__ import annotations

try:
    import hypothesis  # noqa: F401
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError("kvpush.testing needs hypothesis: pip install 'kvpush[testing]'") from exc

from ._fakes import FakeClock, FakeNetwork, InFlight
from ._invariants import InvariantChecker, InvariantViolation
from ._loopback import LoopbackConfig, LoopbackPair, LoopbackSide, kv_pattern, loopback_pair
from ._machine import FaultFreeMachine, ProtocolMachine
from ._world import Op, World, WorldConfig

__all__ = (
    "FakeClock",
    "FakeNetwork",
    "FaultFreeMachine",
    "InFlight",
    "InvariantChecker",
    "InvariantViolation",
    "LoopbackConfig",
    "LoopbackPair",
    "LoopbackSide",
    "Op",
    "ProtocolMachine",
    "World",
    "WorldConfig",
    "kv_pattern",
    "loopback_pair",
)
