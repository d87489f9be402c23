"""The validator kernel's cold path: recording and repairing a block that holds a bad entry.

The hot path of each rule (:mod:`tripwire.validate._triton`) keeps one vote per block and calls out here only when it
is true. These functions are ``noinline`` and take scalars (pointers, offsets, sizes) rather than the hot path's
lanes: they read the block again themselves, so no fault-path value is live beside the hot loop and the guard does
not raise the kernel's registers (registers are allocated for the hungriest path, taken or not).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton import record_hits


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _segment_of(pos, sg_ptr, sgn, want):
    """For each lane of ``want``: the segment ``b`` with ``sg[b] <= pos < sg[b + 1]`` of an offsets tensor of ``sgn``
    entries (cu_seq_lens, an indptr), or -1 outside them. A bisection of fixed depth (fault path only); an offsets
    tensor that is not sorted gives a wrong segment, never an out-of-range load."""
    lo = tl.zeros_like(pos)
    hi = tl.zeros_like(pos) + (sgn - 1)
    for _ in range(0, 40):
        live = want & (lo < hi)
        mid = (lo + hi + 1) // 2
        go = tl.load(sg_ptr + mid, mask=live, other=0).to(tl.int64) <= pos
        lo = tl.where(live & go, mid, lo)
        hi = tl.where(live & (go == 0), mid - 1, hi)
    first = tl.load(sg_ptr + lo * 0, mask=want, other=0).to(tl.int64)
    last = tl.load(sg_ptr + lo * 0 + (sgn - 1), mask=want, other=0).to(tl.int64)
    return tl.where(want & (pos >= first) & (pos < last) & (lo < sgn - 1), lo, -1)


@triton.jit
def _requests_of(rows, bad, rq_ptr, rqn, sg_ptr, sgn, REQ: tl.constexpr):
    """The request of each bad lane (-1: not known). ``REQ``: 1 = ``requests[row]``; 2 = ``requests[segment of row]``
    (the segments tensor, or a CSR rule's indptr)."""
    if REQ == 1:
        idx = rows
    else:
        idx = _segment_of(rows, sg_ptr, sgn, bad)
    ok = bad & (idx >= 0) & (idx < rqn)
    return tl.where(ok, tl.load(rq_ptr + tl.where(ok, idx, 0), mask=ok, other=-1).to(tl.int64), -1)


@triton.jit
def _record(ctr_ptr, bad, rows, v, rq_ptr, rqn, sg_ptr, sgn, REQ: tl.constexpr, CALLS: tl.constexpr):
    """``CALLS``: record_hits' (these functions are out of line; the launcher picks: _triton._with_cap)."""
    if REQ == 0:
        record_hits(ctr_ptr, bad, rows, v, None, CALLS)
    elif tl.sum(bad.to(tl.int32), axis=0) > 0:  # the request lookups only for a tile with a bad entry
        record_hits(ctr_ptr, bad, rows, v, _requests_of(rows, bad, rq_ptr, rqn, sg_ptr, sgn, REQ), CALLS)


# The fault paths: a block with a bad entry, or an auxiliary tensor with a bad chunk, is recorded and repaired by one
# out-of-line call made with scalars only, which reads the entries again in tiles of _TILE (one per thread at the
# launch's 4 warps). A kernel is allocated registers for its hungriest path, taken or not, and this one has every
# rule's paths: recorded in the kernel, over whole 1024-entry blocks, the records' reductions and claims (and the
# requests' bisection) cost it programs per SM (benchmarks/RESULTS.md, `validator`). Each tile is recorded before it
# is repaired; the entries a tile reads are its own.
_TILE = tl.constexpr(128)


@triton.jit(noinline=True)
def _entries_fault(ctr_ptr, t_ptr, a_ptr, rq_ptr, sg_ptr, start, end, w, rqn, sgn, KIND: tl.constexpr,
                   HAS_PAD: tl.constexpr, HAS_LEN: tl.constexpr, REQ: tl.constexpr, LO: tl.constexpr,
                   HI: tl.constexpr, PAD: tl.constexpr, SAFE: tl.constexpr, MASK: tl.constexpr,
                   BLOCK: tl.constexpr, CALLS: tl.constexpr):  # fmt: skip
    """The bounds rule's fault path over the block ``[start, start + BLOCK)`` of entries below ``end`` (an INDEX
    rule's size, a CSR rule's used end)."""
    for s0 in tl.range(0, BLOCK, _TILE, loop_unroll_factor=1):
        offs = start + s0 + tl.arange(0, _TILE)
        m = offs < end
        v = tl.load(t_ptr + offs, mask=m, other=0).to(tl.int64)
        if KIND == 1:
            row = offs // w
            if HAS_LEN:
                ln = tl.load(a_ptr + row, mask=m, other=0).to(tl.int64)
                m = m & ((offs - row * w) < ln)
        else:
            row = offs  # a CSR rule's requests are per row of its layout: the segments are its own indptr
        bad = m & ((v < LO) | (v >= HI))
        if HAS_PAD:
            bad = bad & (v != PAD)
        _record(ctr_ptr, bad, row, v, rq_ptr, rqn, sg_ptr, sgn, REQ, CALLS)
        if MASK:
            tl.store(t_ptr + offs, (v * 0 + SAFE).to(t_ptr.dtype.element_ty), mask=bad)


@triton.jit(noinline=True)
def _lengths_fault(ctr_ptr, a_ptr, rq_ptr, sg_ptr, an, w, rqn, sgn, REQ: tl.constexpr, MASK: tl.constexpr,
                   CALLS: tl.constexpr):  # fmt: skip
    """The lengths rule's fault path over the whole lengths tensor (``an`` entries)."""
    for s0 in tl.range(0, an, _TILE, loop_unroll_factor=1):
        k = s0 + tl.arange(0, _TILE).to(tl.int64)
        valid = k < an
        ln = tl.load(a_ptr + k, mask=valid, other=0).to(tl.int64)
        bad = valid & ((ln < 0) | (ln > w))
        _record(ctr_ptr, bad, k, ln, rq_ptr, rqn, sg_ptr, sgn, REQ, CALLS)
        if MASK:
            tl.store(a_ptr + k, tl.minimum(tl.maximum(ln, 0), w).to(a_ptr.dtype.element_ty), mask=bad)


@triton.jit
def _indptr_bad(a_ptr, k, valid, lo, ni, carry):
    """The indptr's entries ``k`` (the ``valid`` lanes): ``(value, in range, last good entry before, bad)``, one
    definition for the check and its fault path. Each lane's previous entry is read from ``[lo, k)`` only; ``carry``
    is the last good entry before ``lo``."""
    v = tl.load(a_ptr + k, mask=valid, other=0).to(tl.int64)
    in_range = (v >= 0) & (v <= ni)
    kp = k - 1
    prev_here = valid & (kp >= lo) & (kp >= 1)
    vp = tl.load(a_ptr + kp, mask=prev_here, other=-1).to(tl.int64)
    wp = tl.where(prev_here & (vp >= 0) & (vp <= ni), vp, -1)
    last_good = tl.maximum(tl.associative_scan(wp, 0, _max_combine), carry)
    bad = valid & tl.where(k == 0, v != 0, (in_range == 0) | (v < last_good))
    return v, in_range, last_good, bad


@triton.jit(noinline=True)
def _indptr_fault(ctr_ptr, a_ptr, an, ni, MASK: tl.constexpr, CALLS: tl.constexpr):
    """The indptr rule's fault path over the whole indptr (``an`` entries). The tiles run in order and carry the
    last good entry before each (a repaired entry is the last good one before it, so reading it again never raises
    the max)."""
    carry = tl.zeros([], tl.int64)  # entry 0 counts as 0
    for s0 in tl.range(0, an, _TILE, loop_unroll_factor=1):
        k = s0 + tl.arange(0, _TILE).to(tl.int64)
        valid = k < an
        v, in_range, last_good, bad = _indptr_bad(a_ptr, k, valid, s0, ni, carry)
        record_hits(ctr_ptr, bad, k, v, None, CALLS)
        if MASK:
            tl.store(a_ptr + k, tl.where(k == 0, 0, last_good).to(a_ptr.dtype.element_ty), mask=bad)
        carry = tl.maximum(carry, tl.max(tl.where(valid & (k >= 1) & in_range, v, -1), axis=0))
