"""The anyio runtime that pumps the sans-IO core (docs/runtime.md, "Pieces"):
it imports the core and nothing above it (docs/architecture.md)."""

from __future__ import annotations

from ._channel import ControlChannel
from ._channel_types import (
    Backoff,
    ChannelBusy,
    ChannelClosed,
    ChannelSettings,
    Garbage,
    PeerConnected,
    PeerLost,
    PeerUnreachable,
    Received,
)
from ._dataplane import DataPlane, Fence, NoticeIn, OpResult, PeerRanks, Rank, Result
from ._metrics import EndpointMetrics
from ._plan import TransferPlan, TransferPlanner, plan_transfer
from ._registry import TRANSPORTS_GROUP, TransportKind, transport_kind, transport_kinds
from ._runtime import (
    ConsumerRuntime,
    DataPlaneLike,
    EndpointRuntime,
    ProducerRuntime,
    SyncRuntime,
    decode_rank,
    encode_rank,
)
from ._stage import Copier, CostModel, HostCopier, stage_bytes
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
    "TRANSPORTS_GROUP",
    "Backoff",
    "ChannelBusy",
    "ChannelClosed",
    "ChannelSettings",
    "Completed",
    "ConsumerRuntime",
    "ControlChannel",
    "Copier",
    "CostModel",
    "DataPlane",
    "DataPlaneLike",
    "Descriptors",
    "EndpointMetrics",
    "EndpointRuntime",
    "Fence",
    "Garbage",
    "HostCopier",
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
    "SyncRuntime",
    "TransferPlan",
    "TransferPlanner",
    "Transport",
    "TransportError",
    "TransportKind",
    "decode_rank",
    "encode_rank",
    "plan_transfer",
    "stage_bytes",
    "transport_kind",
    "transport_kinds",
)
