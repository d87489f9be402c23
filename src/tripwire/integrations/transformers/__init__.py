"""tripwire inside Hugging Face transformers' continuous batching, installed from outside in one call.

::

    from tripwire.integrations import transformers as tw_transformers
    handle = tw_transformers.install(model, policy="mask", contain=True)   # before generate_batch / init_continuous_batching
    outputs = model.generate_batch(inputs, generation_config)               # a right answer or an error per request
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
* **Takes a verdict every step, before any request of that step is handed back** (:mod:`tripwire.verdict`): after the
  step's kernels, one small copy of the four sites' rows on the engine's compute stream; after the engine's own wait
  for its sampled tokens (sync: it synchronises the compute stream; async batching: the pair's copy event), the
  verdict is read in microseconds, before ``update_batch`` hands any request back (finished or streamed). Eager, CUDA
  graphs and async batching alike.
* **Containment** (``contain=True``): the requests a masked access touched fail with :class:`ContainedFault` (site and
  entry) through the engine's per-request error path in that same step, reads and masked WRITES alike (a masked
  write went to the trash slot: the damage is the writer's own token); every other request goes on, bit-identical to
  a clean run. More than ``TRIPWIRE_OFFENDERS`` distinct offenders in one step, or a hit that names no request,
  fails every request of that step (fail closed); the engine goes on. Without containment a write stays FATAL: the
  verdict arms the stop in the same step and the engine fails every request in flight; a read is reported and served
  masked (the ``mask`` policy).
* **No shared state from a masked computation**: a request a masked access touched never registers its blocks for
  prefix sharing from that step on, and a failed one frees its blocks uncached, under ``mask`` as under containment.
* **Non-finite logits, per request** (``logits=True``, the default; :mod:`._logits`): a forward hook on
  the model checks the model's logits, one row per request that samples this step, after the forward and before
  the engine's logits processors and sampler (inside the captured forward, so replayed with the engine's graphs).
  Each row holding a NaN or an Inf counts once, with its request; ``mask`` sets its NaN/Inf to 0 before sampling,
  ``flag`` only counts; under containment the request fails in that step through the same verdict and error path
  as a masked access, its blocks uncached. A model whose logits are not one row per sampled request (no
  ``logits_to_keep``) is refused under containment and served unchecked (one WARNING) otherwise.
* **Sites.** ``transformers.write_index`` (fatal), ``transformers.read_index``, ``transformers.block_table``,
  ``transformers.logits_nonfinite``; reports, events, taints and a contained request's error name the engine's
  request ids.
* **The lifecycle.** ``prealloc`` and the verdict ring at install; the reader starts at the engine's first step (after
  its warm-up and graph captures; later captures are safe too, the reader relaxes its capture mode); ``check()`` at
  the top of every step; ``drain()`` when the engine's generation loop ends. A stop raises
  :class:`tripwire.GuardTripped` inside the step, and the engine fails it through its own failure path: every
  request in flight ends with the error, the process and the GPU stay healthy, and the next ``generate_batch``
  raises again until ``tripwire.reset()`` (the stop is sticky).

Why a pre-hook on the model and not a wrapper of the attention function: from transformers 5.24 the attention
module calls ``cache.update`` (the first ``index_copy_``) BEFORE the attention function, so a wrapper there validates
too late; the model's forward is the last point before the first cache access in every supported version, and it
leaves ``config._attn_implementation`` and the attention registry untouched (a new attention key would silently
lose the engine's attention mask).

Supported versions: :data:`SUPPORTED` (5.17, whose cache holds per-layer tensors, and 5.18 to 5.25, whose cache is
one tensor carved by per-group allocators, 5.25's MLA allocator included). Others are refused with an error naming
the version. The block-table path is validated wherever the engine takes it (the decode fast path needs flash-attn's
``flash_attn_with_kvcache``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

from ..._default import default_monitor
from ...contain import Taint
from ...errors import GuardTripped
from ...monitor import Monitor
from ...validate import POLICIES
from .._versions import in_range
from . import _engine
from ._cache import (
    _DESC_READ,
    _DESC_TABLE,
    _DESC_WRITE,
    SITE_BLOCK_TABLE,
    SITE_READ_INDEX,
    SITE_WRITE_INDEX,
    SUPPORTED,
    CacheValidators,
    cache_groups,
)
from ._logits import SITE_LOGITS, LogitsCheck, LogitsRows, logits_layout_problem, register_logits_site
from ._requests import MAX_REQUESTS, RequestTable, States

__all__ = [
    "SITE_BLOCK_TABLE",
    "SITE_LOGITS",
    "SITE_READ_INDEX",
    "SITE_WRITE_INDEX",
    "SUPPORTED",
    "ContainedFault",
    "Handle",
    "install",
]

log = logging.getLogger("tripwire")


def _installed_version() -> str:
    import transformers

    return str(transformers.__version__)


def check_version(version: str) -> None:
    """Raise RuntimeError unless ``version`` is inside :data:`SUPPORTED` (pre-releases of a supported minor count)."""
    if not in_range(version, SUPPORTED):
        raise RuntimeError(
            f"tripwire.integrations.transformers supports transformers >={SUPPORTED[0]},<{SUPPORTED[1]}; this process "
            f"has transformers {version}. Its continuous-batching cache layout is read directly (index bounds and trash "
            f"slots), so an untested version is refused rather than guarded with possibly wrong bounds."
        )


# ---------------------------------------------------------------------------------------------- the engine's hooks
_lock = threading.Lock()
_handles: weakref.WeakKeyDictionary[torch.nn.Module, Handle] = weakref.WeakKeyDictionary()
# The engine objects whose steps a handle has seen: IO objects (the verdict's ticket) and caches (the prefix-cache
# guard). Weak: the engine owns them.
_seen: dict[str, weakref.WeakKeyDictionary[Any, Handle]] = {
    "io": weakref.WeakKeyDictionary(),
    "cache": weakref.WeakKeyDictionary(),
}


def _lookup(kind: str, obj: Any) -> Handle | None:
    return _handles.get(obj) if kind == "model" else _seen[kind].get(obj)


class ContainedFault(RuntimeError):
    """The error a contained request fails with: the site and the offending entry (``taint``)."""

    def __init__(self, taint: Taint, request_id: str) -> None:
        # The engine's request id in the error itself: what an operator greps for in the engine's own logs.
        super().__init__(taint.message().replace("this request", f"request {request_id!r}", 1))
        self.taint = taint
        self.request_id = request_id


class Handle:
    """An installed integration. ``uninstall()`` removes the hooks and, with the last handle, restores the
    engine's methods exactly. ``sites`` names the sites it counts at (``transformers.logits_nonfinite`` where the
    logits check is on). ``contained`` lists the requests containment failed (their engine ids, with the taint),
    newest last; ``tainted`` the requests a masked access or a non-finite logits row touched (kept out of the prefix
    cache), newest last; ``verdicts`` the verdicts taken (``verdicts_dirty`` those that were not clean)."""

    def __init__(
        self,
        model: torch.nn.Module,
        policy: str,
        monitor: Monitor,
        contain: bool,
        attribute: bool,
        logits: bool,
    ) -> None:
        self.model_ref = weakref.ref(model)
        self.policy = policy
        self.monitor = monitor
        self.contain = contain
        self.device = torch.device(model.device)  # type: ignore[call-overload]  # a PreTrainedModel attribute
        # The logits check and its row map, allocated now, before the engine captures anything (its graphs hold
        # their addresses).
        rows = LogitsRows(self.device, MAX_REQUESTS) if logits and attribute else None
        self.requests = RequestTable(self.device, monitor.requests, rows) if attribute else None
        self._logits = (
            LogitsCheck(monitor, self.device, MAX_REQUESTS, mask=policy == "mask", requests=rows, strict=contain)
            if logits
            else None
        )
        self.sites: tuple[str, ...] = (SITE_WRITE_INDEX, SITE_READ_INDEX, SITE_BLOCK_TABLE) + (
            (SITE_LOGITS,) if logits else ()
        )
        self.contained: list[tuple[str, Taint]] = []
        self.tainted = States()
        self._failed = States()  # failed by a verdict: dropped from any later update (async batching)
        self._validators: CacheValidators | None = None
        self._started = False
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._post_hook: torch.utils.hooks.RemovableHandle | None = None
        self.verdicts = 0
        self.verdicts_dirty = 0
        # The step's verdict ring over the integration's four sites (registered here with the attributes the cache
        # validators and the logits check give them), allocated now, before the engine captures anything; depth 4
        # covers async batching's two steps in flight. A ticket per IO object: (ticket, the step's request ids).
        self.ring = _ring(monitor, self.device)
        self._tickets: weakref.WeakKeyDictionary[Any, tuple[Any, list[Any]]] = weakref.WeakKeyDictionary()
        self._processor_of: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

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
            if self.contain and not v.writes_contained:
                log.warning(
                    "this engine cache was built before tripwire was installed and may hold uninitialised "
                    "memory, so a masked KV write cannot be contained to its request: under containment the write "
                    "site stops the engine (install tripwire before the engine builds its cache)"
                )
        v(kwargs)
        return None

    def _post_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        """After the model's forward, before the engine reads its logits: the non-finite logits check (inside the
        engine's captured forward, so replayed with its graphs; see _logits)."""
        if self._logits is None or kwargs.get("cache") is None or "logits_indices" not in kwargs:
            return None  # an ordinary forward (no continuous batching): nothing to check
        self._logits(output, kwargs)
        return None

    # ------------------------------------------------------------------ the step, in the engine's order
    def _before_step(self, processor: Any) -> None:
        if not self._started:
            # The first step comes after the engine's warm-up and first captures.
            self._started = True
            self.monitor.start()
        self.monitor.check()
        io = processor.inputs_and_outputs
        _seen["io"][io] = self
        _seen["cache"][processor.cache] = self
        host = _host_io(io)
        for obj in (io, *(p.host_io for p in getattr(io, "io_pairs", ())), host):
            _seen["io"][obj] = self
            self._processor_of[obj] = processor
        batch = host.requests_in_batch
        # The engine pads a batch's logits rows (CUDA graphs, torch.compile) up to its requests per batch at most.
        rows = min(int(getattr(host, "max_requests_per_batch", len(batch))), MAX_REQUESTS)
        if self.requests is not None:
            self.requests.fill(batch, io.compute_stream, rows)

    def _enqueue(self, io: Any) -> None:
        """After the step's kernels, before the engine waits for them: the verdict copy, on the compute stream."""
        host = _host_io(io)
        states = [fs.state for fs in host.requests_in_batch]
        # The ticket goes with the IO object whose prepare_batch_update hands this step back (async: the pair's).
        self._tickets[host] = (self.ring.enqueue(io.compute_stream), states)

    def _verdict(self, io: Any, result: Any) -> Any:
        """The engine waited for the step and is about to hand its requests back: take its verdict and drop what
        must not be handed back (failed here, or failed by an earlier step's verdict in async batching)."""
        entry = self._tickets.pop(io, None)
        if entry is None:
            return self._drop_failed(result) if self._failed else result
        ticket, states = entry
        verdict = self.ring.take(ticket)  # after the engine's wait: an event query, no sync
        self.verdicts += 1
        if verdict.clean:
            return self._drop_failed(result) if self._failed else result
        self.verdicts_dirty += 1
        if verdict.stop is not None:
            # Without containment: a fatal site, or raise mode. Raised inside update_batch, the engine fails every
            # request in flight through its own error path (no result of this step is handed back).
            raise verdict.stop
        if self.contain and not (self._validators is None or self._validators.writes_contained):
            write = next((h for h in verdict.hits if h.site == SITE_WRITE_INDEX), None)
            if write is not None:
                # A 5.17 cache built before install: no containment of a masked write (CacheValidators.writes_contained).
                exc = GuardTripped(
                    f"tripwire: MASKED FAULT (a KV write) at site {SITE_WRITE_INDEX!r} on {verdict.device} ({write.delta} in this "
                    f"step); this engine cache was built before tripwire was installed and may hold uninitialised memory, "
                    f"so a masked write cannot be contained to its request: the step's requests fail and the engine is "
                    f"stopped",
                    site=SITE_WRITE_INDEX,
                    device=verdict.device,
                    count=write.total,
                    first_row=write.offenders[0].row if write.offenders else None,
                    first_value=write.offenders[0].value if write.offenders else None,
                    fatal=True,
                )
                self.monitor.arm(exc)
                raise self.monitor.armed or exc
        touched = states if verdict.fail_all else [st for st in states if st.request_id in verdict.tainted]
        for st in touched:
            self.tainted.add(st)
        if not self.contain:
            return result  # mask without containment: reported, served masked, kept out of the prefix cache
        processor = self._processor_of[io]
        for st in touched:
            taint = verdict.failure(st.request_id)
            if taint is not None:
                self._fail(processor, st, taint)
        return self._drop_failed(result)

    def _fail(self, processor: Any, state: Any, taint: Taint) -> None:
        rid = state.request_id
        if processor.scheduler.active_requests.get(rid) is not state:
            return  # finished or cancelled between scheduling and this update (async batching)
        fault = ContainedFault(taint, rid)
        processor._handle_request_error(fault, state)
        _free_no_cache(processor.cache, rid)
        processor.scheduler.finish_request(rid)
        self._failed.add(state)
        self.contained.append((rid, taint))
        # The fault's message names tripwire for the engine's client; the log line's logger already does.
        log.warning("%s", str(fault).removeprefix("tripwire "))

    def _drop_failed(self, result: Any) -> Any:
        """``prepare_batch_update``'s result without the failed requests (their tokens taken out in step, so the
        rest stay aligned: only requests with a new token have one)."""
        states, tokens, logprobs = result
        if not any(self._failed.has(fs.state) for fs in states):
            return result
        keep_s: list[Any] = []
        keep_t: list[Any] = []
        keep_l: list[Any] | None = [] if logprobs is not None else None
        i = 0
        for fs in states:
            drop = self._failed.has(fs.state)
            if fs.has_new_token:
                if not drop:
                    keep_t.append(tokens[i])
                    if keep_l is not None:
                        keep_l.append(logprobs[i])
                i += 1
            if not drop:
                keep_s.append(fs)
        return keep_s, keep_t, keep_l

    def _keeps_out(self, state: Any) -> bool:
        return self.tainted.has(state)

    def _after_loop(self) -> None:
        try:
            self.monitor.drain()
        except Exception:  # the engine is shutting down: report, never break its shutdown
            log.exception("the final drain at the end of the generation loop failed")

    def uninstall(self) -> None:
        """Undo :func:`install` (idempotent). Counts already made stay in the arena."""
        with _lock:
            if self._hook is None:
                return
            self._hook.remove()
            self._hook = None
            if self._post_hook is not None:
                self._post_hook.remove()
                self._post_hook = None
            model = self.model_ref()
            if model is not None and _handles.get(model) is self:
                del _handles[model]
            for seen in _seen.values():
                for obj in [o for o, h in seen.items() if h is self]:
                    del seen[obj]
            if not _handles:
                _engine.unpatch()


def _host_io(io: Any) -> Any:
    """The IO object whose ``prepare_batch_update`` hands the current step back: the current pair's host IOs in
    async batching, the IOs themselves otherwise."""
    return io.io_pairs[io.current_pair].host_io if hasattr(io, "io_pairs") else io


def _free_no_cache(cache: Any, rid: str) -> None:
    try:  # 5.18+: the blocks go straight back to the pool, never cached (their KV came from a masked computation)
        cache.free_blocks(rid, no_cache=True)
    except TypeError:
        pass  # 5.17 has no such switch: its blocks after the fault were never registered (Handle._keeps_out)


# One verdict ring per monitor and device (a site belongs to one ring): handles installed on the same monitor share
# it. Two engines served at once on one monitor and device share the sites too: one's verdict may consume the
# other's offenders, whose step then fails closed (every request of it), never open.
_rings: weakref.WeakKeyDictionary[Monitor, dict[torch.device, Any]] = weakref.WeakKeyDictionary()


def _ring(monitor: Monitor, device: torch.device) -> Any:
    rings = _rings.setdefault(monitor, {})
    if device not in rings:
        rings[device] = monitor.verdicts(device, register_sites(monitor))
    return rings[device]


def register_sites(monitor: Monitor) -> list[Any]:
    """The integration's four sites, registered with the attributes its cache validators and its logits check give
    them (the logits site is in the ring whether or not a handle checks logits: a ring is shared per monitor and
    device, and a site nobody counts at costs its row's copy only)."""
    reg = monitor.registry
    return [
        reg.register(SITE_WRITE_INDEX, description=_DESC_WRITE, fatal=True),
        reg.register(SITE_READ_INDEX, description=_DESC_READ),
        reg.register(SITE_BLOCK_TABLE, description=_DESC_TABLE),
        register_logits_site(monitor),
    ]


def install(
    model: torch.nn.Module,
    *,
    policy: str = "mask",
    monitor: Monitor | None = None,
    contain: bool = False,
    attribute: bool | None = None,
    logits: bool = True,
    **unknown: Any,
) -> Handle:
    """Install tripwire into ``model``'s continuous batching (see the module docstring). Call it before
    ``generate_batch``/``init_continuous_batching``. ``monitor`` defaults to the default monitor; its arena for the
    model's device is allocated here.

    ``contain``: a masked fault fails the requests it hit, in the step it happened (each with a
    :class:`ContainedFault` naming the site and the entry, its blocks kept out of the prefix cache), a masked write
    included, and the rest of the batch goes on; a hit that names no request fails the whole step. ``attribute``
    (default: ``contain``): the offenders carry the engine's request (a small per-step copy of the batch's request
    numbers to the device). ``logits`` (default True): the non-finite logits check (site
    ``transformers.logits_nonfinite``): each step, every logits row the engine samples from that holds a NaN or an
    Inf counts once, with its request; ``policy="mask"`` sets its NaN/Inf to 0 before sampling, ``flag`` only counts;
    under ``contain`` its request fails in that step. A model whose logits are not one row per sampled request (its
    forward takes no ``logits_to_keep``) is refused here under ``contain`` (ValueError) and otherwise served without
    the check, with one WARNING."""
    if "verdicts" in unknown:
        raise TypeError(
            f"install(verdicts={unknown['verdicts']!r}): the verdicts keyword is gone; every step takes a same-step "
            f"verdict, the one containment path. Drop the keyword; pass contain=True for containment (the requests a "
            f"masked fault hit fail in its step), contain=False to report and serve masked"
        )
    if unknown:
        raise TypeError(f"install() got unexpected keyword argument(s) {sorted(unknown)}")
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
    if logits:
        problem = logits_layout_problem(model)
        if problem is not None:
            if contain:
                raise ValueError(
                    f"tripwire: the non-finite logits check (site {SITE_LOGITS!r}) needs one logits row per sampled "
                    f"request and {problem}; containment cannot attribute such rows, so install(contain=True) refuses "
                    f"this model (pass logits=False to serve it without the check)"
                )
            log.warning("the non-finite logits check is off for this model: %s", problem)
            logits = False
    mon = monitor if monitor is not None else default_monitor()
    with _lock:
        if model in _handles:
            raise RuntimeError(
                f"tripwire is already installed on this {type(model).__name__}; uninstall the first handle before "
                f"installing again"
            )
        mon.prealloc(torch.device(model.device))  # type: ignore[call-overload]  # before the engine captures anything
        handle = Handle(model, policy, mon, contain, attribute, logits)
        if contain:
            mon.set_contain(True)  # explicit: the caller asked for containment (the monitor's one setting)
        if not _handles:
            _engine.patch(_lookup)
        handle._hook = model.register_forward_pre_hook(handle._pre_forward, with_kwargs=True)
        if handle._logits is not None:
            handle._post_hook = model.register_forward_hook(handle._post_forward, with_kwargs=True)
        _handles[model] = handle
    return handle


_cache_groups = cache_groups  # the demo's fault injector and the tests read the engine cache's bounds through it
