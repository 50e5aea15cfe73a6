"""POSIX shared-memory segments and the single-producer mailbox ring.

A :class:`Segment` is opened with ``shm_open`` and ``mmap`` directly rather
than through :class:`multiprocessing.shared_memory.SharedMemory`, for two
reasons. (1) Before Python 3.13, *attaching* to a segment registers it
with the resource tracker, which then unlinks it (with a warning) when the
attaching process exits; the usual fix, unregistering right after attaching,
is wrong when the creator shares the tracker (the same process, or a
``spawn`` child, which inherits its parent's tracker): the tracker keeps a
*set* of names, so the attacher's unregister also drops the creator's
registration. Here only the creator registers (so a crashed creator's
segment is still unlinked when the tracker exits) and attachments never do.
(2) ``SharedMemory.close`` raises :class:`BufferError` while numpy views of
its buffer are alive, also from ``__del__``; a :class:`Segment` whose views
are still held leaves the unmapping to the garbage collector instead.

Memory ordering. The writer stores the transfer's data, then the record, then
the 8-byte aligned ``write_pos`` index, each from one thread, in program order
(the data copy has *returned* before the record is written; CPython runs the
statements in order and numpy's copy is a plain ``memcpy``). x86-64 is TSO:
stores become visible to other cores in program order and loads are not
reordered with older loads, so a reader that sees the new ``write_pos`` (one
aligned 8-byte load, never torn) and then reads the record and the data sees
both complete. The reader symmetrically reads the record before it stores
``read_pos``, and loads are not reordered with later stores, so the writer
never overwrites a record still being read. On weakly ordered CPUs (aarch64)
Python code has no fence to offer, so this is not guaranteed there; the
receiver's CRC check (``verify=True``) is how such a violation would show.
"""

from __future__ import annotations

import contextlib
import importlib
import mmap
import os
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvpush.runtime import Descriptors, TransportError

__all__ = (
    "MAX_PAYLOAD",
    "NAME_RE",
    "Record",
    "RingReader",
    "RingWriter",
    "Segment",
    "check_rows",
    "copy_rows",
    "crc_rows",
    "posix_shm",
)

#: Shared-memory names this module creates or accepts (no ``/``, bounded).
NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}")
#: Largest notice payload one record may carry.
MAX_PAYLOAD = 1 << 16

U8 = NDArray[np.uint8]
U64 = NDArray[np.uint64]

_RING_MAGIC = b"KVPRING1"
# Header: magic, capacity at 0..16 (set once by the writer, magic last);
# writer-owned write_pos and closed flag on their own cache line at 64;
# reader-owned read_pos and next expected sequence number at 128; data at 192.
_OFF_CAPACITY = 8
_OFF_WRITE, _OFF_CLOSED = 64 // 8, 72 // 8
_OFF_READ, _OFF_SEQ = 128 // 8, 136 // 8
_HEADER = 192
# seq u64, record length, payload length, row count, crc32, flags, reserved (u32 each).
_REC = struct.Struct("<QIIIIII")
_FLAG_CRC = 0x1
_ROW = np.dtype("<u8")
#: Smallest accepted mailbox capacity (bytes).
MIN_CAPACITY = 4096


def posix_shm() -> Any:
    """CPython's POSIX shared-memory module (no typeshed stubs; POSIX only)."""
    try:
        return importlib.import_module("_posixshmem")
    except ImportError:  # pragma: no cover - Windows
        raise TransportError("ShmTransport needs POSIX shared memory") from None


class Segment:
    """One named shared-memory object, mapped whole; only an ``owner`` unlinks it."""

    __slots__ = ("_array", "_map", "_unlinked", "name", "owner", "size")

    def __init__(self, name: str, size: int, owner: bool, fd: int) -> None:
        self.name, self.size, self.owner = name, size, owner
        self._unlinked = False
        try:
            self._map: mmap.mmap | None = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._array: U8 | None = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Create segment ``name`` of ``size`` bytes (refused if it exists)."""
        shm = posix_shm()
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
        try:
            fd: int = shm.shm_open("/" + name, flags, mode=0o600)
        except FileExistsError:
            raise TransportError(f"shared memory {name!r} already exists") from None
        except OSError as exc:
            raise TransportError(f"cannot create shared memory {name!r}: {exc}") from None
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            os.close(fd)
            shm.shm_unlink("/" + name)
            raise TransportError(f"cannot size shared memory {name!r}: {exc}") from None
        # Registered so that the tracker unlinks it if this process dies unclosed.
        resource_tracker.register("/" + name, "shared_memory")
        try:
            return cls(name, size, True, fd)
        except BaseException:
            shm.shm_unlink("/" + name)
            resource_tracker.unregister("/" + name, "shared_memory")
            raise

    @classmethod
    def attach(cls, name: str, size: int | None = None) -> Segment:
        """Map existing segment ``name`` (its first ``size`` bytes, default all)."""
        try:
            fd: int = posix_shm().shm_open("/" + name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            raise TransportError(f"no shared memory named {name!r}") from None
        except OSError as exc:
            raise TransportError(f"cannot open shared memory {name!r}: {exc}") from None
        actual = os.fstat(fd).st_size
        want = actual if size is None else size
        if want < 1 or actual < want:
            os.close(fd)
            raise TransportError(
                f"shared memory {name!r} holds {actual} bytes, expected at least {max(want, 1)}"
            )
        return cls(name, want, False, fd)

    @property
    def array(self) -> U8:
        """The whole segment as a writable ``uint8`` array."""
        if self._array is None:
            raise TransportError(f"shared memory {self.name!r} is closed")
        return self._array

    @property
    def closed(self) -> bool:
        return self._array is None

    def unlink(self) -> None:
        """Remove the name (owners only; idempotent). Mappings stay valid."""
        if not self.owner or self._unlinked:
            return
        self._unlinked = True
        with contextlib.suppress(FileNotFoundError):  # someone else removed it already
            posix_shm().shm_unlink("/" + self.name)
        resource_tracker.unregister("/" + self.name, "shared_memory")

    def close(self) -> None:
        """Unmap (idempotent). If numpy views of :attr:`array` are still alive
        the mapping stays until they are collected (never a dangling view)."""
        mapping, self._map, self._array = self._map, None, None
        if mapping is not None:
            with contextlib.suppress(BufferError):  # views held: the GC unmaps with the last
                mapping.close()


def crc_rows(memory: U8, rows: Sequence[Sequence[int]]) -> int:
    """CRC32 of ``memory`` over ``(offset, length, ...)`` rows, in order."""
    crc = 0
    for row in rows:
        off, n = row[0], row[1]
        crc = zlib.crc32(memory[off : off + n].data, crc)
    return crc


def check_rows(desc: Descriptors, what: str, segment: Segment) -> U64:
    """``desc`` as ``(N, 3)`` uint64 rows inside ``segment`` (else TransportError)."""
    if not isinstance(desc, np.ndarray) or desc.ndim != 2 or desc.shape[1] != 3:
        raise TransportError(f"{what} must be an (N, 3) array of (offset, length, device)")
    if desc.dtype.kind not in "iu" or (desc.dtype.kind == "i" and bool((desc < 0).any())):
        raise TransportError(f"{what} must hold non-negative integers")
    rows: U64 = desc.astype(np.uint64, copy=False)
    if not rows.shape[0]:
        return rows
    if bool((rows[:, 2] != 0).any()):
        raise TransportError(f"{what}: shared memory is device 0, got another device id")
    off, n, limit = rows[:, 0], rows[:, 1], segment.size
    bad = (off > limit) | (n > limit - np.minimum(off, limit))
    if bool(bad.any()):
        i = int(np.argmax(bad))
        raise TransportError(
            f"{what} row {i} [{int(off[i])}, +{int(n[i])}) is outside the {limit}-byte "
            f"segment {segment.name!r}"
        )
    return rows


def copy_rows(dst: U8, dst_rows: U64, src: U8, src_rows: U64) -> None:
    """One slice copy per row (the planner already merged adjacent rows)."""
    for (s, n, _), (d, _, _) in zip(src_rows.tolist(), dst_rows.tolist(), strict=True):
        if n:
            dst[d : d + n] = src[s : s + n]


@dataclass(frozen=True, slots=True)
class Record:
    """One mailbox entry as read: ``rows`` are the writer's destination rows
    ``(offset, length)`` and ``crc`` their CRC32, or both ``None``."""

    seq: int
    #: Bytes the record occupies in the ring.
    size: int
    payload: bytes
    crc: int | None
    rows: U64 | None


class _Ring:
    __slots__ = ("_data", "_idx", "capacity", "segment")

    def __init__(self, segment: Segment, capacity: int) -> None:
        self.segment, self.capacity = segment, capacity
        arr = segment.array
        self._idx: U64 = arr[:_HEADER].view(np.uint64)
        self._data: U8 = arr[_HEADER : _HEADER + capacity]

    @property
    def name(self) -> str:
        return self.segment.name

    def _release(self) -> None:  # drop the views into the mapping
        self._idx = np.zeros(_HEADER // 8, dtype=np.uint64)
        self._data = np.zeros(0, dtype=np.uint8)


class RingWriter(_Ring):
    """The writing end; creates the ring segment and unlinks it on :meth:`close`."""

    __slots__ = ("_next_seq",)

    def __init__(self, name: str, capacity: int, nonce: bytes) -> None:
        if capacity < MIN_CAPACITY or capacity % 8:
            raise TransportError(f"mailbox capacity must be a multiple of 8 >= {MIN_CAPACITY}")
        segment = Segment.create(name, _HEADER + capacity)
        super().__init__(segment, capacity)
        self._next_seq = 1
        arr = segment.array
        arr[16:32] = np.frombuffer(nonce[:16].ljust(16, b"\0"), dtype=np.uint8)
        self._idx[_OFF_CAPACITY // 8] = capacity
        arr[:8] = np.frombuffer(_RING_MAGIC, dtype=np.uint8)  # last: the ring is ready

    def free(self) -> int:
        used = int(self._idx[_OFF_WRITE]) - int(self._idx[_OFF_READ])
        if not 0 <= used <= self.capacity:
            raise TransportError(f"mailbox {self.name!r} is corrupt (used {used})")
        return self.capacity - used

    @staticmethod
    def record_size(payload: int, rows: int) -> int:
        return (_REC.size + payload + 16 * rows + 7) & ~7

    def append(self, payload: bytes, crc: int | None, rows: U64 | None) -> int:
        """Publish one record; the caller checked :meth:`free` (space only grows)."""
        nrows = 0 if rows is None else int(rows.shape[0])
        size = self.record_size(len(payload), nrows)
        flags = 0 if crc is None else _FLAG_CRC
        seq = self._next_seq
        head = _REC.pack(seq, size, len(payload), nrows, crc or 0, flags, 0)
        body = head + payload
        if rows is not None:
            body += np.ascontiguousarray(rows[:, :2], dtype=_ROW).tobytes()
        body = body.ljust(size, b"\0")
        pos = int(self._idx[_OFF_WRITE])
        start = pos % self.capacity
        first = min(size, self.capacity - start)
        src = np.frombuffer(body, dtype=np.uint8)
        self._data[start : start + first] = src[:first]
        if first < size:
            self._data[: size - first] = src[first:]
        self._idx[_OFF_WRITE] = pos + size  # publish: one aligned 8-byte store, last
        self._next_seq = seq + 1
        return seq

    def close(self) -> None:
        """Mark the ring closed (the reader detaches after draining); idempotent."""
        if not self.segment.closed:
            self._idx[_OFF_CLOSED] = 1
            self._release()
        self.segment.unlink()
        self.segment.close()


class RingReader(_Ring):
    """The reading end of a ring another transport created."""

    __slots__ = ()

    @classmethod
    def try_attach(cls, name: str) -> RingReader | None:
        """The ring ``name`` if it exists and is initialised, else ``None``."""
        try:
            segment = Segment.attach(name)
        except TransportError:
            return None
        arr = segment.array
        ok = segment.size > _HEADER and bytes(arr[:8]) == _RING_MAGIC
        capacity = int(arr[:_HEADER].view(np.uint64)[_OFF_CAPACITY // 8]) if ok else 0
        del arr
        if not ok or capacity != segment.size - _HEADER:
            segment.close()
            return None
        return cls(segment, capacity)

    @property
    def closed(self) -> bool:
        return bool(self._idx[_OFF_CLOSED])

    def _read(self, pos: int, n: int) -> bytes:
        start = pos % self.capacity
        first = min(n, self.capacity - start)
        out = self._data[start : start + first].tobytes()
        if first < n:
            out += self._data[: n - first].tobytes()
        return out

    def drain(self, memory_size: int) -> tuple[list[Record], bool]:
        """Every published record, in order, and whether the writer closed the
        ring (then nothing more will come). Raises :class:`TransportError` for
        a malformed record or a sequence gap; nothing past it is consumed."""
        closed = self.closed  # before write_pos: a closed ring's index is final
        end = int(self._idx[_OFF_WRITE])
        pos = int(self._idx[_OFF_READ])
        expect = int(self._idx[_OFF_SEQ]) or 1
        if not 0 <= end - pos <= self.capacity:
            raise TransportError(f"mailbox {self.name!r} is corrupt (read {pos}, write {end})")
        records: list[Record] = []
        while pos < end:
            if end - pos < _REC.size:
                raise TransportError(f"mailbox {self.name!r}: truncated record at {pos}")
            seq, size, plen, nrows, crc, flags, _ = _REC.unpack(self._read(pos, _REC.size))
            if (
                size % 8
                or size > end - pos
                or plen > MAX_PAYLOAD
                or _REC.size + plen + 16 * nrows > size
                or flags & ~_FLAG_CRC
                or (nrows and not flags & _FLAG_CRC)
            ):
                raise TransportError(f"mailbox {self.name!r}: malformed record at {pos}")
            if seq != expect:
                raise TransportError(
                    f"mailbox {self.name!r}: notice sequence {seq} where {expect} was due "
                    "(a notice was lost or reordered)"
                )
            body = self._read(pos + _REC.size, plen + 16 * nrows)
            rows: U64 | None = None
            if flags & _FLAG_CRC:
                rows = np.frombuffer(body, dtype=_ROW, offset=plen).reshape(nrows, 2)
                rows = rows.astype(np.uint64)
                bad = (rows[:, 0] > memory_size) | (rows[:, 1] > memory_size - rows[:, 0])
                if rows.size and bad.any():
                    raise TransportError(
                        f"mailbox {self.name!r}: record {seq} names rows outside this segment"
                    )
            records.append(Record(seq, size, body[:plen], crc if flags & _FLAG_CRC else None, rows))
            pos += size
            expect += 1
        return records, closed

    def consume(self, records: Sequence[Record]) -> None:
        """Free the space of ``records``: a prefix of what :meth:`drain` returned."""
        if not records:
            return
        advance = sum(r.size for r in records)
        self._idx[_OFF_SEQ] = records[-1].seq + 1
        self._idx[_OFF_READ] = int(self._idx[_OFF_READ]) + advance  # last: frees the space

    def close(self) -> None:
        """Unmap (the writer owns the name). Idempotent."""
        if not self.segment.closed:
            self._release()
        self.segment.close()
