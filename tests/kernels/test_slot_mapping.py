"""The slot mapping (`tripwire.kernels.slot_mapping`) against torch/Python references: in-range metadata (identical outputs, zero counts, the
unguarded twin identical) and corrupted metadata (masked outputs, exact counts, exact first offender and extremes)."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import I32, I64, INT32_MAX, INT32_MIN, assert_hits, ids
from tripwire.kernels import counters
from tripwire.kernels import slot_mapping as sm


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
    assert ctr[..., :7].cpu().abs().sum() == 0  # slot 7 is layout (the offender block)


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
    assert ctr[..., :7].cpu().abs().sum() == 0  # slot 7 is layout (the offender block)


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


# Both launch shapes: an engine step's (one warp per program, 32 tokens each) and past it (1024 tokens per program
# over 8 warps); bad tokens in several programs, the last one partial.
@pytest.mark.parametrize("tokens", [200, sm._SMALL_T + 1000])
@pytest.mark.parametrize("pos_dtype", [I32, I64])
def test_slot_mapping_both_launch_shapes(kernel_device, monitor, tokens, pos_dtype):
    R, W, bs = 8, 16, 16
    g = torch.Generator().manual_seed(tokens)
    table = torch.randperm(R * W * 2, generator=g)[: R * W].reshape(R, W).to(I32)
    rows = torch.randint(0, R, (tokens,), generator=g, dtype=I32)
    pos = torch.randint(0, W * bs, (tokens,), generator=g).to(pos_dtype)
    last = tokens - 1
    rows[[3, 40, last]] = torch.tensor([R, -1, INT32_MIN], dtype=I32)  # row site
    pos[[5, 70, last - 1]] = torch.tensor([W * bs, -1, INT32_MAX], dtype=pos_dtype)  # column site
    table[rows[100], pos[100] // bs] = R * W * 2  # block site: a block id past the pool (other tokens may share it)
    slots = torch.zeros(tokens, dtype=I64, device=kernel_device)
    ctr = counters(sm.SITES, kernel_device, monitor)
    args = [x.to(kernel_device) for x in (pos, rows, table)]
    sm.slot_mapping(*args, slots, bs, num_kv_blocks=R * W * 2, ctr=ctr)
    ref, hits = sm.slot_mapping_reference(pos, rows, table, bs, R * W * 2)
    assert len(hits["row"]) == 3 and len(hits["column"]) == 3 and hits["block"]
    assert torch.equal(slots.cpu(), ref)
    assert_hits(ctr[0], hits["row"])
    assert_hits(ctr[1], hits["column"])
    assert_hits(ctr[2], hits["block"])


def test_slot_mapping_block_limit_past_int32(kernel_device, monitor):
    """An int32 table checked against a pool of 2**31 blocks or more: every non-negative id is in range, INT32_MAX
    included (the 32-bit compare saturates the pool size at 2**31, not below it). The control: a pool of INT32_MAX
    blocks, where INT32_MAX is one past the end and counts."""
    table = ids([[INT32_MAX, 3]], kernel_device)
    slots = torch.zeros(2, dtype=I64, device=kernel_device)
    args = (ids([0, 4], kernel_device), ids([0, 0], kernel_device), table, slots, 4)
    ctr = counters(sm.SITES, kernel_device, monitor)
    sm.slot_mapping(*args, num_kv_blocks=2**32, ctr=ctr)
    assert slots.cpu().tolist() == [INT32_MAX * 4, 12]
    assert_hits(ctr[2], [])
    sm.slot_mapping(*args, num_kv_blocks=INT32_MAX, ctr=ctr)
    assert slots.cpu().tolist() == [-1, 12]
    assert_hits(ctr[2], [(0, INT32_MAX)])


@pytest.mark.parametrize("table_dtype", [I32, I64])
@pytest.mark.parametrize("pos_dtype", [I32, I64])
def test_slot_mapping_sizes_past_32_bits(kernel_device, monitor, table_dtype, pos_dtype):
    """A block of 2**32 tokens (a shift past an int32 position's width: the column is formed in 64 bits) and a pool
    of 2**31 + 5 blocks (past int32: compared in 64 bits against an int64 table, saturated against an int32 one):
    the slots and the counts are the reference's."""
    table = ids([[1, 2]], kernel_device, table_dtype)
    pos, rows = ids([0, 5, -1], kernel_device, pos_dtype), ids([0, 0, 0], kernel_device)
    slots = torch.zeros(3, dtype=I64, device=kernel_device)
    ctr = counters(sm.SITES, kernel_device, monitor)
    sm.slot_mapping(pos, rows, table, slots, 2**32, num_kv_blocks=2**31 + 5, ctr=ctr)
    ref, hits = sm.slot_mapping_reference(pos, rows, table, 2**32, 2**31 + 5)
    assert slots.cpu().tolist() == ref.tolist() == [2**32, 2**32 + 5, -1]
    assert hits["column"] == [(2, -1)]
    assert_hits(ctr[1], hits["column"])
    assert_hits(ctr[2], [])


def test_slot_mapping_refuses_sizes_past_int64(kernel_device, monitor):
    """A size Triton would pass as uint64 (2**63 or more) is refused by name; the control: 2**63 - 1 is taken."""
    table = ids([[1, 2]], kernel_device)
    args = (
        ids([0, 5], kernel_device),
        ids([0, 0], kernel_device),
        table,
        torch.zeros(2, dtype=I64, device=kernel_device),
    )
    ctr = counters(sm.SITES, kernel_device, monitor)
    with pytest.raises(ValueError, match="num_kv_blocks must fit in an int64"):
        sm.slot_mapping(*args, 16, num_kv_blocks=2**63, ctr=ctr)
    with pytest.raises(ValueError, match="block_size must fit in an int64"):
        sm.slot_mapping(*args, 2**64, ctr=ctr)
    sm.slot_mapping(*args, 16, num_kv_blocks=2**63 - 1, ctr=ctr)
    assert args[3].cpu().tolist() == [16, 21]
    assert_hits(ctr[2], [])


@pytest.mark.parametrize("with_requests", [True, False])
def test_slot_mapping_step_records_every_bad_token(kernel_device, monitor, hit_of, with_requests):
    """An engine step's launch (one token per thread, where each bad token records itself on the GPU:
    tripwire.triton.record_lanes) with many bad tokens per program, at every site and in the last, partial program:
    counts and extremes exact, the first pair and every kept offender real ones (with the token's request), as many
    offenders kept as the block holds, and all of them done. The control: the same launch with the row site's
    bad tokens made good counts none there."""
    R, W, bs, tokens = 6, 8, 16, 100
    g = torch.Generator().manual_seed(7)
    table = torch.randperm(R * W, generator=g).reshape(R, W).to(I32)
    rows = torch.randint(0, R, (tokens,), generator=g, dtype=I32)
    pos = torch.randint(0, W * bs, (tokens,), generator=g, dtype=I64)
    bad_rows = list(range(0, tokens, 7))  # 15 tokens, in every program, the last included
    bad_cols = list(range(3, tokens, 11))
    rows[bad_rows] = torch.tensor([R + (t % 3) if t % 2 else -1 - t for t in bad_rows], dtype=I32)
    pos[bad_cols] = torch.tensor([W * bs + t if t % 2 else -t - 1 for t in bad_cols], dtype=I64)
    table[1, 2] = R * W + 5  # a block id past the pool: every token that reads (1, 2)
    rows[[50, 61, 99]] = 1
    pos[[50, 61, 99]] = 2 * bs + 3
    requests = torch.arange(tokens, dtype=I64) * 10 - 5 if with_requests else None
    slots = torch.zeros(tokens, dtype=I64, device=kernel_device)
    ctr = counters(sm.SITES, kernel_device, monitor)

    def run(rows):
        args = [x.to(kernel_device) for x in (pos, rows, table)]
        req = None if requests is None else requests.to(kernel_device)
        sm.slot_mapping(*args, slots, bs, num_kv_blocks=R * W, ctr=ctr, requests=req)

    run(rows)
    ref, hits = sm.slot_mapping_reference(pos, rows, table, bs, R * W)
    assert torch.equal(slots.cpu(), ref)
    k = monitor.offenders
    for i, site in enumerate(sm.SITES):
        name = site.name.rsplit(".", 1)[1]
        want = hits[name]
        assert want, name
        assert_hits(ctr[i], want)
        hit = hit_of(monitor, site.name)
        req = {t: (None if requests is None or requests[t] < 0 else int(requests[t])) for t, _ in want}
        kept = [tuple(o) for o in hit.offenders]
        assert len(kept) == min(k, len(want)), (name, kept)
        assert set(kept) <= {(t, v, req[t]) for t, v in want}, (name, kept)
    # The control: the row site's bad tokens made good count nothing more there.
    before = ctr[0, 0].item()
    fixed = rows.clone()
    fixed[bad_rows] = 0
    run(fixed)
    assert ctr[0, 0].item() == before
