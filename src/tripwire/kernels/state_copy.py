"""State copy (recurrent / Mamba-style state): copy state blocks between slots named through a block table.

For each copy ``i``: ``r = rows[i]``, ``src = table[r, src_cols[i]]``, ``dst = table[r, dst_cols[i]]``, then
``state[dst] = state[src]``. ``state`` is ``[S, ...]`` with the slot index leading.

Guards (one site each; a copy with any bad lookup copies nothing):

* ``kernels.state_copy.row``: ``rows[i]`` against the table's rows ``[0, R)``; (row ``i``, value the row).
* ``kernels.state_copy.column``: ``src_cols[i]`` and ``dst_cols[i]`` against the width ``[0, W)``, each a separate
  entry (a copy with both wrong counts twice); (row ``i``, value the column). Checked even when the row is bad.
* ``kernels.state_copy.slot``: each slot read from the table against ``[0, S)``, when its lookup was in range;
  (row ``i``, value the slot).

Request map (optional): ``requests[i]``, the request that copy ``i`` belongs to, kept with the offenders of all
three sites; read only for a copy that faults.

Contract: within one launch no destination slot may be the source or destination of another copy (copies run in
parallel; an overlap is a race, as in every batched state-copy kernel).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..sites import register_site
from ..triton import record_hits
from ._common import INDEX_DTYPES, check_fake_ctr, check_requests, check_same_device, check_tensor, pow2, resolve_ctr

__all__ = ["SITES", "SITE_COLUMN", "SITE_ROW", "SITE_SLOT", "state_copy", "state_copy_reference", "state_copy_op"]

SITE_ROW = register_site(
    "kernels.state_copy.row",
    description="state copy: a copy's request row vs the state block table's rows (row = copy index)",
)
SITE_COLUMN = register_site(
    "kernels.state_copy.column",
    description="state copy: a source/destination column vs the state block table's width (row = copy index)",
)
SITE_SLOT = register_site(
    "kernels.state_copy.slot",
    description="state copy: a state slot read from the block table vs the state pool's slots (row = copy index)",
)
# Counter rows in kernel order: ``ctr[k]`` is SITES[k]'s row.
SITES = (SITE_ROW, SITE_COLUMN, SITE_SLOT)


@triton.jit
def _state_copy(
    state_ptr,
    table_ptr,
    rows_ptr,
    src_cols_ptr,
    dst_cols_ptr,
    ctr_ptr,
    req_ptr,
    R,
    W,
    S,
    E,
    BLOCK: tl.constexpr,
    GUARD: tl.constexpr,
    HAS_REQ: tl.constexpr,
):
    i = tl.program_id(0)
    t = tl.program_id(1)
    r = tl.load(rows_ptr + i).to(tl.int64)
    cs = tl.load(src_cols_ptr + i).to(tl.int64)
    cd = tl.load(dst_cols_ptr + i).to(tl.int64)
    offs = t * BLOCK + tl.arange(0, BLOCK)
    m = offs < E
    if GUARD:
        row_ok = (r >= 0) & (r < R)
        # Both columns as a 2-lane block: one reduction and one set of atomics for the pair.
        lane = tl.arange(0, 2)
        cols = tl.where(lane == 0, cs, cd)
        col_ok = (cols >= 0) & (cols < W)
        # where(scalar, block, False), not `scalar & block`: the interpreter mis-types a bool scalar & a bool block.
        looked = tl.where(row_ok, col_ok, False)  # lookups that are in range
        slots = tl.load(table_ptr + tl.where(looked, r * W + cols, 0), mask=looked, other=0).to(tl.int64)
        slot_ok = (slots >= 0) & (slots < S)
        good = tl.sum((looked & slot_ok).to(tl.int32), axis=0) == 2  # false iff a row, column or slot is bad
        # The fault path, in the copy's first tile only (a hit counts once however large a state block is).
        if (good == 0) & (t == 0):
            req = None
            if HAS_REQ:
                req = tl.load(req_ptr + i)
            record_hits(ctr_ptr, row_ok == 0, i, r, req)
            record_hits(ctr_ptr + 8, col_ok == 0, i, cols, req)
            record_hits(ctr_ptr + 16, looked & (slot_ok == 0), i, slots, req)
        src = tl.sum(tl.where(lane == 0, slots, 0), axis=0)
        dst = tl.sum(tl.where(lane == 1, slots, 0), axis=0)
        m = tl.where(good, m, False)
        src = tl.where(good, src, 0)
        dst = tl.where(good, dst, 0)
    else:
        src = tl.load(table_ptr + r * W + cs).to(tl.int64)
        dst = tl.load(table_ptr + r * W + cd).to(tl.int64)
    # int64 slot offsets: slot * E exceeds int32 for pools over 2**31 elements.
    v = tl.load(state_ptr + src * E + offs, mask=m, other=0)
    tl.store(state_ptr + dst * E + offs, v, mask=m)


def state_copy(
    state: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    src_cols: torch.Tensor,
    dst_cols: torch.Tensor,
    *,
    guard: bool = True,
    ctr: torch.Tensor | None = None,
    requests: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy ``state[table[rows[i], src_cols[i]]]`` to ``state[table[rows[i], dst_cols[i]]]`` for every ``i``.

    Args:
        state: ``[S, ...]`` contiguous state pool, any dtype; modified in place and returned.
        block_table: int32/int64 ``[R, W]``, request row -> state slots.
        rows, src_cols, dst_cols: int32/int64 ``[M]``, one copy each.
        guard: False launches the unguarded twin (benchmarks and the sanitizer control only).
        ctr: int64 ``[3, 8]``, the counter rows of :data:`SITES` (default: the default monitor's).
        requests: int32/int64 ``[M]``, the request id of each copy (row ``i``), kept with its offenders; None:
            requests not known.
    """
    check_tensor("state", state, min_ndim=1)
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    check_tensor("rows", rows, dtypes=INDEX_DTYPES, ndim=1)
    M = rows.shape[0]
    check_tensor("src_cols", src_cols, dtypes=INDEX_DTYPES, shape=(M,))
    check_tensor("dst_cols", dst_cols, dtypes=INDEX_DTYPES, shape=(M,))
    dev = check_same_device(state=state, block_table=block_table, rows=rows, src_cols=src_cols, dst_cols=dst_cols)
    c = resolve_ctr("ctr", SITES, ctr, dev)
    req = check_requests(requests, M, "copy", dev)
    R, W = block_table.shape
    S = state.shape[0]
    E = math.prod(state.shape[1:])  # elements per slot: host shape arithmetic
    if M == 0:
        return state
    block = pow2(E, lo=16, hi=4096)
    _state_copy[(M, triton.cdiv(max(E, 1), block))](
        state,
        block_table,
        rows,
        src_cols,
        dst_cols,
        c,
        c if req is None else req,  # never read without HAS_REQ
        R,
        W,
        S,
        E,
        BLOCK=block,
        GUARD=bool(guard),
        HAS_REQ=req is not None,
    )
    return state


def state_copy_reference(
    state: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor, src_cols: torch.Tensor, dst_cols: torch.Tensor
) -> tuple[torch.Tensor, dict[str, list[tuple[int, int]]]]:
    """Python reference on a CPU copy: ``(state_after, {"row": hits, "column": hits, "slot": hits})`` (tests)."""
    before = state.detach().cpu().clone()
    out = before.clone()
    R, W = block_table.shape
    S = state.shape[0]
    table = block_table.cpu()
    hits: dict[str, list[tuple[int, int]]] = {"row": [], "column": [], "slot": []}
    for i, (r, cs, cd) in enumerate(
        zip(rows.cpu().tolist(), src_cols.cpu().tolist(), dst_cols.cpu().tolist(), strict=True)
    ):
        row_ok = 0 <= r < R
        if not row_ok:
            hits["row"].append((i, r))
        good = row_ok
        slots = []
        for c in (cs, cd):
            if not 0 <= c < W:
                hits["column"].append((i, c))
                good = False
            elif row_ok:
                s = int(table[r, c])
                slots.append(s)
                if not 0 <= s < S:
                    hits["slot"].append((i, s))
                    good = False
        if good:
            out[slots[1]] = before[slots[0]]
    return out, hits


# The custom op (torch.ops.tripwire.state_copy, for torch.compile: tripwire.kernels.ops has the contract).
@torch.library.custom_op("tripwire::state_copy", mutates_args=("state", "ctr"))
def state_copy_op(
    state: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    src_cols: torch.Tensor,
    dst_cols: torch.Tensor,
    ctr: torch.Tensor,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    state_copy(state, block_table, rows, src_cols, dst_cols, guard=guard, ctr=ctr, requests=requests)


@state_copy_op.register_fake
def _(state, block_table, rows, src_cols, dst_cols, ctr, guard=True, requests=None):  # type: ignore[no-untyped-def]
    check_fake_ctr(ctr, len(SITES))
