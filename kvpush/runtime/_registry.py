"""The registry of transports: how the layers above find an implementation of
:class:`~kvpush.runtime.Transport` without the runtime importing one
(docs/architecture.md, "The registries")::

    kind = transport_kind("nixl")
    kind.probe()                 # TransportError naming the fix if NIXL is missing
    transport = kind.factory("prefill-0-r0")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from ._transport import Transport, TransportError

__all__ = ("TRANSPORTS_GROUP", "TransportKind", "transport_kind", "transport_kinds")

#: The entry-point group transport packages register under.
TRANSPORTS_GROUP = "kvpush.transports"


@dataclass(frozen=True, slots=True)
class TransportKind:
    """One registered transport: what its package's entry point names."""

    #: Builds one rank's transport: ``factory(agent, **options)``; the options
    #: are the transport's own (its class documents them).
    factory: Callable[..., Transport]
    #: What to install when :attr:`probe` fails ("" when there is nothing to install).
    install_hint: str = ""
    #: Raises :class:`TransportError` (with the fix) when the transport
    #: cannot run here, e.g. its library is missing; builds nothing, and its
    #: result is ignored.
    probe: Callable[[], object] = lambda: None


def _load(ep: EntryPoint) -> TransportKind:
    try:
        kind = ep.load()
    except ImportError as exc:
        raise TransportError(
            f"transport {ep.name!r} is registered ({ep.value}) but cannot be imported: {exc}"
        ) from exc
    if not isinstance(kind, TransportKind):
        raise TransportError(f"transport {ep.name!r} ({ep.value}) is not a TransportKind")
    return kind


def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=TRANSPORTS_GROUP)}


def transport_kinds() -> dict[str, TransportKind]:
    """Every installed transport, by name (each package imported, no library)."""
    return {name: _load(ep) for name, ep in sorted(_entry_points().items())}


def transport_kind(name: str) -> TransportKind:
    """The installed transport ``name``; :class:`TransportError` naming the
    installed ones if there is none, or if its package cannot be imported."""
    found = _entry_points()
    if name not in found:
        known = ", ".join(sorted(found)) or "none"
        raise TransportError(
            f"no transport named {name!r} is installed (installed: {known}); a transport "
            f"package registers one under the {TRANSPORTS_GROUP!r} entry-point group"
        )
    return _load(found[name])
