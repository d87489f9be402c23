"""Fault injectors and fixtures for testing tripwire, and code guarded by it, against the faults it exists to catch.

They re-create the bugs tripwire guards against, the way they happen (a bad index in a guarded kernel, a host-side
metadata bug in a real engine, a NaN in one request's hidden state); tripwire's own tests, ``tripwire demo``,
``tripwire bench`` and the measurement lab in the repository's ``benchmarks/`` use them, and so may a user's tests.
None of them is needed to run tripwire.

* :func:`write_hit` (:mod:`.hits`): a guard hit written on the host into a CPU arena row as a kernel writes it.
* :func:`gather_rows` (:mod:`.gather`): a guarded row gather (and its unguarded twin) to feed bad indices.
* timing a guarded kernel against its twin on a GPU (:mod:`.timing`): :func:`capture`, :func:`do_bench_ms`,
  :func:`paired_replay_ms`, :func:`jit_copy` (the same kernel's code loaded again), :func:`pooled_replay_ms`,
  :func:`pooled_cost_pct`, :func:`pooled_ms`, :func:`d2d_copy_ms`.
* transformers (:mod:`.transformers_engine`, needs ``transformers``): :func:`tiny_llama` (a small random Llama, no
  download), :func:`cb_config`, :data:`PROMPTS`, :class:`PersistentEngine` (continuous batching kept across runs),
  :class:`FaultInjector` with :class:`Injection` (bad entries in the engine's prepared metadata at a chosen step)
  and :class:`NanInjector` (NaN in one request's rows at a chosen step).
* vLLM, each run in a process of its own with the vLLM environment's python (:mod:`.vllm_proc`:
  :func:`run_engine`, :class:`EnginePool`, :class:`Run`, :func:`vllm_python`, :class:`NoVllm`); the run itself
  (:mod:`.vllm_run`, ``python -m tripwire.testing.vllm_run CONFIG``, and its :func:`make_model`); the host-side
  fault injector loaded into vLLM as a plugin (:mod:`.vllm_faults`, :func:`plugin_dir`).

The names load on first use, so that ``import tripwire.testing`` imports neither Triton nor transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "PROMPTS",
    "EnginePool",
    "FaultInjector",
    "Injection",
    "NanInjector",
    "NoVllm",
    "PersistentEngine",
    "Run",
    "capture",
    "cb_config",
    "d2d_copy_ms",
    "do_bench_ms",
    "gather_rows",
    "jit_copy",
    "make_model",
    "paired_replay_ms",
    "plugin_dir",
    "pooled_cost_pct",
    "pooled_ms",
    "pooled_replay_ms",
    "run_engine",
    "tiny_llama",
    "vllm_python",
    "write_hit",
]

_HOME = {
    "write_hit": "hits",
    "gather_rows": "gather",
    "PROMPTS": "transformers_engine",
    "FaultInjector": "transformers_engine",
    "Injection": "transformers_engine",
    "NanInjector": "transformers_engine",
    "PersistentEngine": "transformers_engine",
    "cb_config": "transformers_engine",
    "tiny_llama": "transformers_engine",
    "EnginePool": "vllm_proc",
    "NoVllm": "vllm_proc",
    "Run": "vllm_proc",
    "run_engine": "vllm_proc",
    "vllm_python": "vllm_proc",
    "make_model": "vllm_run",
    "plugin_dir": "vllm_faults",
    "capture": "timing",
    "d2d_copy_ms": "timing",
    "do_bench_ms": "timing",
    "jit_copy": "timing",
    "paired_replay_ms": "timing",
    "pooled_cost_pct": "timing",
    "pooled_ms": "timing",
    "pooled_replay_ms": "timing",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'tripwire.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
