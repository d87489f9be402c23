"""The block-table gather (`tripwire.kernels.block_table`) against torch/Python references: in-range metadata (identical outputs, zero counts, the
unguarded twin identical) and corrupted metadata (masked outputs, exact counts, exact first offender and extremes)."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import I32, INT32_MAX, INT32_MIN, assert_hits, bt_inputs, ids
from tripwire.kernels import block_table as bt
from tripwire.kernels import counters


@pytest.mark.parametrize("guard", [True, False])
def test_block_table_in_range(kernel_device, monitor, guard):
    table, counts = bt_inputs(kernel_device)
    rows = ids([4, 0, 2, 1, 3, 0], kernel_device)
    out = torch.full((6, 6), -9, dtype=I32, device=kernel_device)
    ctr = counters(bt.SITES, kernel_device, monitor)
    bt.block_table_gather(table, rows, counts, out, guard=guard, ctr=ctr)
    ref, rh, ch = bt.block_table_gather_reference(table, rows, counts)
    assert rh == [] and ch == []
    assert torch.equal(out.cpu(), ref)
    assert ctr[..., :7].cpu().abs().sum() == 0  # slot 7 is layout (the offender block)


def test_block_table_corrupted(kernel_device, monitor):
    table, counts = bt_inputs(kernel_device)
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
