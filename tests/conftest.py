"""Test setup shared by every test module.

Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must be set before triton is imported, so it
is set here, at collection, and only when CUDA is absent (on the H200 the same tests compile and run on the GPU).

Fixtures:
* ``kernel_device``: where kernels run in this process: "cpu" under the interpreter, else "cuda".
* ``registry``/``monitor``: a private SiteRegistry and a Monitor on it, so tests never share counts or rows.
"""

from __future__ import annotations

import os

import pytest
import torch

# pytester: tests/test_tripwire_pytest.py runs pytest sessions with tripwire's plugin.
pytest_plugins = ["pytester"]

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
