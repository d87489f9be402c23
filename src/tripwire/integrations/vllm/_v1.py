"""The V1 model runner's step hooks (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, vLLM 0.26-0.33; the CPU
build's ``CPUModelRunner`` subclasses it): the inputs phase before its block table's slot-mapping kernel
(``MultiGroupBlockTable.compute_slot_mapping``, which reads the table at ``position // block_size`` with no bound),
the outputs phase in ``_build_attention_metadata`` (before any attention metadata is built), and the lifecycle
both runners share (:mod:`tripwire.integrations.vllm._runner`). The validator is
:class:`tripwire.integrations.vllm._steps.StepValidator`.
"""

from __future__ import annotations

import functools
from typing import Any

from ._runner import RunnerState, lifecycle
from ._steps import StepValidator

# The V1 runner's methods this integration wraps, and its block table's method that runs vLLM's slot-mapping kernel.
RUNNER_HOOKS = ("initialize_kv_cache", "execute_model", "_build_attention_metadata", "sample_tokens", "capture_model")
TABLE_HOOK = "compute_slot_mapping"


def patches(plugin: Any, runner_cls: type, table_cls: type) -> list[tuple[type, str, Any]]:
    """The V1 runner (0.26-0.33; the CPU build's ``CPUModelRunner`` subclasses it): the lifecycle, the inputs phase
    before its block table's slot-mapping kernel, the outputs phase in ``_build_attention_metadata``."""
    slots_orig = table_cls.__dict__[TABLE_HOOK]

    @functools.wraps(slots_orig)
    def compute_slot_mapping(self: Any, num_reqs: Any, query_start_loc: Any, positions: Any) -> Any:
        cur = plugin.v1_step
        # Real steps only, once each: the step wrapper sets v1_step (dummy runs and captures never do).
        if cur is not None and not cur[1].inputs_done:
            runner, st = cur
            st.inputs_done = True
            # positions and query_start_loc are the runner's own buffers' prefixes (what this call is given).
            st.rose = st.validator.inputs(runner, num_reqs, positions.shape[0]) or st.rose
        return slots_orig(self, num_reqs, query_start_loc, positions)

    attn_orig = runner_cls.__dict__["_build_attention_metadata"]

    def outputs(self: Any, st: RunnerState, n_reqs: int, n_tokens: int, slots: Any) -> None:
        if not st.inputs_done:
            # A vLLM whose step did not pass through compute_slot_mapping (a runner that computes slots otherwise):
            # the inputs are validated here, late for its slot kernel but before attention.
            st.inputs_done = True
            st.rose = st.validator.inputs(self, n_reqs, n_tokens) or st.rose
        st.rose = st.validator.outputs(self, n_reqs, n_tokens, slots) or st.rose
        st.validated = True

    @functools.wraps(attn_orig)
    def _build_attention_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        st: RunnerState | None = getattr(self, "_tripwire", None)
        # Real steps only, once each: vLLM's dummy runs and graph captures build metadata from placeholders, and a
        # capture must record no host read of it (the captured graph replays with whatever the buffers hold then).
        if st is not None and st.in_step and not st.validated and not kwargs.get("for_cudagraph_capture", False):
            if args:
                raise RuntimeError(
                    f"tripwire: vLLM {plugin.version} builds attention metadata with positional arguments; this "
                    f"integration reads them by name (num_reqs, num_tokens, slot_mappings)"
                )
            outputs(self, st, kwargs["num_reqs"], kwargs["num_tokens"], kwargs["slot_mappings"])
        return attn_orig(self, *args, **kwargs)

    return [
        *lifecycle(plugin, runner_cls, StepValidator, v1=True),
        (runner_cls, "_build_attention_metadata", _build_attention_metadata),
        (table_cls, TABLE_HOOK, compute_slot_mapping),
    ]
