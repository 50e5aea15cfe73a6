"""The sans-IO kvpush protocol core.

Plain objects with explicit transition tables and injected time: no sockets,
threads, clocks or randomness. See docs/protocol.md.
"""

from __future__ import annotations

from ._config import ConsumerConfig, Identity, ProducerConfig, Timing
from ._consumer import Consumer, Refused, RefuseReason, Reserved
from ._endpoint import PeerView, check_compatible
from ._errors import (
    ConfigError,
    IncompatiblePeerError,
    KvpushError,
    LocalProtocolError,
    RemoteProtocolError,
    TopologyError,
)
from ._messages import (
    PROTOCOL_VERSION,
    Abort,
    Announce,
    Completion,
    ControlMessage,
    Heartbeat,
    Hello,
    HelloReject,
    ReadDone,
    Register,
    Rejected,
    Settled,
    Withdraw,
    WriteFailed,
)
from ._outputs import (
    Action,
    Event,
    Failed,
    Output,
    PeerFailed,
    PeerReady,
    Ready,
    Released,
    ReleaseOutcome,
    Send,
    SourceReleased,
    StartRead,
    StartWrite,
)
from ._producer import Producer
from ._tables import CState, PeerState, PState
from ._timeline import Timeline
from ._topology import HeadSlice, Route, Topology, compute_topology
from ._types import BlockIds, FailureReason, Mode, RejectReason, Role, Source

__all__ = (
    "PROTOCOL_VERSION",
    "Abort",
    "Action",
    "Announce",
    "BlockIds",
    "CState",
    "Completion",
    "ConfigError",
    "Consumer",
    "ConsumerConfig",
    "ControlMessage",
    "Event",
    "Failed",
    "FailureReason",
    "HeadSlice",
    "Heartbeat",
    "Hello",
    "HelloReject",
    "Identity",
    "IncompatiblePeerError",
    "KvpushError",
    "LocalProtocolError",
    "Mode",
    "Output",
    "PState",
    "PeerFailed",
    "PeerReady",
    "PeerState",
    "PeerView",
    "Producer",
    "ProducerConfig",
    "ReadDone",
    "Ready",
    "RefuseReason",
    "Refused",
    "Register",
    "RejectReason",
    "Rejected",
    "ReleaseOutcome",
    "Released",
    "RemoteProtocolError",
    "Reserved",
    "Role",
    "Route",
    "Send",
    "Settled",
    "Source",
    "SourceReleased",
    "StartRead",
    "StartWrite",
    "Timeline",
    "Timing",
    "Topology",
    "TopologyError",
    "Withdraw",
    "WriteFailed",
    "check_compatible",
    "compute_topology",
)
