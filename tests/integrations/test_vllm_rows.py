"""tripwire.integrations.vllm._rows: the guard of vLLM V2's idx_mapping (rows) and the fence after prepare_attn,
against a torch reference, counters and offenders exactly. Compiled on a GPU, under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from tripwire.integrations.vllm import _rows

MAX_REQS, WIDTH, TOKENS = 16, 6, 64


def _step(rng: random.Random, device: str, bad_rows: set[int], n: int):
    idx = torch.tensor(rng.sample(range(MAX_REQS), n), dtype=torch.int32, device=device)
    values = {}
    for b in bad_rows:
        v = rng.choice((-1, -7, MAX_REQS, MAX_REQS + 3, 1 << 30))
        idx[b] = v
        values[b] = v
    per = [rng.randint(1, 4) for _ in range(n)]
    qsl = torch.tensor([0, *torch.tensor(per).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return idx, qsl, values


@pytest.mark.parametrize("mask", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_rows_and_fence_match_the_reference(kernel_device, monitor, hit_of, mask, seed):
    """Each bad idx_mapping entry counts once at the site with its batch row, value and request; under mask it is
    rewritten to the scratch row and its row fenced (gathered table zeroed, its tokens' slots PAD, count 0); every
    other row keeps its table and slots and gets its state row's block count. Under flag nothing is rewritten."""
    rng = random.Random(seed)
    dev = kernel_device
    n = rng.randint(1, MAX_REQS - 1)
    bad = set(rng.sample(range(n), rng.randint(0, min(3, n))))
    idx, qsl, values = _step(rng, dev, bad, n)
    site = monitor.registry.register("test.idx_mapping")
    ctr = monitor.counter(site, dev)
    flags = torch.full((MAX_REQS,), 7, dtype=torch.int32, device=dev)
    req = torch.arange(100, 100 + MAX_REQS, dtype=torch.int64, device=dev)
    scratch = MAX_REQS - 1
    before = idx.clone()
    _rows.rows(idx, flags, req, ctr, MAX_REQS, scratch, True, mask=mask)
    want_idx = before.clone()
    if mask:
        for b in bad:
            want_idx[b] = scratch
    assert torch.equal(idx, want_idx)
    assert flags[:n].tolist() == [int(b in bad) for b in range(n)]
    hit = hit_of(monitor, "test.idx_mapping")
    if not bad:
        assert hit is None
    else:
        assert hit.count == len(bad)
        assert sorted((o.row, o.value, o.request) for o in hit.offenders) == sorted(
            (b, values[b], 100 + b) for b in bad
        )
    num_blocks = torch.tensor([rng.randint(0, WIDTH) for _ in range(MAX_REQS)], dtype=torch.int32, device=dev)
    table = torch.randint(1, 50, (MAX_REQS, WIDTH), dtype=torch.int32, device=dev)
    slots = torch.randint(0, 800, (TOKENS,), dtype=torch.int64, device=dev)
    counts = torch.full((MAX_REQS,), -9, dtype=torch.int32, device=dev)
    t0, s0 = table.clone(), slots.clone()
    _rows.fence(flags, idx[:n], qsl, num_blocks, counts, table, slots, mask=mask)
    for b in range(n):
        lo, hi = int(qsl[b]), int(qsl[b + 1])
        if b in bad:
            assert int(counts[b]) == 0
            if mask:
                assert table[b].tolist() == [0] * WIDTH and slots[lo:hi].tolist() == [-1] * (hi - lo)
            else:
                assert torch.equal(table[b], t0[b]) and torch.equal(slots[lo:hi], s0[lo:hi])
        else:
            assert int(counts[b]) == int(num_blocks[int(idx[b])])
            assert torch.equal(table[b], t0[b]) and torch.equal(slots[lo:hi], s0[lo:hi])
    assert torch.equal(table[n:], t0[n:]) and torch.equal(slots[int(qsl[n]) :], s0[int(qsl[n]) :])


def test_unattributed_when_no_row_is_free(kernel_device, monitor, hit_of):
    """No scratch row free: the hit names no request (the verdict fails the step closed). Control: attributed, the
    same hit names the batch row's request."""
    dev = kernel_device
    site = monitor.registry.register("test.idx_mapping")
    ctr = monitor.counter(site, dev)
    req = torch.arange(100, 100 + MAX_REQS, dtype=torch.int64, device=dev)
    flags = torch.zeros(MAX_REQS, dtype=torch.int32, device=dev)
    for attributed, want in ((False, None), (True, 101)):
        monitor.reset()
        idx = torch.tensor([3, MAX_REQS + 5, 4], dtype=torch.int32, device=dev)
        _rows.rows(idx, flags, req, ctr, MAX_REQS, 3, attributed, mask=True)
        hit = hit_of(monitor, "test.idx_mapping")
        assert hit.count == 1 and [(o.row, o.value, o.request) for o in hit.offenders] == [(1, MAX_REQS + 5, want)]
        assert idx.tolist() == [3, 3, 4]


def test_bad_arguments_are_refused(kernel_device, monitor):
    dev = kernel_device
    ctr = monitor.counter(monitor.registry.register("test.idx_mapping"), dev)
    idx = torch.zeros(4, dtype=torch.int32, device=dev)
    small = torch.zeros(2, dtype=torch.int32, device=dev)
    req = torch.zeros(4, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="flags of 2"):
        _rows.rows(idx, small, req, ctr, MAX_REQS, 0, True, mask=True)
    with pytest.raises(ValueError, match="scratch row 16 of 16"):
        _rows.rows(idx, idx.clone(), req, ctr, MAX_REQS, MAX_REQS, True, mask=True)


def test_many_rows_span_several_blocks(kernel_device, monitor, hit_of):
    """A step of 300 rows (more than one block of the guard's loop): each bad entry, in every block, counted once."""
    dev = kernel_device
    n, bound = 300, 512
    idx = torch.arange(n, dtype=torch.int64, device=dev)
    bad = [0, 127, 128, 255, 299]
    for b in bad:
        idx[b] = bound + b
    site = monitor.registry.register("test.idx_mapping")
    flags = torch.zeros(n, dtype=torch.int32, device=dev)
    req = torch.arange(n, dtype=torch.int64, device=dev)
    _rows.rows(idx, flags, req, monitor.counter(site, dev), bound, 400, True, mask=True)
    assert hit_of(monitor, "test.idx_mapping").count == len(bad)
    assert torch.nonzero(flags).flatten().tolist() == bad
    assert [int(idx[b]) for b in bad] == [400] * len(bad)


def test_the_scratch_rows_token_count_is_zeroed_only_when_it_is_free(kernel_device, monitor):
    """Masked to a free scratch row, that row's token count (V2's ``total_len``, where ``post_update`` appends the
    victim's token) is zeroed: a count left at the row's end by its last owner would write into the next row.
    Control: with no free row (the hit unattributed, the row a live one of the step), the count is left alone; and
    with no bad entry nothing is written."""
    dev = kernel_device
    ctr = monitor.counter(monitor.registry.register("test.idx_mapping"), dev)
    flags = torch.zeros(MAX_REQS, dtype=torch.int32, device=dev)
    req = torch.arange(MAX_REQS, dtype=torch.int64, device=dev)
    for attributed, bad, want in ((True, True, 0), (False, True, 128), (True, False, 128)):
        total = torch.full((MAX_REQS,), 128, dtype=torch.int32, device=dev)
        idx = torch.tensor([2, MAX_REQS + 1 if bad else 3, 4], dtype=torch.int32, device=dev)
        _rows.rows(idx, flags, req, ctr, MAX_REQS, 9, attributed, mask=True, total_len=total)
        assert int(total[9]) == want, (attributed, bad)
        assert int(total.sum()) == 128 * MAX_REQS - (128 - want)
