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
        limit: float | None = option(None, "at most this long in all", unit="s", low="timeout")

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
    #: Inclusive bounds, and an exclusive lower one (``above=0``: positive); of a
    #: str or bytes option, its length in bytes. A bound may name an option declared
    #: before it (``low="ready_timeout"``, ``above="timing.max_transit"``), checked
    #: by :func:`check_options` (no bound while that one is ``None``).
    low: float | str | None = None
    high: float | str | None = None
    above: float | str | None = None
    #: The allowed values (an enum field's are its members' values).
    choices: tuple[object, ...] = ()
    #: Turns a raw value into the field's value, and accepts the field's own
    #: values (:func:`check_options` runs it too); raises ValueError naming what
    #: it expected. For shapes the type alone cannot say (``host:port``).
    parse: Callable[[Any], Any] | None = None
    #: Not offered on a command line (:func:`add_arguments` skips it); a str
    #: names its flag where another program's name is kept (``"block-size"``).
    cli: bool | str = True
    #: An empty str, list or set is a value (default: refused).
    empty: bool = False
    #: A key: its value is never shown in an error.
    secret: bool = False


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
        _check(f.name, getattr(obj, f.name), spec, kind, obj)


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, prefix: str = "") -> None:
    """One ``--name`` per option of ``cls`` (``_`` as ``-``), default unset so
    that :func:`from_arguments` passes only what was given."""
    for f, spec, kind in option_specs(cls):
        if not spec.cli:
            continue
        flag = "--" + prefix + (spec.cli if isinstance(spec.cli, str) else f.name.replace("_", "-"))
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        shown = f" [{spec.unit}]" if spec.unit else ""
        text = f"{spec.help}{shown} (default: {_show(default)})"
        common: dict[str, Any] = {"dest": prefix + f.name, "default": None, "help": text}
        base = _base(kind)
        if base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        elif base in (tuple, frozenset) and spec.parse is None:  # else: one text to parse
            parser.add_argument(flag, nargs="+", **common)
        else:  # choices shown, not enforced: from_arguments refuses with the option's text
            choices = spec.choices or _members(base)
            metavar = "{" + ",".join(map(str, choices)) + "}" if choices else None
            kind_of = base if base in (int, float) else str
            parser.add_argument(flag, type=kind_of, metavar=metavar, **common)


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


def _parse(name: str, value: Any, spec: Spec) -> Any:
    if spec.parse is None:
        return value
    try:
        return spec.parse(value)
    except (ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{name} must be {exc}{_got(value, spec)}") from None


def _convert(name: str, value: Any, spec: Spec, kind: Any) -> Any:
    """A raw value in the field's type; what cannot be converted is left for
    :func:`_check` to refuse with the option's one error text."""
    if spec.parse is not None and value is not None:
        return _parse(name, value, spec)
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


def _check(name: str, value: Any, spec: Spec, kind: Any, obj: object) -> None:
    if value is None and type(None) in typing.get_args(kind):
        return
    if spec.parse is not None:
        _parse(name, value, spec)
    elif not _fits(value, spec, _base(kind), obj):
        raise ConfigError(f"{name} must be {_expected(spec, kind)}{_got(value, spec)}")


def _got(value: Any, spec: Spec) -> str:
    return "" if spec.secret else f", got {value!r:.80}"


def _fits(value: Any, spec: Spec, base: Any, obj: object) -> bool:
    choices = spec.choices or _members(base)
    if choices:
        raw = value.value if isinstance(value, enum.Enum) else value
        return raw in choices and (not isinstance(base, type) or isinstance(value, base))
    if base is bool:
        return type(value) is bool
    if base in (int, float):
        number = type(value) is int or (base is float and type(value) is float)
        return number and math.isfinite(value) and _in_range(value, spec, obj)
    if base in (str, bytes):
        size = len(value.encode() if type(value) is str else value) if type(value) is base else -1
        return size >= (0 if spec.empty else 1) and _in_range(size, spec, obj)
    if base in (tuple, frozenset):
        items = isinstance(value, base) and all(type(v) is str and v for v in value)
        return items and (spec.empty or bool(value))
    return isinstance(value, base) if isinstance(base, type) else True


def _members(base: Any) -> tuple[object, ...]:
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return tuple(m.value for m in base)
    return ()


def _in_range(value: float, spec: Spec, obj: object) -> bool:
    above, low, high = (_bound(b, obj) for b in (spec.above, spec.low, spec.high))
    if above is not None and not value > above:
        return False
    return (low is None or value >= low) and (high is None or value <= high)


def _bound(bound: float | str | None, obj: object) -> Any:
    """A number, or the value of the option it names (``None`` on the way: no bound)."""
    if not isinstance(bound, str):
        return bound
    for name in bound.split("."):
        obj = None if obj is None else getattr(obj, name)
    return obj


def _expected(spec: Spec, kind: Any) -> str:
    """The option's one error text: what a value must be."""
    base = _base(kind)
    choices = spec.choices or _members(base)
    if choices:
        return "one of " + ", ".join(repr(c) for c in choices)
    unit = f" ({spec.unit})" if spec.unit else ""
    if base is bool:
        return "true or false"
    if base in (tuple, frozenset):
        return f"a {'' if spec.empty else 'non-empty '}list of non-empty str"
    low, high = _num(spec.low), _num(spec.high)
    if base in (str, bytes):
        sizes = [f"at least {low}"] * bool(spec.low) + [f"at most {high}"] * bool(spec.high)
        plain = "" if spec.empty or spec.low else "non-empty "
        noun = f"a {plain}str" if base is str else f"{plain}bytes"
        return noun + (f" of {' and '.join(sizes)} bytes" if sizes else "")
    if base not in (int, float):
        return f"a {getattr(base, '__name__', base)}"
    bounds = [f"> {_num(spec.above)}"] if spec.above is not None else []
    if spec.low is not None and spec.high is not None:
        bounds.append(f"in [{low}, {high}]")
    elif spec.low is not None or spec.high is not None:
        bounds.append(f">= {low}" if spec.low is not None else f"<= {high}")
    noun = "an int" if base is int else "a number"
    return " ".join([noun + unit, *bounds])


def _num(bound: float | str | None) -> str:
    if isinstance(bound, float):
        return f"{bound:g}"
    return "" if bound is None else str(bound)


def _show(default: Any) -> str:
    if isinstance(default, enum.Enum):
        return str(default.value)
    if isinstance(default, (tuple, frozenset)):
        return " ".join(map(str, default)) or "none"
    return str(default)
