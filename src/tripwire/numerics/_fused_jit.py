"""The fused FP8 kernel's device helpers (:mod:`tripwire.numerics.fused` has the design): scales, the float32
thresholds, the packed and portable running maxima, the rounding to the FP8 grid, the quantised store, the guarded
token lane, and the exact count of a program's clipped elements."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_scale(scale, h, H: tl.constexpr, MODE: tl.constexpr):
    if MODE == 2:
        s = tl.load(scale + h, mask=h < H, other=1.0)  # [BLOCK_H, 1]
    elif MODE == 1:
        s = tl.load(scale)
    else:
        s = scale
    return s


@triton.jit
def _threshold(s, FP8_MAX: tl.constexpr, PTX: tl.constexpr):
    """The ceiling ``fp8_max * s`` rounded DOWN to float32, ``T``: for every float32 ``|x|``, ``|x| > T`` <=>
    ``|x| > fp8_max * s`` (same value as clip._device_threshold)."""
    if PTX:
        # mul.rm.f32: the exact product rounded toward -inf, in one instruction (the float64 path below is ~7
        # per threshold). Overflow gives FLT_MAX, as below; no .ftz, so subnormal scales round like float64 does.
        # The immediates are 448.0 (0x43E00000) and 57344.0 (0x47600000).
        if FP8_MAX == 448.0:
            t = tl.inline_asm_elementwise(
                "mul.rm.f32 $0, $1, 0f43E00000;", "=r,r", [s], dtype=tl.float32, is_pure=True, pack=1
            )
        else:
            t = tl.inline_asm_elementwise(
                "mul.rm.f32 $0, $1, 0f47600000;", "=r,r", [s], dtype=tl.float32, is_pure=True, pack=1
            )
    else:
        # The interpreter (no inline PTX): fp8_max * s is exact in float64 (24 x 3 significant bits); round it to
        # nearest float32, then one step down where that rounded up.
        c = s.to(tl.float64) * FP8_MAX
        t = c.to(tl.float32)
        below = (t.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
        t = tl.where(t.to(tl.float64) > c, below, t)
    return t


@triton.jit
def _abs_max2(m, x):
    """Per 16-bit half: ``max(|m|, |x|)``, for bf16/fp16 ``m``, ``x`` of one shape, two elements per instruction.

    ``max.xorsign.abs`` (sm_86+) takes the magnitudes for free but sets the result's sign to the XOR of the inputs'
    signs; the caller drops the sign at the end (``_max_final``). A NaN operand yields the other one (no ``.NaN``
    modifier), so NaN never becomes the maximum, as in the float32 path (maxnum)."""
    if x.dtype == tl.bfloat16:
        r = tl.inline_asm_elementwise(
            "max.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r", [m, x], dtype=tl.bfloat16, is_pure=True, pack=2
        )
    else:
        r = tl.inline_asm_elementwise(
            "max.xorsign.abs.f16x2 $0, $1, $2;", "=r,r,r", [m, x], dtype=tl.float16, is_pure=True, pack=2
        )
    return r


@triton.jit
def _max_init(x_ptr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr, PACKED: tl.constexpr):
    """The running max of ``|x|`` over a program's tokens: packed, the full tile in the input's 16-bit type (one
    ``_abs_max2`` per two elements per token); otherwise float32, one value per thread's ``VEC`` chunk."""
    if PACKED:
        acc = tl.zeros([BLOCK_H, BLOCK_D], x_ptr.dtype.element_ty)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_D // VEC], tl.float32)
    return acc


@triton.jit
def _max_update(acc, x, ok, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr, PACKED: tl.constexpr):
    """``acc`` updated with token tile ``x`` (as loaded; 0.0 outside the tile) unless the token is left out
    (``ok`` false: padding or a bad slot)."""
    if PACKED:
        if ok:  # one uniform branch per token instead of a select per register
            acc = _abs_max2(acc, x)
    else:
        # In-thread fmax over the thread's VEC contiguous elements (its 16-byte load); NaN is dropped (maxnum).
        p = tl.max(tl.reshape(tl.abs(x.to(tl.float32)), [BLOCK_H, BLOCK_D // VEC, VEC]), axis=2)
        acc = tl.maximum(acc, tl.where(ok, p, 0.0))
    return acc


@triton.jit
def _max_final(acc, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr, PACKED: tl.constexpr):
    """``[BLOCK_H, BLOCK_D // VEC]`` float32 maxima (non-negative, never NaN) from the running max."""
    if PACKED:
        # abs drops the sign max.xorsign left; widening a 16-bit float to float32 is exact.
        res = tl.max(tl.reshape(tl.abs(acc.to(tl.float32)), [BLOCK_H, BLOCK_D // VEC, VEC]), axis=2)
    else:
        res = acc
    return res


@triton.jit
def _round_to_fp8_grid(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr, SUB_SCALE: tl.constexpr):
    """Round float32 ``y`` (already clamped to the FP8 range) to the nearest FP8 value, ties to even, in float32.

    Why not just ``.to(fp8)``: the cast's rounding is not the same on every backend (the Triton interpreter
    truncates; see the control test). After this rounding the value is exactly representable in FP8, so whatever
    the cast's rounding mode, the bits equal torch's round-to-nearest-even. Used where the cast is not known to be
    the hardware's direct one (no ``CVT_ASM``: the interpreter, NVIDIA GPUs before sm_89, other backends).
    Normal range: round the fp32 bit pattern to ``MANT`` mantissa bits (add half-1 plus the kept lsb, mask).
    Subnormal range (below 2**(MIN_EXP-127)): the grid is uniform, 1/SUB_SCALE, so round |y|*SUB_SCALE to an
    integer with the 2**23 magic number (two correctly rounded float32 adds: RNE, exact). NaN passes through.
    """
    b = y.to(tl.int32, bitcast=True)
    a = b & 0x7FFFFFFF
    sign = b ^ a
    DROP: tl.constexpr = 23 - MANT
    lsb = (a >> DROP) & 1
    a_normal = (a + ((1 << (DROP - 1)) - 1) + lsb) & ~((1 << DROP) - 1)
    v = tl.abs(y) * SUB_SCALE
    v = (v + 8388608.0) - 8388608.0
    a_sub = (v * (1.0 / SUB_SCALE)).to(tl.int32, bitcast=True)
    r = tl.where(a >= (MIN_EXP << 23), a_normal, a_sub)
    r = tl.where(a > 0x7F800000, a, r)  # NaN unchanged
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_store(
    x,
    dst_ptrs,
    lane,
    s,
    FP8_MAX: tl.constexpr,
    FP8_TYPE: tl.constexpr,
    MANT: tl.constexpr,
    MIN_EXP: tl.constexpr,
    SUB_SCALE: tl.constexpr,
    CVT_ASM: tl.constexpr,
):
    # Correctly rounded division (div.rn.f32), as torch's CUDA `x / s` with a tensor divisor computes it. Neither
    # `/` nor `tl.fdiv(..., ieee_rounding=True)` gives that on Triton 3.6: its fdiv ignores ieee_rounding and
    # lowers to the approximate div.full.f32, which rounds some quotients to the wrong side of an FP8 rounding
    # boundary (the GPU tests compare with torch bit for bit). tl.math.div_rn does not broadcast, hence the explicit
    # one (adding 0.0 to a positive scale is exact).
    y = tl.math.div_rn(x, s + tl.zeros_like(x))
    if CVT_ASM != "":
        # sm_89+: the hardware's cvt.rn.satfinite alone is torch's clamp-then-round (see _cvt_asm), which spares the
        # clamp and the grid rounding below: a sequence of instructions per element, with or without counting.
        q = tl.inline_asm_elementwise(CVT_ASM, "=r,r,r,r,r", [y], dtype=tl.int8, is_pure=True, pack=4)
        tl.store(dst_ptrs, q.to(FP8_TYPE, bitcast=True), mask=lane)
    else:
        # Saturate before the cast, propagating NaN like torch.clamp (the default drops it), then round to the FP8
        # grid in float32 so that whatever the cast does, the bits are torch's.
        y = tl.maximum(y, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        y = tl.minimum(y, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        y = _round_to_fp8_grid(y, MANT, MIN_EXP, SUB_SCALE)
        tl.store(dst_ptrs, y.to(FP8_TYPE), mask=lane)


@triton.jit
def _token_lane(slot_ptr, tok, num_tokens, num_slots, in_tile, h, d, GUARD: tl.constexpr):
    """``(raw, slot, lane, ok)`` of token ``tok``: ``raw`` = the slot read (-1 past the batch); ``ok`` = the token is
    present, not padding (negative slot) and, with ``GUARD``, inside the cache; ``lane`` = ``ok`` over the tile;
    ``slot`` = ``raw`` where it is used, 0 elsewhere. Recording happens in the caller (the main pass records a bad
    slot once; the recount pass must not record it again)."""
    present = tok < num_tokens
    raw = tl.load(slot_ptr + tok, mask=present, other=-1).to(tl.int64)
    ok = raw >= 0  # negative slot (or past the batch): padding row, neither written nor counted
    if GUARD:
        ok = ok & (raw < num_slots)
    slot = tl.where(ok, raw, 0)  # a masked token's addresses stay inside the cache (no wild pointer arithmetic)
    # The scalar `ok` is widened through an int32 block: the interpreter splats a scalar int1 as int32, which it then
    # refuses as a load mask (on the GPU this folds away).
    lane = in_tile & ((h * 0 + d * 0 + ok.to(tl.int32)) != 0)
    return raw, slot, lane, ok


@triton.jit
def _count_clipped(
    src_ptr, stride, slot_ptr, num_tokens, num_slots, src, in_tile, h, d, thr, TPP: tl.constexpr, GUARD: tl.constexpr
):
    """Exact count of the program's elements with ``|x| > thr`` (the rare path: only a program whose maximum
    exceeded a threshold runs it). Re-reads the program's inputs, which the main pass has just read (L2-hot)."""
    n = tl.full([], 0, tl.int32)
    for i in range(TPP):
        tok = tl.program_id(0) * TPP + i
        _, _, lane, _ = _token_lane(slot_ptr, tok, num_tokens, num_slots, in_tile, h, d, GUARD)
        x = tl.load(src_ptr + tok.to(tl.int64) * stride + src, mask=lane, other=0.0).to(tl.float32)
        # A reduction per token (rare path) instead of a tile accumulator: no extra registers held across the loop.
        # Masked by `lane`: a masked lane loaded 0.0, which a threshold below zero (a corrupted scale TENSOR, which
        # the launcher cannot check without a sync) would count.
        n += tl.sum((lane & (tl.abs(x) > thr)).to(tl.int32), axis=None)
    return n


@triton.jit
def _over(mx, m, thr, MODE: tl.constexpr):
    """Whether some element exceeded its threshold, from the running max ``mx`` and its reduction ``m``."""
    if MODE == 2:
        # Per-head thresholds compare per head: one more (rare-mode) reduction.
        res = tl.max((mx > thr).to(tl.int32), axis=None) > 0
    else:
        res = m > thr  # one threshold: the program's max says it all
    return res


@triton.jit
def _thread_tail(xk, xv, lim_k, lim_v, ks, vs, row, seen_k, seen_v, ASM: tl.constexpr, CON: tl.constexpr,
                 PACK: tl.constexpr):  # fmt: skip
    """The per-thread counting tail (tripwire.numerics._fused_ptx._tail_asm) over one token's K and V registers:
    kept for its side effects (its barrier, the rare path's atomics)."""
    tl.inline_asm_elementwise(
        ASM, CON, [xk, xv, lim_k, lim_v, ks, vs, row, seen_k, seen_v], dtype=tl.int32, is_pure=False, pack=PACK
    )
