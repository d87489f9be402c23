"""The reference guarded kernels against torch/Python references: in-range metadata (identical outputs, zero counts,
the unguarded twin identical), corrupted metadata (negative ids, id == size, huge ids, INT32 extremes: masked outputs,
exact counts, exact first offender and extremes), random corruptions (hypothesis), launch-time argument errors, and
the control: the unguarded twin on an id that lands inside a neighbouring live allocation silently reads / clobbers
it and counts nothing, which is the bug class the guard exists for.

Under the interpreter (CPU) programs run in order, so the first offender is exactly the lowest (row, value); on the
GPU programs race for it, so there it must be one of the real hits.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tripwire.kernels import block_table as bt
from tripwire.kernels import counters
from tripwire.kernels import kv_zero as kz
from tripwire.kernels import paged_gather as pg
from tripwire.kernels import rope as rp
from tripwire.kernels import slot_mapping as sm
from tripwire.kernels import state_copy as sc
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
    assert c[6:] == [0, 0]


def ids(values: list[int], device: str, dtype: torch.dtype = I32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------- block table gather
def _bt_inputs(dev: str, R: int = 5, W: int = 6):
    table = (torch.arange(R * W, dtype=I32).reshape(R, W) * 7 + 1).to(dev)
    counts = ids([W, 3, 0, W - 1, 1][:R], dev)
    return table, counts


@pytest.mark.parametrize("guard", [True, False])
def test_block_table_in_range(kernel_device, monitor, guard):
    table, counts = _bt_inputs(kernel_device)
    rows = ids([4, 0, 2, 1, 3, 0], kernel_device)
    out = torch.full((6, 6), -9, dtype=I32, device=kernel_device)
    ctr = counters(bt.SITES, kernel_device, monitor)
    bt.block_table_gather(table, rows, counts, out, guard=guard, ctr=ctr)
    ref, rh, ch = bt.block_table_gather_reference(table, rows, counts)
    assert rh == [] and ch == []
    assert torch.equal(out.cpu(), ref)
    assert ctr.cpu().abs().sum() == 0


def test_block_table_corrupted(kernel_device, monitor):
    table, counts = _bt_inputs(kernel_device)
    counts[1] = 7  # > W
    counts[4] = -1
    rows = ids([0, -1, 5, INT32_MAX, 1, INT32_MIN, 2, 4, 3], kernel_device)
    out = torch.full((9, 6), -9, dtype=I32, device=kernel_device)
    ctr = counters(bt.SITES, kernel_device, monitor)
    bt.block_table_gather(table, rows, counts, out, ctr=ctr)
    ref, rh, ch = bt.block_table_gather_reference(table, rows, counts)
    assert rh == [(1, -1), (2, 5), (3, INT32_MAX), (5, INT32_MIN)]
    assert ch == [(4, 7), (7, -1)]
    assert torch.equal(out.cpu(), ref)
    assert out[[1, 2, 3, 4, 5, 7]].abs().sum() == 0  # bad rows are zeroed rows
    assert_hits(ctr[0], rh)
    assert_hits(ctr[1], ch)


# ---------------------------------------------------------------------------------------------- slot mapping
@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("pos_dtype", [I32, I64])
def test_slot_mapping_in_range(kernel_device, monitor, guard, pos_dtype):
    R, W, bs = 4, 5, 4
    table = (torch.arange(R * W, dtype=I32).reshape(R, W).flip(1) * 3).contiguous().to(kernel_device)
    pos = ids([0, 3, 4, 19, 7, 12, 1], kernel_device, pos_dtype)
    rows = ids([0, 1, 2, 3, 3, 0, 2], kernel_device)
    slots = torch.full((7,), -5, dtype=I64, device=kernel_device)
    ctr = counters(sm.SITES, kernel_device, monitor)
    sm.slot_mapping(pos, rows, table, slots, bs, num_kv_blocks=R * W * 3, guard=guard, ctr=ctr)
    ref, hits = sm.slot_mapping_reference(pos, rows, table, bs, R * W * 3)
    assert hits == {"row": [], "column": [], "block": []}
    assert torch.equal(slots.cpu(), ref)
    assert (ref >= 0).all()
    assert ctr.cpu().abs().sum() == 0


# 4: the power-of-two path (shift and mask); 3 and 6: the general floor-division path.
@pytest.mark.parametrize("bs", [4, 3, 6])
def test_slot_mapping_corrupted(kernel_device, monitor, bs):
    R, W = 4, 5
    table = (torch.arange(R * W, dtype=I32).reshape(R, W) * 3).to(kernel_device)
    table[2, 1] = 60  # == num_kv_blocks
    table[3, 0] = -4
    table[1, 4] = INT32_MAX
    pos = ids([0, -1, -4, -5, 20, 5, 6, INT32_MAX, INT32_MIN, 0, 3, 16, 5, 2], kernel_device)
    rows = ids([0, 0, 1, 1, 0, 2, 4, 1, 0, -1, 3, 1, INT32_MIN, INT32_MAX], kernel_device)
    slots = torch.zeros(14, dtype=I64, device=kernel_device)
    ctr = counters(sm.SITES, kernel_device, monitor)
    sm.slot_mapping(pos, rows, table, slots, bs, num_kv_blocks=60, ctr=ctr)
    ref, hits = sm.slot_mapping_reference(pos, rows, table, bs, 60)
    if bs == 4:
        # negative positions floor into negative columns (-1 -> -1, -4 -> -1, -5 -> -2), not into column 0
        assert hits["column"] == [(1, -1), (2, -1), (3, -2), (4, 5), (7, INT32_MAX // 4), (8, INT32_MIN // 4)]
        assert hits["row"] == [(6, 4), (9, -1), (12, INT32_MIN), (13, INT32_MAX)]
        assert hits["block"] == [(5, 60), (10, -4), (11, INT32_MAX)]
        assert slots[[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]].eq(-1).all()
    else:
        assert hits["column"][0] == (1, -1)  # position -1 floors to column -1 at any block size
    assert torch.equal(slots.cpu(), ref)
    assert_hits(ctr[0], hits["row"])
    assert_hits(ctr[1], hits["column"])
    assert_hits(ctr[2], hits["block"])


def test_slot_mapping_without_block_limit_does_not_guard_block_ids(kernel_device, monitor):
    table = ids([[5, -3]], kernel_device)
    slots = torch.zeros(2, dtype=I64, device=kernel_device)
    ctr = counters(sm.SITES, kernel_device, monitor)
    sm.slot_mapping(ids([1, 5], kernel_device), ids([0, 0], kernel_device), table, slots, 4, ctr=ctr)
    assert slots.cpu().tolist() == [21, -11]  # HAS_BLOCK_LIMIT off: the ids pass through, as documented
    assert ctr.cpu().abs().sum() == 0


# ---------------------------------------------------------------------------------------------- KV zero
@pytest.mark.parametrize("guard", [True, False])
def test_kv_zero_in_range(kernel_device, monitor, guard):
    pool = torch.randn(6, 2, 3, 5, device=kernel_device) + 10
    block_ids = ids([5, 0, 3, 3], kernel_device)
    ref, hits = kz.kv_zero_reference(pool, block_ids)
    ctr = counters(kz.SITES, kernel_device, monitor)
    kz.kv_zero(pool, block_ids, guard=guard, ctr=ctr)
    assert hits == [] and torch.equal(pool.cpu(), ref)
    assert ctr.cpu().abs().sum() == 0


def test_kv_zero_corrupted(kernel_device, monitor):
    # A block of 2*3*700 elements spans several tiles: a bad id must still count once.
    pool = torch.randn(6, 2, 3, 700, device=kernel_device) + 10
    block_ids = ids([1, 6, -1, 4, INT32_MAX, INT32_MIN, 6], kernel_device)
    ref, hits = kz.kv_zero_reference(pool, block_ids)
    ctr = counters(kz.SITES, kernel_device, monitor)
    kz.kv_zero(pool, block_ids, ctr=ctr)
    assert hits == [(1, 6), (2, -1), (4, INT32_MAX), (5, INT32_MIN), (6, 6)]
    assert torch.equal(pool.cpu(), ref)
    assert_hits(ctr, hits)


# ---------------------------------------------------------------------------------------------- paged gather
@pytest.mark.parametrize("guard", [True, False])
def test_paged_gather_in_range(kernel_device, monitor, guard):
    cache = torch.randn(7, 2, 4, 3, device=kernel_device).to(torch.bfloat16)
    table = ids([[0, 6, 2], [3, 3, 1]], kernel_device, I64)
    out = torch.full((2, 3, 2, 4, 3), 9.0, dtype=torch.bfloat16, device=kernel_device)
    ctr = counters(pg.SITES, kernel_device, monitor)
    pg.paged_gather(cache, table, out, guard=guard, ctr=ctr)
    ref, hits = pg.paged_gather_reference(cache, table)
    assert hits == [] and torch.equal(out.cpu(), ref)
    assert ctr.cpu().abs().sum() == 0


def test_paged_gather_corrupted(kernel_device, monitor):
    cache = torch.randn(7, 2, 4, 300, device=kernel_device) + 5  # 2400 elements per page: several tiles
    table = ids([[0, 7, -1], [INT32_MAX, 3, INT32_MIN], [6, 100000, 2]], kernel_device)
    out = torch.full((3, 3, 2, 4, 300), 9.0, device=kernel_device)
    ctr = counters(pg.SITES, kernel_device, monitor)
    pg.paged_gather(cache, table, out, ctr=ctr)
    ref, hits = pg.paged_gather_reference(cache, table)
    assert hits == [(1, 7), (2, -1), (3, INT32_MAX), (5, INT32_MIN), (7, 100000)]
    assert torch.equal(out.cpu(), ref)
    assert out[0, 1].abs().sum() == 0  # masked pages read as zeros
    assert_hits(ctr, hits)


# ---------------------------------------------------------------------------------------------- state copy
def _sc_inputs(dev: str):
    state = (torch.arange(8 * 5, dtype=torch.float32).reshape(8, 5) + 1).to(dev)
    table = ids([[0, 1], [2, 3], [4, 5], [6, 7]], dev)
    return state, table


@pytest.mark.parametrize("guard", [True, False])
def test_state_copy_in_range(kernel_device, monitor, guard):
    state, table = _sc_inputs(kernel_device)
    rows, src, dst = ids([0, 2, 3], kernel_device), ids([0, 1, 0], kernel_device), ids([1, 0, 1], kernel_device)
    ref, hits = sc.state_copy_reference(state, table, rows, src, dst)
    ctr = counters(sc.SITES, kernel_device, monitor)
    sc.state_copy(state, table, rows, src, dst, guard=guard, ctr=ctr)
    assert hits == {"row": [], "column": [], "slot": []}
    assert torch.equal(state.cpu(), ref)
    assert ctr.cpu().abs().sum() == 0


def test_state_copy_corrupted(kernel_device, monitor):
    state, table = _sc_inputs(kernel_device)
    table[1, 1] = 8  # == S
    table[2, 0] = INT32_MIN
    rows = ids([0, 4, INT32_MAX, 1, 2, 3, -1, 3], kernel_device)
    src = ids([0, 0, 2, 0, 0, -1, 0, 0], kernel_device)
    dst = ids([1, 1, 1, 1, 1, 2, 1, INT32_MAX], kernel_device)
    ref, hits = sc.state_copy_reference(state, table, rows, src, dst)
    assert hits == {
        "row": [(1, 4), (2, INT32_MAX), (6, -1)],
        "column": [(2, 2), (5, -1), (5, 2), (7, INT32_MAX)],
        "slot": [(3, 8), (4, INT32_MIN)],
    }
    ctr = counters(sc.SITES, kernel_device, monitor)
    sc.state_copy(state, table, rows, src, dst, ctr=ctr)
    assert torch.equal(state.cpu(), ref)  # only copy 0 ran
    assert_hits(ctr[0], hits["row"])
    assert_hits(ctr[1], hits["column"])
    assert_hits(ctr[2], hits["slot"])


# ---------------------------------------------------------------------------------------------- rope
def _rope_inputs(dev: str, dtype: torch.dtype, T: int = 6, Hq: int = 3, Hk: int = 2, D: int = 12, max_pos: int = 10):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, Hq, D, generator=g).to(dtype).to(dev)
    k = torch.randn(T, Hk, D, generator=g).to(dtype).to(dev)
    cs = torch.randn(max_pos, D, generator=g).to(dev)
    return q, k, cs


@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_range(kernel_device, monitor, guard, dtype):
    q, k, cs = _rope_inputs(kernel_device, dtype)
    pos = ids([0, 9, 3, 3, 5, 1], kernel_device, I64)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    ctr = counters(rp.SITES, kernel_device, monitor)
    rp.rope(pos, q, k, cs, qo, ko, guard=guard, ctr=ctr)
    rq, rk, hits = rp.rope_reference(pos, q, k, cs)
    assert hits == []
    # fp32 math rounded once; the compiled kernel may contract a*b-c*d into an FMA, hence a 1-ulp tolerance
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(qo.cpu(), rq, **tol)
    torch.testing.assert_close(ko.cpu(), rk, **tol)
    assert ctr.cpu().abs().sum() == 0


def test_rope_in_place(kernel_device, monitor):
    q, k, cs = _rope_inputs(kernel_device, torch.float32)
    pos = ids([0, 9, 3, 3, 5, 1], kernel_device)
    rq, rk, _ = rp.rope_reference(pos, q, k, cs)
    rp.rope(pos, q, k, cs, q, k, ctr=counters(rp.SITES, kernel_device, monitor))
    torch.testing.assert_close(q.cpu(), rq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k.cpu(), rk, rtol=1e-6, atol=1e-6)


def test_rope_corrupted_is_fatal_and_zeroes(kernel_device, monitor):
    assert rp.SITE.fatal
    q, k, cs = _rope_inputs(kernel_device, torch.float32)
    pos = ids([0, 10, -1, INT32_MAX, 4, INT32_MIN], kernel_device)
    qo, ko = torch.full_like(q, 7.0), torch.full_like(k, 7.0)
    ctr = counters(rp.SITES, kernel_device, monitor)
    rp.rope(pos, q, k, cs, qo, ko, ctr=ctr)
    rq, rk, hits = rp.rope_reference(pos, q, k, cs)
    assert hits == [(1, 10), (2, -1), (3, INT32_MAX), (5, INT32_MIN)]
    assert qo[[1, 2, 3, 5]].abs().sum() == 0 and ko[[1, 2, 3, 5]].abs().sum() == 0
    torch.testing.assert_close(qo.cpu(), rq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ko.cpu(), rk, rtol=1e-6, atol=1e-6)
    assert_hits(ctr, hits)
    # the private monitor sees it as a fatal site: drain arms and raises
    monitor.drain()
    assert monitor.armed is not None and monitor.armed.site == "kernels.rope.position"


# ---------------------------------------------------------------------------------------------- random corruptions
_bad = st.one_of(
    st.sampled_from([-1, INT32_MIN, INT32_MAX]),
    st.integers(-(2**31), -1),
    st.integers(0, 2**31 - 1),
)


@HYP
@given(data=st.data())
def test_random_corruptions(kernel_device, monitor, data):
    """Random in-range and out-of-range ids into every kernel: outputs equal the reference, counts exact."""
    dev = kernel_device
    monitor.reset()
    n_pages = data.draw(st.integers(1, 6))
    page_ids = data.draw(st.lists(st.one_of(st.integers(0, n_pages - 1), _bad), min_size=1, max_size=8))
    # paged gather
    cache = torch.randn(n_pages, 2, 3, device=dev)
    table = ids(page_ids, dev).reshape(1, -1)
    out = torch.empty(1, len(page_ids), 2, 3, device=dev)
    ctr = counters(pg.SITES, dev, monitor)
    pg.paged_gather(cache, table, out, ctr=ctr)
    ref, hits = pg.paged_gather_reference(cache, table)
    assert torch.equal(out.cpu(), ref)
    assert_hits(ctr, hits)
    # kv zero, same ids
    pool = torch.randn(n_pages, 4, device=dev) + 3
    ref, hits = kz.kv_zero_reference(pool, table[0])
    ctr = counters(kz.SITES, dev, monitor)
    kz.kv_zero(pool, table[0], ctr=ctr)
    assert torch.equal(pool.cpu(), ref)
    assert_hits(ctr, hits)
    # slot mapping: rows and positions (positions as int64, extremes of int32 and beyond); both division paths
    R, W = 3, 4
    bs = data.draw(st.sampled_from([4, 3]))
    n = data.draw(st.integers(1, 8))
    rows = data.draw(st.lists(st.one_of(st.integers(0, R - 1), _bad), min_size=n, max_size=n))
    pos = data.draw(
        st.lists(st.one_of(st.integers(0, W * bs - 1), _bad, st.integers(-(2**40), 2**40)), min_size=n, max_size=n)
    )
    btab = data.draw(st.lists(st.one_of(st.integers(0, 9), _bad), min_size=R * W, max_size=R * W))
    btab_t = ids(btab, dev).reshape(R, W)
    pos_t, rows_t = ids(pos, dev, I64), ids(rows, dev)
    slots = torch.empty(n, dtype=I64, device=dev)
    ctr = counters(sm.SITES, dev, monitor)
    sm.slot_mapping(pos_t, rows_t, btab_t, slots, bs, num_kv_blocks=10, ctr=ctr)
    ref, hits = sm.slot_mapping_reference(pos_t, rows_t, btab_t, bs, 10)
    assert torch.equal(slots.cpu(), ref)
    assert_hits(ctr[0], hits["row"])
    assert_hits(ctr[1], hits["column"])
    assert_hits(ctr[2], hits["block"])
    # block table gather over the same rows
    counts = ids(data.draw(st.lists(st.one_of(st.integers(0, W), _bad), min_size=R, max_size=R)), dev)
    bout = torch.empty(n, W, dtype=I32, device=dev)
    ctr = counters(bt.SITES, dev, monitor)
    bt.block_table_gather(btab_t, rows_t, counts, bout, ctr=ctr)
    ref, rh, ch = bt.block_table_gather_reference(btab_t, rows_t, counts)
    assert torch.equal(bout.cpu(), ref)
    assert_hits(ctr[0], rh)
    assert_hits(ctr[1], ch)


# ---------------------------------------------------------------------------------------------- controls
def test_control_unguarded_twin_reads_and_clobbers_a_neighbour(kernel_device, monitor):
    """The bug class: an id one past the end lands in the NEXT live allocation (here: the row after a view of a
    larger buffer). The twin silently reads it and zeroes it, counting nothing; the guard masks both and counts."""
    buf = torch.randn(5, 2, 3, device=kernel_device) + 10  # rows 0..3 are "the pool", row 4 is someone else's
    pool = buf[:4]
    table = ids([[1, 4]], kernel_device)
    out = torch.empty(1, 2, 2, 3, device=kernel_device)
    ctr = counters(pg.SITES, kernel_device, monitor)

    pg.paged_gather(pool, table, out, guard=False, ctr=ctr)
    assert torch.equal(out[0, 1], buf[4])  # silently read the neighbour
    assert ctr.cpu().abs().sum() == 0  # and nobody was told
    pg.paged_gather(pool, table, out, guard=True, ctr=ctr)
    assert out[0, 1].abs().sum() == 0
    assert_hits(ctr, [(1, 4)])

    neighbour = buf[4].clone()
    zctr = counters(kz.SITES, kernel_device, monitor)
    kz.kv_zero(pool, ids([4], kernel_device), guard=True, ctr=zctr)
    assert torch.equal(buf[4], neighbour)
    assert_hits(zctr, [(0, 4)])
    kz.kv_zero(pool, ids([4], kernel_device), guard=False, ctr=zctr)
    assert buf[4].abs().sum() == 0  # the twin clobbered a live neighbour
    assert_hits(zctr, [(0, 4)])  # and counted nothing more


def test_control_truncating_division_would_hide_negative_positions(kernel_device, monitor):
    """Triton's // truncates toward zero: position -1 // 4 == 0, a valid column. The kernel floors instead; this
    control shows the truncating version would map the bad token to a real slot."""
    table = ids([[3, 4]], kernel_device)
    slots = torch.zeros(1, dtype=I64, device=kernel_device)
    ctr = counters(sm.SITES, kernel_device, monitor)
    sm.slot_mapping(ids([-1], kernel_device), ids([0], kernel_device), table, slots, 4, ctr=ctr)
    truncated_col = int(-1 / 4)  # what a truncating division computes
    assert 0 <= truncated_col < 2  # would have passed the column guard
    assert slots.cpu().tolist() == [-1]
    assert_hits(ctr[1], [(0, -1)])


# ---------------------------------------------------------------------------------------------- launcher errors
def test_launcher_errors(kernel_device, monitor):
    dev = kernel_device
    table = torch.zeros(3, 4, dtype=I32, device=dev)
    counts = torch.zeros(3, dtype=I32, device=dev)
    rows = torch.zeros(2, dtype=I32, device=dev)
    out = torch.zeros(2, 4, dtype=I32, device=dev)
    ctr = counters(bt.SITES, dev, monitor)
    with pytest.raises(TypeError, match="req_rows must have dtype int32 or int64"):
        bt.block_table_gather(table, rows.float(), counts, out, ctr=ctr)
    with pytest.raises(ValueError, match=r"out must have shape \[2, 4\]"):
        bt.block_table_gather(table, rows, counts, out[:, :3].contiguous(), ctr=ctr)
    with pytest.raises(ValueError, match="block_table must be contiguous"):
        bt.block_table_gather(torch.zeros(4, 3, dtype=I32, device=dev).t(), rows, counts, out, ctr=ctr)
    with pytest.raises(TypeError, match="out must have dtype int32"):
        bt.block_table_gather(table, rows, counts, out.long(), ctr=ctr)
    with pytest.raises(ValueError, match=r"ctr must have shape \[2, 8\]"):
        bt.block_table_gather(table, rows, counts, out, ctr=ctr[0])
    with pytest.raises(TypeError, match="ctr must have dtype int64"):
        bt.block_table_gather(table, rows, counts, out, ctr=ctr.int())
    with pytest.raises(TypeError, match=r"block_table must be a torch\.Tensor"):
        bt.block_table_gather([[0]], rows, counts, out, ctr=ctr)
    slots = torch.zeros(2, dtype=I64, device=dev)
    sctr = counters(sm.SITES, dev, monitor)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        sm.slot_mapping(rows, rows, table, slots, 0, ctr=sctr)
    with pytest.raises(TypeError, match="block_size must be an int"):
        sm.slot_mapping(rows, rows, table, slots, 4.0, ctr=sctr)
    with pytest.raises(TypeError, match="slots must have dtype int64"):
        sm.slot_mapping(rows, rows, table, slots.int(), 4, ctr=sctr)
    q = torch.zeros(2, 1, 5, device=dev)
    with pytest.raises(ValueError, match="head size of q must be even"):
        rp.rope(rows, q, q, torch.zeros(3, 5, device=dev), q, q, ctr=counters(rp.SITES, dev, monitor))
    with pytest.raises(ValueError, match="k_out must have shape"):
        q = torch.zeros(2, 1, 4, device=dev)
        rp.rope(
            rows,
            q,
            q,
            torch.zeros(3, 4, device=dev),
            q,
            torch.zeros(2, 2, 4, device=dev),
            ctr=counters(rp.SITES, dev, monitor),
        )
    with pytest.raises(ValueError, match=r"out must have shape \[1, 2, 3\]"):
        pg.paged_gather(
            torch.zeros(4, 3, device=dev),
            rows.reshape(1, 2),
            torch.zeros(1, 2, 4, device=dev),
            ctr=counters(pg.SITES, dev, monitor),
        )
    with pytest.raises(ValueError, match="dst_cols must have shape"):
        sc.state_copy(torch.zeros(4, 3, device=dev), table, rows, rows, rows[:1], ctr=counters(sc.SITES, dev, monitor))


def test_launcher_refuses_counter_on_another_device(kernel_device, monitor):
    if kernel_device == "cpu":
        # meta tensors stand in for "another device" without a GPU
        ctr = torch.zeros(8, dtype=I64, device="meta")
    else:
        ctr = torch.zeros(8, dtype=I64)
    pool = torch.zeros(4, 3, device=kernel_device)
    with pytest.raises(ValueError, match="ctr \\(the counter rows\\) is on"):
        kz.kv_zero(pool, ids([0], kernel_device), ctr=ctr)
    with pytest.raises(ValueError, match="block_ids is on"):
        kz.kv_zero(pool, torch.zeros(1, dtype=I32, device="meta"), ctr=counters(kz.SITES, kernel_device, monitor))


def test_counters_need_adjacent_rows(registry, monitor):
    registry.register("something.else")
    registry.register(sm.SITE_ROW.name, description=sm.SITE_ROW.description)
    registry.register("in.between")
    with pytest.raises(ValueError, match="adjacent"):
        counters(sm.SITES, "cpu", monitor)


def test_default_counter_path(kernel_device):
    """ctr=None records into the default monitor's rows of the module's sites."""
    import tripwire

    tripwire.reset()
    pool = torch.zeros(3, 2, device=kernel_device)
    kz.kv_zero(pool, ids([0, 3, -2], kernel_device))
    snap = tripwire.snapshot()
    hit = snap[
        (
            str(torch.device(kernel_device) if kernel_device == "cpu" else torch.device("cuda", 0)),
            "kernels.kv_zero.block",
        )
    ]
    assert (hit.count, hit.min_value, hit.max_value) == (2, -2, 3)
    tripwire.reset()


def test_sites_registered_at_import():
    import tripwire
    from tripwire import kernels

    names = {s.name for s in tripwire.sites()}
    for s in kernels.ALL_SITES:
        assert s.name in names
    assert [s.name for s in kernels.ALL_SITES if s.fatal] == ["kernels.rope.position"]
    assert len(kernels.ALL_SITES) == 13


# ---------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
def test_graph_replay_counts_exactly_n_times(monitor):
    """A captured guarded kernel replayed N times counts exactly N x the bad entries."""
    dev = "cuda"
    cache = torch.randn(8, 2, 16, device=dev)
    table = ids([[0, 8, -1, 3], [INT32_MAX, 2, 1, 9]], dev)
    out = torch.empty(2, 4, 2, 16, device=dev)
    monitor.prealloc(dev)
    ctr = counters(pg.SITES, dev, monitor)
    pg.paged_gather(cache, table, out, ctr=ctr)  # compile outside the capture
    torch.cuda.synchronize()
    monitor.reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pg.paged_gather(cache, table, out, ctr=ctr)
    torch.cuda.synchronize()
    assert ctr.cpu()[0] == 0  # capture does not execute
    n = 50
    for _ in range(n):
        g.replay()
    torch.cuda.synchronize()
    assert ctr.cpu()[0] == n * 4
    ref, _ = pg.paged_gather_reference(cache, table)
    assert torch.equal(out.cpu(), ref)
