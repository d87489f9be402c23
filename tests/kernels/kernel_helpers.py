"""Shared by the reference kernels' tests (tests/kernels/test_<name>.py, tests/kernels/test_kernels.py): dtypes, the counter-row
check and index tensors.

Under the interpreter (CPU) programs run in order, so the first offender is exactly the lowest (row, value); on the
GPU programs race for it, so there it must be one of the real hits.
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

from tripwire.layout import decode, decode_neg

I32, I64 = torch.int32, torch.int64
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
SEQUENTIAL = os.environ.get("TRITON_INTERPRET") == "1"
HYP = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def assert_hits(row: torch.Tensor, hits: list[tuple[int, int]]) -> None:
    """The counter row records exactly ``hits`` (count, extremes, a real first pair)."""
    c = row.cpu().tolist()
    assert c[0] == len(hits), f"count {c[0]} != {len(hits)} expected hits {hits}"
    if not hits:
        assert c[:6] == [0] * 6
        return
    rows = [r for r, _ in hits]
    vals = [v for _, v in hits]
    assert decode(c[1]) == max(rows)
    assert decode(c[2]) == max(vals)
    assert decode_neg(c[3]) == min(vals)
    first = (decode(c[4]), decode(c[5]))
    if SEQUENTIAL:
        assert first == min(hits)
    else:
        assert first in hits
    assert c[6] == 0  # spare (slot 7 is the offender block's address)


def ids(values: list[int], device: str, dtype: torch.dtype = I32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


# Inputs of the kernels' tests that the cross-kernel tests (tests/kernels/test_kernels.py) use too.
def bt_inputs(dev: str, R: int = 5, W: int = 6):
    table = (torch.arange(R * W, dtype=I32).reshape(R, W) * 7 + 1).to(dev)
    counts = ids([W, 3, 0, W - 1, 1][:R], dev)
    return table, counts


def sc_inputs(dev: str):
    state = (torch.arange(8 * 5, dtype=torch.float32).reshape(8, 5) + 1).to(dev)
    table = ids([[0, 1], [2, 3], [4, 5], [6, 7]], dev)
    return state, table


def rope_inputs(dev: str, dtype: torch.dtype, T: int = 6, Hq: int = 3, Hk: int = 2, D: int = 12, max_pos: int = 10):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, Hq, D, generator=g).to(dtype).to(dev)
    k = torch.randn(T, Hk, D, generator=g).to(dtype).to(dev)
    cs = torch.randn(max_pos, D, generator=g).to(dev)
    return q, k, cs
