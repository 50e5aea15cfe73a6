"""One name per concept where layers meet (issue 29), kept so by parsing the source.

* A block's token count is ``tokens_per_block`` in every layer. vLLM calls it
  ``block_size``: that name is read off vLLM's objects (``cache_config.block_size``)
  and kept for the facts the handshake compares by vLLM's own flag names
  (``kvpush_vllm/_proven.py``), and nowhere else. ``block_tokens`` is gone.
* ``agent`` is a transport agent's name (a ``str``) in every layer; the NIXL
  agent object is a ``NixlAgent`` (``nixl``).
* ``Pair`` (a source and a consumer rank) is defined once, in the core.
* "router" is the HTTP application (``kvpush_router``): no other package has a
  module or a class of that name (the demo's process manager is a supervisor,
  the placement policy is ``kvpush.routing``).

The checker runs on planted sources too, so a broken checker cannot pass.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvpush", "kvpush_nixl", "kvpush_vllm", "kvpush_router")
#: Where vLLM's ``block_size`` may be bound as a name: the proven facts, keyed by vLLM's flags.
VLLM_FACTS = {"kvpush_vllm/_proven.py"}


def _bound(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """Every name a source binds: defs, classes, arguments, assignment targets
    (names and attributes), dataclass fields, keyword arguments of calls."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node.lineno
        elif isinstance(node, ast.arg):
            yield node.arg, node.lineno
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            yield node.id, node.lineno
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            yield node.attr, node.lineno
        elif isinstance(node, ast.keyword) and node.arg is not None:
            yield node.arg, node.value.lineno


def misnamed(path: str, source: str) -> list[str]:
    """The names in ``source`` (at ``path``, relative to the root) that break the rules above."""
    found = []
    for name, line in _bound(ast.parse(source)):
        where = f"{path}:{line}: {name}"
        if name.lstrip("_") in ("block_tokens", "block_size") and path not in VLLM_FACTS:
            found.append(f"{where} (a block's token count is tokens_per_block)")
        elif "Router" in name and not path.startswith("kvpush_router/"):
            found.append(f"{where} (a router is the HTTP application in kvpush_router)")
    return found


def _annotated(tree: ast.AST) -> Iterator[tuple[str, int, ast.expr]]:
    """Every annotated argument and annotated assignment, with its annotation."""
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            yield node.arg, node.lineno, node.annotation
        elif isinstance(node, ast.AnnAssign):
            target = node.target
            name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
            yield name, node.lineno, node.annotation


def agents_not_named(path: str, source: str) -> list[str]:
    """Bindings called ``agent`` annotated as anything but a name (``object``: a
    name not yet checked, as a validator takes it)."""
    return [
        f"{path}:{line}: {name}: {ast.unparse(annotation)}"
        for name, line, annotation in _annotated(ast.parse(source))
        if name.lstrip("_") == "agent"
        and ast.unparse(annotation) not in ("str", "str | None", "object")
    ]


def _sources() -> Iterator[tuple[str, str]]:
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            yield file.relative_to(ROOT).as_posix(), file.read_text()


def test_one_name_per_concept_in_every_package() -> None:
    found = [hit for path, source in _sources() for hit in misnamed(path, source)]
    assert found == []


def test_an_agent_is_a_name() -> None:
    found = [hit for path, source in _sources() for hit in agents_not_named(path, source)]
    assert found == []
    planted = (
        "class T:\n"
        "    def __init__(self, agent: NixlAgent) -> None:\n"
        "        self._agent: Any = 1\n"
    )
    assert len(agents_not_named("kvpush_nixl/_x.py", planted)) == 2
    assert agents_not_named("kvpush_nixl/_x.py", "def f(agent: str) -> None: ...\n") == []


def test_pair_is_defined_once() -> None:
    homes = [
        path
        for path, source in _sources()
        for name, _ in _bound(ast.parse(source))
        if name == "Pair"
    ]
    assert homes == ["kvpush/protocol/_types.py"]


def test_only_the_router_package_has_router_modules() -> None:
    strays = [
        path
        for path, _ in _sources()
        if "router" in Path(path).stem and not path.startswith("kvpush_router/")
    ]
    assert strays == []


def test_the_checker_catches_each_rule_on_planted_sources() -> None:
    planted = (
        "def f(block_size: int) -> None: ...\n"
        "x = Spec(block_tokens=16)\n"
        "class DemoRouter: ...\n"
        "self._block_size = 3\n"
    )
    hits = misnamed("kvpush/demo/_x.py", planted)
    assert sorted(h.split(": ")[1].split(" ")[0] for h in hits) == [
        "DemoRouter",
        "_block_size",
        "block_size",
        "block_tokens",
    ]
    # Reading vLLM's attribute is not binding a name; the facts file may bind it.
    assert misnamed("kvpush_vllm/connector.py", "n = config.cache_config.block_size\n") == []
    assert misnamed("kvpush_vllm/_proven.py", "block_size: int = 16\n") == []
    assert misnamed("kvpush_router/_core.py", "class Router: ...\n") == []
