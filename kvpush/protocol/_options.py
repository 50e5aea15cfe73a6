"""Configuration as data: frozen dataclasses whose fields carry range, unit and help.

An options class declares each option once, as a field made by :func:`option`.
One validator reads those fields for every way an option arrives: a mapping
(``kv_connector_extra_config``, a JSON file) through :func:`build_options`, a command
line through :func:`add_arguments` and :func:`from_arguments`, or a direct
construction through :func:`check_options` (called from ``__post_init__``). So an
option has one name, one range and one error text everywhere::

    @dataclass(frozen=True, slots=True)
    class Settings:
        timeout: float = option(5.0, "seconds a peer may stay silent", unit="s", above=0)

        def __post_init__(self) -> None:
            check_options(self)

Standard library only, no I/O: the core owns it so that every layer can.
"""

from __future__ import annotations

import argparse
import enum
import functools
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, TypeVar

from ._errors import ConfigError

__all__ = (
    "Spec",
    "add_arguments",
    "build_options",
    "check_options",
    "from_arguments",
    "option",
    "option_specs",
)

T = TypeVar("T")

_KEY = "kvpush.option"


@dataclass(frozen=True, slots=True)
class Spec:
    """What an option's field says about it (its ``metadata``)."""

    help: str
    #: Shown after the help and in errors: "s", "MiB", "bytes".
    unit: str = ""
    #: Inclusive bounds, and an exclusive lower one (``above=0``: positive).
    low: float | None = None
    high: float | None = None
    above: float | None = None
    #: The allowed values (an enum field's are its members' values).
    choices: tuple[object, ...] = ()
    #: Turns a raw value into the field's value; raises ValueError naming
    #: what it expected. For shapes the type alone cannot say (``host:port``).
    parse: Callable[[Any], Any] | None = None
    #: Not offered on a command line (:func:`add_arguments` skips it).
    cli: bool = True
    #: An empty str, list or set is a value (default: refused).
    empty: bool = False


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    **spec: Any,
) -> Any:
    """A dataclass field carrying its :class:`Spec`."""
    meta = {_KEY: Spec(help, **spec)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def option_specs(cls: type) -> Iterator[tuple[Field[Any], Spec, Any]]:
    """``(field, spec, type)`` of each option of ``cls``, in declaration order."""
    return iter(_specs(cls))


@functools.cache
def _specs(cls: type) -> tuple[tuple[Field[Any], Spec, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f, f.metadata[_KEY], hints[f.name]) for f in fields(cls) if _KEY in f.metadata)


def build_options(cls: type[T], raw: Mapping[str, Any] | None, *, what: str, **fixed: Any) -> T:
    """``cls`` from a mapping of option names to raw values (JSON-like):
    unknown keys refused, each value converted and checked. ``fixed`` values
    are passed as they are (not options a user sets)."""
    raw = dict(raw or {})
    known = {f.name: (spec, kind) for f, spec, kind in option_specs(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"unknown {what} key(s) {unknown}; known: {sorted(known)}")
    values = {name: _convert(name, raw[name], *known[name]) for name in raw}
    obj = cls(**values, **fixed)
    check_options(obj)
    return obj


def check_options(obj: object) -> None:
    """:class:`ConfigError` naming the first option of ``obj`` out of its range."""
    for f, spec, kind in option_specs(type(obj)):
        _check(f.name, getattr(obj, f.name), spec, kind)


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, prefix: str = "") -> None:
    """One ``--name`` per option of ``cls`` (``_`` as ``-``), default unset so
    that :func:`from_arguments` passes only what was given."""
    for f, spec, kind in option_specs(cls):
        if not spec.cli:
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        shown = f" [{spec.unit}]" if spec.unit else ""
        text = f"{spec.help}{shown} (default: {_show(default)})"
        base = _base(kind)
        if base is bool:
            parser.add_argument(flag, dest=prefix + f.name, action=argparse.BooleanOptionalAction,
                                default=None, help=text)  # fmt: skip
        elif base in (tuple, frozenset):
            parser.add_argument(flag, dest=prefix + f.name, nargs="+", default=None, help=text)
        else:
            parser.add_argument(flag, dest=prefix + f.name, default=None, help=text,
                                type=_cli_type(base))  # fmt: skip


def from_arguments(
    cls: type[T], namespace: argparse.Namespace, *, what: str, prefix: str = "", **fixed: Any
) -> T:
    """``cls`` from what :func:`add_arguments` parsed (checked as :func:`build_options`)."""
    given = {
        f.name: getattr(namespace, prefix + f.name)
        for f, spec, _ in option_specs(cls)
        if spec.cli and getattr(namespace, prefix + f.name, None) is not None
    }
    return build_options(cls, given, what=what, **fixed)


# --- the rules ------------------------------------------------------------------


def _base(kind: Any) -> Any:
    """The type an option's annotation names, ``None`` taken off."""
    args = typing.get_args(kind)
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        return _base(rest[0]) if len(rest) == 1 else kind
    return typing.get_origin(kind) or kind


def _optional(kind: Any) -> bool:
    return type(None) in typing.get_args(kind)


def _cli_type(base: Any) -> Callable[[str], Any]:
    if base is int:
        return int
    if base is float:
        return float
    return str


def _convert(name: str, value: Any, spec: Spec, kind: Any) -> Any:
    """A raw value in the field's type; what cannot be converted is left for
    :func:`_check` to refuse with the option's one error text."""
    if spec.parse is not None and value is not None:
        try:
            return spec.parse(value)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{name} must be {exc}, got {value!r:.80}") from None
    base = _base(kind)
    if isinstance(base, type) and issubclass(base, enum.Enum) and not isinstance(value, base):
        try:
            return base(value)
        except ValueError:
            return value
    if base in (tuple, frozenset) and isinstance(value, (list, tuple, set, frozenset)):
        return base(value)
    if base is float and type(value) is int:
        return float(value)
    if base is bytes and isinstance(value, str):
        return value.encode()
    return value


def _check(name: str, value: Any, spec: Spec, kind: Any) -> None:
    if value is None and _optional(kind):
        return
    if not _fits(value, spec, _base(kind)):
        raise ConfigError(f"{name} must be {_expected(spec, kind)}, got {value!r:.80}")


def _fits(value: Any, spec: Spec, base: Any) -> bool:
    if spec.parse is not None:
        return True  # parse decided
    choices = spec.choices or _members(base)
    if choices:
        raw = value.value if isinstance(value, enum.Enum) else value
        return raw in choices and (not isinstance(base, type) or isinstance(value, base))
    if base is bool:
        return type(value) is bool
    if base in (int, float):
        number = type(value) is int or (base is float and type(value) is float)
        return number and math.isfinite(value) and _in_range(value, spec)
    if base in (str, bytes):
        return type(value) is base and (spec.empty or len(value) >= max(spec.low or 1, 1))
    if base in (tuple, frozenset):
        items = isinstance(value, base) and all(type(v) is str and v for v in value)
        return items and (spec.empty or bool(value))
    return isinstance(value, base) if isinstance(base, type) else True


def _members(base: Any) -> tuple[object, ...]:
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return tuple(m.value for m in base)
    return ()


def _in_range(value: float, spec: Spec) -> bool:
    if spec.above is not None and not value > spec.above:
        return False
    return (spec.low is None or value >= spec.low) and (spec.high is None or value <= spec.high)


def _expected(spec: Spec, kind: Any) -> str:
    """The option's one error text: what a value must be."""
    base = _base(kind)
    choices = spec.choices or _members(base)
    if choices:
        return "one of " + ", ".join(repr(c) for c in choices)
    unit = f" ({spec.unit})" if spec.unit else ""
    if base is bool:
        return "true or false"
    if base in (str, bytes):
        least = f" of at least {spec.low:g} bytes" if spec.low else ""
        return f"a {'' if spec.empty else 'non-empty '}{base.__name__}{least}"
    if base in (tuple, frozenset):
        return f"a {'' if spec.empty else 'non-empty '}list of non-empty str"
    bounds = []
    if spec.above is not None:
        bounds.append(f"> {spec.above:g}")
    if spec.low is not None and spec.high is not None:
        bounds.append(f"in [{spec.low:g}, {spec.high:g}]")
    elif spec.low is not None:
        bounds.append(f">= {spec.low:g}")
    elif spec.high is not None:
        bounds.append(f"<= {spec.high:g}")
    noun = "an int" if base is int else "a number"
    return " ".join([noun + unit, *bounds])


def _show(default: Any) -> str:
    if isinstance(default, enum.Enum):
        return str(default.value)
    if isinstance(default, (tuple, frozenset)):
        return " ".join(map(str, default)) or "none"
    return str(default)
