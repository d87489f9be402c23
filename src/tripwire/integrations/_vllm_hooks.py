"""The vLLM plugin's hooks: the wrappers put on vLLM's model runner (V1 and V2), scheduler and engine core, and the
per-process plugin state they share (:class:`_Plugin`, and each runner's :class:`_RunnerState`).

:mod:`tripwire.integrations.vllm` installs them (``install`` calls :func:`_patch`) and says what they do; this module
is how. The wrappers run on every engine step, so each one does the least it can on a clean step (no argument
tuples, no allocation, no torch call when the buffers are the ones already seen) and says why where it does more.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import types
from typing import Any

from ..monitor import Monitor
from . import _vllm_contain, _vllm_v2
from ._vllm_contain import ATTR, Containment, SchedulerSide
from ._vllm_steps import StepValidator

log = logging.getLogger("tripwire")

ENV = "TRIPWIRE_VLLM"
# The V1 runner's methods this integration wraps (the V2 runner's: _vllm_v2.HOOKS); _LIFECYCLE: both runners'.
_RUNNER_HOOKS = ("initialize_kv_cache", "execute_model", "_build_attention_metadata", "sample_tokens", "capture_model")
_LIFECYCLE = ("initialize_kv_cache", "capture_model", "execute_model", "sample_tokens")


class _Plugin:
    """The installed integration of this process: the mode, the monitor, the runners' validators and the
    containment between the runner's verdict and the scheduler."""

    def __init__(self, mode: str, monitor: Monitor, version: str) -> None:
        self.mode = mode
        self.monitor = monitor
        self.version = version
        self.policy = "flag" if mode == "flag" else "mask"
        self.contain = Containment(mode, monitor)
        # The methods wrapped for as long as the plugin is installed (the scheduler's: ``sched``, only while armed).
        self.originals: dict[tuple[type, str], Any] = {}
        self.sched: SchedulerSide | None = None
        self.started = False
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ the runner's side
    def build(self, runner: Any, make: Any = StepValidator) -> None:
        if getattr(runner, "kv_cache_config", None) is None or not runner.kv_cache_config.kv_cache_groups:
            return  # an attention-free model: no KV-cache metadata to validate
        parallel = runner.vllm_config.parallel_config
        if self.mode == "contain" and parallel.world_size > 1:
            raise RuntimeError(
                f"{ENV}=contain needs one worker (the scheduler acts on the output of one model runner, whose verdict "
                f"covers only its own arena); this engine has {parallel.world_size}. Use {ENV}=mask."
            )
        sv = make(runner, self.policy, self.monitor)
        ring = self.contain.ring(sv) if self.mode != "flag" else None
        runner._tripwire = _RunnerState(sv, ring)
        log.info(
            "tripwire: vLLM %s %s runner guarded (%s): sites %s",
            self.version,
            type(runner).__name__,
            self.mode,
            ", ".join(s.name for s in sv.sites),
        )

    def start(self) -> None:
        if not self.started:
            self.started = True
            self.monitor.start()

    def drain(self) -> None:
        try:
            self.monitor.drain()
        except Exception:  # the engine is shutting down: report, never break its shutdown
            log.exception("tripwire: the final drain at vLLM's shutdown failed")


class _RunnerState:
    """Per model runner: its validator, its verdict ring (None under flag), the step in progress."""

    # Read and written by the wrappers on every step: slots, not an instance dict.
    __slots__ = ("clean", "in_step", "ring", "rose", "step", "ticket", "validated", "validator")

    def __init__(self, validator: StepValidator, ring: Any) -> None:
        self.validator = validator
        # The V1 validator's host clean test on the CPU (None elsewhere): the step wrapper calls it directly, and the
        # validator's exact path only when it fails.
        self.clean = getattr(validator, "_host", None) if callable(getattr(validator, "exact", None)) else None
        self.ring = ring
        self.in_step = False
        self.validated = False
        # The validator's call may have raised a count this step: on CUDA always (its launch is asynchronous); on
        # the CPU only when its exact path ran (a clean step leaves the arena as the last verdict saw it).
        self.rose = False
        self.ticket: Any = None
        self.step: Any = None


def _runner_class() -> type:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def _scheduler_class() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def _engine_core_class() -> type:
    from vllm.v1.engine.core import EngineCore

    return EngineCore


def _require(cls: type, names: tuple[str, ...], version: str) -> None:
    missing = [n for n in names if not callable(getattr(cls, n, None))]
    if missing:
        raise RuntimeError(
            f"tripwire: vLLM {version}'s {cls.__module__}.{cls.__qualname__} lacks {missing}, the points tripwire "
            f"validates each step at; refusing to run installed but not validating (unset {ENV})"
        )


def _patch(plugin: _Plugin) -> None:
    runner_cls, sched_cls, core_cls = _runner_class(), _scheduler_class(), _engine_core_class()
    _require(runner_cls, _RUNNER_HOOKS, plugin.version)
    _require(sched_cls, ("update_from_output", "finish_requests"), plugin.version)
    _require(core_cls, ("shutdown",), plugin.version)
    plugin.contain.check_scheduler(sched_cls, plugin.version)
    v2 = _v2_runner_class(plugin.version)

    attn_orig = runner_cls.__dict__["_build_attention_metadata"]

    @functools.wraps(attn_orig)
    def _build_attention_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        st: _RunnerState | None = getattr(self, "_tripwire", None)
        # Real steps only, once each: vLLM's dummy runs and graph captures build metadata from placeholders, and a
        # capture must record no host read of it (the captured graph replays with whatever the buffers hold then).
        if st is not None and st.in_step and not st.validated and not kwargs.get("for_cudagraph_capture", False):
            if args:
                raise RuntimeError(
                    f"tripwire: vLLM {plugin.version} builds attention metadata with positional arguments; this "
                    f"integration reads them by name (num_reqs, num_tokens, slot_mappings)"
                )
            n_reqs, n_tokens, slots = kwargs["num_reqs"], kwargs["num_tokens"], kwargs["slot_mappings"]
            # The tensors are views of the runner's persistent buffers (no allocation); on CUDA the validator is one
            # asynchronous launch (no sync); on the CPU its host clean test reads them in place first.
            clean = st.clean
            if clean is not None and clean(self, n_reqs, n_tokens, slots):
                st.rose = False  # clean by the validator's own test: nothing to count, repair or take a verdict of
            elif clean is not None:
                st.rose = st.validator.exact(self, n_reqs, n_tokens, slots)  # counts, repairs, attributes
            else:
                st.rose = st.validator(self, n_reqs, n_tokens, slots)  # CUDA: may have risen (launch is async)
            st.validated = True
        return attn_orig(self, *args, **kwargs)

    if _same_parameters(attn_orig, _ATTN_PARAMETERS):

        def _build_attention_metadata_v1(
            self: Any,
            num_tokens: Any,
            num_reqs: Any,
            max_query_len: Any,
            num_tokens_padded: Any = None,
            num_reqs_padded: Any = None,
            ubatch_slices: Any = None,
            logits_indices: Any = None,
            max_num_sampled_tokens: Any = None,
            use_spec_decode: Any = False,
            for_cudagraph_capture: Any = False,
            num_scheduled_tokens: Any = None,
            slot_mappings: Any = None,
        ) -> Any:
            # vLLM's exact signature (checked at install; its defaults copied below): the step's call binds its
            # keywords straight to these names and is passed on with the same constant keyword names, where a
            # **kwargs wrapper builds a dict of them and unpacks it again on every step.
            st: _RunnerState | None = getattr(self, "_tripwire", None)
            # Real steps only, once each (as the generic wrapper above).
            if st is not None and st.in_step and not st.validated and not for_cudagraph_capture:
                clean = st.clean
                if clean is not None and clean(self, num_reqs, num_tokens, slot_mappings):
                    st.rose = False  # clean by the validator's own test: nothing to count, repair or take a verdict of
                elif clean is not None:
                    st.rose = st.validator.exact(self, num_reqs, num_tokens, slot_mappings)
                else:
                    st.rose = st.validator(self, num_reqs, num_tokens, slot_mappings)
                st.validated = True
            return attn_orig(
                self,
                num_tokens=num_tokens,
                num_reqs=num_reqs,
                max_query_len=max_query_len,
                num_tokens_padded=num_tokens_padded,
                num_reqs_padded=num_reqs_padded,
                ubatch_slices=ubatch_slices,
                logits_indices=logits_indices,
                max_num_sampled_tokens=max_num_sampled_tokens,
                use_spec_decode=use_spec_decode,
                for_cudagraph_capture=for_cudagraph_capture,
                num_scheduled_tokens=num_scheduled_tokens,
                slot_mappings=slot_mappings,
            )

        _build_attention_metadata_v1.__defaults__ = attn_orig.__defaults__  # vLLM's own defaults, exactly
        _build_attention_metadata = functools.wraps(attn_orig)(_build_attention_metadata_v1)

    sched_orig = sched_cls.__dict__["update_from_output"]
    contain = plugin.contain
    masked = contain.masked  # the dict itself (never replaced): its emptiness is the test below

    @functools.wraps(sched_orig)
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        # On the class only while an output with taints is due or a masked request runs on (SchedulerSide): a clean
        # step never comes here.
        named = getattr(model_runner_output, ATTR, None)
        try:
            # Inside the try: an error while failing the victims still settles the wrapper's count (else it would
            # stay on the class for good) and reaches vLLM's own step error path.
            if named:
                contain.before_update(self, model_runner_output)
            out = sched_orig(self, scheduler_output, model_runner_output)
            if masked:
                contain.after_update(self)
        finally:
            side.settle(bool(named), masked)
        return out

    side = plugin.sched = SchedulerSide(sched_cls, "update_from_output", update_from_output)

    core_orig = core_cls.__dict__["shutdown"]

    @functools.wraps(core_orig)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        plugin.drain()  # a hit on the last step is not lost
        return core_orig(self, *args, **kwargs)

    patches = [
        *_lifecycle(plugin, runner_cls, StepValidator),
        (runner_cls, "_build_attention_metadata", _build_attention_metadata),
        *(_v2_patches(plugin, v2) if v2 is not None else []),
        (core_cls, "shutdown", shutdown),
    ]
    for cls, name, fn in patches:
        plugin.originals[(cls, name)] = cls.__dict__[name]
        setattr(cls, name, fn)
    if plugin.mode != "flag":
        _vllm_contain.ON_TAINT = side.arm  # a step output with taints puts the scheduler's wrapper on


# V1's _build_attention_metadata parameters (vLLM 0.32): the wrapper with this exact signature is used when the
# installed vLLM's matches, name for name (the generic keyword wrapper otherwise).
_ATTN_PARAMETERS = (
    "self",
    "num_tokens",
    "num_reqs",
    "max_query_len",
    "num_tokens_padded",
    "num_reqs_padded",
    "ubatch_slices",
    "logits_indices",
    "max_num_sampled_tokens",
    "use_spec_decode",
    "for_cudagraph_capture",
    "num_scheduled_tokens",
    "slot_mappings",
)


def _same_parameters(fn: Any, names: tuple[str, ...]) -> bool:
    """``fn`` takes exactly ``names``, each positional-or-keyword (no ``*args``, no ``**kwargs``, no keyword-only):
    a wrapper with these names binds and passes on every call the same way."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return tuple(p.name for p in params) == names and all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)


def _lifecycle(plugin: _Plugin, runner_cls: type, make: Any) -> list[tuple[type, str, Any]]:
    """The wrappers of a runner class's lifecycle and step (both runners have these methods): the validator built
    by ``make`` after the KV cache, the reader started after the captures, the stop checked and the verdict
    enqueued around each step, and taken with the sampled tokens (``sample_tokens`` wrapped on the runner instance,
    for the one call after a step that enqueued a verdict: a clean CPU step passes two wrappers, ``execute_model``
    and the metadata hook, the scheduler's being off the class then; on CUDA every step enqueues a verdict, since the
    validator's launch is asynchronous, so every step wraps ``sample_tokens`` too)."""
    orig = {name: runner_cls.__dict__[name] for name in _LIFECYCLE}
    init_sig = inspect.signature(orig["initialize_kv_cache"])

    @functools.wraps(orig["initialize_kv_cache"])
    def initialize_kv_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig["initialize_kv_cache"](self, *args, **kwargs)
        if init_sig.bind(self, *args, **kwargs).arguments.get("is_profiling", False):
            return out  # the memory profile's throw-away cache
        plugin.build(self, make)  # before capture_model: the validator preallocates the arena here
        return out

    @functools.wraps(orig["capture_model"])
    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig["capture_model"](self, *args, **kwargs)
        if getattr(self, "_tripwire", None) is not None and not kwargs.get("profile_only", False):
            plugin.start()
        return out

    # Bound once: the step path below reads no setting and resolves no method per step.
    execute = orig["execute_model"]
    monitor = plugin.monitor
    # Monitor.check() inlined (one Python call less per step): the armed stop is one attribute, and the reader's
    # activity flag a bytearray the monitor never replaces. flag never arms a stop from a verdict: no check.
    checks = plugin.mode != "flag"
    act = monitor._act

    def enter(st: _RunnerState, scheduler_output: Any) -> None:
        # Both execute_model wrappers below, before vLLM's step: two calls a step (one here, one in leave) rather than
        # two copies of the step's bookkeeping.
        if not plugin.started:
            plugin.start()  # the first step comes after vLLM's warm-up and captures
        if checks:
            tripped = monitor._tripped
            if tripped is not None:  # an armed stop fails this step through vLLM's own error path
                raise tripped.with_traceback(None)  # as Monitor.check: no traceback grows over retries
            act[0] = 1  # one byte store: the step is activity for the reader's idle detection
        # One store each on a slotted object (a four-way tuple assignment would build a tuple): no allocation on the
        # step path. The scheduler output is kept for a verdict that fails every request of the step (its ids).
        st.in_step = True
        st.validated = False
        st.rose = False
        st.step = scheduler_output

    def leave(self: Any, st: _RunnerState, out: Any) -> Any:
        if st.rose and st.ring is not None:
            # After the step's kernels, in their stream order: the verdict copy of the sites' rows. A CPU step whose
            # metadata was clean takes none: nothing could rise, and its verdict would be the clean one.
            st.ticket = st.ring.enqueue()
            if out is not None:  # this runner returned its output from execute_model (no sample_tokens call)
                return _take_verdict(plugin, st, out)
            # The verdict goes with the sampled tokens: sample_tokens is wrapped on this runner only, for its next
            # call (an instance attribute over the class's method), so a step without a verdict calls vLLM's own.
            self.sample_tokens = types.MethodType(sample_tokens, self)
        return out

    @functools.wraps(execute)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        st: _RunnerState | None = getattr(self, "_tripwire", None)  # set by initialize_kv_cache: None, unguarded
        if st is None or (kwargs and kwargs.get("dummy_run", False)):  # V1 passes no keywords: no dict lookup
            # V2 runs its warm-up and capture batches through execute_model(dummy_run=True): not a step (the reader
            # starts after the captures, and a dummy batch's metadata is vLLM's own placeholder).
            return execute(self, scheduler_output, *args, **kwargs)
        enter(st, scheduler_output)
        try:
            out = execute(self, scheduler_output, *args, **kwargs)
        finally:
            st.in_step = False
        return leave(self, st, out)

    if _same_parameters(execute, ("self", "scheduler_output", "intermediate_tensors")):
        # V1's exact signature (checked above): its positional call binds straight to these names, where a
        # *args/**kwargs wrapper builds a tuple and a dict on every step, and calls with both unpacked again.
        def execute_model_v1(self: Any, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
            st: _RunnerState | None = getattr(self, "_tripwire", None)  # set by initialize_kv_cache: None, unguarded
            if st is None:
                return execute(self, scheduler_output, intermediate_tensors)
            enter(st, scheduler_output)
            try:
                out = execute(self, scheduler_output, intermediate_tensors)
            finally:
                st.in_step = False
            return leave(self, st, out)

        execute_model_v1.__defaults__ = execute.__defaults__  # vLLM's own default, exactly
        execute_model = functools.wraps(execute)(execute_model_v1)

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.__dict__.pop("sample_tokens", None)  # one call only: the class's method again from the next step on
        st: _RunnerState | None = getattr(self, "_tripwire", None)
        out = type(self).sample_tokens(self, *args, **kwargs)  # the runner's own, through its class
        if st is not None and st.ticket is not None:
            return _take_verdict(plugin, st, out)
        return out

    functools.update_wrapper(sample_tokens, orig["sample_tokens"])

    return [
        (runner_cls, "initialize_kv_cache", initialize_kv_cache),
        (runner_cls, "capture_model", capture_model),
        (runner_cls, "execute_model", execute_model),
    ]


def _take_verdict(plugin: _Plugin, st: _RunnerState, out: Any) -> Any:
    """Take the step's verdict where vLLM waits for the step's sampled tokens: now, for a synchronous output (the
    tokens are on the host: the verdict copy, enqueued before them in stream order, has landed); for an asynchronous
    one (async scheduling), inside its ``get_output``, after vLLM's own wait for the tokens' copy, which the engine
    core calls before the scheduler sees the step."""
    ring, ticket, step = st.ring, st.ticket, st.step
    st.ticket = None
    get = getattr(out, "get_output", None)
    if not callable(get):
        return plugin.contain.after_step(ring, ticket, step, out)

    @functools.wraps(get)
    def get_output(*args: Any, **kwargs: Any) -> Any:
        return plugin.contain.after_step(ring, ticket, step, get(*args, **kwargs))

    out.get_output = get_output
    return out


def _v2_runner_class(version: str) -> type | None:
    """The V2 model runner class when this vLLM ships one (checked for its hook points and its input batch's
    fields: a V2 runner lacking them is refused with the version), else None."""
    try:
        from vllm.v1.worker.gpu.input_batch import InputBatch
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
    except Exception:  # no V2 runner this vLLM can import: none can be built either
        return None
    _require(V2, _vllm_v2.HOOKS, version)
    _vllm_v2.check_input_batch(InputBatch, version)
    return V2


def _v2_patches(plugin: _Plugin, v2: type) -> list[tuple[type, str, Any]]:
    """The V2 runner (``vllm.v1.worker.gpu.model_runner``, vLLM's GPU default from 0.33): the same lifecycle, and
    the step validated right after ``prepare_attn`` (:mod:`tripwire.integrations._vllm_v2`)."""
    prep = v2.__dict__["prepare_attn"]

    @functools.wraps(prep)
    def prepare_attn(self: Any, input_batch: Any) -> Any:
        out = prep(self, input_batch)
        st: _RunnerState | None = getattr(self, "_tripwire", None)
        if st is not None and st.in_step and not st.validated:
            block_tables, slot_mappings = out
            st.rose = st.validator(self, input_batch, block_tables, slot_mappings)
            st.validated = True
        return out

    return [*_lifecycle(plugin, v2, _vllm_v2.V2StepValidator), (v2, "prepare_attn", prepare_attn)]
