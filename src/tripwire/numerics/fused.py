"""Fused FP8 KV-cache write: quantise K/V into a paged FP8 cache through a slot mapping and count clipping in the
same pass.

Each program handles ``TOKENS_PER_PROGRAM`` tokens (one on the GPU: see :func:`fp8_cache_launch`). For each it loads the
token's K and V rows and its slot, skips the token when the slot is negative (padding of a captured batch), guards
the slot against the cache size (a slot past the cache is masked -- nothing is written -- and counted at the fatal
site ``numerics.fp8_cache.slot``, row = token index, value = slot), then for K and V: ``y = x / scale`` (IEEE
division), ``clamp(y, -fp8_max, fp8_max)``, round-to-nearest-even cast to FP8, store (on sm_89+ the clamp and the
cast are the hardware's one saturating conversion: ``_quantize_store``). With ``COUNT`` the same
registers give the number of elements with ``|x| > fp8_max * scale`` (exact, see :mod:`tripwire.numerics.clip`) and
the max magnitude, recorded in the layer's clip row (the ``|x|`` tested is the input before scaling; NaN neither
clips nor counts as a maximum; skipped and masked tokens count nothing).

Hot-path cost of counting, on NVIDIA sm_90+ with bf16/fp16 K and V (what the launcher picks there; see the
comment above ``_limit_asm``): per thread, a packed tree of maxima (one ``max.xorsign.abs`` per two elements), one
packed compare per tensor against a 16-bit limit (the largest value not above min(threshold, stored maximum)), and
ONE barrier that ORs the flags of the CTA (``bar.red.or``), in inline PTX: after the token's stores in a batch of
about one wave, before them in a larger one (:func:`fp8_cache_launch`). Only a CTA where some element clipped or
exceeded the stored maximum counts exactly (in registers, float32) and records, with one set of atomics per CTA.
Elsewhere (other GPUs, fp32 or mixed inputs, tiles of fewer than 8 elements per thread, the interpreter) the
block-level tail: a running max of ``|x|`` per thread, two thresholds, one block reduction of a flag, and a second
read of the program's tokens where it clipped. What counting costs against ``count=False`` (the same launch) is
measured by the lab's ``benchmarks/lab/numerics.py``: benchmarks/RESULTS.md, q1 and "The fused FP8 kernel".

Inline PTX (``PTX``: an NVIDIA GPU, not the interpreter): ``mul.rm.f32`` thresholds, the packed maxima, the
per-thread tail. The portable code (float64 thresholds, float32 maxima, the block-level tail) is what the interpreter
runs and what ``inline_ptx=False`` forces (``thread_tail=False`` forces the block-level tail alone); the GPU tests
check that every build gives the same bits, counts and maxima.

Bit-exactness: the cache equals :func:`tripwire.numerics.clip.reference_quantize` bit for bit for finite inputs and
+-Inf. On sm_89+ the conversion is the hardware's ``cvt.rn.satfinite`` straight from float32 (round to nearest even,
saturating: torch's clamp-then-round). Elsewhere the kernel clamps and rounds to the FP8 grid in float32 first
(``_round_to_fp8_grid``), so that any cast gives torch's bits -- the Triton interpreter's own float-to-FP8
conversion truncates (the CPU control test shows it). NaN inputs are stored as an FP8 NaN whose bit pattern may
differ from torch's (count them with :func:`tripwire.numerics.count_nonfinite`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from ..sites import register_site
from ..triton import _callee, record_hits  # _callee: the module, see tripwire.kernels._common
from .clip import FP8_MAX, SLOT_SITE_DESCRIPTION, SLOT_SITE_NAME, ClipCounter

__all__ = ["FP8_CACHE_SLOT_SITE", "FP8CacheLaunch", "fp8_cache_launch", "quantize_kv_to_fp8_cache"]

# Registered at import, so the row exists before any capture (ClipCounter registers it in private registries too).
FP8_CACHE_SLOT_SITE = register_site(SLOT_SITE_NAME, description=SLOT_SITE_DESCRIPTION, fatal=True)

_TL_FP8 = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}
# Scale modes (a constexpr per tensor): a scalar kernel argument, a 1-element tensor, a [heads] tensor.
_SCALE_ARG, _SCALE_TENSOR, _SCALE_PER_HEAD = 0, 1, 2


# ---------------------------------------------------------------------------------------------------------- inline PTX
# The kernel's inline PTX, built as strings by the launcher (_launch) and passed to the kernel as constexprs: the
# per-thread counting tail (_tail_asm, with the packed limit of _limit_asm) and the saturating FP8 conversion
# (_cvt_asm). Why each exists and the rules the launcher keeps are in the comment below.
#
# On NVIDIA sm_90+ with 16-bit K and V the counting tail is inline PTX (THREAD_TAIL; the launcher decides, see
# _launch). Why: the block-level tail (a block reduction of a flag: shared memory, three barriers, a block-uniform
# branch) costs several times more over count=False at one token per program than this one, which needs no shared
# memory on the healthy path (benchmarks/RESULTS.md, "The fused FP8 kernel", has both).
#
# Hot path, per thread and token: a packed tree of max.xorsign.abs over its K registers and its V registers (one
# instruction per two elements; the abs is free, the sign it leaves is masked off), one packed compare per tensor
# against a 16-bit limit L, then ONE barrier that ORs the threads' flags (bar.red.or: the CTA learns whether any
# thread flagged, with no shared-memory round trip) and a CTA-uniform branch. L is the largest 16-bit value not above
# min(threshold, stored max), so "some |x| > L" is exactly "some element clipped or exceeded the stored maximum":
# bf16 keeps float32's exponent, so truncating the float32 bits (prmt) rounds a non-negative limit down; fp16 rounds
# it down with cvt.rm. A negative limit (a corrupted scale tensor) stays negative and flags every element: the exact
# test below decides. Per-head scales give a limit per element: the tree then takes max(|x| - L) (sub.rn is exact in
# sign: differences of 16-bit floats are multiples of the smallest subnormal, so a positive one never rounds to 0).
#
# Rare path (some thread of the CTA flagged): thread 0 zeroes four shared words, a barrier; each flagged thread
# counts exactly in float32 against the same float32 threshold as every other path (mul.rm: fp8_max * scale rounded
# down) and takes its max magnitude (NaN left out); per warp (activemask + redux.sync) one lane adds them into the
# shared words; a barrier; thread 0 issues the global atomics: the counts where non-zero, the maxima where they exceed
# the stored ones. One set of atomics per CTA, as the block tail has: per-warp global atomics, cheaper when healthy,
# contend on the row's two count words when every token clips and make that regime several times slower (the
# designs' figures are in benchmarks/RESULTS.md, "The fused FP8 kernel"). Lanes outside the tile carry scale = inf
# (threshold inf: never counted; they hold 0.0, never a maximum).
#
# Rules the launcher keeps: every thread runs the asm the same number of times (it holds barriers: one program-uniform
# `if ok` around it, ``pack`` = min(16, elements per thread) so that every thread has the same number of instances),
# and every element is held by exactly one thread (a replicated element would be counted twice): the tail runs only
# when the tile gives each thread at least one full 16-byte chunk, which Triton's blocked layouts never replicate.
_FP8_MAX_IMM = {448.0: "0f43E00000", 57344.0: "0f47600000"}  # 448.0 and 57344.0 as PTX float immediates


def _limit_asm(half: str, fp8_max: float) -> str:
    """PTX for ``$0`` = the packed limit ``L|L`` from ``$1`` = the float32 scale and ``$2`` = the stored maximum's
    low word (float32 bits). ``min.s32`` on float bits: both are non-negative floats (their bits order like their
    values), except a negative threshold, which stays below (negative) and flags everything."""
    imm = _FP8_MAX_IMM[fp8_max]
    if half == "bf16":
        return f"{{ .reg .b32 t; mul.rm.f32 t, $1, {imm}; min.s32 t, t, $2; prmt.b32 $0, t, t, 0x3232; }}"
    return (
        f"{{ .reg .b32 t; .reg .b16 h; mul.rm.f32 t, $1, {imm}; min.s32 t, t, $2; cvt.rm.f16.f32 h, t; "
        "mov.b32 $0, {h, h}; }"
    )


@functools.cache
def _tail_asm(pack: int, half: str, k_per_head: bool, v_per_head: bool, fp8_max: float) -> tuple[str, str]:
    """(PTX, constraints) of the per-thread tail for ``pack`` elements of K and of V (see the comment above).

    Operands, in order: ``pack`` dummy int32 outputs (the asm is kept for its side effects); K and V (``pack // 2``
    packed registers each); the limits of K and V (``pack`` each; one value per element, all equal unless per
    head); the scales of K and V (``pack`` each; inf outside the tile); the clip row's address (``pack``, 64-bit);
    the stored maxima's low words of K and V (``pack`` each). Its labels and its shared words live inside its own
    braces, so several instances per thread assemble."""
    r = pack // 2
    o_xk, o_xv = pack, pack + r
    o_lk = pack + 2 * r
    o_lv, o_sk, o_sv, o_row = o_lk + pack, o_lk + 2 * pack, o_lk + 3 * pack, o_lk + 4 * pack
    o_ek, o_ev = o_row + pack, o_row + 2 * pack
    cons = ",".join(["=r"] * pack + ["r"] * (2 * r + 4 * pack) + ["l"] * pack + ["r"] * (2 * pack))
    nan = "0x7F80" if half == "bf16" else "0x7C00"  # magnitudes above these 16-bit patterns are NaN
    imm = _FP8_MAX_IMM[fp8_max]
    a = [
        "{",
        ".shared .align 16 .b32 tw_sum[4];",  # K count, V count, K max, V max of the CTA
        ".reg .pred %p<5>, %q, %lead, %any, %first;",
        f".reg .b32 %m<{pack}>, %e<{pack}>, %d<{pack}>;",
        ".reg .b32 %a, %b, %c, %t, %n, %mx, %mask, %lane, %low, %s<4>;",
        ".reg .f32 %f;",
        ".reg .b16 %h0, %h1;",
        ".reg .b64 %w;",
    ]

    def tree(regs: list[str], name: str, op: str) -> str:
        n = 0
        while len(regs) > 1:
            nxt = []
            for i in range(0, len(regs), 2):
                a.append(f"{op} %{name}{n}, {regs[i]}, {regs[i + 1]};")
                nxt.append(f"%{name}{n}")
                n += 1
            regs = nxt
        return regs[0]

    def absmax(xo: int) -> str:  # the packed max magnitudes (two lanes; signs garbage) of one tensor's registers
        return tree([f"${xo + i}" for i in range(r)], "m", f"max.xorsign.abs.{half}x2")

    def flag(xo: int, lo: int, per_head: bool, p1: str, p2: str) -> None:
        if not per_head:
            a.append(f"and.b32 %a, {absmax(xo)}, 0x7FFF7FFF;")
            a.append(f"setp.gt.{half}x2 {p1}|{p2}, %a, ${lo};")
            return
        for i in range(r):
            a.append(f"and.b32 %e{i}, ${xo + i}, 0x7FFF7FFF;")
            a.append(f"prmt.b32 %c, ${lo + 2 * i}, ${lo + 2 * i + 1}, 0x7610;")  # element 2i's L, element 2i+1's L
            a.append(f"sub.rn.{half}x2 %e{i}, %e{i}, %c;")
        top = tree([f"%e{i}" for i in range(r)], "d", f"max.{half}x2")
        a.append("mov.b32 %c, 0;")
        a.append(f"setp.gt.{half}x2 {p1}|{p2}, {top}, %c;")

    def rare(xo: int, so: int, off_n: int, off_m: int, per_head: bool) -> None:
        a.append("mov.u32 %n, 0;")
        if not per_head:
            a.append(f"mul.rm.f32 %t, ${so}, {imm};")
        for i in range(r):
            for j in range(2):
                if per_head:
                    a.append(f"mul.rm.f32 %t, ${so + 2 * i + j}, {imm};")
                if half == "bf16":
                    a.append(f"shl.b32 %b, ${xo + i}, 16;" if j == 0 else f"and.b32 %b, ${xo + i}, 0xFFFF0000;")
                    a.append("mov.b32 %f, %b;")
                else:
                    a.append(f"mov.b32 {{%h0, %h1}}, ${xo + i};")
                    a.append(f"cvt.f32.f16 %f, %h{j};")
                a.append("abs.f32 %f, %f;")
                a.append("setp.gt.f32 %q, %f, %t;")  # NaN: false
                a.append("selp.u32 %b, 1, 0, %q;")
                a.append("add.u32 %n, %n, %b;")
        # The thread's max magnitude, NaN left out (a lane is NaN only when all its elements are), as float32 bits.
        top = absmax(xo)
        a.append(f"and.b32 %a, {top}, 0x7FFF;")
        a.append(f"setp.gt.u32 %q, %a, {nan};")
        a.append("selp.u32 %a, 0, %a, %q;")
        a.append(f"shr.u32 %b, {top}, 16;")
        a.append("and.b32 %b, %b, 0x7FFF;")
        a.append(f"setp.gt.u32 %q, %b, {nan};")
        a.append("selp.u32 %b, 0, %b, %q;")
        a.append("max.u32 %mx, %a, %b;")
        if half == "bf16":
            a.append("shl.b32 %mx, %mx, 16;")
        else:
            a.append("cvt.u16.u32 %h0, %mx;")
            a.append("cvt.f32.f16 %f, %h0;")
            a.append("mov.b32 %mx, %f;")
        # Per warp, the lowest flagged lane adds for the flagged lanes (the active ones here).
        a.append("redux.sync.add.u32 %n, %n, %mask;")
        a.append("redux.sync.max.u32 %mx, %mx, %mask;")
        a.append(f"@%lead red.shared.add.u32 [tw_sum + {off_n}], %n;")
        a.append(f"@%lead red.shared.max.u32 [tw_sum + {off_m}], %mx;")

    flag(o_xk, o_lk, k_per_head, "%p1", "%p2")
    flag(o_xv, o_lv, v_per_head, "%p3", "%p4")
    a += [
        "or.pred %p0, %p1, %p2;",
        "or.pred %p0, %p0, %p3;",
        "or.pred %p0, %p0, %p4;",
        "bar.red.or.pred %any, 0, %p0;",  # the hot path ends here when no thread of the CTA flagged
        "@!%any bra.uni TW_DONE;",
        "mov.u32 %a, %tid.x;",
        "setp.eq.u32 %first, %a, 0;",
        "@%first st.shared.v4.u32 [tw_sum], {0, 0, 0, 0};",
        "bar.sync 0;",
        "@!%p0 bra TW_JOIN;",
        "activemask.b32 %mask;",
        "mov.u32 %lane, %laneid;",
        "neg.s32 %low, %mask;",
        "and.b32 %low, %low, %mask;",
        "bfind.u32 %low, %low;",
        "setp.eq.u32 %lead, %lane, %low;",
    ]
    rare(o_xk, o_sk, 0, 8, k_per_head)
    rare(o_xv, o_sv, 4, 12, v_per_head)
    a += [
        "TW_JOIN:",
        "bar.sync 0;",
        "@!%first bra TW_DONE;",
        "ld.shared.v4.u32 {%s0, %s1, %s2, %s3}, [tw_sum];",
        # Relaxed: nothing is ordered against the row; the reader sees it complete once the kernel has finished.
        "setp.ne.u32 %q, %s0, 0;",
        "cvt.u64.u32 %w, %s0;",
        f"@%q red.relaxed.gpu.global.add.u64 [${o_row}], %w;",
        "setp.ne.u32 %q, %s1, 0;",
        "cvt.u64.u32 %w, %s1;",
        f"@%q red.relaxed.gpu.global.add.u64 [${o_row} + 8], %w;",
        f"setp.gt.u32 %q, %s2, ${o_ek};",
        "cvt.u64.u32 %w, %s2;",
        f"@%q red.relaxed.gpu.global.max.u64 [${o_row} + 16], %w;",
        f"setp.gt.u32 %q, %s3, ${o_ev};",
        "cvt.u64.u32 %w, %s3;",
        f"@%q red.relaxed.gpu.global.max.u64 [${o_row} + 24], %w;",
        "TW_DONE:",
    ]
    a += [f"mov.u32 ${i}, 0;" for i in range(pack)]
    a.append("}")
    return "\n".join(a), cons


@functools.cache
def _cvt_asm(fmt: str) -> str:
    """PTX for four float32 elements ``$1..$4`` -> four FP8 bytes in ``$0`` (element order, ``$1`` lowest), by the
    hardware's ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32`` (sm_89+). That instruction alone is torch's
    ``clamp(y, -fp8_max, fp8_max).to(fp8)``: it rounds to nearest even straight from float32, saturates finite values
    and +-Inf to +-fp8_max like the clamp, and keeps NaN a NaN. Written out, not left to ``.to(fp8)``: Triton's
    lowering of that cast varies (3.6 on sm_89 goes through float16 with round-toward-zero, which rounds twice; the
    PTX probe in the tests shows it). ``cvt`` puts its first source in the upper byte of its pair."""
    cvt = f"cvt.rn.satfinite.{fmt}x2.f32"
    return f"{{ .reg .b16 lo, hi; {cvt} lo, $2, $1; {cvt} hi, $4, $3; mov.b32 $0, {{lo, hi}}; }}"


# ------------------------------------------------------------------------------------------------------ device helpers
# The kernel's @triton.jit helpers: scales, the float32 thresholds, the packed and portable running maxima, the
# rounding to the FP8 grid, the quantised store, the guarded token lane, and the exact count of a program's
# clipped elements.


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
    """The per-thread counting tail (``_tail_asm``) over one token's K and V registers: kept for its side effects (its
    barrier, the rare path's atomics)."""
    tl.inline_asm_elementwise(
        ASM, CON, [xk, xv, lim_k, lim_v, ks, vs, row, seen_k, seen_v], dtype=tl.int32, is_pure=False, pack=PACK
    )


# ---------------------------------------------------------------------------------------------------------- the kernel
# One program per TOKENS_PER_PROGRAM tokens: the slot guard, the quantised stores, and the clip counting with the
# tail the launcher chose.


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


# -------------------------------------------------------------------------------------------------------- the launcher


def _scale_arg(scale: float | torch.Tensor, heads: int, device: torch.device, what: str) -> tuple[object, int]:
    if isinstance(scale, torch.Tensor):
        if scale.dtype != torch.float32:
            raise TypeError(f"{what} must be float32, got {scale.dtype}")
        if scale.device != device:
            raise ValueError(f"{what} is on {scale.device}, the data on {device}")
        if not scale.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
        if scale.numel() == 1:
            return scale, _SCALE_TENSOR
        if scale.dim() == 1 and scale.shape[0] == heads:
            return scale, _SCALE_PER_HEAD
        raise ValueError(
            f"{what} must be a Python float, a 1-element tensor or a [{heads}] tensor, got shape {tuple(scale.shape)}"
        )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{what} must be a Python float or a float32 tensor, got {type(scale).__name__}")
    s32 = float(np.float32(scale))  # Triton passes float arguments as float32; round the same way, then check
    if not (np.isfinite(s32) and s32 > 0):
        raise ValueError(f"{what} must be finite and > 0 as a float32, got {scale!r}")
    return s32, _SCALE_ARG


def _check_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    counter: ClipCounter,
) -> tuple[int, int, int]:
    if not isinstance(counter, ClipCounter):
        raise TypeError(f"counter must be a tripwire.numerics.ClipCounter, got {type(counter).__name__}")
    dev = counter.device
    if key.dim() != 3:
        raise ValueError(f"key must be [tokens, heads, head_dim], got shape {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value has shape {tuple(value.shape)}, key {tuple(key.shape)}; they must match")
    tokens, heads, head_dim = key.shape
    for x, what in ((key, "key"), (value, "value")):
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"{what} must be bf16, fp16 or fp32, got {x.dtype}")
        if x.device != dev:
            raise ValueError(f"{what} is on {x.device}, clip counter {counter.name!r} on {dev}")
        if x.stride(2) != 1 or x.stride(1) != head_dim:
            raise ValueError(
                f"{what} must have contiguous heads and head_dim (strides (*, {head_dim}, 1)), got strides "
                f"{tuple(x.stride())}; only the token stride may be arbitrary"
            )
    for c, what in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if c.dtype != counter.fp8_dtype:
            raise TypeError(
                f"{what} must be {counter.fp8_dtype} (clip counter {counter.name!r} is {counter.fmt}), got {c.dtype}"
            )
        if c.device != dev:
            raise ValueError(f"{what} is on {c.device}, clip counter {counter.name!r} on {dev}")
        if c.dim() not in (3, 4) or tuple(c.shape[-2:]) != (heads, head_dim):
            raise ValueError(
                f"{what} must be [num_blocks, block_size, {heads}, {head_dim}] or [num_slots, {heads}, {head_dim}], "
                f"got shape {tuple(c.shape)}"
            )
        if not c.is_contiguous():
            raise ValueError(f"{what} must be contiguous (slots are addressed as slot * heads * head_dim)")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)}, k_cache {tuple(k_cache.shape)}; they must match")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != tokens:
        raise ValueError(f"slot_mapping must be [{tokens}] (one slot per token), got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.device != dev or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping must be contiguous on {dev}, got {slot_mapping.device}")
    num_slots = k_cache.numel() // (heads * head_dim) if heads * head_dim else 0
    if num_slots == 0:
        raise ValueError("the FP8 cache holds no slot")
    return tokens, heads, head_dim


_DEVICE_PROPS: dict[torch.device, tuple[int, tuple[int, int]]] = {}
# Launch shape, chosen by benchmarks/sweep_fused.py (warps and tokens per program; its figures are in
# benchmarks/RESULTS.md, "The fused FP8 kernel"): one token per program, counted or not -- 2 warps (512 tile elements
# per warp), or 4 below _SMALL_BATCH_TOKENS_PER_SM tokens per SM, where more warps per token fill the GPU.
# Multi-token programs pay the counting tail once per several tokens, which shrinks the counted kernel's ratio to its
# own twin, but make both kernels slower. So the counted and uncounted kernels share one shape, and what counting
# costs is measured against exactly what count=False runs.
_LEAN_TILE_PER_WARP = 512
_SMALL_TILE_PER_WARP = 256
_SMALL_BATCH_TOKENS_PER_SM = 32


def _device_props(device: torch.device) -> tuple[int, tuple[int, int]]:
    """(SM count, compute capability): cached host properties (no sync)."""
    props = _DEVICE_PROPS.get(device)
    if props is None:
        p = torch.cuda.get_device_properties(device)
        props = _DEVICE_PROPS[device] = (p.multi_processor_count, (p.major, p.minor))
    return props


def _launch_config(tokens: int, tile: int, device: torch.device, small: bool) -> tuple[int, int]:
    """``(num_warps, tokens_per_program)`` for a batch of ``tokens`` tokens whose padded ``heads x head_dim`` tile has
    ``tile`` elements (see the sweep note above); the same with and without counting. ``small``: the batch is small
    for the GPU it runs on (:func:`_small_batch`; the caller computes it once, since the tail's placement follows the
    same line). On the CPU (the interpreter) the shape only matters to coverage: small batches run one token per
    program, larger ones four (the loop)."""
    small_warps = max(1, min(8, tile // _SMALL_TILE_PER_WARP))
    if device.type != "cuda":
        return small_warps, (1 if tokens < 64 else 4)
    if small:
        return small_warps, 1
    return max(1, min(8, tile // _LEAN_TILE_PER_WARP)), 1


def _small_batch(tokens: int, device: torch.device, sms: int | None = None) -> bool:
    """Whether a batch of ``tokens`` tokens is small for ``device`` (fewer than _SMALL_BATCH_TOKENS_PER_SM per SM): its
    programs run in about one wave. There the per-thread tail runs after the token's stores (TAIL_LAST): a
    program's barrier between its loads and its stores lengthens the one wave by its latency, while after the
    stores it waits beside them; in a batch of many waves, where a program's end is what the next one waits for,
    the barrier before the stores costs less (benchmarks/sweep_fused.py measures both). ``sms``: the SM count to plan
    for (None: ``device``'s own; :func:`fp8_cache_launch`). The launch shape follows the same line
    (:func:`_launch_config`)."""
    if device.type != "cuda":
        return False
    return tokens < _SMALL_BATCH_TOKENS_PER_SM * (_device_props(device)[0] if sms is None else sms)


def _thread_tail_ok(
    ptx: bool, capability: tuple[int, int], key_dtype: torch.dtype, value_dtype: torch.dtype, per_thread: int
) -> bool:
    """Whether the per-thread counting tail (see ``_tail_asm``) can run: inline PTX on sm_90+ (packed bf16 compares
    and subtractions), one 16-bit dtype for K and V, and at least one 16-byte chunk (8 elements) of the tile per
    thread, so that no element is held by two threads (it would be counted twice)."""
    sixteen_bit = key_dtype in (torch.bfloat16, torch.float16)
    return ptx and capability >= (9, 0) and key_dtype == value_dtype and sixteen_bit and per_thread >= 8


def _inline_ptx(device: torch.device) -> bool:
    """Whether the kernel may use inline PTX: an NVIDIA GPU, compiled (the interpreter cannot run PTX; ROCm has
    none)."""
    return device.type == "cuda" and torch.version.hip is None and not _callee.interpreting()


class FP8CacheLaunch(NamedTuple):
    """How :func:`quantize_kv_to_fp8_cache` launches for one batch (:func:`fp8_cache_launch`)."""

    num_warps: int
    """Warps per program."""
    tokens_per_program: int
    """Tokens each program handles (the grid is ``ceil(tokens / tokens_per_program)`` programs)."""
    tail_after_stores: bool
    """Where the per-thread counting tail goes, where it runs (sm_90+, bf16 or fp16 K and V of one dtype, at least 8
    tile elements per thread): after the token's stores (a batch of about one wave) or before them."""
    inline_ptx: bool
    """Whether the kernel uses inline PTX: an NVIDIA GPU, compiled (never the CPU, the Triton interpreter or ROCm)."""


def fp8_cache_launch(
    tokens: int, heads: int, head_dim: int, device: torch.device | str, *, sm_count: int | None = None
) -> FP8CacheLaunch:
    """The launch shape :func:`quantize_kv_to_fp8_cache` picks for ``tokens`` tokens of ``heads x head_dim`` on
    ``device``: the same with and without counting, so that what counting costs is measured against exactly what
    ``count=False`` runs. A kernel engineer's read-only view of the launcher's decisions (what a profile's grid and
    warps should show, where the counting tail sits and whether the PTX path runs); it launches nothing.

    ``sm_count``: plan for a GPU with that many SMs instead of ``device``'s own (then no CUDA device need be
    present); by default a CUDA ``device``'s SM count is read once and cached. ``device`` of another type: the
    shape the Triton interpreter runs (one token per program below 64 tokens, four from 64, for coverage of the
    kernel's loop). ValueError for a non-positive size or SM count."""
    for name, n in (("tokens", tokens), ("heads", heads), ("head_dim", head_dim), ("sm_count", sm_count)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < (0 if name == "tokens" else 1)):
            least = ">= 0" if name == "tokens" else ">= 1"
            raise ValueError(f"fp8_cache_launch: {name} must be an int {least}, got {n!r}")
    dev = torch.device(device)
    tile = triton.next_power_of_2(heads) * triton.next_power_of_2(head_dim)
    small = _small_batch(tokens, dev, sm_count)
    num_warps, tpp = _launch_config(tokens, tile, dev, small)
    return FP8CacheLaunch(num_warps, tpp, small, _inline_ptx(dev))


def _launch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor,
    v_scale: float | torch.Tensor,
    counter: ClipCounter,
    *,
    count: bool,
    guard: bool,
    vec: int | None = None,
    config: tuple[int, int] | None = None,
    inline_ptx: bool | None = None,
    thread_tail: bool | None = None,
    tail_last: bool | None = None,
    tail_override: tuple[str, str, int] | None = None,
    rne_cast: bool | None = None,
    kernel: Any = None,
) -> None:
    """The launch behind :func:`quantize_kv_to_fp8_cache`. ``count``/``guard`` compile the counting and the slot
    guard in or out (the benchmark's twins); ``vec`` overrides the running max's in-thread chunk (tests: any power
    of two up to head_dim's block gives the same counts); ``config`` overrides ``(num_warps, tokens_per_program)``
    (the benchmark's same-shape twin); ``inline_ptx=False`` forces the portable code on an NVIDIA GPU (tests: both
    paths give the same bits and counts); ``thread_tail`` forces the per-thread counting tail on (an error where it
    cannot run) or off (the block-level tail, what other GPUs and shapes run); ``tail_last`` places the per-thread tail
    after the token's stores (True) or before them (False) instead of by the batch's size (``_small_batch``);
    ``tail_override`` = ``(asm, constraints, pack)`` replaces the generated tail (tests' controls only);
    ``rne_cast=False`` forces the clamp and the float32 grid rounding before the cast on sm_89+ (what older GPUs and
    the interpreter run; ``True`` raises where the cast is not the hardware's direct round-to-nearest-even); ``kernel``
    launches another JITFunction of the same kernel (the benchmark's loads of the code at other addresses:
    :func:`tripwire.testing.jit_copy`) instead of the module's."""
    tokens, heads, head_dim = _check_inputs(key, value, k_cache, v_cache, slot_mapping, counter)
    ks, k_mode = _scale_arg(k_scale, heads, counter.device, "k_scale")
    vs, v_mode = _scale_arg(v_scale, heads, counter.device, "v_scale")
    block_h = triton.next_power_of_2(heads)
    block_d = triton.next_power_of_2(head_dim)
    small = _small_batch(tokens, counter.device)
    num_warps, tpp = config if config is not None else _launch_config(tokens, block_h * block_d, counter.device, small)
    if num_warps < 1 or num_warps & (num_warps - 1) or tpp < 1:
        raise ValueError(f"config must be (power-of-two num_warps, tokens_per_program >= 1), got {config}")
    # The contiguous elements one thread holds along head_dim: a 16-byte load of the wider input, at most what the
    # tile gives each thread. The running max reduces over exactly these, in-thread when the loads vectorise (16-byte
    # aligned rows; otherwise the chunk's max takes warp shuffles: slower, still exact). Any power of two is exact.
    chunk = min(
        16 // max(key.element_size(), value.element_size()), block_d, max(1, block_h * block_d // (32 * num_warps))
    )
    if vec is not None:
        if vec < 1 or vec > block_d or vec & (vec - 1):
            raise ValueError(f"vec must be a power of two in [1, {block_d}], got {vec}")
        chunk = vec
    if tokens == 0:  # after every check: a bad argument is an error even with nothing to write
        return
    ptx = _inline_ptx(counter.device) if inline_ptx is None else inline_ptx and _inline_ptx(counter.device)
    cc = _device_props(counter.device)[1] if ptx else (0, 0)
    # The packed running max needs max.xorsign.abs (sm_86+) and a 16-bit input.
    packed_ok = ptx and cc >= (8, 6)
    per_thread = block_h * block_d // (32 * num_warps)
    tail_ok = _thread_tail_ok(ptx, cc, key.dtype, value.dtype, per_thread)
    if thread_tail and not tail_ok:
        raise ValueError(
            "thread_tail=True needs inline PTX on sm_90+, bf16 or fp16 K and V of one dtype and at least 8 tile "
            f"elements per thread; got ptx={ptx}, capability={cc}, {key.dtype}/{value.dtype}, {per_thread} per thread"
        )
    use_tail = count and (tail_ok if thread_tail is None else thread_tail)
    # float32 -> FP8 in one hardware instruction that rounds like torch (cvt.rn.satfinite, sm_89+; _quantize_store),
    # four elements per asm instance: every thread must hold a multiple of four.
    rne_ok = ptx and cc >= (8, 9) and per_thread >= 4
    if rne_cast and not rne_ok:
        raise ValueError(
            "rne_cast=True needs inline PTX on sm_89+ (the direct float32 -> FP8 conversion) and at least 4 tile "
            f"elements per thread; got ptx={ptx}, capability={cc}, {per_thread} per thread"
        )
    use_cvt = rne_ok if rne_cast is None else rne_cast
    fp8_max = FP8_MAX[counter.fmt]
    if use_tail:
        half = "bf16" if key.dtype == torch.bfloat16 else "f16"
        tail_pack = min(16, per_thread)
        tail_asm, tail_con = _tail_asm(tail_pack, half, k_mode == _SCALE_PER_HEAD, v_mode == _SCALE_PER_HEAD, fp8_max)
        limit_asm = _limit_asm(half, fp8_max)
        if tail_override is not None:
            tail_asm, tail_con, tail_pack = tail_override
    else:
        tail_pack, tail_asm, tail_con, limit_asm = 1, "", "", ""
    (_fp8_kv_cache_kernel if kernel is None else kernel)[(triton.cdiv(tokens, tpp),)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        ks,
        vs,
        counter.ctr,
        counter.slot_ctr,
        k_cache.numel() // (heads * head_dim),
        tokens,
        key.stride(0),
        value.stride(0),
        H=heads,
        D=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        K_SCALE_MODE=k_mode,
        V_SCALE_MODE=v_mode,
        FP8_MAX=fp8_max,
        FP8_TYPE=_TL_FP8[counter.fmt],
        COUNT=count,
        GUARD=guard,
        TOKENS_PER_PROGRAM=tpp,
        VEC=chunk,
        PTX=ptx,
        K_PACKED=packed_ok and key.element_size() == 2,
        V_PACKED=packed_ok and value.element_size() == 2,
        THREAD_TAIL=use_tail,
        TAIL_PACK=tail_pack,
        TAIL_ASM=tail_asm,
        TAIL_CON=tail_con,
        TAIL_LAST=use_tail and (small if tail_last is None else bool(tail_last)),
        LIMIT_ASM=limit_asm,
        CVT_ASM=_cvt_asm(counter.fmt) if use_cvt else "",
        num_warps=num_warps,
    )


def quantize_kv_to_fp8_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor,
    v_scale: float | torch.Tensor,
    counter: ClipCounter,
    *,
    count: bool = True,
) -> None:
    """Write ``key``/``value`` ``[tokens, heads, head_dim]`` (bf16/fp16/fp32; heads and head_dim contiguous, any
    token stride) into the FP8 caches ``[num_blocks, block_size, heads, head_dim]`` (or ``[num_slots, heads,
    head_dim]``; contiguous; dtype ``counter.fp8_dtype``) at ``slot_mapping[t]`` (int32/int64 ``[tokens]``), as
    ``clamp(x / scale, -fp8_max, fp8_max).to(fp8)``, and count clipping into ``counter``'s row (``count=False``
    writes only).

    Negative slots are skipped (not written, not counted). A slot ``>= num_slots`` is masked (not written) and
    counted at the fatal site ``numerics.fp8_cache.slot``. Scales: Python floats (used as float32), 1-element
    float32 tensors, or ``[heads]`` float32 tensors. Everything is checked before the launch; the launch itself
    allocates nothing and never syncs, so it can be captured in a CUDA graph (compile it once before capturing).
    """
    _launch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, counter, count=count, guard=True)
