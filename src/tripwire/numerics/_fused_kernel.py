"""The fused FP8 KV-cache write's kernel (:mod:`tripwire.numerics.fused` has the design and launches it): one program
per ``TOKENS_PER_PROGRAM`` tokens, the slot guard, the quantised stores, and the clip counting with the tail the
launcher chose."""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton import record_hits
from ._fused_jit import (
    _count_clipped,
    _load_scale,
    _max_final,
    _max_init,
    _max_update,
    _over,
    _quantize_store,
    _thread_tail,
    _threshold,
    _token_lane,
)


@triton.jit
def _fp8_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    clip_ctr_ptr,
    slot_ctr_ptr,
    num_slots,
    num_tokens,
    key_stride,
    value_stride,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_SCALE_MODE: tl.constexpr,
    V_SCALE_MODE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_TYPE: tl.constexpr,
    COUNT: tl.constexpr,
    GUARD: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr,
    VEC: tl.constexpr,
    PTX: tl.constexpr,
    K_PACKED: tl.constexpr,
    V_PACKED: tl.constexpr,
    THREAD_TAIL: tl.constexpr,
    TAIL_PACK: tl.constexpr,
    TAIL_ASM: tl.constexpr,
    TAIL_CON: tl.constexpr,
    TAIL_LAST: tl.constexpr,
    LIMIT_ASM: tl.constexpr,
    CVT_ASM: tl.constexpr,
):
    # TOKENS_PER_PROGRAM tokens (one on the GPU, see _launch_config), reduced ONCE at the end. Counting on the hot
    # path is a running max of |x|. "Some element of the program clipped" is exactly "the program's max |x| exceeds
    # its threshold", so only such a program (rare: the fault case) pays for an exact count, in a second pass
    # (_count_clipped): counting every element in the main pass (compare, convert, add, plus a bit-pattern max) would
    # add that work to every element of every healthy program.
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    src = h * D + d
    in_tile = (h < H) & (d < D)
    if COUNT:
        # The maxima stored so far, read first so that the loop hides the load's latency (reading them in the tail
        # cost more than the atomics it saved). A program whose maxima do not exceed them has nothing to record: the
        # slot only grows, so its atomic could not change it. A stale (smaller) value only costs a useless atomic.
        if THREAD_TAIL:
            # The low words (the float bits; little-endian). Unclamped: a corrupted slot only costs useless atomics
            # or skips ones that could not have raised a value above the float range anyway.
            seen_lo = clip_ctr_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
            seen_k = tl.load(seen_lo + 4)
            seen_v = tl.load(seen_lo + 6)
        else:
            # Clamped to +inf's bits: the slots hold zero-extended float bits, never above it unless overwritten.
            seen_k = tl.minimum(tl.load(clip_ctr_ptr + 2), 0x7F800000).to(tl.int32)
            seen_v = tl.minimum(tl.load(clip_ctr_ptr + 3), 0x7F800000).to(tl.int32)
    ks = _load_scale(k_scale, h, H, K_SCALE_MODE)
    vs = _load_scale(v_scale, h, H, V_SCALE_MODE)
    # e5m2: 2 mantissa bits, min normal 2**-14 (fp32 exponent 113), subnormal step 2**-16;
    # e4m3fn: 3 mantissa bits, min normal 2**-6 (exponent 121), subnormal step 2**-9.
    MANT: tl.constexpr = 2 if FP8_MAX == 57344.0 else 3
    MIN_EXP: tl.constexpr = 113 if FP8_MAX == 57344.0 else 121
    SUB_SCALE: tl.constexpr = 65536.0 if FP8_MAX == 57344.0 else 512.0
    if COUNT and not THREAD_TAIL:
        mx_k = _max_init(key_ptr, BLOCK_H, BLOCK_D, VEC, K_PACKED)
        mx_v = _max_init(value_ptr, BLOCK_H, BLOCK_D, VEC, V_PACKED)
    if COUNT and THREAD_TAIL:
        # Once per program, off the critical path (the loads are in flight): the packed 16-bit limits.
        lim_k = tl.inline_asm_elementwise(LIMIT_ASM, "=r,r,r", [ks, seen_k], dtype=tl.int32, is_pure=True, pack=1)
        lim_v = tl.inline_asm_elementwise(LIMIT_ASM, "=r,r,r", [vs, seen_v], dtype=tl.int32, is_pure=True, pack=1)
        row = clip_ctr_ptr.to(tl.int64)  # an address operand for the asm (pointers are not asm operands)
        tail_ks = ks
        tail_vs = vs
        if (H != BLOCK_H) or (D != BLOCK_D):  # lanes outside the tile: threshold inf, never counted
            tail_ks = tl.where(in_tile, ks, float("inf"))
            tail_vs = tl.where(in_tile, vs, float("inf"))
    for i in range(TOKENS_PER_PROGRAM):
        tok = tl.program_id(0) * TOKENS_PER_PROGRAM + i
        tok64 = tok.to(tl.int64)
        # K and V are loaded first, masked by the batch only, not by the slot: no store can sit between the loads
        # (the compiler cannot move a load across a store to a possibly aliasing cache) and the loads need not wait
        # for the slot's load. Padding rows are read (they are inside the batch) and masked below.
        ld = in_tile & ((h * 0 + d * 0 + (tok < num_tokens).to(tl.int32)) != 0)
        xk_in = tl.load(key_ptr + tok64 * key_stride + src, mask=ld, other=0.0)
        xv_in = tl.load(value_ptr + tok64 * value_stride + src, mask=ld, other=0.0)
        raw, slot, lane, ok = _token_lane(slot_ptr, tok, num_tokens, num_slots, in_tile, h, d, GUARD)
        if COUNT and not THREAD_TAIL:
            # Out-of-tile lanes loaded 0.0; a token that is not written (padding, a bad slot) is left out by `ok`.
            # NaN is left out, as in ClipCounter.count.
            mx_k = _max_update(mx_k, xk_in, ok, BLOCK_H, BLOCK_D, VEC, K_PACKED)
            mx_v = _max_update(mx_v, xv_in, ok, BLOCK_H, BLOCK_D, VEC, V_PACKED)
        if COUNT and THREAD_TAIL and not TAIL_LAST:
            # Before the quantisation, right after the loads: the warps of the CTA reach its barrier together there
            # (at the end of the program they arrive apart, and the barrier waits for the slowest). A token left out
            # (padding, a bad slot) skips it: one program-uniform branch, so every thread meets the same barriers.
            if ok:
                _thread_tail(xk_in, xv_in, lim_k, lim_v, tail_ks, tail_vs, row, seen_k, seen_v, TAIL_ASM, TAIL_CON,
                             TAIL_PACK)  # fmt: skip
        if GUARD:
            # A token whose slot is past the cache: masked in _token_lane, recorded here (once) with the raw slot.
            record_hits(slot_ctr_ptr, raw >= num_slots, tok, raw)
        dst = slot * (H * D) + src
        _quantize_store(
            xk_in.to(tl.float32), k_cache_ptr + dst, lane, ks, FP8_MAX, FP8_TYPE, MANT, MIN_EXP, SUB_SCALE, CVT_ASM
        )
        _quantize_store(
            xv_in.to(tl.float32), v_cache_ptr + dst, lane, vs, FP8_MAX, FP8_TYPE, MANT, MIN_EXP, SUB_SCALE, CVT_ASM
        )
        if COUNT and THREAD_TAIL and TAIL_LAST:
            # After the stores (TAIL_LAST, a batch that fits the GPU in one wave): there the barrier is off the
            # critical path of a program whose stores are in flight, instead of between its loads and its stores.
            if ok:
                _thread_tail(xk_in, xv_in, lim_k, lim_v, tail_ks, tail_vs, row, seen_k, seen_v, TAIL_ASM, TAIL_CON,
                             TAIL_PACK)  # fmt: skip
    if COUNT and not THREAD_TAIL:
        # The program's tail. The healthy path is ONE block reduction (a flag), then nothing: a program acts only
        # when some element exceeds its threshold (it clipped) or the stored maximum (a new maximum). Both tests
        # compare float32 bits as int32: the maxima are non-negative and never NaN, so their bits order like their
        # values, and a threshold's bits order like it when it is >= 0 (a negative threshold -- a corrupted scale
        # tensor, which the launcher cannot check without a sync -- compares below every maximum: the program acts,
        # and the exact float test below decides). The skip of a program that neither clipped nor raised a maximum
        # spares it two contended atomics per token at one token per program, the launcher's shape on the GPU.
        thr_k = _threshold(ks, FP8_MAX, PTX)
        thr_v = _threshold(vs, FP8_MAX, PTX)
        m_k = _max_final(mx_k, BLOCK_H, BLOCK_D, VEC, K_PACKED)
        m_v = _max_final(mx_v, BLOCK_H, BLOCK_D, VEC, V_PACKED)
        bits_k = m_k.to(tl.int32, bitcast=True)
        bits_v = m_v.to(tl.int32, bitcast=True)
        lim_k = tl.minimum(thr_k.to(tl.int32, bitcast=True), seen_k)
        lim_v = tl.minimum(thr_v.to(tl.int32, bitcast=True), seen_v)
        act = tl.max(((bits_k > lim_k) | (bits_v > lim_v)).to(tl.int32), axis=None)
        if act > 0:
            # The rare path: the program's maxima, exact counts from a second read of its tokens, the atomics.
            b_k = tl.max(bits_k, axis=None)
            b_v = tl.max(bits_v, axis=None)
            over_k = _over(m_k, b_k.to(tl.float32, bitcast=True), thr_k, K_SCALE_MODE)
            over_v = _over(m_v, b_v.to(tl.float32, bitcast=True), thr_v, V_SCALE_MODE)
            if over_k:
                n_k = _count_clipped(
                    key_ptr,
                    key_stride,
                    slot_ptr,
                    num_tokens,
                    num_slots,
                    src,
                    in_tile,
                    h,
                    d,
                    thr_k,
                    TOKENS_PER_PROGRAM,
                    GUARD,
                )
                tl.atomic_add(clip_ctr_ptr + 0, n_k.to(tl.int64))
            if over_v:
                n_v = _count_clipped(
                    value_ptr,
                    value_stride,
                    slot_ptr,
                    num_tokens,
                    num_slots,
                    src,
                    in_tile,
                    h,
                    d,
                    thr_v,
                    TOKENS_PER_PROGRAM,
                    GUARD,
                )
                tl.atomic_add(clip_ctr_ptr + 1, n_v.to(tl.int64))
            # Max magnitude as float32 bits (monotone for non-negative floats, so an integer atomic max is valid),
            # only where it exceeds what the program read. Relaxed: nothing is ordered against these slots, and the
            # reader sees them complete once the kernel has finished.
            tl.atomic_max(clip_ctr_ptr + 2, b_k.to(tl.int64), mask=b_k > seen_k, sem="relaxed")
            tl.atomic_max(clip_ctr_ptr + 3, b_v.to(tl.int64), mask=b_v > seen_v, sem="relaxed")
