"""FP8 clip counter, torch path (tripwire.numerics.clip): exact counts and maxima against a float64 reference with
values planted just above and just below the ceiling, the shape-(1,) threshold rule (with the 0-dim control that
undercounts), padding rows, and the "clip" reporter (confirmation one copy late, K/V deltas, suggested scale,
heartbeat, arming only for fatal counters). GPU: a captured CUDA graph replayed N times counts exactly N x."""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import pytest
import torch

from tripwire import Monitor, SiteRegistry
from tripwire.numerics import FP8_MAX, ClipCounter, bits_to_float, clip_thresholds
from tripwire.numerics.clip import ClipReporter

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FMTS = ["e4m3", "e5m2"]
H, D = 3, 16


def scale_f32(s) -> np.ndarray:
    """The float32 scale(s) as float64 numbers, one per head."""
    if isinstance(s, torch.Tensor):
        v = s.detach().cpu().double().reshape(-1).numpy()
        return np.broadcast_to(v, (H,)) if v.size == 1 else v
    return np.full(H, float(np.float32(s)))


def reference(x: torch.Tensor, scale, fmt: str, valid: torch.Tensor | None) -> tuple[int, float]:
    """float64: elements with |x| > fp8_max * scale (real arithmetic), and the max |x| (NaN left out)."""
    a = x.detach().cpu().double().abs().numpy()  # [T, H, D], exact
    ceiling = scale_f32(scale)[None, :, None] * FP8_MAX[fmt]  # exact in float64
    keep = np.ones(a.shape[0], bool) if valid is None else valid.cpu().numpy()
    a = a[keep]
    count = int((a > ceiling).sum())
    finite_or_inf = a[~np.isnan(a)]
    return count, float(finite_or_inf.max()) if finite_or_inf.size else 0.0


def neighbours(c: float, dtype: torch.dtype, k: int = 3) -> torch.Tensor:
    """The 2k+1 values of ``dtype`` around ``c`` (its rounding and k steps either side), as float64."""
    v = torch.tensor([c], dtype=torch.float64).to(dtype)
    ity = torch.int32 if dtype == torch.float32 else torch.int16
    bits = v.view(ity).to(torch.int64) + torch.arange(-k, k + 1)
    return bits.to(ity).view(dtype).double()


def planted(dtype: torch.dtype, fmt: str, scale, tokens: int, seed: int) -> torch.Tensor:
    """Random K/V of magnitude around the ceiling, with each head's ceiling neighbours planted (both signs)."""
    g = torch.Generator().manual_seed(seed)
    ceilings = scale_f32(scale) * FP8_MAX[fmt]
    x = torch.randn(tokens, H, D, generator=g, dtype=torch.float64) * torch.tensor(ceilings)[None, :, None] * 0.6
    for h in range(H):
        nb = neighbours(float(ceilings[h]), dtype)
        n = nb.numel()
        x[h % tokens, h, :n] = nb
        x[(h + 1) % tokens, h, D - n :] = -nb
    return x.to(dtype)


def scales(kind: str, fmt: str, dtype: torch.dtype):
    # Ceilings stay inside fp16's range for e5m2 (57344 x 1.1 < 65504).
    per_head = [0.7, 1.0 + 3 * 2**-10, 1.0 / 3.0]
    if kind == "float":
        return 1.0 / 3.0  # not a float32: used as float32
    if kind == "0dim":
        return torch.tensor(1.0 + 3 * 2**-10, dtype=torch.float32)
    if kind == "1elem":
        return torch.tensor([0.7], dtype=torch.float32)
    return torch.tensor(per_head, dtype=torch.float32)


@pytest.fixture
def make(monitor):
    def _make(name="layers.0.attn", fmt="e4m3", **kw):
        return ClipCounter(name, "cpu", fmt, monitor=monitor, **kw)

    return _make


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("kind", ["float", "0dim", "1elem", "per_head"])
def test_exact_counts_and_max(make, dtype, fmt, kind):
    ks, vs = scales(kind, fmt, dtype), scales("per_head" if kind != "per_head" else "float", fmt, dtype)
    key = planted(dtype, fmt, ks, 12, seed=1)
    value = planted(dtype, fmt, vs, 12, seed=2)
    slots = torch.tensor([5, -1, 0, 7, -1, 3, 2, 9, 11, -1, 4, 1])
    # Padding rows carry values far past the ceiling: they must not count, nor reach the max.
    key[1] = 4 * FP8_MAX[fmt]
    value[4] = -4 * FP8_MAX[fmt]
    c = make(fmt=fmt)
    c.count(key, value, ks, vs, slots)
    rk, mk = reference(key, ks, fmt, slots >= 0)
    rv, mv = reference(value, vs, fmt, slots >= 0)
    assert rk > 0 and rv > 0  # the planted values above the ceiling are there
    assert c.totals() == {"k": rk, "v": rv, "k_max": mk, "v_max": mv}
    # Without a slot mapping every row counts (so the padding rows above are what made the difference).
    c2 = make(name="layers.1.attn", fmt=fmt)
    c2.count(key, value, ks, vs)
    assert c2.totals()["k"] == reference(key, ks, fmt, None)[0] > rk


def test_accumulates_and_keeps_the_max(make):
    c = make()
    x = torch.zeros(4, H, D, dtype=torch.bfloat16)
    x[0, 0, 0] = 500.0
    c.count(x, x, 1.0, 1.0)
    y = torch.zeros(4, H, D, dtype=torch.bfloat16)
    y[1, 2, 3] = 460.0
    y[2, 2, 3] = -470.0
    c.count(y, -y, 1.0, 1.0)
    assert c.totals() == {"k": 3, "v": 3, "k_max": 500.0, "v_max": 500.0}


def test_nan_left_out_of_max_inf_counted(make):
    c = make()
    x = torch.zeros(2, H, D, dtype=torch.float16)
    x[0, 0, 0] = float("nan")
    x[0, 0, 1] = 100.0
    v = torch.zeros(2, H, D, dtype=torch.float16)
    v[1, 1, 1] = -float("inf")
    c.count(x, v, 1.0, 1.0)
    assert c.totals() == {"k": 0, "v": 1, "k_max": 100.0, "v_max": math.inf}


def test_zero_dim_threshold_undercounts_on_bf16_grid():
    """The bug class behind the shape-(1,) rule: a 0-dim float32 threshold is rounded to bf16."""
    s = 1.0 + 3 * 2**-10  # ceiling 449.3125; bf16 neighbours 448, 450; it rounds UP to 450
    x = torch.tensor([448.0, 450.0, 452.0], dtype=torch.bfloat16).view(3, 1, 1)
    true = int((x.double().abs() > 448.0 * s).sum())
    assert true == 2
    thr = clip_thresholds(s, "e4m3", 1, "cpu")
    assert thr.shape == (1,) and thr.dtype == torch.float32
    assert int((x.abs() > thr).sum()) == true
    # Control: the same threshold as a 0-dim tensor compares on the bf16 grid and misses 450.
    zero_dim = thr.reshape(())
    assert int((x.abs() > zero_dim).sum()) == true - 1


def test_threshold_is_the_float32_below_the_exact_ceiling():
    # 448 * float32(0.3) is not a float32; T must be the float32 just below it (then x > T <=> x > ceiling).
    s = float(np.float32(0.3))
    ceiling = 448.0 * s
    t = float(clip_thresholds(0.3, "e4m3", 1, "cpu")[0])
    assert t <= ceiling < float(np.nextafter(np.float32(t), np.float32(np.inf)))
    # The device path (tensor scales) agrees with the host path (float scales).
    td = clip_thresholds(torch.tensor([0.3, 0.3]), "e4m3", 2, "cpu")
    assert td.shape == (2, 1) and td.reshape(-1).tolist() == [t, t]
    # The float32 nearest the ceiling lies above it, so it is clipped, and T counts it ...
    x = torch.tensor([float(np.float32(ceiling))]).view(1, 1, 1)
    assert x.double().item() > ceiling
    assert int((x > clip_thresholds(0.3, "e4m3", 1, "cpu")).sum()) == 1
    # ... Control: a threshold rounded to nearest (not down) misses exactly that value.
    nearest = torch.tensor([ceiling], dtype=torch.float64).float()
    assert int((x > nearest).sum()) == 0


def test_threshold_cache_is_used_outside_capture(make):
    """Float scales' thresholds are filled once per counter (a ``torch.full``) and reused by later eager calls: the
    fills are counted at torch's dispatch. K and V at one scale share one entry. Control: a new scale is a new fill."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Fills(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten.full.default:
                self.n += 1
            return func(*args, **(kwargs or {}))

    c = make()
    x = torch.zeros(1, H, D)

    def fills(k_scale: float, v_scale: float) -> int:
        with Fills() as mode:
            c.count(x, x, k_scale, v_scale)
        return mode.n

    assert fills(0.5, 0.5) == 1  # V finds K's entry
    assert fills(0.5, 0.5) == 0
    assert fills(0.5, 0.25) == 1  # control: V's new scale is filled, K's is not


@pytest.mark.parametrize(
    "kw, err",
    [
        (dict(key=torch.zeros(4, H * D)), "tokens, heads, head_dim"),
        (dict(key=torch.zeros(4, H, D, dtype=torch.int32)), "bf16, fp16 or fp32"),
        (dict(k_scale=torch.ones(2)), "per head"),
        (dict(k_scale=torch.ones(H, dtype=torch.float64)), "float32"),
        (dict(k_scale=-1.0), "> 0"),
        (dict(slot_mapping=torch.zeros(3, dtype=torch.int64)), "one slot per token"),
        (dict(slot_mapping=torch.zeros(4)), "int32 or int64"),
    ],
)
def test_count_rejects_bad_arguments(make, kw, err):
    c = make()
    args = dict(key=torch.zeros(4, H, D), value=torch.zeros(4, H, D), k_scale=1.0, v_scale=1.0, slot_mapping=None)
    args.update(kw)
    with pytest.raises((ValueError, TypeError), match=err):
        c.count(**args)
    assert c.totals()["k"] == 0


def test_registration(monitor, registry):
    c = ClipCounter("layers.3.attn", "cpu", "e5m2", monitor=monitor)
    assert c.site.kind == "clip" and not c.site.fatal and c.fp8_max == 57344.0
    assert ClipCounter("layers.3.attn", "cpu", "e5m2", monitor=monitor).site is c.site
    with pytest.raises(ValueError):
        ClipCounter("layers.3.attn", "cpu", "e4m3", monitor=monitor)  # another format: another description
    with pytest.raises(ValueError, match="fmt"):
        ClipCounter("layers.4.attn", "cpu", "e3m4", monitor=monitor)
    assert registry.get("numerics.fp8_cache.slot").fatal


def test_bits_encoding_orders_like_values():
    vals = np.array([0.0, 1e-45, 1e-38, 0.5, 448.0, 57344.0, 3.4e38, np.inf], dtype=np.float32)
    words = vals.view(np.int32).astype(np.int64)
    assert np.all(np.diff(words) > 0)
    assert [bits_to_float(int(w)) for w in words] == vals.tolist()


# ------------------------------------------------------------------------------------------------------ reporting


def clip_once(c: ClipCounter, k: int, v: int, big: float = 900.0) -> None:
    key = torch.zeros(8, H, D, dtype=torch.bfloat16)
    value = torch.zeros(8, H, D, dtype=torch.bfloat16)
    key.view(-1)[:k] = big
    value.view(-1)[:v] = -big / 2
    c.count(key, value, 1.0, 1.0)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "CLIPPING" in r.getMessage()]


def test_rise_reported_one_copy_after_first_sight(monitor, make, caplog):
    caplog.set_level(logging.INFO, logger="tripwire")
    c = make("layers.7.attn")
    clip_once(c, 5, 2)
    monitor.poll()  # first sight: pending
    assert warnings_of(caplog) == []
    monitor.poll()  # confirmed with this copy's row
    (msg,) = warnings_of(caplog)
    assert "'layers.7.attn'" in msg and "on cpu" in msg
    assert "K +5 (5 total)" in msg and "V +2 (2 total)" in msg
    assert "max |K| 900 (K scale >= 2.00893 would fit)" in msg  # 900 / 448
    assert "max |V| 450 (V scale >= 1.00446 would fit)" in msg
    assert monitor.armed is None  # not fatal: reported, never armed
    # A second rise inside report_every is aggregated; drain flushes it with the K/V deltas since the last line.
    clip_once(c, 3, 0)
    monitor.poll()
    monitor.poll()
    assert len(warnings_of(caplog)) == 1
    monitor.drain()
    last = warnings_of(caplog)[-1]
    assert "K +3 (8 total)" in last and "V +0 (2 total)" in last
    assert monitor.armed is None


def test_nonfatal_never_arms_even_in_raise_mode(caplog):
    reg = SiteRegistry(capacity=16)
    m = Monitor(registry=reg, capacity=16, mode="raise", interval=0.01)
    c = ClipCounter("layers.0.attn", "cpu", monitor=m)
    clip_once(c, 1, 1)
    m.poll()
    m.poll()
    assert warnings_of(caplog) and m.armed is None
    # Control: the same clip on a fatal counter arms the stop.
    f = ClipCounter("layers.1.attn", "cpu", monitor=m, fatal=True)
    clip_once(f, 1, 0)
    m.poll()
    m.poll()
    assert m.armed is not None and m.armed.site == "layers.1.attn" and m.armed.fatal
    with pytest.raises(Exception, match="CLIPPING"):
        m.check()


def test_fatal_counter_arms_in_warn_mode(monitor, make):
    c = make("layers.2.attn", fatal=True)
    clip_once(c, 2, 0)
    monitor.poll()
    assert monitor.armed is None  # not before confirmation
    monitor.poll()
    assert monitor.armed is not None and monitor.armed.count == 2


def test_heartbeat(caplog):
    caplog.set_level(logging.INFO, logger="tripwire")
    reg = SiteRegistry(capacity=16)
    m = Monitor(registry=reg, capacity=16, heartbeat=0.2, interval=0.01)
    c = ClipCounter("layers.0.attn", "cpu", monitor=m)
    ClipCounter("layers.1.attn", "cpu", monitor=m)

    def beats():
        return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "alive" in r.getMessage()]

    m.poll()
    assert len(beats()) == 1  # the first read: the counters are alive
    assert "2 layer(s), K clipped 0, V clipped 0" in beats()[0]
    clip_once(c, 4, 1)
    m.poll()
    assert len(beats()) == 1  # not due yet
    time.sleep(0.25)
    m.poll()
    assert len(beats()) == 2
    assert "K clipped 4, V clipped 1" in beats()[1] and "'layers.0.attn' 5" in beats()[1]


def test_reporter_deltas_survive_reset(monitor, make, caplog):
    c = make()
    clip_once(c, 4, 4)
    monitor.drain()
    monitor.reset()
    clip_once(c, 1, 1)
    monitor.drain()
    assert "K +1 (1 total)" in warnings_of(caplog)[-1]


def test_reporter_plugged_for_clip_kind(monitor, make):
    make()
    assert isinstance(monitor.pipeline.reporters.make("clip"), ClipReporter)


# ------------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("kind", ["float", "1elem", "per_head"])
def test_gpu_exact_counts(dtype, fmt, kind):
    reg = SiteRegistry(capacity=16)
    m = Monitor(registry=reg, capacity=16)
    ks = scales(kind, fmt, dtype)
    ks = ks.cuda() if isinstance(ks, torch.Tensor) else ks
    key = planted(dtype, fmt, ks, 64, seed=3).cuda()
    value = planted(dtype, fmt, ks, 64, seed=4).cuda()
    slots = torch.arange(64, device="cuda")
    slots[::5] = -1
    c = ClipCounter("layers.0.attn", "cuda", fmt, monitor=m)
    c.count(key, value, ks, ks, slots)
    rk, mk = reference(key, ks, fmt, slots >= 0)
    rv, mv = reference(value, ks, fmt, slots >= 0)
    assert c.totals() == {"k": rk, "v": rv, "k_max": mk, "v_max": mv}


@pytest.mark.gpu
def test_gpu_graph_replay_counts_n_times(caplog):
    caplog.set_level(logging.INFO, logger="tripwire")
    reg = SiteRegistry(capacity=16)
    m = Monitor(registry=reg, capacity=16, interval=0.01)
    m.prealloc("cuda")
    c = ClipCounter("layers.0.attn", "cuda", monitor=m)
    key = planted(torch.bfloat16, "e4m3", 1.0, 32, seed=5).cuda()
    value = planted(torch.bfloat16, "e4m3", 0.5, 32, seed=6).cuda()
    slots = torch.arange(32, device="cuda")
    slots[-4:] = -1
    ks = torch.tensor([1.0], device="cuda")
    rk, mk = reference(key, 1.0, "e4m3", slots >= 0)
    rv, mv = reference(value, 0.5, "e4m3", slots >= 0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        c.count(key, value, ks, 0.5, slots)  # warm-up: caches the float threshold outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    m.reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c.count(key, value, ks, 0.5, slots)
    assert c.totals()["k"] == 0  # capture runs nothing
    n = 7
    for _ in range(n):
        g.replay()
    torch.cuda.synchronize()
    assert c.totals() == {"k": n * rk, "v": n * rv, "k_max": mk, "v_max": mv}
    for _ in range(4):  # the reader: first sight, then confirmation (copies land asynchronously)
        m.poll()
        torch.cuda.synchronize()
    msgs = warnings_of(caplog)
    assert msgs and f"({n * rk} total)" in msgs[-1] and "cuda:0" in msgs[-1]


def test_heartbeat_continues_after_reset(caplog):
    """reset() drops the reporters (they keep per-row state); the next read makes them again, so the heartbeat
    goes on. Control: without re-making them on the read, no heartbeat follows the reset."""
    caplog.set_level(logging.INFO, logger="tripwire")
    reg = SiteRegistry(capacity=16)
    m = Monitor(registry=reg, capacity=16, heartbeat=0.01, interval=0.01)
    ClipCounter("layers.0.attn", "cpu", monitor=m)

    def beats():
        return [r for r in caplog.records if r.levelno == logging.INFO and "alive" in r.getMessage()]

    def polls(k: int) -> int:
        before = len(beats())
        for _ in range(k):
            time.sleep(0.012)
            m.poll()
        return len(beats()) - before

    assert polls(3) == 3
    m.reset()
    assert polls(3) == 3
    # Control: the reporters dropped while the confirmer keeps its plan and its last rows (a reset that forgets
    # only them): nothing re-makes them on the read, so nothing ticks.
    m.pipeline.reporters.clear()
    assert polls(3) == 0
