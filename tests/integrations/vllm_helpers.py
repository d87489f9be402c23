"""The vLLM tests' engine runs (tripwire.cli._vllm_proc), and where to find vLLM: ``TRIPWIRE_VLLM_PYTHON``, else
``/opt/venv-vllm/bin/python`` (where ``.ci/run`` builds it). Without it the vLLM tests skip, and under ``CI=true``
they fail: CI must run them."""

from __future__ import annotations

import os
import subprocess

import pytest

from tripwire.cli import _vllm_proc
from tripwire.cli._vllm_proc import EnginePool, Run, run_engine

__all__ = ["EnginePool", "Run", "python_in_vllm_env", "run_engine", "vllm_python"]


def vllm_python() -> str:
    """The vLLM environment's python, or skip (fail under CI=true) when there is none."""
    try:
        return _vllm_proc.vllm_python()
    except _vllm_proc.NoVllm as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(str(e))
        pytest.skip(str(e))


def python_in_vllm_env(code: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    vllm_python()
    return _vllm_proc.python_in_vllm_env(code, env=env, timeout=timeout)
