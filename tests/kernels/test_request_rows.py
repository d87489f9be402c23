"""tripwire.kernels.request_rows: the guard of a batch-row -> request-state-row map (guard_rows) and the fence after
the metadata kernels (fence_rows), against a torch reference, counters and offenders exactly. Compiled on a GPU,
under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from tripwire.kernels import request_rows

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
def test_guard_and_fence_match_the_reference(kernel_device, monitor, hit_of, mask, seed):
    """Each bad map entry counts once at the site with its batch row, value and request; under mask it is
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
    request_rows.guard_rows(idx, flags, req, ctr, MAX_REQS, scratch, mask=mask)
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
    request_rows.fence_rows(flags, idx[:n], qsl, num_blocks, counts, table, slots, mask=mask)
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
        request_rows.guard_rows(idx, flags, req, ctr, MAX_REQS, 3, scratch_free=attributed)
        hit = hit_of(monitor, "test.idx_mapping")
        assert hit.count == 1 and [(o.row, o.value, o.request) for o in hit.offenders] == [(1, MAX_REQS + 5, want)]
        assert idx.tolist() == [3, 3, 4]


def test_bad_arguments_are_refused(kernel_device, monitor):
    """Each launcher refuses, naming it, an argument it would read or write out of bounds (or at the wrong width).
    Control: the same calls with every argument right launch."""
    dev = kernel_device
    ctr = monitor.counter(monitor.registry.register("test.idx_mapping"), dev)
    i32 = dict(dtype=torch.int32, device=dev)
    idx = torch.zeros(4, **i32)
    flags = torch.zeros(4, **i32)
    req = torch.zeros(4, dtype=torch.int64, device=dev)
    total = torch.zeros(MAX_REQS, **i32)
    guard = dict(rows=idx, flags=flags, requests=req, ctr=ctr, num_state_rows=MAX_REQS, scratch=0)
    for change, error, match in (
        ({"flags": torch.zeros(2, **i32)}, ValueError, "flags has 2 entries, fewer than the 4 batch rows"),
        ({"requests": req[:3]}, ValueError, "requests has 3 entries, fewer than the 4 batch rows"),
        ({"scratch": MAX_REQS}, ValueError, "scratch row 16 is not one of the 16 state rows"),
        ({"num_state_rows": 0}, ValueError, "num_state_rows must be >= 1"),
        ({"rows": idx.float()}, TypeError, "rows must have dtype int32 or int64, got float32"),
        ({"flags": flags.long()}, TypeError, "flags must have dtype int32, got int64"),
        ({"ctr": ctr[:4]}, ValueError, r"ctr must have shape \[8\]"),
        ({"total_len": total[:8]}, ValueError, "total_len has 8 entries, fewer than the 16 state rows"),
        ({"rows": idx[0]}, ValueError, r"rows must be 1-D, got shape \(\)"),
    ):
        with pytest.raises(error, match=match):
            request_rows.guard_rows(**{**guard, **change})
    request_rows.guard_rows(**guard, total_len=total)  # control
    table = torch.zeros(MAX_REQS, WIDTH, **i32)
    fence = dict(flags=flags, rows=idx, query_start_loc=torch.arange(5, **i32), num_blocks=torch.zeros(MAX_REQS, **i32),
                 counts=torch.zeros(4, **i32), table=table, slots=torch.zeros(TOKENS, dtype=torch.int64, device=dev))  # fmt: skip
    for change, error, match in (
        ({"query_start_loc": torch.arange(4, **i32)}, ValueError, "query_start_loc has 4 entries, fewer than the 5"),
        ({"counts": torch.zeros(3, **i32)}, ValueError, "counts has 3 entries, fewer than the 4 batch rows"),
        ({"table": table[:3]}, ValueError, "table has 3 entries, fewer than the 4 batch rows"),
        ({"table": table[:, :3]}, ValueError, "table must be contiguous"),
        ({"table": table.long()}, TypeError, "table must have dtype int32, got int64"),
        ({"slots": torch.zeros(TOKENS, **i32)}, TypeError, "slots must have dtype int64, got int32"),
        ({"rows": idx[0]}, ValueError, r"rows must be 1-D, got shape \(\)"),
    ):
        with pytest.raises(error, match=match):
            request_rows.fence_rows(**{**fence, **change})
    request_rows.fence_rows(**fence)  # control


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
    request_rows.guard_rows(idx, flags, req, monitor.counter(site, dev), bound, 400)
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
        request_rows.guard_rows(idx, flags, req, ctr, MAX_REQS, 9, scratch_free=attributed, total_len=total)
        assert int(total[9]) == want, (attributed, bad)
        assert int(total.sum()) == 128 * MAX_REQS - (128 - want)
