"""Numeric instruments: counted on the device, capture-safe, read by the monitor's reader in the same copy as the
guards.

* FP8 KV clip counter: :class:`ClipCounter` (one ``"clip"`` row per layer), its torch-ops path
  :meth:`ClipCounter.count`, and the fused quantise-into-paged-FP8-cache kernel :func:`quantize_kv_to_fp8_cache`
  (its launch shape: :func:`fp8_cache_launch`).
* Non-finite counter: :func:`count_nonfinite` into a site from :func:`register_nonfinite_site`.
* Non-finite rows: :class:`NonFiniteRows` (one hit per row, with its request; a site from
  :func:`register_nonfinite_rows_site`), what an engine's same-step verdict fails requests by.

Importing this module registers the ``"clip"`` and ``"nonfinite"`` reporters and the fused kernel's slot guard
site; it touches no device.
"""

from __future__ import annotations

from .clip import (
    FP8_DTYPES,
    FP8_MAX,
    K_COUNT,
    K_MAX,
    V_COUNT,
    V_MAX,
    ClipCounter,
    ClipReporter,
    bits_to_float,
    clip_thresholds,
    reference_quantize,
)
from .fused import FP8_CACHE_SLOT_SITE, FP8CacheLaunch, fp8_cache_launch, quantize_kv_to_fp8_cache
from .nonfinite import NonFiniteReporter, count_nonfinite, register_nonfinite_site
from .nonfinite_rows import NonFiniteRows, NonFiniteRowsReporter, register_nonfinite_rows_site

__all__ = [
    # FP8 clip counter
    "ClipCounter",
    "quantize_kv_to_fp8_cache",
    "fp8_cache_launch",
    "FP8CacheLaunch",
    "FP8_CACHE_SLOT_SITE",
    "reference_quantize",
    "clip_thresholds",
    "bits_to_float",
    "FP8_MAX",
    "FP8_DTYPES",
    "K_COUNT",
    "V_COUNT",
    "K_MAX",
    "V_MAX",
    # non-finite counter
    "count_nonfinite",
    "register_nonfinite_site",
    # non-finite rows (one per request: a step's logits)
    "NonFiniteRows",
    "register_nonfinite_rows_site",
    # reporters
    "ClipReporter",
    "NonFiniteReporter",
    "NonFiniteRowsReporter",
]
