"""The public names: ``__all__`` tuples that match what the packages define."""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import pkgutil
import types
import warnings

import pytest

import kvpush
import kvpush.protocol


def test_all_are_tuples_of_existing_names() -> None:
    for module in (kvpush, kvpush.protocol):
        names = module.__all__
        assert isinstance(names, tuple), module.__name__
        assert len(set(names)) == len(names), module.__name__
        for name in names:
            assert isinstance(name, str)
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_top_level_reexports_the_protocol() -> None:
    assert set(kvpush.protocol.__all__) <= set(kvpush.__all__)
    for name in kvpush.protocol.__all__:
        assert getattr(kvpush, name) is getattr(kvpush.protocol, name)
    assert isinstance(kvpush.__version__, str)


def _private_modules() -> list[str]:
    path = kvpush.protocol.__path__
    return [
        f"kvpush.protocol.{info.name}"
        for info in pkgutil.iter_modules(path)
        if info.name.startswith("_")
    ]


def test_every_public_class_and_function_of_the_core_is_exported() -> None:
    exported = set(kvpush.protocol.__all__)
    missing = []
    for name in dir(kvpush.protocol):
        if name.startswith("_"):
            continue
        obj = getattr(kvpush.protocol, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        home = getattr(obj, "__module__", "")
        if home.startswith("kvpush.protocol._") and name not in exported:
            missing.append(name)
    assert missing == []


def test_private_modules_declare_exports_that_exist() -> None:
    modules = _private_modules()
    assert "kvpush.protocol._consumer" in modules
    for qualname in modules:
        module = importlib.import_module(qualname)
        names = getattr(module, "__all__", None)
        assert isinstance(names, tuple), qualname
        for name in names:
            assert hasattr(module, name), f"{qualname}.{name}"


def test_public_classes_and_functions_reach_the_package() -> None:
    """A class a private module exports, and the package re-exports, is the same
    object under both names (no stale copies)."""
    for qualname in _private_modules():
        module = importlib.import_module(qualname)
        for name in module.__all__:
            if name in kvpush.protocol.__all__:
                assert getattr(kvpush.protocol, name) is getattr(module, name)


# Every public module of the packages (anyio's ``test_all_attributes``):
# its ``__all__`` is a tuple that lists every public name the module defines
# (def, class, assignment) or, for a package, re-exports from its private
# modules, and nothing that does not exist. Modules are found by walking the
# packages, so a module that moves or appears is checked without listing it.

PACKAGES = ("kvpush", "kvpush_nixl", "kvpush_vllm", "kvpush_router")


def _unwalkable(name: str) -> None:
    """A package that fails to import is an error, not a subtree left out."""
    raise ImportError(f"cannot walk {name}")


def _public_modules() -> list[str]:
    names = []
    for package in PACKAGES:
        root = importlib.import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}.", onerror=_unwalkable):
            if not any(part.startswith("_") for part in info.name.split(".")):
                names.append(info.name)
    return sorted(names)


def _import_public(qualname: str) -> types.ModuleType:
    """Import a public module; skip (with the reason) only where it needs an
    optional dependency that is not installed (vLLM or NIXL: ``make
    test-fast``'s venv has neither)."""
    try:
        # torch and vLLM warn at import (tests/vllm/conftest.py): not ours to fail on.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(qualname)
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing in _OPTIONAL:
            pytest.skip(f"{qualname} needs {missing}, not installed")
        raise


#: Optional dependencies a public module may need (extras, or vLLM itself).
_OPTIONAL = {"vllm", "torch", "nixl", "nixl_cu12", "hypothesis", "h11", "prometheus_client", "rich"}


def _declared(module: types.ModuleType) -> set[str]:
    """The public names the module's source defines at top level (also under
    ``if``/``try``), and, for a package, those it imports from its own
    private modules (``from ._x import Name``): its re-exports."""
    tree = ast.parse(inspect.getsource(module))
    is_package = hasattr(module, "__path__")
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for st in body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(st.name)
            elif isinstance(st, ast.Assign):
                for target in st.targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                names.add(st.target.id)
            elif (
                isinstance(st, ast.ImportFrom)
                and is_package
                and st.level == 1
                and st.module is not None
                and st.module.startswith("_")
            ):
                names.update(a.asname or a.name for a in st.names if a.name != "*")
            elif isinstance(st, ast.If):
                visit(st.body)
                visit(st.orelse)
            elif isinstance(st, ast.Try):
                visit(st.body)
                visit(st.orelse)
                visit(st.finalbody)
                for handler in st.handlers:
                    visit(handler.body)

    visit(tree.body)
    return {n for n in names if not n.startswith("_")}


def _not_api(value: object) -> bool:
    """A module's logger is reached by its logging name, not imported."""
    return isinstance(value, logging.Logger)


def test_the_walk_finds_the_public_modules() -> None:
    modules = _public_modules()
    expected = {"kvpush", "kvpush.protocol", "kvpush.runtime", "kvpush_vllm.connector"}
    assert expected | {"kvpush_router"} <= set(modules)
    assert not [m for m in modules if "._" in m]


@pytest.mark.parametrize("qualname", _public_modules())
def test_all_attributes(qualname: str) -> None:
    module = _import_public(qualname)
    names = getattr(module, "__all__", None)
    assert isinstance(names, tuple), f"{qualname}.__all__ is not a tuple"
    assert len(set(names)) == len(names), f"{qualname}.__all__ repeats a name"
    assert all(isinstance(n, str) for n in names), qualname
    absent = [n for n in names if not hasattr(module, n)]
    assert absent == [], f"{qualname}.__all__ lists names it lacks"
    # Defined here: in the source, or (classes, functions) by their __module__.
    here = _declared(module) | {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == qualname
    }
    missing = sorted(n for n in here - set(names) if not _not_api(getattr(module, n, None)))
    assert missing == [], f"{qualname} defines public names its __all__ lacks"
    private = [n for n in names if n.startswith("_") and n != "__version__"]
    assert private == [], f"{qualname}.__all__ lists private names"


def test_moved_names_are_exported_by_their_layer() -> None:
    """The shared-memory transport is its own package's, the planner the
    runtime's (docs/architecture.md); neither is left behind."""
    import kvpush.runtime
    import kvpush.shm

    assert "ShmTransport" in kvpush.shm.__all__
    assert not hasattr(kvpush.runtime, "ShmTransport")
    for name in ("TransferPlan", "TransferPlanner", "plan_transfer"):
        assert name in kvpush.runtime.__all__
        assert name not in kvpush.protocol.__all__ and not hasattr(kvpush, name)
