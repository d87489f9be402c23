"""The FP8 clip count of a cache write as ONE launch: :func:`count_clipped` counts, for one layer's new K and V
(``[tokens, heads, head_dim]``, each token's ``heads * head_dim`` values contiguous), the elements a per-tensor FP8
scale saturates and the largest magnitude seen, into a :class:`tripwire.numerics.ClipCounter`'s row, with the exact
comparison of :mod:`tripwire.numerics.clip` (``|x| > fp8_max * scale``, the ceiling rounded down to float32, formed
on the device from the scale tensor the cache write itself reads).

Why a kernel and not :meth:`ClipCounter.count`'s torch ops: an engine writes its cache once per layer per step, and a
dozen elementwise launches per layer (abs, compare, sum, masks, max, for K and for V) is hundreds of launches per
decode step; this is one, with no temporaries (nothing to allocate inside a CUDA graph's capture) and no host sync.
Tokens past ``slot_mapping``'s length (a captured batch's padding) and tokens whose slot is negative (padding the
cache write skips) are not counted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .clip import FP8_MAX, K_COUNT, K_MAX, V_COUNT, V_MAX, ClipCounter

__all__ = ["count_clipped"]

# Elements per program per tensor (tokens x heads x head_dim; < 2**16: the packed counts). A decode step's launch is
# latency, not bandwidth: a program of one 8 x 128 token (8 elements a thread) ends sooner than one of four tokens,
# and more programs cost nothing at decode sizes (benchmarks/bench_clip_count.py compares the two).
_ELEMS = 1024
# The row's slots, as constexprs: a compiled Triton kernel reads no plain Python global.
_KC, _VC, _KM, _VM = (tl.constexpr(x) for x in (K_COUNT, V_COUNT, K_MAX, V_MAX))


@triton.jit
def _threshold(scale_ptr, FMAX: tl.constexpr):
    """The float32 ``T`` with ``x > T`` <=> ``x > FMAX * scale`` for every float32 ``x``: the float64 product (exact)
    rounded to float32, then one step down where rounding went up."""
    c = tl.load(scale_ptr).to(tl.float64) * FMAX
    t = c.to(tl.float32)
    down = (t.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
    return tl.where(t.to(tl.float64) > c, down, t)


@triton.jit
def _seen(ctr_ptr, MAX: tl.constexpr):
    """The row's stored max magnitude as a float32 (the low 32 bits of its word; 0.0 for a zeroed row)."""
    return tl.load(ctr_ptr + MAX).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _raise_max(ctr_ptr, a, m, MAX: tl.constexpr):
    # NaN is left out of the max (its bits sort above +inf); +inf stays (it was clipped). Non-negative float32 bits
    # order like the values: an integer max keeps the largest magnitude.
    top = tl.max(tl.where(m & (a == a), a, 0.0), axis=None)
    tl.atomic_max(ctr_ptr + MAX, top.to(tl.int32, bitcast=True).to(tl.int64), sem="relaxed")


# The step's token count changes every call: not specialised on (a count of 1 would compile a variant mid-serving).
@triton.jit(do_not_specialize=["n"])
def _clip_count_kernel(k_ptr, v_ptr, slot_ptr, ks_ptr, vs_ptr, ctr_ptr, n, k_stride, v_stride, HD: tl.constexpr,
                       HDP: tl.constexpr, TOK: tl.constexpr, FMAX: tl.constexpr):  # fmt: skip
    tok = tl.program_id(0) * TOK + tl.arange(0, TOK)[:, None]
    e = tl.arange(0, HDP)[None, :]
    live = tok < n
    inside = live & (e < HD)
    # A decode step calls this once per layer on a few KiB, so its time is the chain of dependent memory round
    # trips, not bandwidth. Every load is issued before any result is used: the K/V loads are masked by the batch
    # bound only (not by the slot, which would make them wait for the slot's load), the slot's padding mask is
    # applied afterwards, and the row's stored maxima are read in the same wave.
    slot = tl.load(slot_ptr + tok, mask=live, other=-1)
    k = tl.load(k_ptr + tok.to(tl.int64) * k_stride + e, mask=inside, other=0).to(tl.float32)
    v = tl.load(v_ptr + tok.to(tl.int64) * v_stride + e, mask=inside, other=0).to(tl.float32)
    kt = _threshold(ks_ptr, FMAX)
    vt = _threshold(vs_ptr, FMAX)
    kseen = _seen(ctr_ptr, _KM)
    vseen = _seen(ctr_ptr, _VM)
    m = inside & (slot >= 0)
    ka, va = tl.abs(k), tl.abs(v)
    # ONE reduction for four per-program counts, 16 bits each (a program holds at most max(_ELEMS, HDP) <= 2**15
    # elements per tensor: no field carries into the next): K clipped, V clipped, K above the stored max, V above it
    # (NaN compares false: never above). Each field is read back masked: the top one may reach bit 63.
    flags = (
        ((ka > kt) & m).to(tl.int64)
        | (((va > vt) & m).to(tl.int64) << 16)
        | (((ka > kseen) & m).to(tl.int64) << 32)
        | (((va > vseen) & m).to(tl.int64) << 48)
    )
    both = tl.sum(flags, axis=None)
    # Atomics only where something changes: a healthy step clips nothing, and once the maxima have settled no program
    # raises them, so the common launch writes nothing (and a prefill's thousands of programs do not queue on the
    # row's two max words).
    # Relaxed: the row's words are independent counters nobody orders against within the step (the reader and the
    # verdict read them after the stream's later work). A stored max read stale low only costs a redundant atomic_max.
    kc = both & 0xFFFF
    vc = (both >> 16) & 0xFFFF
    if kc > 0:
        tl.atomic_add(ctr_ptr + _KC, kc, sem="relaxed")
    if vc > 0:
        tl.atomic_add(ctr_ptr + _VC, vc, sem="relaxed")
    if ((both >> 32) & 0xFFFF) > 0:
        _raise_max(ctr_ptr, ka, m, _KM)
    if ((both >> 48) & 0xFFFF) > 0:
        _raise_max(ctr_ptr, va, m, _VM)


def _check(x: torch.Tensor, what: str, device: torch.device) -> None:
    if x.dim() != 3 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"{what} must be a bf16/fp16/fp32 [tokens, heads, head_dim] tensor, got {x.dtype} {tuple(x.shape)}"
        )
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(f"{what}'s heads x head_dim must be contiguous per token, got strides {tuple(x.stride())}")
    if x.device != device:
        raise ValueError(f"{what} is on {x.device}, the counter on {device}")


def count_clipped(
    counter: ClipCounter,
    key: torch.Tensor,
    value: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Count one cache write's clipped K and V elements into ``counter`` (see the module docstring). ``k_scale`` and
    ``v_scale``: one-element float32 tensors on the device (per tensor; a per-head scale is refused). ``slot_mapping``:
    the write's int32/int64 slots, at most as many as there are tokens (the rest are padding). Checks read shapes
    and dtypes only (no sync): an engine calls this on its step path."""
    dev = counter.device
    _check(key, "key", dev)
    _check(value, "value", dev)
    if key.shape[1:] != value.shape[1:] or slot_mapping.shape[0] > min(key.shape[0], value.shape[0]):
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)}, {slot_mapping.shape[0]} slots")
    for s, what in ((k_scale, "k_scale"), (v_scale, "v_scale")):
        if s.dtype != torch.float32 or s.numel() != 1 or s.device != dev:
            raise ValueError(f"{what} must be a one-element float32 tensor on {dev}, got {s.dtype} {tuple(s.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be a 1-D int32/int64 tensor, got {slot_mapping.dtype}")
    n = slot_mapping.shape[0]
    if n == 0:
        return
    hd = key.shape[1] * key.shape[2]
    hdp = triton.next_power_of_2(hd)
    if hdp > 1 << 15:  # the kernel packs a program's four counts in 16 bits each
        raise ValueError(f"{hd} K/V elements per token (heads x head_dim) is past this counter's 32768")
    tok = max(1, _ELEMS // hdp)
    _clip_count_kernel[(triton.cdiv(n, tok),)](key, value, slot_mapping, k_scale, v_scale, counter.ctr, n,
                                                key.stride(0), value.stride(0), HD=hd, HDP=hdp, TOK=tok,
                                                FMAX=FP8_MAX[counter.fmt])  # fmt: skip
