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

import functools
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .._default import default_monitor
from ..monitor import Monitor
from ..validate import POLICIES, Validator

__all__ = ["SITE_BLOCK_TABLE", "SITE_READ_INDEX", "SITE_WRITE_INDEX", "SUPPORTED", "Handle", "install"]

log = logging.getLogger("tripwire")

# [lowest, first unsupported): the versions whose cache layout this module reads (see _cache_groups).
SUPPORTED = ("5.17", "5.25")
SITE_WRITE_INDEX = "transformers.write_index"
SITE_READ_INDEX = "transformers.read_index"
SITE_BLOCK_TABLE = "transformers.block_table"
# One description per site for every attention group (a site's attributes are fixed at its first registration).
_DESC_WRITE = (
    "transformers continuous batching: a KV-cache write index vs the cache's rows (row = the token in the step); "
    "masked to the write-trash slot, so that token's K/V are missing from the cache"
)
_DESC_READ = (
    "transformers continuous batching: a KV-cache read index vs the cache's rows (row = the position in the step's "
    "read index); masked to the zeroed read-trash slot"
)
_DESC_TABLE = (
    "transformers continuous batching: a block-table page vs the cache's pages (row = the request's batch row); "
    "masked to the write-trash page"
)


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


# ---------------------------------------------------------------------------------------------- the cache's bounds
@dataclass(frozen=True)
class _Group:
    """One attention group's cache bounds: ``rows`` bounds its write/read indices (the shortest per-layer view the
    engine indexes), the trash slots are the mask targets; ``pages``/``page_safe`` bound its block table."""

    rows: int
    write_trash: int
    read_trash: int
    pages: int | None
    page_safe: int | None


def _cache_groups(cache: Any) -> list[_Group]:
    allocators = getattr(cache, "cache_allocators", None)
    if allocators is not None:
        # 5.18+: one flat tensor; each group's allocator indexes per-layer shifted views of it.
        groups = []
        for a in allocators.values():
            rows = min(int(t.shape[0]) for kv in a._kv_token_views.values() for t in kv)
            pages_views = getattr(a, "_kv_page_views", None) or {}
            pages = min((int(t.shape[0]) for kv in pages_views.values() for t in kv), default=None)
            page_safe = a.write_trash_index // a.tokens_per_page if pages is not None else None
            groups.append(_Group(rows, int(a.write_trash_index), int(a.read_trash_index), pages, page_safe))
        return groups
    key_cache = getattr(cache, "key_cache", None)
    if key_cache is not None:
        # 5.17: per-layer-in-group tensors [(num_blocks + 2) * block_size, heads, dim], trash slots shared.
        rows = min(int(t.shape[0]) for t in (*key_cache, *cache.value_cache))
        bs = int(cache.block_size)
        return [
            _Group(
                rows,
                int(cache.write_trash_index),
                int(cache.read_trash_index),
                rows // bs,
                int(cache.write_trash_index) // bs,
            )
            for _ in cache.group_cache_managers
        ]
    raise RuntimeError(
        f"tripwire.integrations.transformers: {type(cache).__name__} has neither cache_allocators nor key_cache; "
        f"this transformers version's cache layout is not one this module knows"
    )


def _suffix(g: int) -> str:
    return "" if g == 0 else f"_{g}"


class _CacheValidators:
    """The validators of one engine cache: write/read indices per group, and the block table where the engine has
    one. Built at the engine's first forward with that cache (its bounds are only known then); Python only."""

    def __init__(self, cache: Any, device: torch.device, policy: str, monitor: Monitor) -> None:
        self.cache_ref = weakref.ref(cache)
        self.groups = _cache_groups(cache)
        self.indices = Validator("transformers", device, policy=policy, monitor=monitor)
        self.table: Validator | None = None
        for g, grp in enumerate(self.groups):
            sfx = _suffix(g)
            self.indices.index(
                f"write_index{sfx}",
                hi=grp.rows,
                safe=grp.write_trash,
                fatal=True,
                site=SITE_WRITE_INDEX,
                description=_DESC_WRITE,
            )
            self.indices.index(
                f"read_index{sfx}", hi=grp.rows, safe=grp.read_trash, site=SITE_READ_INDEX, description=_DESC_READ
            )
        if self.groups and all(grp.pages is not None for grp in self.groups):
            self.table = Validator("transformers", device, policy=policy, monitor=monitor)
            for g, grp in enumerate(self.groups):
                assert grp.pages is not None and grp.page_safe is not None
                self.table.index(
                    f"block_table{_suffix(g)}",
                    hi=grp.pages,
                    padding=-1,
                    safe=grp.page_safe,
                    site=SITE_BLOCK_TABLE,
                    description=_DESC_TABLE,
                )

    def __call__(self, kwargs: dict[str, Any]) -> None:
        table = kwargs.get("block_table")
        if table is not None:
            # Decode fast path: the attention kernel reads and writes through the table; the index lists are stale.
            if self.table is None:
                raise RuntimeError("tripwire: the engine passed a block table but its cache has no page views")
            self.table(**{f"block_table{_suffix(g)}": table[g] for g in range(len(self.groups))})
            return
        writes, reads = kwargs["write_index"], kwargs["read_index"]
        if len(writes) != len(self.groups) or len(reads) != len(self.groups):
            raise RuntimeError(
                f"tripwire: the engine passed {len(writes)} write and {len(reads)} read index tensors for a cache of "
                f"{len(self.groups)} attention groups"
            )
        args = {}
        for g in range(len(self.groups)):
            args[f"write_index{_suffix(g)}"] = writes[g]
            args[f"read_index{_suffix(g)}"] = reads[g]
        self.indices(**args)


# ---------------------------------------------------------------------------------------------- the engine's hooks
_lock = threading.Lock()
_handles: weakref.WeakKeyDictionary[torch.nn.Module, Handle] = weakref.WeakKeyDictionary()
# (class, attribute) -> the original function, restored exactly when the last handle is uninstalled.
_originals: dict[tuple[type, str], Any] = {}


def _engine_classes() -> tuple[type, type]:
    from transformers.generation.continuous_batching import continuous_api

    return continuous_api.ContinuousBatchProcessor, continuous_api.ContinuousBatchingManager


def _patch_engine() -> None:
    processor_cls, manager_cls = _engine_classes()
    step = processor_cls.__dict__["_generation_step"]
    loop = manager_cls.__dict__["_run_generation_loop"]

    @functools.wraps(step)
    def _generation_step(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        handle = _handles.get(model)
        if handle is not None:
            handle._before_step()  # raises GuardTripped: the engine fails the step through its own error path
        return step(self, model, *args, **kwargs)

    @functools.wraps(loop)
    def _run_generation_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return loop(self, *args, **kwargs)
        finally:
            handle = _handles.get(self.model)
            if handle is not None:
                handle._after_loop()

    _originals[(processor_cls, "_generation_step")] = step
    _originals[(manager_cls, "_run_generation_loop")] = loop
    processor_cls._generation_step = _generation_step  # type: ignore[attr-defined]
    manager_cls._run_generation_loop = _run_generation_loop  # type: ignore[attr-defined]


def _unpatch_engine() -> None:
    for (cls, name), fn in _originals.items():
        setattr(cls, name, fn)
    _originals.clear()


class Handle:
    """An installed integration. ``uninstall()`` removes the pre-hook and, with the last handle, restores the
    engine's methods exactly. ``sites`` names the sites it counts at."""

    sites = (SITE_WRITE_INDEX, SITE_READ_INDEX, SITE_BLOCK_TABLE)

    def __init__(self, model: torch.nn.Module, policy: str, monitor: Monitor) -> None:
        self.model_ref = weakref.ref(model)
        self.policy = policy
        self.monitor = monitor
        self.device = torch.device(model.device)  # type: ignore[call-overload]  # a PreTrainedModel attribute
        self._validators: _CacheValidators | None = None
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
            v = self._validators = _CacheValidators(cache, self.device, self.policy, self.monitor)
        v(kwargs)
        return None

    def _before_step(self) -> None:
        if not self._started:
            # The first step comes after the engine's warm-up and first captures.
            self._started = True
            self.monitor.start()
        self.monitor.check()

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


def install(model: torch.nn.Module, *, policy: str = "mask", monitor: Monitor | None = None) -> Handle:
    """Install tripwire into ``model``'s continuous batching (see the module docstring). Call it before
    ``generate_batch``/``init_continuous_batching``. ``monitor`` defaults to the default monitor; its arena for the
    model's device is allocated here."""
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
    mon = monitor if monitor is not None else default_monitor()
    with _lock:
        if model in _handles:
            raise RuntimeError(
                f"tripwire is already installed on this {type(model).__name__}; uninstall the first handle before "
                f"installing again"
            )
        handle = Handle(model, policy, mon)
        mon.prealloc(handle.device)  # before the engine's warm-up captures anything
        if not _handles:
            _patch_engine()
        handle._hook = model.register_forward_pre_hook(handle._pre_forward, with_kwargs=True)
        _handles[model] = handle
    return handle
