"""tripwire inside Hugging Face transformers' continuous batching, installed from outside in one call.

::

    from tripwire.integrations import transformers as tw_transformers
    handle = tw_transformers.install(model, policy="mask")    # before generate_batch / init_continuous_batching
    outputs = model.generate_batch(inputs, generation_config)
    handle.uninstall()

What it does:

* **Validates the step's cache indices on the device, once per step, before the first cache access.** A forward
  pre-hook on the model runs a :class:`tripwire.validate.Validator` over the step's ``write_index`` and
  ``read_index`` (one per attention group), or over its ``block_table`` when the engine takes the decode fast path,
  before any layer runs: every layer then reads and writes through the validated indices, and each bad entry counts
  once per step, not once per layer. The hook runs inside the engine's forward, so it is captured into the
  engine's CUDA graphs and replayed with them (and traced by ``torch.compile`` through the ``tripwire::validate``
  op). Under ``mask`` a bad write index is rewritten to the engine's write-trash slot (never read) and a bad read
  index to its zeroed read-trash slot, so torch's ``index_copy_``/``index_select`` never see an out-of-range index.
* **Sites.** ``transformers.write_index`` (FATAL: a masked write leaves that token's K/V missing from the cache,
  durable damage), ``transformers.read_index``, ``transformers.block_table``.
* **The lifecycle.** ``prealloc`` at install; the reader starts at the engine's first step (after its warm-up and
  graph captures; later captures are safe too, the reader relaxes its capture mode); ``check()`` at the top of every
  step; ``drain()`` when the engine's generation loop ends. A stop (a fatal site, any hit under ``raise``) raises
  :class:`tripwire.GuardTripped` inside the step, and the engine fails it through its own failure path: every
  request in flight ends with the error, the process and the GPU stay healthy, and the next ``generate_batch``
  raises again until ``tripwire.reset()`` (the stop is sticky).

Why a pre-hook on the model and not a wrapper of the attention function: from transformers 5.24 the attention
module calls ``cache.update`` (the first ``index_copy_``) BEFORE the attention function, so a wrapper there validates
too late; the model's forward is the last point before the first cache access in every supported version, and it
leaves ``config._attn_implementation`` and the attention registry untouched (a new attention key would silently
lose the engine's attention mask).

Supported versions: :data:`SUPPORTED` (5.17, whose cache holds per-layer tensors, and 5.18 to 5.24, whose cache is
one tensor carved by per-group allocators). Others are refused with an error naming the version. The block-table
path is validated wherever the engine takes it (the decode fast path needs flash-attn's ``flash_attn_with_kvcache``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch

from .._default import default_monitor
from ..contain import Taint
from ..errors import GuardTripped
from ..monitor import Monitor
from ..validate import POLICIES
from ._transformers_cache import (
    SITE_BLOCK_TABLE,
    SITE_READ_INDEX,
    SITE_WRITE_INDEX,
    SUPPORTED,
    CacheValidators,
    cache_groups,
)

__all__ = [
    "SITE_BLOCK_TABLE",
    "SITE_READ_INDEX",
    "SITE_WRITE_INDEX",
    "SUPPORTED",
    "ContainedFault",
    "Handle",
    "install",
]

log = logging.getLogger("tripwire")


def _version_tuple(text: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(text).release


def _installed_version() -> str:
    import transformers

    return str(transformers.__version__)


def check_version(version: str) -> None:
    """Raise RuntimeError unless ``version`` is inside :data:`SUPPORTED` (pre-releases of a supported minor count)."""
    lo, hi = (_version_tuple(v) for v in SUPPORTED)
    got = _version_tuple(version)
    if not lo <= got[: len(lo)] or not got[: len(hi)] < hi:
        raise RuntimeError(
            f"tripwire.integrations.transformers supports transformers >={SUPPORTED[0]},<{SUPPORTED[1]}; this process "
            f"has transformers {version}. Its continuous-batching cache layout is read directly (index bounds and trash "
            f"slots), so an untested version is refused rather than guarded with possibly wrong bounds."
        )


# ---------------------------------------------------------------------------------------------- the engine's hooks
_lock = threading.Lock()
_handles: weakref.WeakKeyDictionary[torch.nn.Module, Handle] = weakref.WeakKeyDictionary()
# The batch processors whose steps a handle has seen (containment runs before their next batch is prepared).
_processors: weakref.WeakKeyDictionary[Any, Handle] = weakref.WeakKeyDictionary()
# (class, attribute) -> the original function, restored exactly when the last handle is uninstalled.
_originals: dict[tuple[type, str], Any] = {}
# Request numbers one step can hold (the device table of the step's requests is allocated at install, before any
# capture, at this size; an engine configured for more requests per batch is refused at its first forward).
MAX_REQUESTS = 4096


def _engine_classes() -> tuple[type, type]:
    from transformers.generation.continuous_batching import continuous_api

    return continuous_api.ContinuousBatchProcessor, continuous_api.ContinuousBatchingManager


def _patch_engine() -> None:
    processor_cls, manager_cls = _engine_classes()
    step = processor_cls.__dict__["_generation_step"]
    prepare = processor_cls.__dict__["prepare_next_batch"]
    loop = manager_cls.__dict__["_run_generation_loop"]

    @functools.wraps(prepare)
    def prepare_next_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        handle = _processors.get(self)
        if handle is not None:
            handle._contain(self)  # fail tainted requests before the batch that would include them is built
        return prepare(self, *args, **kwargs)

    @functools.wraps(step)
    def _generation_step(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        handle = _handles.get(model)
        if handle is not None:
            handle._before_step(self)  # raises GuardTripped: the engine fails the step through its own error path
        return step(self, model, *args, **kwargs)

    @functools.wraps(loop)
    def _run_generation_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return loop(self, *args, **kwargs)
        finally:
            handle = _handles.get(self.model)
            if handle is not None:
                handle._after_loop()

    for cls, name, fn in (
        (processor_cls, "_generation_step", _generation_step),
        (processor_cls, "prepare_next_batch", prepare_next_batch),
        (manager_cls, "_run_generation_loop", _run_generation_loop),
    ):
        _originals[(cls, name)] = cls.__dict__[name]
        setattr(cls, name, fn)


def _unpatch_engine() -> None:
    for (cls, name), fn in _originals.items():
        setattr(cls, name, fn)
    _originals.clear()


class ContainedFault(RuntimeError):
    """The error a contained request fails with: the site and the offending entry (``taint``)."""

    def __init__(self, taint: Taint, request_id: str) -> None:
        super().__init__(taint.message())
        self.taint = taint
        self.request_id = request_id


class _RequestTable:
    """The step's request numbers on the device, in batch order, for the validators' attribution: filled before each
    step from a pinned ring (the engine's next step may be enqueued before this one's copy ran, in async batching),
    with a non-blocking copy on the engine's compute stream, so the step's kernels (replayed graphs included) read
    this step's numbers. Numbers map back to the engine's request ids (a bounded map of the recent ones)."""

    RING = 4
    KEEP = 1 << 16

    def __init__(self, device: torch.device) -> None:
        # Allocated at install, before the engine captures anything: the validators' graphs hold its address.
        self.device = torch.full((MAX_REQUESTS,), -1, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self._host = [torch.full((MAX_REQUESTS,), -1, dtype=torch.int64, pin_memory=pin) for _ in range(self.RING)]
        self._np = [h.numpy() for h in self._host]
        self._turn = 0
        self._numbers: dict[str, int] = {}
        self.ids: OrderedDict[int, str] = OrderedDict()
        self._next = 0

    def number(self, request_id: str) -> int:
        n = self._numbers.get(request_id)
        if n is None:
            n = self._numbers[request_id] = self._next
            self._next += 1
            self.ids[n] = request_id
            while len(self.ids) > self.KEEP:  # the oldest requests finished long ago
                _, old = self.ids.popitem(last=False)
                self._numbers.pop(old, None)
        return n

    def fill(self, request_ids: list[str], stream: Any) -> None:
        k = len(request_ids)
        if k > MAX_REQUESTS:
            raise RuntimeError(f"tripwire: a step of {k} requests exceeds the request table ({MAX_REQUESTS})")
        host, buf = self._host[self._turn], self._np[self._turn]
        self._turn = (self._turn + 1) % self.RING
        buf[:k] = [self.number(r) for r in request_ids]  # numpy assignment into pinned memory: no torch allocation
        if self.device.device.type == "cuda":
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.device[:k].copy_(host[:k], non_blocking=True)
        else:
            self.device[:k].copy_(host[:k])


class Handle:
    """An installed integration. ``uninstall()`` removes the pre-hook and, with the last handle, restores the
    engine's methods exactly. ``sites`` names the sites it counts at. ``contained`` lists the requests containment
    failed (their engine ids, with the taint), newest last."""

    sites = (SITE_WRITE_INDEX, SITE_READ_INDEX, SITE_BLOCK_TABLE)

    def __init__(self, model: torch.nn.Module, policy: str, monitor: Monitor, contain: bool, attribute: bool) -> None:
        self.model_ref = weakref.ref(model)
        self.policy = policy
        self.monitor = monitor
        self.contain = contain
        self.device = torch.device(model.device)  # type: ignore[call-overload]  # a PreTrainedModel attribute
        self.requests = _RequestTable(self.device) if attribute else None
        self.contained: list[tuple[str, Taint]] = []
        self._validators: CacheValidators | None = None
        self._started = False
        self._hook: torch.utils.hooks.RemovableHandle | None = None

    @property
    def installed(self) -> bool:
        return self._hook is not None

    def _pre_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("cache")
        if cache is None or "write_index" not in kwargs:
            return None  # an ordinary forward (no continuous batching): nothing to validate
        v = self._validators
        if v is None or v.cache_ref() is not cache:
            # Once per engine cache (its first forward is the engine's eager warm-up, before any capture).
            table = None if self.requests is None else self.requests.device
            v = self._validators = CacheValidators(cache, self.device, self.policy, self.monitor, table)
        v(kwargs)
        return None

    def _before_step(self, processor: Any) -> None:
        if not self._started:
            # The first step comes after the engine's warm-up and first captures.
            self._started = True
            self.monitor.start()
        self.monitor.check()
        _processors[processor] = self
        if self.requests is not None:
            io = processor.inputs_and_outputs
            host = io.io_pairs[io.current_pair].host_io if hasattr(io, "io_pairs") else io
            self.requests.fill([fs.state.request_id for fs in host.requests_in_batch], io.compute_stream)

    def _contain(self, processor: Any) -> None:
        """Fail the requests masked faults hit since the last step (containment on), before the next batch is
        built; a hit that names no request stops the engine (fail closed)."""
        if not self.contain:
            return
        for taint in self.monitor.take_tainted():
            rid = None if taint.request is None or self.requests is None else self.requests.ids.get(int(taint.request))
            if rid is None:
                raise GuardTripped(
                    f"tripwire: a masked fault at site {taint.site!r} on {taint.device} (row {taint.row}, value "
                    f"{taint.value}) could not be attributed to a request, so containment cannot fail only the "
                    f"requests it hit; the engine is stopped",
                    site=taint.site,
                    device=taint.device,
                    count=0,
                    first_row=taint.row,
                    first_value=taint.value,
                )
            state = processor.scheduler.active_requests.get(rid)
            if state is None:
                log.warning(
                    "tripwire: request %s hit at %s had finished before containment could fail it", rid, taint.site
                )
                continue
            processor._handle_request_error(ContainedFault(taint, rid), state)
            try:  # 5.18+: keep its blocks out of the prefix cache (their KV came from a masked computation)
                processor.cache.free_blocks(rid, no_cache=True)
            except TypeError:
                pass  # 5.17 has no such switch: finish_request frees them as usual
            processor.scheduler.finish_request(rid)
            self.contained.append((rid, taint))
            log.warning("tripwire: %s", taint.message().replace("this request", f"request {rid}"))

    def _after_loop(self) -> None:
        try:
            self.monitor.drain()
        except Exception:  # the engine is shutting down: report, never break its shutdown
            log.exception("tripwire: the final drain at the end of the generation loop failed")

    def uninstall(self) -> None:
        """Undo :func:`install` (idempotent). Counts already made stay in the arena."""
        with _lock:
            if self._hook is None:
                return
            self._hook.remove()
            self._hook = None
            model = self.model_ref()
            if model is not None and _handles.get(model) is self:
                del _handles[model]
            if not _handles:
                _unpatch_engine()


def install(
    model: torch.nn.Module,
    *,
    policy: str = "mask",
    monitor: Monitor | None = None,
    contain: bool = False,
    attribute: bool | None = None,
) -> Handle:
    """Install tripwire into ``model``'s continuous batching (see the module docstring). Call it before
    ``generate_batch``/``init_continuous_batching``. ``monitor`` defaults to the default monitor; its arena for the
    model's device is allocated here.

    ``contain``: a masked fault at a non-fatal site fails the requests it hit (each with a :class:`ContainedFault`
    naming the site and the entry, its blocks kept out of the prefix cache) and the rest of the batch goes on; a
    fatal site, or a hit that names no request, still stops the engine. ``attribute`` (default: ``contain``): the
    offenders carry the engine's request (a small per-step copy of the batch's request numbers to the device)."""
    check_version(_installed_version())
    if not isinstance(model, torch.nn.Module) or not all(
        callable(getattr(model, a, None)) for a in ("generate_batch", "init_continuous_batching")
    ):
        raise TypeError(
            f"install() needs a transformers model that can run continuous batching (a PreTrainedModel with "
            f"generate_batch and init_continuous_batching), got {type(model).__name__}"
        )
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not a validator policy; expected one of {', '.join(POLICIES)}")
    attribute = contain if attribute is None else attribute
    if contain and not attribute:
        raise ValueError("contain=True needs attribute=True: containment fails the requests the offenders name")
    mon = monitor if monitor is not None else default_monitor()
    with _lock:
        if model in _handles:
            raise RuntimeError(
                f"tripwire is already installed on this {type(model).__name__}; uninstall the first handle before "
                f"installing again"
            )
        handle = Handle(model, policy, mon, contain, attribute)
        mon.prealloc(handle.device)  # before the engine's warm-up captures anything
        if contain:
            mon.pipeline.containment.enabled = True
        if not _handles:
            _patch_engine()
        handle._hook = model.register_forward_pre_hook(handle._pre_forward, with_kwargs=True)
        _handles[model] = handle
    return handle


_cache_groups = cache_groups  # the demo's fault injector and the tests read the engine cache's bounds through it
