"""The device copier (torch) on CPU tensors: every path byte for byte against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpush.protocol import KvpushError
from kvpush_vllm._copier import TorchCopier


def rows(t: torch.Tensor, offsets: list[int], length: int) -> np.ndarray:
    return np.array([[t.data_ptr() + o, length, 0] for o in offsets], dtype=np.uint64)


def run(src_off: list[int], dst_off: list[int], length: int) -> None:
    gen = torch.Generator().manual_seed(length + len(src_off))
    kv = torch.randint(0, 255, (1 << 16,), dtype=torch.uint8, generator=gen).view(torch.bfloat16)
    pool = torch.zeros(1 << 16, dtype=torch.uint8)
    want = pool.numpy().copy()
    src_bytes = kv.view(torch.uint8).numpy()
    for s, d in zip(src_off, dst_off, strict=True):
        want[d : d + length] = src_bytes[s : s + length]
    TorchCopier([kv, pool]).copy(rows(kv, src_off, length), rows(pool, dst_off, length))
    assert np.array_equal(pool.numpy(), want)


@pytest.mark.parametrize("length", [8, 64, 4096])
def test_a_gather_into_one_run(length: int) -> None:
    n = (1 << 14) // length
    src = (np.random.default_rng(1).permutation(n * 2)[:n] * length // 2).tolist()
    src = [o - o % length for o in src]
    src = list(dict.fromkeys(src))
    run(src, [i * length for i in range(len(src))], length)


@pytest.mark.parametrize("length", [8, 64, 4096])
def test_a_scatter_out_of_one_run(length: int) -> None:
    n = (1 << 14) // length
    dst = (np.random.default_rng(2).permutation(n * 3)[:n] * length).tolist()
    run([i * length for i in range(n)], dst, length)


def test_anywhere_to_anywhere_and_odd_lengths_and_offsets() -> None:
    run([64, 0, 256, 128], [512, 1024, 0, 256], 64)  # neither side one run
    run([3, 100, 7], [1, 50, 900], 5)  # not multiples of the length: row by row
    run([0, 6, 12], [30, 36, 42], 6)  # bytes, not 8-byte elements


def test_a_row_outside_the_tensors_is_refused() -> None:
    kv = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(KvpushError, match="outside the copier's tensors"):
        TorchCopier([kv]).copy(rows(kv, [32], 64), rows(kv, [0], 64))


def test_rows_within_one_tensor() -> None:
    """Source and destination in one buffer (a pool gathered into itself)."""
    buf = torch.arange(4096, dtype=torch.int64).view(torch.uint8)
    want = buf.numpy().copy()
    src, dst = [0, 512, 1024], [8192, 8256, 8320]
    for s, d in zip(src, dst, strict=True):
        want[d : d + 64] = want[s : s + 64]
    TorchCopier([buf]).copy(rows(buf, src, 64), rows(buf, dst, 64))
    assert np.array_equal(buf.numpy(), want)
