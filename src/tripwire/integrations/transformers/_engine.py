"""The engine methods :mod:`tripwire.integrations.transformers` wraps, and their exact restoration.

Per step, in the engine's order (both IO classes, sync and async batching, every supported version):

* ``ContinuousBatchProcessor._generation_step``: before it, the handle's ``_before_step`` (the reader's start at the
  first step, ``check()``, the step's request numbers to the device).
* ``ContinuousBatchingIOs.retrieve_device_outputs`` / ``ContinuousBatchingAsyncIOs.retrieve_device_outputs``: the
  step's kernels are enqueued (the model runner's forward and sampling) and the engine is about to wait for them (sync)
  or start their copy to the host (async). Before it: the step's verdict copy, on the compute stream.
* ``ContinuousBatchingIOs.prepare_batch_update``: the engine waited for the step (sync: ``retrieve_device_outputs``
  synchronised the compute stream; async: the pair's ``d2h_over`` event, recorded after the compute stream, was
  synchronised) and is about to hand the step's requests back (``update_batch``). After it: the verdict, which fails
  tainted requests and drops them from what ``update_batch`` processes (async batching calls it on the pair's host
  IOs, which is where the verdict's ticket is kept).
* The cache's block-hash registration (``mark_complete_blocks`` from 5.18, ``mark_shareable_blocks_as_complete`` in
  5.17): skipped for a request a masked access touched, so its blocks never enter the prefix cache.
* ``PagedAttentionCache.__init__``: after it, 5.17's per-layer KV tensors (``torch.empty``) are zeroed, once, at
  construction (never in a capture, never on the step path). A masked write leaves its request's slot unwritten, and
  that request's own read of the slot pulls it into the step's packed attention, where every query multiplies it by
  its (zero) softmax weight: uninitialised memory holding a NaN made every request of the batch NaN. Zeroed (as
  5.18+'s one cache tensor is by construction), an unwritten slot holds a zero or an earlier request's finite K/V, so
  the rest of the batch is bit-identical and the masked write is contained to its request
  (:attr:`zeroed`, ``CacheValidators.writes_contained``).
* ``ContinuousBatchingManager._run_generation_loop``: after it, the drain.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

# The engine caches built while patched, whose KV tensors were zeroed at construction (5.17's per-layer layout).
zeroed: weakref.WeakSet[Any] = weakref.WeakSet()

# (class, attribute) -> the original function, restored exactly when the last handle is uninstalled.
_originals: dict[tuple[type, str], Any] = {}


def _classes() -> dict[str, type]:
    from transformers.generation.continuous_batching import cache, continuous_api, input_outputs

    return {
        "processor": continuous_api.ContinuousBatchProcessor,
        "manager": continuous_api.ContinuousBatchingManager,
        "ios": input_outputs.ContinuousBatchingIOs,
        "async_ios": input_outputs.ContinuousBatchingAsyncIOs,
        "cache": cache.PagedAttentionCache,
    }


def mark_complete_name(cache_cls: type) -> str:
    """The cache method that registers a request's completed blocks for sharing, by version."""
    for name in ("mark_complete_blocks", "mark_shareable_blocks_as_complete"):
        if name in cache_cls.__dict__:
            return name
    raise RuntimeError(
        "tripwire.integrations.transformers: the engine's cache registers completed blocks through neither "
        "mark_complete_blocks nor mark_shareable_blocks_as_complete; this version's prefix cache is not one this "
        "module knows, so a request a masked access touched could share its blocks: refusing to install"
    )


def patch(lookup: Callable[[str, Any], Any]) -> None:
    """Wrap the engine's methods. ``lookup(kind, obj)`` returns the handle for a model (``"model"``), an IO
    object (``"io"``) or an engine cache (``"cache"``), or None. Idempotent: while
    patched (a handle whose model was collected without ``uninstall`` leaves the patch in place), a second call would
    wrap the wrappers, run every hook twice per step and record the wrappers as the originals."""
    if _originals:
        return
    c = _classes()
    processor_cls, manager_cls, ios_cls, async_cls, cache_cls = (
        c["processor"],
        c["manager"],
        c["ios"],
        c["async_ios"],
        c["cache"],
    )
    step = processor_cls.__dict__["_generation_step"]
    loop = manager_cls.__dict__["_run_generation_loop"]
    retrieve = ios_cls.__dict__["retrieve_device_outputs"]
    retrieve_async = async_cls.__dict__["retrieve_device_outputs"]
    update = ios_cls.__dict__["prepare_batch_update"]
    mark_name = mark_complete_name(cache_cls)
    mark = cache_cls.__dict__[mark_name]
    cache_init = cache_cls.__dict__["__init__"]

    @functools.wraps(cache_init)
    def cache_construct(self: Any, *args: Any, **kwargs: Any) -> None:
        cache_init(self, *args, **kwargs)
        tensors = (*getattr(self, "key_cache", ()), *getattr(self, "value_cache", ()))
        if getattr(self, "cache_allocators", None) is None and tensors:
            # 5.17 allocates its KV tensors with torch.empty: zero them (module docstring: a masked write's
            # unwritten slot must never hold a NaN). In place, at construction: no capture, no step.
            for t in tensors:
                t.zero_()
            zeroed.add(self)

    @functools.wraps(step)
    def _generation_step(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        handle = lookup("model", model)
        if handle is not None:
            handle._before_step(self)  # raises GuardTripped: the engine fails the step through its own error path
        return step(self, model, *args, **kwargs)

    def _retrieving(original: Any) -> Any:
        @functools.wraps(original)
        def retrieve_device_outputs(self: Any, *args: Any, **kwargs: Any) -> Any:
            handle = lookup("io", self)
            if handle is not None:
                handle._enqueue(self)  # the verdict copy, after the step's kernels, before the engine's wait
            return original(self, *args, **kwargs)

        return retrieve_device_outputs

    @functools.wraps(update)
    def prepare_batch_update(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = update(self, *args, **kwargs)  # sync: reads the step's outputs (the engine already waited)
        handle = lookup("io", self)
        return result if handle is None else handle._verdict(self, result)

    @functools.wraps(mark)
    def mark_complete(self: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
        handle = lookup("cache", self)
        if handle is not None and handle._keeps_out(state):
            return None  # a masked access touched this request: its blocks must never be shared
        return mark(self, state, *args, **kwargs)

    @functools.wraps(loop)
    def _run_generation_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return loop(self, *args, **kwargs)
        finally:
            handle = lookup("model", self.model)
            if handle is not None:
                handle._after_loop()

    for cls, name, fn in (
        (processor_cls, "_generation_step", _generation_step),
        (manager_cls, "_run_generation_loop", _run_generation_loop),
        (ios_cls, "retrieve_device_outputs", _retrieving(retrieve)),
        (async_cls, "retrieve_device_outputs", _retrieving(retrieve_async)),
        (ios_cls, "prepare_batch_update", prepare_batch_update),
        (cache_cls, mark_name, mark_complete),
        (cache_cls, "__init__", cache_construct),
    ):
        _originals[(cls, name)] = cls.__dict__[name]
        setattr(cls, name, fn)


def unpatch() -> None:
    for (cls, name), fn in _originals.items():
        setattr(cls, name, fn)
    _originals.clear()
