"""count_clipped (tripwire.numerics.clip_count): one launch's counts and maxima equal ClipCounter.count's torch
path exactly (values planted just above and just below the ceiling, padding slots and padded tokens left out), 0 on
healthy input; the control counts the padding too when the slot mapping is not given as padding."""

from __future__ import annotations

import pytest
import torch

from tripwire.numerics import ClipCounter
from tripwire.numerics.clip_count import count_clipped


def kv(device: str, tokens: int = 9, heads: int = 3, dim: int = 20, big: bool = True):
    g = torch.Generator().manual_seed(3)
    k = torch.randn(tokens, heads, dim, generator=g) * 50
    v = torch.randn(tokens, heads, dim, generator=g) * 50
    if big:
        k[1, 0, 3] = 448.0 * 0.5 + 1  # just above the ceiling at scale 0.5 (bf16 steps by 1 there)
        k[2, 1, 0] = 448.0 * 0.5  # at it: not clipped
        v[4, 2, 7] = -1e4
        k[7, 0, 0] = 1e5  # a token the slot mapping pads (-1): not counted
        k[8, 0, 0] = 1e6  # past the slot mapping's length: not counted
    return k.to(torch.bfloat16).float().to(device), v.to(torch.bfloat16).float().to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_the_torch_path(monitor, kernel_device, dtype):
    k, v = (t.to(dtype) for t in kv(kernel_device))
    slots = torch.tensor([5, 6, 7, 8, 9, 10, 11, -1], device=kernel_device)
    ks = torch.tensor([0.5], device=kernel_device)
    vs = torch.tensor([4.0], device=kernel_device)
    a = ClipCounter("layer.a", kernel_device, monitor=monitor)
    b = ClipCounter("layer.b", kernel_device, monitor=monitor)
    count_clipped(a, k, v, ks, vs, slots)
    b.count(k[:8], v[:8], ks, vs, slots)
    ta, tb = a.totals(), b.totals()
    assert ta == tb and ta["k"] >= 1 and ta["v"] >= 1, (ta, tb)
    assert ta["k_max"] < 1e5  # the padded tokens' values are not the max


def test_healthy_counts_nothing(monitor, kernel_device):
    k, v = kv(kernel_device, big=False)
    c = ClipCounter("layer.c", kernel_device, monitor=monitor)
    one = torch.ones(1, device=kernel_device)
    count_clipped(c, k, v, one, one, torch.arange(9, device=kernel_device))
    t = c.totals()
    assert t["k"] == 0 and t["v"] == 0 and 0 < t["k_max"] < 448


def test_padding_control(monitor, kernel_device):
    """Control: the same write with the padded token's slot made real counts it (the slot test is what leaves it
    out)."""
    k, v = kv(kernel_device)
    ks = torch.tensor([0.5], device=kernel_device)
    counts = []
    for pad in (-1, 12):
        c = ClipCounter(f"layer.p{pad}", kernel_device, monitor=monitor)
        slots = torch.tensor([5, 6, 7, 8, 9, 10, 11, pad], device=kernel_device)
        count_clipped(c, k, v, ks, ks, slots)
        counts.append(c.totals()["k"])
    assert counts[1] == counts[0] + 1


def test_bad_input_is_named(monitor, kernel_device):
    c = ClipCounter("layer.bad", kernel_device, monitor=monitor)
    k, v = kv(kernel_device)
    one = torch.ones(1, device=kernel_device)
    with pytest.raises(ValueError, match="k_scale"):
        count_clipped(c, k, v, torch.ones(3, device=kernel_device), one, torch.arange(3, device=kernel_device))
    with pytest.raises(ValueError, match="contiguous per token"):
        count_clipped(c, k.transpose(1, 2), v, one, one, torch.arange(3, device=kernel_device))


def test_the_max_is_the_largest_over_calls(monitor, kernel_device):
    """Over a rising, a falling and a rising-again sequence of writes the max word equals the torch path's, call by
    call (a max that a later, smaller write lowered, or that a larger one failed to raise, differs)."""
    a = ClipCounter("layer.m1", kernel_device, monitor=monitor)
    b = ClipCounter("layer.m2", kernel_device, monitor=monitor)
    one = torch.ones(1, device=kernel_device)
    slots = torch.arange(4, device=kernel_device)
    seen = []
    for top in (3.0, 1.5, 7.25, 7.0, 9.5):
        k = torch.full((4, 2, 8), top / 2, device=kernel_device)
        k[1, 1, 3] = top
        v = -k
        count_clipped(a, k, v, one, one, slots)
        b.count(k, v, one, one, slots)
        ta, tb = a.totals(), b.totals()
        assert ta == tb, (top, ta, tb)
        seen.append(ta["k_max"])
    assert seen == [3.0, 3.0, 7.25, 7.25, 9.5]


def test_the_widest_token_raises_both_maxima(monitor, kernel_device):
    """A token of 2**15 K/V elements (the widest the counter takes: one program holds it) all above the row's stored
    maximum fills each 'above' field to 2**15; the V field then reaches the packed sum's sign bit, and the max is
    raised for V as for K. Control: read without its mask, that field is negative (the max would be skipped). One
    element wider is refused, naming the limit."""
    k = torch.full((1, 256, 128), 3.0, device=kernel_device)
    v = torch.full((1, 256, 128), 5.0, device=kernel_device)
    one = torch.ones(1, device=kernel_device)
    c = ClipCounter("layer.wide", kernel_device, monitor=monitor)
    count_clipped(c, k, v, one, one, torch.zeros(1, dtype=torch.int64, device=kernel_device))
    t = c.totals()
    assert (t["k"], t["v"], t["k_max"], t["v_max"]) == (0, 0, 3.0, 5.0)
    packed = torch.tensor([1 << 15], dtype=torch.int64) << 48
    assert int(packed >> 48) < 0 and int((packed >> 48) & 0xFFFF) == 1 << 15  # the control: unmasked, negative
    wide = torch.zeros(1, 32769, 1, device=kernel_device)
    with pytest.raises(ValueError, match="past this counter's 32768"):
        count_clipped(c, wide, wide, one, one, torch.zeros(1, dtype=torch.int64, device=kernel_device))
