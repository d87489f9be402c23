"""The KV-block zeroing (`tripwire.kernels.kv_zero`) against torch/Python references: in-range metadata (identical outputs, zero counts, the
unguarded twin identical) and corrupted metadata (masked outputs, exact counts, exact first offender and extremes)."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import INT32_MAX, INT32_MIN, assert_hits, ids
from tripwire.kernels import counters
from tripwire.kernels import kv_zero as kz


@pytest.mark.parametrize("guard", [True, False])
def test_kv_zero_in_range(kernel_device, monitor, guard):
    pool = torch.randn(6, 2, 3, 5, device=kernel_device) + 10
    block_ids = ids([5, 0, 3, 3], kernel_device)
    ref, hits = kz.kv_zero_reference(pool, block_ids)
    ctr = counters(kz.SITES, kernel_device, monitor)
    kz.kv_zero(pool, block_ids, guard=guard, ctr=ctr)
    assert hits == [] and torch.equal(pool.cpu(), ref)
    assert ctr[..., :7].cpu().abs().sum() == 0  # slot 7 is layout (the offender block)


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
