"""The ``e2e`` marker, and a summary of the e2e test's timings at the end of the run."""

from __future__ import annotations

import pytest
from cluster import TIMINGS


def pytest_configure(config: pytest.Config) -> None:
    # Also listed in pyproject.toml's markers; registering it here keeps
    # --strict-markers happy when this directory is run on its own.
    config.addinivalue_line(
        "markers", "e2e: end-to-end test with real vLLM engines (make e2e; needs .venv-e2e)"
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not TIMINGS:
        return
    terminalreporter.section("kvpush e2e timings")
    for name, seconds in TIMINGS.items():
        terminalreporter.write_line(f"{name:<40} {seconds:8.1f} s")
