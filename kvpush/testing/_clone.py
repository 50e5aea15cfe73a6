"""Fast structural copies of a :class:`World` for the explorer.

``copy.deepcopy`` (or pickle) copies every frozen message and action too; here
immutable values are shared and only the mutable records are copied, which is
about ten times faster. This module knows the endpoints' private records on
purpose: it is the model checker's view of the state.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any, TypeVar

from kvpush.protocol import Consumer, Producer

from ._invariants import InvariantChecker
from ._world import World

__all__ = ("clone_world",)

T = TypeVar("T")


def _shallow(obj: T, **fields: Any) -> T:
    new = copy.copy(obj)
    for name, value in fields.items():
        setattr(new, name, value)
    return new


def _timeline(tl: Any) -> Any:
    return _shallow(
        tl,
        write_done=dict(tl.write_done),
        ops=dict(tl.ops),
        notice_seen=dict(tl.notice_seen),
        renewed=list(tl.renewed),
    )


def _endpoint(ep: Any) -> Any:
    return _shallow(
        ep,
        _out=list(ep._out),
        _counters=Counter(ep._counters),
        _peers={k: copy.copy(v) for k, v in ep._peers.items()},
        _peer_timers={k: dict(v) for k, v in ep._peer_timers.items()},
        _heap=list(ep._heap),
    )


def _consumer(c: Consumer) -> Consumer:
    new = _endpoint(c)
    res = {
        k: _shallow(
            r,
            done=set(r.done),
            settled=set(r.settled),
            timers=dict(r.timers),
            reads=dict(r.reads),
            op_timer=dict(r.op_timer),
            timeline=_timeline(r.timeline),
        )
        for k, r in c._res.items()
    }
    new._res = res
    new._suspect = dict(c._suspect)
    new._slots = _shallow(c._slots, _free=[list(run) for run in c._slots._free])
    new._live = {tid: res[(tid, r.epoch)] for tid, r in c._live.items()}
    return new  # type: ignore[no-any-return]


def _producer(p: Producer) -> Producer:
    new = _endpoint(p)
    new._tx = {
        k: _shallow(
            t,
            inflight=dict(t.inflight),
            op_timer=dict(t.op_timer),
            sent=dict(t.sent),
            committed=set(t.committed),
            owe=set(t.owe),
            timers=dict(t.timers),
            timeline=_timeline(t.timeline),
        )
        for k, t in p._tx.items()
    }
    return new  # type: ignore[no-any-return]


def _checker(c: InvariantChecker) -> InvariantChecker:
    return _shallow(
        c,
        res={
            k: _shallow(r, notices=set(r.notices), write_failed=set(r.write_failed))
            for k, r in c.res.items()
        },
        content={k: set(v) for k, v in c.content.items()},
        dst_owner=dict(c.dst_owner),
        slot_owner=dict(c.slot_owner),
        src_held=dict(c.src_held),
        src_released=set(c.src_released),
        leases=dict(c.leases),
        producer_withdrawn=set(c.producer_withdrawn),
        producer_aborted=dict(c.producer_aborted),
        writes=dict(c.writes),
        readies=set(c.readies),
        reads=dict(c.reads),
    )


def clone_world(w: World) -> World:
    """An independent copy of ``w`` (immutable values shared)."""
    return _shallow(
        w,
        clock=copy.copy(w.clock),
        net=_shallow(w.net, queue=list(w.net.queue)),
        producer=_producer(w.producer),
        consumer=_consumer(w.consumer),
        free_dst=list(w.free_dst),
        free_src=list(w.free_src),
        ops=[copy.copy(op) for op in w.ops],
        notices=list(w.notices),
        live=dict(w.live),
        kv=dict(w.kv),
        parts=dict(w.parts),
        ready=set(w.ready),
        failed=set(w.failed),
        failure_reasons=dict(w.failure_reasons),
        source_outcomes=dict(w.source_outcomes),
        stall_losses=set(w.stall_losses),
        hung=set(w.hung),
        checker=_checker(w.checker),
    )
