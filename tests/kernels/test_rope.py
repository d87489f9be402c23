"""The rope (`tripwire.kernels.rope`, the fatal site) against torch/Python references: in-range metadata (identical outputs, zero counts, the
unguarded twin identical) and corrupted metadata (masked outputs, exact counts, exact first offender and extremes)."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import I64, INT32_MAX, INT32_MIN, assert_hits, ids, rope_inputs
from tripwire.kernels import counters
from tripwire.kernels import rope as rp


@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_range(kernel_device, monitor, guard, dtype):
    q, k, cs = rope_inputs(kernel_device, dtype)
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
    assert ctr[..., :7].cpu().abs().sum() == 0  # slot 7 is layout (the offender block)


def test_rope_in_place(kernel_device, monitor):
    q, k, cs = rope_inputs(kernel_device, torch.float32)
    pos = ids([0, 9, 3, 3, 5, 1], kernel_device)
    rq, rk, _ = rp.rope_reference(pos, q, k, cs)
    rp.rope(pos, q, k, cs, q, k, ctr=counters(rp.SITES, kernel_device, monitor))
    torch.testing.assert_close(q.cpu(), rq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k.cpu(), rk, rtol=1e-6, atol=1e-6)


def test_rope_corrupted_is_fatal_and_zeroes(kernel_device, monitor):
    assert rp.SITE.fatal
    q, k, cs = rope_inputs(kernel_device, torch.float32)
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
