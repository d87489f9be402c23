"""The pre-check of a loop's indices (:func:`tripwire.triton.any_outside`): whether any entry of a range lies outside
``[lo, hi)``, decided before the loop so that a clean range runs the kernel's own loop and only a range with a bad
entry runs a masking copy of it.

Compiled on NVIDIA GPUs, for int32 and int64 entries, each warp reads every entry of the range itself and decides
with one warp vote (``vote.sync.any``): every warp reads the same entries, so every warp reaches the same answer,
and no warp waits for another. A block reduction (Triton's ``tl.max`` over lanes spread across warps) goes through
shared memory and barriers, and every program of the kernel waits for them before its loop can start; in vLLM's
decode kernels that reduction costs most of what the guard costs, against the warp vote measured as a whole (no
barrier, each warp's own reads, more entries per step: benchmarks/RESULTS.md, the adopted decode rows). A warp's
extra reads of the same few entries are L1 hits. Under Triton's interpreter (no PTX), and for other entry types,
the block reduction.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._callee import _INTERP


@triton.constexpr_function
def _vote_ptx(bits: int, block: int) -> str:
    """PTX: ``$0`` = 1 when an entry of ``$1[$2:$3]`` (``bits``-wide signed entries at address ``$1``; the bounds
    int64) lies outside ``[$4, $5)`` (int64), else 0, in every lane of the warp. Each lane reads entries ``lane,
    lane + 32, ...``: ``loads`` = min(4, ceil(block / 32)) per step, all issued before any is compared (in flight
    together), then the compares OR-ed into one predicate, and one ``vote.sync.any`` over the warp at the end. Lanes
    leave the loop a step apart at most and meet again at the vote. ``${:uid}`` keeps the labels unique per copy."""
    loads = min(4, -(-block // 32))
    size = bits // 8
    shift = size.bit_length() - 1
    vals = ", ".join(f"w{j}" for j in range(loads))
    s = (
        "{ .reg .pred q, f" + "".join(f", p{j}" for j in range(loads)) + "; .reg .b32 lane; "
        f".reg .b64 i, k, a, {vals}; "
        + (".reg .b32 " + ", ".join(f"v{j}" for j in range(loads)) + "; " if bits == 32 else "")
        + "mov.u32 lane, %laneid; cvt.u64.u32 k, lane; add.s64 i, $2, k; setp.ne.u32 f, 0, 0; "
        "L${:uid}: setp.ge.s64 q, i, $3; @q bra D${:uid}; "
    )
    for j in range(loads):
        s += f"add.s64 k, i, {32 * j}; setp.lt.s64 p{j}, k, $3; shl.b64 a, k, {shift}; add.s64 a, a, $1; "
        if bits == 32:
            s += f"mov.b32 v{j}, 0; @p{j} ld.global.b32 v{j}, [a]; "
        else:
            s += f"mov.b64 w{j}, 0; @p{j} ld.global.b64 w{j}, [a]; "
    for j in range(loads):
        if bits == 32:
            s += f"cvt.s64.s32 w{j}, v{j}; "
        s += (
            f"setp.lt.s64 q, w{j}, $4; and.pred q, q, p{j}; or.pred f, f, q; "
            f"setp.ge.s64 q, w{j}, $5; and.pred q, q, p{j}; or.pred f, f, q; "
        )
    return s + (
        f"add.s64 i, i, {32 * loads}; bra L${{:uid}}; "
        "D${:uid}: vote.sync.any.pred f, f, 0xffffffff; selp.u32 $0, 1, 0, f; }"
    )


@triton.constexpr_function
def _votes(dtype) -> bool:  # type: ignore[no-untyped-def]
    """Whether entries of ``dtype`` take the warp vote (compiled; signed 32- or 64-bit integers)."""
    return not _INTERP.value and dtype.is_int_signed() and dtype.primitive_bitwidth in (32, 64)


@triton.jit
def any_outside(ptr, start, end, lo, hi, BLOCK: tl.constexpr):
    """Whether any entry of ``ptr[start:end]`` (integer entries) lies outside ``[lo, hi)``: a scalar, the same in
    every lane. Reads only and records nothing: the pre-check that lets a kernel keep its own hot loop for clean
    index ranges and run a masking copy (which records) only for a range with a bad entry.

    Compiled, for int32/int64 entries: each warp reads every entry, ``32 * min(4, ceil(BLOCK / 32))`` per step (one
    to four loads per lane in flight), and the answer is one warp vote, with no shared memory and no barrier (this
    module's docstring says why). Otherwise: ``BLOCK`` entries per step, one lane per entry, and a block reduction
    at the end. Either way one pass before the loop: checked inside a loop whose tile layout
    replicates each index over many lanes (a page id broadcast over its tokens), the same compare would run once per
    replica and put a data-dependent mask on the loop's pipelined loads.
    """
    if _votes(ptr.dtype.element_ty):
        # Not pure: the asm reads memory, which Triton cannot see, so it must stay where it is among the kernel's
        # stores and two calls must not be merged (on vLLM's decode kernels the SASS is the same either way).
        bad = tl.inline_asm_elementwise(
            _vote_ptx(ptr.dtype.element_ty.primitive_bitwidth, BLOCK),
            "=r,l,l,l,l,l",
            [ptr.to(tl.int64, bitcast=True), tl.cast(start, tl.int64), tl.cast(end, tl.int64), tl.cast(lo, tl.int64),
             tl.cast(hi, tl.int64)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
        return bad != 0
    else:
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for s0 in range(start, end, BLOCK):
            offs = s0 + tl.arange(0, BLOCK)
            inside = offs < end
            x = tl.load(ptr + offs, mask=inside, other=0)
            bad = bad | (inside & ((x < lo) | (x >= hi))).to(tl.int32)
        return tl.max(bad, axis=0) > 0
