"""The sans-IO rule: the protocol core imports nothing that does I/O, keeps time,
makes randomness or runs concurrently, and nothing outside the stdlib but numpy and
msgpack."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import kvpush.protocol

CORE = Path(kvpush.protocol.__file__).parent
FORBIDDEN = frozenset(
    {
        "socket",
        "threading",
        "_thread",
        "time",
        "random",
        "secrets",
        "asyncio",
        "anyio",
        "trio",
        "os",
        "subprocess",
        "select",
        "selectors",
        "signal",
        "multiprocessing",
        "concurrent",
        "nixl",
        "vllm",
        "torch",
        "kvpush_nixl",
        "kvpush_vllm",
        "kvpush.runtime",
        "kvpush.testing",
    }
)
THIRD_PARTY = frozenset({"numpy", "msgpack"})


def _modules() -> list[Path]:
    files = sorted(CORE.rglob("*.py"))
    assert CORE / "_consumer.py" in files
    return files


def _package_of(path: Path) -> str:
    rel = path.relative_to(CORE.parent.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1])
    return ".".join(parts[:-1])


def imported_names(path: Path) -> list[str]:
    """Every module ``path`` imports, relative imports resolved to absolute names."""
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(path).split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base)
                module = f"{prefix}.{node.module}" if node.module else prefix
                # "from . import x" may import submodule x
                names += [module] + [f"{module}.{a.name}" for a in node.names]
            else:
                assert node.module is not None
                names.append(node.module)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id != "__import__", f"{path}: dynamic import"
    return names


def violation(name: str) -> str | None:
    top = name.split(".", maxsplit=1)[0]
    for bad in FORBIDDEN:
        if name == bad or name.startswith(bad + "."):
            return f"{name} is forbidden in the core"
    if top == "kvpush":
        if name == "kvpush" or name.startswith("kvpush.protocol"):
            return None
        return f"{name} is outside kvpush.protocol"
    if top in THIRD_PARTY or top == "__future__":
        return None
    if top not in sys.stdlib_module_names:
        return f"{name} is neither stdlib nor an allowed dependency"
    return None


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_core_module_imports_only_allowed_modules(path: Path) -> None:
    bad = [v for v in map(violation, imported_names(path)) if v]
    assert bad == [], f"{path.name}: {bad}"


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("time", False),
        ("os.path", False),
        ("concurrent.futures", False),
        ("kvpush.runtime.loop", False),
        ("kvpush_nixl", False),
        ("requests", False),
        ("heapq", True),
        ("numpy", True),
        ("kvpush.protocol._types", True),
    ],
)
def test_the_rule_itself(name: str, ok: bool) -> None:
    assert (violation(name) is None) is ok


def test_relative_imports_are_resolved(tmp_path: Path) -> None:
    names = imported_names(CORE / "_consumer.py")
    assert "kvpush.protocol._tables" in names
    assert "heapq" in imported_names(CORE / "_endpoint.py")
