"""docs/contract.md, shape by shape: what each leg parses to, what a prefill
answers, and what is refused (ambiguous, contradictory, or a decode leg
naming a prefill it cannot trust)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpush.protocol import Mode
from kvpush_vllm._contract import NIXL_PREFILL_LEG, Contract, peer_of_request_id
from kvpush_vllm._params import ParamsError, TransferParams

SECRET = b"s" * 16
P = "10.0.0.1:9100"
#: What vllm-router 0.1.17 and vLLM 0.33 make of a request id (docs/contract.md).
VR_ID = "cmpl-___prefill_addr_10.0.0.1:9100___decode_addr_10.0.0.2:9200_" + "a" * 32 + "-0-1b2c3d4e"
#: vllm-router's default mode, the prefill leg (``--kv-connector nixl``).
NIXL_PREFILL = NIXL_PREFILL_LEG
#: llm-d's sidecar, NIXL push: the prefill leg, and the decode leg it builds
#: from the identity it cached (pkg/sidecar/proxy, nixl push parallel dispatch).
LLMD_PREFILL = {**NIXL_PREFILL, "transfer_id": "xfer-00000000-0000-0000-0000-000000000003"}
LLMD_DECODE = {
    "remote_engine_id": "10.0.0.1:9100#00000000000000ab",
    "remote_host": "10.0.0.1",
    "remote_port": 9100.0,  # JSON numbers reach Go as float64 and come back so
    "tp_size": 1,
    "transfer_mode": "push",
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_request_id": "00000000-0000-0000-0000-000000000003",
    "transfer_id": "xfer-00000000-0000-0000-0000-000000000003",
}
#: vLLM's NixlConnector decode leg (a NixlConnector prefill's answer).
NIXL_DECODE = {
    "do_remote_prefill": True,
    "remote_engine_id": "e",
    "remote_block_ids": [1],
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
}
#: vllm-router's MoRI-IO WRITE mode (``--kv-connector moriio``).
MORI_ID = "tx-" + "b" * 32
MORI_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": MORI_ID}
MORI_DECODE = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": MORI_ID}


def kvpush_leg(role: str, peer: str = P, mode: str = "push", **extra: Any) -> dict[str, Any]:
    return {"kvpush": {"transfer_id": "kvp-1", "role": role, "mode": mode, "peer": peer, **extra}}


def test_kvpush_shape_both_legs() -> None:
    c = Contract(allowed_peers=frozenset({P}))
    leg = c.parse(kvpush_leg("decode"), "r", "decode")
    assert leg == TransferParams("kvp-1", "decode", Mode.PUSH, P)
    assert c.parse(kvpush_leg("prefill", peer="http://d"), "r", "prefill") == TransferParams(
        "kvp-1", "prefill", Mode.PUSH, "http://d"
    )
    assert c.answer(TransferParams("kvp-1", "prefill", Mode.PUSH, "d"), "r", P, "e", 1) is None
    assert c.parse(None, "r", "decode") is None
    assert c.parse({"other_connector": {"x": 1}}, "r", "decode") is None


def test_vllm_router_default_mode_prefill_mints_a_stable_id_and_answers_a_sealed_pull() -> None:
    c = Contract(secret=SECRET)
    leg = c.parse(NIXL_PREFILL, "cmpl-x-0-1", "prefill")
    assert leg is not None and (leg.role, leg.mode, leg.shape) == ("prefill", Mode.PULL, "nixl")
    assert leg.transfer_id.startswith("kvp-") and len(leg.transfer_id) == 36
    assert c.parse(NIXL_PREFILL, "cmpl-x-0-1", "prefill") == leg  # same request, same id
    other = c.parse(NIXL_PREFILL, "cmpl-x-0-2", "prefill")
    assert other is not None and other.transfer_id != leg.transfer_id
    answer = c.answer(leg, "cmpl-x-0-1", P, "e", 1)
    assert answer is not None
    assert set(answer["kvpush"]) == {"transfer_id", "role", "mode", "peer", "seal"}
    # The router copies it verbatim to the decode, which verifies the seal.
    decode = Contract(secret=SECRET).parse(answer, "cmpl-y", "decode")
    assert decode == TransferParams(leg.transfer_id, "decode", Mode.PULL, P)


def test_an_injected_decode_leg_is_refused() -> None:
    """A client's own kv_transfer_params reach the decode when the prefill
    answers none: unsealed or forged, to a prefill not allowed, refused."""
    sealed = Contract(secret=SECRET)
    good = sealed.answer(sealed.parse(NIXL_PREFILL, "r", "prefill"), "r", P, "e", 1)  # type: ignore[arg-type]
    assert good is not None
    forged = {"kvpush": {**good["kvpush"], "peer": "6.6.6.6:9100"}}
    with pytest.raises(ParamsError, match="seal is missing or wrong"):
        sealed.parse(forged, "r", "decode")
    with pytest.raises(ParamsError, match="seal is missing or wrong"):
        sealed.parse(kvpush_leg("decode", mode="pull"), "r", "decode")
    with pytest.raises(ParamsError, match="seal is missing or wrong"):
        Contract(secret=b"t" * 16).parse(good, "r", "decode")  # another cluster's secret
    with pytest.raises(ParamsError, match="no secret is configured"):
        Contract().parse(good, "r", "decode")
    with pytest.raises(ParamsError, match="carries no seal"):
        Contract(secret=SECRET).parse(LLMD_DECODE, "r", "decode")
    # The allow-list: by address, or by host for any port.
    assert Contract(allowed_peers=frozenset({P})).parse(LLMD_DECODE, "r", "decode") is not None
    assert Contract(allowed_peers=frozenset({"10.0.0.1"})).parse(good, "r", "decode") is not None
    with pytest.raises(ParamsError, match="not in allowed_peers"):
        Contract(allowed_peers=frozenset({"10.0.0.1:9101"})).parse(LLMD_DECODE, "r", "decode")


def test_llmd_push_prefill_answers_its_identity_and_the_decode_leg_parses() -> None:
    c = Contract(allowed_peers=frozenset({P}))
    leg = c.parse(LLMD_PREFILL, "cmpl-z", "prefill")
    assert leg == TransferParams(LLMD_PREFILL["transfer_id"], "prefill", Mode.PUSH, "-", "llmd")  # type: ignore[arg-type]
    answer = c.answer(leg, "cmpl-z", P, "10.0.0.1:9100#00000000000000ab", 1)
    assert answer is not None
    # What the sidecar caches: transfer_mode push and every required identity field.
    assert answer["transfer_mode"] == "push"
    for key in ("remote_engine_id", "remote_host", "remote_port", "tp_size"):
        assert isinstance(answer[key], (str, int)), key
    # Serial (first request to the endpoint): the answer verbatim.
    assert c.parse(answer, "d1", "decode") == TransferParams(
        leg.transfer_id, "decode", Mode.PUSH, P, "llmd"
    )
    # Parallel: the cached identity plus the per-request fields.
    assert c.parse(LLMD_DECODE, "d2", "decode") == TransferParams(
        LLMD_DECODE["transfer_id"], "decode", Mode.PUSH, P, "llmd"  # type: ignore[arg-type]
    )


def test_moriio_legs_only_when_configured() -> None:
    on = Contract(allowed_peers=frozenset({P}), moriio=True)
    assert on.parse(MORI_DECODE, VR_ID, "decode") == TransferParams(
        MORI_DECODE["transfer_id"], "decode", Mode.PUSH, P, "moriio"  # type: ignore[arg-type]
    )
    leg = on.parse(MORI_PREFILL, VR_ID, "prefill")
    assert leg is not None and (leg.transfer_id, leg.mode) == (MORI_ID, Mode.PUSH)
    with pytest.raises(ParamsError, match="only with router_discovery configured"):
        Contract(allowed_peers=frozenset({P})).parse(MORI_DECODE, VR_ID, "decode")
    with pytest.raises(ParamsError, match="names no prefill"):
        on.parse(MORI_DECODE, "cmpl-plain-0-1", "decode")
    assert peer_of_request_id(VR_ID) == P
    assert peer_of_request_id(VR_ID.replace("10.0.0.1:9100", "tcp://10.0.0.1:9100")) == P
    v6 = VR_ID.replace("10.0.0.1:9100", "[fd00::1]:9100")
    assert peer_of_request_id(v6) == "[fd00::1]:9100"


@pytest.mark.parametrize(
    ("params", "serves", "match"),
    [
        ({**NIXL_PREFILL, "do_remote_prefill": True}, "prefill", "both true"),
        ({**kvpush_leg("decode"), "do_remote_prefill": True}, "decode", "ambiguous"),
        ({**kvpush_leg("prefill"), "do_remote_decode": True}, "prefill", "ambiguous"),
        (kvpush_leg("decode"), "prefill", "decode leg reached an instance that serves prefill"),
        (NIXL_PREFILL, "decode", "prefill leg reached an instance that serves decode"),
        (LLMD_DECODE, "prefill", "decode leg reached"),
        ({**LLMD_DECODE, "transfer_mode": "pull"}, "decode", "transfer_mode must be 'push'"),
        ({**LLMD_DECODE, "remote_port": "9100"}, "decode", "remote_port must be an integer"),
        ({k: v for k, v in LLMD_DECODE.items() if k != "transfer_id"}, "decode", "transfer_id"),
        (NIXL_DECODE, "decode", "NixlConnector decode leg"),
        ({**NIXL_PREFILL, "do_remote_decode": "yes"}, "prefill", "true, false or null"),
        ({**NIXL_PREFILL, "transfer_id": 7}, "prefill", "transfer_id must be a string"),
        ({**LLMD_PREFILL, "transfer_id": "bad id!"}, "prefill", "transfer_id must be"),
        (kvpush_leg("decode", extra_key=1), "decode", "unknown"),
        ([1, 2], "decode", "must be an object"),
    ],
)
def test_malformed_ambiguous_and_contradictory_legs_are_refused(
    params: Any, serves: Any, match: str
) -> None:
    c = Contract(secret=SECRET, allowed_peers=frozenset({P}), moriio=True)
    with pytest.raises(ParamsError, match=match):
        c.parse(params, VR_ID, serves)
