"""The vLLM plugin's hooks: the per-process plugin state (:class:`_Plugin`), what the running vLLM has (its runners,
scheduler and engine core), and the wrappers of the scheduler, the engine core and the V2 runner's step; the V1
runner's step hooks are :mod:`tripwire.integrations.vllm._v1`, the lifecycle and verdict both runners share
:mod:`tripwire.integrations.vllm._runner`.

:mod:`tripwire.integrations.vllm` installs them (``install`` calls :func:`_patch`) and says what they do; this module
is how. Each runner's step is validated in two phases (:mod:`tripwire.integrations.vllm._steps`,
:mod:`tripwire.integrations.vllm._v2`): its inputs before vLLM's own metadata kernels read them (V1: its block
table's ``compute_slot_mapping``; V2: before ``prepare_attn``) and its outputs before the attention metadata is built
from them (V1: ``_build_attention_metadata``; V2: after ``prepare_attn``).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from ...monitor import Monitor
from . import _contain, _v1, _v2
from ._contain import ATTR, SchedulerSide, VerdictChannel
from ._numerics import build_clip, build_logits, wrap_compute_logits
from ._runner import RunnerState, enqueue, lifecycle
from ._steps import StepValidator

log = logging.getLogger("tripwire")

ENV = "TRIPWIRE_VLLM"


class _Plugin:
    """The installed integration of this process: the mode, the monitor, the runners' validators and the
    containment between the runner's verdict and the scheduler."""

    def __init__(self, mode: str, monitor: Monitor, version: str, *, logits: bool = True) -> None:
        self.mode = mode
        self.logits = logits  # the logits check (TRIPWIRE_VLLM_LOGITS)
        self.monitor = monitor
        self.version = version
        self.policy = "flag" if mode == "flag" else "mask"
        self.contain = VerdictChannel(mode, monitor)
        # The methods wrapped for as long as the plugin is installed (the scheduler's: ``sched``, only while armed).
        self.originals: dict[tuple[type, str], Any] = {}
        self.sched: SchedulerSide | None = None
        self.runners: tuple[str, ...] = ()  # the runners this vLLM has that are hooked ("V1", "V2")
        self.started = False
        self.lock = threading.Lock()
        # The V1 step in progress in this process (runner, state): its block table's compute_slot_mapping, which
        # knows no runner, runs the inputs phase through it. Set and cleared around each V1 step.
        self.v1_step: tuple[Any, RunnerState] | None = None

    # ------------------------------------------------------------------ the runner's side
    def build(self, runner: Any, make: Any = StepValidator) -> None:
        if getattr(runner, "kv_cache_config", None) is None or not runner.kv_cache_config.kv_cache_groups:
            return  # an attention-free model: no KV-cache metadata to validate
        parallel = runner.vllm_config.parallel_config
        if self.mode == "contain" and parallel.world_size > 1:
            raise RuntimeError(
                f"{ENV}=contain needs one worker (the scheduler acts on the output of one model runner, whose verdict "
                f"covers only its own arena); this engine has {parallel.world_size} (tensor, pipeline or context "
                f"parallelism). Use {ENV}=mask or {ENV}=flag."
            )
        sv = make(runner, self.policy, self.monitor)
        v2 = make is _v2.V2StepValidator
        logits = build_logits(runner, self.mode, self.policy, self.monitor, enabled=self.logits)
        requests = functools.partial(sv.requests, runner)  # bound once: the step path builds no closure
        if logits is not None and v2:
            wrap_compute_logits(runner, logits, requests)
        clip = build_clip(runner, self.monitor)
        sites = [*sv.sites, *([logits.site] if logits is not None else [])]
        # No verdict on a pipeline stage before the last: its step returns intermediate tensors, never the sampled
        # tokens the verdict is taken with (nor an output the scheduler reads); the reader reports its rises.
        ring = self.contain.ring(sv.device, sites) if self.mode != "flag" and _last_pp_rank(runner) else None
        runner._tripwire = RunnerState(sv, ring, logits, requests, late=v2 and logits is not None)
        log.warning(
            "vLLM %s %s runner (%s) guarded, mode %s; sites %s; %s",
            self.version,
            "V2" if v2 else "V1",
            type(runner).__name__,
            self.mode,
            ", ".join(s.name for s in sites),
            clip,
        )

    def start(self) -> None:
        if not self.started:
            self.started = True
            self.monitor.start()

    def drain(self) -> None:
        try:
            self.monitor.drain()
        except Exception:  # the engine is shutting down: report, never break its shutdown
            log.exception("the final drain at vLLM's shutdown failed")


def _last_pp_rank(runner: Any) -> bool:
    """Whether this runner is its pipeline's last stage (V2 keeps ``is_last_pp_rank``; V1 asks vLLM's group)."""
    last = getattr(runner, "is_last_pp_rank", None)
    if last is None:
        if int(getattr(runner.vllm_config.parallel_config, "pipeline_parallel_size", 1)) == 1:
            return True
        from vllm.distributed.parallel_state import get_pp_group

        last = get_pp_group().is_last_rank
    return bool(last)


def _runner_class() -> type | None:
    """vLLM's V1 GPU model runner (0.26-0.33; 0.34 deleted it), or None."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return None
    return GPUModelRunner


def _v1_table_class() -> type:
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    return MultiGroupBlockTable


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
    v2 = _v2_runner_class(plugin.version)
    if runner_cls is None and v2 is None:
        raise RuntimeError(
            f"tripwire: vLLM {plugin.version} has neither model runner tripwire hooks (V1: "
            f"vllm.v1.worker.gpu_model_runner, V2: vllm.v1.worker.gpu.model_runner); refusing to run installed but not "
            f"validating (unset {ENV})"
        )
    _require(sched_cls, ("update_from_output", "finish_requests"), plugin.version)
    _require(core_cls, ("shutdown",), plugin.version)
    plugin.contain.check_scheduler(sched_cls, plugin.version)
    patches: list[tuple[type, str, Any]] = []
    if runner_cls is not None:
        _require(runner_cls, _v1.RUNNER_HOOKS, plugin.version)
        table_cls = _v1_table_class()
        _require(table_cls, (_v1.TABLE_HOOK,), plugin.version)
        patches += _v1.patches(plugin, runner_cls, table_cls)
    if v2 is not None:
        patches += _v2_patches(plugin, v2)
    plugin.runners = (("V1",) if runner_cls is not None else ()) + (("V2",) if v2 is not None else ())

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

    patches.append((core_cls, "shutdown", shutdown))
    for cls, name, fn in patches:
        plugin.originals[(cls, name)] = cls.__dict__[name]
        setattr(cls, name, fn)
    if plugin.mode != "flag":
        _contain.ON_TAINT = side.arm  # a step output with taints puts the scheduler's wrapper on


def _v2_runner_class(version: str) -> type | None:
    """The V2 model runner class when this vLLM ships one (checked for its hook points and its input batch's
    fields: a V2 runner lacking them is refused with the version), else None."""
    try:
        from vllm.v1.worker.gpu.input_batch import InputBatch
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
    except Exception:  # no V2 runner this vLLM can import (its CPU build: no Triton GPU backend): none can be built
        return None
    _require(V2, _v2.HOOKS, version)
    _v2.check_input_batch(InputBatch, version)
    return V2


def _v2_patches(plugin: _Plugin, v2: type) -> list[tuple[type, str, Any]]:
    """The V2 runner: the same lifecycle, and both phases around ``prepare_attn``
    (:mod:`tripwire.integrations.vllm._v2`)."""
    prep = v2.__dict__["prepare_attn"]

    @functools.wraps(prep)
    def prepare_attn(self: Any, input_batch: Any) -> Any:
        st: RunnerState | None = getattr(self, "_tripwire", None)
        if st is None or not st.in_step or st.validated:
            return prep(self, input_batch)
        validator = st.validator
        st.rose = validator.inputs(self, input_batch)  # before vLLM's gather and slot-mapping kernels read them
        out = prep(self, input_batch)
        block_tables, slot_mappings = out
        validator.outputs(self, input_batch, block_tables, slot_mappings)  # before the attention metadata
        st.validated = True
        return out

    sample_orig = v2.__dict__["sample"]

    @functools.wraps(sample_orig)
    def sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        st: RunnerState | None = getattr(self, "_tripwire", None)
        if st is None or not st.sample_due:
            return sample_orig(self, *args, **kwargs)
        st.sample_due = False
        check = st.logits
        check.sampling = True  # the model's compute_logits checks what it returns (_numerics)
        try:
            out = sample_orig(self, *args, **kwargs)
        finally:
            check.sampling = False
        if st.ring is not None:
            # After the logits check and the sampler, before sample_tokens copies the sampled tokens out: their
            # wait covers this copy too.
            enqueue(st)
        return out

    return [
        *lifecycle(plugin, v2, _v2.V2StepValidator, v1=False),
        (v2, "prepare_attn", prepare_attn),
        (v2, "sample", sample),
    ]
