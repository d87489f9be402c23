"""A guarded row gather with an unguarded twin: a small kernel to feed bad indices on purpose (the reader's tests,
``tripwire bench``'s detection and the lab's reader questions, the 2-GPU experiment). The reference kernels
(:mod:`tripwire.kernels`) are not used for this: a measurement of the reader must not depend on their launcher
signatures, and needs one hit per bad index with the row = the output row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton import guard_index

_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _gather_rows(table_ptr, idx_ptr, out_ptr, n_rows, ctr_ptr, D: tl.constexpr, GUARD: tl.constexpr):
    # One program per output row: out[pid] = table[idx[pid]].
    pid = tl.program_id(0)
    idx = tl.load(idx_ptr + pid).to(tl.int64)
    cols = tl.arange(0, D)
    if GUARD:
        safe, ok = guard_index(idx, 0, n_rows, ctr_ptr, pid)
        # safe is clamped into [0, n_rows), so the load is in bounds; the masked row becomes zeros.
        vals = tl.where(ok, tl.load(table_ptr + safe * D + cols), 0.0)
    else:
        # The unguarded twin: a bad idx reads outside the table (only ever launched with good indices).
        vals = tl.load(table_ptr + idx * D + cols)
    tl.store(out_ptr + pid * D + cols, vals)


def gather_rows(
    table: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, *, guard: bool = True, ctr: torch.Tensor | None = None
) -> None:
    """``out[i] = table[idx[i]]`` for a float ``table`` ``[R, D]`` (D a power of two) or ``[R]`` (one element per
    row), int32/int64 ``idx`` ``[N]`` and a preallocated ``out`` ``[N, D]`` (``[N]`` for a 1-D table).

    Guarded: an index outside ``[0, R)`` is masked (its row of ``out`` becomes 0) and counted in ``ctr`` (an int64
    ``[8]`` counter row) at row ``i``, value the index: one hit per bad index. Unguarded (``guard=False``): no check,
    no counter (only for good indices). Allocates nothing and never syncs, so it can be captured in a CUDA graph."""
    if table.dim() not in (1, 2) or not table.is_floating_point():
        raise ValueError(
            f"gather_rows: table must be a 1-D or 2-D float tensor, got {tuple(table.shape)} {table.dtype}"
        )
    r, d = (table.shape[0], 1) if table.dim() == 1 else table.shape
    if r == 0:
        raise ValueError("gather_rows: the table has no rows (the guard clamps indices into [0, rows))")
    if d & (d - 1) or d == 0:
        raise ValueError(f"gather_rows: the row width must be a power of two, got {d}")
    if idx.dim() != 1 or idx.dtype not in _INDEX_DTYPES:
        raise ValueError(f"gather_rows: idx must be a 1-D int32/int64 tensor, got {tuple(idx.shape)} {idx.dtype}")
    want = (idx.shape[0],) if table.dim() == 1 else (idx.shape[0], d)
    if tuple(out.shape) != want or out.dtype != table.dtype:
        raise ValueError(f"gather_rows: out must be {want} {table.dtype}, got {tuple(out.shape)} {out.dtype}")
    for name, t in (("table", table), ("idx", idx), ("out", out)):
        if t.device != table.device:
            raise ValueError(f"gather_rows: {name} is on {t.device}, table on {table.device}")
        if not t.is_contiguous():
            raise ValueError(f"gather_rows: {name} must be contiguous")
    if guard:
        if ctr is None or ctr.dtype != torch.int64 or ctr.numel() < 8 or ctr.device != table.device:
            raise ValueError("gather_rows: a guarded launch needs ctr, an int64 [8] counter row on the table's device")
    else:
        ctr = idx  # never read when GUARD is False; any pointer of the right device will do
    if idx.shape[0] == 0:
        return
    _gather_rows[(idx.shape[0],)](table, idx, out, r, ctr, D=d, GUARD=guard)
