"""``NixlTransport``: kvpush's data-plane transport over NIXL (one agent per rank).

``agent`` is the logical name (a ``str``, stable across restarts); the NIXL
agent object is ``nixl`` and its name, ``agent#<instance hex>``, a
``nixl_name``. Identity and restarts, posting, progress and threads (why every
method takes a lock and the agent runs in STRICT mode): docs/operations.md.
Handles are our own integers, never NIXL objects.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

import numpy as np

from kvpush.protocol import ConfigError, KVLayout, build_options
from kvpush.runtime import Completed, Descriptors, Indices, Notice, PreppedTransport, TransportError

from ._agent import Handle, NixlAgent
from ._books import Notices, Transfers
from ._memory import MemoryMap, check_rows, explained, layout_spans
from ._meta import decode_metadata, encode_metadata, new_instance, nixl_name
from ._options import NixlOptions, PrepRule
from ._prepped import Prepped, check_indices, explain_indices, prepare
from ._ucx import apply_vram_defaults

__all__ = ("MAX_NOTICE_BYTES", "NixlTransport")

log = logging.getLogger("kvpush.nixl")

#: Largest notice accepted (kvpush's completion notices are ~100 bytes).
MAX_NOTICE_BYTES = 1 << 16

BackendParams = Mapping[str, Mapping[str, "str | int | bool | Sequence[str | int]"]]


@dataclass(slots=True, eq=False)
class _Peer:
    agent: str
    instance: bytes
    nixl_name: str
    memory: MemoryMap
    prepped: dict[object, Prepped]


class NixlTransport:
    """One rank's data plane over NIXL; the options are in docs/operations.md.
    ``vram=True`` sets UCX's VRAM defaults first (``_ucx.py``); ``prep_rule``
    decides :meth:`prefers_prepped` (default: the measured :class:`PrepRule`).

    Bad options raise :class:`~kvpush.protocol.ConfigError`; NIXL missing or
    failing to start, :class:`~kvpush.runtime.TransportError`."""

    def __init__(
        self,
        agent: str,
        *,
        backends: Sequence[str] = ("UCX",),
        backend_params: BackendParams | None = None,
        progress_thread: bool = False,
        sync_mode: Literal["STRICT", "RW"] = "STRICT",
        close_timeout: float = 0.5,
        prep_rule: PrepRule | None = None,
        vram: bool = False,
    ) -> None:
        raw: dict[str, object] = {"agent": agent, "backends": backends, "sync_mode": sync_mode}
        raw.update(backend_params=backend_params, progress_thread=progress_thread)
        raw["close_timeout"] = close_timeout
        params = build_options(NixlOptions, raw, what="NixlTransport").params()
        if vram:  # before the agent: UCX reads its environment when the backend starts
            apply_vram_defaults()
        if prep_rule is not None and not isinstance(prep_rule, PrepRule):
            raise ConfigError(f"prep_rule must be a PrepRule, got {type(prep_rule).__name__}")
        self._agent = agent
        self._instance = new_instance()
        self._nixl = NixlAgent(
            nixl_name(agent, self._instance),
            params,
            progress_thread=progress_thread,
            sync_mode=sync_mode,
        )
        self._close_timeout = float(close_timeout)
        self._rule = prep_rule or PrepRule()
        self._lock = threading.Lock()
        self._closed = False
        self._layout: KVLayout | None = None
        self._memory = MemoryMap(())
        self._registered: list[Handle] = []
        self._peers: dict[str, _Peer] = {}
        self._transfers = Transfers(self._nixl)
        self._notices = Notices(agent)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"NixlTransport(agent={self._agent!r}, nixl={self._nixl.name!r}, "
            f"peers={len(self._peers)}, posted={len(self._transfers)}, {state})"
        )

    def __enter__(self) -> NixlTransport:
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
        """The logical name (stable across restarts)."""
        return self._agent

    @property
    def nixl_agent_name(self) -> str:
        """The NIXL agent's name: ``agent#<instance hex>``."""
        return self._nixl.name

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    @property
    def closed(self) -> bool:
        return self._closed

    def backend_params(self, backend: str) -> dict[str, str]:
        """The init parameters NIXL reports for a created backend."""
        with self._lock:
            self._check_open()
            return self._nixl.backend_params(backend)

    def register(self, layout: KVLayout) -> None:
        """Register each region's memory with NIXL once (type and device from the
        region; overlapping regions as one span). Again with an equal layout: no-op."""
        with self._lock:
            self._check_open()
            if not isinstance(layout, KVLayout):
                raise TransportError(f"register needs a KVLayout, got {type(layout).__name__}")
            if self._layout is not None:
                if self._layout != layout:
                    raise TransportError("a different KV layout is already registered")
                return
            spans = layout_spans(layout)
            self._registered = self._nixl.register(spans)
            self._memory = MemoryMap(spans)
            self._layout = layout

    def metadata(self) -> bytes:
        """msgpack: logical name, instance token, NIXL metadata, registered spans."""
        with self._lock:
            self._check_open()
            if self._layout is None:
                raise TransportError(
                    "register() the KV layout before metadata(): NIXL's metadata lists the "
                    "registered memory a peer may write to or read from"
                )
            return encode_metadata(
                self._agent, self._instance, self._nixl.metadata(), self._memory.spans
            )

    def add_peer(self, metadata: bytes, layout: KVLayout | None = None) -> str:
        """Load a peer's metadata; returns its logical name. The same instance
        again is a no-op; a new instance replaces the old one (its posted
        transfers fail on the next poll, its prepared lists are dropped).
        ``layout``, if given, must lie in the memory the metadata registers.
        Malformed metadata: :class:`TransportError`, nothing changes."""
        with self._lock:
            self._check_open()
            info = decode_metadata(metadata)
            if info.agent == self._agent:
                raise TransportError(f"metadata of {info.agent!r} names this transport's own agent")
            memory = MemoryMap(info.spans)
            if layout is not None:
                if not isinstance(layout, KVLayout):
                    raise TransportError(f"layout must be a KVLayout, got {type(layout).__name__}")
                memory.check_layout(layout, f"peer {info.agent!r}")
            old = self._peers.get(info.agent)
            if old is not None and old.instance == info.instance:
                return info.agent
            loaded = self._nixl.add_remote(info.nixl)
            if loaded != info.nixl_name:
                if loaded not in {p.nixl_name for p in self._peers.values()}:
                    self._nixl.remove_remote(loaded)
                raise TransportError(
                    f"NIXL metadata names agent {loaded!r:.80}, the wrapper {info.nixl_name!r:.80}"
                )
            if old is not None:
                self._drop(old, f"peer {info.agent!r} restarted (new instance)")
            self._peers[info.agent] = _Peer(info.agent, info.instance, loaded, memory, {})
            self._notices.admit(info.agent, loaded)
            return info.agent

    def remove_peer(self, agent: str) -> None:
        """Forget ``agent`` (no-op if unknown); its posted transfers fail."""
        with self._lock:
            peer = self._peers.get(agent)
            if peer is not None and not self._closed:
                self._drop(peer, f"peer {agent!r} was removed")

    def write(self, agent: str, src: Descriptors, dst: Descriptors, notice: bytes) -> int:
        """Post a WRITE of local ``src`` rows to ``agent``'s ``dst`` rows with
        ``notice`` (delivered after the data). Zero rows: the notice alone."""
        with self._lock:
            return self._post_rows("WRITE", agent, src, dst, notice)

    def read(self, agent: str, local: Descriptors, remote: Descriptors) -> int:
        """Post a READ of ``agent``'s ``remote`` rows into local ``local`` rows."""
        with self._lock:
            return self._post_rows("READ", agent, local, remote, None)

    def poll(self) -> tuple[list[Completed], list[Notice]]:
        """Settled transfers (by handle) and arrived notices. Never blocks."""
        with self._lock:
            self._check_open()
            completed = self._transfers.poll()
            try:
                arrived = self._nixl.notifs()
            except TransportError as exc:  # not seen in practice; the next poll retries
                log.warning("%s: %s", self._agent, exc)
                arrived = {}
            return completed, self._notices.sort(arrived, self._current)

    def cancel(self, handle: int) -> bool:
        """Cancel a posted transfer (NIXL releases a running one): True once
        nothing of it can move any more, False if NIXL would not."""
        with self._lock:
            self._check_open()
            return self._transfers.cancel(handle)

    def prefers_prepped(self, merged_rows: int, pieces: int) -> bool:
        """Whether posting by index beats posting merged rows (see ``PrepRule``)."""
        return self._rule.prefers_prepped(merged_rows, pieces)

    def prep(self, agent: str, key: object, local: Descriptors, remote: Descriptors) -> None:
        """Prepare local rows and ``agent``'s rows under ``key`` (replacing it)."""
        with self._lock:
            peer = self._usable_peer(agent)
            try:
                hash(key)
            except TypeError:
                raise TransportError(
                    f"prep key must be hashable, got {type(key).__name__}"
                ) from None
            prepped = prepare(
                self._nixl, peer.nixl_name, local, remote, self._local_memory(), peer.memory
            )
            old = peer.prepped.get(key)
            peer.prepped[key] = prepped
            if old is not None:
                self._release_prepped(old)

    def write_prepped(
        self, agent: str, key: object, local: Indices, remote: Indices, notice: bytes
    ) -> int:
        """:meth:`write` by index into the lists prepared under ``key``."""
        with self._lock:
            return self._post_index("WRITE", agent, key, local, remote, notice)

    def read_prepped(self, agent: str, key: object, local: Indices, remote: Indices) -> int:
        """:meth:`read` by index into the lists prepared under ``key``."""
        with self._lock:
            return self._post_index("READ", agent, key, local, remote, None)

    def close(self) -> None:
        """Release everything: posted transfers (cancelled; those NIXL cannot
        cancel get up to ``close_timeout`` s of progress), prepared lists,
        remote agents, memory registrations, the agent. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stuck = self._transfers.close(self._close_timeout)
            if stuck:
                log.warning("%s: NIXL would not release %d transfer(s)", self._agent, stuck)
            for peer in list(self._peers.values()):
                self._drop(peer, "transport closed")
            for reg in self._registered:
                failure = self._nixl.deregister(reg)
                if failure is not None:
                    log.warning("%s: deregistering memory failed: %s", self._agent, failure)
            self._registered.clear()
            self._notices.clear()
            self._nixl.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self._agent!r} is closed")

    def _usable_peer(self, agent: str) -> _Peer:
        self._check_open()
        peer = self._peers.get(agent)
        if peer is None:
            raise TransportError(f"unknown peer {agent!r:.80} (add_peer its metadata first)")
        return peer

    def _local_memory(self) -> MemoryMap:
        if self._layout is None:
            raise TransportError("register() the local KV layout before posting")
        return self._memory

    def _post_rows(self, op: str, agent: str, local: object, remote: object, notice: object) -> int:
        peer = self._usable_peer(agent)
        payload = _notice(notice)
        mine = check_rows(local, "local rows")
        theirs = check_rows(remote, "remote rows")
        if mine.shape != theirs.shape or not np.array_equal(mine[:, 1], theirs[:, 1]):
            raise TransportError("local and remote rows differ in count or lengths")
        memory = self._local_memory()
        if not mine.shape[0]:
            return self._nothing_to_move(peer, payload)
        mem_l = memory.classify(mine, "local rows")
        mem_r = peer.memory.classify(theirs, f"rows of {agent!r}")
        try:
            xfer = self._nixl.post(op, mine, mem_l, theirs, mem_r, peer.nixl_name, payload)
        except TransportError as exc:
            sides = (memory, mine, "local rows"), (peer.memory, theirs, f"rows of {agent!r}")
            raise explained(exc, *sides) from None
        return self._transfers.track(xfer, peer.nixl_name)

    def _post_index(
        self, op: str, agent: str, key: object, local: object, remote: object, notice: object
    ) -> int:
        peer = self._usable_peer(agent)
        payload = _notice(notice)
        prepped = self._prepped(peer, key)
        li, ri = check_indices(prepped, local, remote)
        if not li.size:
            return self._nothing_to_move(peer, payload)
        try:
            xfer = self._nixl.post_prepped(op, prepped.local, li, prepped.remote, ri, payload)
        except TransportError as exc:
            detail = explain_indices(prepped, li, ri)
            raise (TransportError(f"{detail}; {exc}") if detail else exc) from None
        return self._transfers.track(xfer, peer.nixl_name)

    def _nothing_to_move(self, peer: _Peer, notice: bytes) -> int:
        """An empty transfer: a WRITE's notice goes alone (no data to precede)."""
        if notice:
            self._nixl.send_notif(peer.nixl_name, notice)
        return self._transfers.settled_now()

    def _prepped(self, peer: _Peer, key: object) -> Prepped:
        try:
            return peer.prepped[key]
        except (KeyError, TypeError):
            raise TransportError(
                f"key {key!r:.80} is not prepared for this instance of {peer.agent!r}"
            ) from None

    def _release_prepped(self, prepped: Prepped) -> None:
        for handle in (prepped.local, prepped.remote):
            if not self._nixl.release(handle):
                log.warning("%s: releasing a prepared list failed", self._agent)

    def _current(self, agent: str) -> str | None:
        peer = self._peers.get(agent)
        return peer.nixl_name if peer is not None else None

    def _drop(self, peer: _Peer, reason: str) -> None:
        """Forget one instance: fail its transfers, release its lists, unload it."""
        del self._peers[peer.agent]
        self._transfers.fail_peer(peer.nixl_name, reason)
        for prepped in peer.prepped.values():
            self._release_prepped(prepped)
        peer.prepped.clear()
        failure = self._nixl.remove_remote(peer.nixl_name)
        if failure is not None:
            log.warning("%s: removing %s failed: %s", self._agent, peer.nixl_name, failure)
        self._notices.retire(peer.nixl_name)


def _notice(notice: object) -> bytes:
    """A WRITE's notice as bytes; ``None`` (a READ) or ``b""`` (an increment
    of a progressive source) is no notice."""
    if notice is None or notice == b"":
        return b""
    if not isinstance(notice, (bytes, bytearray)) or not 1 <= len(notice) <= MAX_NOTICE_BYTES:
        raise TransportError(
            f"notice must be 1 to {MAX_NOTICE_BYTES} bytes (NIXL sends nothing for an empty one)"
        )
    return bytes(notice)


_IS_A_PREPPED_TRANSPORT: type[PreppedTransport] = NixlTransport  # mypy checks the Protocol
