"""Hypothesis strategies for kvpush's inputs (needs the ``testing`` extra)."""

from __future__ import annotations

from hypothesis import strategies as st

from kvpush.protocol import Mode, Source

from ._world import WorldConfig

__all__ = ("block_ids", "modes", "sources", "transfer_ids", "world_configs")


def transfer_ids(n: int = 3) -> st.SearchStrategy[str]:
    """One of ``n`` transfer ids, so that inputs collide on purpose."""
    return st.sampled_from([f"t{i}" for i in range(n)])


def modes() -> st.SearchStrategy[Mode]:
    return st.sampled_from(list(Mode))


def sources(max_tp: int = 4, max_pp: int = 2) -> st.SearchStrategy[Source]:
    return st.builds(Source, st.integers(0, max_tp - 1), st.integers(0, max_pp - 1))


def block_ids(groups: int = 1, max_blocks: int = 8) -> st.SearchStrategy[list[list[int]]]:
    """Block ids per KV group, unique within each group."""
    group = st.lists(st.integers(0, 1 << 20), min_size=1, max_size=max_blocks, unique=True)
    return st.lists(group, min_size=groups, max_size=groups)


def world_configs(*, faults: bool = True) -> st.SearchStrategy[WorldConfig]:
    """Worlds with TP 1-4 on each side (P > D, P < D and equal), sometimes
    PP 2 or MLA, 12 KV heads so every TP size in range divides them; half of
    them shake hands over the faulty network (with the first reservation)."""
    slow = 1000.0  # fault-free worlds must not time out while being driven
    return st.builds(
        WorldConfig,
        producer_tp=st.integers(1, 4),
        consumer_tp=st.integers(1, 4),
        producer_pp=st.sampled_from([1, 1, 2]),
        num_kv_heads=st.just(12),
        mla=st.sampled_from([False, False, True]),
        max_transit=st.just(1.0 if faults else slow),
        op_bound=st.just(2.0),
        ready_timeout=st.sampled_from([5.0, 20.0] if faults else [slow]),
        kv_hold_timeout=st.sampled_from([3.0, 20.0] if faults else [slow]),
        tombstone_ttl=st.just(5.0 if faults else 2 * slow),
        max_reserved_blocks=st.sampled_from([None, None, 4] if faults else [None]),
        handshake=st.booleans(),
        staging_pages=st.sampled_from([0, 0, 2, 4]),
    )
