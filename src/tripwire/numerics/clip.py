"""FP8 KV-cache clip counter: per layer, how many K and V elements a static FP8 scale saturated, and how large
the activations really were.

Quantised KV caches with static (calibrated) scales clip silently when activations outgrow the calibration: the
model gets worse and nothing says why. A :class:`ClipCounter` owns one arena row per layer (kind ``"clip"``), read by
the monitor's reader in the same copy as every guard row, and reported by the ``"clip"`` reporter registered here.

Row slots (``K_COUNT`` .. ``V_MAX``):
    0  K elements clipped (plain count)
    1  V elements clipped
    2  K max magnitude seen, as the zero-extended bits of a float32
    3  V max magnitude seen, likewise
    4..7 spare

Why float bits work with an integer max: for non-negative IEEE floats the bit patterns order exactly like the values
(and +inf above every finite value), so ``atomic_max`` / ``torch.maximum`` on the int64 words keeps the largest
magnitude, and a zeroed row decodes as 0.0. NaN elements are left out of the max (their bits sort above +inf, which
would hide the real maximum; count them with :func:`tripwire.numerics.count_nonfinite`).

What "clipped" means, exactly: ``|x| > fp8_max * scale`` in real arithmetic, where ``x`` is the input element
(bf16/fp16/fp32, exactly representable as float32), ``scale`` is the float32 scale (Python floats are rounded to
float32 first: the cache stores float32 scales) and ``fp8_max`` is 448 (e4m3) or 57344 (e5m2). Every such element
is saturated by the quantisation ``clamp(x / scale, -fp8_max, fp8_max).to(fp8)``; no other element is. Both paths
(the torch ops here and the fused Triton kernel in :mod:`tripwire.numerics.fused`) evaluate this comparison exactly:
the ceiling ``fp8_max * scale`` is formed in float64 (exact: 24 x 3 significant bits) and rounded DOWN to float32,
``T``; for a float32 ``x``, ``x > ceiling`` if and only if ``x > T``.

The max slots hold the largest magnitude among counted (non-padding) elements, clipped or not, so a report can say
which scale would have fitted: ``max / fp8_max``.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._runtime.arena import normalize_device
from .._runtime.capture import is_capturing
from ..errors import GuardTripped
from ..report import Event, Report, ReportContext, Wording, register_reporter, short_name
from ..sites import Site, SiteRegistry

if TYPE_CHECKING:
    from ..monitor import Monitor

__all__ = [
    "FP8_DTYPES",
    "FP8_MAX",
    "K_COUNT",
    "K_MAX",
    "SLOT_SITE_DESCRIPTION",
    "SLOT_SITE_NAME",
    "V_COUNT",
    "V_MAX",
    "ClipCounter",
    "ClipReporter",
    "bits_to_float",
    "clip_message",
    "clip_thresholds",
    "clip_wording",
    "reference_quantize",
]

log = logging.getLogger("tripwire")

K_COUNT, V_COUNT, K_MAX, V_MAX = 0, 1, 2, 3

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

# The guard site of the fused kernel's slot mapping (a slot past the cache is masked and counted here). Fatal: the
# token's K/V were NOT written, so the cache keeps stale data at a position attention will read -- durable damage.
SLOT_SITE_NAME = "numerics.fp8_cache.slot"
SLOT_SITE_DESCRIPTION = (
    "slot_mapping entry >= the FP8 KV cache's slot count: that token's K/V were not written to the cache"
)

# Which format each clip row was registered with (the reporter needs fp8_max for the suggested scale). Keyed by
# registry (weakly: a test's private registry may die) then row id.
_FORMATS: weakref.WeakKeyDictionary[SiteRegistry, dict[int, str]] = weakref.WeakKeyDictionary()


def _check_fmt(fmt: str) -> str:
    if fmt not in FP8_MAX:
        raise ValueError(f"fmt must be one of {sorted(FP8_MAX)}, got {fmt!r}")
    return fmt


def bits_to_float(word: int) -> float:
    """Decode a max slot (zero-extended float32 bits) to a Python float; 0 decodes as 0.0."""
    return float(np.array([word & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0])


def clip_totals(row: Any) -> dict[str, int | float]:
    """A ``"clip"`` row (its eight words, host-side) decoded: ``{"k", "v", "k_max", "v_max"}``."""
    return {
        "k": int(row[K_COUNT]),
        "v": int(row[V_COUNT]),
        "k_max": bits_to_float(int(row[K_MAX])),
        "v_max": bits_to_float(int(row[V_MAX])),
    }


def _host_threshold(scale: float, fmt: str) -> float:
    """The float32 ``T`` with ``x > T`` <=> ``x > fp8_max * float32(scale)`` for every float32 ``x``."""
    s32 = np.float32(scale)
    if not (math.isfinite(float(s32)) and s32 > 0):
        raise ValueError(f"an FP8 scale must be a finite number > 0 (as float32), got {scale!r}")
    ceiling = float(s32) * FP8_MAX[fmt]  # exact in float64
    t = np.float32(ceiling)  # round to nearest ...
    if float(t) > ceiling:  # ... then down, if nearest was above
        t = np.nextafter(t, np.float32(0))
    return float(t)


def _device_threshold(scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Same as :func:`_host_threshold`, on the device, elementwise (capture-safe torch ops, no sync)."""
    ceiling = scale.double() * FP8_MAX[fmt]
    t = ceiling.float()
    return torch.where(t.double() > ceiling, torch.nextafter(t, torch.zeros_like(t)), t)


def _check_scale_tensor(scale: torch.Tensor, heads: int, device: torch.device, what: str) -> bool:
    """Validate a scale tensor; True when it is per head."""
    if scale.dtype != torch.float32:
        raise TypeError(f"{what} must be float32 (the dtype the cache's dequantisation uses), got {scale.dtype}")
    if scale.device != device:
        raise ValueError(f"{what} is on {scale.device}, the data on {device}")
    if scale.numel() == 1:
        return False
    if scale.dim() == 1 and scale.shape[0] == heads:
        return True
    raise ValueError(
        f"{what} must be a Python float, a 0-dim or 1-element tensor (per tensor) or a [{heads}] tensor (per head), "
        f"got shape {tuple(scale.shape)}"
    )


def clip_thresholds(
    scale: float | torch.Tensor,
    fmt: str,
    heads: int,
    device: torch.device | str,
    _cache: dict | None = None,
    *,
    what: str = "scale",
) -> torch.Tensor:
    """The clip thresholds ``T`` for ``scale`` as a float32 tensor of shape ``(1,)`` (per tensor) or ``(heads, 1)``
    (per head), broadcastable against ``[tokens, heads, head_dim]``: ``|x| > T`` exactly when ``|x| > fp8_max *
    scale`` (see the module docstring).

    Why shape ``(1,)`` and not a 0-dim tensor: PyTorch's type promotion treats a 0-dim tensor like a Python scalar,
    so ``bf16_tensor > zero_dim_float32`` is computed on the bf16 grid -- the threshold is rounded to bf16 and values
    just above the true ceiling (below its bf16 rounding) are not counted. A tensor with a dimension takes part in
    promotion as a tensor, so the comparison runs in float32, where every bf16/fp16 value and this threshold are
    exact. ``tests/numerics/test_clip.py`` shows the 0-dim version undercounting.
    """
    fmt = _check_fmt(fmt)
    dev = torch.device(device)
    if isinstance(scale, torch.Tensor):
        per_head = _check_scale_tensor(scale, heads, dev, what)
        t = _device_threshold(scale.reshape(-1), fmt)
        return t.reshape(heads, 1) if per_head else t
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{what} must be a Python float or a float32 tensor, got {type(scale).__name__}")
    key = (dev, fmt, float(scale))
    if _cache is not None:
        hit = _cache.get(key)
        if hit is not None:
            return hit
    value = _host_threshold(float(scale), fmt)
    # torch.full bakes the value into a fill kernel: no host-to-device copy, so it is capture-safe.
    t = torch.full((1,), value, dtype=torch.float32, device=dev)
    # Cache only outside a capture: a tensor allocated during a capture lives in the graph's private pool and is
    # only filled when the graph replays, so it must not be reused by eager calls.
    if _cache is not None and not is_capturing():
        _cache[key] = t
    return t


def reference_quantize(x: torch.Tensor, scale: float | torch.Tensor, fmt: str) -> torch.Tensor:
    """The reference FP8 quantisation of ``x`` ``[tokens, heads, head_dim]``: ``clamp(x.float() / scale, -fp8_max,
    fp8_max).to(fp8)``, with ``scale`` (a float or a 1-element/per-head float32 tensor) as float32.

    The division is by a float32 device tensor, deliberately: PyTorch's CUDA kernel for division by a CPU scalar
    multiplies by the reciprocal instead, which differs in the last bit for some inputs. This is what the fused
    kernel must match bit for bit. A tool's and a test's function: it allocates.
    """
    fmt = _check_fmt(fmt)
    heads = x.shape[1] if x.dim() == 3 else 1
    if isinstance(scale, torch.Tensor):
        s = scale.reshape(-1).to(device=x.device, dtype=torch.float32)
        s = s.reshape(heads, 1) if s.numel() > 1 else s
    else:
        s = torch.full((1,), float(np.float32(scale)), dtype=torch.float32, device=x.device)
    fmax = FP8_MAX[fmt]
    return (x.float() / s).clamp(-fmax, fmax).to(FP8_DTYPES[fmt])


def _register_format(registry: SiteRegistry, site: Site, fmt: str) -> None:
    table = _FORMATS.setdefault(registry, {})
    old = table.get(site.id)
    if old is not None and old != fmt:
        raise ValueError(f"clip counter {site.name!r} is already registered with fmt={old!r}, not {fmt!r}")
    table[site.id] = fmt


def _format_of(site: Site) -> str | None:
    reg = site.registry
    if reg is None:
        return None
    return _FORMATS.get(reg, {}).get(site.id)


class ClipCounter:
    """One layer's FP8 KV clip counter: a ``"clip"`` row in ``monitor``'s arena on ``device``.

    Create it before any capture (it registers the row and allocates the arena if needed). ``fatal=True`` makes a
    clip arm the stop (in every mode but off); by default clipping is only reported, never stops the engine, even in
    ``raise`` mode: saturation is a quality problem, not memory corruption.

    Counting paths:
    * :meth:`count` -- plain torch ops (several passes over K/V), capture-safe, for caches written elsewhere.
    * :func:`tripwire.numerics.fused.quantize_kv_to_fp8_cache` -- quantises into a paged FP8 cache and counts in the
      same pass.

    Attributes: ``site`` (the row), ``ctr`` (the int64 ``[8]`` row view on ``device``), ``slot_site``/``slot_ctr``
    (the fused kernel's slot-mapping guard row), ``fmt``, ``fp8_max``, ``fp8_dtype``, ``device``, ``monitor``.
    """

    def __init__(
        self,
        name: str,
        device: torch.device | str | int,
        fmt: str = "e4m3",
        *,
        fatal: bool = False,
        monitor: Monitor | None = None,
        description: str = "",
    ) -> None:
        if monitor is None:
            from .._default import default_monitor

            monitor = default_monitor()
        self.fmt = _check_fmt(fmt)
        self.fp8_max = FP8_MAX[fmt]
        self.fp8_dtype = FP8_DTYPES[fmt]
        self.monitor = monitor
        self.device = normalize_device(device)
        desc = f"FP8 {fmt} KV-cache clip counter" + (f": {description}" if description else "")
        self.site = monitor.registry.register(name, description=desc, fatal=fatal, kind="clip")
        _register_format(monitor.registry, self.site, fmt)
        self.slot_site = monitor.registry.register(SLOT_SITE_NAME, description=SLOT_SITE_DESCRIPTION, fatal=True)
        self.ctr = monitor.counter(self.site, self.device)
        self.slot_ctr = monitor.counter(self.slot_site, self.device)
        self._thresholds: dict = {}

    @property
    def name(self) -> str:
        return self.site.name

    def count(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_scale: float | torch.Tensor,
        v_scale: float | torch.Tensor,
        slot_mapping: torch.Tensor | None = None,
    ) -> None:
        """Count clipped K/V elements and record their max magnitudes into this layer's row, with torch ops.

        ``key``/``value``: ``[tokens, heads, head_dim]`` bf16/fp16/fp32 on this counter's device. Scales: Python
        floats, 0-dim/1-element float32 tensors (per tensor) or ``[heads]`` float32 tensors (per head).
        ``slot_mapping`` (``[tokens]`` int): rows whose slot is negative (padding of a captured batch) are not
        counted. Capture-safe: no host sync, no host-to-device copy (tensor scales are turned into thresholds on the
        device; Python-float thresholds are filled by a kernel and cached after the first eager call).
        """
        for x, what in ((key, "key"), (value, "value")):
            if x.dim() != 3:
                raise ValueError(f"{what} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
            if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise TypeError(f"{what} must be bf16, fp16 or fp32, got {x.dtype}")
            if x.device != self.device:
                raise ValueError(f"{what} is on {x.device}, clip counter {self.name!r} counts on {self.device}")
        if key.shape[0] != value.shape[0]:
            raise ValueError(f"key has {key.shape[0]} tokens, value {value.shape[0]}")
        valid = None
        if slot_mapping is not None:
            if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
                raise ValueError(
                    f"slot_mapping must be [{key.shape[0]}] (one slot per token), got {tuple(slot_mapping.shape)}"
                )
            if slot_mapping.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
            if slot_mapping.device != self.device:
                raise ValueError(f"slot_mapping is on {slot_mapping.device}, the counter on {self.device}")
            valid = (slot_mapping >= 0).view(-1, 1, 1)
        if key.shape[0] == 0:
            return  # nothing to count (and amax of an empty tensor would raise)
        # Every op below is a device op on the current stream: temporaries come from the caching allocator (from
        # the graph's private pool under capture) and nothing is read back, so the whole method can be captured.
        counts = []
        maxima = []
        for x, scale, what in ((key, k_scale, "k_scale"), (value, v_scale, "v_scale")):
            thr = clip_thresholds(scale, self.fmt, x.shape[1], self.device, self._thresholds, what=what)
            a = x.abs()  # exact in x's dtype
            over = a > thr  # float32 comparison: thr has a dimension (see clip_thresholds)
            if valid is not None:
                over = over & valid
                a = a.masked_fill(~valid, 0)
            counts.append(over.sum())
            # NaN is left out of the max (its bits would sort above +inf); +inf stays (it was clipped).
            a = a.nan_to_num(nan=0.0, posinf=math.inf)
            maxima.append(a.amax().float().view(torch.int32).to(torch.int64))
        ctr = self.ctr
        # In-place on the row view: stream-ordered after earlier kernels on this stream, no host involvement.
        ctr[K_COUNT : V_COUNT + 1] += torch.stack(counts)
        m = ctr[K_MAX : V_MAX + 1]
        torch.maximum(m, torch.stack(maxima), out=m)

    def totals(self) -> dict[str, int | float]:
        """``{"k", "v", "k_max", "v_max"}``: clipped counts and max magnitudes so far, decoded. A synchronous read
        (it waits for the device): a tool's and a test's call, never the step path's."""
        return clip_totals(self.monitor.read_rows(self.device)[self.site.id])

    def __repr__(self) -> str:
        return f"ClipCounter({self.name!r}, {str(self.device)!r}, fmt={self.fmt!r}, fatal={self.site.fatal})"


# ---------------------------------------------------------------------------------------------------- reporting


def _fmt_max(m: float, fmax: float | None, what: str) -> str:
    if m == 0.0:
        return f"max |{what}| 0"
    if fmax is None:
        return f"max |{what}| {m:.6g}"
    if math.isinf(m):
        return f"max |{what}| inf (no finite {what} scale fits)"
    return f"max |{what}| {m:.6g} ({what} scale >= {m / fmax:.6g} would fit)"


def clip_wording(site: Site, device: str, row: np.ndarray, dk: int | None, dv: int | None) -> Wording:
    """The words of a clip row's report: the K and V deltas and totals first, the maxima and the scale that would
    have fitted in the detail."""
    fmt = _format_of(site)
    fmax = FP8_MAX.get(fmt) if fmt is not None else None
    k, v = int(row[K_COUNT]), int(row[V_COUNT])
    kmax, vmax = bits_to_float(int(row[K_MAX])), bits_to_float(int(row[V_MAX]))
    fatal = " (FATAL counter)" if site.fatal else ""
    kd = f"+{dk} " if dk is not None else ""
    vd = f"+{dv} " if dv is not None else ""
    ceiling = f"{fmt} max {fmax:g} x scale" if fmax is not None else "fp8 max x scale"
    line = short_name(
        lambda s: (
            f"FP8 KV CLIPPING in layer {s} on {device}{fatal}: K {kd}({k} total), V {vd}({v} total) elements "
            f"exceeded {ceiling} and were saturated."
        ),
        site.name,
    )
    detail = f"Observed lifetime {_fmt_max(kmax, fmax, 'K')}, {_fmt_max(vmax, fmax, 'V')}."
    return Wording(line, detail, "The static KV scales are too small for these activations: recalibrate.")


def clip_message(site: Site, device: str, row: np.ndarray, dk: int | None, dv: int | None) -> str:
    """The whole report of a clip row as one string (an exception's message)."""
    return "tripwire: " + str(clip_wording(site, device, row, dk, dv))


class ClipReporter:
    """The monitor's reporter for ``"clip"`` rows: a report per confirmed rise (aggregated by the monitor's window,
    with the K and V deltas since the last one; one event per tensor that rose, kinds ``"clip_k"`` and
    ``"clip_v"``), arming only for fatal counters; and an INFO heartbeat every ``monitor.settings.heartbeat``
    seconds with the totals, proving the counters are being read."""

    count_slots = (K_COUNT, V_COUNT)

    def __init__(self) -> None:
        self._logged: dict[tuple[str, int], tuple[int, int]] = {}  # (device, row) -> (k, v) at the last report
        self._next_beat: float | None = None

    def confirm(self, ctx: ReportContext, device: str, site: Site, row: np.ndarray, now: float) -> None:
        key = (device, site.id)
        row = row.copy()
        k, v = int(row[K_COUNT]), int(row[V_COUNT])

        def render(_delta: int) -> Report:
            # Called when the report actually goes out (maybe later, aggregated): deltas since the last one.
            lk, lv = self._logged.get(key, (0, 0))
            if k < lk or v < lv:  # the counters were reset since
                lk, lv = 0, 0
            self._logged[key] = (k, v)
            events = tuple(
                Event(kind, site.name, device, delta=d, total=t, fatal=site.fatal)
                for kind, d, t in (("clip_k", k - lk, k), ("clip_v", v - lv, v))
                if d > 0
            )
            return Report(events, clip_wording(site, device, row, k - lk, v - lv), site.name)

        ctx.emit(key, k + v, now, render)
        if site.fatal:
            ctx.arm(
                GuardTripped(
                    clip_message(site, device, row, None, None) + " The counter is fatal: the engine was stopped "
                    "by tripwire.check().",
                    site=site.name,
                    device=device,
                    count=k + v,
                    fatal=True,
                )
            )

    def tick(self, ctx: ReportContext, latest: dict[str, np.ndarray], now: float) -> None:
        if self._next_beat is not None and now < self._next_beat:
            return
        lines = []
        sites = ctx.registry.all()
        for device, rows in sorted(latest.items()):
            clip = [s for s in sites[: rows.shape[0]] if s.kind == "clip"]
            if not clip:
                continue
            lines.append(_heartbeat_line(device, clip, rows))
        if not lines:
            return  # nothing read yet: try again next tick
        self._next_beat = now + ctx.settings().heartbeat
        for line in lines:
            log.info("%s", line)


def _heartbeat_line(device: str, clip: list[Site], rows: np.ndarray) -> str:
    ids = [s.id for s in clip]
    k = int(rows[ids, K_COUNT].sum())
    v = int(rows[ids, V_COUNT].sum())
    kmax = [(bits_to_float(int(rows[i, K_MAX])), s.name) for i, s in zip(ids, clip, strict=True)]
    vmax = [(bits_to_float(int(rows[i, V_MAX])), s.name) for i, s in zip(ids, clip, strict=True)]
    mk, lk = max(kmax)
    mv, lv = max(vmax)
    clipping = sorted(
        ((int(rows[s.id, K_COUNT] + rows[s.id, V_COUNT]), s.name) for s in clip if rows[s.id, :2].any()),
        reverse=True,
    )
    worst = ", ".join(f"{n!r} {c}" for c, n in clipping[:8]) + (" ..." if len(clipping) > 8 else "")
    return (
        f"tripwire: FP8 clip counters alive on {device}: {len(clip)} layer(s), K clipped {k}, V clipped {v} in "
        f"total; largest max |K| {mk:.6g} ({lk!r}), |V| {mv:.6g} ({lv!r})"
        + (f"; clipping layers: {worst}" if clipping else "")
    )


register_reporter("clip", ClipReporter)
