"""The layers of docs/architecture.md, enforced on every import.

Every ``.py`` of ``kvpush``, ``kvpush_nixl``, ``kvpush_vllm`` and ``kvpush_router`` is parsed
(no import runs) and every import in it is checked: module-level, inside
functions, under ``TYPE_CHECKING``, and ``importlib.import_module`` /
``__import__`` of a constant name. The rules, with the layer table read from
docs/architecture.md (the one place it lives):

* an import points to the importer's own component or to one its row lists
  (each of a lower layer): no arrow runs up, or sideways between transports;
* a private module (``_name``) is used only inside its own package;
* a library a row claims (``nixl``, ``vllm``, ...) is imported by that row only;
* a dynamic import names a constant, so that this test can see it;
* the core does no I/O: only the standard library without I/O, clocks,
  threads, randomness or concurrency, and ``msgpack`` (the sans-IO rule).

The checker is tested on planted sources too, so a broken checker cannot pass
a broken tree. The registries that let ``kvpush`` reach the packages above it
without importing them are tested at the end.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pytest

import kvpush.cli
import kvpush.runtime
import kvpush.runtime._registry
from kvpush.runtime import TransportError, transport_kind, transport_kinds

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGES = ("kvpush", "kvpush_nixl", "kvpush_vllm", "kvpush_router")

#: Standard-library modules the core may not import: I/O, time, randomness, concurrency.
CORE_FORBIDDEN = frozenset(
    {
        "socket",
        "ssl",
        "threading",
        "_thread",
        "time",
        "random",
        "secrets",
        "uuid",
        "asyncio",
        "os",
        "subprocess",
        "select",
        "selectors",
        "signal",
        "multiprocessing",
        "concurrent",
        "importlib",
    }
)
#: The only libraries outside the standard library the core may import.
CORE_LIBRARIES = frozenset({"msgpack"})


# --- the table ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Component:
    """One row of the layer table."""

    name: str
    #: ``None``: beside the layers (the test kit), importable by no row.
    layer: int | None
    modules: tuple[str, ...]
    may_import: frozenset[str]
    #: Libraries no other row may import.
    owns: frozenset[str]
    #: Rows whose private modules this one may open too (white-box).
    private_of: frozenset[str] = frozenset()

    def match(self, module: str) -> int:
        """How specific the longest of this row's names matching ``module``
        is (its length), or -1."""
        best = -1
        for pattern in self.modules:
            if pattern.endswith("*"):
                hit = module.startswith(pattern[:-1])
            else:
                hit = module == pattern or module.startswith(pattern + ".")
            if hit:
                best = max(best, len(pattern))
        return best


Table = Mapping[str, Component]


def parse_table(markdown: str) -> dict[str, Component]:
    """The rows between ``<!-- layers -->`` and ``<!-- end -->``."""
    found = re.search(r"<!-- layers -->\n(.*?)<!-- end -->", markdown, re.S)
    assert found, "no <!-- layers --> table"
    rows = [line for line in found.group(1).splitlines() if line.startswith("|")][2:]
    table: dict[str, Component] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert len(cells) == 5, row
        layer, name, modules, may, owns = cells
        listed = [n.strip() for n in may.split(",") if n.strip()]
        white_box = {n.removesuffix("(private too)").strip() for n in listed if "(" in n}
        table[name] = Component(
            name=name,
            layer=None if layer in ("-", "") else int(layer),
            modules=tuple(re.findall(r"`([^`]+)`", modules)),
            may_import=frozenset(n.split("(")[0].strip() for n in listed),
            owns=frozenset(re.findall(r"`([^`]+)`", owns)),
            private_of=frozenset(white_box),
        )
    return table


TABLE = parse_table(ARCHITECTURE.read_text())


def component_of(module: str, table: Table) -> Component | None:
    """The row whose longest name matches ``module``."""
    best, found = -1, None
    for component in table.values():
        score = component.match(module)
        if score > best:
            best, found = score, component
    return found


# --- the imports -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Import:
    line: int
    #: The module imported (a package as ``pkg.__init__`` when it is one).
    target: str
    #: ``from target import name``: the name, which may itself be a module.
    name: str | None = None


def module_name(path: Path, root: Path) -> str:
    """``kvpush/runtime/__init__.py`` -> ``kvpush.runtime.__init__``."""
    return ".".join(path.relative_to(root).with_suffix("").parts)


def tree_sources(root: Path = ROOT) -> dict[str, str]:
    """Every module of the packages, by name."""
    return {
        module_name(path, root): path.read_text()
        for package in PACKAGES
        for path in sorted((root / package).rglob("*.py"))
    }


def _package(module: str) -> str:
    return module.rpartition(".")[0]


def _canonical(name: str, known: Mapping[str, object]) -> str:
    return f"{name}.__init__" if f"{name}.__init__" in known else name


_DYNAMIC = frozenset({"import_module", "__import__"})


def imports_of(module: str, source: str, known: Mapping[str, object]) -> Iterator[Import | str]:
    """Every import of ``module`` (relative ones resolved), or a complaint
    (str), in source order."""
    nodes = sorted(ast.walk(ast.parse(source, module)), key=lambda n: getattr(n, "lineno", 0))
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, _canonical(alias.name, known))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = _package(module).split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                assert node.module is not None
                name = node.module
            for alias in node.names:
                yield Import(node.lineno, _canonical(name, known), alias.name)
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called not in _DYNAMIC:
                continue
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield Import(node.lineno, _canonical(arg.value, known))
            else:
                yield f"line {node.lineno}: {called} of a computed name (use a registry)"


def _private_owner(name: str) -> str | None:
    """The package a private part of ``name`` is private to, if any."""
    parts = name.split(".")
    for i, part in enumerate(parts[1:], 1):
        if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
            return ".".join(parts[:i])
    return None


def _owners(table: Table) -> dict[str, str]:
    return {lib: c.name for c in table.values() for lib in c.owns}


def _arrow(home: Component, there: Component) -> str:
    if there.layer is None:
        return "nothing imports the test kit"
    if home.layer is None:
        return "not in its row"
    if there.layer > home.layer:
        return "an arrow up"
    return "sideways" if there.layer == home.layer else "not in its row"


def check(sources: Mapping[str, str], table: Table = TABLE) -> list[str]:
    """Every breach of the layer rules in ``sources`` (module name -> source)."""
    owners = _owners(table)
    problems: list[str] = []
    for module, source in sorted(sources.items()):
        home = component_of(module, table)
        if home is None:
            problems.append(f"{module}: in no row of the layer table")
            continue
        for imp in imports_of(module, source, sources):
            if isinstance(imp, str):
                problems.append(f"{module}: {imp}")
                continue
            where = f"{module}:{imp.line}"
            dotted = imp.target.removesuffix(".__init__")
            full = f"{dotted}.{imp.name}" if imp.name and imp.name != "*" else dotted
            top = dotted.split(".")[0]
            if top not in PACKAGES:
                owner = owners.get(top)
                if owner is not None and owner != home.name:
                    problems.append(f"{where} imports {dotted}: only {owner} may import {top}")
                continue
            # "from pkg import sub" imports the module pkg.sub when there is one.
            sub = _canonical(full, sources)
            target = sub if sub in sources else imp.target
            there = component_of(target, table)
            if there is None:
                problems.append(f"{where} imports {dotted}: in no row of the layer table")
            elif there is not home and there.name not in home.may_import:
                problems.append(
                    f"{where} imports {full}: {home.name} (layer {home.layer}) may not import "
                    f"{there.name} (layer {there.layer}): {_arrow(home, there)}"
                )
            private = _private_owner(full)
            if (
                private is not None
                and not (module + ".").startswith(private + ".")
                and (there is None or there.name not in home.private_of)
            ):
                problems.append(f"{where} imports {full}: a private part of {private}")
    return problems


def core_problems(sources: Mapping[str, str], table: Table = TABLE) -> list[str]:
    """The sans-IO rule over the core row's modules."""
    problems = []
    for module, source in sorted(sources.items()):
        if component_of(module, table) is not table["core"]:
            continue
        for imp in imports_of(module, source, sources):
            if isinstance(imp, str):
                problems.append(f"{module}: {imp}")
                continue
            top = imp.target.split(".")[0]
            if top in PACKAGES or top == "__future__" or top in CORE_LIBRARIES:
                continue
            if top in CORE_FORBIDDEN:
                problems.append(f"{module}:{imp.line} imports {imp.target}: I/O in the core")
            elif top not in sys.stdlib_module_names:
                problems.append(f"{module}:{imp.line} imports {imp.target}: not stdlib or msgpack")
    return problems


# --- the tree ------------------------------------------------------------------

SOURCES = tree_sources()


def test_the_tree_keeps_the_layers() -> None:
    assert check(SOURCES) == []


def test_the_core_does_no_io() -> None:
    assert core_problems(SOURCES) == []


def test_every_module_is_in_a_row_and_every_name_of_a_row_is_used() -> None:
    assert [m for m in SOURCES if component_of(m, TABLE) is None] == []
    for component in TABLE.values():
        for pattern in component.modules:
            single = Component("x", 1, (pattern,), frozenset(), frozenset())
            assert any(single.match(m) >= 0 for m in SOURCES), f"{pattern} matches no module"


def test_the_table_points_down() -> None:
    layers = sorted({c.layer for c in TABLE.values() if c.layer is not None})
    assert layers == list(range(1, len(layers) + 1)) and TABLE["core"].layer == 1
    for component in TABLE.values():
        for name in component.may_import:
            target = TABLE[name]
            assert target.layer is not None, f"{component.name} may import the test kit"
            if component.layer is not None:
                assert target.layer < component.layer, f"{component.name} -> {name} points up"
    assert TABLE["core"].may_import == frozenset()
    # White-box access is the test kit's alone, and only to rows it may import.
    assert {c.name for c in TABLE.values() if c.private_of} <= {"testing"}
    assert all(c.private_of <= c.may_import for c in TABLE.values())


def test_the_walk_sees_what_it_must() -> None:
    """The real tree's modules, relative imports and lazy imports are all seen."""
    assert "kvpush.__init__" in SOURCES and "kvpush.shm._ring" in SOURCES
    targets = {
        i.target
        for i in imports_of("kvpush.shm._ring", SOURCES["kvpush.shm._ring"], SOURCES)
        if isinstance(i, Import)
    }
    assert {"kvpush.runtime.__init__", "_posixshmem", "numpy"} <= targets  # lazy one too
    assert component_of("kvpush_router._core", TABLE) is TABLE["router"]
    assert component_of("kvpush_router.__init__", TABLE) is TABLE["router"]
    assert component_of("kvpush_vllm.connector", TABLE) is TABLE["vllm"]
    assert component_of("kvpush.__init__", TABLE) is TABLE["core"]
    assert component_of("kvpush.cli", TABLE) is TABLE["commands"]


def test_kvpush_names_neither_package_above_it() -> None:
    """Not even in a lazy import or an ``import_module`` string."""
    for module, source in SOURCES.items():
        if module.split(".")[0] != "kvpush":
            continue
        for imp in imports_of(module, source, SOURCES):
            assert isinstance(imp, Import), imp
            above = ("kvpush_nixl", "kvpush_vllm", "kvpush_router")
            assert imp.target.split(".")[0] not in above, module


def test_nothing_imports_the_router() -> None:
    """The router is an application: no module outside it names it, not even
    lazily; ``kvpush router`` reaches it through the commands registry."""
    for module, source in SOURCES.items():
        if module.split(".")[0] == "kvpush_router":
            continue
        for imp in imports_of(module, source, SOURCES):
            assert isinstance(imp, Import), imp
            assert imp.target.split(".")[0] != "kvpush_router", f"{module}:{imp.line}"
    (ep,) = (e for e in entry_points(group=kvpush.cli.COMMANDS_GROUP) if e.name == "router")
    assert ep.value == "kvpush_router._command"


# --- the checker, on planted sources ---------------------------------------------

PLANTED = {
    "kvpush.__init__": "from .protocol import *\n",
    "kvpush.protocol.__init__": "from ._codec import Codec\n",
    "kvpush.protocol._codec": "import msgpack\n",
    "kvpush.runtime.__init__": "from ._transport import Transport\n",
    "kvpush.runtime._transport": "from kvpush.protocol import Codec\n",
    "kvpush.shm.__init__": "from ._ring import Segment\n",
    "kvpush.shm._ring": "from kvpush.runtime import Transport\n",
    "kvpush.demo.__init__": "from kvpush.shm import Segment\n",
    "kvpush_nixl.__init__": "import numpy\n",
    "kvpush_vllm.__init__": "from ._params import P\n",
    "kvpush_vllm._params": "",
    "kvpush_router.__init__": "from ._core import C\n",
    "kvpush_router._core": "from kvpush_vllm import P\nfrom kvpush.runtime import Transport\n",
}


def planted(module: str, source: str) -> list[str]:
    return check({**PLANTED, module: source})


def test_the_planted_tree_is_clean() -> None:
    assert check(PLANTED) == []
    assert core_problems(PLANTED) == []


def test_an_upward_import_is_caught() -> None:
    (problem,) = planted("kvpush.runtime._transport", "from kvpush.shm import Segment\n")
    assert problem.startswith("kvpush.runtime._transport:1 imports kvpush.shm.Segment")
    assert "runtime (layer 2) may not import shm (layer 3): an arrow up" in problem


def test_a_lazy_upward_import_is_caught() -> None:
    source = "def f():\n    if True:\n        from kvpush_router import _core\n"
    problems = planted("kvpush.protocol._codec", source)
    assert any("kvpush.protocol._codec:3" in p and "an arrow up" in p for p in problems)


def test_a_dynamic_import_is_caught() -> None:
    upward = planted(
        "kvpush.demo.__init__", "import importlib\nimportlib.import_module('kvpush_nixl')\n"
    )
    assert (
        upward and "commands (layer 5) may not import nixl (layer 3): not in its row" in upward[0]
    )
    (computed,) = planted(
        "kvpush.demo.__init__", "import importlib\nname = 'x'\n__import__(name)\n"
    )
    assert "computed name" in computed


def test_a_sideways_import_between_transports_is_caught() -> None:
    (problem,) = planted("kvpush.shm._ring", "import kvpush_nixl\n")
    assert "shm (layer 3) may not import nixl (layer 3): sideways" in problem


def test_kvpush_importing_the_vllm_package_is_caught() -> None:
    layer, private = planted("kvpush.demo.__init__", "from kvpush_router import _core\n")
    assert "commands (layer 5) may not import router (layer 5): sideways" in layer
    assert private.endswith("a private part of kvpush_router")
    (problem,) = planted("kvpush_vllm.__init__", "def f():\n    import kvpush_router\n")
    assert "vllm (layer 4) may not import router (layer 5): an arrow up" in problem


def test_the_router_using_the_shims_private_modules_is_caught() -> None:
    (problem,) = planted("kvpush_router._core", "from kvpush_vllm._params import P\n")
    assert problem.endswith("imports kvpush_vllm._params.P: a private part of kvpush_vllm")
    (problem,) = planted("kvpush_router._core", "import kvpush.shm\n")
    assert "router (layer 5) may not import shm (layer 3): not in its row" in problem
    (problem,) = planted("kvpush.sim.__init__", "def f():\n    import kvpush_nixl\n")
    assert "kvpush.sim.__init__:2 imports kvpush_nixl: commands (layer 5)" in problem


def test_a_private_module_of_another_package_is_caught() -> None:
    (problem,) = planted("kvpush.demo.__init__", "from kvpush.shm._ring import Segment\n")
    assert (
        problem
        == "kvpush.demo.__init__:1 imports kvpush.shm._ring.Segment: a private part of kvpush.shm"
    )
    (problem,) = planted("kvpush.demo.__init__", "from kvpush.shm import _ring\n")
    assert "a private part of kvpush.shm" in problem
    # Inside its own package it is fine.
    assert planted("kvpush.shm.__init__", "from kvpush.shm._ring import Segment\n") == []


def test_a_library_another_row_owns_is_caught() -> None:
    (problem,) = planted("kvpush.demo.__init__", "def f():\n    import nixl._api\n")
    assert problem == "kvpush.demo.__init__:2 imports nixl._api: only nixl may import nixl"
    assert planted("kvpush_nixl.__init__", "import nixl._api\n") == []


def test_torch_in_the_runtime_for_a_device_copier_is_caught() -> None:
    """Issue 27: the runtime stages transfers but copies device memory only
    through the copier the shim hands it; torch stays in the shim."""
    (problem,) = planted("kvpush.runtime._stage", "def f():\n    import torch\n")
    assert problem == "kvpush.runtime._stage:2 imports torch: only vllm may import torch"
    assert planted("kvpush_vllm._copier", "import torch\n") == []


def test_a_module_outside_the_table_is_caught() -> None:
    sources = {**PLANTED, "kvpush_other.__init__": ""}
    assert check(sources) == ["kvpush_other.__init__: in no row of the layer table"]


def test_the_core_rule_catches_io() -> None:
    sources = {**PLANTED, "kvpush.protocol._codec": "def f():\n    import time\nimport numpy\n"}
    assert core_problems(sources) == [
        "kvpush.protocol._codec:2 imports time: I/O in the core",
        "kvpush.protocol._codec:3 imports numpy: not stdlib or msgpack",
    ]


def test_a_planted_module_on_disk_fails_the_walk(tmp_path: Path) -> None:
    """The whole path: files on disk, the walk, the check (what the tree test runs)."""
    files = {
        "kvpush/__init__.py": "",
        "kvpush/runtime/__init__.py": "from ._dataplane import DataPlane\n",
        "kvpush/runtime/_dataplane.py": (
            "class DataPlane:\n"
            "    def nixl(self):\n"
            "        from kvpush_nixl._transport import NixlTransport\n"
            "        return NixlTransport\n"
        ),
        "kvpush_nixl/__init__.py": "",
        "kvpush_nixl/_transport.py": "from kvpush.runtime import DataPlane\n",
        "kvpush_vllm/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    sources = tree_sources(tmp_path)
    assert set(sources) == {n.removesuffix(".py").replace("/", ".") for n in files}
    assert check(sources) == [
        "kvpush.runtime._dataplane:3 imports kvpush_nixl._transport.NixlTransport: runtime "
        "(layer 2) may not import nixl (layer 3): an arrow up",
        "kvpush.runtime._dataplane:3 imports kvpush_nixl._transport.NixlTransport: "
        "a private part of kvpush_nixl",
    ]


def test_relative_imports_resolve() -> None:
    found = list(
        imports_of("kvpush.shm._ring", "from . import _x\nfrom ..runtime import y\n", PLANTED)
    )
    assert found == [
        Import(1, "kvpush.shm.__init__", "_x"),
        Import(2, "kvpush.runtime.__init__", "y"),
    ]
    found = list(imports_of("kvpush.shm.__init__", "from ._ring import Segment\n", PLANTED))
    assert found == [Import(1, "kvpush.shm._ring", "Segment")]


# --- the registries --------------------------------------------------------------


def test_the_doc_lists_the_registered_entry_points() -> None:
    """docs/architecture.md's registry table is what pyproject.toml registers
    (as installed: a stale install fails here too; ``pip install --no-deps -e .``)."""
    text = ARCHITECTURE.read_text().split("## The registries", 1)[1]
    rows = set(re.findall(r"^\| `(kvpush\.\w+)` \| `(\w+)` \| `([^`]+)` \|", text, re.M))
    groups = (kvpush.cli.COMMANDS_GROUP, kvpush.runtime.TRANSPORTS_GROUP)
    installed = {
        (ep.group, ep.name, ep.value)
        for group in groups
        for ep in entry_points(group=group)
        if ep.dist is not None and ep.dist.name == "kvpush"
    }
    assert rows == installed
    assert {name for _, name, _ in rows} >= {"demo", "router", "simulate", "shm", "nixl"}


def test_both_transports_are_registered() -> None:
    from kvpush.shm import ShmTransport
    from kvpush_nixl import INSTALL_HINT, NixlTransport

    kinds = transport_kinds()
    assert {"shm", "nixl"} <= set(kinds)
    assert kinds["shm"].factory is ShmTransport
    assert kinds["nixl"].factory is NixlTransport
    assert kinds["nixl"].install_hint == INSTALL_HINT
    kinds["shm"].probe()


def test_a_transport_nobody_registered_is_refused_by_name() -> None:
    with pytest.raises(
        TransportError, match=r"no transport named 'rdma' is installed \(installed: .*nixl.*shm"
    ):
        transport_kind("rdma")


def test_a_missing_library_is_reported_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # import fails as if absent
    with pytest.raises(TransportError, match="pip install --no-deps nixl nixl-cu12"):
        transport_kind("nixl").probe()


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, module: object, *eps: EntryPoint) -> None:
    monkeypatch.setattr(module, "entry_points", lambda group: [e for e in eps if e.group == group])


def test_a_registered_transport_that_cannot_be_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = EntryPoint("gone", "kvpush_no_such_package:TRANSPORT", "kvpush.transports")
    _fake_entry_points(monkeypatch, kvpush.runtime._registry, ep)
    with pytest.raises(TransportError, match=r"'gone' is registered .* cannot be imported"):
        transport_kind("gone")
    bad = EntryPoint("bad", "kvpush.shm:ShmTransport", "kvpush.transports")
    _fake_entry_points(monkeypatch, kvpush.runtime._registry, bad)
    with pytest.raises(TransportError, match="not a TransportKind"):
        transport_kind("bad")


def test_the_commands_are_registered() -> None:
    parser = kvpush.cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) >= {"demo", "router", "simulate"}


class _NeedsALibrary:
    HELP = "needs a library"
    DESCRIPTION = "a command whose library is missing"
    INSTALL_HINT = "install kvpush[extra]"

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        import kvpush_no_such_library  # noqa: F401

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        raise AssertionError("never run")


def test_a_command_without_its_library_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "NEEDS", _NeedsALibrary, raising=False)
    eps = (
        EntryPoint("needy", f"{__name__}:NEEDS", "kvpush.commands"),
        EntryPoint("gone", "kvpush_no_such_package", "kvpush.commands"),
    )
    _fake_entry_points(monkeypatch, kvpush.cli, *eps)
    assert kvpush.cli.main(["needy", "--any", "flag"]) == 2
    err = capsys.readouterr().err
    assert "kvpush needy: No module named 'kvpush_no_such_library'; install kvpush[extra]" in err
    assert kvpush.cli.main(["gone"]) == 2
    assert "kvpush gone: kvpush_no_such_package cannot be imported" in capsys.readouterr().err


def test_the_router_command_without_h11() -> None:
    """In a fresh interpreter: h11 blocked, ``kvpush router`` is listed and says why."""
    code = (
        "import sys; sys.modules['h11'] = None\n"
        "from kvpush.cli import main\n"
        "raise SystemExit(main(['router', '--prefill', 'http://p:1@p:2', '--decode', 'http://d:3']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "kvpush router: " in done.stderr and "install kvpush[router]" in done.stderr
