"""KV block zeroer: zero the listed blocks of a KV pool (freed or newly allocated blocks).

``pool[block_ids[i]] = 0`` for every ``i``. The pool is ``[N, ...]`` with the block index leading (any dtype; K and
V together in one block, e.g. ``[N, 2, block_size, heads, head_dim]``, so one bad id counts once).

Guard ``kernels.kv_zero.block``: ``block_ids[i]`` against ``[0, N)``; a bad id zeroes nothing and is recorded as
(row ``i``, value the id). Only the first tile of each entry records, so a hit counts once however large a block is.

Request map (optional): ``requests[i]``, the request that list entry ``i`` belongs to (the one whose block is freed
or allocated), kept with its offender; read only for a bad entry.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..sites import register_site
from ..triton import record_hit
from ._common import INDEX_DTYPES, check_fake_ctr, check_requests, check_same_device, check_tensor, pow2, resolve_ctr

__all__ = ["SITE", "SITES", "kv_zero", "kv_zero_reference", "kv_zero_op"]

SITE = register_site(
    "kernels.kv_zero.block",
    description="KV block zeroer: a listed block id vs the KV pool's blocks (row = list index)",
)
SITES = (SITE,)


@triton.jit
def _kv_zero(
    pool_ptr, ids_ptr, ctr_ptr, req_ptr, N, E, BLOCK: tl.constexpr, GUARD: tl.constexpr, HAS_REQ: tl.constexpr
):
    i = tl.program_id(0)
    t = tl.program_id(1)
    blk = tl.load(ids_ptr + i).to(tl.int64)
    offs = t * BLOCK + tl.arange(0, BLOCK)
    m = offs < E
    if GUARD:
        ok = (blk >= 0) & (blk < N)
        if (ok == 0) & (t == 0):  # the fault path, in the entry's first tile only: one hit per entry
            req = None
            if HAS_REQ:
                req = tl.load(req_ptr + i)
            record_hit(ctr_ptr, i, blk, req)
        m = tl.where(ok, m, False)  # where(), not `m & ok`: see block_table.py (interpreter typing)
        blk = tl.where(ok, blk, 0)
    # int64 block offset: blk * E exceeds int32 for pools over 2**31 elements.
    tl.store(pool_ptr + blk * E + offs, tl.zeros([BLOCK], dtype=pool_ptr.dtype.element_ty), mask=m)


def kv_zero(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    *,
    guard: bool = True,
    ctr: torch.Tensor | None = None,
    requests: torch.Tensor | None = None,
) -> torch.Tensor:
    """Zero ``pool[block_ids[i]]`` for every ``i`` (ids out of ``[0, N)`` zero nothing and are counted).

    Args:
        pool: ``[N, ...]`` contiguous KV pool, any dtype; modified in place and returned.
        block_ids: int32/int64 ``[M]``. Duplicates are fine (zeroing is idempotent).
        guard: False launches the unguarded twin (benchmarks and the sanitizer control only).
        ctr: int64 ``[8]``, :data:`SITE`'s counter row (default: the default monitor's).
        requests: int32/int64 ``[M]``, the request id of each list entry (row ``i``), kept with its offender;
            None: requests not known.
    """
    check_tensor("pool", pool, min_ndim=1)
    check_tensor("block_ids", block_ids, dtypes=INDEX_DTYPES, ndim=1)
    dev = check_same_device(pool=pool, block_ids=block_ids)
    c = resolve_ctr("ctr", SITES, ctr, dev)
    N = pool.shape[0]
    M = block_ids.shape[0]
    req = check_requests(requests, M, "list entry", dev)
    E = math.prod(pool.shape[1:])  # elements per block: host shape arithmetic, no device access
    if M == 0:
        return pool
    block = pow2(E, lo=16, hi=4096)
    # At least one tile per id even for empty blocks, so every id is still checked and counted.
    _kv_zero[(M, triton.cdiv(max(E, 1), block))](
        pool,
        block_ids,
        c,
        c if req is None else req,  # never read without HAS_REQ
        N,
        E,
        BLOCK=block,
        GUARD=bool(guard),
        HAS_REQ=req is not None,
    )
    return pool


def kv_zero_reference(pool: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Python reference on a CPU copy: ``(zeroed_pool, hits)`` (tests)."""
    out = pool.detach().cpu().clone()
    hits = []
    for i, b in enumerate(block_ids.cpu().tolist()):
        if 0 <= b < out.shape[0]:
            out[b] = 0
        else:
            hits.append((i, b))
    return out, hits


# The custom op (torch.ops.tripwire.kv_zero, for torch.compile: tripwire.kernels.ops has the contract).
@torch.library.custom_op("tripwire::kv_zero", mutates_args=("pool", "ctr"))
def kv_zero_op(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    ctr: torch.Tensor,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    kv_zero(pool, block_ids, guard=guard, ctr=ctr, requests=requests)


@kv_zero_op.register_fake
def _(pool, block_ids, ctr, guard=True, requests=None):  # type: ignore[no-untyped-def]
    check_fake_ctr(ctr, len(SITES))
