"""Fused FP8 KV-cache write: quantise K/V into a paged FP8 cache through a slot mapping and count clipping in the
same pass.

Each program handles a few tokens (``TOKENS_PER_PROGRAM``). For each it loads the token's K and V rows and its slot,
skips the token when the slot is negative (padding of a captured batch), guards the slot against the cache size (a
slot past the cache is masked -- nothing is written -- and counted at the fatal site ``numerics.fp8_cache.slot``,
row = token index, value = slot), then for K and V: ``y = x / scale`` (IEEE division), ``clamp(y, -fp8_max,
fp8_max)``, round-to-nearest-even cast to FP8, store. With ``COUNT`` the same registers give the number of elements
with ``|x| > fp8_max * scale`` (exact, see :mod:`tripwire.numerics.clip`) and the max magnitude, recorded in the
layer's clip row by per-program atomics: two maxima always, the counts only from a program that clipped (the
``|x|`` tested is the input before scaling; NaN neither clips nor counts as a maximum; skipped and masked tokens
count nothing).

Hot-path cost of counting: a running max of ``|x|`` kept per thread (one fmax per element, no cross-thread work per
token), a two-stage K/V reduction per program (in-warp integer maxima, then one joint cross-warp round trip) and
two fire-and-forget atomic maxima per program. A program whose maximum exceeds its threshold counts exactly in a
second read of its tokens (the fault case pays, the healthy case does not). ``benchmarks/bench_numerics.py``
measures it against the same kernel with ``COUNT=False, GUARD=False``: on an H200 +7.1..8.1 % (the kernel is
issue-bound: the division, clamp and FP8 rounding are ~30 instructions per element, the running max is one more,
and the per-program reduction, thresholds and atomics are the rest; by SASS count at 4 tokens per program, 2001
instructions per program bare against 2158 counted).

Bit-exactness: the cache equals :func:`tripwire.numerics.clip.reference_quantize` bit for bit for finite inputs on
the GPU (the PTX conversion is ``cvt.rn.satfinite``, torch's is round-to-nearest-even; after the clamp both agree).
NaN inputs are stored as an FP8 NaN whose bit pattern may differ from torch's (count them with
:func:`tripwire.numerics.count_nonfinite`). Under ``TRITON_INTERPRET=1`` the interpreter's own float-to-FP8
conversion truncates instead of rounding, so on the CPU only values that are exact in FP8 after scaling match (the
CPU tests use those; the GPU tests use random data).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ..sites import register_site
from ..triton import record_hits
from .clip import FP8_MAX, SLOT_SITE_DESCRIPTION, SLOT_SITE_NAME, ClipCounter

__all__ = ["FP8_CACHE_SLOT_SITE", "quantize_kv_to_fp8_cache"]

# Registered at import, so the row exists before any capture (ClipCounter registers it in private registries too).
FP8_CACHE_SLOT_SITE = register_site(SLOT_SITE_NAME, description=SLOT_SITE_DESCRIPTION, fatal=True)

_TL_FP8 = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}
# Scale modes (a constexpr per tensor): a scalar kernel argument, a 1-element tensor, a [heads] tensor.
_SCALE_ARG, _SCALE_TENSOR, _SCALE_PER_HEAD = 0, 1, 2


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
def _threshold(s, FP8_MAX: tl.constexpr):
    # fp8_max * s is exact in float64 (24 x 3 significant bits); round it DOWN to float32, so that for every
    # float32 |x|: |x| > T  <=>  |x| > fp8_max * s. Same arithmetic as clip._device_threshold.
    c = s.to(tl.float64) * FP8_MAX
    t = c.to(tl.float32)
    below = (t.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
    return tl.where(t.to(tl.float64) > c, below, t)


@triton.jit
def _round_to_fp8_grid(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr, SUB_SCALE: tl.constexpr):
    """Round float32 ``y`` (already clamped to the FP8 range) to the nearest FP8 value, ties to even, in float32.

    Why not just ``.to(fp8)``: the cast's rounding is not the same on every backend (the Triton interpreter
    truncates; see the control test). After this rounding the value is exactly representable in FP8, so whatever
    the cast's rounding mode, the bits equal torch's round-to-nearest-even.
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
):
    # Correctly rounded division (div.rn.f32), as torch's CUDA `x / s` with a tensor divisor computes it. Neither
    # `/` nor `tl.fdiv(..., ieee_rounding=True)` gives that on Triton 3.6: its fdiv ignores ieee_rounding and
    # lowers to the approximate div.full.f32 (measured on an H200: 18432 / 0.6f came out 30720.0, not 30719.998,
    # which moved 0.75 % of e5m2 bytes one step). tl.math.div_rn does not broadcast, hence the explicit one
    # (adding 0.0 to a positive scale is exact).
    y = tl.math.div_rn(x, s + tl.zeros_like(x))
    # Saturate before the cast, propagating NaN like torch.clamp (the default drops it).
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
def _max2(a0, b0, a1, b1):
    return tl.maximum(a0, a1), tl.maximum(b0, b1)


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
):
    # Several tokens per program, reduced ONCE at the end: per-token block reductions and counter atomics dominated
    # this short kernel. The uncounted twin runs the same loop, so the comparison stays fair.
    # Counting on the hot path is a running max of |x|. "Some element of the program clipped" is exactly "the
    # program's max |x| exceeds its threshold", so only such a program (rare: the fault case) pays for an exact
    # count, in a second pass (_count_clipped). Counting every element in the main pass (compare, convert, add, plus
    # a bit-pattern max) cost +42..58 % on an H200.
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    src = h * D + d
    in_tile = (h < H) & (d < D)
    ks = _load_scale(k_scale, h, H, K_SCALE_MODE)
    vs = _load_scale(v_scale, h, H, V_SCALE_MODE)
    # e5m2: 2 mantissa bits, min normal 2**-14 (fp32 exponent 113), subnormal step 2**-16;
    # e4m3fn: 3 mantissa bits, min normal 2**-6 (exponent 121), subnormal step 2**-9.
    MANT: tl.constexpr = 2 if FP8_MAX == 57344.0 else 3
    MIN_EXP: tl.constexpr = 113 if FP8_MAX == 57344.0 else 121
    SUB_SCALE: tl.constexpr = 65536.0 if FP8_MAX == 57344.0 else 512.0
    if COUNT:
        # Running maxima kept per thread: [BLOCK_H, BLOCK_D // VEC], VEC = the contiguous elements one thread holds
        # (its 16-byte load), so the per-token max over VEC is in-thread fmax only. A per-head row reduction per
        # token (warp shuffles) measured +12 % over the twin on an H200, this +9 %; a full-tile accumulator holds
        # VEC times more registers for the same instruction count.
        mx_k = tl.zeros([BLOCK_H, BLOCK_D // VEC], tl.float32)
        mx_v = tl.zeros([BLOCK_H, BLOCK_D // VEC], tl.float32)
    for i in range(TOKENS_PER_PROGRAM):
        tok = tl.program_id(0) * TOKENS_PER_PROGRAM + i
        tok64 = tok.to(tl.int64)
        # K and V are loaded first, masked by the batch only, not by the slot: no store can sit between the loads
        # (the compiler cannot move a load across a store to a possibly aliasing cache) and the loads need not wait
        # for the slot's load. Padding rows are read (they are inside the batch) and masked below.
        ld = in_tile & ((h * 0 + d * 0 + (tok < num_tokens).to(tl.int32)) != 0)
        xk = tl.load(key_ptr + tok64 * key_stride + src, mask=ld, other=0.0).to(tl.float32)
        xv = tl.load(value_ptr + tok64 * value_stride + src, mask=ld, other=0.0).to(tl.float32)
        raw, slot, lane, ok = _token_lane(slot_ptr, tok, num_tokens, num_slots, in_tile, h, d, GUARD)
        if COUNT:
            # Out-of-tile lanes loaded 0.0; a token that is not written (padding, a bad slot) is left out by `ok`.
            # NaN is left out (maxnum returns the other operand), as in ClipCounter.count.
            pk = tl.max(tl.reshape(tl.abs(xk), [BLOCK_H, BLOCK_D // VEC, VEC]), axis=2)
            pv = tl.max(tl.reshape(tl.abs(xv), [BLOCK_H, BLOCK_D // VEC, VEC]), axis=2)
            mx_k = tl.maximum(mx_k, tl.where(ok, pk, 0.0))
            mx_v = tl.maximum(mx_v, tl.where(ok, pv, 0.0))
        if GUARD:
            # A token whose slot is past the cache: masked in _token_lane, recorded here (once) with the raw slot.
            record_hits(slot_ctr_ptr, raw >= num_slots, tok, raw)
        dst = slot * (H * D) + src
        _quantize_store(xk, k_cache_ptr + dst, lane, ks, FP8_MAX, FP8_TYPE, MANT, MIN_EXP, SUB_SCALE)
        _quantize_store(xv, v_cache_ptr + dst, lane, vs, FP8_MAX, FP8_TYPE, MANT, MIN_EXP, SUB_SCALE)
    if COUNT:
        # The program's tail, two stages. (1) Each quarter of the running maxima is reduced on its own, as int32
        # bits: the maxima are non-negative and never NaN (maxnum drops it), so their bits order like their values
        # and the reduction is exact; a single-operand integer max of a warp's lanes is one redux.sync where a
        # float max is five shuffle+fmax levels (with 4 warps, as the benchmark's shape launches, each quarter is
        # one warp's; with other warp counts the grouping only changes the cost, never the result). (2) ONE joint reduction of the (K, V) pairs across the quarters (a
        # tuple reduce shares the shared-memory round trip and its barriers). The clip test reuses the maxima (one
        # threshold) or compares per head. Measured on an H200 against the one-stage float reduction: +7.1..8.1 %
        # over the twin instead of +8.1..8.9 %, bit-identical caches and counts.
        thr_k = _threshold(ks, FP8_MAX)
        thr_v = _threshold(vs, FP8_MAX)
        N: tl.constexpr = BLOCK_H * (BLOCK_D // VEC)
        G: tl.constexpr = 4 if N % 4 == 0 else 1
        q_k = tl.max(tl.reshape(mx_k.to(tl.int32, bitcast=True), [G, N // G]), axis=1)
        q_v = tl.max(tl.reshape(mx_v.to(tl.int32, bitcast=True), [G, N // G]), axis=1)
        b_k, b_v = tl.reduce((q_k, q_v), 0, _max2)
        m_k = b_k.to(tl.float32, bitcast=True)
        m_v = b_v.to(tl.float32, bitcast=True)
        over_k = _over(mx_k, m_k, thr_k, K_SCALE_MODE)
        over_v = _over(mx_v, m_v, thr_v, V_SCALE_MODE)
        # The rare path: exact counts, from a second read of this program's tokens.
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
        # Max magnitude as float32 bits (monotone for non-negative floats, so an integer atomic max is valid).
        # Unconditional and relaxed: a reduction the program does not wait for (no result is read back). Reading
        # the stored maxima first to skip settled ones cost more on an H200 (+8.9 % vs +8.1 % over the twin): the
        # read's latency lands in every program's tail. Relaxed is enough: nothing is ordered against these slots,
        # and the reader sees them complete once the kernel has finished.
        tl.atomic_max(clip_ctr_ptr + 2, b_k.to(tl.int64), sem="relaxed")
        tl.atomic_max(clip_ctr_ptr + 3, b_v.to(tl.int64), sem="relaxed")


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


_SM_COUNT: dict[torch.device, int] = {}
# H200 sweep (bench_numerics.py shapes, 2048..32768 tokens): 4 tokens per program was the fastest counted kernel at
# every size. More tokens per program spread the per-program reduction thinner (the ratio to the twin drops to
# +4..6 % at 8-32) but the kernel itself gets 5-20 % slower (fewer, longer programs); an even split over a
# persistent grid of 8-32 programs per SM was slower still.
_MAX_TOKENS_PER_PROGRAM = 4


def _tokens_per_program(tokens: int, device: torch.device) -> int:
    """Tokens per program: the largest power of two, at most _MAX_TOKENS_PER_PROGRAM, that leaves at least two
    programs per SM (1 when the batch has fewer than four tokens per SM). A constexpr: at most three compiled
    variants. The SM count is a cached host property (no sync)."""
    if device.type != "cuda":
        return 1 if tokens < 64 else 4
    sms = _SM_COUNT.get(device)
    if sms is None:
        sms = _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    per = max(1, tokens // (2 * sms))
    return min(_MAX_TOKENS_PER_PROGRAM, 1 << (per.bit_length() - 1))


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
) -> None:
    """The launch behind :func:`quantize_kv_to_fp8_cache`. ``count``/``guard`` compile the counting and the slot
    guard in or out (the benchmark's twins); ``vec`` overrides the running max's in-thread chunk (tests: any power
    of two up to head_dim's block gives the same counts)."""
    tokens, heads, head_dim = _check_inputs(key, value, k_cache, v_cache, slot_mapping, counter)
    ks, k_mode = _scale_arg(k_scale, heads, counter.device, "k_scale")
    vs, v_mode = _scale_arg(v_scale, heads, counter.device, "v_scale")
    block_h = triton.next_power_of_2(heads)
    block_d = triton.next_power_of_2(head_dim)
    num_warps = max(1, min(8, block_h * block_d // 256))
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
    if tokens == 0:
        return
    tpp = _tokens_per_program(tokens, counter.device)
    _fp8_kv_cache_kernel[(triton.cdiv(tokens, tpp),)](
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
        FP8_MAX=FP8_MAX[counter.fmt],
        FP8_TYPE=_TL_FP8[counter.fmt],
        COUNT=count,
        GUARD=guard,
        TOKENS_PER_PROGRAM=tpp,
        VEC=chunk,
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
