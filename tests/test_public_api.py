"""The public names: ``__all__`` tuples that match what the packages define."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

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
