"""Slot mapping: positions + block table -> the KV-cache slot of each token.

``slots[t] = block_table[token_rows[t], pos // block_size] * block_size + pos % block_size`` with
``pos = positions[t]`` (floor division, so a negative position lands in a negative column and is caught).

Guards (one site each; a token whose entry is bad gets the padding slot ``-1``, which KV writers skip):

* ``kernels.slot_mapping.row``: ``token_rows[t]`` against the table's rows ``[0, R)``; (row ``t``, value the row).
* ``kernels.slot_mapping.column``: ``pos // block_size`` against the table's width ``[0, W)``; (row ``t``, value
  the column). Checked independently of the row: a token with both wrong counts at both sites.
* ``kernels.slot_mapping.block``: the block id read from the table against the KV pool ``[0, num_kv_blocks)``,
  only when ``num_kv_blocks`` is given (the table itself may hold a corrupted id); (row ``t``, value the block id).

Request map (optional): ``requests[t]``, the request of token ``t``, kept with the offenders of every site; read
only by a program that has a bad token.

Limit: int64 positions must stay within +-2**62 (the counter encoding); int32 positions are always fine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sites import register_site
from ..triton import record_lanes, record_tiles
from ..triton._budget import register_cap
from ._common import (
    INDEX_DTYPES,
    check_fake_ctr,
    check_int_arg,
    check_requests,
    check_same_device,
    check_tensor,
    resolve_ctr,
)

__all__ = [
    "SITES",
    "SITE_BLOCK",
    "SITE_COLUMN",
    "SITE_ROW",
    "slot_mapping",
    "slot_mapping_reference",
    "slot_mapping_op",
]

SITE_ROW = register_site(
    "kernels.slot_mapping.row",
    description="slot mapping: a token's request row vs the block table's rows (row = token index)",
)
SITE_COLUMN = register_site(
    "kernels.slot_mapping.column",
    description="slot mapping: position // block_size vs the block table's width (row = token index, value = column)",
)
SITE_BLOCK = register_site(
    "kernels.slot_mapping.block",
    description="slot mapping: the block id read from the block table vs the KV pool size (row = token index)",
)
# Counter rows in kernel order: ``ctr[k]`` is SITES[k]'s row.
SITES = (SITE_ROW, SITE_COLUMN, SITE_BLOCK)
# The launch shapes (tripwire.kernels.slot_mapping._launch_shape). Up to _SMALL_T tokens (an engine's batch: the
# kernel is one program's latency, not bandwidth), programs of one warp and one token per thread: the guard's vote is
# then one warp reduction (redux.sync) with no shared memory and no barrier, and the tokens spread over every SM. Past
# it, _BLOCK_T tokens per program over _NUM_WARPS warps: one reduction per 1024 tokens, amortised (bandwidth); four
# tokens per thread, as at eight (4 warps) the guard's int64 checks needed more registers than the twin's.
_SMALL_T = 1 << 16
_BLOCK_T = 1024
_NUM_WARPS = 8


def _launch_shape(T: int) -> tuple[int, int]:
    """``(tokens per program, warps)`` for ``T`` tokens (see the comment above)."""
    if T <= _SMALL_T:
        return 32, 1
    return _BLOCK_T, _NUM_WARPS


@triton.jit
def _column(pos, block_size, LOG2_BS: tl.constexpr):
    """``(column, offset within the block)`` of positions (int32 or int64, kept in their dtype): floor division,
    also for negative positions."""
    if LOG2_BS >= 31:
        # A block of 2**31 tokens or more: a shift of 31 or more needs 64 bits (a constexpr branch: free otherwise).
        pos = pos.to(tl.int64)
    if LOG2_BS >= 0:
        # A power-of-two block size (every engine's): the arithmetic shift IS floor division for signed integers
        # and the mask is the matching remainder. A runtime int64 division is a long emulated sequence that made
        # this kernel ALU-bound (twin and guarded alike), so every guard instruction showed in its time.
        col = pos >> LOG2_BS
        within = pos & ((1 << LOG2_BS) - 1)
    else:
        # Floor division written with non-negative operands only: Triton's // truncates toward zero, which would
        # map positions -1..-(bs-1) into column 0 and hide them. (-1 - pos) cannot overflow, unlike -pos.
        col = tl.where(pos >= 0, pos // block_size, -1 - (-1 - pos) // block_size)
        within = pos - col * block_size
    return col, within


@triton.jit
def _below(x, n):
    """``0 <= x < n`` for a signed integer block ``x`` and a size ``n >= 0`` (the launcher's check), in ONE unsigned
    compare: a negative ``x`` read as unsigned is larger than any such ``n``. Half the compares of the two-sided test,
    on the path between the index loads and the table load that depends on them; 32 bits for a 32-bit ``x``."""
    n64 = tl.cast(n, tl.int64)  # n may be a constexpr (Triton specialises a size of 1) or an int32/int64 scalar
    if x.dtype.primitive_bitwidth == 64:
        return x.to(tl.uint64, bitcast=True) < n64.to(tl.uint64)  # n >= 0: the value cast keeps its bits
    else:
        # Every non-negative int32 is below an n of 2**31 or more: n saturated at 2**31 (a scalar, once), where the
        # unsigned compare is exactly "x >= 0", INT32_MAX included.
        return x.to(tl.uint32, bitcast=True) < tl.minimum(n64, 0x80000000).to(tl.uint32)


@triton.jit
def _token_tile(C, args, t):
    """Tile ``t`` of a program's tokens read again for one site: ``(bad, rows, values, requests)`` for
    tripwire.triton.record_tiles. ``C = (SITE, LOG2_BS, HAS_REQ, FAULT_T)`` (SITE: 0 row, 1 column, 2 block; FAULT_T:
    the tile, one token per thread), constexprs, so each site's fault path forms only its own words from only the
    arguments it reads (the out-of-line functions receive them in registers): ``args`` is ``(start, limit, <the
    site's>..., requests)``, the requests read with HAS_REQ only. The row and column sites are checked independently
    (a token with both wrong counts at both); the block site only where the row and column are in range."""
    SITE: tl.constexpr = C[0]
    LOG2_BS: tl.constexpr = C[1]
    HAS_REQ: tl.constexpr = C[2]
    FAULT_T: tl.constexpr = C[3]
    start = args[0]
    limit = args[1]
    offs = start + t * FAULT_T + tl.arange(0, FAULT_T)
    m = offs < limit  # the program's own tokens (limit: the end of its range or of the tokens)
    if SITE == 0:
        rows_ptr, R = args[2], args[3]
        r = tl.load(rows_ptr + offs, mask=m, other=0)
        bad = m & ((r < 0) | (r >= R))
        value = r.to(tl.int64)
    elif SITE == 1:
        pos_ptr, W, block_size = args[2], args[3], args[4]
        pos = tl.load(pos_ptr + offs, mask=m, other=0).to(tl.int64)
        value, _ = _column(pos, block_size, LOG2_BS)
        bad = m & ((value < 0) | (value >= W))
    else:
        pos_ptr, rows_ptr, table_ptr, R, W, block_size, num_blocks = (
            args[2], args[3], args[4], args[5], args[6], args[7], args[8],
        )  # fmt: skip
        r = tl.load(rows_ptr + offs, mask=m, other=0).to(tl.int64)
        pos = tl.load(pos_ptr + offs, mask=m, other=0).to(tl.int64)
        col, _ = _column(pos, block_size, LOG2_BS)
        ok = m & (r >= 0) & (r < R) & (col >= 0) & (col < W)
        value = tl.load(table_ptr + tl.where(ok, r * W + col, 0), mask=ok, other=0).to(tl.int64)
        bad = ok & ((value < 0) | (value >= num_blocks))
    reqs = tl.full([FAULT_T], -1, tl.int64)  # -1: not known
    if HAS_REQ:
        reqs = tl.load(args[len(args) - 1] + offs, mask=bad, other=0).to(tl.int64)  # read here only
    return bad, offs, value, reqs


@triton.jit
def _slot_mapping(
    pos_ptr,
    rows_ptr,
    table_ptr,
    slots_ptr,
    ctr_ptr,
    req_ptr,
    T,
    R,
    W,
    block_size,
    num_blocks,
    BLOCK_T: tl.constexpr,
    FAULT_T: tl.constexpr,
    LOG2_BS: tl.constexpr,
    HAS_BLOCK_LIMIT: tl.constexpr,
    GUARD: tl.constexpr,
    HAS_REQ: tl.constexpr,
    LANES: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = offs < T
    # Indices in their own dtype (int32 rows and positions compare in 32 bits); the table's offset in int64 (R * W
    # may pass 2**31), twin and guarded alike.
    pos = tl.load(pos_ptr + offs, mask=m, other=0)
    r = tl.load(rows_ptr + offs, mask=m, other=0)
    col, within = _column(pos, block_size, LOG2_BS)
    if GUARD:
        row_ok = _below(r, R)
        col_ok = _below(col, W)
        ok = m & row_ok & col_ok
        # A masked lane reads nothing, so the clamp is not for safety: with it, the compiler keeps less of four
        # tokens' int64 offsets live at _BLOCK_T (the twin's registers on Triton 3.9, where without it the guarded
        # build needed one allocation unit more and fit fewer programs per SM).
        blk = tl.load(table_ptr + tl.where(ok, r.to(tl.int64) * W + col, 0), mask=ok, other=0)
        any_bad = m & ((row_ok & col_ok) == 0)
        if HAS_BLOCK_LIMIT:
            ok_rc = ok
            blk_ok = _below(blk, num_blocks)
            any_bad = any_bad | (ok & (blk_ok == 0))
            ok = ok & blk_ok
        slot = tl.where(ok, blk.to(tl.int64) * block_size + within, -1)
        tl.store(slots_ptr + offs, slot, mask=m)
        if LANES:
            # An engine step's launch (one token per thread): each bad token records itself (record_lanes), with no
            # vote. A vote over the block check waits for the table load, and the program for the vote: at a few
            # programs per launch that wait was the guard's whole cost. The sites as the tiles record them: row and
            # column independently, the block id only where both are in range.
            req = None  # not known
            if HAS_REQ:
                req = tl.load(req_ptr + offs, mask=any_bad, other=-1)  # a bad token's only
            row_bad = m & (row_ok == 0)
            col_bad = m & (col_ok == 0)
            if HAS_BLOCK_LIMIT:
                record_lanes((ctr_ptr, ctr_ptr + 8, ctr_ptr + 16), (row_bad, col_bad, ok_rc & (blk_ok == 0)), offs,
                             (r, col, blk), req)  # fmt: skip
            else:
                record_lanes((ctr_ptr, ctr_ptr + 8), (row_bad, col_bad), offs, (r, col), req)
        elif tl.sum(any_bad.to(tl.int32), axis=None) > 0:
            # A bandwidth launch: record AFTER the store, behind one reduction per 1024 tokens (a reduction placed
            # between the index loads and the dependent table load would delay that load); clean programs pay the
            # reduction and no atomics. The fault path: the program's tokens formed again, a tile at a time, by
            # out-of-line functions (record_tiles), site after site; nothing of it is live beside the hot path's.
            start = tl.program_id(0) * BLOCK_T
            limit = tl.minimum(start + BLOCK_T, T)
            tiles = tl.cdiv(BLOCK_T, FAULT_T)
            a0 = (start, limit, rows_ptr, R, req_ptr)
            a1 = (start, limit, pos_ptr, W, block_size, req_ptr)
            a2 = (start, limit, pos_ptr, rows_ptr, table_ptr, R, W, block_size, num_blocks, req_ptr)
            # KEEPS_SMEM=False: nothing of this kernel is in shared memory at the calls (no loop, no dot; the vote's
            # scratch is dead), so the tile functions are out of line before Triton 3.9 too.
            record_tiles(ctr_ptr, _token_tile, (0, LOG2_BS, HAS_REQ, FAULT_T), a0, tiles, False)
            record_tiles(ctr_ptr + 8, _token_tile, (1, LOG2_BS, HAS_REQ, FAULT_T), a1, tiles, False)
            if HAS_BLOCK_LIMIT:
                record_tiles(ctr_ptr + 16, _token_tile, (2, LOG2_BS, HAS_REQ, FAULT_T), a2, tiles, False)
    else:
        blk = tl.load(table_ptr + (r.to(tl.int64) * W + col), mask=m, other=0)
        slot = blk.to(tl.int64) * block_size + within
        tl.store(slots_ptr + offs, slot, mask=m)


def slot_mapping(
    positions: torch.Tensor,
    token_rows: torch.Tensor,
    block_table: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    *,
    num_kv_blocks: int | None = None,
    guard: bool = True,
    ctr: torch.Tensor | None = None,
    requests: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write each token's KV slot into ``slots`` (``-1`` for a token whose metadata is out of range).

    Args:
        positions: int32/int64 ``[T]``, token positions in their sequences.
        token_rows: int32/int64 ``[T]``, each token's request row in ``block_table``.
        block_table: int32/int64 ``[R, W]``.
        slots: int64 ``[T]`` output.
        block_size: tokens per KV block (> 0), a host int.
        num_kv_blocks: the KV pool's block count; given, block ids read from the table are guarded too. Both host
            ints at most 2**63 - 1 (ValueError past it: Triton would pass them as uint64).
        guard: False launches the unguarded twin (benchmarks and the sanitizer control only).
        ctr: int64 ``[3, 8]``, the counter rows of :data:`SITES` (default: the default monitor's).
        requests: int32/int64 ``[T]``, the request id of each token (row ``t``), kept with its offenders; None:
            requests not known.

    No sync, no allocation: capture-safe once the counters exist. Past 65536 tokens (a bandwidth launch) the first
    launch of a compiled variant also finds its register cap (tripwire.triton._budget: it compiles the twin too),
    as Triton's first launch compiles: make it before any CUDA graph capture.
    """
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, ndim=1)
    T = positions.shape[0]
    check_tensor("token_rows", token_rows, dtypes=INDEX_DTYPES, shape=(T,))
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    check_tensor("slots", slots, dtypes=(torch.int64,), shape=(T,))
    check_int_arg("block_size", block_size, lo=1)
    if num_kv_blocks is not None:
        check_int_arg("num_kv_blocks", num_kv_blocks, lo=0)
    dev = check_same_device(positions=positions, token_rows=token_rows, block_table=block_table, slots=slots)
    c = resolve_ctr("ctr", SITES, ctr, dev)
    req = check_requests(requests, T, "token", dev)
    R, W = block_table.shape
    if T == 0:
        return slots
    block_t, warps = _launch_shape(T)
    grid = (triton.cdiv(T, block_t),)
    args = (positions, token_rows, block_table, slots, c, c if req is None else req,  # never read without HAS_REQ
            T, R, W, block_size, 0 if num_kv_blocks is None else num_kv_blocks)  # fmt: skip
    kw = dict(
        BLOCK_T=block_t,
        # The fault path's tile: one token per thread, so that what it keeps per lane (int64 rows, columns, blocks,
        # values) does not raise the kernel's registers over the hot path's.
        FAULT_T=32 * warps,
        # A constexpr: one compiled variant per block size an engine uses (a handful), -1 for the general path.
        LOG2_BS=block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else -1,
        HAS_BLOCK_LIMIT=num_kv_blocks is not None,
        GUARD=bool(guard),
        HAS_REQ=req is not None,
        # At one warp per program (an engine step's launch), bad tokens record themselves: no vote (record_lanes,
        # whose precondition holds there: 32 tokens over 32 threads, each token held by one).
        LANES=warps == 1,
        num_warps=warps,
    )
    if guard and warps > 1:
        # A bandwidth launch within the twin's registers (tripwire.triton._budget): its fault path, out of line,
        # spills on its own path rather than cost the hot path programs per SM. The key is the compiled variant:
        # Triton specialises each tensor's 16-byte alignment and each size's type, divisibility and value 1.
        tensors, sizes = args[:6], args[6:]
        key = (positions.device, *(t.dtype for t in tensors), *(t.data_ptr() % 16 == 0 for t in tensors),
               *((v % 16 == 0, v == 1, v < 2**31) for v in sizes), block_t, kw["LOG2_BS"], kw["HAS_BLOCK_LIMIT"],
               kw["HAS_REQ"])  # fmt: skip
        cap = register_cap(key, _slot_mapping, grid, args, kw, {"GUARD": False})
        if cap is not None:
            kw["maxnreg"] = cap
    _slot_mapping[grid](*args, **kw)
    return slots


def slot_mapping_reference(
    positions: torch.Tensor,
    token_rows: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    num_kv_blocks: int | None = None,
) -> tuple[torch.Tensor, dict[str, list[tuple[int, int]]]]:
    """Python reference: ``(slots, {"row": hits, "column": hits, "block": hits})`` (tests)."""
    R, W = block_table.shape
    table = block_table.cpu()
    slots = torch.full((positions.shape[0],), -1, dtype=torch.int64)
    hits: dict[str, list[tuple[int, int]]] = {"row": [], "column": [], "block": []}
    for t, (p, r) in enumerate(zip(positions.cpu().tolist(), token_rows.cpu().tolist(), strict=True)):
        col = p // block_size  # Python floors
        row_ok, col_ok = 0 <= r < R, 0 <= col < W
        if not row_ok:
            hits["row"].append((t, r))
        if not col_ok:
            hits["column"].append((t, col))
        if not (row_ok and col_ok):
            continue
        blk = int(table[r, col])
        if num_kv_blocks is not None and not 0 <= blk < num_kv_blocks:
            hits["block"].append((t, blk))
            continue
        slots[t] = blk * block_size + p % block_size
    return slots, hits


# The custom op (torch.ops.tripwire.slot_mapping, for torch.compile: tripwire.kernels.ops has the contract).
@torch.library.custom_op("tripwire::slot_mapping", mutates_args=("slots", "ctr"))
def slot_mapping_op(
    positions: torch.Tensor,
    token_rows: torch.Tensor,
    block_table: torch.Tensor,
    slots: torch.Tensor,
    ctr: torch.Tensor,
    block_size: int,
    num_kv_blocks: int = -1,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    slot_mapping(
        positions,
        token_rows,
        block_table,
        slots,
        block_size,
        num_kv_blocks=None if num_kv_blocks < 0 else num_kv_blocks,
        guard=guard,
        ctr=ctr,
        requests=requests,
    )


@slot_mapping_op.register_fake
def _(positions, token_rows, block_table, slots, ctr, block_size, num_kv_blocks=-1, guard=True, requests=None):  # type: ignore[no-untyped-def]
    if tuple(slots.shape) != tuple(positions.shape) or slots.dtype != torch.int64:
        raise ValueError(f"slots must be int64 {list(positions.shape)}")
    check_fake_ctr(ctr, len(SITES))
