"""Fused FP8 quantise-into-paged-cache kernel (tripwire.numerics.fused): cache bits equal torch's reference
quantisation, counts and maxima equal the torch path's (and the float64 reference), padding rows skipped, the slot
mapping guarded (with a control that writes past the cache without the guard), ``count=False`` writes the same
cache and counts nothing.

CPU (interpreter) limits: Triton's interpreter converts float32 to FP8 by truncating the mantissa (not
round-to-nearest-even), so on the CPU the bit-for-bit tests use data that is exact in FP8 after scaling (plus
saturating values); rounding itself is checked by the GPU tests, on random data, where the kernel compiles to the
hardware conversion."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from tripwire import Monitor, SiteRegistry
from tripwire.layout import decode
from tripwire.numerics import (
    FP8_DTYPES,
    FP8_MAX,
    ClipCounter,
    fp8_cache_launch,
    quantize_kv_to_fp8_cache,
    reference_quantize,
)
from tripwire.numerics.fused import _fp8_kv_cache_kernel, _launch, _tail_asm, _thread_tail_ok, _threshold

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FMTS = ["e4m3", "e5m2"]
H, D = 2, 16
BLOCKS, BLOCK_SIZE = 5, 4  # 20 slots
SENTINEL = 0x11  # a byte pattern no test writes: unwritten slots must keep it


def f64_reference(x: torch.Tensor, scale, fmt: str, valid: torch.Tensor) -> tuple[int, float]:
    s = (
        scale.double().reshape(-1).cpu()
        if isinstance(scale, torch.Tensor)
        else torch.tensor([float(np.float32(scale))])
    )
    s = s.reshape(-1, 1) if s.numel() > 1 else s
    a = x.double().abs().cpu()[valid.cpu()]
    count = int((a > s.double() * FP8_MAX[fmt]).sum())
    a = a[~a.isnan()]
    return count, float(a.max()) if a.numel() else 0.0


def fp8_exact_values(fmt: str, n: int, seed: int) -> torch.Tensor:
    """Random finite FP8 values (every exponent, subnormals included), as float32."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    v = b.view(FP8_DTYPES[fmt]).float()
    return torch.where(v.isfinite(), v, torch.zeros_like(v))


def scale_value(kind: str, fmt: str, dtype: torch.dtype, device: str, heads: int = H):
    small = fmt == "e5m2" and dtype == torch.float16  # 57344 x scale must stay inside fp16
    if kind == "float":
        return 0.5 if small else 2.0
    if kind == "1elem":
        return torch.tensor([0.25 if small else 4.0], device=device)
    vals = [0.5, 0.25, 1.0][:heads] if small else [2.0, 0.5, 0.25][:heads]
    return torch.tensor(vals, device=device)


def per_head(scale, heads: int = H) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        s = scale.detach().cpu().reshape(-1)
        return s.expand(heads) if s.numel() == 1 else s
    return torch.full((heads,), float(np.float32(scale)))


def exact_kv(fmt, dtype, scale, tokens, seed, heads=H, dim=D) -> torch.Tensor:
    """K or V whose scaled values are exact in FP8, with saturating values (above the ceiling) planted."""
    s = per_head(scale, heads)
    y = fp8_exact_values(fmt, tokens * heads * dim, seed).view(tokens, heads, dim)
    y[:, :, 0] = 3 * FP8_MAX[fmt]  # clipped: saturates to +max
    y[:, :, 1] = -1.5 * FP8_MAX[fmt]  # clipped: saturates to -max
    return (y * s.view(1, heads, 1)).to(dtype)


def near_ceiling(dtype, fmt, scale, tokens, seed, heads) -> torch.Tensor:
    """Random values around each head's ceiling, with the 7 values of ``dtype`` nearest it planted (both signs)."""
    g = torch.Generator().manual_seed(seed)
    ceilings = per_head(scale, heads).double() * FP8_MAX[fmt]
    x = torch.randn(tokens, heads, D, generator=g, dtype=torch.float64) * ceilings.view(1, -1, 1) * 0.6
    ity = torch.int32 if dtype == torch.float32 else torch.int16
    for h in range(heads):
        bits = torch.tensor([float(ceilings[h])], dtype=torch.float64).to(dtype).view(ity).to(torch.int64)
        nb = (bits + torch.arange(-3, 4)).to(ity).view(dtype).double()
        x[h % tokens, h, :7] = nb
        x[(h + 1) % tokens, h, D - 7 :] = -nb
    return x.to(dtype)


def caches(fmt, device, heads=H, dim=D):
    k = torch.full((BLOCKS, BLOCK_SIZE, heads, dim), SENTINEL, dtype=torch.uint8, device=device).view(FP8_DTYPES[fmt])
    return k, k.clone()


def slots_for(tokens: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(tokens)
    s = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[:tokens]
    s[1::4] = -1  # padding rows
    return s.to(device)


def check_cache(cache: torch.Tensor, x: torch.Tensor, scale, fmt: str, slots: torch.Tensor) -> None:
    ref = reference_quantize(x, scale, fmt).view(torch.uint8)
    flat = cache.view(torch.uint8).reshape(-1, *x.shape[1:])
    live = slots >= 0
    got = flat[slots[live]]
    if not torch.equal(got, ref[live]):
        bad = (got != ref[live]).nonzero()
        xs = x[live]
        detail = [
            (tuple(i), float(xs[tuple(i)]), int(ref[live][tuple(i)]), int(got[tuple(i)])) for i in bad[:6].tolist()
        ]
        raise AssertionError(f"{bad.shape[0]} cache bytes differ (index, x, torch byte, kernel byte): {detail}")
    unwritten = torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device)
    unwritten[slots[live]] = False
    assert bool((flat[unwritten] == SENTINEL).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("kind", ["float", "1elem", "per_head"])
def test_cache_bits_and_counts(monitor, kernel_device, dtype, fmt, kind):
    tokens = 8
    ks = scale_value(kind, fmt, dtype, kernel_device)
    vs = scale_value("per_head" if kind != "per_head" else "float", fmt, dtype, kernel_device)
    key = exact_kv(fmt, dtype, ks, tokens, seed=1).to(kernel_device)
    value = exact_kv(fmt, dtype, vs, tokens, seed=2).to(kernel_device)
    slots = slots_for(tokens, kernel_device)
    kc, vc = caches(fmt, kernel_device)
    fused = ClipCounter("fused", kernel_device, fmt, monitor=monitor)
    quantize_kv_to_fp8_cache(key, value, kc, vc, slots, ks, vs, fused)
    check_cache(kc, key, ks, fmt, slots)
    check_cache(vc, value, vs, fmt, slots)
    torch_path = ClipCounter("torch", kernel_device, fmt, monitor=monitor)
    torch_path.count(key, value, ks, vs, slots)
    rk, mk = f64_reference(key, ks, fmt, slots >= 0)
    rv, mv = f64_reference(value, vs, fmt, slots >= 0)
    assert rk >= 2 * 6 * H  # the planted saturating values (6 live tokens)
    assert fused.totals() == torch_path.totals() == {"k": rk, "v": rv, "k_max": mk, "v_max": mv}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
def test_counts_equal_torch_path_near_the_ceiling(monitor, kernel_device, dtype, fmt):
    """Random data (any scale, values just above/below each head's ceiling): counts and maxima are exact, whatever
    the interpreter's FP8 rounding does to the cache."""
    heads = 3
    ks = torch.tensor([0.7, 1.0 + 3 * 2**-10, 1.0 / 3.0], device=kernel_device)
    key = near_ceiling(dtype, fmt, ks, 6, seed=7, heads=heads).to(kernel_device)
    value = near_ceiling(dtype, fmt, 0.3, 6, seed=8, heads=heads).to(kernel_device)
    slots = torch.tensor([3, 9, -1, 0, 14, 7], device=kernel_device)
    kc, vc = caches(fmt, kernel_device, heads=heads)
    fused = ClipCounter("fused", kernel_device, fmt, monitor=monitor)
    quantize_kv_to_fp8_cache(key, value, kc, vc, slots, ks, 0.3, fused)
    torch_path = ClipCounter("torch", kernel_device, fmt, monitor=monitor)
    torch_path.count(key, value, ks, 0.3, slots)
    rk, mk = f64_reference(key, ks, fmt, slots >= 0)
    rv, mv = f64_reference(value, 0.3, fmt, slots >= 0)
    assert rk > 0 and rv > 0
    assert fused.totals() == torch_path.totals() == {"k": rk, "v": rv, "k_max": mk, "v_max": mv}
    # Where the reference value is exact in FP8 the interpreter's conversion is exact too: compare those bits.
    ref = reference_quantize(key, ks, fmt)
    got = kc.view(-1, heads, D)[slots.clamp(min=0)]
    exact = (ref.float() * ks.view(1, -1, 1) == key.float()) & (slots >= 0).view(-1, 1, 1)
    assert int(exact.sum()) > 0
    assert torch.equal(got.view(torch.uint8)[exact], ref.view(torch.uint8)[exact])


def test_non_power_of_two_heads_and_dim_and_token_stride(monitor, kernel_device):
    heads, dim, tokens = 3, 12, 5
    fmt = "e4m3"
    ks = torch.tensor([2.0, 0.5, 0.25], device=kernel_device)
    k = exact_kv(fmt, torch.bfloat16, ks, tokens, seed=3, heads=heads, dim=dim)
    v = exact_kv(fmt, torch.bfloat16, 1.0, tokens, seed=4, heads=heads, dim=dim)
    # K and V as views of one fused qkv buffer: token stride 3 * heads * dim, heads/dim contiguous.
    qkv = torch.zeros(tokens, 3, heads, dim, dtype=torch.bfloat16)
    qkv[:, 1], qkv[:, 2] = k, v
    qkv = qkv.to(kernel_device)
    key, value = qkv[:, 1], qkv[:, 2]
    assert not key.is_contiguous()
    slots = torch.tensor([4, -1, 0, 19, 7], device=kernel_device)
    kc = torch.full((BLOCKS * BLOCK_SIZE, heads, dim), SENTINEL, dtype=torch.uint8, device=kernel_device)
    kc, vc = kc.view(torch.float8_e4m3fn), kc.clone().view(torch.float8_e4m3fn)
    c = ClipCounter("strided", kernel_device, fmt, monitor=monitor)
    quantize_kv_to_fp8_cache(key, value, kc, vc, slots, ks, 1.0, c)
    check_cache(kc, key, ks, fmt, slots)
    check_cache(vc, value, 1.0, fmt, slots)
    assert c.totals()["k"] == f64_reference(key, ks, fmt, slots >= 0)[0] == 2 * 4 * heads


def test_count_false_writes_the_same_cache_and_counts_nothing(monitor, kernel_device):
    fmt = "e4m3"
    key = exact_kv(fmt, torch.float16, 1.0, 6, seed=5).to(kernel_device)
    slots = slots_for(6, kernel_device)
    c = ClipCounter("layer", kernel_device, fmt, monitor=monitor)
    kc1, vc1 = caches(fmt, kernel_device)
    quantize_kv_to_fp8_cache(key, key, kc1, vc1, slots, 1.0, 1.0, c, count=False)
    assert c.totals() == {"k": 0, "v": 0, "k_max": 0.0, "v_max": 0.0}
    kc2, vc2 = caches(fmt, kernel_device)
    quantize_kv_to_fp8_cache(key, key, kc2, vc2, slots, 1.0, 1.0, c)
    assert torch.equal(kc1.view(torch.uint8), kc2.view(torch.uint8))
    assert c.totals()["k"] > 0  # control: the same call with counting on counts


def test_launch_runs_a_copy_of_the_kernel(monitor, kernel_device):
    """``_launch(kernel=...)``: another JITFunction of the kernel (the benchmark's loads of the code at other
    addresses) writes the same bits and counts the same as the module's kernel."""
    from tripwire.testing import jit_copy

    fmt = "e4m3"
    key = exact_kv(fmt, torch.bfloat16, 1.0, 6, seed=5).to(kernel_device)
    slots = slots_for(6, kernel_device)
    copy = jit_copy(_fp8_kv_cache_kernel)
    launched = []

    class Seen:  # the copy, recording that the launch went through it (a launcher ignoring kernel= fails below)
        def __getitem__(self, grid):
            launched.append(grid)
            return copy[grid]

    out = []
    for kernel in (None, Seen()):
        c = ClipCounter(f"copy{kernel is None}", kernel_device, fmt, monitor=monitor)
        kc, vc = caches(fmt, kernel_device)
        _launch(key, key, kc, vc, slots, 1.0, 1.0, c, count=True, guard=True, kernel=kernel)
        out.append((kc.view(torch.uint8).clone(), c.totals()))
    assert len(launched) == 1
    assert torch.equal(out[0][0], out[1][0]) and out[0][1] == out[1][1]
    assert out[0][1]["k"] > 0  # something clipped: the counts compared are not both zero


def test_slot_past_the_cache_is_masked_and_counted(monitor, kernel_device, caplog):
    fmt = "e4m3"
    num_slots = BLOCKS * BLOCK_SIZE
    key = exact_kv(fmt, torch.bfloat16, 1.0, 4, seed=6).to(kernel_device)
    # The cache is the head of a larger buffer: a write past it lands in the tail, which we can watch.
    buf = torch.full((num_slots + 4, H, D), SENTINEL, dtype=torch.uint8, device=kernel_device)
    kc = buf[:num_slots].view(BLOCKS, BLOCK_SIZE, H, D).view(torch.float8_e4m3fn)
    vbuf = buf.clone()
    vc = vbuf[:num_slots].view(BLOCKS, BLOCK_SIZE, H, D).view(torch.float8_e4m3fn)
    slots = torch.tensor([2, num_slots + 1, -1, num_slots], device=kernel_device)
    c = ClipCounter("layer", kernel_device, fmt, monitor=monitor)
    quantize_kv_to_fp8_cache(key, key, kc, vc, slots, 1.0, 1.0, c)
    assert bool((buf[num_slots:] == SENTINEL).all()) and bool((vbuf[num_slots:] == SENTINEL).all())
    row = monitor.read_rows(kernel_device)[c.slot_site.id].tolist()
    assert row[0] == 2  # tokens 1 and 3; the padding row (token 2) is not an offender
    assert (
        decode(row[1]) == 3
        and decode(row[2]) == num_slots + 1
        and (decode(row[4]), decode(row[5]))
        in {
            (1, num_slots + 1),
            (3, num_slots),
        }
    )
    # The masked tokens are not counted as clipped either: only token 0's saturating values are.
    assert c.totals()["k"] == 2 * H
    # The monitor reports the fatal slot site and arms the stop.
    monitor.drain()
    assert any("numerics.fp8_cache.slot" in r.getMessage() for r in caplog.records)
    assert monitor.armed is not None and monitor.armed.site == "numerics.fp8_cache.slot"
    # Control: the same kernel without the guard writes into the memory past the cache.
    _launch(key, key, kc, vc, slots, 1.0, 1.0, c, count=False, guard=False)
    assert not bool((buf[num_slots:] == SENTINEL).all())


@pytest.mark.parametrize(
    "change, err",
    [
        (dict(k_cache="bf16"), "float8_e4m3fn"),
        (dict(k_cache="noncontig"), "contiguous"),
        (dict(k_cache="shape"), "num_blocks, block_size"),
        (dict(key="strides"), "contiguous heads"),
        (dict(key="2d"), "tokens, heads, head_dim"),
        (dict(slot_mapping="len"), "one slot per token"),
        (dict(slot_mapping="float"), "int32 or int64"),
        (dict(k_scale="shape"), "per head|1-element"),
        (dict(k_scale="f64"), "float32"),
        (dict(k_scale="neg"), "> 0"),
        (dict(counter="none"), "ClipCounter"),
    ],
)
def test_launcher_rejects_bad_arguments(monitor, change, err):
    T = 4
    key = torch.zeros(T, H, D)
    kc, vc = caches("e4m3", "cpu")
    args = dict(
        key=key,
        value=key.clone(),
        k_cache=kc,
        v_cache=vc,
        slot_mapping=torch.arange(T),
        k_scale=1.0,
        v_scale=1.0,
        counter=ClipCounter("layer", "cpu", monitor=monitor),
    )
    ((name, how),) = change.items()
    bad = {
        ("k_cache", "bf16"): torch.zeros(BLOCKS, BLOCK_SIZE, H, D, dtype=torch.bfloat16),
        ("k_cache", "noncontig"): kc.transpose(0, 1),
        ("k_cache", "shape"): kc.view(BLOCKS, BLOCK_SIZE, H * D),
        ("key", "strides"): torch.zeros(T, D, H).transpose(1, 2),
        ("key", "2d"): torch.zeros(T, H * D),
        ("slot_mapping", "len"): torch.arange(T + 1),
        ("slot_mapping", "float"): torch.zeros(T),
        ("k_scale", "shape"): torch.ones(3),
        ("k_scale", "f64"): torch.ones(1, dtype=torch.float64),
        ("k_scale", "neg"): -2.0,
        ("counter", "none"): None,
    }[(name, how)]
    args[name] = bad
    with pytest.raises((ValueError, TypeError), match=err):
        quantize_kv_to_fp8_cache(**args)  # type: ignore[arg-type]
    assert bool((kc.view(torch.uint8) == SENTINEL).all())  # nothing launched


# ------------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("kind", ["float", "1elem", "per_head"])
def test_gpu_random_data_bit_exact(dtype, fmt, kind):
    """Compiled: round-to-nearest-even FP8 conversion on random data (ties and subnormals included) matches torch
    bit for bit; counts and maxima equal the torch path's and the float64 reference. For every build the launcher can
    run: its own shape (one token per program on 4 warps at this size), 2 warps (its shape for larger batches), the
    loop (4 warps x 4 tokens), the portable code (no inline PTX: float64 thresholds, float32 running max), and the
    block-level counting tail (what runs where the per-thread tail cannot: before sm_90, mixed dtypes, small tiles),
    and the clamp with the float32 grid rounding before the cast (what GPUs before sm_89 run; the launcher's builds
    on the H200 convert with the hardware's cvt.rn.satfinite alone)."""
    reg = SiteRegistry(capacity=64)
    m = Monitor(registry=reg, capacity=64)
    heads, dim, tokens = 8, 128, 512
    ks = {"float": 0.37, "1elem": torch.tensor([1.3], device="cuda"), "per_head": None}[kind]
    if kind == "per_head":
        ks = torch.linspace(0.2, 1.1, heads, device="cuda")
    vs = 0.9 if fmt == "e5m2" and dtype == torch.float16 else 0.6  # both K and V clip some elements
    g = torch.Generator(device="cuda").manual_seed(11)
    fmax = FP8_MAX[fmt]
    spread = 0.3 * fmax if not (fmt == "e5m2" and dtype == torch.float16) else 0.25 * fmax
    key = (torch.randn(tokens, heads, dim, device="cuda", generator=g) * spread).to(dtype)
    value = (torch.randn(tokens, heads, dim, device="cuda", generator=g) * spread).to(dtype)
    key[:, :, :4] *= 1e-6  # deep into the FP8 subnormals
    slots = torch.randperm(4096, device="cuda", generator=g)[:tokens]
    slots[::7] = -1
    t = ClipCounter("torch", "cuda", fmt, monitor=m)
    t.count(key, value, ks, vs, slots)
    rk, mk = f64_reference(key, ks, fmt, slots >= 0)
    rv, mv = f64_reference(value, vs, fmt, slots >= 0)
    assert rk > 0 and rv > 0
    assert t.totals() == {"k": rk, "v": rv, "k_max": mk, "v_max": mv}
    builds = {
        "launcher": {},
        "lean": {"config": (2, 1)},
        "bulk": {"config": (4, 4)},
        "portable": {"inline_ptx": False},
        "portable-bulk": {"inline_ptx": False, "config": (4, 4)},
        "block-tail": {"thread_tail": False},  # what other GPUs and dtypes run
        "tail-first": {"tail_last": False},  # the per-thread tail before the stores (a large batch's placement)
        "tail-last": {"tail_last": True},  # after them (a small batch's)
        "block-tail-lean": {"thread_tail": False, "config": (2, 1)},
        "grid-rounding": {"rne_cast": False},  # the clamp and float32 grid rounding before the cast (pre-sm_89)
        "grid-rounding-lean": {"rne_cast": False, "config": (2, 1)},
    }
    for name, kw in builds.items():
        kc = torch.full((256, 16, heads, dim), SENTINEL, dtype=torch.uint8, device="cuda").view(FP8_DTYPES[fmt])
        vc = kc.clone()
        c = ClipCounter(f"fused.{name}", "cuda", fmt, monitor=m)
        _launch(key, value, kc, vc, slots, ks, vs, c, count=True, guard=True, **kw)
        check_cache(kc, key, ks, fmt, slots)
        check_cache(vc, value, vs, fmt, slots)
        assert c.totals() == t.totals(), name


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_cast_edges_both_conversions(fmt):
    """The edges of the float32 -> FP8 conversion, with the hardware's saturating cast alone (the launcher on sm_89+)
    and with the clamp and grid rounding before it: +-0, values that underflow to +-0, the smallest subnormal and
    half of it (a tie to 0), every boundary between binades, the FP8 max, values just above it, the midpoint past it,
    the float32 max and +-Inf (saturate to +-max, as torch's clamp does). Both builds equal torch's bits; NaN stays a
    NaN in both (its bit pattern is not compared: see the module docstring)."""
    reg = SiteRegistry(capacity=16)
    m = Monitor(registry=reg, capacity=16)
    fmax = FP8_MAX[fmt]
    tiny = 2.0**-16 if fmt == "e5m2" else 2.0**-9  # the smallest subnormal
    past = 61440.0 if fmt == "e5m2" else 464.0  # halfway from the max to the next step the format does not have
    vals = [0.0, -0.0, 1e-30, -1e-30, tiny, -tiny, tiny / 2, -tiny / 2, tiny * 1.5, tiny * 0.75, fmax, -fmax,
            fmax * 1.0001, past, -past, fmax * 2, 3.4028235e38, -3.4028235e38,
            float("inf"), float("-inf")]  # fmt: skip
    vals += [2.0**e * f for e in range(-16, 16) for f in (1.0, 1.0 + 2**-4, 1.0 + 2**-3 + 2**-5, 1.9999)]
    x = torch.tensor(vals, dtype=torch.float32)
    heads, dim = 2, 64
    n = heads * dim
    g = torch.Generator().manual_seed(5)
    x = torch.cat([x, -x, torch.randn(n * 8, generator=g) * fmax * 0.5])
    x = torch.cat([x, torch.zeros((-x.numel()) % n)]).reshape(-1, heads, dim).cuda()
    x[0, 0, 0] = float("nan")
    nan = torch.isnan(x)
    tokens = x.shape[0]
    slots = torch.arange(tokens, device="cuda")
    for scale in (1.0, 0.37, torch.tensor([1.7, 0.01], device="cuda")):
        ref = reference_quantize(x, scale, fmt).view(torch.uint8)
        for rne in (True, False):
            kc = torch.full((tokens, heads, dim), SENTINEL, dtype=torch.uint8, device="cuda").view(FP8_DTYPES[fmt])
            c = ClipCounter(f"edges.{rne}", "cuda", fmt, monitor=m)
            _launch(x, x, kc, kc.clone(), slots, scale, scale, c, count=True, guard=True, rne_cast=rne)
            assert torch.equal(kc.view(torch.uint8)[~nan], ref[~nan]), (scale, rne)
            assert bool(torch.isnan(kc.float()[nan]).all())


def _tail_case(heads, dim, dtype, kind, fmt, tokens, seed, spread=0.3, negative=False):
    """K, V, slots (padding, one slot past the cache) and scales for the thread-tail tests, with NaN and +-Inf
    planted; ``negative`` makes the scales negative (a corrupted scale tensor: everything live clips)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    fmax = FP8_MAX[fmt]
    small = fmt == "e5m2" and dtype == torch.float16
    s = spread * fmax * (0.25 if small else 1.0)
    key = (torch.randn(tokens, heads, dim, device="cuda", generator=g) * s).to(dtype)
    value = (torch.randn(tokens, heads, dim, device="cuda", generator=g) * s).to(dtype)
    key[1, 0, 0] = float("nan")
    key[2, heads - 1, dim - 1] = float("inf")
    value[4, 0, dim // 2] = float("-inf")
    value[6, :, :] = float("nan")  # a live token that is all NaN: no clip, no maximum
    nslots = 2 * tokens
    slots = torch.randperm(nslots, device="cuda", generator=g)[:tokens]
    slots[::5] = -1
    slots[3] = nslots + 7  # past the cache: masked, counted at the slot site, not in the clip row
    if kind == "per_head":
        ks = torch.linspace(0.4, 1.2, heads, device="cuda")
        vs = torch.linspace(1.1, 0.5, heads, device="cuda")
    else:
        ks, vs = torch.tensor([0.8], device="cuda"), torch.tensor([0.6], device="cuda")
    if negative:
        ks = -ks
        vs = vs.clone()
        vs[0] = -vs[0]
    if kind == "float":
        ks, vs = 0.8, 0.6
    return key, value, slots, nslots, ks, vs


def _run_tail_case(m, name, key, value, slots, nslots, ks, vs, fmt, launches=2, **kw):
    heads, dim = key.shape[1:]
    kc = torch.full((nslots, heads, dim), SENTINEL, dtype=torch.uint8, device="cuda").view(FP8_DTYPES[fmt])
    vc = kc.clone()
    c = ClipCounter(name, "cuda", fmt, monitor=m)
    bad0 = int(m.read_rows("cuda")[c.slot_site.id][0])  # the slot site is shared by every counter of a registry
    rows = []
    for _ in range(launches):
        _launch(key, value, kc, vc, slots, ks, vs, c, count=True, guard=True, **kw)
        rows.append(c.totals())
    return kc, vc, rows, int(m.read_rows("cuda")[c.slot_site.id][0]) - bad0


_TAIL_SHAPES = [  # (heads, dim, config): every tile here gives each thread >= 8 elements
    (8, 128, None),  # the benchmark's shape, the launcher's config (4 warps at this batch)
    (8, 128, (2, 1)),  # its config for large batches: 16 elements per thread
    (8, 128, (4, 4)),  # the loop: the tail per token
    (6, 96, None),  # a padded tile: out-of-tile lanes must count nothing
    (32, 128, None),  # 8 warps, 16 elements per thread
    (8, 128, (1, 1)),  # 32 elements per thread: two asm instances per thread
    (1, 256, None),  # one head, one warp
    (128, 8, (2, 1)),  # rows of 8: each thread's 16 elements span two heads (per-head limits inside one instance)
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", _TAIL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}@{s[2]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["float", "1elem", "per_head"])
def test_gpu_thread_tail_equals_reference(monitor, shape, dtype, kind):
    """The per-thread counting tail (sm_90, 16-bit K/V; forced on, so a shape where it cannot run is an error, not a
    silent fallback): cache bits equal torch's, counts and maxima equal the torch path's and the block-level tail's,
    over tile shapes (padded, several asm instances per thread, the loop), NaN/Inf planted, padding rows and a slot
    past the cache (counted once per launch at the slot site), across two launches (counts double, maxima stay)."""
    heads, dim, config = shape
    fmt = "e4m3" if (heads + dim + (dtype == torch.float16)) % 2 else "e5m2"
    key, value, slots, nslots, ks, vs = _tail_case(heads, dim, dtype, kind, fmt, tokens=600, seed=heads + dim)
    live = (slots >= 0) & (slots < nslots)
    t = ClipCounter("torch", "cuda", fmt, monitor=monitor)
    t.count(key, value, ks, vs, torch.where(live, slots, -1))
    want = t.totals()
    assert want["k"] > 0 and want["v"] > 0 and want["k_max"] == float("inf") and want["v_max"] == float("inf")
    twice = {"k": 2 * want["k"], "v": 2 * want["v"], "k_max": want["k_max"], "v_max": want["v_max"]}
    results = {}
    for name, kw in (
        ("tail", {"thread_tail": True}),
        ("tail-first", {"thread_tail": True, "tail_last": False}),  # before the stores (a large batch's placement)
        ("tail-last", {"thread_tail": True, "tail_last": True}),  # after them (a small batch's)
        ("block", {"thread_tail": False}),
    ):
        kc, vc, rows, bad = _run_tail_case(monitor, name, key, value, slots, nslots, ks, vs, fmt, config=config, **kw)
        assert rows == [want, twice], name
        assert bad == 2, name
        results[name] = (kc.view(torch.uint8), vc.view(torch.uint8))
        for cache, x, sc in ((kc, key, ks), (vc, value, vs)):
            ref = reference_quantize(x, sc, fmt).view(torch.uint8)
            got = cache.view(torch.uint8)[slots[live]]
            fin = x[live].isfinite() | x[live].isinf()  # NaN bytes may differ from torch's (module docstring)
            assert torch.equal(got[fin], ref[live][fin]), name
    for name in ("tail", "tail-first", "tail-last"):
        assert torch.equal(results[name][0], results["block"][0]) and torch.equal(results[name][1], results["block"][1])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["1elem", "per_head"])
def test_gpu_thread_tail_negative_scale_and_full_clipping(monitor, kind):
    """A corrupted (negative) scale tensor makes every live element clip: the tail's negative limit must flag every
    thread, and the exact count must leave out padded head_dim lanes, padding rows and the slot past the cache.
    Then the fault case: a tiny scale, every element of every token clips (each warp records)."""
    heads, dim = 6, 96  # a padded tile
    key, value, slots, nslots, ks, vs = _tail_case(heads, dim, torch.bfloat16, kind, "e4m3", 300, 3, negative=True)
    live = (slots >= 0) & (slots < nslots)
    t = ClipCounter("torch", "cuda", "e4m3", monitor=monitor)
    t.count(key, value, ks, vs, torch.where(live, slots, -1))
    want = t.totals()
    _, _, rows, _ = _run_tail_case(monitor, "neg", key, value, slots, nslots, ks, vs, "e4m3", 1, thread_tail=True)
    assert rows[0] == want
    n_live = int(live.sum()) * heads * dim
    assert want["k"] == n_live - int(key[live].isnan().sum())  # every live, non-NaN K element "clipped"
    tiny = 1e-6 if kind == "1elem" else torch.full((heads,), 1e-6, device="cuda")
    key, value, slots, nslots, _, _ = _tail_case(heads, dim, torch.bfloat16, kind, "e4m3", 3000, 4)
    live = (slots >= 0) & (slots < nslots)
    t2 = ClipCounter("torch.tiny", "cuda", "e4m3", monitor=monitor)
    t2.count(key, value, tiny, tiny, torch.where(live, slots, -1))
    _, _, rows, _ = _run_tail_case(monitor, "tiny", key, value, slots, nslots, tiny, tiny, "e4m3", 1, thread_tail=True)
    assert rows[0] == t2.totals()
    assert rows[0]["k"] > 0.99 * int(live.sum()) * heads * dim  # the fault case: nearly every element clips


@pytest.mark.gpu
def test_gpu_thread_tail_control_per_tensor_asm_on_per_head_scales(monitor):
    """Control: the per-tensor tail (one limit and one threshold for all of a thread's elements) launched with
    per-head scales miscounts -- so the exactness test above would see a tail that ignored the per-element limits.
    Rows of 8 elements, so that each thread's 16 elements (2 warps) span two heads (with 128-element rows Triton
    gives each thread 16 elements of one row, where one limit per instance happens to be right)."""
    heads, dim = 128, 8
    key, value, slots, nslots, ks, vs = _tail_case(heads, dim, torch.bfloat16, "per_head", "e4m3", 600, 5)
    live = (slots >= 0) & (slots < nslots)
    t = ClipCounter("torch", "cuda", "e4m3", monitor=monitor)
    t.count(key, value, ks, vs, torch.where(live, slots, -1))
    pack = 16  # config (2, 1): 1024 tile elements over 64 threads
    wrong = (*_tail_asm(pack, "bf16", False, False, FP8_MAX["e4m3"]), pack)
    _, _, rows, _ = _run_tail_case(
        monitor, "wrong", key, value, slots, nslots, ks, vs, "e4m3", 1, config=(2, 1), tail_override=wrong
    )
    assert rows[0]["k"] != t.totals()["k"]
    right = (*_tail_asm(pack, "bf16", True, True, FP8_MAX["e4m3"]), pack)
    _, _, rows, _ = _run_tail_case(
        monitor, "right", key, value, slots, nslots, ks, vs, "e4m3", 1, config=(2, 1), tail_override=right
    )
    assert rows[0] == t.totals()


def test_thread_tail_rule():
    """Where the launcher picks the per-thread tail: sm_90+ with inline PTX, one 16-bit dtype, >= 8 elements per
    thread. Each condition alone turns it off (no GPU needed)."""
    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    assert _thread_tail_ok(True, (9, 0), bf, bf, 16) and _thread_tail_ok(True, (10, 0), f16, f16, 8)
    assert not _thread_tail_ok(False, (9, 0), bf, bf, 16)  # the interpreter, ROCm, inline_ptx=False
    assert not _thread_tail_ok(True, (8, 9), bf, bf, 16)  # no packed bf16 compare before sm_90
    assert not _thread_tail_ok(True, (9, 0), bf, f16, 16)  # mixed dtypes
    assert not _thread_tail_ok(True, (9, 0), f32, f32, 16)
    assert not _thread_tail_ok(True, (9, 0), bf, bf, 4)  # a small tile: layouts may replicate elements


def test_thread_tail_refused_where_it_cannot_run(monitor, kernel_device):
    """``thread_tail=True`` is an error (naming why) where the per-thread tail cannot run: on the CPU (no inline
    PTX), or on the GPU for fp32 inputs, mixed dtypes, or fewer than 8 tile elements per thread -- never a silent
    fallback to the other tail."""
    c = ClipCounter("refuse", kernel_device, "e4m3", monitor=monitor)
    kc = torch.zeros(16, 8, 128, dtype=torch.uint8, device=kernel_device).view(torch.float8_e4m3fn)
    slots = torch.arange(4, device=kernel_device)
    bf = torch.ones(4, 8, 128, dtype=torch.bfloat16, device=kernel_device)
    cases = [(bf.float(), bf.float(), None), (bf, bf.half(), None), (bf, bf, (8, 1))]  # 8 warps: 4 per thread
    if kernel_device == "cpu":
        cases = [(bf, bf, None)]
    for k, v, config in cases:
        with pytest.raises(ValueError, match="thread_tail=True needs"):
            _launch(k, v, kc, kc.clone(), slots, 1.0, 1.0, c, count=True, guard=True, config=config, thread_tail=True)


def test_rne_cast_refused_where_it_cannot_run(monitor, kernel_device):
    """``rne_cast=True`` (the hardware's direct float32 -> FP8 conversion, sm_89+) is an error naming why where it
    cannot run -- the interpreter, or the portable build on a GPU -- never a silent switch to the grid rounding."""
    c = ClipCounter("refuse.rne", kernel_device, "e4m3", monitor=monitor)
    kc = torch.zeros(16, 8, 128, dtype=torch.uint8, device=kernel_device).view(torch.float8_e4m3fn)
    slots = torch.arange(4, device=kernel_device)
    x = torch.ones(4, 8, 128, dtype=torch.bfloat16, device=kernel_device)
    with pytest.raises(ValueError, match="rne_cast=True needs inline PTX on sm_89"):
        _launch(x, x, kc, kc.clone(), slots, 1.0, 1.0, c, count=True, guard=True, inline_ptx=False, rne_cast=True)
    assert bool((kc.view(torch.uint8) == 0).all())  # nothing launched


_THR_EDGES = [0.0, 1e-45, 1.1754942e-38, 1.1754944e-38, 1e-30, 0.5, 1.0, 1.3, 3.0e35, 7.59e35, 7.6e35, 5.9e33,
              5.94e33, 3.4028235e38, float("inf")]  # fmt: skip


@triton.jit
def _threshold_probe(s_ptr, out_ptr, FP8_MAX: tl.constexpr, PTX: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _threshold(tl.load(s_ptr + offs), FP8_MAX, PTX))


@pytest.mark.parametrize("fmt", FMTS)
def test_threshold_equals_float64_rounding(kernel_device, fmt):
    """The kernel's threshold equals a host reference (the exact float64 product rounded DOWN to float32) bit for
    bit, over random positive float32 scales of every exponent (subnormals included) and the edges: zero, the
    smallest and largest subnormal and normal, products that overflow float32 (FLT_MAX expected, not inf), inf. On
    the CPU the portable code (float64, what the interpreter runs); on the GPU also the inline-PTX one (mul.rm.f32),
    which must equal it. Control: a plain float32 product (round to nearest) differs on many scales, so a wrongly
    rounded threshold would be caught."""
    g = torch.Generator().manual_seed(7)
    n = 1 << (20 if kernel_device == "cuda" else 14)
    bits = torch.randint(0, 0x7F800000, (n,), generator=g, dtype=torch.int32)
    s = torch.cat([bits.view(torch.float32), torch.tensor(_THR_EDGES, dtype=torch.float32)])
    s = torch.cat([s, torch.zeros(-s.numel() % 1024)]).to(kernel_device)
    out = {}
    for ptx in (True, False) if kernel_device == "cuda" else (False,):
        out[ptx] = torch.empty_like(s)
        _threshold_probe[(s.numel() // 1024,)](s, out[ptx], FP8_MAX=FP8_MAX[fmt], PTX=ptx, BLOCK=1024)
    # Host reference: the exact float64 product, rounded to nearest float32, one step down where that rounded up.
    c = s.cpu().double().numpy() * FP8_MAX[fmt]
    with np.errstate(over="ignore"):
        t = c.astype(np.float32)
    want = np.where(t.astype(np.float64) > c, np.nextafter(t, np.float32(-np.inf)), t)
    for got in out.values():
        assert np.array_equal(got.cpu().numpy().view(np.int32), want.view(np.int32))
        assert float(got[s == 3.4028235e38][0]) == float(np.finfo(np.float32).max)  # overflow: FLT_MAX, not inf
    nearest = torch.from_numpy(t).to(kernel_device)  # the control: round to nearest
    assert int((nearest.view(torch.int32) != out[False].view(torch.int32)).sum()) > n // 8


@pytest.mark.gpu
def test_gpu_graph_replay_counts_n_times(caplog):
    caplog.set_level(logging.INFO, logger="tripwire")
    reg = SiteRegistry(capacity=16)
    m = Monitor(registry=reg, capacity=16, interval=0.01)
    m.prealloc("cuda")
    heads, dim, tokens, fmt = 8, 128, 256, "e4m3"
    g = torch.Generator(device="cuda").manual_seed(12)
    key = (torch.randn(tokens, heads, dim, device="cuda", generator=g) * 200).to(torch.bfloat16)
    value = (torch.randn(tokens, heads, dim, device="cuda", generator=g) * 150).to(torch.bfloat16)
    slots = torch.arange(tokens, device="cuda")
    slots[-16:] = -1  # padding of the captured batch
    slots[3] = 10**6  # one bad slot per step: masked, counted at the fatal slot site
    kc = torch.zeros(64, 16, heads, dim, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    vc = kc.clone()
    ks = torch.tensor([1.0], device="cuda")
    c = ClipCounter("layers.0.attn", "cuda", fmt, monitor=m)
    quantize_kv_to_fp8_cache(key, value, kc, vc, slots, ks, 0.8, c)  # compile before capturing
    torch.cuda.synchronize()
    per_step = c.totals()
    per_slot = int(m.read_rows("cuda")[c.slot_site.id][0])
    assert per_step["k"] > 0 and per_step["v"] > 0 and per_slot == 1
    m.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantize_kv_to_fp8_cache(key, value, kc, vc, slots, ks, 0.8, c)
    n = 9
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    assert c.totals() == {
        "k": n * per_step["k"],
        "v": n * per_step["v"],
        "k_max": per_step["k_max"],
        "v_max": per_step["v_max"],
    }
    assert int(m.read_rows("cuda")[c.slot_site.id][0]) == n
    for _ in range(4):
        m.poll()
        torch.cuda.synchronize()
    msgs = [r.getMessage() for r in caplog.records]
    assert any("CLIPPING" in s and f"({n * per_step['k']} total)" in s for s in msgs)
    assert any("numerics.fp8_cache.slot" in s and "MASKED FAULT" in s for s in msgs)
    assert m.armed is not None and m.armed.site == "numerics.fp8_cache.slot"


@triton.jit
def _plain_cast_kernel(x_ptr, out_ptr, s, n, FP8_MAX: tl.constexpr, FP8_TYPE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = tl.math.div_rn(x, s + tl.zeros_like(x))
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    tl.store(out_ptr + offs, y.to(FP8_TYPE), mask=m)


def _tie_data(dtype, fmt, device):
    g = torch.Generator().manual_seed(5)
    fmax = FP8_MAX[fmt]
    big = fmax if dtype != torch.float16 else min(fmax, 20000.0)
    x = torch.randn(32, 8, 64, generator=g) * 0.3 * big
    x[:, :, :8] *= 1e-6  # FP8 subnormals
    # exact ties after division by 1.1f (8448 / 1.1f rounds to 7680.0 in float32: an e5m2 tie)
    x[0, 7, :4] = torch.tensor([-8448.0, 16896.0, 4224.0, 2112.0])
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
def test_random_data_with_ties_bit_exact(kernel_device, dtype, fmt):
    """Random data, FP8 subnormals and exact ties: the kernel's cache equals torch's RNE quantisation bit for bit,
    on the interpreter (which truncates in its cast) and compiled (Triton 3.6's fdiv ignores ieee_rounding: the
    kernel must use div_rn, or these near-tie values round the other way)."""
    reg = SiteRegistry(capacity=16)
    m = Monitor(registry=reg, capacity=16)
    x = _tie_data(dtype, fmt, kernel_device)
    T = x.shape[0]
    slots = torch.arange(T, device=kernel_device)
    for scale in (1.1, 0.37, torch.linspace(0.2, 1.1, 8, device=kernel_device)):
        kc = torch.full((T, 1, 8, 64), SENTINEL, dtype=torch.uint8, device=kernel_device).view(FP8_DTYPES[fmt])
        vc = kc.clone()
        c = ClipCounter(f"ties.{fmt}", kernel_device, fmt, monitor=m)
        quantize_kv_to_fp8_cache(x, x, kc, vc, slots, scale, scale, c)
        check_cache(kc, x, scale, fmt, slots)


def test_control_plain_cast_is_not_bit_exact(kernel_device):
    """Control: the same division and clamp with a plain ``.to(fp8)`` (no grid rounding) does not match torch on
    this data in the interpreter (its cast truncates); on a GPU the result depends on the Triton version."""
    if kernel_device != "cpu":
        pytest.skip("the control's observation is the interpreter's truncating cast")
    fmt = "e5m2"
    x = _tie_data(torch.float32, fmt, kernel_device).reshape(-1).contiguous()
    out = torch.empty(x.numel(), dtype=torch.uint8).view(FP8_DTYPES[fmt])
    _plain_cast_kernel[(triton.cdiv(x.numel(), 1024),)](
        x, out, 1.1, x.numel(), FP8_MAX=FP8_MAX[fmt], FP8_TYPE=tl.float8e5, BLOCK=1024
    )
    ref = reference_quantize(x.reshape(1, 1, -1), 1.1, fmt).view(torch.uint8).reshape(-1)
    assert int((out.view(torch.uint8) != ref).sum()) > 0


def test_several_tokens_per_program_counts_exactly(kernel_device):
    """A program handles several tokens (a partial last program, padding, guarded bad slots): the cache is bit-exact
    and the counts equal the torch path's on the same valid rows. The launcher runs 4 tokens per program on the CPU
    at this size; on the GPU it runs one, so the loop is forced there (4 warps x 4 tokens)."""
    reg = SiteRegistry(capacity=16)
    m = Monitor(registry=reg, capacity=16)
    T, heads, dim, nslots = 103 if kernel_device == "cpu" else 40003, 4, 32, 200
    if kernel_device != "cpu":
        nslots = 2 * T
    config = None if kernel_device == "cpu" else (4, 4)
    if kernel_device == "cpu":
        assert fp8_cache_launch(T, heads, dim, kernel_device).tokens_per_program > 1
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(T, heads, dim, generator=g) * 300).to(kernel_device)
    v = (torch.randn(T, heads, dim, generator=g) * 300).to(kernel_device)
    slots = torch.randperm(nslots, generator=g)[:T]
    slots[::9] = -1
    slots[5], slots[77] = nslots + 300, nslots + 800
    slots = slots.to(kernel_device)
    kc = torch.zeros(nslots, heads, dim, dtype=torch.uint8, device=kernel_device).view(FP8_DTYPES["e4m3"])
    vc = kc.clone()
    c = ClipCounter("tpp.fused", kernel_device, "e4m3", monitor=m)
    _launch(k, v, kc, vc, slots, 0.5, 0.7, c, count=True, guard=True, config=config)
    t = ClipCounter("tpp.torch", kernel_device, "e4m3", monitor=m)
    valid = (slots >= 0) & (slots < nslots)
    t.count(k, v, 0.5, 0.7, torch.where(valid, slots, -1))
    assert c.totals() == t.totals() and c.totals()["k"] > 0
    ref = reference_quantize(k, 0.5, "e4m3").view(torch.uint8)
    assert torch.equal(kc.view(torch.uint8)[slots[valid]], ref[valid])
    from tripwire.numerics.clip import SLOT_SITE_NAME

    hit = m.snapshot()[("cpu" if kernel_device == "cpu" else "cuda:0", SLOT_SITE_NAME)]
    assert (hit.count, hit.max_row, hit.max_value, hit.min_value) == (2, 77, nslots + 800, nslots + 300)
    # the first offender is one real hit (which program wins the compare-and-swap is a race on the GPU)
    assert (hit.first_row, hit.first_value) in {(5, nslots + 300), (77, nslots + 800)}


_PTX_PROBE = r"""
import json, re, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tripwire.numerics.fused import _cvt_asm, _fp8_kv_cache_kernel, _limit_asm, _tail_asm

def ptx(kernel, types, consts, cc=90):
    names = kernel.arg_names
    sig = {n: types.get(n, "constexpr") for n in names}
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", cc, 32)).asm["ptx"]

@triton.jit
def approx_div(x_ptr, out_ptr, s, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) / s)

@triton.jit
def f16_step(x_ptr, out_ptr, BLOCK: tl.constexpr):  # float32 -> float16 -> FP8: rounds twice
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs).to(tl.float16).to(tl.float8e5))

types = {"key_ptr": "*bf16", "value_ptr": "*bf16", "k_cache_ptr": "*fp8e5", "v_cache_ptr": "*fp8e5",
         "slot_ptr": "*i64", "k_scale": "fp32", "v_scale": "fp32", "clip_ctr_ptr": "*i64", "slot_ctr_ptr": "*i64",
         "num_slots": "i64", "num_tokens": "i32", "key_stride": "i64", "value_stride": "i64"}
consts = dict(H=8, D=128, BLOCK_H=8, BLOCK_D=128, K_SCALE_MODE=0, V_SCALE_MODE=0, FP8_MAX=57344.0,
              FP8_TYPE=tl.float8e5, COUNT=True, GUARD=True, TOKENS_PER_PROGRAM=4, VEC=8,
              PTX=True, K_PACKED=True, V_PACKED=True, THREAD_TAIL=False, TAIL_PACK=1, TAIL_ASM="", TAIL_CON="",
              LIMIT_ASM="", CVT_ASM=_cvt_asm("e5m2"))
try:
    k = ptx(_fp8_kv_cache_kernel, types, consts)
    portable = ptx(_fp8_kv_cache_kernel, types, dict(consts, PTX=False, K_PACKED=False, V_PACKED=False,
                                                     CVT_ASM=""))
    grid = ptx(_fp8_kv_cache_kernel, types, dict(consts, CVT_ASM=""))  # sm_90 with the float32 grid rounding
    e4m3_types = dict(types, k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
    e4m3_consts = dict(consts, FP8_MAX=448.0, FP8_TYPE=tl.float8e4nv, CVT_ASM=_cvt_asm("e4m3"))
    e4m3 = ptx(_fp8_kv_cache_kernel, e4m3_types, e4m3_consts)
    # sm_89 (Ada), the oldest architecture the launcher gives the inline conversion: both formats
    e4m3_89 = ptx(_fp8_kv_cache_kernel, e4m3_types, e4m3_consts, cc=89)
    e5m2_89 = ptx(_fp8_kv_cache_kernel, types, consts, cc=89)
    c = ptx(approx_div, {"x_ptr": "*fp32", "out_ptr": "*fp32", "s": "fp32"}, {"BLOCK": 128})
    two_step = ptx(f16_step, {"x_ptr": "*fp32", "out_ptr": "*fp8e5"}, {"BLOCK": 128})
    one = dict(consts, TOKENS_PER_PROGRAM=1)
    builds = {}
    for half, ty in (("bf16", "*bf16"), ("f16", "*fp16")):  # the per-thread tail, 8 elements per thread (4 warps)
        for per_head in (False, True):
            asm, con = _tail_asm(8, half, per_head, per_head, 57344.0)
            mode = 2 if per_head else 0
            sc = "*fp32" if per_head else "fp32"
            builds[f"tail_{half}_{int(per_head)}"] = ptx(
                _fp8_kv_cache_kernel, dict(types, key_ptr=ty, value_ptr=ty, k_scale=sc, v_scale=sc),
                dict(one, THREAD_TAIL=True, TAIL_PACK=8, TAIL_ASM=asm, TAIL_CON=con, K_SCALE_MODE=mode,
                     V_SCALE_MODE=mode, LIMIT_ASM=_limit_asm(half, 57344.0)))
except Exception as e:
    print(json.dumps({"error": repr(e)}))
    sys.exit(0)
count = lambda text, pat: len(re.findall(pat, text))
print(json.dumps({name: {"rn": count(t, r"div\.rn\.f32"), "approx": count(t, r"div\.(full|approx)"),
                         "mul_rm": count(t, r"mul\.rm\.f32"), "xorsign": count(t, r"max\.xorsign\.abs\.(bf|f)16x2"),
                         "f64": count(t, r"\.f64"), "setp2": count(t, r"setp\.gt\.(bf|f)16x2"),
                         "redux": count(t, r"redux\.sync"), "bar_red": count(t, r"bar\.red\.or"),
                         "cvt_e5m2": count(t, r"cvt\.rn\.satfinite\.e5m2x2\.f32"),
                         "cvt_e4m3": count(t, r"cvt\.rn\.satfinite\.e4m3x2\.f32"),
                         "via_f16": count(t, r"cvt\.[a-z.]*f16(x2)?\.f32|\.e[45]m[23]x2\.f16x2"),
                         "clamp": count(t, r"(max|min)\.NaN\.f32")}
                  for name, t in (("kernel", k), ("portable", portable), ("control", c), ("grid", grid),
                                  ("e4m3", e4m3), ("e4m3_89", e4m3_89), ("e5m2_89", e5m2_89), ("two_step", two_step),
                                  *builds.items())}))
"""


def test_ptx_divides_correctly_rounded(build_probe):
    """The kernel compiled for an H100/H200 (sm_90, ahead of time: no GPU needed) divides with div.rn.f32, what
    torch computes, never div.full/approx. Triton 3.6 ignores fdiv's ieee_rounding flag and emits div.full.f32,
    which leaves some e5m2 bytes one step off torch's. Control: a plain `/` compiles to the approximate division, so the
    check can see the difference. Runs in a subprocess: compiling needs TRITON_INTERPRET unset."""
    r = build_probe(_PTX_PROBE, timeout=600)
    assert r["kernel"]["rn"] > 0 and r["kernel"]["approx"] == 0, r
    assert r["control"]["approx"] > 0, r
    # The inline-PTX build: thresholds by mul.rm (no float64), the packed running max; the portable build (what the
    # interpreter runs) has neither -- so the GPU tests comparing both paths compare two different codes.
    assert r["kernel"]["mul_rm"] == 2 and r["kernel"]["xorsign"] > 0 and r["kernel"]["f64"] == 0, r
    assert r["portable"]["mul_rm"] == 0 and r["portable"]["xorsign"] == 0 and r["portable"]["f64"] > 0, r
    # The per-thread tail assembles for sm_90 in each of its forms (bf16/fp16, per-tensor/per-head limits): packed
    # compares, one barrier-OR of the flags (its hot path), the warp reductions of its rare path.
    for name in ("tail_bf16_0", "tail_bf16_1", "tail_f16_0", "tail_f16_1"):
        t = r[name]
        assert t["setp2"] >= 2 and t["redux"] >= 4 and t["bar_red"] == 1 and t["f64"] == 0, (name, r)
        assert t["rn"] > 0 and t["approx"] == 0, (name, r)
    # CVT_ASM (sm_89+, both formats): the store's conversion is the hardware's round-to-nearest-even from float32
    # (one cvt.rn.satfinite per two elements, written as inline PTX) with no float16 step, which would round twice
    # (Triton 3.6's own `.to(fp8)` on sm_89 takes one), and no clamp before it. Controls: an explicit float16 step
    # and the grid-rounding build (which keeps the clamp) show that the patterns see what they look for.
    for name, fmt in (("kernel", "e5m2"), ("e4m3", "e4m3"), ("e5m2_89", "e5m2"), ("e4m3_89", "e4m3")):
        t = r[name]
        assert t[f"cvt_{fmt}"] == 8 and t["via_f16"] == 0 and t["clamp"] == 0, (name, r)  # 2 x 8 elements per thread
    assert r["two_step"]["via_f16"] > 0 and r["grid"]["clamp"] > 0, r


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_inputs(monitor, kernel_device, dtype):
    """NaN is neither clipped nor a maximum (as in the torch path); +-Inf clips and is the maximum. With one token per
    program and several, so that the rare-path recount (a program whose max exceeds the ceiling) sees them too."""
    fmt, heads, dim = "e4m3", 2, 16
    for tokens in (3, 70):
        key = torch.full((tokens, heads, dim), 1.0, dtype=dtype)
        value = key.clone()
        key[0, 0, 0] = float("nan")  # a program with only NaN: no clip, max 1.0 there
        key[tokens - 1, 1, 3] = float("inf")
        key[tokens - 1, 0, 2] = 1000.0  # clipped
        value[1, 1, 1] = float("-inf")
        value[1, 1, 2] = float("nan")
        key, value = key.to(kernel_device), value.to(kernel_device)
        slots = torch.arange(tokens, device=kernel_device)
        kc = torch.zeros(tokens, heads, dim, dtype=torch.uint8, device=kernel_device).view(FP8_DTYPES[fmt])
        vc = kc.clone()
        fused = ClipCounter(f"nan.fused.{tokens}", kernel_device, fmt, monitor=monitor)
        quantize_kv_to_fp8_cache(key, value, kc, vc, slots, 1.0, 1.0, fused)
        torch_path = ClipCounter(f"nan.torch.{tokens}", kernel_device, fmt, monitor=monitor)
        torch_path.count(key, value, 1.0, 1.0, slots)
        want = {"k": 2, "v": 1, "k_max": float("inf"), "v_max": float("inf")}
        assert fused.totals() == torch_path.totals() == want


@pytest.mark.parametrize("tokens", [5, 70])
@pytest.mark.parametrize("kind", ["1elem", "per_head"])
def test_corrupted_negative_scale_tensor_counts_only_live_lanes(monitor, kernel_device, tokens, kind):
    """A scale TENSOR cannot be checked on the host without a sync, so a corrupted one (negative) reaches the kernel:
    every element then exceeds the (negative) ceiling, and the exact recount must still count only live lanes --
    not padded head_dim lanes, padding rows, slots past the cache, or tokens past a partial last program. The
    control: counting the masked lanes too (what an unmasked recount did) gives a different number."""
    heads, dim, nslots = 3, 12, 200
    scale = torch.tensor([-1.0] if kind == "1elem" else [-1.0, 1.0, -2.0], device=kernel_device)
    g = torch.Generator().manual_seed(tokens)
    key = (torch.randn(tokens, heads, dim, generator=g) * 3).to(kernel_device)
    value = key.clone()
    slots = torch.randperm(nslots, generator=g)[:tokens]
    slots[1] = -1  # padding row
    slots[2] = nslots + 7  # past the cache: masked and counted at the slot site, never as clipping
    slots = slots.to(kernel_device)
    kc = torch.zeros(nslots, heads, dim, dtype=torch.uint8, device=kernel_device).view(FP8_DTYPES["e4m3"])
    vc = kc.clone()
    fused = ClipCounter(f"neg.fused.{tokens}.{kind}", kernel_device, "e4m3", monitor=monitor)
    quantize_kv_to_fp8_cache(key, value, kc, vc, slots, scale, scale, fused)
    torch_path = ClipCounter(f"neg.torch.{tokens}.{kind}", kernel_device, "e4m3", monitor=monitor)
    valid = (slots >= 0) & (slots < nslots)
    torch_path.count(key, value, scale, scale, torch.where(valid, slots, -1))
    want, _ = f64_reference(key, scale, "e4m3", valid)
    assert fused.totals()["k"] == torch_path.totals()["k"] == want > 0
    # Control: what a recount that also counted masked lanes would report. Masked lanes load 0.0, and 0.0 exceeds
    # a negative ceiling; padded heads load the scale 1.0 (positive ceiling). Tiles are 4 x 16, programs cover
    # whole groups of tokens_per_program tokens.
    tpp = fp8_cache_launch(tokens, heads, dim, kernel_device).tokens_per_program
    ceil = (scale.double().cpu().expand(heads) if kind == "1elem" else scale.double().cpu()) * FP8_MAX["e4m3"]
    ceil = torch.cat([ceil, ceil[:1] if kind == "1elem" else torch.tensor([448.0], dtype=torch.float64)])
    unmasked = 0
    for t in range(-(-tokens // tpp) * tpp):
        for h in range(4):
            for d in range(16):
                live = t < tokens and bool(valid[t]) and h < heads and d < dim
                a = abs(float(key[t, h, d])) if live else 0.0
                unmasked += a > float(ceil[h])
    assert unmasked != want


@pytest.mark.parametrize("vec", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("per_head", [False, True])
def test_running_max_chunk_gives_the_same_counts(monitor, kernel_device, vec, per_head):
    """The running max reduces each thread's ``vec`` contiguous elements per token (the launcher picks the thread's
    16-byte load) and accumulates them over a program's tokens; any chunk must give the torch path's exact counts
    and maxima. 70 tokens: several tokens per program on the CPU too (so the accumulation across tokens and a
    program mixing live and padding tokens are exercised). The planted maximum and clipped elements sit at chunk
    ends and in the last live column before head_dim's padding (20 of a 32-wide block); a padding row in the same
    program as a clipped live token holds a larger value that must not count; with per-head scales [0.3, 1, 4] a
    reduction that mixed heads would move elements across thresholds."""
    tokens, heads, dim = 70, 3, 20
    g = torch.Generator().manual_seed(vec)
    key = (torch.randn(tokens, heads, dim, generator=g) * 50).to(kernel_device)
    value = (torch.randn(tokens, heads, dim, generator=g) * 50).to(kernel_device)
    key[4, 2, 19] = 1000.0  # clipped, the maximum, last live column
    key[7, 0, 7] = -700.0  # clipped, end of an 8-chunk
    value[2, 1, 15] = 3000.0  # clipped, the maximum, end of a 16-chunk
    slots = torch.arange(tokens, device=kernel_device)
    slots[3] = -1  # padding, in the same program as tokens 0-2 (token 2 clips): its values must not count
    value[3, 0, 0] = 9000.0
    key[3, 1, 1] = -5000.0
    kc = torch.zeros(tokens, heads, dim, dtype=torch.uint8, device=kernel_device).view(FP8_DTYPES["e4m3"])
    vc = kc.clone()
    scale: float | torch.Tensor = torch.tensor([0.3, 1.0, 4.0], device=kernel_device) if per_head else 1.0
    fused = ClipCounter(f"vec.fused.{vec}.{per_head}", kernel_device, "e4m3", monitor=monitor)
    _launch(key, value, kc, vc, slots, scale, scale, fused, count=True, guard=True, vec=vec)
    torch_path = ClipCounter(f"vec.torch.{vec}.{per_head}", kernel_device, "e4m3", monitor=monitor)
    torch_path.count(key, value, scale, scale, slots)
    want = torch_path.totals()
    assert (want["k_max"], want["v_max"]) == (1000.0, 3000.0)
    assert want["k"] >= 2 and want["v"] >= 1
    assert fused.totals() == want


def test_running_max_chunk_is_checked(monitor, kernel_device):
    c = ClipCounter("vec.bad", kernel_device, "e4m3", monitor=monitor)
    x = torch.zeros(2, 1, 16, device=kernel_device)
    kc = torch.zeros(4, 1, 16, dtype=torch.uint8, device=kernel_device).view(FP8_DTYPES["e4m3"])
    slots = torch.arange(2, device=kernel_device)
    for bad in (0, 3, 32):
        with pytest.raises(ValueError, match="vec must be a power of two"):
            _launch(x, x, kc, kc.clone(), slots, 1.0, 1.0, c, count=True, guard=True, vec=bad)
        with pytest.raises(ValueError, match="vec must be a power of two"):  # an empty batch is checked too
            _launch(x[:0], x[:0], kc, kc.clone(), slots[:0], 1.0, 1.0, c, count=True, guard=True, vec=bad)


def test_maxima_grow_across_launches_and_after_reset(monitor, kernel_device):
    """A program records its maxima only where they exceed the stored ones, which it reads at its start (a settled
    maximum costs no atomic). K and V are each compared with their own slot: the second batch has a smaller K max
    but a larger V max, so V must rise while K stays; an equal max changes nothing; after ``Monitor.reset()`` the
    slots are 0 again and a smaller batch is recorded. 70 tokens: several tokens per program on the CPU too, and
    each maximum sits in one program only (the others must not lower or skip it). The skip cannot change a result
    (an atomic max it skips could not have raised the slot): what it saves is measured in the lab
    (benchmarks/lab/numerics.py)."""
    tokens, heads, dim = 70, 2, 16
    c = ClipCounter("maxima.grow", kernel_device, "e4m3", monitor=monitor)
    kc = torch.zeros(tokens, heads, dim, dtype=torch.uint8, device=kernel_device).view(FP8_DTYPES["e4m3"])
    vc = kc.clone()
    slots = torch.arange(tokens, device=kernel_device)

    def launch(k_at: tuple[int, float], v_at: tuple[int, float]) -> dict:
        key = torch.full((tokens, heads, dim), 0.5, device=kernel_device)
        value = torch.full((tokens, heads, dim), -0.25, device=kernel_device)
        key[k_at[0], 1, 3] = k_at[1]
        value[v_at[0], 0, 9] = v_at[1]
        quantize_kv_to_fp8_cache(key, value, kc, vc, slots, 1.0, 1.0, c)
        return c.totals()

    assert launch((5, 100.0), (60, -10.0)) == {"k": 0, "v": 0, "k_max": 100.0, "v_max": 10.0}
    assert launch((66, 50.0), (2, 60.0)) == {"k": 0, "v": 0, "k_max": 100.0, "v_max": 60.0}
    assert launch((30, -100.0), (31, 60.0)) == {"k": 0, "v": 0, "k_max": 100.0, "v_max": 60.0}
    assert launch((9, 500.0), (9, 1.0)) == {"k": 1, "v": 0, "k_max": 500.0, "v_max": 60.0}
    monitor.reset()
    assert launch((40, 5.0), (41, 6.0)) == {"k": 0, "v": 0, "k_max": 5.0, "v_max": 6.0}


def test_launch_config_rules():
    """The launch shape (fp8_cache_launch), the same counted or not: one token per program; 2 warps for an 8 x 128
    tile, 4 below 32 tokens per SM; tiles scale the warps. Planned for an H200's 132 SMs (no GPU needed). The
    interpreter runs the loop (4 tokens per program) from 64 tokens, for coverage."""
    dev = torch.device("cuda", 7)

    def cfg(tokens, heads, head_dim, device=dev):  # type: ignore[no-untyped-def]
        return tuple(fp8_cache_launch(tokens, heads, head_dim, device, sm_count=132)[:2])

    assert cfg(2048, 8, 128) == (4, 1)
    assert cfg(32 * 132 - 1, 8, 128) == (4, 1)
    assert cfg(32 * 132, 8, 128) == (2, 1)
    assert cfg(1 << 20, 8, 128) == (2, 1)
    assert cfg(1 << 20, 32, 128) == (8, 1)
    assert cfg(1 << 20, 1, 64) == (1, 1)
    assert cfg(10, 64, 128) == (8, 1)
    assert cfg(1 << 20, 6, 100) == (2, 1)  # padded to an 8 x 128 tile
    assert cfg(63, 8, 128, torch.device("cpu")) == (4, 1)
    assert cfg(64, 8, 128, torch.device("cpu")) == (4, 4)
    # The per-thread tail's placement follows the same line: after the stores below it, before them from it.
    assert fp8_cache_launch(32 * 132 - 1, 8, 128, dev, sm_count=132).tail_after_stores
    assert not fp8_cache_launch(32 * 132, 8, 128, dev, sm_count=132).tail_after_stores
    assert fp8_cache_launch(32 * 66 - 1, 8, 128, dev, sm_count=66).tail_after_stores  # the line scales with SMs
    assert not fp8_cache_launch(32 * 66, 8, 128, dev, sm_count=66).tail_after_stores
    assert not fp8_cache_launch(16, 8, 128, "cpu").tail_after_stores  # the interpreter runs no per-thread tail


@pytest.mark.parametrize(
    "args, sm_count, err",
    [
        ((-1, 8, 128, "cpu"), None, "tokens must be an int >= 0, got -1"),
        ((4, 0, 128, "cpu"), None, "heads must be an int >= 1, got 0"),
        ((4, 8, 1.5, "cpu"), None, "head_dim must be an int >= 1, got 1.5"),
        ((4, 8, 128, "cuda"), 0, "sm_count must be an int >= 1, got 0"),
    ],
)
def test_launch_shape_rejects_bad_sizes(args, sm_count, err):
    with pytest.raises(ValueError, match=err):
        fp8_cache_launch(*args, sm_count=sm_count)


def test_launch_config_override_is_checked(monitor, kernel_device):
    c = ClipCounter("cfg.bad", kernel_device, "e4m3", monitor=monitor)
    x = torch.zeros(2, 1, 16, device=kernel_device)
    kc = torch.zeros(4, 1, 16, dtype=torch.uint8, device=kernel_device).view(FP8_DTYPES["e4m3"])
    slots = torch.arange(2, device=kernel_device)
    for bad in ((3, 1), (0, 1), (2, 0)):
        with pytest.raises(ValueError, match="config must be"):
            _launch(x, x, kc, kc.clone(), slots, 1.0, 1.0, c, count=True, guard=True, config=bad)
        with pytest.raises(ValueError, match="config must be"):  # an empty batch is checked too
            _launch(x[:0], x[:0], kc, kc.clone(), slots[:0], 1.0, 1.0, c, count=True, guard=True, config=bad)


def test_inline_ptx_only_where_it_compiles(monkeypatch):
    """Inline PTX goes only to a compiled NVIDIA kernel: never to the CPU, never under the interpreter (which
    cannot run PTX: a CUDA tensor under TRITON_INTERPRET=1 runs there too), never on ROCm. The observation flips
    with the interpreter flag alone."""
    cuda = torch.device("cuda", 0)

    def ptx(device):  # type: ignore[no-untyped-def]
        return fp8_cache_launch(16, 8, 128, device, sm_count=132).inline_ptx

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    assert ptx(cuda) and not ptx(torch.device("cpu"))
    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    assert not ptx(cuda)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not ptx(cuda)
