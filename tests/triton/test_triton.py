"""The record helpers, run in the interpreter on the CPU (CI) and compiled on the GPU: exact counts, extremes,
first-offender pair, encodings near the limits, a property test against a Python reference, and ``count=``: bad
ENTRIES counted once in a 2-D tile read by several programs (with the lane-counting control that over-counts)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tripwire.layout import VALUE_MAX, VALUE_MIN, decode, decode_neg
from tripwire.triton import GUARD_BIAS, any_outside, guard_index, record_hit, record_hits, record_lanes


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


@triton.jit
def _plain_numbers_kernel(ctr, x_ptr):
    # The row, the value and the request as plain numbers (constexpr in a compiled kernel, ints in the interpreter).
    x = tl.load(x_ptr)
    if x > 0:
        record_hit(ctr, 0, x)
        record_hit(ctr, 3, 41, 7)
    record_hits(ctr, x > 0, 2, 9)


@triton.jit
def _dot_to(x):
    return x.to(tl.int64)


@triton.jit
def _plain_to_kernel(out):
    tl.store(out, _dot_to(0))


def test_record_hit_takes_plain_numbers(kernel_device):
    """``record_hit(ctr, 0, v)``: a plain row, value or request counts like a tensor one."""
    ctr = torch.zeros(8 + 2 * 8, dtype=torch.int64, device=kernel_device)
    _plain_numbers_kernel[(1,)](ctr, torch.tensor([5], device=kernel_device))
    d = decoded(ctr[:8])
    assert (d["count"], d["first_row"], d["first_value"], d["max_row"], d["max_value"]) == (3, 0, 5, 3, 41)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's error; a compiler's differs")
def test_control_dot_to_on_a_plain_number_is_an_attribute_error():
    """Control: what the helpers did (``row.to(tl.int64)``) fails on a plain number, naming no argument."""
    from triton.runtime.errors import InterpreterError

    with pytest.raises(InterpreterError, match=r"int\\*. object has no attribute \\*.to"):
        _plain_to_kernel[(1,)](torch.zeros(1, dtype=torch.int64))


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


# ------------------------------------------------------------------------------------------ count=: entries, not lanes
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


# ---------------------------------------------------------------------------------------------- offenders
# Under the interpreter programs run one after another and a block's atomics run lane by lane, so "first come" is
# exactly (program, lane) order; on the GPU programs and lanes race, so there the kept ones are some K of them.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SEQUENTIAL = INTERPRET


@triton.jit
def _offender_kernel(ctr, bad_ptr, rows_ptr, vals_ptr, reqs_ptr, n, HAS_REQ: tl.constexpr, BLOCK: tl.constexpr):
    """Program p records lanes [p * BLOCK, (p + 1) * BLOCK): their bad flags, rows, values and (HAS_REQ) requests."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    bad = tl.load(bad_ptr + offs, mask=m, other=0) != 0
    rows = tl.load(rows_ptr + offs, mask=m, other=0)
    vals = tl.load(vals_ptr + offs, mask=m, other=0)
    reqs = None
    if HAS_REQ:
        reqs = tl.load(reqs_ptr + offs, mask=m, other=0)
    record_hits(ctr, tl.where(m, bad, False), rows, vals, reqs)


@triton.jit
def _scalar_offender_kernel(ctr, x_ptr, reqs_ptr, lo, hi, HAS_REQ: tl.constexpr):
    """record_hit under the kernel's `if bad:` (one program per entry), the request of the entry with it."""
    pid = tl.program_id(0)
    x = tl.load(x_ptr + pid)
    if (x < lo) | (x >= hi):
        req = None
        if HAS_REQ:
            req = tl.load(reqs_ptr + pid)
        record_hit(ctr, pid, x, req)


@triton.jit
def _guard_offender_kernel(ctr, x_ptr, reqs_ptr, n, lo, hi, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0)
    guard_index(x, lo, hi, ctr, offs, mask=m, req=tl.load(reqs_ptr + offs, mask=m, other=0))


def _record(dev, ctr, lanes, block, has_req=True):
    """Launch _offender_kernel over ``lanes`` = [(bad, row, value, request)], ``block`` lanes per program."""
    bad, rows, vals, reqs = (torch.tensor(c, dtype=torch.int64, device=dev) for c in zip(*lanes, strict=True))
    n = len(lanes)
    _offender_kernel[(triton.cdiv(n, block),)](ctr, bad, rows, vals, reqs, n, HAS_REQ=has_req, BLOCK=block)


def _first_distinct(hits):
    out = []
    for h in hits:
        if h not in out:
            out.append(h)
    return out


def _claim_order(lanes, block):
    """The hits of ``lanes`` (one ``(row, value, request)`` per lane in lane order, None where the lane is not bad)
    in the order the helpers claim offenders: program by program (the interpreter runs programs in order), and
    within a program lowest (row, value, request) first, "no request" lowest (its word is 0)."""
    out = []
    for p in range(0, len(lanes), block):
        hits = [h for h in lanes[p : p + block] if h is not None]
        out += sorted(hits, key=lambda h: (h[0], h[1], -1 if h[2] is None else h[2]))
    return out


def _check_kept(hit, hits, k):
    """The kept offenders of ``hit`` against the hits in claim order (:func:`_claim_order`): the first ``k``
    distinct ones (exactly, in order, under the interpreter; on the GPU, where programs race, some ``min(k,
    distinct)`` of them, all of them when they fit)."""
    distinct = _first_distinct(hits)
    kept = [tuple(o) for o in hit.offenders]
    assert hit.count == len(hits)
    assert len(kept) == len(set(kept)) == min(k, len(distinct)), (kept, distinct)
    if SEQUENTIAL:
        assert kept == distinct[:k]
    else:
        assert set(kept) <= set(distinct)
        if len(distinct) <= k:
            assert set(kept) == set(distinct)


_req_pool = st.one_of(st.integers(-3, 3), st.sampled_from([2**62, -(2**63), 2**31 - 1]))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lanes=st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(-4, 4), _req_pool), min_size=1, max_size=40),
    block=st.sampled_from([1, 4, 16]),
    k=st.sampled_from([1, 3, 8]),
    has_req=st.booleans(),
)
def test_offenders_first_k_distinct(make_monitor, hit_of, lanes, block, k, has_req):
    """Random bad sets over one or several programs (block 1: a program per lane; 16: most in one program), drawn
    from small pools so that repeats are common: the row keeps the first K distinct (row, value, request) in claim
    order (:func:`_claim_order`), the count is exact; without a request map every request is None."""
    mon = make_monitor(offenders=k)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ctr = mon.counter(mon.registry.register("t.offenders"), dev)
    _record(dev, ctr, lanes, block, has_req)
    sat = lambda q: max(VALUE_MIN, min(VALUE_MAX, q))  # noqa: E731
    # A negative request: no request.
    hits = _claim_order([(r, v, sat(q) if has_req and q >= 0 else None) if b else None for b, r, v, q in lanes], block)
    hit = hit_of(mon, "t.offenders")
    if not hits:
        assert hit is None
        return
    _check_kept(hit, hits, k)


@triton.jit
def _lanes_kernel(c0, c1, c2, bad_ptr, rows_ptr, vals_ptr, reqs_ptr, n, HAS_REQ: tl.constexpr, BLOCK: tl.constexpr):
    """record_lanes over three sites: lane bits 1, 2 and 4 flag sites 0, 1 and 2; their values v, v + 1 and 2v."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    bits = tl.load(bad_ptr + offs, mask=m, other=0)
    rows = tl.load(rows_ptr + offs, mask=m, other=0)
    vals = tl.load(vals_ptr + offs, mask=m, other=0)
    reqs = None
    if HAS_REQ:
        reqs = tl.load(reqs_ptr + offs, mask=m, other=0)
    bads = (m & ((bits & 1) != 0), m & ((bits & 2) != 0), m & ((bits & 4) != 0))
    record_lanes((c0, c1, c2), bads, rows, (vals, vals + 1, vals * 2), reqs)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lanes=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 5), st.integers(-4, 4), _req_pool), min_size=1,
                   max_size=70),
    block=st.sampled_from([32, 128]),
    k=st.sampled_from([1, 3, 8]),
    has_req=st.booleans(),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)  # fmt: skip
def test_record_lanes_against_reference(make_monitor, hit_of, lanes, block, k, has_req, dtype):
    """record_lanes (each lane records itself, no vote: compiled, PTX) over three sites of random bad lanes, repeats
    common: per site the count and extremes exact, the first pair one real hit, the first K distinct offenders kept
    (in claim order under the interpreter; on the GPU, where lanes race, some K of them, all when they fit). A site
    with no bad lane records nothing. Rows, values and requests int32 or int64: compiled, a 32-bit operand is
    sign-extended inside the record (negative values and requests, and int32's extremes, show a wrong extension)."""
    mon = make_monitor(offenders=k)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    names = [f"t.lanes{i}" for i in range(3)]
    ctrs = [mon.counter(mon.registry.register(name), dev) for name in names]
    if dtype == torch.int32:  # the pool's 64-bit requests as int32's extremes
        lanes = [(b, r, v, q if -(2**31) <= q < 2**31 else (2**31 - 1 if q > 0 else -(2**31))) for b, r, v, q in lanes]
    bits = torch.tensor([c[0] for c in lanes], dtype=torch.int64, device=dev)
    rows, vals, reqs = (torch.tensor(c, dtype=dtype, device=dev) for c in list(zip(*lanes, strict=True))[1:])
    n = len(lanes)
    # One thread per lane (the helper's precondition): a block of 32 lanes per warp.
    _lanes_kernel[(triton.cdiv(n, block),)](
        *ctrs, bits, rows, vals, reqs, n, HAS_REQ=has_req, BLOCK=block, num_warps=block // 32
    )
    sat = lambda q: max(VALUE_MIN, min(VALUE_MAX, q))  # noqa: E731
    for i, (name, ctr) in enumerate(zip(names, ctrs, strict=True)):
        value = [lambda v: v, lambda v: v + 1, lambda v: 2 * v][i]
        mine = [(r, value(v), sat(q) if has_req and q >= 0 else None) if b >> i & 1 else None for b, r, v, q in lanes]
        hits = _claim_order(mine, block)
        hit = hit_of(mon, name)
        if not hits:
            assert hit is None and ctr.cpu()[:6].abs().sum() == 0
            continue
        d = decoded(ctr)
        assert d["count"] == len(hits)
        assert d["max_row"] == max(h[0] for h in hits)
        assert (d["max_value"], d["min_value"]) == (max(h[1] for h in hits), min(h[1] for h in hits))
        assert (d["first_row"], d["first_value"]) in {(h[0], h[1]) for h in hits}
        _check_kept(hit, hits, k)


def test_record_lanes_needs_a_thread_per_lane(make_monitor, kernel_device):
    """record_lanes' precondition: each lane held by one thread. A block of 32 lanes over one warp records its one bad
    lane once; the control, the same block over 4 warps (every lane held by 4 threads), records it once per copy
    when compiled (the PTX runs in every thread that holds the lane). The interpreter has no threads: once."""
    bits = torch.zeros(32, dtype=torch.int64, device=kernel_device)
    bits[5] = 1
    z = torch.zeros(32, dtype=torch.int64, device=kernel_device)
    counts = []
    for warps in (1, 4):
        mon = make_monitor(offenders=4)
        ctrs = [mon.counter(mon.registry.register(f"t.replica{i}"), kernel_device) for i in range(3)]
        _lanes_kernel[(1,)](*ctrs, bits, z, z, z, 32, HAS_REQ=False, BLOCK=32, num_warps=warps)
        counts.append(int(ctrs[0][0]))
    assert counts == ([1, 1] if INTERPRET else [1, 4])


@triton.jit
def _sites_kernel(c0, c1, c2, c3, x_ptr, N: tl.constexpr):
    offs = tl.arange(0, 32)
    x = tl.load(x_ptr + offs)
    if N == 4:
        record_lanes((c0, c1, c2, c3), (x > 0, x > 1, x > 2, x > 3), offs, (x, x, x, x))
    else:
        record_lanes((c0, c1), (x > 0, x > 1), offs, (x, x))


def test_record_lanes_refuses_four_sites(kernel_device):
    """record_lanes takes one to three sites: four are refused when the kernel is built (compiled, they would
    otherwise leave the fourth unrecorded). The control, two sites, records both."""
    ctrs = [torch.zeros(8, dtype=torch.int64, device=kernel_device) for _ in range(4)]
    x = torch.arange(32, dtype=torch.int64, device=kernel_device)
    with pytest.raises(Exception) as err:  # the interpreter's AssertionError, or the compiler's error around one
        _sites_kernel[(1,)](*ctrs, x, N=4, num_warps=1)
    assert "1 to 3 sites" in str(err.value) + repr(err.value.__cause__)
    _sites_kernel[(1,)](*ctrs, x, N=2, num_warps=1)
    assert [int(c[0]) for c in ctrs] == [31, 30, 0, 0]


def test_offenders_in_one_program_and_across_programs(make_monitor, hit_of, kernel_device):
    """5 distinct offenders in one program, then a program with 2 repeats and 2 new ones: 7 kept of K = 8, in
    arrival order; the count is the 10 bad lanes. Control: the same bad lanes in one program each, with the repeats'
    values made distinct, fill the 8 entries (so the repeats above really were recognised as repeats)."""
    mon = make_monitor(offenders=8)
    ctr = mon.counter(mon.registry.register("t.one"), kernel_device)
    p0 = [(1, 10 + i, -i, 100 + i) for i in range(5)] + [(0, 99, 99, 99)] * 3
    p1 = [(1, 11, -1, 101), (1, 13, -3, 103), (1, 50, 7, -1), (1, 51, 8, -2), (0, 1, 1, 1), (1, 50, 7, -1)] + [
        (0, 0, 0, 0)
    ] * 2
    _record(kernel_device, ctr, p0 + p1, 8)
    hits = [(r, v, q if q >= 0 else None) for b, r, v, q in p0 + p1 if b]  # a negative id: no request
    assert len(hits) == 10 and len(_first_distinct(hits)) == 7
    hit = hit_of(mon, "t.one")
    _check_kept(hit, hits, 8)
    # Control: distinct values for what were repeats: every lane is a new offender, 10 distinct, 8 kept.
    mon2 = make_monitor(offenders=8)
    ctr2 = mon2.counter(mon2.registry.register("t.one"), kernel_device)
    distinct = [(b, r, v + 1000 * i, q) for i, (b, r, v, q) in enumerate(p0 + p1)]
    _record(kernel_device, ctr2, distinct, 1)
    hit2 = hit_of(mon2, "t.one")
    assert hit2.count == 10 and len(hit2.offenders) == 8


def test_repeats_claim_nothing(make_monitor, hit_of, kernel_device):
    """The same 3 faults launched 4 times (and twice within one program each time): the count is 4 x 6, the
    offenders are the 3 distinct ones, once each. Control: the same rows with a new value each launch keep more."""
    mon = make_monitor(offenders=8)
    ctr = mon.counter(mon.registry.register("t.repeat"), kernel_device)
    faults = [(1, 3, 40, 7), (1, 5, -2, 7), (1, 9, 40, 8)]
    for _ in range(4):
        _record(kernel_device, ctr, faults + faults, 8)
    hit = hit_of(mon, "t.repeat")
    assert hit.count == 24
    assert [tuple(o) for o in hit.offenders] == [(3, 40, 7), (5, -2, 7), (9, 40, 8)] or not SEQUENTIAL
    assert sorted(tuple(o) for o in hit.offenders) == [(3, 40, 7), (5, -2, 7), (9, 40, 8)]
    # Control: a new value per launch is a new offender each time: 3 per launch, 8 kept (the count is exact).
    mon2 = make_monitor(offenders=8)
    ctr2 = mon2.counter(mon2.registry.register("t.repeat"), kernel_device)
    for i in range(4):
        _record(kernel_device, ctr2, [(b, r, v + i, q) for b, r, v, q in faults], 8)
    hit2 = hit_of(mon2, "t.repeat")
    assert hit2.count == 12 and len(hit2.offenders) == 8


def test_request_only_tells_offenders_apart(make_monitor, hit_of, kernel_device):
    """One (row, value) with two requests is two offenders; with no request map it is one (request None)."""
    mon = make_monitor()
    ctr = mon.counter(mon.registry.register("t.req"), kernel_device)
    _record(kernel_device, ctr, [(1, 4, 9, 1), (1, 4, 9, 2), (1, 4, 9, 1)], 4)
    assert sorted(tuple(o) for o in hit_of(mon, "t.req").offenders) == [(4, 9, 1), (4, 9, 2)]
    mon2 = make_monitor()
    ctr2 = mon2.counter(mon2.registry.register("t.req"), kernel_device)
    _record(kernel_device, ctr2, [(1, 4, 9, 1), (1, 4, 9, 2), (1, 4, 9, 1)], 4, has_req=False)
    hit = hit_of(mon2, "t.req")
    assert hit.count == 3 and [tuple(o) for o in hit.offenders] == [(4, 9, None)]


def test_more_than_k_distinct_keep_k_and_count_exactly(make_monitor, hit_of, kernel_device):
    """12 distinct offenders over 6 programs into K = 4: 4 kept (the first 4, under the interpreter), the count 12,
    the extremes over all 12. Control: K = 16 keeps all 12."""
    faults = [(1, i, 100 - i, i % 3) for i in range(12)]
    for k, kept in ((4, 4), (16, 12)):
        mon = make_monitor(offenders=k)
        ctr = mon.counter(mon.registry.register("t.many"), kernel_device)
        _record(kernel_device, ctr, faults, 2)
        hit = hit_of(mon, "t.many")
        assert (hit.count, len(hit.offenders)) == (12, kept)
        assert (hit.max_row, hit.min_value, hit.max_value) == (11, 89, 100)
        _check_kept(hit, [(r, v, q) for _, r, v, q in faults], k)
    # More faults into the full block: counted, nothing more kept.
    _record(kernel_device, ctr, [(1, 50 + i, i, 0) for i in range(6)], 4)
    hit = hit_of(mon, "t.many")
    assert (hit.count, len(hit.offenders)) == (18, 16)


def test_record_hit_and_guard_index_keep_offenders_with_requests(make_monitor, hit_of, kernel_device):
    """record_hit (a program each) and guard_index (lanes of a block) keep the same offenders as record_hits."""
    x = [0, 9, -1, 3, 12, 9]
    reqs = [70, 71, 72, 73, 74, 71]
    expect = [(1, 9, 71), (2, -1, 72), (4, 12, 74), (5, 9, 71)]
    xt = torch.tensor(x, dtype=torch.int32, device=kernel_device)
    rt = torch.tensor(reqs, dtype=torch.int32, device=kernel_device)
    mon = make_monitor()
    a = mon.counter(mon.registry.register("t.hit"), kernel_device)
    b = mon.counter(mon.registry.register("t.hit_noreq"), kernel_device)
    g = mon.counter(mon.registry.register("t.guard"), kernel_device)
    _scalar_offender_kernel[(len(x),)](a, xt, rt, 0, 8, HAS_REQ=True)
    _scalar_offender_kernel[(len(x),)](b, xt, rt, 0, 8, HAS_REQ=False)
    _guard_offender_kernel[(2,)](g, xt, rt, len(x), 0, 8, BLOCK=4)
    for name, want in (("t.hit", expect), ("t.guard", expect), ("t.hit_noreq", [(r, v, None) for r, v, _ in expect])):
        hit = hit_of(mon, name)
        assert hit.count == 4, name
        got = [tuple(o) for o in hit.offenders]
        assert (got if SEQUENTIAL else sorted(got, key=str)) == (want if SEQUENTIAL else sorted(want, key=str)), name


def test_plain_counter_counts_and_keeps_no_offenders(make_monitor, hit_of, kernel_device):
    """A counter that is not an arena row (a plain zeros(8): slot 7 is 0) still counts exactly, keeps its extremes
    and first pair, and nothing is written past its 8 words. Control: the same faults into an arena row keep 3."""
    faults = [(1, 2, 30, 5), (1, 4, -6, 5), (0, 0, 0, 0), (1, 7, 30, 6)]
    guard = torch.full((24,), -1, dtype=torch.int64, device=kernel_device)  # 8 words of counter, then 16 of canary
    ctr = guard[8:16]
    ctr.zero_()
    _record(kernel_device, ctr, faults, 4)
    d = decoded(ctr)
    assert (d["count"], d["max_row"], d["min_value"], d["max_value"], d["spare"]) == (3, 7, -6, 30, [0, 0])
    assert (d["first_row"], d["first_value"]) == (2, 30)
    assert guard[:8].eq(-1).all() and guard[16:].eq(-1).all()  # nothing written around it
    mon = make_monitor()
    row = mon.counter(mon.registry.register("t.arena"), kernel_device)
    _record(kernel_device, row, faults, 4)
    hit = hit_of(mon, "t.arena")
    assert hit.count == 3 and sorted(tuple(o) for o in hit.offenders) == [(2, 30, 5), (4, -6, 5), (7, 30, 6)]


# ---------------------------------------------------------------------------------------------- sm_90 build
# The control: an early return inside a static `if`. A module of its own, so that the interpreter (here) and the
# compiler (the probe) run the same source (@triton.jit reads its function's source from a file).
_EARLY_RETURN = """
import triton
import triton.language as tl


@triton.jit
def _early_return(reqs, like):
    if reqs is None:
        return like * 0
    return reqs.to(tl.int64) + like * 0


@triton.jit
def control(out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _early_return(None, offs.to(tl.int64)))
"""

_HELPERS_PROBE = r"""
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.errors import CompilationError
from tripwire.triton import guard_index, record_hit, record_hits, record_lanes

@triton.jit
def lanes(ctr, x_ptr, req_ptr, n, HAS_REQ: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0)
    q = None
    if HAS_REQ:
        q = tl.load(req_ptr + offs, mask=m, other=0)
    record_lanes((ctr, ctr + 8, ctr + 16), (m & (x < 0), m & (x > 9), m & (x == 5)), x, (x, x + 1, x * 2), q)

@triton.jit
def uses(ctr, x_ptr, req_ptr, n, HAS_REQ: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0)
    q = None
    if HAS_REQ:
        q = tl.load(req_ptr + offs, mask=m, other=0)
    guard_index(x, 0, n, ctr, offs, mask=m, count=tl.program_id(1) == 0, req=q)
    record_hits(ctr + 8, m & (x == 7), offs, x, q)
    y = tl.load(x_ptr + tl.program_id(0))
    if y >= n:
        r = None
        if HAS_REQ:
            r = tl.load(req_ptr + tl.program_id(0))
        record_hit(ctr + 16, tl.program_id(0), y, r)

from early_return import control  # noqa: E402  (written next to this probe)

def build(k, types, consts):
    names = k.arg_names
    sig = {n: types.get(n, "constexpr") for n in names}
    src = ASTSource(k, sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]

types = {"ctr": "*i64", "x_ptr": "*i32", "req_ptr": "*i64", "n": "i32", "out_ptr": "*i64"}
try:
    out = {}
    for has in (False, True):
        ptx = build(uses, types, dict(HAS_REQ=has, BLOCK=128))
        out[str(has)] = {"cas": ptx.count(".cas.b64"), "release": ptx.count("atom.global.sys.release.exch"),
                         "cold": sorted({f for f in ("_record_words", "_claim", "_record_one") if "call.uni" in ptx
                                         and f"_$_{f}__" in ptx})}
    for width in (32, 64):
        for has in (False, True):
            ptx = build(lanes, {**types, "x_ptr": f"*i{width}", "req_ptr": f"*i{width}"}, dict(HAS_REQ=has, BLOCK=128))
            out[f"lanes{width}{has}"] = ptx.count("cvt.s64.s32")
    try:
        build(control, types, dict(BLOCK=16))
        out["control"] = "compiled"
    except CompilationError as e:
        out["control"] = "CompilationError: " + str(e).splitlines()[-1][:200]
except CompilationError:
    raise  # a helper that does not compile is a failure, never a skip
except Exception as e:
    out = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
print(json.dumps(out))
"""


def test_helpers_compile_for_sm90_with_and_without_requests(build_probe, tmp_path):
    """Every helper, with and without a request, compiled for sm_90 (no GPU needed; record_lanes at int32 and
    int64 operands too): the fault path's
    compare-and-swaps and the released ROW store are in the PTX, out of line (called functions). Control: the interpreter runs code the compiler
    refuses (an early return inside a static `if`: the compiler goes on past it), so only a build shows that the
    helpers compile."""
    (tmp_path / "early_return.py").write_text(_EARLY_RETURN)
    r = build_probe(f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n" + _HELPERS_PROBE)
    for has in ("False", "True"):
        # Out of line, each compare-and-swap is in the PTX once (in its .func), called from every helper.
        assert r[has]["cas"] >= 2 and r[has]["release"] >= 1, r
        # The claim walk is inlined into the claim loop (a call there costs registers: see _claim).
        assert r[has]["cold"] == ["_record_one", "_record_words"], r
    # record_lanes at both operand widths: 32-bit rows, values and requests are widened inside the record (on its
    # fault path, one cvt per operand: the row, three values, the request), 64-bit ones are not.
    assert [r[f"lanes{w}{has}"] for w in (32, 64) for has in ("False", "True")] == [4, 5, 0, 0], r
    assert r["control"].startswith("CompilationError"), r
    if INTERPRET:  # ... which the interpreter runs without a complaint
        spec = importlib.util.spec_from_file_location("early_return", tmp_path / "early_return.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out = torch.full((4,), 5, dtype=torch.int64)
        mod.control[(1,)](out, BLOCK=4)
        assert out.tolist() == [0, 0, 0, 0]


_REGISTERS_PROBE = r"""
import json, os
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # each variant below is a different fault path under one cache key
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.errors import CompilationError
import tripwire.triton as tt
from tripwire import layout
from tripwire.numerics import nonfinite as nf

_H, _E = tl.constexpr(layout.OFF_HEADER), tl.constexpr(layout.OFF_ENTRY)
_ER, _EV, _EQ = tl.constexpr(layout.E_ROW), tl.constexpr(layout.E_VALUE), tl.constexpr(layout.E_REQ)


@triton.jit
def no_offenders(ctr_ptr, b, rb, vb, qb, CALLS: tl.constexpr = True):
    # The baseline: the fault path's count, extremes and first pair, no offenders.
    tl.atomic_add(ctr_ptr + 6, rb.to(tl.int64).sum() * 0)


@triton.jit
def per_lane_offenders(ctr_ptr, b, rb, vb, qb, CALLS: tl.constexpr = True):
    # The control: every lane claims at once (a key and a compare-and-swap result per lane, live across the block).
    addr = tl.load(ctr_ptr + 7)
    if addr != 0:
        blk = addr.to(tl.pointer_type(tl.int64))
        k = tl.load(blk + 1)
        if tl.load(blk + _H + (k - 1) * _E) == 0:
            # The shipped claim's own key function (one source for the hash: a copy here could drift from it), read
            # by name as the claim itself is swapped by name below.
            key = tt._offender_key(rb, vb, qb)
            active = b
            for j in range(0, k):
                if tl.sum(active.to(tl.int32), axis=None) > 0:
                    slot = blk + _H + j * _E
                    old = tl.atomic_cas(tl.where(active, slot, blk), tl.where(active, 0, -1).to(tl.int64), key)
                    won = active & (old == 0)
                    tl.store(slot + _EQ + rb * 0, qb, mask=won)
                    tl.store(slot + _EV + rb * 0, vb, mask=won)
                    tl.atomic_xchg(slot + _ER + rb * 0, rb, mask=won, sem="release", scope="sys")
                    active = active & (old != 0) & (old != key)


@triton.jit
def wide(x_ptr, ctr_ptr, numel, ncols, BLOCK: tl.constexpr):
    # The control's kernel: a record over a whole wide block (2048 lanes), the layout the counters had before
    # their fault paths read small tiles again: per-lane claims there cost registers.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    x = tl.load(x_ptr + offs, mask=m, other=0)
    bad = ((x & 0x7F80) == 0x7F80) & m
    if tl.max(bad.to(tl.int32), axis=None) > 0:
        tt.record_hits(ctr_ptr, bad, offs // ncols, offs % ncols)


def regs(fn, types, consts, warps):
    names = fn.arg_names
    sig = {a: ("constexpr" if a in consts else types.get(a, "*i64" if a.endswith("_ptr") else "i32")) for a in names}
    src = ASTSource(fn, sig, constexprs={(names.index(a),): v for a, v in consts.items()})
    return sm90_usage(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)), warps)


def launched_nonfinite():
    # The non-finite counter as count_nonfinite launches it over [256, 152064] bf16 logits: recorded (not run) and
    # compiled for sm_90 with the launch's own specialisation (16-byte aligned data) and register cap (its twin's
    # allocation, found in this process: each variant runs in a process of its own, the register budget keeping one
    # cap per launch).
    import torch
    from tripwire import Monitor, SiteRegistry
    from tripwire import resources as rs

    mon = Monitor(registry=SiteRegistry(capacity=4), capacity=4, mode="off")
    site = nf.register_nonfinite_site("probe.logits", monitor=mon)
    x = torch.zeros(256, 152064, dtype=torch.bfloat16)
    (launch,) = rs.capture_launches(lambda: nf.count_nonfinite(x, site, ctr=mon.counter(site, "cpu")))
    u = rs.triton_usage(launch)
    return {"regs": u.regs, "smem": u.smem, "programs_per_sm": u.programs_per_sm}


# The control's wide record. The non-finite counter (a wide read) is measured as launched (launched_nonfinite).
KERNELS = {
    "wide": (wide, {"x_ptr": "*i16", "numel": "i64", "ncols": "i64"}, dict(BLOCK=2048), 8),
}
VARIANT = "@VARIANT@"  # the one this process compiles (the test runs a process per variant)
try:
    variants = {"shipped": tt._claim_offenders, "none": no_offenders, "per_lane": per_lane_offenders}
    tt._claim_offenders = variants[VARIANT]  # _fault resolves it by name when it is compiled
    out = {name: regs(*spec) for name, spec in KERNELS.items()}
    out["nonfinite"] = launched_nonfinite()
except CompilationError:
    raise  # a kernel that does not compile is a failure, never a skip
except Exception as e:
    out = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
print(json.dumps(out))
"""


def test_offender_claims_cost_the_hot_path_no_occupancy(build_probe):
    """Registers are allocated for a kernel's hungriest path, taken or not, so a compiled-in fault path can slow a
    clean launch. Compiled for sm_90 (no GPU needed) as count_nonfinite launches it (its default shape, within its
    twin's registers), the non-finite counter (whose fault path reads small tiles again) needs no more registers and
    fits as many programs per SM with the shipped offender claims as with none at all: the claims fit the cap without
    the kernel's entry function spilling more than its twin's (else there is no cap, and the comparison fails). A
    record over a whole 2048-lane block is where claims cost (why the counters record from small tiles): there the
    shipped scalar claims need fewer registers than claims made by every lane at once (the control: per-lane keys
    and compare-and-swap results live across the block), so the comparison can fail. (The slot mapping is held to
    the register rule against its twin in tests/test_register_rule.py.)"""
    r = {v: build_probe(_REGISTERS_PROBE.replace("@VARIANT@", v)) for v in ("shipped", "none", "per_lane")}
    assert r["per_lane"]["wide"]["regs"] > r["shipped"]["wide"]["regs"] + 8, r
    assert r["per_lane"]["wide"]["programs_per_sm"] <= r["shipped"]["wide"]["programs_per_sm"], r
    shipped, none = r["shipped"]["nonfinite"], r["none"]["nonfinite"]
    assert shipped["regs"] <= none["regs"] + 8 and shipped["programs_per_sm"] >= none["programs_per_sm"], r


_CACHE_PROBE = r"""
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def one(x_ptr):
    tl.store(x_ptr, 1)


try:
    triton.compile(ASTSource(one, {"x_ptr": "*i32"}), target=GPUTarget("cuda", 90, 32))
    out = {"compiled": True}
except Exception as e:
    out = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
print(json.dumps(out))
"""


def test_build_probes_compile_into_a_cache_of_their_own(build_probe, tmp_path, monkeypatch):
    """The claims probe above compiles three fault paths under the non-finite counter's one cache key: into a
    shared Triton cache, the last of them would be what count_nonfinite launches afterwards, in any process that
    reads that cache (a user's ~/.triton after `make test`). So every build probe compiles into a cache of its own:
    the cache the tests' process names gets nothing. The control: the same probe told to share it writes there."""
    shared = tmp_path / "shared-cache"
    shared.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(shared))
    build_probe(_CACHE_PROBE)
    assert not any(shared.iterdir())
    build_probe(_CACHE_PROBE, private_cache=False)
    assert any(shared.iterdir())


# ---------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
def test_gpu_graph_replay_offenders_are_the_distinct_ones(make_monitor, hit_of, captured):
    """A guarded kernel captured in a CUDA graph and replayed N times: the count is N x the bad lanes, exactly, and
    the offenders are the distinct ones once each (a replay's repeats claim nothing), with their requests."""
    mon = make_monitor(offenders=8)
    mon.prealloc("cuda")
    ctr = mon.counter(mon.registry.register("t.graph"), "cuda")
    lanes = [(0, i, i, i) for i in range(300)]
    bad = {3: (3, -1, 11), 40: (40, 1000, 12), 41: (41, 1000, 12), 130: (130, 2**31 - 1, 13), 299: (299, -7, 14)}
    for i, (r, v, q) in bad.items():
        lanes[i] = (1, r, v, q)
    lanes[200] = (1, 3, -1, 11)  # a repeat of lane 3's offender in another program
    b, rows, vals, reqs = (torch.tensor(c, dtype=torch.int64, device="cuda") for c in zip(*lanes, strict=True))

    def step():
        _offender_kernel[(triton.cdiv(300, 64),)](ctr, b, rows, vals, reqs, 300, HAS_REQ=True, BLOCK=64)

    graph = captured(step, mon)  # resets the monitor: the run outside the capture leaves nothing behind
    n = 40
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    hit = hit_of(mon, "t.graph")
    assert hit.count == n * 6
    assert sorted(tuple(o) for o in hit.offenders) == sorted(bad.values())


@triton.jit
def _any_outside_kernel(x_ptr, out_ptr, start, end, lo, hi, BLOCK: tl.constexpr):
    tl.store(out_ptr, any_outside(x_ptr, start, end, lo, hi, BLOCK).to(tl.int32))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16])
@pytest.mark.parametrize("block", [4, 64, 128])
def test_any_outside_sees_only_its_range(kernel_device, block, dtype):
    """The pre-check of a loop's indices: True exactly when an entry of x[start:end] is outside [lo, hi), over
    several steps (compiled, int32 and int64 entries take the warp vote, 32 to 128 entries per step and warp; int16
    the block reduction); a bad entry just past ``end`` (read by a step's tail lanes) and one just before ``start``
    do not count. The control: the same range with one bad entry inside it flips the answer, at its first entry, its
    last, and past the first steps."""
    x = torch.full((700,), 5, dtype=dtype)
    x[2], x[30], x[599] = -1, 99, 10  # outside [0, 10), but outside the ranges below too
    x = x.to(kernel_device)
    out = torch.zeros(1, dtype=torch.int32, device=kernel_device)

    def run(start: int, end: int, lo: int = 0, hi: int = 10) -> int:
        _any_outside_kernel[(1,)](x, out, start, end, lo, hi, BLOCK=block)
        return int(out.cpu()[0])

    assert run(3, 30) == 0
    assert run(3, 3) == 0  # an empty range
    assert run(31, 599) == 0  # many steps, bad entries on both sides
    # lo above the value a masked lane would hold (0): lanes past `end` of a range that is no multiple of 32 are left
    # out. lo itself is inside, lo - 1 outside; negative int32/int16 entries compare signed (sign-extended).
    assert run(3, 30, lo=5) == 0 and run(3, 30, lo=6) == 1 and run(31, 599, lo=1) == 0
    x[40], x[41] = -4, -3
    assert run(40, 42, lo=-4) == 0 and run(40, 42, lo=-3) == 1 and run(41, 42, lo=-3) == 0
    x[40], x[41] = 5, 5
    x[17] = 10  # hi itself is outside
    assert run(3, 30) == 1
    assert run(18, 30) == 0
    x[31] = -(2**15)  # the range's first entry (the smallest int16)
    assert run(31, 599) == 1 and run(32, 599) == 0
    x[31] = 5
    x[598] = 11  # its last
    assert run(31, 599) == 1 and run(31, 598) == 0
    x[598] = 5
    x[450] = -3  # past the first steps of every block size
    assert run(31, 599) == 1 and run(451, 599) == 0 and run(31, 450) == 0
    assert run(2, 3) == 1 and run(30, 31) == 1 and run(599, 600) == 1  # the entries left out above are bad
