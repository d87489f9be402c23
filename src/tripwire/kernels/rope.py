"""Rotary embedding (NeoX / rotate-half style) with a guarded cos/sin lookup by position.

For token ``t`` at ``pos = positions[t]`` and each head, with ``x1, x2`` the two halves of the head and
``cos, sin = cos_sin[pos, :D/2], cos_sin[pos, D/2:]`` (the vLLM cache layout)::

    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin

computed in float32 and rounded to the output dtype once.

Guard ``kernels.rope.position`` (registered ``fatal=True``): ``pos`` against the table's rows ``[0, max_pos)``.
A bad position writes ZEROS for that token's q and k (cos = sin = 0) and is recorded as (row ``t``, value the
position). It is fatal because the rotated key is stored in the KV cache and read by every later step: continuing
past it corrupts every later answer of that sequence, so a hit arms the stop in every mode but off.

Request map (optional): ``requests[t]``, the request of token ``t``, kept with its offender; read only for a bad
position.

The outputs may be the inputs (in place): each element is read before it is written, by the same program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sites import register_site
from ..triton import record_hit
from ._common import INDEX_DTYPES, check_fake_ctr, check_requests, check_same_device, check_tensor, pow2, resolve_ctr

__all__ = ["FLOAT_DTYPES", "SITE", "SITES", "rope", "rope_reference", "rope_op"]

SITE = register_site(
    "kernels.rope.position",
    description="rope: a token position vs the cos/sin table's rows; the zeroed key is stored in the KV cache "
    "(row = token index, value = position)",
    fatal=True,
)
SITES = (SITE,)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rotate(
    x_ptr,
    o_ptr,
    t,
    H,
    cos,
    sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    H_TILES: tl.constexpr,
):
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    # A constexpr trip count (heads are fixed per model, so this rarely recompiles): a loop bounded by a runtime
    # int breaks the Triton 3.6 interpreter under NumPy >= 2.5 (it converts a 1-element array to an int).
    for i in range(H_TILES):
        heads = i * BLOCK_H + tl.arange(0, BLOCK_H)
        msk = (heads[:, None] < H) & dm[None, :]
        base = (t * H + heads[:, None]).to(tl.int64) * (2 * HALF) + d[None, :]
        x1 = tl.load(x_ptr + base, mask=msk, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + base + HALF, mask=msk, other=0.0).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(o_ptr + base, o1.to(o_ptr.dtype.element_ty), mask=msk)
        tl.store(o_ptr + base + HALF, o2.to(o_ptr.dtype.element_ty), mask=msk)


@triton.jit
def _rope(
    pos_ptr,
    q_ptr,
    k_ptr,
    cs_ptr,
    qo_ptr,
    ko_ptr,
    ctr_ptr,
    req_ptr,
    Hq,
    Hk,
    max_pos,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GUARD: tl.constexpr,
    HQ_TILES: tl.constexpr,
    HK_TILES: tl.constexpr,
    HAS_REQ: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    if GUARD:
        ok = (pos >= 0) & (pos < max_pos)
        if ok == 0:  # the fault path
            req = None
            if HAS_REQ:
                req = tl.load(req_ptr + t)
            record_hit(ctr_ptr, t, pos, req)
        dm = tl.where(ok, dm, False)  # masked cos/sin read as 0, so the token's q and k come out as zeros
        pos = tl.where(ok, pos, 0)
    # int64 row offset: the unguarded twin's wild positions must not wrap around into the table.
    row = cs_ptr + pos * (2 * HALF)
    cos = tl.load(row + d, mask=dm, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + d, mask=dm, other=0.0).to(tl.float32)
    _rotate(q_ptr, qo_ptr, t, Hq, cos, sin, HALF, BLOCK_H, BLOCK_D, HQ_TILES)
    _rotate(k_ptr, ko_ptr, t, Hk, cos, sin, HALF, BLOCK_H, BLOCK_D, HK_TILES)


def rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    *,
    guard: bool = True,
    ctr: torch.Tensor | None = None,
    requests: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` by their tokens' positions into ``q_out``/``k_out`` (may alias ``q``/``k``).

    Args:
        positions: int32/int64 ``[T]``.
        q: float32/float16/bfloat16 ``[T, Hq, D]``, ``D`` even; ``k``: same dtype, ``[T, Hk, D]``.
        cos_sin: float ``[max_pos, D]``, cos in the first half of each row, sin in the second.
        q_out, k_out: like ``q`` and ``k`` (dtype and shape).
        guard: False launches the unguarded twin (benchmarks and the sanitizer control only).
        ctr: int64 ``[8]``, :data:`SITE`'s counter row (default: the default monitor's).
        requests: int32/int64 ``[T]``, the request id of each token (row ``t``), kept with its offender; None:
            requests not known.
    """
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, ndim=1)
    T = positions.shape[0]
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    if q.shape[0] != T:
        raise ValueError(f"q must have one row per position ({T}), got shape {list(q.shape)}")
    D = q.shape[2]
    if D % 2:
        raise ValueError(f"the head size of q must be even for rotate-half rope, got {D}")
    check_tensor("k", k, dtypes=(q.dtype,), shape=(T, None, D))
    check_tensor("cos_sin", cos_sin, dtypes=FLOAT_DTYPES, shape=(None, D))
    check_tensor("q_out", q_out, dtypes=(q.dtype,), shape=tuple(q.shape))
    check_tensor("k_out", k_out, dtypes=(k.dtype,), shape=tuple(k.shape))
    dev = check_same_device(positions=positions, q=q, k=k, cos_sin=cos_sin, q_out=q_out, k_out=k_out)
    c = resolve_ctr("ctr", SITES, ctr, dev)
    req = check_requests(requests, T, "token", dev)
    if T == 0:
        return q_out, k_out
    half = D // 2
    block_d = pow2(half)
    # A [heads, D/2] tile of at most ~4K elements per loop iteration.
    block_h = pow2(max(q.shape[1], k.shape[1]), hi=max(1, 4096 // block_d))
    _rope[(T,)](
        positions,
        q,
        k,
        cos_sin,
        q_out,
        k_out,
        c,
        c if req is None else req,  # never read without HAS_REQ
        q.shape[1],
        k.shape[1],
        cos_sin.shape[0],
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        GUARD=bool(guard),
        HQ_TILES=triton.cdiv(q.shape[1], block_h),
        HK_TILES=triton.cdiv(k.shape[1], block_h),
        HAS_REQ=req is not None,
    )
    return q_out, k_out


def rope_reference(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Torch reference: ``(q_rot, k_rot, hits)``; bad positions give zero rows (tests)."""
    pos = positions.cpu().to(torch.int64)
    max_pos, D = cos_sin.shape
    half = D // 2
    ok = (pos >= 0) & (pos < max_pos)
    cs = cos_sin.cpu().float()[pos.clamp(0, max_pos - 1)] * ok[:, None]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x = x.cpu().float()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(q.dtype)

    hits = [(t, p) for t, p in enumerate(pos.tolist()) if not 0 <= p < max_pos]
    return rot(q), rot(k), hits


# The custom op (torch.ops.tripwire.rope, for torch.compile: tripwire.kernels.ops has the contract).
@torch.library.custom_op("tripwire::rope", mutates_args=("q_out", "k_out", "ctr"))
def rope_op(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    ctr: torch.Tensor,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    rope(positions, q, k, cos_sin, q_out, k_out, guard=guard, ctr=ctr, requests=requests)


@rope_op.register_fake
def _(positions, q, k, cos_sin, q_out, k_out, ctr, guard=True, requests=None):  # type: ignore[no-untyped-def]
    if q_out.shape != q.shape or k_out.shape != k.shape:
        raise ValueError("q_out/k_out must have the shapes of q/k")
    check_fake_ctr(ctr, len(SITES))
