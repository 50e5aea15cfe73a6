"""The anyio runtime that pumps the sans-IO core: control channel, data plane,
shared-memory transport and a synchronous facade (work in progress: the demo,
metrics and benchmarks arrive with the rest of the runtime issue)."""

from __future__ import annotations

from ._channel import (
    Backoff,
    ChannelBusy,
    ChannelClosed,
    ControlChannel,
    Garbage,
    PeerConnected,
    PeerLost,
    PeerUnreachable,
    Received,
)
from ._dataplane import DataPlane, NoticeIn, OpResult, PeerRanks, Rank, Result
from ._facade import SyncRuntime
from ._metrics import EndpointMetrics
from ._runtime import (
    ConsumerRuntime,
    DataPlaneLike,
    EndpointRuntime,
    ProducerRuntime,
    decode_rank,
    encode_rank,
)
from ._shm import ShmTransport
from ._transport import (
    Completed,
    Descriptors,
    Indices,
    Notice,
    PreppedTransport,
    Transport,
    TransportError,
)

__all__ = (
    "Backoff",
    "ChannelBusy",
    "ChannelClosed",
    "Completed",
    "ConsumerRuntime",
    "ControlChannel",
    "DataPlane",
    "DataPlaneLike",
    "Descriptors",
    "EndpointMetrics",
    "EndpointRuntime",
    "Garbage",
    "Indices",
    "Notice",
    "NoticeIn",
    "OpResult",
    "PeerConnected",
    "PeerLost",
    "PeerRanks",
    "PeerUnreachable",
    "PreppedTransport",
    "ProducerRuntime",
    "Rank",
    "Received",
    "Result",
    "ShmTransport",
    "SyncRuntime",
    "Transport",
    "TransportError",
    "decode_rank",
    "encode_rank",
)
