"""Hypothesis profiles: ``ci`` (default, a few hundred examples) and ``long``
(>= 10,000 examples), chosen with KVPUSH_HYPOTHESIS_PROFILE."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

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
