"""Hypothesis profiles: ``ci`` (default, a few hundred examples) and ``long``
(>= 10,000 examples), chosen with KVPUSH_HYPOTHESIS_PROFILE; the anyio
backends every anyio-marked test runs on (asyncio and trio); the kit's
pytest-asyncio fixtures (``kvpush_pair`` ..., tests/test_testing_pair.py), loaded
as an integrator loads them."""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["kvpush.testing.pytest_plugin"]

# UCX (under NIXL) on loopback only: never the host's external interface.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
# NIXL logs INFO lines to stdout otherwise.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=10_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("KVPUSH_HYPOTHESIS_PROFILE", "ci"))


#: anyio's plugin runs each ``pytest.mark.anyio`` test once per param. A module
#: whose tests depend on one backend overrides ``anyio_backend`` with the reason.
BACKENDS = [
    pytest.param("asyncio", id="asyncio"),
    pytest.param(
        "trio",
        id="trio",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("trio") is None,
            reason="trio is not installed (the dev extra has it)",
        ),
    ),
]


@pytest.fixture(scope="module", params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _nixl_missing() -> str | None:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return "NIXL is not installed (make test installs it)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``nixl``-marked tests, with the reason, where NIXL is missing
    (``make test-fast``'s venv); a module that needs NIXL throughout uses
    ``pytest.importorskip("nixl._api", ...)`` instead."""
    marked = [item for item in items if item.get_closest_marker("nixl") is not None]
    reason = _nixl_missing() if marked else None
    if reason is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))
