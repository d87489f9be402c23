"""Block-table gather: copy the block-table rows of a batch's requests into a dense per-batch table.

``out[b, j] = block_table[req_rows[b], j]`` for ``j < block_counts[req_rows[b]]``, else 0.

Guards (one site each):

* ``kernels.block_table.row``: ``req_rows[b]`` against the table's rows ``[0, R)``. Recorded as (row ``b``, value
  the bad request row). A bad row writes an all-zero output row; its block count is not read.
* ``kernels.block_table.count``: ``block_counts[r]`` against the table's width ``[0, W]``. Recorded as (row ``b``,
  value the bad count). A bad count writes an all-zero output row.

Zero is the padding value of unused columns too, as in engines whose block tables are zero-initialised; block 0 is
therefore only meaningful up to the row's count (attention must mask by sequence length, as it does anyway).

Request map (optional): ``requests[b]``, the request of batch entry ``b``, kept with the offenders of both sites;
read only for a batch entry that faults.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sites import register_site
from ..triton import record_hit
from ._common import INDEX_DTYPES, check_fake_ctr, check_requests, check_same_device, check_tensor, pow2, resolve_ctr

__all__ = [
    "SITES",
    "SITE_COUNT",
    "SITE_ROW",
    "block_table_gather",
    "block_table_gather_reference",
    "block_table_gather_op",
]

SITE_ROW = register_site(
    "kernels.block_table.row",
    description="block-table gather: a batch entry's request row vs the block table's rows (row = batch index)",
)
SITE_COUNT = register_site(
    "kernels.block_table.count",
    description="block-table gather: a request's block count vs the block table's width (row = batch index)",
)
# Counter rows in kernel order: ``ctr[k]`` is SITES[k]'s row.
SITES = (SITE_ROW, SITE_COUNT)


@triton.jit
def _block_table_gather(
    table_ptr,
    req_rows_ptr,
    counts_ptr,
    out_ptr,
    ctr_ptr,
    req_ptr,
    R,
    W,
    BLOCK_W: tl.constexpr,
    GUARD: tl.constexpr,
    W_TILES: tl.constexpr,
    HAS_REQ: tl.constexpr,
):
    b = tl.program_id(0)
    ctr_row = ctr_ptr  # SITES[0]
    ctr_count = ctr_ptr + 8  # SITES[1]
    r = tl.load(req_rows_ptr + b).to(tl.int64)
    r_seen = r
    if GUARD:
        row_ok = (r >= 0) & (r < R)
        # The count is read through the row: a bad row must not be dereferenced, and is not a count fault.
        n = tl.load(counts_ptr + tl.where(row_ok, r, 0), mask=row_ok, other=0).to(tl.int64)
        n_ok = (n >= 0) & (n <= W)
        ok = row_ok & n_ok
        r = tl.where(ok, r, 0)
    else:
        n = tl.load(counts_ptr + r).to(tl.int64)
    # int64 row offset: r * W overflows int32 for large tables (and for the unguarded twin's wild rows).
    src = table_ptr + r * W
    dst = out_ptr + b.to(tl.int64) * W
    # A constexpr trip count (the table width is fixed per engine, so this rarely recompiles): a loop bounded by a
    # runtime int breaks the Triton 3.6 interpreter under NumPy >= 2.5 (it converts a 1-element array to an int).
    for i in range(W_TILES):
        cols = i * BLOCK_W + tl.arange(0, BLOCK_W)
        in_w = cols < W
        live = in_w & (cols < n)
        if GUARD:
            # where(), not `live & ok`: the interpreter mis-types a bool block & a bool scalar (int32 mask).
            live = tl.where(ok, live, False)
        v = tl.load(src + cols, mask=live, other=0)
        tl.store(dst + cols, v, mask=in_w)
    if GUARD:
        # Recorded after the copy, under one scalar test: nothing sits in the req_rows -> counts -> table load chain.
        if ok == 0:
            req = None  # the request is read on the fault path only
            if HAS_REQ:
                req = tl.load(req_ptr + b)
            # Scalars: record_hit, whose fault path is out of line as a whole (tripwire.triton).
            if row_ok == 0:
                record_hit(ctr_row, b, r_seen, req)
            else:
                record_hit(ctr_count, b, n, req)


def block_table_gather(
    block_table: torch.Tensor,
    req_rows: torch.Tensor,
    block_counts: torch.Tensor,
    out: torch.Tensor,
    *,
    guard: bool = True,
    ctr: torch.Tensor | None = None,
    requests: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather ``block_table[req_rows]`` (first ``block_counts[row]`` columns, zeros after) into ``out``.

    Args:
        block_table: int32/int64 ``[R, W]``, the persistent per-request table.
        req_rows: int32/int64 ``[B]``, the request row of each batch entry.
        block_counts: int32/int64 ``[R]``, blocks in use per request row (``0 <= count <= W``).
        out: ``[B, W]``, same dtype as ``block_table``; fully written.
        guard: False launches the unguarded twin (same kernel without the checks; benchmarks and the sanitizer
            control only: a bad entry then reads out of bounds).
        ctr: int64 ``[2, 8]``, the counter rows of :data:`SITES` (``SITE_ROW``, ``SITE_COUNT``), e.g.
            ``tripwire.kernels.counters(SITES, device, monitor)``; default: the default monitor's.
        requests: int32/int64 ``[B]``, the request id of each batch entry (row ``b``), kept with its offenders;
            None: requests not known.

    No sync, no allocation: safe inside a CUDA-graph capture once the counters exist (``tripwire.prealloc``).
    """
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    R, W = block_table.shape
    check_tensor("req_rows", req_rows, dtypes=INDEX_DTYPES, ndim=1)
    B = req_rows.shape[0]
    check_tensor("block_counts", block_counts, dtypes=INDEX_DTYPES, shape=(R,))
    check_tensor("out", out, dtypes=(block_table.dtype,), shape=(B, W))
    dev = check_same_device(block_table=block_table, req_rows=req_rows, block_counts=block_counts, out=out)
    c = resolve_ctr("ctr", SITES, ctr, dev)
    req = check_requests(requests, B, "batch entry", dev)
    if B == 0 or W == 0:
        return out
    _block_table_gather[(B,)](
        block_table,
        req_rows,
        block_counts,
        out,
        c,
        c if req is None else req,  # never read without HAS_REQ
        R,
        W,
        BLOCK_W=pow2(W, hi=1024),
        GUARD=bool(guard),
        W_TILES=triton.cdiv(W, pow2(W, hi=1024)),
        HAS_REQ=req is not None,
    )
    return out


def block_table_gather_reference(
    block_table: torch.Tensor, req_rows: torch.Tensor, block_counts: torch.Tensor
) -> tuple[torch.Tensor, list[tuple[int, int]], list[tuple[int, int]]]:
    """Torch/Python reference: ``(out, row_hits, count_hits)`` with hits as ``(row, value)`` pairs (tests)."""
    R, W = block_table.shape
    out = torch.zeros((req_rows.shape[0], W), dtype=block_table.dtype)
    row_hits, count_hits = [], []
    table, counts = block_table.cpu(), block_counts.cpu()
    for b, r in enumerate(req_rows.cpu().tolist()):
        if not 0 <= r < R:
            row_hits.append((b, r))
            continue
        n = int(counts[r])
        if not 0 <= n <= W:
            count_hits.append((b, n))
            continue
        out[b, :n] = table[r, :n]
    return out, row_hits, count_hits


# The custom op (torch.ops.tripwire.block_table_gather, for torch.compile: tripwire.kernels.ops has the contract).
@torch.library.custom_op("tripwire::block_table_gather", mutates_args=("out", "ctr"))
def block_table_gather_op(
    block_table: torch.Tensor,
    req_rows: torch.Tensor,
    block_counts: torch.Tensor,
    out: torch.Tensor,
    ctr: torch.Tensor,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    block_table_gather(block_table, req_rows, block_counts, out, guard=guard, ctr=ctr, requests=requests)


@block_table_gather_op.register_fake
def _(block_table, req_rows, block_counts, out, ctr, guard=True, requests=None):  # type: ignore[no-untyped-def]
    if tuple(out.shape) != (req_rows.shape[0], block_table.shape[1]) or out.dtype != block_table.dtype:
        raise ValueError(f"out must be {block_table.dtype} [{req_rows.shape[0]}, {block_table.shape[1]}]")
    check_fake_ctr(ctr, len(SITES))
