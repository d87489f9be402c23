"""The paged KV gather (`tripwire.kernels.paged_gather`) against torch/Python references: in-range metadata (identical outputs, zero counts, the
unguarded twin identical) and corrupted metadata (masked outputs, exact counts, exact first offender and extremes)."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import I64, INT32_MAX, INT32_MIN, assert_hits, ids
from tripwire.kernels import counters
from tripwire.kernels import paged_gather as pg


@pytest.mark.parametrize("guard", [True, False])
def test_paged_gather_in_range(kernel_device, monitor, guard):
    cache = torch.randn(7, 2, 4, 3, device=kernel_device).to(torch.bfloat16)
    table = ids([[0, 6, 2], [3, 3, 1]], kernel_device, I64)
    out = torch.full((2, 3, 2, 4, 3), 9.0, dtype=torch.bfloat16, device=kernel_device)
    ctr = counters(pg.SITES, kernel_device, monitor)
    pg.paged_gather(cache, table, out, guard=guard, ctr=ctr)
    ref, hits = pg.paged_gather_reference(cache, table)
    assert hits == [] and torch.equal(out.cpu(), ref)
    assert ctr[..., :7].cpu().abs().sum() == 0  # slot 7 is layout (the offender block)


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
