"""vLLM's numeric faults per request: the step's logits checked for NaN/Inf, one row per request, after vLLM
computes them and before it applies a grammar's bitmask or samples (site ``vllm.logits_nonfinite``,
:class:`tripwire.numerics.NonFiniteRows`), inside the step's same-step verdict.

Where the logits are:

* V1 (``gpu_model_runner``, 0.26-0.33): ``execute_model`` computes them and keeps them in its
  ``execute_model_state`` for ``sample_tokens``; the check runs when ``execute_model`` returns, before the verdict
  copy is enqueued (:func:`tripwire.integrations.vllm._runner.lifecycle`).
* V2 (``gpu/model_runner``): ``sample_tokens`` computes them in ``sample`` (``model.compute_logits``, in 0.34 through
  ``model_state.compute_sample_logits``, which calls it) and applies the grammar bitmask right after. The model's
  ``compute_logits`` is wrapped on the instance and checks only while ``sample`` runs (prompt logprobs and the
  warm-up's sampler run call it too, on rows that are not the step's requests); the verdict copy is enqueued when
  ``sample`` returns, before V2 copies the sampled tokens out.

Why before the bitmask: a grammar sets the logits of every disallowed token to -inf, which is not a fault; the model's
own logits hold none. Under ``mask`` and ``contain`` the row's NaN/Inf are set to 0, so the sampler draws an id
inside the vocabulary (a NaN row can make a sampler return an id past it, which the next step's embedding lookup
would read out of bounds under async scheduling, where the next step is already scheduled); under ``contain`` the
verdict fails the request in that step and no token of it is returned. Under ``flag`` the rows are counted only.

One logits row per request is what the check expects: speculative decoding (several rows per request) is refused
under ``contain`` and skipped with a warning otherwise; a pooling model has no logits. ``TRIPWIRE_VLLM_LOGITS=0``
turns the check off.

FP8 KV saturation (:func:`build_clip`): with ``kv_cache_dtype`` fp8, each attention layer's cache write
(``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)``, which vLLM's ``unified_kv_cache_update`` op
calls on every backend, 0.26 to 0.34) is wrapped on the layer's impl instance: one count launch
(:func:`tripwire.numerics.clip_count.count_clipped`) over the new K and V with the layer's own ``_k_scale`` /
``_v_scale`` tensors, into a :class:`tripwire.numerics.ClipCounter` row per layer (site ``vllm.fp8_kv.<layer>``).
Why there and not a launch over the step's K/V after the forward: the new K/V exist only inside each layer, before
the write quantises them (after it, a saturated value and one that rounded to the format's max look the same). It
runs where the write runs: eagerly in a piecewise graph, captured in a FULL one. Not per request: saturation is a
quality signal reported through the clip instrument (events, ``tripwire_fp8_clipped_total``), never a stop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from ...monitor import Monitor
from ...numerics import ClipCounter, NonFiniteRows, register_nonfinite_rows_site
from ...numerics.clip_count import count_clipped
from ...sites import Site

__all__ = ["CLIP_PREFIX", "ENV_LOGITS", "SITE_LOGITS", "LogitsCheck", "build_clip", "build_logits", "logits_from_env"]

log = logging.getLogger("tripwire")

SITE_LOGITS = "vllm.logits_nonfinite"
CLIP_PREFIX = "vllm.fp8_kv."
# vLLM's fp8 cache dtypes and the FP8 format each stores.
_FP8 = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}
ENV_LOGITS = "TRIPWIRE_VLLM_LOGITS"
_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def logits_from_env(environ: Any = None) -> bool:
    """``TRIPWIRE_VLLM_LOGITS`` as a switch (unset: on); ValueError naming the variable for any other value."""
    raw = (os.environ if environ is None else environ).get(ENV_LOGITS, "")
    value = raw.strip().lower()
    if not value or value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{ENV_LOGITS}={raw!r} is not a switch; expected one of {', '.join(_ON + _OFF)} (unset: on)")


class LogitsCheck:
    """One runner's logits check: the rows check, whether it repairs, and (V2) whether ``sample`` is running."""

    __slots__ = ("mask", "rows", "sampling", "site")

    def __init__(self, rows: NonFiniteRows, site: Site, *, mask: bool) -> None:
        self.rows = rows
        self.site = site
        self.mask = mask
        self.sampling = False

    def __call__(self, logits: torch.Tensor, requests: torch.Tensor | Callable[[], torch.Tensor]) -> bool:
        """Check one step's logits (``[num_reqs, vocab]``, batch order) with its request numbers. Returns whether the
        arena may have risen (always on CUDA)."""
        return self.rows.check(logits, requests, mask=self.mask)


def build_logits(runner: Any, mode: str, policy: str, monitor: Monitor, *, enabled: bool) -> LogitsCheck | None:
    """The logits check of a runner being built (before any capture: its buffers are allocated here), or None where
    there is none to run (switched off, a pooling model, speculative decoding outside ``contain``)."""
    if not enabled:
        return None
    config = runner.vllm_config
    model_config = getattr(config, "model_config", None)
    if getattr(runner, "is_pooling_model", False) or getattr(model_config, "runner_type", "") == "pooling":
        log.warning("a pooling model has no logits: %s is not checked", SITE_LOGITS)
        return None
    if getattr(config, "speculative_config", None) is not None:
        what = (
            "the logits check expects one logits row per request; this engine decodes speculatively (several rows "
            "per request)"
        )
        if mode == "contain":
            raise RuntimeError(
                f"tripwire: {what}. Set {ENV_LOGITS}=0 to run TRIPWIRE_VLLM=contain without the logits check."
            )
        log.warning("%s: %s is not checked", what, SITE_LOGITS)
        return None
    site = register_nonfinite_rows_site(
        SITE_LOGITS,
        description="a request's logits row held NaN/Inf before sampling (row = batch row, column = one non-finite "
        "vocabulary entry; under mask and contain the NaN/Inf were set to 0 before sampling)",
        monitor=monitor,
    )
    device = torch.device(runner.device)
    # The step's batch bound (V2 keeps it on the runner; V1 on its input batch).
    max_rows = getattr(runner, "max_num_reqs", None) or runner.input_batch.max_num_reqs
    rows = NonFiniteRows(monitor.counter(site, device), int(max_rows))
    return LogitsCheck(rows, site, mask=policy == "mask")


def v1_logits(runner: Any, check: LogitsCheck, requests: Callable[[], torch.Tensor]) -> bool:
    """V1: the logits ``execute_model`` just kept for ``sample_tokens`` (none: a step that returned its output, or a
    pipeline stage before the last)."""
    state = getattr(runner, "execute_model_state", None)
    logits = getattr(state, "logits", None)
    if logits is None:
        return False
    return check(logits, requests)


def wrap_compute_logits(runner: Any, check: LogitsCheck, requests: Callable[[], torch.Tensor]) -> None:
    """V2: the model's ``compute_logits``, wrapped on the model instance (the module docstring says why there): it
    checks what it returns while ``check.sampling`` (set around V2's ``sample``)."""
    model = runner.model
    state = getattr(runner, "model_state", None)
    if state is not None and callable(getattr(state, "compute_sample_logits", None)):
        model = getattr(state, "model", model)  # 0.34: the model the sampler's logits come from
    current = model.compute_logits
    orig = getattr(current, "__tripwire_wrapped__", current)  # a runner built again: wrap vLLM's, not ours

    def compute_logits(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        logits = orig(hidden_states, *args, **kwargs)
        if check.sampling:
            check(logits, requests)
        return logits

    compute_logits.__tripwire_wrapped__ = orig  # type: ignore[attr-defined]
    model.compute_logits = compute_logits


def build_clip(runner: Any, monitor: Monitor) -> str:
    """Wrap every attention layer's cache write with its clip count when the KV cache is fp8 (module docstring);
    returns what was done, for the plugin's WARNING line."""
    config = runner.vllm_config
    dtype = str(getattr(getattr(config, "cache_config", None), "cache_dtype", "auto"))
    fmt = _FP8.get(dtype)
    if fmt is None:
        return f"fp8 KV counter off (kv_cache_dtype {dtype})"
    layers = getattr(getattr(config, "compilation_config", None), "static_forward_context", None) or {}
    device = torch.device(runner.device)
    wrapped, skipped = 0, []
    for name, layer in layers.items():
        impl = getattr(layer, "impl", None)
        write = getattr(impl, "do_kv_cache_update", None)
        ks, vs = getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)
        if write is None or not isinstance(ks, torch.Tensor) or not isinstance(vs, torch.Tensor):
            continue
        if ks.numel() != 1 or vs.numel() != 1:
            skipped.append(name)  # a per-head or per-token scale: not this counter's comparison
            continue
        counter = ClipCounter(CLIP_PREFIX + name, device, fmt, monitor=monitor, description=f"vLLM layer {name}")
        _wrap_write(impl, counter, getattr(write, "__tripwire_wrapped__", write))
        wrapped += 1
    if skipped:
        log.warning("%d layers' FP8 scales are not per tensor; their clipping is not counted", len(skipped))
    return f"fp8 KV counter on {wrapped} layers ({fmt})"


def _wrap_write(impl: Any, counter: ClipCounter, write: Any) -> None:
    def do_kv_cache_update(layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> Any:
        # Before the write, in its stream order: the same new K/V and scales the write quantises (one launch).
        count_clipped(counter, key, value, layer._k_scale, layer._v_scale, slot_mapping)
        return write(layer, key, value, kv_cache, slot_mapping)

    do_kv_cache_update.__tripwire_wrapped__ = write  # type: ignore[attr-defined]
    impl.do_kv_cache_update = do_kv_cache_update
