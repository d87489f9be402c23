"""Fused FP8 KV-cache write: quantise K/V into a paged FP8 cache through a slot mapping and count clipping in the
same pass.

Each program handles ``TOKENS_PER_PROGRAM`` tokens (one on the GPU: see ``_launch_config``). For each it loads the
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
about one wave, before them in a larger one (``_small_batch``). Only a CTA where some element clipped or
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

from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from ..sites import register_site
from ..triton import _callee  # the module: see tripwire.kernels._common
from ._fused_kernel import _fp8_kv_cache_kernel
from ._fused_ptx import _cvt_asm, _limit_asm, _tail_asm
from .clip import FP8_MAX, SLOT_SITE_DESCRIPTION, SLOT_SITE_NAME, ClipCounter

__all__ = ["FP8_CACHE_SLOT_SITE", "quantize_kv_to_fp8_cache"]

# Registered at import, so the row exists before any capture (ClipCounter registers it in private registries too).
FP8_CACHE_SLOT_SITE = register_site(SLOT_SITE_NAME, description=SLOT_SITE_DESCRIPTION, fatal=True)

_TL_FP8 = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}
# Scale modes (a constexpr per tensor): a scalar kernel argument, a 1-element tensor, a [heads] tensor.
_SCALE_ARG, _SCALE_TENSOR, _SCALE_PER_HEAD = 0, 1, 2


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


def _launch_config(tokens: int, tile: int, device: torch.device) -> tuple[int, int]:
    """``(num_warps, tokens_per_program)`` for a batch of ``tokens`` tokens whose padded ``heads x head_dim`` tile has
    ``tile`` elements (see the sweep note above); the same with and without counting. On the CPU (the interpreter)
    the shape only matters to coverage: small batches run one token per program, larger ones four (the loop)."""
    small_warps = max(1, min(8, tile // _SMALL_TILE_PER_WARP))
    if device.type != "cuda":
        return small_warps, (1 if tokens < 64 else 4)
    if _small_batch(tokens, device):
        return small_warps, 1
    return max(1, min(8, tile // _LEAN_TILE_PER_WARP)), 1


def _small_batch(tokens: int, device: torch.device) -> bool:
    """Whether a batch of ``tokens`` tokens is small for ``device`` (fewer than _SMALL_BATCH_TOKENS_PER_SM per SM): its
    programs run in about one wave. There the per-thread tail runs after the token's stores (TAIL_LAST): a
    program's barrier between its loads and its stores lengthens the one wave by its latency, while after the
    stores it waits beside them; in a batch of many waves, where a program's end is what the next one waits for,
    the barrier before the stores costs less (benchmarks/sweep_fused.py measures both)."""
    return device.type == "cuda" and tokens < _SMALL_BATCH_TOKENS_PER_SM * _device_props(device)[0]


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
    num_warps, tpp = config if config is not None else _launch_config(tokens, block_h * block_d, counter.device)
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
        TAIL_LAST=use_tail and (_small_batch(tokens, counter.device) if tail_last is None else bool(tail_last)),
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
