"""UCX's VRAM defaults (issue 26 item 4): set before the agent, the user's setting wins."""

from __future__ import annotations

import logging

import pytest

from kvpush_nixl._ucx import VRAM_DEFAULTS, apply_vram_defaults


def test_each_default_is_set_where_the_user_set_nothing_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env: dict[str, str] = {}
    with caplog.at_level(logging.INFO, logger="kvpush.nixl"):
        assert apply_vram_defaults(env) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    assert env == {name: value for name, (value, _) in VRAM_DEFAULTS.items()}
    assert "set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y for VRAM" in caplog.text
    assert apply_vram_defaults(env) == {}  # already there: nothing again


def test_a_users_own_setting_always_wins() -> None:
    env = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}
    assert apply_vram_defaults(env) == {}
    assert env == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}


def test_a_vram_transport_sets_them_before_its_agent_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("nixl._api", reason="NIXL is not installed (make test installs it)")
    from kvpush_nixl import NixlTransport, _transport

    seen: list[str | None] = []
    real = _transport.NixlAgent

    def spy(*args: object, **kwargs: object) -> object:
        import os

        seen.append(os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY"))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    # setenv first: monkeypatch then restores the variable's absence at teardown.
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "")
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
    monkeypatch.setattr(_transport, "NixlAgent", spy)
    NixlTransport("ucx-dram").close()
    assert seen == [None]  # DRAM only: nothing set
    NixlTransport("ucx-vram", vram=True).close()
    assert seen == [None, "y"]
