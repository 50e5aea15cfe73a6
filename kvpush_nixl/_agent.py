"""A typed facade over ``nixl._api.nixl_agent``: the only module that touches NIXL.

Every NIXL failure (a dozen ``Exception`` subclasses of its own with bare status
names, plus the odd ``IndexError``) is re-raised as
:class:`~kvpush.runtime.TransportError` saying what we were doing and what the
status usually means. NIXL is imported lazily (:func:`load_api`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvpush.runtime import TransportError

from ._memory import U64, Span

__all__ = ("I32", "INSTALL_HINT", "U64", "Handle", "NixlAgent", "load_api")

INSTALL_HINT = (
    "NIXL is not installed: on a CPU host run `pip install --no-deps nixl nixl-cu12` (the "
    "wheels declare torch, which DRAM transfers do not need); on a GPU host run "
    "`pip install 'kvpush[nixl]'`"
)

#: What NIXL's terse statuses usually mean at the calls we make.
_HINTS = {
    "nixlNotFoundError": "a row outside memory registered on either side, an unknown remote "
    "agent, or a backend that is not available",
    "nixlInvalidParamError": "an index out of range or rows whose lengths differ",
    "nixlRemoteDisconnectError": "the peer disconnected or died",
    "nixlBackendError": "the backend (UCX, LIBFABRIC, ...) failed",
    "nixlNotAllowedError": "the call is not allowed in this state",
}

Handle = Any  # an opaque nixl_xfer_handle or nixl_prepped_dlist_handle
I32 = NDArray[np.int32]


def load_api() -> Any:
    """``nixl._api``, or :class:`TransportError` with install instructions."""
    try:
        return importlib.import_module("nixl._api")
    except (ImportError, OSError) as exc:
        raise TransportError(f"{INSTALL_HINT} ({type(exc).__name__}: {exc})") from exc


def describe(exc: BaseException) -> str:
    """``Class: message (usual meaning)`` for a NIXL exception."""
    name = type(exc).__name__
    hint = _HINTS.get(name)
    text = f"{name}: {exc}" if str(exc) else name
    return f"{text} ({hint})" if hint else text


def _params(params: Mapping[str, object]) -> dict[str, str]:
    """NIXL takes string values only: ints as decimal, bools as true/false,
    sequences (device lists) comma-joined."""
    out: dict[str, str] = {}
    for key, value in params.items():
        if isinstance(value, bool):
            out[key] = "true" if value else "false"
        elif isinstance(value, (str, int)):
            out[key] = str(value)
        else:
            assert isinstance(value, Sequence)  # checked by the transport's constructor
            out[key] = ",".join(str(v) for v in value)
    return out


class NixlAgent:
    """One ``nixl_agent`` with the threads and lock mode kvpush wants."""

    __slots__ = ("_api", "name")

    def __init__(
        self,
        name: str,
        backends: Mapping[str, Mapping[str, object]],
        *,
        progress_thread: bool,
        sync_mode: str,
    ) -> None:
        api = load_api()
        config = api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            # Metadata travels on kvpush's control channel, never NIXL's socket.
            enable_listen_thread=False,
            backends=[],  # created below, each with its own init params
            sync_mode=getattr(api.nixl_thread_sync_t, f"NIXL_THREAD_SYNC_{sync_mode}"),
        )
        try:
            self._api: Any = api.nixl_agent(name, config)
        except Exception as exc:
            raise TransportError(f"NIXL could not create agent {name!r}: {describe(exc)}") from exc
        self.name = name
        plugins = list(self._api.get_plugin_list())
        for backend, params in backends.items():
            if backend not in plugins:
                raise TransportError(
                    f"NIXL has no {backend!r} plugin here (available: {', '.join(plugins)})"
                )
            try:
                self._api.create_backend(backend, _params(params))
            except Exception as exc:
                raise TransportError(
                    f"NIXL could not create backend {backend!r}: {describe(exc)}; it may need "
                    "libraries or hardware this host lacks (LIBFABRIC: libfabric, hwloc and "
                    "EFA devices)"
                ) from exc

    def backend_params(self, backend: str) -> dict[str, str]:
        return dict(self._api.get_backend_params(backend))

    # --- memory and metadata ---------------------------------------------------

    def register(self, spans: Sequence[Span]) -> list[Handle]:
        """Register spans, one NIXL call per memory type; returns what
        :meth:`deregister` takes. Nothing stays registered on failure."""
        done: list[Handle] = []
        for memory in sorted({s.memory for s in spans}):
            descs = [(s.base, s.length, s.device, "") for s in spans if s.memory == memory]
            try:
                done.append(self._api.register_memory(descs, memory))
            except Exception as exc:
                for handle in done:
                    self.deregister(handle)
                raise TransportError(
                    f"NIXL could not register {len(descs)} {memory} span(s): {describe(exc)}"
                ) from exc
        return done

    def deregister(self, handle: Handle) -> str | None:
        try:
            self._api.deregister_memory(handle)
        except Exception as exc:
            return describe(exc)
        return None

    def metadata(self) -> bytes:
        return bytes(self._api.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        try:
            name = self._api.add_remote_agent(metadata)
        except Exception as exc:
            raise TransportError(f"NIXL refused the peer's metadata: {describe(exc)}") from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> str | None:
        try:
            self._api.remove_remote_agent(name)
        except Exception as exc:
            return describe(exc)
        return None

    # --- transfers ---------------------------------------------------------------

    def post(
        self,
        op: str,
        local: U64,
        local_mem: str,
        remote: U64,
        remote_mem: str,
        peer: str,
        notice: bytes,
    ) -> Handle:
        """Build descriptor lists from rows, create the request and post it."""
        handle = None
        try:
            src = self._api.get_xfer_descs(local, local_mem)
            dst = self._api.get_xfer_descs(remote, remote_mem)
            handle = self._api.initialize_xfer(op, src, dst, peer, notice)
            status = self._api.transfer(handle)
        except Exception as exc:
            if handle is not None:
                self.release(handle)
            raise TransportError(f"NIXL refused the {op}: {describe(exc)}") from exc
        return self._check_posted(handle, status, op)

    def prep(self, peer: str | None, rows: U64, memory: str) -> Handle:
        """A prepared list of ``peer``'s rows (``None``: local rows)."""
        target = "NIXL_INIT_AGENT" if peer is None else peer
        try:
            return self._api.prep_xfer_dlist(target, rows, memory)
        except Exception as exc:
            side = "local" if peer is None else "remote"
            raise TransportError(
                f"NIXL could not prepare the {side} rows: {describe(exc)}"
            ) from exc

    def post_prepped(
        self, op: str, local: Handle, local_idx: I32, remote: Handle, remote_idx: I32, notice: bytes
    ) -> Handle:
        handle = None
        try:
            handle = self._api.make_prepped_xfer(op, local, local_idx, remote, remote_idx, notice)
            status = self._api.transfer(handle)
        except Exception as exc:
            if handle is not None:
                self.release(handle)
            raise TransportError(f"NIXL refused the prepared {op}: {describe(exc)}") from exc
        return self._check_posted(handle, status, op)

    def _check_posted(self, handle: Handle, status: object, op: str) -> Handle:
        if status == "ERR":  # the reference never saw it; exceptions are the rule
            self.release(handle)
            raise TransportError(f"NIXL could not post the {op} (ERR)")
        return handle

    def state(self, handle: Handle) -> str:
        """``"DONE"``, ``"PROC"`` or ``"ERR"``; a NIXL exception becomes TransportError."""
        try:
            return str(self._api.check_xfer_state(handle))
        except Exception as exc:
            raise TransportError(f"transfer failed: {describe(exc)}") from exc

    def release(self, handle: Handle) -> bool:
        """Release (cancelling if still running); False if NIXL could not."""
        try:
            handle.release()
        except Exception:
            return False
        return True

    def notifs(self) -> dict[str, list[bytes]]:
        try:
            got = self._api.get_new_notifs()
        except Exception as exc:
            raise TransportError(f"NIXL could not fetch notifications: {describe(exc)}") from exc
        return {str(k): [bytes(m) for m in v] for k, v in got.items()}

    def send_notif(self, peer: str, message: bytes) -> None:
        try:
            self._api.send_notif(peer, message)
        except Exception as exc:
            raise TransportError(f"NIXL could not send the notice: {describe(exc)}") from exc

    def close(self) -> None:
        """Drop the agent (its destructor tears NIXL down)."""
        self._api = None
