"""The documentation cannot drift from the code.

docs/protocol.md embeds every machine of ``kvpush.protocol._tables`` twice: as
``render_markdown`` (here) renders it (each row with its effects and the timers armed
after it), and as a mermaid state diagram generated here from the same table.
Both live between marker comments (``<!-- table:NAME -->`` ... ``<!-- end -->``
and ``<!-- diagram:NAME -->`` ... ``<!-- end -->``); this test regenerates them
and demands them verbatim.
docs/api.md must name every counter ``stats()`` can report.

After changing a table, regenerate the blocks with::

    .venv/bin/python tests/test_docs.py

(The doctests in docs/*.md run through pytest's ``--doctest-glob``.)
"""

from __future__ import annotations

import enum
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpush.protocol import _tables
from kvpush.protocol._machine import Machine, Row

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PROTOCOL = DOCS / "protocol.md"

Table = Machine[Any, Any]


def render_markdown(machine: Table) -> str:
    """Render a machine as a Markdown table (used by docs/protocol.md): its
    rows state by state, the inputs a state stays in with no effect on one
    line, and the timers armed after each row (those of the next state)."""

    def line(state: enum.Enum, inputs: str, row: Row[Any]) -> str:
        effects = ", ".join(f"`{e}`" for e in row.effects) or "-"
        timers = ", ".join(f"`{k.name}`" for k, _ in machine.timers.get(row.next, ())) or "-"
        return f"| `{state.name}` | {inputs} | `{row.next.name}` | {effects} | {timers} |"

    lines = ["| state | input | next state | effects | timers |", "|---|---|---|---|---|"]
    for state in type(next(iter(machine))[0]):
        stays = machine.stays.get(state, ())
        for (s, inp), row in machine.rows.items():
            if s is state and inp not in stays:
                lines.append(line(s, f"`{inp.name}`", row))
        if stays:
            lines.append(line(state, ", ".join(f"`{i.name}`" for i in stays), Row(state)))
    return "\n".join(lines)


#: The tables docs/protocol.md renders, by the name used in its markers.
TABLES: dict[str, Table] = {
    "PEER": _tables.PEER,
    "CONSUMER_PUSH": _tables.CONSUMER_PUSH,
    "CONSUMER_PULL": _tables.CONSUMER_PULL,
    "PRODUCER": _tables.PRODUCER,
}


def render_mermaid(table: Table) -> str:
    """A mermaid state diagram of ``table``: one arrow per (state, next state)
    labelled with every input that takes it, self-loops left out (the table
    lists them), the first state of the enum as the start, and every state
    without an outgoing transition as an end."""
    states: list[Any] = list(type(next(iter(table))[0]))
    edges: dict[tuple[str, str], list[str]] = {}
    for (state, inp), new in table.items():
        if new is not state:
            edges.setdefault((state.name, new.name), []).append(inp.name)
    lines = ["stateDiagram-v2", f"    [*] --> {states[0].name}"]
    for (a, b), inputs in edges.items():
        lines.append(f"    {a} --> {b}: {', '.join(inputs)}")
    sources = {s.name for s, _ in table}
    for s in states:
        if s.name not in sources and any(new is s for new in table.values()):
            lines.append(f"    {s.name} --> [*]")
    return "\n".join(lines)


def blocks(name: str, table: Table) -> dict[str, str]:
    """The marked blocks docs/protocol.md must contain for ``table``."""
    return {
        f"table:{name}": render_markdown(table),
        f"diagram:{name}": f"```mermaid\n{render_mermaid(table)}\n```",
    }


def _marked(marker: str, body: str) -> str:
    return f"<!-- {marker} -->\n{body}\n<!-- end -->"


def expected() -> dict[str, str]:
    out: dict[str, str] = {}
    for name, table in TABLES.items():
        out.update(blocks(name, table))
    return out


@pytest.mark.parametrize(("marker", "body"), sorted(expected().items()))
def test_protocol_md_embeds_generated_block(marker: str, body: str) -> None:
    text = PROTOCOL.read_text()
    assert f"<!-- {marker} -->" in text, f"docs/protocol.md lacks the {marker} block"
    assert _marked(marker, body) in text, (
        f"docs/protocol.md's {marker} block is stale: run `.venv/bin/python tests/test_docs.py`"
    )


def test_protocol_md_has_no_unknown_blocks() -> None:
    found = set(re.findall(r"<!-- ((?:table|diagram):\w+) -->", PROTOCOL.read_text()))
    assert found == set(expected())


def test_every_table_is_rendered() -> None:
    """A new table in _tables.py must show up in the docs too."""
    public = {n for n in _tables.__all__ if n.isupper()}
    assert public == set(TABLES)


def test_every_state_is_explained() -> None:
    """Each state of each machine has a row in a state table of protocol.md."""
    text = PROTOCOL.read_text()
    for enum_cls in (_tables.PeerState, _tables.CState, _tables.PState):
        for member in enum_cls:
            assert f"| `{member.name}` |" in text, f"{enum_cls.__name__}.{member.name}"


def test_every_input_is_explained() -> None:
    text = PROTOCOL.read_text()
    for enum_cls in (_tables.PeerInput, _tables.CInput, _tables.PInput):
        for member in enum_cls:
            assert f"| `{member.name}` |" in text, f"{enum_cls.__name__}.{member.name}"


def _counter_names() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "kvpush" / "protocol").glob("*.py"):
        names.update(re.findall(r'_counters\["(\w+)"\]', path.read_text()))
    return names


def test_api_md_names_every_counter() -> None:
    text = (DOCS / "api.md").read_text()
    missing = sorted(n for n in _counter_names() if f"`{n}`" not in text)
    assert not missing, f"docs/api.md does not document counters {missing}"


def test_render_mermaid_shape() -> None:
    diagram = render_mermaid(_tables.PEER)
    assert diagram.splitlines()[:2] == ["stateDiagram-v2", "    [*] --> DISCONNECTED"]
    assert "    DISCONNECTED --> HELLO_SENT: CONNECT" in diagram
    assert "DISCONNECTED --> DISCONNECTED" not in diagram  # self-loops left out


def update() -> int:
    """Rewrite the marked blocks of docs/protocol.md from the tables."""
    text = PROTOCOL.read_text()
    for marker, body in expected().items():
        pattern = re.compile(rf"<!-- {re.escape(marker)} -->\n(?:.*?\n)??<!-- end -->", re.S)
        if not pattern.search(text):
            print(f"no {marker} block in {PROTOCOL}", file=sys.stderr)
            return 1
        text = pattern.sub(lambda _m, m=marker, b=body: _marked(m, b), text)
    PROTOCOL.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(update())
