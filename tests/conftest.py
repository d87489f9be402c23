"""Test setup shared by every test module.

Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must be set before triton is imported, so it
is set here, at collection, and only when CUDA is absent (on the H200 the same tests compile and run on the GPU).

Fixtures:
* ``kernel_device``: where kernels run in this process: "cpu" under the interpreter, else "cuda".
* ``registry``/``monitor``: a private SiteRegistry and a Monitor on it, so tests never share counts or rows.
* ``build_probe``: runs a script that compiles kernels ahead of time for a GPU target (no GPU needed) and prints one
  JSON line; returns it parsed, skipping the test when the script reports ``{"error": ...}`` (no bundled ptxas).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def kernel_device() -> str:
    return "cpu" if INTERPRET or not HAS_CUDA else "cuda"


@pytest.fixture
def registry():
    from tripwire import SiteRegistry

    return SiteRegistry(capacity=64)


@pytest.fixture
def monitor(registry):
    from tripwire import Monitor

    m = Monitor(registry=registry, capacity=64, mode="warn", interval=0.01, report_every=10.0)
    yield m
    m.stop()


@pytest.fixture
def build_probe(tmp_path):
    def run(source: str, timeout: float = 900) -> dict:
        # A file (@triton.jit reads its function's source) run without TRITON_INTERPRET: compiling needs the real
        # compiler, which the interpreter replaces in this process.
        probe = tmp_path / "build_probe.py"
        probe.write_text(source)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        p = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=env, timeout=timeout)
        assert p.returncode == 0, p.stderr[-2000:]
        r = json.loads(p.stdout.strip().splitlines()[-1])
        if "error" in r:
            pytest.skip(f"cannot compile for the GPU target here (no bundled ptxas?): {r['error']}")
        return r

    return run
