"""A :class:`~kvpush.runtime.Transport` over POSIX shared memory (one machine).

Each rank owns one segment holding its KV cache; layout addresses are byte
offsets into it (DRAM, device 0). A WRITE is one numpy slice copy per row
straight into the peer's attached segment, done before :meth:`ShmTransport.write`
returns. Its notice follows in a *mailbox*: a single-producer ring per (writer,
target) pair, created by the writer under a name the target computes from the
writer's metadata and attaches lazily. Records carry a sequence number (no
loss, no reorder) and, with ``verify=True``, the CRC32 of the bytes sent and
their destination rows, which the target recomputes when it polls: a mismatch
means a notice overtook its data (see ``_ring`` for the memory-ordering
argument) and fails the transport for good. Verification relies on kvpush's
guarantee that destination blocks are not rewritten before their notice is
polled. Refusals are :class:`TransportError`, raised before anything is copied.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import secrets
import time
from collections import deque
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, NoReturn

import msgpack

from kvpush.protocol import MAX_ID_LEN, ConfigError, KVLayout, MemoryType, Region, Staging
from kvpush.runtime import Completed, Descriptors, Notice, Transport, TransportError

from ._ring import (
    MAX_PAYLOAD,
    MIN_CAPACITY,
    NAME_RE,
    U8,
    RingReader,
    RingWriter,
    Segment,
    check_rows,
    copy_rows,
    crc_rows,
)

__all__ = ("DEFAULT_MAILBOX_BYTES", "ShmTransport")

#: Default capacity of one (writer, target) mailbox: ~30,000 notices without
#: verification rows (each row adds 16 bytes when ``verify=True``).
DEFAULT_MAILBOX_BYTES = 4 << 20

_META_KIND = "kvpush.shm"
_META_VERSION = 1
_META_KEYS = frozenset(("kind", "version", "agent", "instance", "segment", "size", "rings"))
_NONCE_BYTES = 16


def _ring_name(prefix: str, target: str, instance: bytes) -> str:
    """The mailbox a writer with ring ``prefix`` creates for one target instance."""
    digest = hashlib.blake2b(target.encode() + b"\0" + instance, digest_size=4).hexdigest()
    return f"{prefix}_{digest}"


@dataclass(frozen=True, slots=True)
class _PeerInfo:
    """The metadata's fields after ``kind`` and ``version``, in wire order."""

    agent: str
    instance: bytes
    segment: str
    size: int
    rings: str


def _decode_metadata(data: bytes) -> _PeerInfo:
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > 4096:
        raise TransportError("shared-memory metadata must be bytes of at most 4096")
    try:
        obj: Any = msgpack.unpackb(
            bytes(data),
            raw=False,
            max_str_len=4 * MAX_ID_LEN,
            max_bin_len=64,
            max_array_len=0,
            max_map_len=len(_META_KEYS),
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack documents "other exceptions can be raised"
        raise TransportError(f"malformed shared-memory metadata: {exc}") from None
    if not isinstance(obj, dict) or set(obj) != _META_KEYS or obj["kind"] != _META_KIND:
        raise TransportError("not kvpush shared-memory metadata")
    if obj["version"] != _META_VERSION:
        raise TransportError(f"shared-memory metadata version {obj['version']!r:.20} unsupported")
    agent, instance, size = obj["agent"], obj["instance"], obj["size"]
    if type(agent) is not str or not 1 <= len(agent.encode()) <= MAX_ID_LEN:
        raise TransportError("shared-memory metadata: bad agent name")
    if type(instance) is not bytes or len(instance) != _NONCE_BYTES:
        raise TransportError("shared-memory metadata: bad instance nonce")
    if type(size) is not int or not 1 <= size < 1 << 62:
        raise TransportError("shared-memory metadata: bad segment size")
    for key in ("segment", "rings"):
        if type(obj[key]) is not str or not NAME_RE.fullmatch(obj[key]):
            raise TransportError(f"shared-memory metadata: bad {key} name")
    return _PeerInfo(agent, instance, obj["segment"], size, obj["rings"])


@dataclass(slots=True, eq=False)
class _Peer:
    info: _PeerInfo
    segment: Segment
    outbox: RingWriter
    inbox_name: str
    inbox: RingReader | None = None


@dataclass(frozen=True, slots=True)
class _Op:
    """A rate-limited op waiting for its turn: a write (``notice`` bytes, its
    mailbox record ``need`` bytes) or a read (``notice`` None)."""

    local: Descriptors
    remote: Descriptors
    notice: bytes | None
    need: int


class ShmTransport:
    """One rank's data plane over POSIX shared memory; not thread-safe.

    Creates a segment of ``size`` bytes (``name``, or a random ``kvp...``);
    ``create=False`` attaches to segment ``name`` and never unlinks it.
    ``verify`` checks every write's CRC on both ends. ``link_gbps`` models a
    link: ops take turns (FIFO) and each moves at the first :meth:`poll` after
    its wire time (``None``: at once)."""

    def __init__(
        self,
        agent: str,
        size: int,
        *,
        create: bool = True,
        name: str | None = None,
        verify: bool = False,
        mailbox_bytes: int = DEFAULT_MAILBOX_BYTES,
        link_gbps: float | None = None,
    ) -> None:
        if link_gbps is not None and (
            isinstance(link_gbps, bool)
            or not isinstance(link_gbps, (int, float))
            or not (math.isfinite(link_gbps) and link_gbps > 0)
        ):
            raise ConfigError(f"link_gbps must be a positive number or None, got {link_gbps!r}")
        if type(agent) is not str or not 1 <= len(agent.encode()) <= MAX_ID_LEN:
            raise ConfigError(f"agent must be a non-empty str of at most {MAX_ID_LEN} bytes")
        if type(size) is not int or not 1 <= size < 1 << 62:
            raise ConfigError(f"size must be a positive int, got {size!r}")
        if type(mailbox_bytes) is not int or mailbox_bytes < MIN_CAPACITY or mailbox_bytes % 8:
            raise ConfigError(f"mailbox_bytes must be a multiple of 8 >= {MIN_CAPACITY}")
        if name is not None and (type(name) is not str or not NAME_RE.fullmatch(name)):
            raise ConfigError(f"name must match {NAME_RE.pattern}, got {name!r:.40}")
        self._agent = agent
        self._verify = bool(verify)
        self._mailbox_bytes = mailbox_bytes
        self._instance = secrets.token_bytes(_NONCE_BYTES)
        if create:
            seg_name = name if name is not None else "kvp" + secrets.token_hex(5)
            self._segment = Segment.create(seg_name, size)
        elif name is None:
            raise ConfigError("create=False needs the name of the segment to attach")
        else:
            self._segment = Segment.attach(name, size)
        self._ring_prefix = f"{self._segment.name}_{self._instance.hex()[:6]}"
        self._peers: dict[str, _Peer] = {}
        self._posted: dict[int, str] = {}
        self._failed: list[Completed] = []
        self._handles = itertools.count(1)
        self._layout: KVLayout | None = None
        self._closed = False
        self._failure: str | None = None
        self._rate = None if link_gbps is None else link_gbps * 1e9 / 8  # bytes/s
        self._link_free = 0.0
        self._queued: deque[tuple[float, int, str, _Op]] = deque()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "failed" if self._failure else "open"
        return (
            f"ShmTransport(agent={self._agent!r}, segment={self._segment.name!r}, "
            f"size={self._segment.size}, peers={len(self._peers)}, {state})"
        )

    def __enter__(self) -> ShmTransport:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def agent(self) -> str:
        return self._agent

    @property
    def segment_name(self) -> str:
        """The name of this rank's KV segment (attach with ``create=False``)."""
        return self._segment.name

    @property
    def size(self) -> int:
        return self._segment.size

    @property
    def memory(self) -> U8:
        """The whole KV segment as a writable ``uint8`` array (offsets are addresses)."""
        self._check_open()
        return self._segment.array

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    @property
    def verify(self) -> bool:
        return self._verify

    def register(self, layout: KVLayout) -> None:
        """Check that ``layout`` is DRAM, device 0, inside the segment, and unchanged."""
        self._check_open()
        if not isinstance(layout, KVLayout):
            raise TransportError(f"register needs a KVLayout, got {type(layout).__name__}")
        places: list[tuple[str, Region | Staging, int]] = [
            (f"region {r.name}", r, r.base + r.extent) for r in layout.regions
        ]
        if layout.staging is not None:
            st = layout.staging
            places.append(("the staging pool", st, st.base + st.nbytes))
        for what, where, end in places:
            if where.memory is not MemoryType.DRAM or where.device != 0:
                raise TransportError(
                    f"{what} is {where.memory.value} device {where.device}: shared memory "
                    "holds DRAM, device 0 only"
                )
            if end > self._segment.size:
                raise TransportError(
                    f"{what} [{where.base}, {end}) does not fit in the "
                    f"{self._segment.size}-byte segment {self._segment.name!r}"
                )
        if self._layout is not None and self._layout != layout:
            raise TransportError("a different KV layout is already registered")
        self._layout = layout

    def metadata(self) -> bytes:
        """msgpack: agent, instance nonce, segment name and size, mailbox prefix."""
        self._check_open()
        seg = self._segment
        info = _PeerInfo(self._agent, self._instance, seg.name, seg.size, self._ring_prefix)
        head = {"kind": _META_KIND, "version": _META_VERSION}
        packed: bytes = msgpack.packb({**head, **asdict(info)}, use_bin_type=True)
        return packed

    def add_peer(self, metadata: bytes, layout: KVLayout | None = None) -> str:
        """Attach a peer's segment, create our mailbox to it; returns its agent.
        A new instance of a known agent replaces it (its posted transfers fail)."""
        self._check_usable()
        info = _decode_metadata(metadata)
        old = self._peers.get(info.agent)
        if old is not None:
            if old.info.instance == info.instance:
                return info.agent
            self._drop(old, f"peer {info.agent!r} restarted")
        segment = Segment.attach(info.segment, info.size)
        try:
            outbox_name = _ring_name(self._ring_prefix, info.agent, info.instance)
            outbox = RingWriter(outbox_name, self._mailbox_bytes, self._instance)
        except BaseException:
            segment.close()
            raise
        inbox_name = _ring_name(info.rings, self._agent, self._instance)
        peer = _Peer(info, segment, outbox, inbox_name, RingReader.try_attach(inbox_name))
        self._peers[info.agent] = peer
        return info.agent

    def remove_peer(self, agent: str) -> None:
        """Detach ``agent`` (no-op if unknown); its unpolled transfers fail."""
        peer = self._peers.get(agent)
        if peer is not None:
            self._drop(peer, f"peer {agent!r} was removed")

    def write(self, agent: str, src: Descriptors, dst: Descriptors, notice: bytes) -> int:
        """Copy local ``src`` rows into ``agent``'s ``dst`` rows, then post
        ``notice`` to its mailbox. Refused (nothing copied) if a row is out of
        bounds or the mailbox lacks room ("mailbox full": poll and retry)."""
        self._check_usable()
        peer = self._peer(agent)
        if not isinstance(notice, (bytes, bytearray)) or len(notice) > MAX_PAYLOAD:
            raise TransportError(f"notice must be bytes of at most {MAX_PAYLOAD}")
        s, d = self._pair(src, dst, self._segment, peer.segment)
        outbox = peer.outbox
        need = RingWriter.record_size(len(notice), d.shape[0] if self._verify else 0)
        if need > outbox.capacity:
            raise TransportError(
                f"a notice with {d.shape[0]} verification rows needs {need} bytes, more than "
                f"the {outbox.capacity}-byte mailbox: raise mailbox_bytes or turn verify off"
            )
        if self._rate is not None:
            return self._queue(agent, _Op(s, d, bytes(notice), need))
        if need > outbox.free():
            raise TransportError(f"mailbox full to {agent!r} (the target must poll; retry)")
        self._write_now(peer, s, d, bytes(notice))
        return self._post(agent)

    def _write_now(self, peer: _Peer, s: Descriptors, d: Descriptors, notice: bytes) -> None:
        local = self._segment.array
        copy_rows(peer.segment.array, d, local, s)
        crc = crc_rows(local, s.tolist()) if self._verify else None
        peer.outbox.append(notice, crc, d if self._verify else None)

    def read(self, agent: str, local: Descriptors, remote: Descriptors) -> int:
        """Copy ``agent``'s ``remote`` rows into local ``local`` rows (no notice)."""
        self._check_usable()
        peer = self._peer(agent)
        l_rows, r_rows = self._pair(local, remote, self._segment, peer.segment)
        if self._rate is not None:
            return self._queue(agent, _Op(l_rows, r_rows, None, 0))
        copy_rows(self._segment.array, l_rows, peer.segment.array, r_rows)
        return self._post(agent)

    def _queue(self, agent: str, op: _Op) -> int:
        assert self._rate is not None
        nbytes = int(op.local[:, 1].sum()) if op.local.shape[0] else 0
        due = max(time.monotonic(), self._link_free) + nbytes / self._rate
        self._link_free = due
        handle = next(self._handles)
        self._queued.append((due, handle, agent, op))
        return handle

    def _deliver(self) -> None:
        """Carry out the queued ops whose wire time has passed, in order. A full
        mailbox holds the op (and the ones behind it) until the target polls."""
        now = time.monotonic()
        while self._queued and self._queued[0][0] <= now:
            _, handle, agent, op = self._queued[0]
            peer = self._peers[agent]
            if op.notice is None:
                copy_rows(self._segment.array, op.local, peer.segment.array, op.remote)
            elif op.need > peer.outbox.free():
                return
            else:
                self._write_now(peer, op.local, op.remote, op.notice)
            self._queued.popleft()
            self._posted[handle] = agent

    def cancel(self, handle: int) -> bool:
        """A write here copies its bytes when posted: nothing of it can move
        any more, and the next poll reports it as it went."""
        return True

    def poll(self) -> tuple[list[Completed], list[Notice]]:
        """Settled transfers (in handle order) and the notices that arrived.
        Never blocks. Raises :class:`TransportError` (and fails the transport)
        if a mailbox is corrupt, loses or reorders a notice, or, with
        ``verify``, a notice arrived before its data."""
        self._check_usable()
        self._deliver()
        notices: list[Notice] = []
        memory = self._segment.array
        for peer in list(self._peers.values()):
            inbox = peer.inbox
            if inbox is None:
                inbox = peer.inbox = RingReader.try_attach(peer.inbox_name)
                if inbox is None:
                    continue
            try:
                records, closed = inbox.drain(self._segment.size)
            except TransportError as exc:
                self._fail(str(exc))
            for rec in records:
                if self._verify and rec.crc is not None and rec.rows is not None:
                    actual = crc_rows(memory, rec.rows.tolist())
                    if actual != rec.crc:
                        self._fail(
                            f"notice {rec.seq} from {peer.info.agent!r} arrived before its data "
                            f"(CRC32 {actual:#010x} of the destination, {rec.crc:#010x} sent)"
                        )
                if rec.payload:  # b"": a write without a notice (checked all the same)
                    notices.append(Notice(peer.info.agent, rec.payload))
            inbox.consume(records)
            if closed:  # the writer dropped us; a new mailbox may appear later
                inbox.close()
                peer.inbox = None
        completed = self._failed + [Completed(h) for h in self._posted]
        self._failed, self._posted = [], {}
        completed.sort(key=lambda c: c.handle)
        return completed, notices

    def close(self) -> None:
        """Detach every peer, unlink what we created, unmap; idempotent."""
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers.values()):
            self._drop(peer, "transport closed")
        self._failed.clear()
        self._segment.unlink()
        self._segment.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self._agent!r} is closed")

    def _check_usable(self) -> None:
        self._check_open()
        if self._failure is not None:
            raise TransportError(f"transport {self._agent!r} failed: {self._failure}")

    def _fail(self, reason: str) -> NoReturn:
        self._failure = reason
        raise TransportError(reason)

    def _peer(self, agent: str) -> _Peer:
        peer = self._peers.get(agent)
        if peer is None:
            raise TransportError(f"unknown peer {agent!r}")
        return peer

    @staticmethod
    def _pair(
        a: Descriptors, b: Descriptors, seg_a: Segment, seg_b: Segment
    ) -> tuple[Descriptors, Descriptors]:
        rows_a = check_rows(a, "local rows", seg_a)
        rows_b = check_rows(b, "remote rows", seg_b)
        if rows_a.shape != rows_b.shape or bool((rows_a[:, 1] != rows_b[:, 1]).any()):
            raise TransportError("local and remote rows differ in count or lengths")
        return rows_a, rows_b

    def _post(self, agent: str) -> int:
        handle = next(self._handles)
        self._posted[handle] = agent
        return handle

    def _drop(self, peer: _Peer, reason: str) -> None:
        agent = peer.info.agent
        del self._peers[agent]
        for handle in [h for h, a in self._posted.items() if a == agent]:
            del self._posted[handle]
            self._failed.append(Completed(handle, reason))
        for item in [q for q in self._queued if q[2] == agent]:
            self._queued.remove(item)
            self._failed.append(Completed(item[1], reason))
        peer.outbox.close()
        if peer.inbox is not None:
            peer.inbox.close()
        peer.segment.close()


_IS_A_TRANSPORT: type[Transport] = ShmTransport  # mypy checks the Protocol
