"""The one validator (``kvpush.protocol._options``): every check of a
:class:`Spec`, :func:`build_options`, :func:`check_options`' messages, the
command line (:func:`add_arguments` / :func:`from_arguments`), and the option
classes built on it: each names the option the user wrote, and docs/vllm.md's
table of connector keys matches :class:`ConnectorConfig`'s fields."""

from __future__ import annotations

import argparse
import enum
import json
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from kvpush.protocol import (
    ConfigError,
    ConsumerConfig,
    Identity,
    ProducerConfig,
    Timing,
    add_arguments,
    build_options,
    check_options,
    from_arguments,
    option,
    option_specs,
)

ROOT = Path(__file__).resolve().parent.parent


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


def _pair(value: Any) -> tuple[str, str]:
    """A parse hook: ``"a:b"`` (or the pair it became)."""
    if isinstance(value, str) and value.count(":") == 1:
        value = tuple(value.split(":"))
    if not (isinstance(value, tuple) and len(value) == 2 and all(value)):
        raise ValueError("a:b")
    return value


@dataclass(frozen=True, slots=True)
class Opts:
    count: int = option(1, "how many", low=1, high=8)
    rate: float = option(2.0, "how fast", unit="Gb/s", above=0)
    limit: float | None = option(None, "at most", unit="s", low="rate")
    flag: bool = option(False, "on or off")
    name: str = option("x", "a name", high=4)
    key: bytes | None = option(None, "a key", low=4, secret=True)
    tags: tuple[str, ...] = option(("a",), "some tags")
    peers: frozenset[str] = option(frozenset(), "some peers", empty=True)
    color: Color = option(Color.RED, "a color")
    level: str = option("low", "a level", choices=("low", "high"))
    pair: tuple[str, str] | None = option(None, "a pair", parse=_pair)
    params: Mapping[str, int] = option(help="a mapping", factory=dict)
    hidden: int = option(0, "not on the command line", cli=False)

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, slots=True)
class Outer:
    inner: Opts | None = Opts()
    after: float = option(5.0, "above inner.rate", above="inner.rate")

    def __post_init__(self) -> None:
        check_options(self)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"count": 0}, "count must be an int in [1, 8], got 0"),
        ({"count": 9}, "count must be an int in [1, 8], got 9"),
        ({"count": True}, "count must be an int in [1, 8], got True"),
        ({"count": 2.0}, "count must be an int in [1, 8], got 2.0"),
        ({"rate": 0.0}, "rate must be a number (Gb/s) > 0, got 0.0"),
        ({"rate": float("inf")}, "rate must be a number (Gb/s) > 0, got inf"),
        ({"rate": float("nan")}, "rate must be a number (Gb/s) > 0, got nan"),
        ({"rate": False}, "rate must be a number (Gb/s) > 0, got False"),
        ({"rate": "1"}, "rate must be a number (Gb/s) > 0, got '1'"),
        ({"limit": 1.0}, "limit must be a number (s) >= rate, got 1.0"),
        ({"flag": 1}, "flag must be true or false, got 1"),
        ({"name": ""}, "name must be a non-empty str of at most 4 bytes, got ''"),
        ({"name": "ééé"}, "name must be a non-empty str of at most 4 bytes, got 'ééé'"),
        ({"name": b"x"}, "name must be a non-empty str of at most 4 bytes, got b'x'"),
        ({"tags": ()}, "tags must be a non-empty list of non-empty str, got ()"),
        ({"tags": ("a", "")}, "tags must be a non-empty list of non-empty str, got ('a', '')"),
        ({"tags": ["a"]}, "tags must be a non-empty list of non-empty str, got ['a']"),
        ({"peers": frozenset({1})}, "peers must be a list of non-empty str, got frozenset({1})"),
        ({"color": "red"}, "color must be one of 'red', 'blue', got 'red'"),
        ({"level": "mid"}, "level must be one of 'low', 'high', got 'mid'"),
        ({"pair": ("a",)}, "pair must be a:b, got ('a',)"),
        ({"params": []}, "params must be a Mapping, got []"),
    ],
)
def test_each_check_names_the_option_and_what_it_must_be(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Opts(**changes)
    assert str(info.value) == message


def test_what_fits() -> None:
    ok = Opts(count=8, rate=1, limit=1.0, name="abcd", key=b"1234", peers=frozenset())
    assert (ok.count, ok.rate, ok.limit) == (8, 1, 1.0)
    assert Opts(limit=None).limit is None  # optional: None is a value
    assert Opts(color=Color.BLUE, pair=("a", "b")).pair == ("a", "b")
    assert Opts(name="é").name == "é"  # 2 bytes


def test_a_secret_is_never_shown() -> None:
    with pytest.raises(ConfigError) as info:
        Opts(key=b"abc")
    assert str(info.value) == "key must be bytes of at least 4 bytes"
    assert "abc" not in str(info.value)


def test_a_bound_may_name_another_option_even_a_nested_one() -> None:
    assert Outer(Opts(rate=1.0), 1.5).after == 1.5
    assert Outer(None, -1.0).after == -1.0  # nothing to be above: no bound
    with pytest.raises(ConfigError, match=r"after must be a number > inner\.rate, got 2\.0"):
        Outer(Opts(rate=2.0), 2.0)
    assert Opts(rate=3.0, limit=3.0).limit == 3.0  # inclusive
    with pytest.raises(ConfigError, match=r"limit must be a number \(s\) >= rate, got 2\.9"):
        Opts(rate=3.0, limit=2.9)


def test_build_options_converts_and_refuses_unknown_keys() -> None:
    raw = {
        "rate": 3,
        "key": "abcdef",
        "tags": ["x", "y"],
        "peers": ["p"],
        "color": "blue",
        "pair": "a:b",
    }
    got = build_options(Opts, raw, what="test")
    assert got == Opts(
        rate=3.0, key=b"abcdef", tags=("x", "y"), peers=frozenset({"p"}),
        color=Color.BLUE, pair=("a", "b"),
    )  # fmt: skip
    assert type(got.rate) is float
    assert build_options(Opts, None, what="test") == Opts()
    assert build_options(Opts, {}, what="test", hidden=3).hidden == 3  # fixed: passed as is
    with pytest.raises(ConfigError) as info:
        build_options(Opts, {"cuont": 1, "zz": 2}, what="test")
    assert str(info.value).startswith("unknown test key(s) ['cuont', 'zz']; known: ['color', ")
    with pytest.raises(ConfigError, match=r"^color must be one of 'red', 'blue', got 'green'$"):
        build_options(Opts, {"color": "green"}, what="test")
    with pytest.raises(ConfigError, match=r"^tags must be a non-empty list .*, got 'x'$"):
        build_options(Opts, {"tags": "x"}, what="test")  # a str is not a list of one


def test_the_parse_hook_runs_on_both_paths() -> None:
    with pytest.raises(ConfigError, match=r"^pair must be a:b, got 'ab'$"):
        build_options(Opts, {"pair": "ab"}, what="test")
    with pytest.raises(ConfigError, match=r"^pair must be a:b, got \('a', ''\)$"):
        Opts(pair=("a", ""))  # check_options runs it too
    assert build_options(Opts, {"pair": None}, what="test").pair is None


def _parser(prefix: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    add_arguments(parser, Opts, prefix=prefix)
    return parser


def test_the_command_line_comes_from_the_fields() -> None:
    parser = _parser()
    flags = [a.option_strings[0] for a in parser._actions if a.dest != "help"]
    assert flags == [
        "--count",
        "--rate",
        "--limit",
        "--flag",
        "--name",
        "--key",
        "--tags",
        "--peers",
        "--color",
        "--level",
        "--pair",
        "--params",
    ]  # fmt: skip  (not --hidden: cli=False)
    text = " ".join(parser.format_help().split())
    for shown in ("how fast [Gb/s] (default: 2.0)", "some tags (default: a)", "--color {red,blue}"):
        assert shown in text, text
    assert from_arguments(Opts, parser.parse_args([]), what="t") == Opts()  # defaults: the class's
    args = parser.parse_args(
        ["--count", "3", "--flag", "--tags", "x", "y", "--color", "blue", "--limit", "4"]
    )
    got = from_arguments(Opts, args, what="t")
    assert (got.count, got.flag, got.tags, got.color, got.limit) == (
        3, True, ("x", "y"), Color.BLUE, 4.0,
    )  # fmt: skip
    assert from_arguments(Opts, parser.parse_args(["--no-flag"]), what="t").flag is False


def test_the_command_line_errors_are_the_options_errors() -> None:
    parser = _parser()
    for argv, message in (
        (["--count", "0"], "count must be an int in [1, 8], got 0"),
        (["--rate", "-1"], "rate must be a number (Gb/s) > 0, got -1.0"),
        (["--level", "mid"], "level must be one of 'low', 'high', got 'mid'"),
        (["--pair", "ab"], "pair must be a:b, got 'ab'"),
        (["--limit", "1"], "limit must be a number (s) >= rate, got 1.0"),
    ):
        with pytest.raises(ConfigError) as info:
            from_arguments(Opts, parser.parse_args(argv), what="t")
        assert str(info.value) == message
    with pytest.raises(SystemExit):  # not a number at all: argparse says so
        parser.parse_args(["--count", "three"])


def test_a_prefix_keeps_two_option_classes_apart() -> None:
    parser = _parser("a-")
    args = parser.parse_args(["--a-count", "2", "--a-flag"])
    assert vars(args)["a-count"] == 2
    got = from_arguments(Opts, args, what="t", prefix="a-")
    assert (got.count, got.flag) == (2, True)


@dataclass(frozen=True)
class _Named:
    tokens_per_block: int = option(16, "tokens per block", low=1, cli="block-size")

    def __post_init__(self) -> None:
        check_options(self)


def test_a_flag_may_keep_another_programs_name() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, _Named)
    assert "--tokens-per-block" not in parser.format_help()
    got = from_arguments(_Named, parser.parse_args(["--block-size", "32"]), what="t")
    assert got.tokens_per_block == 32
    assert from_arguments(_Named, parser.parse_args([]), what="t").tokens_per_block == 16


def test_option_specs_in_declaration_order() -> None:
    names = [f.name for f, _, _ in option_specs(Opts)]
    assert names[:3] == ["count", "rate", "limit"] and names[-1] == "hidden"


# --- the classes built on it -----------------------------------------------------------


def test_the_core_configs_name_the_field_and_the_bound() -> None:
    me = Identity("d", 1)
    for make, message in (
        (lambda: Timing(max_transit=0), "max_transit must be a number (s) > 0, got 0"),
        (lambda: Timing(hello_retries=1001), "hello_retries must be an int in [0, 1000]"),
        (lambda: Identity("", 1), "engine_id must be a non-empty str of at most 256 bytes"),
        (lambda: Identity("x", -1), "instance must be an int in [0, 18446744073709551615]"),
        (lambda: Identity("x", 1, tp=0), "tp must be an int in [1, "),
        (lambda: Identity("x", 1, fingerprint=(("k", "a"), ("k", "b"))), "fingerprint must be"),
        (lambda: ConsumerConfig(me, ready_timeout=-1.0), "ready_timeout must be a number (s) > 0"),
        (lambda: ConsumerConfig(me, staging_page=0), "staging_page must be an int (bytes) >= 1"),
        (
            lambda: ConsumerConfig(me, ready_timeout=5.0, max_ready_timeout=4.0),
            "max_ready_timeout must be a number (s) >= ready_timeout, got 4.0",
        ),
        (
            lambda: ProducerConfig(me, Timing(max_transit=3.0), tombstone_ttl=3.0),
            "tombstone_ttl must be a number (s) > timing.max_transit, got 3.0",
        ),
    ):
        with pytest.raises(ConfigError) as info:
            make()
        assert str(info.value).startswith(message), info.value
    assert ProducerConfig(me, max_kv_hold_timeout=30.0).hold_limit == 30.0


def test_every_connector_key_is_named_in_its_error() -> None:
    """Whatever key of ``kv_connector_extra_config`` is wrong, the error names it."""
    from kvpush_vllm._config import ConnectorConfig

    for f, _, _ in option_specs(ConnectorConfig):
        with pytest.raises(ConfigError) as info:
            ConnectorConfig.from_extra({f.name: object()})
        assert str(info.value).startswith(f"{f.name} must be "), info.value


def test_the_connector_config() -> None:
    from kvpush_vllm._config import ConnectorConfig

    cfg = ConnectorConfig.from_extra(
        {
            "max_transit": 1,
            "router_discovery": {"router": "r:1", "http": "h:2"},
            "allow_unproven": ["kv_layout"],
            "secret": "s" * 16,
        }
    )
    assert cfg.timing == Timing(max_transit=1.0)
    assert cfg.router_discovery == ("r:1", "h:2") and cfg.allow_unproven == {"kv_layout"}
    assert replace(cfg, port=5).port == 5  # still checked, and the parse hooks take their output
    with pytest.raises(ConfigError, match=r"^secret must be bytes of at least 16 bytes$"):
        ConnectorConfig.from_extra({"secret": "short-secret"})
    with pytest.raises(ConfigError, match=r'^router_discovery must be \{"router": "host:port"'):
        ConnectorConfig.from_extra({"router_discovery": {"router": "r:1", "http": "h"}})


def _shown(value: object) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, (tuple, frozenset, dict)):
        return json.dumps(sorted(value) if isinstance(value, frozenset) else value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return "none" if value is None else str(value)


def test_the_vllm_docs_table_lists_every_key_with_its_default() -> None:
    """docs/vllm.md's table of ``kv_connector_extra_config`` keys: one row per
    key (or a few keys), in the fields' order, each default as the field's."""
    from kvpush_vllm._config import ConnectorConfig

    text = (ROOT / "docs" / "vllm.md").read_text()
    table = text.split("| `kv_connector_extra_config` key |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split(" | ")[:2] for line in table.splitlines()[2:]]
    documented: dict[str, str] = {}
    for keys, defaults in rows:
        names = re.findall(r"`(\w+)`", keys)
        values = defaults.replace("`", "").split(", ") if len(names) > 1 else [defaults]
        documented.update(zip(names, (v.replace("`", "") for v in values), strict=True))
    specs = {f.name: f for f, _, _ in option_specs(ConnectorConfig)}
    assert list(documented) == list(specs)
    for name, f in specs.items():
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        expected = "host:port" if name == "engine_id" else _shown(default)
        assert documented[name] == expected, name
