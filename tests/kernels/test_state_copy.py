"""The recurrent-state copy (`tripwire.kernels.state_copy`) against torch/Python references: in-range metadata (identical outputs, zero counts, the
unguarded twin identical) and corrupted metadata (masked outputs, exact counts, exact first offender and extremes)."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import INT32_MAX, INT32_MIN, assert_hits, ids, sc_inputs
from tripwire.kernels import counters
from tripwire.kernels import state_copy as sc


@pytest.mark.parametrize("guard", [True, False])
def test_state_copy_in_range(kernel_device, monitor, guard):
    state, table = sc_inputs(kernel_device)
    rows, src, dst = ids([0, 2, 3], kernel_device), ids([0, 1, 0], kernel_device), ids([1, 0, 1], kernel_device)
    ref, hits = sc.state_copy_reference(state, table, rows, src, dst)
    ctr = counters(sc.SITES, kernel_device, monitor)
    sc.state_copy(state, table, rows, src, dst, guard=guard, ctr=ctr)
    assert hits == {"row": [], "column": [], "slot": []}
    assert torch.equal(state.cpu(), ref)
    assert ctr[..., :7].cpu().abs().sum() == 0  # slot 7 is layout (the offender block)


def test_state_copy_corrupted(kernel_device, monitor):
    state, table = sc_inputs(kernel_device)
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
