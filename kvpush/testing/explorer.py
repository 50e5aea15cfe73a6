"""Exhaustive explorer: every interleaving of a small configuration.

Where the stateful property test samples interleavings, this walks all of them
for a small world (by default 2 transfers, producer TP 2 -> consumer TP 1, one
preemption with re-reservation and one duplicated message, on a network that
loses nothing), checks I1-I4 after every move and I3/I5 at every end state, and
counts the distinct states it visited. Run it with ``python -m
kvpush.testing.explorer`` (``--help`` lists the knobs).

Moves are the core's inputs: reserve, preempt, KV ready, delivering or
duplicating any message in flight, a write landing, its initiator being told,
its notice being polled, and (only when nothing else can happen) time jumping
to the next timer. States are deduplicated on a canonical form of the two
endpoints, the network and the model transport.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvpush.protocol import Hello, HelloReject, StartWrite
from kvpush.protocol._consumer import _Reservation
from kvpush.protocol._transfer import Transfer

from ._clone import clone_world
from ._world import World, WorldConfig

__all__ = ("ExploreResult", "explore", "main")


@dataclass(frozen=True, slots=True)
class ExploreResult:
    """What a walk found."""

    states: int
    terminal_states: int
    transitions: int
    max_depth: int


@dataclass
class _Node:
    world: World
    preempts_left: int
    dups_left: int
    reserved: frozenset[str]
    rereserve: frozenset[str]  # preempted, waiting for their new epoch
    losses_left: int = 0  # handshake frames the network may still lose
    stalls_left: int = 0  # process stalls still to come
    stops_left: int = 0  # unbounded producer stops still to come
    stopped: bool = False  # a stop happened (liveness is not promised after one)
    increments: bool = False  # a source may come in two increments
    hangs_left: int = 0  # ops that may still hang (never report until cancelled)


def _clone(node: _Node) -> _Node:
    return _Node(
        clone_world(node.world),
        node.preempts_left,
        node.dups_left,
        node.reserved,
        node.rereserve,
        node.losses_left,
        node.stalls_left,
        node.stops_left,
        node.stopped,
        node.increments,
        node.hangs_left,
    )


def _peers_key(ep: Any) -> tuple[object, ...]:
    """An endpoint's handshake state: peer views, their retry timers, the stall window."""
    views = sorted(
        (
            name,
            v.state.name,
            v.attempts,
            None if v.hello is None else v.hello.instance,
            sorted((k.value, t) for k, t in ep._peer_timers.get(name, {}).items()),
        )
        for name, v in ep._peers.items()
    )
    return (views, ep._stall_until)


#: Fields of the endpoints' records left out of the state key, and why. Every
#: other field is in it (``_record_key``), so a new one is keyed by default.
_EXCLUDED: dict[type[Any], dict[str, str]] = {
    _Reservation: {
        "timeline": "history: timestamps reported to the caller, read by no decision",
        "nblocks": "derived: the number of ids in blocks",
        "topology": "derived: the handshake's topology, set when WAITING_PEER is left",
        "total": "derived: topology.expected_total",
        "retry_at": "derived: the RETRY timer's time, keyed in timers",
        "op_bound": "derived: the producer's hello, fixed by the handshake",
    },
    Transfer: {
        "timeline": "history: timestamps reported to the caller, read by no decision",
        "renew_at": "derived: the LEASE timer's time, keyed in timers",
    },
}


#: The fields each record's state key holds, in declaration order.
_KEY_FIELDS: dict[type[Any], tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls) if f.name not in skip)
    for cls, skip in _EXCLUDED.items()
}


def _canon(value: object) -> object:
    """``value`` with a deterministic repr (sets and dicts sorted)."""
    if isinstance(value, (set, frozenset)):
        return sorted(map(repr, value))
    if isinstance(value, dict):
        return sorted((repr(k), v) for k, v in value.items())
    return value


def _record_key(rec: Any) -> str:
    """The canonical state of one record: every field not in ``_EXCLUDED``."""
    return repr([_canon(getattr(rec, name)) for name in _KEY_FIELDS[type(rec)]])


def _digest(node: _Node) -> bytes:
    """A 16-byte fingerprint of everything that decides the future: both
    endpoints' records, the network, the model transport and the budgets.
    (Histories such as timelines and counters are left out.)"""
    w = node.world
    state = (
        round(w.clock.now, 9),
        sorted(repr((m.src, m.dst, m.message)) for m in w.net.queue),
        sorted(repr((op.action, op.landed, op.unbounded, op.hung, op.cancel)) for op in w.ops),
        sorted(repr(n) for n in w.notices),
        sorted(map(_record_key, w.consumer._res.values())),
        sorted(map(_record_key, w.producer._tx.values())),
        sorted(w.live.items()),
        _peers_key(w.consumer),
        _peers_key(w.producer),
        node.preempts_left,
        node.dups_left,
        node.losses_left,
        node.stalls_left,
        node.stops_left,
        node.stopped,
        node.hangs_left,
        sorted(node.reserved),
        sorted(w.consumer._suspect.items()),
        sorted(node.rereserve),
        sorted(w.parts.items()),
    )
    return hashlib.blake2b(repr(state).encode(), digest_size=16).digest()


_Move = tuple[str, Callable[[_Node], None]]


def _moves(node: _Node, transfers: tuple[str, ...]) -> Iterator[_Move]:
    yield from _inputs(node, transfers)
    yield from _in_flight(node)
    yield from _faults(node)
    yield from _transport(node)
    for i, notice in enumerate(node.world.notices):
        yield f"notify {notice!r}", partial(_notify, index=i)  # local


def _inputs(node: _Node, transfers: tuple[str, ...]) -> Iterator[_Move]:
    """The callers' inputs: reserve, KV ready (or its first increment), preempt."""
    w = node.world
    for tid in transfers:
        if tid not in node.reserved or tid in node.rereserve:
            yield f"reserve {tid}", partial(_reserve, tid=tid)
        if tid not in w.kv:
            yield f"kv_ready {tid}", partial(_kv_ready, tid=tid)
            if node.increments and tid not in w.parts:
                yield f"kv_increment {tid}", partial(_kv_increment, tid=tid)
        if node.preempts_left and tid in w.live:
            yield f"preempt {tid}", partial(_preempt, tid=tid)


def _in_flight(node: _Node) -> Iterator[_Move]:
    """Each distinct message in flight: delivered, duplicated, or (a hello) lost."""
    seen: set[str] = set()
    for i, m in enumerate(node.world.net.queue):
        key = repr((m.src, m.dst, m.message))
        if key in seen:
            continue
        seen.add(key)
        yield f"deliver {key}", partial(_deliver, index=i)  # local
        if node.dups_left:
            yield f"duplicate {key}", partial(_dup, index=i)
        if node.losses_left and isinstance(m.message, _HANDSHAKE):
            yield f"lose {key}", partial(_lose, index=i)


def _faults(node: _Node) -> Iterator[_Move]:
    """Process stalls, and an unbounded stop of the prefill with writes posted."""
    if node.stalls_left:
        for who in ("prefill", "decode"):
            yield f"stall {who}", partial(_stall, who=who)
    if node.stops_left and any(isinstance(op.action, StartWrite) for op in node.world.ops):
        yield "stop prefill", _stop


def _transport(node: _Node) -> Iterator[_Move]:
    """What the transport does with each op.

    A write lands at the latest moment the model allows: just before the first
    of "its initiator is told" and "its notice is polled" (both imply it
    landed). Landing later is never safer, so nothing is lost for I1."""
    for i, op in enumerate(node.world.ops):
        if op.cancel and not op.landed:  # the transport confirms the cancel
            yield f"cancel {op.action!r}", partial(_cancel, index=i)  # local
        if op.hung:
            continue
        yield f"ack {op.action!r}", partial(_ack, index=i)  # local
        if not op.landed:
            yield f"notify {op.action!r}", partial(_land_and_notify, index=i)  # local
            if node.hangs_left:
                yield f"hang {op.action!r}", partial(_hang, index=i)


def _kv_ready(node: _Node, tid: str) -> None:
    node.world.kv_ready(tid)


def _kv_increment(node: _Node, tid: str) -> None:
    node.world.kv_increment(tid)


def _deliver(node: _Node, index: int) -> None:
    node.world.deliver(index)


def _notify(node: _Node, index: int) -> None:
    node.world.notify(index)


def _reserve(node: _Node, tid: str) -> None:
    node.world.reserve(tid)
    node.reserved |= {tid}
    node.rereserve -= {tid}


def _preempt(node: _Node, tid: str) -> None:
    node.world.preempt(tid)
    node.preempts_left -= 1
    node.rereserve |= {tid}


def _dup(node: _Node, index: int) -> None:
    node.world.net.duplicate(index)
    node.dups_left -= 1


def _lose(node: _Node, index: int) -> None:
    node.world.net.drop(index)
    node.losses_left -= 1


#: How long an explored stall lasts (the timeouts are huge: it only matters
#: that the stalled side reads what waited for it late, after ``stalled()``).
_STALL_GAP = 0.5


def _stall(node: _Node, who: str) -> None:
    node.world.stall(who, _STALL_GAP)
    node.stalls_left -= 1


def _stop(node: _Node) -> None:
    """The prefill stops with its queued writes posted, past every timer of
    the decode (its deadlines and quarantines), then resumes: its writes may
    land at any later move, after every bound (a software transport such as
    UCX over TCP progresses them only while the prefill runs)."""
    w = node.world
    for i in reversed(range(len(w.ops))):
        if w.ops[i].posted_at is None and isinstance(w.ops[i].action, StartWrite):
            w.post(i)
    cfg = w.config
    w.stall("prefill", 2 * (cfg.ready_timeout + cfg.max_transit) + cfg.op_bound)
    node.stops_left -= 1
    node.stopped = True


def _hang(node: _Node, index: int) -> None:
    """The op never reports: it waits for its initiator's cancel (``OVERDUE``
    fires once nothing else can happen, as every timer here)."""
    w = node.world
    if w.ops[index].posted_at is None:
        w.post(index)
    if index < len(w.ops) and w.ops[index].posted_at is not None:
        w.hang(index)
    node.hangs_left -= 1


def _cancel(node: _Node, index: int) -> None:
    node.world.cancel(index)


def _land(node: _Node, index: int) -> None:
    w = node.world
    if w.ops[index].posted_at is None:
        w.post(index)
    if index < len(w.ops) and not w.ops[index].landed:
        w.land(index)


def _ack(node: _Node, index: int) -> None:
    _land(node, index)
    w = node.world
    if index < len(w.ops) and w.ops[index].landed:
        w.ack(index)


def _land_and_notify(node: _Node, index: int) -> None:
    w = node.world
    before = len(w.notices)
    _land(node, index)
    if len(w.notices) > before:  # an increment before the last has no notice
        w.notify(len(w.notices) - 1)


def explore(
    config: WorldConfig | None = None,
    *,
    transfers: int = 2,
    preemptions: int = 1,
    duplicates: int = 1,
    hello_losses: int = 0,
    stalls: int = 0,
    stops: int = 0,
    increments: int = 1,
    hangs: int = 0,
    limit: int = 5_000_000,
    progress: Callable[[int], None] | None = None,
    reduce: bool = True,
) -> ExploreResult:
    """Walk every interleaving; raise :class:`InvariantViolation` on the first
    broken invariant (with the path in the message). ``hello_losses``: the
    handshake runs over the explored network (with the first reservation), which
    may lose that many ``Hello``/``HelloReject`` frames (the retry timer must
    recover). ``stalls``: that many times either process stalls and reads what
    waited for it late (the stall rule may drop its lease-bearing frames; such
    transfers may fail, by their deadline). ``stops``: that many times the
    prefill stops with writes posted until every timer of the decode passed,
    and its writes land whenever it resumes (I1 must hold with no bound on
    the stall; a transfer may fail). ``increments=2``: a source may come in
    two increments (progressive push: the first block, then the rest), in any
    order with everything else. ``hangs``: that many ops may hang (never
    report on their own): each must be cancelled by its initiator once its
    bound passes, and every block must still come back (I3, no exception);
    a transfer whose op hung may fail."""
    if config is None:
        config = WorldConfig(
            producer_tp=2,
            consumer_tp=1,
            max_transit=1e6,
            ready_timeout=1e6,
            kv_hold_timeout=1e6,
            tombstone_ttl=2e6,
        )
    if hello_losses:
        config = dataclasses.replace(config, handshake=False)
    world = World(config)
    world.events = _Discard()
    root = _Node(
        world,
        preemptions,
        duplicates,
        frozenset(),
        frozenset(),
        hello_losses,
        stalls,
        stops,
        increments=increments > 1,
        hangs_left=hangs,
    )
    names = tuple(f"t{i}" for i in range(transfers))
    return _walk(root, names, limit, progress, reduce)


def _walk(
    root: _Node,
    names: tuple[str, ...],
    limit: int,
    progress: Callable[[int], None] | None,
    reduce: bool,
) -> ExploreResult:
    """Depth-first over every state reachable from ``root`` (each once)."""
    visited = {_digest(root)}
    stack: list[tuple[_Node, list[str]]] = [(root, [])]
    terminal = transitions = depth = 0
    while stack:
        node, path = stack.pop()
        depth = max(depth, len(path))
        found = _next_moves(node, names, path, reduce)
        if found is None:
            terminal += 1
            continue
        node, moves = found
        for label, move in moves:
            child = _apply(node, move, [*path, label])
            transitions += 1
            key = _digest(child)
            if key in visited:
                continue
            visited.add(key)
            if progress is not None and len(visited) % 50_000 == 0:
                progress(len(visited))
            if len(visited) > limit:
                raise RuntimeError(f"more than {limit} states: shrink the configuration")
            stack.append((child, [*path, label]))
    return ExploreResult(len(visited), terminal, transitions, depth)


def _next_moves(
    node: _Node, names: tuple[str, ...], path: list[str], reduce: bool
) -> tuple[_Node, list[_Move]] | None:
    """The moves from ``node``; when none is enabled, time jumps to the next
    timer (from a copy), and with no timer left the end state is checked
    (``None``: ``node`` is terminal)."""
    moves = list(_moves(node, names))
    if reduce:
        moves = _ample(node, moves, names)
    if moves:
        return node, moves
    nxt = _clone(node)
    if nxt.world.advance_to_next():
        return nxt, [("timer", _nothing)]
    _check_end(node, names, path)
    return None


def _apply(node: _Node, move: Callable[[_Node], None], path: list[str]) -> _Node:
    """A copy of ``node`` after ``move`` (its violation names the path to it)."""
    child = _clone(node)
    try:
        move(child)
    except AssertionError as exc:
        raise type(exc)(f"{exc}\n  after: {' -> '.join(path)}") from None
    return child


_LOCAL = ("deliver ", "ack ", "notify ", "cancel ")
_HANDSHAKE = (Hello, HelloReject)


def _owner(node: _Node, label: str, names: tuple[str, ...]) -> str | None:
    """The transfer a move belongs to (every item in flight names its transfer)."""
    for tid in names:
        if f"transfer_id='{tid}'" in label or label.endswith(f" {tid}"):
            return tid
    return None


def _ample(node: _Node, moves: list[_Move], names: tuple[str, ...]) -> list[_Move]:
    """Ample-set partial-order reduction over transfers.

    If some transfer's enabled moves are all *local* (delivering its messages,
    acknowledging or polling its writes), explore only those: they touch only
    that transfer's records, its own messages and ops, and its own blocks, so
    they commute with every move of every other transfer and neither enables
    nor disables one. Moves that share something across transfers (reserve:
    the epoch counter and the block pool; KV ready: the source pool;
    preempt and duplicate: the shared budgets) are never reduced away, so a
    transfer with such a move enabled is not eligible. The state graph is
    acyclic (every move consumes an item, a budget or time), so no cycle
    proviso is needed, and every invariant the checker evaluates is
    per-transfer, so skipped orders of independent moves reach the same states
    through visited ones.
    """
    by_owner: dict[str | None, list[_Move]] = {}
    for move in moves:
        by_owner.setdefault(_owner(node, move[0], names), []).append(move)
    for tid in names:
        mine = by_owner.get(tid, [])
        if mine and all(label.startswith(_LOCAL) for label, _ in mine):
            return mine
    return moves


def _nothing(node: _Node) -> None:
    """The move after a timer jump (the jump itself already happened)."""


def _check_end(node: _Node, names: tuple[str, ...], path: list[str]) -> None:
    w = node.world
    try:
        w.checker.check_quiescent(w.consumer.reserved_blocks, w.producer.held_blocks)
        missing = set(names) - w.ready - w.stall_losses - {t for t, _ in w.hung}
        if missing and not node.stopped:
            raise AssertionError(f"I5: {sorted(missing)} never became ready; failed {w.failed}")
    except AssertionError as exc:
        raise type(exc)(f"{exc}\n  after: {' -> '.join(path)}") from None


class _Discard(list):  # type: ignore[type-arg]
    """An event list that keeps nothing (the explorer needs no history)."""

    def append(self, item: object) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpush.testing.explorer")
    parser.add_argument("--transfers", type=int, default=2)
    parser.add_argument("--producer-tp", type=int, default=2)
    parser.add_argument("--consumer-tp", type=int, default=1)
    parser.add_argument("--preemptions", type=int, default=1)
    parser.add_argument("--duplicates", type=int, default=1)
    parser.add_argument(
        "--hello-losses",
        type=int,
        default=0,
        help="shake hands over the explored network, which may lose this many hellos",
    )
    parser.add_argument(
        "--stalls", type=int, default=0, help="process stalls (frames read late after each)"
    )
    parser.add_argument(
        "--stops",
        type=int,
        default=0,
        help="unbounded prefill stops with writes posted (they land whenever it resumes)",
    )
    parser.add_argument(
        "--increments",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: a source may come in two increments (progressive push)",
    )
    parser.add_argument(
        "--hangs",
        type=int,
        default=0,
        help="ops that never report until their initiator cancels them",
    )
    parser.add_argument(
        "--staging-pages",
        type=int,
        default=0,
        help="the decode's staging pool in pages (a push reservation takes one per block)",
    )
    parser.add_argument(
        "--no-reduction", action="store_true", help="walk every order of independent moves too"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    config = WorldConfig(
        producer_tp=args.producer_tp,
        consumer_tp=args.consumer_tp,
        max_transit=1e6,
        ready_timeout=1e6,
        kv_hold_timeout=1e6,
        tombstone_ttl=2e6,
        staging_pages=args.staging_pages,
    )
    result = explore(
        config,
        transfers=args.transfers,
        preemptions=args.preemptions,
        duplicates=args.duplicates,
        hello_losses=args.hello_losses,
        stalls=args.stalls,
        stops=args.stops,
        increments=args.increments,
        hangs=args.hangs,
        reduce=not args.no_reduction,
        progress=lambda n: print(f"{n} states...", file=sys.stderr, flush=True),
    )
    elapsed = time.perf_counter() - started
    out = {**dataclasses.asdict(result), "seconds": round(elapsed, 1), "config": vars(args)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
