"""The fused FP8 kernel's inline PTX, built as strings by the launcher (:mod:`tripwire.numerics.fused`) and passed to
the kernel as constexprs: the per-thread counting tail (``_tail_asm``, with the packed limit of ``_limit_asm``) and the
saturating FP8 conversion (``_cvt_asm``). Why each exists and the rules the launcher keeps are in the comment below."""

from __future__ import annotations

import functools

# ----------------------------------------------------------------------------------------- the per-thread tail
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
