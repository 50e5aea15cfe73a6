"""The handoff contract: every ``kv_transfer_params`` shape kvpush accepts
(docs/contract.md, the reference for routers), parsed in one place into one
:class:`~kvpush_vllm._params.TransferParams`, and what a prefill answers.

Trust: a decode leg names the prefill to connect to, and a client can put that
name in a request (a router copies a client's parameters when the prefill
answers none). So a decode acts on a peer only when the leg carries a valid
seal (an HMAC under the shared ``secret``) or the peer is in ``allowed_peers``.
A release is sealed under a distinct label, so a decode leg's seal never
releases.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpush.protocol import Mode

from ._params import (
    PARAMS_KEY,
    RELEASE_KEY,
    LegRole,
    ParamsError,
    Release,
    TransferParams,
    parse_host_port,
)

__all__ = (
    "NIXL_PREFILL_LEG",
    "REFUSALS",
    "Contract",
    "host_port",
    "peer_of_request_id",
    "release_params",
)

#: Why a leg is refused -> what fixes it (docs/contract.md, "Refused"); the
#: keys label ``vllm:kvpush_params_refused_total``.
REFUSALS: dict[str, str] = {
    "malformed": "make the router send one of the shapes of docs/contract.md",
    "ambiguous": "send either kvpush's object or NIXL's do_remote_* flags in a request, not both",
    "contradictory": "send do_remote_decode on the prefill leg and do_remote_prefill on the "
    "decode leg, never both on one",
    "wrong_role": "send prefill legs to kv_producer instances and decode legs to kv_consumer "
    "ones (check the router's prefill and decode lists)",
    "nixl_decode": "run KvpushConnector on the prefill as well: kvpush cannot load a "
    "NixlConnector prefill's KV",
    "moriio": "set `router_discovery` on both instances to serve vllm-router's MoRI-IO WRITE mode",
    "untrusted": "set `secret` on the router and both instances, or list the prefill in "
    "`allowed_peers`",
    "release_unsealed": "set the same `secret` on the router and the prefill",
}

#: NixlConnector's prefill leg, as vllm-router and llm-d send it (llm-d adds a ``transfer_id``).
NIXL_PREFILL_LEG: dict[str, bool | None] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: NIXL-shaped keys (vLLM's NixlConnector, llm-d, MoRI-IO) this module reads.
_NIXL_FLAGS = ("do_remote_decode", "do_remote_prefill")
#: What vllm-router writes into the request id: the legs' addresses.
_REQUEST_ID = re.compile(r"___prefill_addr_(.+?)___decode_addr_(.+?)_([0-9a-f]{32})")


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def peer_of_request_id(request_id: str) -> str:
    """The prefill address ``vllm-router`` put in ``request_id``
    (``___prefill_addr_<P>___decode_addr_<D>_<32 hex>``), as ``host:port``."""
    m = _REQUEST_ID.search(request_id)
    if m is None:
        raise ParamsError(
            f"request id {request_id!r} names no prefill (expected vllm-router's "
            "___prefill_addr_<host:port>___decode_addr_<host:port>_<32 hex>)"
        )
    addr = m.group(1).removeprefix("tcp://").removeprefix("http://")
    host, port = parse_host_port(addr)
    return host_port(host, port)


def _hmac(secret: bytes, *fields: str) -> str:
    return hmac.new(secret, "\0".join(fields).encode(), hashlib.sha256).hexdigest()


def _release_seal(secret: bytes, release: Release) -> str:
    """A release's HMAC: over its own label, so a decode leg's seal never fits."""
    return _hmac(secret, "kvpush-release-v1", release.transfer_id, release.mode.value)


def release_params(transfer_id: str, mode: str, secret: bytes | None) -> dict[str, object]:
    """The ``kv_transfer_params`` of a release (docs/contract.md, "Release"),
    sealed under ``secret`` (``None``: unsealed, which only a prefill without
    a secret accepts)."""
    release = Release.from_params({"transfer_id": transfer_id, "mode": mode})
    body: dict[str, str] = {"transfer_id": release.transfer_id, "mode": release.mode.value}
    if secret is not None:
        body["seal"] = _release_seal(secret, release)
    return {RELEASE_KEY: body}


def _flag(raw: Mapping[str, Any], key: str) -> bool:
    value = raw.get(key)
    if value is None or value is False:
        return False
    if value is True:
        return True
    raise ParamsError(f"{key} must be true, false or null, got {value!r}")


def _str(raw: Mapping[str, Any], key: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value:
        raise ParamsError(f"{key} must be a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Contract:
    """How one instance reads legs and answers them (from its connector config)."""

    #: Seals the decode legs this instance answers and verifies the ones it gets.
    secret: bytes | None = None
    #: Prefill addresses (``host:port``, or ``host`` for any port) a decode
    #: trusts without a seal.
    allowed_peers: frozenset[str] = frozenset()
    #: MoRI-IO WRITE legs are accepted (``router_discovery`` is configured).
    moriio: bool = False

    # --- parsing ---------------------------------------------------------------

    def parse(
        self, params: object, request_id: str, serves: LegRole
    ) -> TransferParams | Release | None:
        """The leg in ``params`` for an instance that serves ``serves`` legs,
        (a prefill) a :class:`Release`, or ``None`` (a plain request). Raises
        :class:`ParamsError`, its ``reason`` a key of :data:`REFUSALS`."""
        if params is None:
            return None
        if not isinstance(params, Mapping):
            raise ParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
        leg = self._leg(params, request_id, serves)
        if not isinstance(leg, TransferParams):
            return leg
        if leg.role != serves:
            raise ParamsError(
                f"a {leg.role} leg reached an instance that serves {serves} legs", "wrong_role"
            )
        why = self._distrust(leg, params) if serves == "decode" else None
        if why is not None:
            raise ParamsError(
                f"the decode leg names prefill {leg.peer!r}, which is not in "
                f"allowed_peers, and {why}",
                "untrusted",
            )
        return leg

    def _leg(
        self, raw: Mapping[str, Any], request_id: str, serves: LegRole
    ) -> TransferParams | Release | None:
        """What ``raw`` holds, whatever its shape, before the role and trust checks."""
        remote_decode, remote_prefill = (_flag(raw, k) for k in _NIXL_FLAGS)
        if remote_decode and remote_prefill:
            raise ParamsError(
                "do_remote_decode and do_remote_prefill are both true", "contradictory"
            )
        if RELEASE_KEY in raw:
            return self._release(raw, serves, remote_decode or remote_prefill)
        if PARAMS_KEY in raw:
            leg = TransferParams.from_params(raw)  # "kvpush": null, as if absent
            if remote_decode or remote_prefill:
                raise ParamsError(
                    f"ambiguous: both a {PARAMS_KEY!r} object and NIXL's do_remote_* flags",
                    "ambiguous",
                    None if leg is None else self._declinable(leg, raw, serves),
                )
            return leg
        if remote_decode:
            return self._nixl_prefill(raw, request_id)
        return self._nixl_decode(raw, request_id) if remote_prefill else None

    def _declinable(
        self, leg: TransferParams, raw: Mapping[str, Any], serves: LegRole
    ) -> TransferParams | None:
        """``leg`` if it is a trusted decode leg at a decode (its prefill is told)."""
        ok = leg.role == serves == "decode" and self._distrust(leg, raw) is None
        return leg if ok else None

    def _release(self, raw: Mapping[str, Any], serves: LegRole, flags: bool) -> Release:
        if PARAMS_KEY in raw or flags:
            raise ParamsError(
                f"ambiguous: a {RELEASE_KEY!r} object together with a leg", "ambiguous"
            )
        release = Release.from_params(raw[RELEASE_KEY])
        if serves != "prefill":
            raise ParamsError(
                f"a release reached an instance that serves {serves} legs", "wrong_role"
            )
        if self.secret is None:
            return release  # the router's transfer ids are random: nothing to guess
        seal = raw[RELEASE_KEY].get("seal")
        if not (
            isinstance(seal, str) and hmac.compare_digest(seal, _release_seal(self.secret, release))
        ):
            raise ParamsError(
                f"the release of {release.transfer_id!r} is not sealed under this "
                "instance's secret (its seal is missing or wrong)",
                "release_unsealed",
            )
        return release

    def _nixl_prefill(self, raw: Mapping[str, Any], request_id: str) -> TransferParams:
        tid = raw.get("transfer_id")
        if tid is None:  # vllm-router's default mode: the prefill names the transfer
            digest = hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()
            return TransferParams(f"kvp-{digest}", "prefill", Mode.PULL, "-", shape="nixl")
        if not isinstance(tid, str):
            raise ParamsError(f"transfer_id must be a string, got {tid!r}")
        return TransferParams(tid, "prefill", Mode.PUSH, "-", shape="llmd")

    def _nixl_decode(self, raw: Mapping[str, Any], request_id: str) -> TransferParams:
        tid = _str(raw, "transfer_id") if "transfer_id" in raw else None
        mode = raw.get("transfer_mode")
        if mode is not None and mode != "push":
            raise ParamsError(f"transfer_mode must be 'push', got {mode!r}")
        if mode == "push":
            if tid is None:
                raise ParamsError("an llm-d push decode leg needs its transfer_id")
            host, port = _str(raw, "remote_host"), raw.get("remote_port")
            if type(port) is not int and not (isinstance(port, float) and port.is_integer()):
                raise ParamsError(f"remote_port must be an integer, got {port!r}")
            peer = host_port(*parse_host_port(host_port(host, int(port))))
            return TransferParams(tid, "decode", Mode.PUSH, peer, shape="llmd")
        if tid is not None and raw.get("remote_host") is None:
            if not self.moriio:
                raise ParamsError(
                    "MoRI-IO WRITE decode leg (transfer_id, no remote_host): kvpush reads "
                    "it only with router_discovery configured",
                    "moriio",
                )
            peer = peer_of_request_id(request_id)
            return TransferParams(tid, "decode", Mode.PUSH, peer, shape="moriio")
        raise ParamsError(
            "a NixlConnector decode leg (remote_block_ids from a NixlConnector prefill): "
            "kvpush cannot load it; the prefill must run KvpushConnector",
            "nixl_decode",
        )

    def _distrust(self, leg: TransferParams, raw: Mapping[str, Any]) -> str | None:
        """Why a decode cannot trust ``leg``'s peer (``None``: it can)."""
        if self.allows(leg.peer):
            return None
        if leg.shape == "kvpush" and self.secret is not None:
            seal = raw[PARAMS_KEY].get("seal")
            if isinstance(seal, str) and hmac.compare_digest(seal, self.seal(leg)):
                return None
            return "its seal is missing or wrong"
        if leg.shape == "kvpush":
            return "no secret is configured to verify a seal"
        return f"a {leg.shape} leg carries no seal"

    def allows(self, peer: str) -> bool:
        host = parse_host_port(peer)[0]
        return peer in self.allowed_peers or host in self.allowed_peers

    # --- answering -------------------------------------------------------------

    def seal(self, leg: TransferParams) -> str:
        """The HMAC of a decode leg's transfer id, mode and peer."""
        if self.secret is None:
            raise ParamsError("sealing needs a secret")
        return _hmac(self.secret, "kvpush-seal-v1", leg.transfer_id, leg.mode.value, leg.peer)

    def answer(
        self, leg: TransferParams, request_id: str, control: str, engine: str, tp: int
    ) -> dict[str, Any] | None:
        """What a prefill returns from ``request_finished`` for ``leg``: the
        decode's leg, in the shape its router copies (docs/contract.md)."""
        if leg.shape == "kvpush":
            return None  # the kvpush router sent the decode its leg already
        if leg.shape == "nixl":
            decode = TransferParams(leg.transfer_id, "decode", leg.mode, control)
            out = decode.to_params()
            if self.secret is not None:
                out[PARAMS_KEY]["seal"] = self.seal(decode)
            return out
        host, port = parse_host_port(control)
        return {  # llm-d's NIXL push identity (and the per-request fields)
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine,
            "remote_host": host,
            "remote_port": port,
            "tp_size": tp,
            "transfer_mode": "push",
            "transfer_id": leg.transfer_id,
            "remote_request_id": request_id,
        }
