"""Paged KV gather: the page-table lookup of paged attention, gathering each sequence's pages into a dense buffer.

``out[b, p] = cache[page_table[b, p]]`` for every batch entry ``b`` and page column ``p``. ``cache`` is
``[N, *page_shape]`` with the page index leading (K and V together in one page, e.g.
``[N, 2, page_size, heads, head_dim]``, so a bad page id counts once and reads nothing of either).

Guard ``kernels.paged_gather.page``: ``page_table[b, p]`` against ``[0, N)``. A bad page reads as zeros and is
recorded as (row ``b * P + p``, the flat page-table entry; value the page id). Only the first tile of each page
records, so a hit counts once however large a page is.

Request map (optional): ``requests[b]``, the request of batch entry ``b`` (ONE per row of the page table, not per
entry), kept with the offenders of its entries; read only for a bad entry.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..sites import register_site
from ..triton import record_hit
from ._common import INDEX_DTYPES, check_fake_ctr, check_requests, check_same_device, check_tensor, pow2, resolve_ctr

__all__ = ["SITE", "SITES", "paged_gather", "paged_gather_reference", "paged_gather_op"]

SITE = register_site(
    "kernels.paged_gather.page",
    description="paged KV gather: a page id vs the KV pool's pages (row = b * pages_per_seq + p)",
)
SITES = (SITE,)


@triton.jit
def _paged_gather(
    cache_ptr,
    table_ptr,
    out_ptr,
    ctr_ptr,
    req_ptr,
    N,
    E,
    P,
    BLOCK: tl.constexpr,
    GUARD: tl.constexpr,
    HAS_REQ: tl.constexpr,
):
    e = tl.program_id(0)  # flat page-table entry b * P + p (the table is contiguous)
    t = tl.program_id(1)
    page = tl.load(table_ptr + e).to(tl.int64)
    offs = t * BLOCK + tl.arange(0, BLOCK)
    m = offs < E
    ld = m
    if GUARD:
        ok = (page >= 0) & (page < N)
        if (ok == 0) & (t == 0):  # the fault path, in the entry's first tile only: one hit per entry
            req = None
            if HAS_REQ:
                req = tl.load(req_ptr + e // P)  # the entry's batch entry b
            record_hit(ctr_ptr, e, page, req)
        ld = tl.where(ok, m, False)  # where(), not `m & ok`: see block_table.py (interpreter typing)
        page = tl.where(ok, page, 0)
    # int64 page offset: page * E exceeds int32 for pools over 2**31 elements.
    v = tl.load(cache_ptr + page * E + offs, mask=ld, other=0)
    tl.store(out_ptr + e.to(tl.int64) * E + offs, v, mask=m)


def paged_gather(
    cache: torch.Tensor,
    page_table: torch.Tensor,
    out: torch.Tensor,
    *,
    guard: bool = True,
    ctr: torch.Tensor | None = None,
    requests: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather ``cache[page_table[b, p]]`` into ``out[b, p]`` (zeros for page ids out of ``[0, N)``, counted).

    Args:
        cache: ``[N, *page_shape]`` contiguous pool, any dtype.
        page_table: int32/int64 ``[B, P]``.
        out: ``[B, P, *page_shape]``, same dtype as ``cache``; fully written.
        guard: False launches the unguarded twin (benchmarks and the sanitizer control only).
        ctr: int64 ``[8]``, :data:`SITE`'s counter row (default: the default monitor's).
        requests: int32/int64 ``[B]``, the request id of each batch entry ``b`` (one per row of the page table),
            kept with the offenders of its entries (rows ``b * P + p``); None: requests not known.
    """
    check_tensor("cache", cache, min_ndim=1)
    check_tensor("page_table", page_table, dtypes=INDEX_DTYPES, ndim=2)
    B, P = page_table.shape
    check_tensor("out", out, dtypes=(cache.dtype,), shape=(B, P, *cache.shape[1:]))
    dev = check_same_device(cache=cache, page_table=page_table, out=out)
    c = resolve_ctr("ctr", SITES, ctr, dev)
    req = check_requests(requests, B, "batch entry, a row of page_table", dev)
    N = cache.shape[0]
    E = math.prod(cache.shape[1:])  # elements per page: host shape arithmetic
    if B * P == 0:
        return out
    block = pow2(E, lo=16, hi=4096)
    # At least one tile per entry even for empty pages, so every page id is still checked and counted.
    _paged_gather[(B * P, triton.cdiv(max(E, 1), block))](
        cache,
        page_table,
        out,
        c,
        c if req is None else req,  # never read without HAS_REQ
        N,
        E,
        P,
        BLOCK=block,
        GUARD=bool(guard),
        HAS_REQ=req is not None,
    )
    return out


def paged_gather_reference(cache: torch.Tensor, page_table: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Python reference: ``(out, hits)`` with hits as (flat entry, page id) pairs (tests)."""
    B, P = page_table.shape
    src = cache.detach().cpu()
    out = torch.zeros((B, P, *cache.shape[1:]), dtype=cache.dtype)
    hits = []
    for e, page in enumerate(page_table.cpu().reshape(-1).tolist()):
        if 0 <= page < cache.shape[0]:
            out[e // P, e % P] = src[page]
        else:
            hits.append((e, page))
    return out, hits


# The custom op (torch.ops.tripwire.paged_gather, for torch.compile: tripwire.kernels.ops has the contract).
@torch.library.custom_op("tripwire::paged_gather", mutates_args=("out", "ctr"))
def paged_gather_op(
    cache: torch.Tensor,
    page_table: torch.Tensor,
    out: torch.Tensor,
    ctr: torch.Tensor,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    paged_gather(cache, page_table, out, guard=guard, ctr=ctr, requests=requests)


@paged_gather_op.register_fake
def _(cache, page_table, out, ctr, guard=True, requests=None):  # type: ignore[no-untyped-def]
    want = (*page_table.shape, *cache.shape[1:])
    if tuple(out.shape) != want or out.dtype != cache.dtype:
        raise ValueError(f"out must be {cache.dtype} {list(want)}")
    check_fake_ctr(ctr, len(SITES))
