"""Where one rank keeps its KV cache: a declarative, validated description.

docs/layouts.md describes the fields, the cell arithmetic and the wire form. A
layout received from a peer tells the producer where it may write in remote
memory, so :meth:`KVLayout.from_wire` checks it as strictly as a local one.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

from ._errors import ConfigError, RemoteProtocolError

__all__ = (
    "LAYOUT_WIRE_VERSION",
    "MAX_REGIONS",
    "HeadOrder",
    "KVLayout",
    "MemoryType",
    "Region",
    "Staging",
    "layer_regions",
)

#: Version of the :meth:`KVLayout.to_wire` format.
LAYOUT_WIRE_VERSION = 1
#: Most regions one layout may hold (keeps handshakes and plans bounded).
MAX_REGIONS = 8192
#: Every region must end below this address (offsets stay exact in int64).
_ADDR_LIMIT = 1 << 63
_MAX_BLOCKS = 1 << 31
_MAX_TOKENS_PER_BLOCK = 1 << 16
_MAX_HEADS = 1 << 16
_MAX_HEAD_BYTES = 1 << 24
_MAX_GROUPS = 64
_KIND_RE = re.compile(r"[A-Za-z0-9_.-]{1,32}")


class HeadOrder(enum.Enum):
    """How the (token, head) cells of one block follow each other in memory:
    token-major (NHD, vLLM's LBNHC) or head-major (HND, LBHNC)."""

    NHD = "NHD"
    HND = "HND"


class MemoryType(enum.Enum):
    """Which memory a region lives in (NIXL's memory type names)."""

    DRAM = "DRAM"
    VRAM = "VRAM"


def _int(name: str, value: object, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ConfigError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Region:
    """One registered KV tensor of one rank: ``num_blocks`` blocks of one layer
    (the fields and the cell arithmetic: docs/layouts.md, "The layout description")."""

    layer: int
    kind: str
    base: int
    num_blocks: int
    block_len: int
    #: ``None`` means ``block_len``.
    block_stride: int | None = None
    tokens_per_block: int
    num_heads: int
    head_start: int = 0
    head_bytes: int
    order: HeadOrder = HeadOrder.NHD
    memory: MemoryType = MemoryType.VRAM
    device: int = 0
    group: int = 0

    def __post_init__(self) -> None:
        _int("Region.layer", self.layer, 0, 1 << 20)
        if type(self.kind) is not str or not _KIND_RE.fullmatch(self.kind):
            raise ConfigError(f"Region.kind must match {_KIND_RE.pattern}, got {self.kind!r:.40}")
        _int("Region.base", self.base, 0, _ADDR_LIMIT - 1)
        _int("Region.num_blocks", self.num_blocks, 1, _MAX_BLOCKS)
        _int("Region.tokens_per_block", self.tokens_per_block, 1, _MAX_TOKENS_PER_BLOCK)
        _int("Region.num_heads", self.num_heads, 1, _MAX_HEADS)
        _int("Region.head_bytes", self.head_bytes, 1, _MAX_HEAD_BYTES)
        _int("Region.head_start", self.head_start, 0, _MAX_HEADS - 1)
        _int("Region.device", self.device, 0, (1 << 31) - 1)
        _int("Region.group", self.group, 0, _MAX_GROUPS - 1)
        _int("Region.block_len", self.block_len, 1, _ADDR_LIMIT - 1)
        need = self.tokens_per_block * self.num_heads * self.head_bytes
        if self.block_len != need:
            raise ConfigError(
                f"Region.block_len is {self.block_len} but tokens_per_block "
                f"{self.tokens_per_block} * num_heads {self.num_heads} * head_bytes "
                f"{self.head_bytes} = {need}"
            )
        if self.block_stride is None:
            object.__setattr__(self, "block_stride", self.block_len)
        stride = _int("Region.block_stride", self.block_stride, 0, _ADDR_LIMIT - 1)
        if stride < self.block_len:
            raise ConfigError(
                f"Region.block_stride {stride} is smaller than block_len {self.block_len}"
            )
        if not isinstance(self.order, HeadOrder):
            raise ConfigError(f"Region.order must be a HeadOrder, got {self.order!r}")
        if not isinstance(self.memory, MemoryType):
            raise ConfigError(f"Region.memory must be a MemoryType, got {self.memory!r}")
        if self.base + self.extent > _ADDR_LIMIT:
            raise ConfigError(f"Region {self.name} ends past 2**63 (base + blocks * stride)")

    @property
    def stride(self) -> int:
        """The block stride in bytes (``block_stride`` resolved)."""
        return self.block_stride if self.block_stride is not None else self.block_len

    @property
    def extent(self) -> int:
        """Bytes from ``base`` to the end of the last block."""
        return (self.num_blocks - 1) * self.stride + self.block_len

    @property
    def name(self) -> str:
        """A short human name, ``layer<N>.<kind>``, used in error messages."""
        return f"layer{self.layer}.{self.kind}"

    def to_wire(self) -> dict[str, Any]:
        """This region as a msgpack-able dict (see :meth:`KVLayout.to_wire`)."""
        return _to_wire(self)


def _to_wire(obj: Region | Staging) -> dict[str, Any]:
    """Every field by name, in declaration order (the golden bytes pin it),
    enums by value."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        out[f.name] = value.value if isinstance(value, enum.Enum) else value
    return out


def _digest(items: object) -> str:
    return hashlib.blake2b(repr(items).encode(), digest_size=8).hexdigest()


def _summary(values: Sequence[str]) -> str:
    """One value if uniform, else a digest of the whole sequence."""
    return values[0] if len(set(values)) == 1 else "mixed:" + _digest(tuple(values))


@dataclass(frozen=True, slots=True, kw_only=True)
class Staging:
    """One rank's registered staging pool: ``nbytes`` bytes at ``base``
    (docs/layouts.md, "Staged transfers")."""

    base: int
    nbytes: int
    memory: MemoryType = MemoryType.VRAM
    device: int = 0

    def __post_init__(self) -> None:
        _int("Staging.base", self.base, 0, _ADDR_LIMIT - 1)
        _int("Staging.nbytes", self.nbytes, 1, _ADDR_LIMIT - 1 - self.base)
        _int("Staging.device", self.device, 0, (1 << 31) - 1)
        if not isinstance(self.memory, MemoryType):
            raise ConfigError(f"Staging.memory must be a MemoryType, got {self.memory!r}")

    def to_wire(self) -> dict[str, Any]:
        return _to_wire(self)

    @classmethod
    def from_wire(cls, obj: object) -> Staging:
        if not isinstance(obj, dict) or set(obj) != {f.name for f in fields(cls)}:
            raise RemoteProtocolError(
                "KV layout staging must be a dict of base, nbytes, memory, device"
            )
        try:
            memory = MemoryType(obj["memory"])
            return cls(base=obj["base"], nbytes=obj["nbytes"], memory=memory, device=obj["device"])
        except (ConfigError, ValueError, TypeError) as exc:
            raise RemoteProtocolError(f"bad KV layout staging: {exc}") from None


@dataclass(frozen=True, slots=True)
class KVLayout:
    """All KV regions of one rank, paired across peers by ``(layer, kind)``;
    the invariants checked on construction are in docs/layouts.md."""

    regions: tuple[Region, ...]
    #: Not in the fingerprint: either side may go without (then writes go in place).
    staging: Staging | None = None

    def __post_init__(self) -> None:
        if self.staging is not None and not isinstance(self.staging, Staging):
            raise ConfigError(f"KVLayout.staging is not a Staging: {self.staging!r}")
        regions = self.regions
        if not isinstance(regions, (tuple, list)) or not 1 <= len(regions) <= MAX_REGIONS:
            raise ConfigError(f"KVLayout.regions must hold 1 to {MAX_REGIONS} regions")
        object.__setattr__(self, "regions", tuple(regions))
        seen: set[tuple[int, str]] = set()
        per_group: dict[int, Region] = {}
        for i, r in enumerate(self.regions):
            if not isinstance(r, Region):
                raise ConfigError(f"KVLayout.regions[{i}] is not a Region: {r!r}")
            if (r.layer, r.kind) in seen:
                raise ConfigError(f"KVLayout.regions: duplicate region {r.name}")
            seen.add((r.layer, r.kind))
            first = per_group.setdefault(r.group, r)
            for fld in ("num_blocks", "tokens_per_block"):
                if getattr(r, fld) != getattr(first, fld):
                    raise ConfigError(
                        f"KVLayout.regions: {fld} differs within KV group {r.group} "
                        f"({first.name}: {getattr(first, fld)}, {r.name}: {getattr(r, fld)})"
                    )
        if sorted(per_group) != list(range(len(per_group))):
            raise ConfigError(
                f"KVLayout.regions: KV groups must be numbered 0..n-1, got {sorted(per_group)}"
            )

    @property
    def num_groups(self) -> int:
        """Number of KV groups (block lists a registration carries)."""
        return 1 + max(r.group for r in self.regions)

    @property
    def num_layers(self) -> int:
        """Number of distinct layers."""
        return len({r.layer for r in self.regions})

    def group_region(self, group: int) -> Region:
        """The first region of KV group ``group`` (all share blocks and block size)."""
        for r in self.regions:
            if r.group == group:
                return r
        raise ConfigError(f"no KV group {group} in this layout")

    def fingerprint(self) -> tuple[tuple[str, str], ...]:
        """Named values that must be equal on producer and consumer, whatever
        their parallelism, block size or memory (docs/layouts.md, "The fingerprint")."""
        regions = self.regions
        return (
            ("kv.layers", str(self.num_layers)),
            ("kv.regions", str(len(regions))),
            ("kv.groups", str(self.num_groups)),
            ("kv.region_map", _digest(sorted((r.layer, r.kind, r.group) for r in regions))),
            ("kv.head_bytes", _summary([str(r.head_bytes) for r in regions])),
            ("kv.order", _summary([r.order.value for r in regions])),
        )

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-able dict: ``{"version": 1, "regions": [region dicts]}``."""
        out: dict[str, Any] = {
            "version": LAYOUT_WIRE_VERSION,
            "regions": [r.to_wire() for r in self.regions],
        }
        if self.staging is not None:
            out["staging"] = self.staging.to_wire()
        return out

    @classmethod
    def from_wire(cls, obj: object) -> KVLayout:
        """A peer's :meth:`to_wire` output, validated; anything malformed raises
        :class:`RemoteProtocolError` and no other exception."""
        if not isinstance(obj, dict) or not {"version", "regions"} <= set(obj) <= _LAYOUT_KEYS:
            raise RemoteProtocolError(
                "KV layout must be a dict with keys version, regions (and staging)"
            )
        if type(obj["version"]) is not int or obj["version"] != LAYOUT_WIRE_VERSION:
            raise RemoteProtocolError(f"KV layout version {obj['version']!r:.40} is not supported")
        items = obj["regions"]
        if not isinstance(items, (list, tuple)) or not 1 <= len(items) <= MAX_REGIONS:
            raise RemoteProtocolError(f"KV layout must list 1 to {MAX_REGIONS} regions")
        regions = tuple(_region_from_wire(i, item) for i, item in enumerate(items))
        staging = Staging.from_wire(obj["staging"]) if "staging" in obj else None
        try:
            return cls(regions, staging)
        except ConfigError as exc:
            raise RemoteProtocolError(f"bad KV layout: {exc}") from None


def layer_regions(
    layer_bases: Sequence[int],
    *,
    num_blocks: int,
    tokens_per_block: int,
    num_heads: int,
    head_bytes: int,
    head_start: int = 0,
    packing: Literal["split", "interleaved", "mla"] = "split",
    order: HeadOrder = HeadOrder.NHD,
    memory: MemoryType = MemoryType.VRAM,
    device: int = 0,
    group: int = 0,
    first_layer: int = 0,
) -> tuple[Region, ...]:
    """The regions of vLLM-style per-layer KV tensors, one base address each,
    layers numbered from ``first_layer``. ``packing``: ``"split"`` is ``(2,
    num_blocks, ...)`` (V at ``base + num_blocks * block_len``), ``"interleaved"``
    ``(num_blocks, 2, ...)`` (stride ``2 * block_len``), ``"mla"`` one region."""
    if packing not in ("split", "interleaved", "mla"):
        raise ConfigError(f"packing must be split, interleaved or mla, got {packing!r}")
    block_len = tokens_per_block * num_heads * head_bytes
    shared: dict[str, Any] = {
        "num_blocks": num_blocks,
        "block_len": block_len,
        "tokens_per_block": tokens_per_block,
        "num_heads": num_heads,
        "head_start": head_start,
        "head_bytes": head_bytes,
        "order": order,
        "memory": memory,
        "device": device,
        "group": group,
    }
    regions: list[Region] = []
    for i, base in enumerate(layer_bases):
        places: tuple[tuple[str, int, int], ...]
        if packing == "split":
            places = (("K", base, block_len), ("V", base + num_blocks * block_len, block_len))
        elif packing == "interleaved":
            places = (("K", base, 2 * block_len), ("V", base + block_len, 2 * block_len))
        else:
            places = (("MLA", base, block_len),)
        for kind, at, stride in places:
            regions.append(
                Region(layer=first_layer + i, kind=kind, base=at, block_stride=stride, **shared)
            )
    return tuple(regions)


def _region_from_wire(i: int, item: object) -> Region:
    if not isinstance(item, dict) or set(item) != set(_REGION_KEYS):
        raise RemoteProtocolError(
            f"KV layout region {i} must be a dict with keys {', '.join(sorted(_REGION_KEYS))}"
        )
    for key in _REGION_KEYS:
        if key in ("kind", "order", "memory"):
            if type(item[key]) is not str:
                raise RemoteProtocolError(f"KV layout region {i}: {key} must be a str")
        elif type(item[key]) is not int:
            raise RemoteProtocolError(f"KV layout region {i}: {key} must be an int")
    try:
        order = HeadOrder(item["order"])
        memory = MemoryType(item["memory"])
    except ValueError:
        raise RemoteProtocolError(
            f"KV layout region {i}: unknown order {item['order']!r} or memory {item['memory']!r}"
        ) from None
    try:
        return Region(**{**item, "order": order, "memory": memory})
    except ConfigError as exc:
        raise RemoteProtocolError(f"KV layout region {i}: {exc}") from None


_REGION_KEYS = tuple(f.name for f in fields(Region))
_LAYOUT_KEYS = frozenset(("version", "regions", "staging"))
