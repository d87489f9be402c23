"""The record helpers, run in the interpreter on the CPU (CI) and compiled on the GPU: exact counts, extremes,
first-offender pair, encodings near the limits, a property test against a Python reference, and ``count=``: bad
ENTRIES counted once in a 2-D tile read by several programs (with the lane-counting control that over-counts)."""

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


# ---------------------------------------------------------------------------------------------- count=: entries, not lanes
@triton.jit
def _paged_tile_kernel(
    ctr, table_ptr, lens_ptr, out_ptr, W, N, BS: tl.constexpr, BLOCK_P: tl.constexpr, H, COUNT: tl.constexpr
):
    """Program (b, h) reads sequence b's pages as a 2-D tile [pages, token lanes]: every token lane of a page holds
    that page's id, and every head program h reads the same entries (the attention pattern)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(lens_ptr + b)
    p = tl.arange(0, BLOCK_P)[:, None]
    t = tl.arange(0, BS)[None, :]
    tok = p * BS + t
    live = tok < n
    entry = b * W + p + t * 0  # the flat page-table entry each lane reads
    page = tl.load(table_ptr + entry, mask=live, other=0)
    if COUNT:
        # One lane per entry (the page's first token lane) and one program (head 0) count it.
        safe, ok = guard_index(page, 0, N, ctr, entry, mask=live, count=tl.where(h == 0, t == 0, False))
    else:
        safe, ok = guard_index(page, 0, N, ctr, entry, mask=live)  # the control: counts lanes
    tl.store(out_ptr + (b * H + h) * (BLOCK_P * BS) + tok, tl.where(ok, safe, -1), mask=live)


def _run_paged_tile(dev, table, lens, n_pages, bs, heads, count):
    B, W = len(table), len(table[0])
    block_p = triton.next_power_of_2(W)
    out = torch.full((B, heads, block_p * bs), -7, dtype=torch.int32, device=dev)
    ctr = torch.zeros(8, dtype=torch.int64, device=dev)
    t = torch.tensor(table, dtype=torch.int32, device=dev)
    _paged_tile_kernel[(B, heads)](
        ctr,
        t,
        torch.tensor(lens, dtype=torch.int32, device=dev),
        out,
        W,
        n_pages,
        BS=bs,
        BLOCK_P=block_p,
        H=heads,
        COUNT=count,
    )
    return ctr, out


def _paged_expectations(table, lens, n_pages, bs, heads):
    """(bad entries as (flat entry, id), lanes reading each bad entry, per-lane expected out)."""
    B, W = len(table), len(table[0])
    bad, lanes = [], []
    block_p = triton.next_power_of_2(W)
    out = np.full((B, heads, block_p * bs), -7, dtype=np.int64)
    for b in range(B):
        for tok in range(lens[b]):
            p = tok // bs
            v = table[b][p]
            good = 0 <= v < n_pages
            out[b, :, tok] = v if good else -1
            if not good:
                if tok % bs == 0:
                    bad.append((b * W + p, v))
                    lanes.append(0)
                lanes[-1] += heads
    return bad, lanes, out


def test_count_entries_not_lanes(kernel_device, guard_row):
    """One bad page id read by 4 token lanes and 3 head programs: count= makes it 1; the control (lanes) says 12."""
    table = [[0, 9, 1]]
    lens = [10]  # pages 0, 1 (bad: id 9), and 2 tokens of page 2
    ctr, out = _run_paged_tile(kernel_device, table, lens, 4, 4, 3, True)
    bad, lanes, ref = _paged_expectations(table, lens, 4, 4, 3)
    assert bad == [(1, 9)] and lanes == [12]
    guard_row(ctr, bad)
    np.testing.assert_array_equal(out.cpu().numpy(), ref)  # ok still masks every lane of the bad page
    ctr, out = _run_paged_tile(kernel_device, table, lens, 4, 4, 3, False)
    assert decoded(ctr)["count"] == 12
    np.testing.assert_array_equal(out.cpu().numpy(), ref)


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_count_entries_property(guard_row, data):
    """Random corruptions of a page table read as 2-D tiles by several head programs: count= counts each bad entry
    of the used pages exactly once; the lane-counting control counts tokens x heads (more whenever either is > 1)."""
    dev = "cpu" if not torch.cuda.is_available() else "cuda"
    n_pages = data.draw(st.integers(1, 6))
    bs = data.draw(st.sampled_from([2, 4]))
    heads = data.draw(st.integers(1, 3))
    B = data.draw(st.integers(1, 3))
    W = data.draw(st.integers(1, 4))
    entry = st.one_of(st.integers(0, n_pages - 1), st.integers(-(2**31), -1), st.integers(n_pages, 2**31 - 1))
    table = [data.draw(st.lists(entry, min_size=W, max_size=W)) for _ in range(B)]
    lens = [data.draw(st.integers(0, W * bs)) for _ in range(B)]
    bad, lanes, ref = _paged_expectations(table, lens, n_pages, bs, heads)
    ctr, out = _run_paged_tile(dev, table, lens, n_pages, bs, heads, True)
    guard_row(ctr, bad)
    np.testing.assert_array_equal(out.cpu().numpy(), ref)
    ctr, _ = _run_paged_tile(dev, table, lens, n_pages, bs, heads, False)
    assert decoded(ctr)["count"] == sum(lanes)
    if any(n > 1 for n in lanes):  # the control over-counts exactly when an entry is read by several lanes
        assert sum(lanes) > len(bad)


def test_count_scalar_program_condition(kernel_device, guard_row):
    """count= a scalar (the program condition alone): a 1-D block of entries read by 4 programs counts once."""

    @triton.jit
    def k(ctr, x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0)
        guard_index(x, 0, 8, ctr, offs, mask=m, count=tl.program_id(0) == 0)

    x = torch.tensor([1, 8, -1, 3, 9], dtype=torch.int32, device=kernel_device)
    ctr = torch.zeros(8, dtype=torch.int64, device=kernel_device)
    k[(4,)](ctr, x, 5, BLOCK=8)
    guard_row(ctr, [(1, 8), (2, -1), (4, 9)])


def test_record_hit_counts_once_per_program(kernel_device, guard_row):
    """record_hit under a scalar `if`: once per program that reaches it (4 programs, 4 counts), not per thread;
    with the program condition in the `if`, once."""

    @triton.jit
    def k(ctr, x_ptr, ONE: tl.constexpr):
        x = tl.load(x_ptr)
        bad = x >= 8
        if ONE:
            bad = bad & (tl.program_id(0) == 0)
        if bad:
            record_hit(ctr, tl.program_id(0), x)

    x = torch.tensor([11], dtype=torch.int32, device=kernel_device)
    ctr = torch.zeros(8, dtype=torch.int64, device=kernel_device)
    k[(4,)](ctr, x, ONE=False)
    d = decoded(ctr)
    assert (d["count"], d["max_row"], d["min_value"]) == (4, 3, 11)
    ctr.zero_()
    k[(4,)](ctr, x, ONE=True)
    guard_row(ctr, [(0, 11)])
