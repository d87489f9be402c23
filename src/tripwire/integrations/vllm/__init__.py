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

Any other value, or a ``TRIPWIRE_*`` name tripwire does not read, is refused with an error when vLLM loads its plugins,
in every process (a set-but-broken or misspelt setting never runs unguarded). The decision is the SAME-STEP verdict
(:meth:`tripwire.Monitor.verdicts`): the validators run before the kernels that read the step's metadata, a verdict
copy is enqueued after the step's kernels, and it is read after vLLM's own wait for the sampled tokens (inside the
asynchronous output's ``get_output`` under async scheduling); its events reach every sink before it is acted on.

Where it hooks, in two phases per step (the inputs before vLLM's own metadata kernels read them, the outputs before
the attention metadata is built from them):

* the V2 model runner (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``: vLLM's GPU runner, the default for dense
  models in 0.26, for every model from 0.29, the only one in 0.34): around ``prepare_attn``, whose Triton kernels
  read the block table through ``idx_mapping``, ``num_blocks`` and the positions
  (:mod:`tripwire.integrations.vllm._v2`);
* the V1 model runner (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, 0.26-0.33; the CPU build's
  ``CPUModelRunner`` subclasses it): before its block table's ``compute_slot_mapping``, and in
  ``_build_attention_metadata`` (:mod:`tripwire.integrations.vllm._v1`).

``initialize_kv_cache`` builds the validators (and so preallocates the arena) before vLLM captures anything; the
reader starts after ``capture_model`` or at the first step; ``tripwire.check()`` runs at the top of every step; the
engine core's ``shutdown`` drains. The scheduler's ``update_from_output`` fails the tainted requests, which the step's
``ModelRunnerOutput`` carries to it, through its per-request error set (:mod:`tripwire.integrations.vllm._contain`).

Supported: vLLM :data:`SUPPORTED`, 0.26 to 0.34 (detected from ``vllm.__version__``); a runner that lacks the hook
points is refused with an error naming the version. Run: vLLM 0.26.0 on a GPU (V1 and V2, CUDA graphs and eager,
async scheduling, the engine core in-process and in its own process) and vLLM's CPU build 0.27.0 and 0.32.0 (V1);
every release's hook points are checked from its own source. docs/vllm.md has the table. Containment needs one worker;
it is refused for several (each rank's verdict covers only its own arena).

Events and metrics: the monitor's sinks. vLLM's own ``/metrics`` shows tripwire's metrics: with one API server
through files its processes write (:class:`MetricsFileSink`, in the folder :data:`METRICS_ENV` names) and its API
server collects (:func:`serve_metrics` registers a :class:`MetricsCollector`), with several through
``PROMETHEUS_MULTIPROC_DIR`` (each process adds a :class:`tripwire.sinks.Prometheus` sink there); the sink each
process gets is :func:`add_metrics_sink`'s. The hook points a release must have: :data:`HOOK_POINTS`.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
from typing import Any

from ..._default import default_monitor
from ...monitor import Monitor
from .._versions import in_range
from . import _contain, _metrics, _v1, _v2
from ._hooks import ENV, _patch, _Plugin
from ._metrics import ENV as METRICS_ENV
from ._metrics import MetricsCollector, MetricsFileSink
from ._metrics import serve as serve_metrics
from ._numerics import ENV_LOGITS, SITE_LOGITS, logits_from_env
from ._steps import (
    SITE_BLOCK_COUNTS,
    SITE_BLOCK_TABLE,
    SITE_IDX_MAPPING,
    SITE_NUM_BLOCKS,
    SITE_POSITIONS,
    SITE_QUERY_START_LOC,
    SITE_SEQ_LENS,
    SITE_SLOT_MAPPING,
)

__all__ = [
    "ENV",
    "ENV_LOGITS",
    "HOOK_POINTS",
    "METRICS_ENV",
    "MODES",
    "SITE_BLOCK_COUNTS",
    "SITE_BLOCK_TABLE",
    "SITE_IDX_MAPPING",
    "SITE_LOGITS",
    "SITE_NUM_BLOCKS",
    "SITE_POSITIONS",
    "SITE_QUERY_START_LOC",
    "SITE_SEQ_LENS",
    "SITE_SLOT_MAPPING",
    "SUPPORTED",
    "HookPoints",
    "MetricsCollector",
    "MetricsFileSink",
    "add_metrics_sink",
    "check_version",
    "install",
    "installed",
    "logits_from_env",
    "mode_from_env",
    "register",
    "serve_metrics",
    "uninstall",
]

log = logging.getLogger("tripwire")

MODES = ("flag", "mask", "contain")
# [low, high): the vLLM releases whose runners and scheduler this integration reads (their private method names and
# buffers); others are refused. 0.26 ran here on a GPU, 0.27 and 0.32 on vLLM's CPU build; every release's hook
# points are checked from its own source (tests/integrations/test_vllm_source.py).
SUPPORTED = ("0.26", "0.35")


@dataclasses.dataclass(frozen=True)
class HookPoints:
    """The private names of vLLM that the plugin wraps or reads, by role: what a vLLM release must still have for the
    plugin to work on it. :func:`install` refuses a runner that lacks a method of ``v1_runner`` or ``v2_runner``, a
    V1 block table without ``v1_block_table`` and a V2 ``InputBatch`` without a field of ``v2_input_batch`` (naming
    the version); ``tests/integrations/test_vllm_source.py`` checks every release of :data:`SUPPORTED` for all of
    them from its own source. Names, not signatures: the parameters each hook expects are that test's. The runners'
    methods are wrapped on the class, except ``sample_tokens``: on a runner instance, for the one call after a step
    that took a verdict.

    * ``v2_runner``: the methods of V2's ``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` wrapped
      (``prepare_attn`` is the step's hook, both phases around it; ``sample`` the logits check's);
    * ``v2_input_batch``: the fields of V2's ``InputBatch`` (a dataclass) the step validator reads;
    * ``v2_block_tables``: what it reads of V2's ``BlockTables`` (``runner.block_tables``);
    * ``v2_request_state``: what it reads of V2's ``RequestState`` (``runner.req_states``);
    * ``v1_runner``: the methods of V1's ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` wrapped (vLLM 0.26-0.33;
      0.34 has no V1 runner);
    * ``v1_block_table``: the method of V1's ``MultiGroupBlockTable`` wrapped (it runs vLLM's slot-mapping kernel:
      the inputs phase goes right before it);
    * ``scheduler_errors``: the scheduler's per-request error set, through which ``contain`` fails a request with
      vLLM's error finish reason."""

    v2_runner: tuple[str, ...]
    v2_input_batch: tuple[str, ...]
    v2_block_tables: tuple[str, ...]
    v2_request_state: tuple[str, ...]
    v1_runner: tuple[str, ...]
    v1_block_table: str
    scheduler_errors: str


# Built from the tables the hooks themselves use, so what is declared and what is patched cannot drift apart.
HOOK_POINTS = HookPoints(
    v2_runner=_v2.HOOKS,
    v2_input_batch=_v2.INPUT_BATCH_FIELDS,
    v2_block_tables=_v2.BLOCK_TABLES_ATTRS,
    v2_request_state=_v2.REQUEST_STATE_ATTRS,
    v1_runner=_v1.RUNNER_HOOKS,
    v1_block_table=_v1.TABLE_HOOK,
    scheduler_errors=_contain.ERRORS,
)


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


def check_version(version: str) -> None:
    """RuntimeError unless ``version`` is inside :data:`SUPPORTED` (pre-releases and local builds of a supported
    minor count: ``0.32.0+cpu``)."""
    if not in_range(version, SUPPORTED):
        raise RuntimeError(
            f"tripwire.integrations.vllm supports vLLM >={SUPPORTED[0]},<{SUPPORTED[1]}; this process has vLLM "
            f"{version}. Its model runner's private hook points and buffers are read directly, so an untested "
            f"version is refused rather than run installed-but-not-validating (unset {ENV} to run vLLM without "
            f"tripwire)."
        )


_lock = threading.Lock()
_plugin: _Plugin | None = None


def installed() -> _Plugin | None:
    """The installed integration of this process, or None."""
    return _plugin


def add_metrics_sink(monitor: Monitor) -> None:
    """Add to ``monitor`` the metrics sink :func:`install` adds: a :class:`MetricsFileSink` of the folder
    :data:`METRICS_ENV` names (nothing when it names none), or under ``PROMETHEUS_MULTIPROC_DIR`` (vLLM with several
    API servers) a :class:`tripwire.sinks.Prometheus` writing there. Without ``prometheus_client`` it logs a warning
    and adds nothing."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # vLLM serves its API server's default registry: the counts go there through files (MetricsFileSink).
        _metrics.add_sink(monitor)
        return
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        log.warning("PROMETHEUS_MULTIPROC_DIR is set but prometheus_client is not installed: no metrics")
        return
    from ...sinks import Prometheus

    monitor.add_sink(Prometheus())


def _monitor_for(mode: str, monitor: Monitor | None) -> Monitor:
    """The monitor (default: this process's default monitor), with containment on exactly under ``contain``.

    vLLM runs the entry point, and so this, in every process it starts (API server, engine core, workers), each
    with its own default monitor: the monitor of the process that runs the model runner (whose verdicts decide) is
    switched here, through its one setting (:meth:`tripwire.Monitor.set_contain`), whether it was built before the
    plugin or is built now; no environment variable has to carry the choice across processes. Under ``mask`` and
    ``flag`` a monitor set to contain (``Monitor(contain=True)``, ``TRIPWIRE_CONTAIN=1``) is refused, not switched
    off: an explicit setting is never dropped silently."""
    monitor = default_monitor() if monitor is None else monitor
    if mode == "contain":
        monitor.set_contain(True)
    elif monitor.contain:
        raise RuntimeError(
            f"{ENV}={mode} needs a monitor with containment off, but this one has contain=True (Monitor(contain=True) "
            f"or TRIPWIRE_CONTAIN={os.environ.get('TRIPWIRE_CONTAIN')!r}): under mask or flag a verdict that contains "
            f"would arm no stop and fail no request; use {ENV}=contain for containment"
        )
    return monitor


def install(mode: str, *, monitor: Monitor | None = None, logits: bool | None = None) -> _Plugin:
    """Install the integration into this process's vLLM (what the entry point does when ``TRIPWIRE_VLLM`` is set).
    Call it before vLLM builds its engine. ``mode``: one of :data:`MODES`. ``logits``: the per-request NaN/Inf check
    of the step's logits (site ``vllm.logits_nonfinite``; None: ``TRIPWIRE_VLLM_LOGITS``, unset = on). Idempotent
    for the same mode; another mode while installed is an error."""
    global _plugin
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not a tripwire vLLM mode; expected one of {', '.join(MODES)}")
    if logits is None:
        logits = logits_from_env()
    elif not isinstance(logits, bool):
        raise TypeError(f"logits must be a bool or None, got {type(logits).__name__}")
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
        plugin = _Plugin(mode, mon, version, logits=logits)
        _patch(plugin)
        add_metrics_sink(mon)
        atexit.register(plugin.drain)
        _plugin = plugin
        # At WARNING, so vLLM's own log shows it (tripwire's INFO lines do not appear under vLLM's logging setup):
        # which process is guarded, how, and for which runners.
        log.warning(
            "vLLM plugin on (pid %d): mode %s, vLLM %s, runners %s; sites vllm.* (slot_mapping, "
            "block_table, block_counts, positions, query_start_loc, seq_lens, idx_mapping, num_blocks%s)",
            os.getpid(),
            mode,
            version,
            "/".join(plugin.runners),
            ", logits_nonfinite" if logits else "; logits check off",
        )
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
        _contain.ON_TAINT = None
        if _plugin.sched is not None:
            _plugin.sched.remove()
        atexit.unregister(_plugin.drain)
        _plugin = None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install when ``TRIPWIRE_VLLM`` names a mode, nothing otherwise
    (not even an import of vLLM's internals). vLLM calls it in every process it starts. A ``TRIPWIRE_*`` name
    tripwire does not read (a misspelt switch) or a bad ``TRIPWIRE_VLLM`` stops vLLM here, in every process, whether
    or not the plugin is on: a set-but-misspelt switch would otherwise run vLLM unguarded without a word."""
    from ...config import check_variable_names

    check_variable_names()
    logits_from_env()  # a bad value stops here too, plugin on or not
    mode = mode_from_env()
    if mode is None:
        return
    # Before install (which adds this process's sink), and in the API server before it starts the engine core, whose
    # processes inherit the folder.
    serve_metrics()
    install(mode)
