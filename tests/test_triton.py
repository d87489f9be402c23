"""The record helpers, run in the interpreter on the CPU (CI) and compiled on the GPU: exact counts, extremes,
first-offender pair, encodings near the limits, and a property test against a Python reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from tripwire.layout import decode, decode_neg
from tripwire.triton import GUARD_BIAS, guard_index, record_hit, record_hits


@triton.jit
def _scalar_kernel(ctr, x_ptr, lo, hi):
    pid = tl.program_id(0)
    x = tl.load(x_ptr + pid)
    if (x < lo) | (x >= hi):
        record_hit(ctr, pid, x)


@triton.jit
def _block_kernel(ctr, x_ptr, out_ptr, n, lo, hi, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0)
    safe, ok = guard_index(x, lo, hi, ctr, offs, mask=m)
    tl.store(out_ptr + offs, tl.where(ok, safe, -1), mask=m)


@triton.jit
def _hits_kernel(ctr, x_ptr, n, lo, hi, BLOCK: tl.constexpr):
    # record_hits with a scalar row (the program) and a block of values
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0)
    record_hits(ctr, m & ((x < lo) | (x >= hi)), tl.program_id(0), x)


def decoded(ctr: torch.Tensor) -> dict:
    c = ctr.cpu().tolist()
    return {
        "count": c[0],
        "max_row": decode(c[1]),
        "max_value": decode(c[2]),
        "min_value": decode_neg(c[3]),
        "first_row": decode(c[4]),
        "first_value": decode(c[5]),
        "spare": c[6:],
    }


def reference(x: list[int], lo: int, hi: int, rows: list[int]) -> dict:
    bad = [(r, v) for r, v in zip(rows, x, strict=True) if not lo <= v < hi]
    if not bad:
        return {"count": 0}
    return {
        "count": len(bad),
        "max_row": max(r for r, _ in bad),
        "max_value": max(v for _, v in bad),
        "min_value": min(v for _, v in bad),
    }


def check(ctr, x, lo, hi, rows):
    d = decoded(ctr)
    ref = reference(x, lo, hi, rows)
    assert d["count"] == ref["count"]
    assert d["spare"] == [0, 0]
    if ref["count"] == 0:
        assert d["first_row"] is None and d["first_value"] is None and d["max_row"] is None
        return d
    for k in ("max_row", "max_value", "min_value"):
        assert d[k] == ref[k], k
    # the first-offender pair is one real observed hit
    assert (d["first_row"], d["first_value"]) in {(r, v) for r, v in zip(rows, x, strict=True) if not lo <= v < hi}
    return d


INT32_EXTREMES = [0, 3, -1, 7, 8, -(2**31), 2**31 - 1, 5, 100]


def test_scalar_record_hit(kernel_device):
    x = torch.tensor(INT32_EXTREMES, dtype=torch.int32, device=kernel_device)
    ctr = torch.zeros(8, dtype=torch.int64, device=kernel_device)
    _scalar_kernel[(x.numel(),)](ctr, x, 0, 8)
    d = check(ctr, x.tolist(), 0, 8, list(range(x.numel())))
    assert d["count"] == 5 and d["min_value"] == -(2**31) and d["max_value"] == 2**31 - 1 and d["max_row"] == 8


def test_guard_index_masks_and_clamps(kernel_device):
    x = torch.tensor(INT32_EXTREMES, dtype=torch.int32, device=kernel_device)
    out = torch.empty_like(x)
    ctr = torch.zeros(8, dtype=torch.int64, device=kernel_device)
    _block_kernel[(triton.cdiv(x.numel(), 4),)](ctr, x, out, x.numel(), 0, 8, BLOCK=4)
    expect = [v if 0 <= v < 8 else -1 for v in x.tolist()]
    assert out.tolist() == expect
    d = check(ctr, x.tolist(), 0, 8, list(range(x.numel())))
    # lanes past n (mask) are never counted even though they load 0... and 0 is in range; use lo=1 to prove it:
    ctr.zero_()
    _block_kernel[(triton.cdiv(x.numel(), 4),)](ctr, x, out, x.numel(), 1, 8, BLOCK=4)
    assert decoded(ctr)["count"] == d["count"] + 1  # only the real 0 at index 0, not the 3 padding lanes


def test_guard_index_mask_control(kernel_device):
    # Control: without the lane mask the padding lanes (loaded as 0, out of [1, 8)) are counted: the mask matters.
    @triton.jit
    def unmasked(ctr, x_ptr, n, lo, hi, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0)
        guard_index(x, lo, hi, ctr, offs)

    x = torch.tensor([3, 4, 5], dtype=torch.int32, device=kernel_device)
    ctr = torch.zeros(8, dtype=torch.int64, device=kernel_device)
    unmasked[(1,)](ctr, x, 3, 1, 8, BLOCK=4)
    assert decoded(ctr)["count"] == 1


def test_no_hit_no_write(kernel_device):
    x = torch.arange(16, dtype=torch.int32, device=kernel_device)
    ctr = torch.zeros(8, dtype=torch.int64, device=kernel_device)
    _hits_kernel[(4,)](ctr, x, 16, 0, 16, BLOCK=4)
    assert ctr.cpu().tolist() == [0] * 8


def test_first_offender_is_one_real_pair(kernel_device):
    # One program: the lowest bad row, then the lowest bad value within it.
    x = torch.tensor([1, 50, -3, 20], dtype=torch.int64, device=kernel_device)
    ctr = torch.zeros(8, dtype=torch.int64, device=kernel_device)
    _hits_kernel[(1,)](ctr, x, 4, 0, 10, BLOCK=4)
    d = decoded(ctr)
    assert (d["count"], d["first_row"], d["first_value"]) == (3, 0, -3)
    assert (d["max_value"], d["min_value"], d["max_row"]) == (50, -3, 0)


@pytest.mark.parametrize("v", [-(2**61), 2**61, -(2**62) + 1, 2**62 - 1])
def test_values_near_encoding_limits(kernel_device, v):
    x = torch.tensor([5, v], dtype=torch.int64, device=kernel_device)
    ctr = torch.zeros(8, dtype=torch.int64, device=kernel_device)
    _scalar_kernel[(2,)](ctr, x, 0, 8)
    d = decoded(ctr)
    assert (d["count"], d["first_row"], d["first_value"], d["max_value"], d["min_value"]) == (1, 1, v, v, v)


def test_counts_accumulate_across_launches(kernel_device):
    x = torch.tensor([9, -1, 3], dtype=torch.int32, device=kernel_device)
    ctr = torch.zeros(8, dtype=torch.int64, device=kernel_device)
    for _ in range(3):
        _hits_kernel[(1,)](ctr, x, 3, 0, 8, BLOCK=4)
    d = decoded(ctr)
    assert d["count"] == 6 and (d["first_row"], d["first_value"]) == (0, -1)


@settings(max_examples=25, deadline=None)
@given(
    data=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=40),
    lo=st.integers(-100, 100),
    width=st.integers(0, 200),
    block=st.sampled_from([4, 8, 16]),
)
def test_property_against_reference(data, lo, width, block):
    device = "cpu" if not torch.cuda.is_available() else "cuda"
    hi = lo + width
    x = torch.tensor(data, dtype=torch.int32, device=device)
    out = torch.empty_like(x)
    ctr = torch.zeros(8, dtype=torch.int64, device=device)
    _block_kernel[(triton.cdiv(len(data), block),)](ctr, x, out, len(data), lo, hi, BLOCK=block)
    check(ctr, data, lo, hi, list(range(len(data))))
    ok = (np.array(data) >= lo) & (np.array(data) < hi)
    np.testing.assert_array_equal(out.cpu().numpy(), np.where(ok, np.array(data), -1))


@triton.jit
def _unsaturated_max(ctr, x_ptr, n, BLOCK: tl.constexpr):
    # what the helpers did before saturating: bias the raw int64 value (wraps for |v| >= 2**62)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.atomic_max(ctr + 2, tl.max(tl.where(offs < n, x + GUARD_BIAS, 0), axis=0))


JUNK = [5, 2**62, -(2**62), 2**63 - 1, -(2**63)]


def test_junk_int64_values_are_saturated_not_wrapped(kernel_device):
    from tripwire.layout import VALUE_MAX, VALUE_MIN

    x = torch.tensor(JUNK, dtype=torch.int64, device=kernel_device)
    out = torch.empty_like(x)
    ctr = torch.zeros(8, dtype=torch.int64, device=kernel_device)
    _block_kernel[(1,)](ctr, x, out, len(JUNK), 0, 8, BLOCK=8)
    d = decoded(ctr)
    assert d["count"] == 4 and out.tolist() == [5, -1, -1, -1, -1]
    assert (d["max_value"], d["min_value"]) == (VALUE_MAX, VALUE_MIN)
    assert (d["first_row"], d["first_value"]) == (1, VALUE_MAX)
    ctr.zero_()
    _scalar_kernel[(len(JUNK),)](ctr, x, 0, 8)
    d = decoded(ctr)
    assert (d["count"], d["max_value"], d["min_value"]) == (4, VALUE_MAX, VALUE_MIN)


def test_control_unsaturated_bias_wraps(kernel_device):
    """Control: biasing 2**62 without saturation overflows int64; atomic_max then keeps 0 (nothing recorded)."""
    x = torch.tensor([2**62], dtype=torch.int64, device=kernel_device)
    ctr = torch.zeros(8, dtype=torch.int64, device=kernel_device)
    _unsaturated_max[(1,)](ctr, x, 1, BLOCK=2)
    assert decoded(ctr)["max_value"] is None
