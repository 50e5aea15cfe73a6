"""docs/contract.md, shape by shape: what each leg parses to, what a prefill
answers, and what is refused (ambiguous, contradictory, or a decode leg
naming a prefill it cannot trust)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpush.protocol import Mode
from kvpush_vllm._contract import (
    NIXL_PREFILL_LEG,
    REFUSALS,
    Contract,
    peer_of_request_id,
    release_params,
)
from kvpush_vllm._params import ParamsError, Release, TransferParams

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
        LLMD_DECODE["transfer_id"],
        "decode",
        Mode.PUSH,
        P,
        "llmd",  # type: ignore[arg-type]
    )


def test_moriio_legs_only_when_configured() -> None:
    on = Contract(allowed_peers=frozenset({P}), moriio=True)
    assert on.parse(MORI_DECODE, VR_ID, "decode") == TransferParams(
        MORI_DECODE["transfer_id"],
        "decode",
        Mode.PUSH,
        P,
        "moriio",  # type: ignore[arg-type]
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


RELEASE = release_params("kvp-1", "push", SECRET)
AMBIGUOUS = {"do_remote_prefill": True}


@pytest.mark.parametrize(
    ("params", "serves", "match", "reason"),
    [
        ({**NIXL_PREFILL, "do_remote_prefill": True}, "prefill", "both true", "contradictory"),
        ({**kvpush_leg("decode"), "do_remote_prefill": True}, "decode", "ambiguous", "ambiguous"),
        ({**kvpush_leg("prefill"), "do_remote_decode": True}, "prefill", "ambiguous", "ambiguous"),
        ({**RELEASE, **kvpush_leg("prefill")}, "prefill", "together with a leg", "ambiguous"),
        (kvpush_leg("decode"), "prefill", "decode leg reached an instance", "wrong_role"),
        (
            NIXL_PREFILL,
            "decode",
            "prefill leg reached an instance that serves decode",
            "wrong_role",
        ),
        (LLMD_DECODE, "prefill", "decode leg reached", "wrong_role"),
        (RELEASE, "decode", "release reached an instance that serves decode", "wrong_role"),
        ({**LLMD_DECODE, "transfer_mode": "pull"}, "decode", "must be 'push'", "malformed"),
        ({**LLMD_DECODE, "remote_port": "9100"}, "decode", "must be an integer", "malformed"),
        (
            {k: v for k, v in LLMD_DECODE.items() if k != "transfer_id"},
            "decode",
            "transfer_id",
            "malformed",
        ),
        (NIXL_DECODE, "decode", "NixlConnector decode leg", "nixl_decode"),
        (
            {**NIXL_PREFILL, "do_remote_decode": "yes"},
            "prefill",
            "true, false or null",
            "malformed",
        ),
        ({**NIXL_PREFILL, "transfer_id": 7}, "prefill", "must be a string", "malformed"),
        ({**LLMD_PREFILL, "transfer_id": "bad id!"}, "prefill", "transfer_id must be", "malformed"),
        (kvpush_leg("decode", extra_key=1), "decode", "unknown", "malformed"),
        (
            {"kvpush_release": {"transfer_id": "kvp-1"}},
            "prefill",
            "expected transfer_id, mode",
            "malformed",
        ),
        (
            {"kvpush_release": {"transfer_id": "kvp-1", "mode": "x"}},
            "prefill",
            "mode must be",
            "malformed",
        ),
        ([1, 2], "decode", "must be an object", "malformed"),
    ],
)
def test_malformed_ambiguous_and_contradictory_legs_are_refused(
    params: Any, serves: Any, match: str, reason: str
) -> None:
    """Each refusal has a class, whose fix the connector's first error names."""
    c = Contract(secret=SECRET, allowed_peers=frozenset({P}), moriio=True)
    with pytest.raises(ParamsError, match=match) as refused:
        c.parse(params, VR_ID, serves)
    assert refused.value.reason == reason and reason in REFUSALS
    # Only the ambiguous decode leg, to an allowed peer, is one a decode may
    # tell its prefill about (next tests).
    assert (refused.value.leg is not None) == (params == {**kvpush_leg("decode"), **AMBIGUOUS})


def test_moriio_legs_without_router_discovery_and_untrusted_legs_have_their_class() -> None:
    with pytest.raises(ParamsError) as refused:
        Contract(allowed_peers=frozenset({P})).parse(MORI_DECODE, VR_ID, "decode")
    assert refused.value.reason == "moriio"
    with pytest.raises(ParamsError) as refused:
        Contract().parse(kvpush_leg("decode"), "r", "decode")
    assert (refused.value.reason, refused.value.leg) == ("untrusted", None)
    assert "`secret` on the router and both instances" in REFUSALS["untrusted"]
    assert "`allowed_peers`" in REFUSALS["untrusted"]


def test_a_refused_leg_carries_its_decode_leg_only_when_the_decode_trusts_it() -> None:
    """A decode tells a prefill to release (``SchedulerSide.decline``) only
    for a leg it refused for a reason other than trust, and whose peer it
    trusts (sealed, or allowed): never a peer an untrusted leg names."""
    ambiguous = {**kvpush_leg("decode"), "do_remote_prefill": True}
    leg = TransferParams("kvp-1", "decode", Mode.PUSH, P)
    with pytest.raises(ParamsError) as allowed:
        Contract(allowed_peers=frozenset({P})).parse(ambiguous, "r", "decode")
    assert allowed.value.leg == leg
    sealer = Contract(secret=SECRET)
    sealed = {**kvpush_leg("decode", seal=sealer.seal(leg)), "do_remote_prefill": True}
    with pytest.raises(ParamsError) as trusted:
        sealer.parse(sealed, "r", "decode")
    assert trusted.value.leg == leg
    for contract in (Contract(), Contract(secret=SECRET), Contract(allowed_peers=frozenset({"x"}))):
        with pytest.raises(ParamsError) as untrusted:
            contract.parse(ambiguous, "r", "decode")
        assert untrusted.value.reason == "ambiguous" and untrusted.value.leg is None
    with pytest.raises(ParamsError) as prefill:  # a prefill has no one to tell
        Contract(allowed_peers=frozenset({P})).parse(
            {**kvpush_leg("prefill"), "do_remote_decode": True}, "r", "prefill"
        )
    assert prefill.value.leg is None


def test_a_release_is_sealed_with_its_own_label_and_refused_when_forged() -> None:
    """``release_params`` (what ``kvpush router`` sends the prefill when the
    decode leg failed at the decode's API layer): sealed under the secret over
    its own label, parsed by a prefill into a :class:`Release`; a forged one,
    or a decode leg's seal, is refused. A prefill without a secret takes an
    unsealed one (the router's transfer ids are random)."""
    tid = "kvp-" + "a" * 32
    release = json.loads(json.dumps(release_params(tid, "pull", SECRET)))  # as sent
    assert set(release) == {"kvpush_release"}
    assert set(release["kvpush_release"]) == {"transfer_id", "mode", "seal"}
    prefill = Contract(secret=SECRET)
    assert prefill.parse(release, "r", "prefill") == Release(tid, Mode.PULL)
    unsealed = release_params(tid, "pull", None)
    assert unsealed == {"kvpush_release": {"transfer_id": tid, "mode": "pull"}}
    assert Contract().parse(unsealed, "r", "prefill") == Release(tid, Mode.PULL)
    assert Contract().parse(release, "r", "prefill") == Release(tid, Mode.PULL)
    seal = release["kvpush_release"]["seal"]
    decode_seal = prefill.seal(TransferParams(tid, "decode", Mode.PULL, P))
    forged = [
        unsealed,  # no seal, at a prefill with a secret
        release_params(tid, "pull", b"t" * 16),  # another cluster's secret
        {"kvpush_release": {"transfer_id": "kvp-other", "mode": "pull", "seal": seal}},
        {"kvpush_release": {"transfer_id": tid, "mode": "push", "seal": seal}},
        {"kvpush_release": {"transfer_id": tid, "mode": "pull", "seal": decode_seal}},
    ]
    for params in forged:
        with pytest.raises(ParamsError, match="not sealed under") as refused:
            prefill.parse(params, "r", "prefill")
        assert refused.value.reason == "release_unsealed"
    # Nor does a release's seal make a decode leg trusted.
    leg = kvpush_leg("decode", mode="pull", seal=seal)
    leg["kvpush"]["transfer_id"] = tid
    with pytest.raises(ParamsError, match="seal is missing or wrong"):
        prefill.parse(leg, "r", "decode")
    for bad in (("bad id!", "push"), (tid, "fast")):
        with pytest.raises(ParamsError):
            release_params(*bad, SECRET)
