"""What one NixlTransport tells its peers: a msgpack wrapper around NIXL's metadata.

The wrapper says which *instance* of a logical rank made the blob: a restarted
rank keeps its name but has new memory and connections, so everything prepared
for the old process must be dropped, never reused, and its NIXL agent name
``agent#<instance hex>`` keeps NIXL from confusing the two (a stale handle fails
with "stale generation" instead of writing into the new process). The fields:
docs/operations.md, "Identity and restarts". Decoding is strict and raises only
:class:`TransportError`: the bytes come from a peer.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import msgpack

from kvpush.protocol import MAX_ID_LEN
from kvpush.runtime import TransportError

from ._memory import MEMORY_TYPES, Span

__all__ = ("decode_metadata", "encode_metadata", "new_instance", "nixl_name", "split_nixl_name")

META_KIND = "kvpush.nixl"
META_VERSION = 1
INSTANCE_BYTES = 8
#: NIXL metadata grows ~44 B per registered span; 8,192 regions fit well below this.
MAX_METADATA_BYTES = 4 << 20
_MAX_SPANS = 65_536
_KEYS = frozenset(("kind", "version", "agent", "instance", "nixl", "mem"))
_SEP = "#"


def new_instance() -> bytes:
    return secrets.token_bytes(INSTANCE_BYTES)


def nixl_name(agent: str, instance: bytes) -> str:
    """The NIXL agent name of one instance of logical ``agent``."""
    return f"{agent}{_SEP}{instance.hex()}"


def split_nixl_name(name: str) -> tuple[str, bytes] | None:
    """Inverse of :func:`nixl_name`, or ``None`` for a name we did not make."""
    agent, sep, tail = name.rpartition(_SEP)
    if not sep or not agent or len(tail) != 2 * INSTANCE_BYTES:
        return None
    try:
        return agent, bytes.fromhex(tail)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """A decoded peer metadata blob."""

    agent: str
    instance: bytes
    nixl: bytes
    spans: tuple[Span, ...]

    @property
    def nixl_name(self) -> str:
        return nixl_name(self.agent, self.instance)


def encode_metadata(agent: str, instance: bytes, nixl: bytes, spans: tuple[Span, ...]) -> bytes:
    packed: bytes = msgpack.packb(
        {
            "kind": META_KIND,
            "version": META_VERSION,
            "agent": agent,
            "instance": instance,
            "nixl": bytes(nixl),
            "mem": [[s.memory, s.device, s.base, s.length] for s in spans],
        },
        use_bin_type=True,
    )
    return packed


def decode_metadata(data: object) -> PeerInfo:
    """Validate and decode a peer's :func:`encode_metadata` output."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TransportError(f"NIXL peer metadata must be bytes, got {type(data).__name__}")
    if len(data) > MAX_METADATA_BYTES:
        raise TransportError(f"NIXL peer metadata is {len(data)} bytes, over {MAX_METADATA_BYTES}")
    try:
        obj: Any = msgpack.unpackb(
            bytes(data),
            raw=False,
            max_str_len=4 * MAX_ID_LEN,
            max_bin_len=MAX_METADATA_BYTES,
            max_array_len=_MAX_SPANS,
            max_map_len=len(_KEYS),
            max_ext_len=0,
            strict_map_key=True,
        )
    except Exception as exc:  # msgpack raises several types; all mean "malformed"
        raise TransportError(f"malformed NIXL peer metadata: {exc}") from None
    if not isinstance(obj, dict) or obj.get("kind") != META_KIND:
        raise TransportError(
            "not kvpush NIXL metadata (wrong kind; is the peer on another transport?)"
        )
    if set(obj) != _KEYS:
        raise TransportError(f"NIXL peer metadata keys {sorted(map(str, obj))} != {sorted(_KEYS)}")
    if obj["version"] != META_VERSION:
        raise TransportError(f"NIXL peer metadata version {obj['version']!r:.20} is unsupported")
    agent, instance, nixl = obj["agent"], obj["instance"], obj["nixl"]
    if type(agent) is not str or not 1 <= len(agent.encode()) <= MAX_ID_LEN or "\0" in agent:
        raise TransportError("NIXL peer metadata: bad agent name")
    if type(instance) is not bytes or len(instance) != INSTANCE_BYTES:
        raise TransportError("NIXL peer metadata: bad instance token")
    if type(nixl) is not bytes or not nixl:
        raise TransportError("NIXL peer metadata: missing NIXL agent metadata")
    return PeerInfo(agent, instance, nixl, _decode_spans(obj["mem"]))


def _decode_spans(items: object) -> tuple[Span, ...]:
    if not isinstance(items, list):
        raise TransportError("NIXL peer metadata: mem must be a list")
    spans: list[Span] = []
    for item in items:
        if not isinstance(item, list) or len(item) != 4:
            raise TransportError(
                "NIXL peer metadata: a mem entry is not [type, device, base, length]"
            )
        memory, device, base, length = item
        ok = (
            memory in MEMORY_TYPES
            and type(device) is int
            and 0 <= device < 1 << 31
            and type(base) is int
            and type(length) is int
            and base >= 0
            and length >= 1
            and base + length <= 1 << 64
        )
        if not ok:
            raise TransportError(f"NIXL peer metadata: bad mem entry {item!r:.80}")
        spans.append(Span(memory, device, base, length))
    return tuple(spans)
