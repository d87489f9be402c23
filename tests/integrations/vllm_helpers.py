"""The vLLM tests' engine runs (tripwire.testing.vllm_proc), and where to find vLLM: ``TRIPWIRE_VLLM_PYTHON``, else
``/opt/venv-vllm/bin/python`` (where ``.ci/run`` builds it). Without it the vLLM tests skip, and under ``CI=true``
they fail: CI must run them."""

from __future__ import annotations

import os
import subprocess

import pytest

from tripwire.testing import vllm_proc
from tripwire.testing.vllm_proc import EnginePool, Run, run_engine

__all__ = [
    "BLOCK",
    "EnginePool",
    "Run",
    "by_marker",
    "fault",
    "marker",
    "prompt",
    "python_in_vllm_env",
    "run_engine",
    "same",
    "vllm_python",
]

BLOCK = 32  # the engine's block size (tripwire.testing.vllm_run)


def vllm_python() -> str:
    """The vLLM environment's python, or skip (fail under CI=true) when there is none."""
    try:
        return vllm_proc.vllm_python()
    except vllm_proc.NoVllm as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(str(e))
        pytest.skip(str(e))


def python_in_vllm_env(code: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    vllm_python()
    return vllm_proc.python_in_vllm_env(code, env=env, timeout=timeout)


def prompt(round_: int, i: int) -> list[int]:
    """Request ``i`` of a round: its first token is its marker (the fault injector finds its victim by it); lengths
    10 to 40 tokens, so some requests span two blocks and some cross into a new block while decoding."""
    n = (10, 25, 40, 31)[i]
    return [marker(round_, i)] + [(7 * round_ + 3 * i + k) % 400 + 1 for k in range(n - 1)]


def marker(round_: int, i: int) -> int:
    return 410 + 10 * round_ + i  # below the model's vocabulary of 512


def fault(round_: int, i: int, kind: str, step: int, value: int | str) -> dict:
    return {"marker": marker(round_, i), "step": step, "kind": kind, "value": value}


def same(r: dict) -> tuple:
    """What a request returned, without its request id (which counts the requests of its process)."""
    return r["marker"], r["tokens"], r["finish_reason"]


def by_marker(round_out: list[dict]) -> dict[int, dict]:
    return {r["marker"]: r for r in round_out}
