"""vLLM's CUDA ``reshape_and_cache_flash_kernel`` and its guarded copy as one torch extension
(``reshape_and_cache.cu``), built with ``torch.utils.cpp_extension`` on first use (needs nvcc and a GPU build of
torch)."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

import tripwire

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "reshape_and_cache.cu"
NAME = "tripwire_adopted_vllm_cache"
FLAGS = ["-O3", "-lineinfo", "-std=c++17"]

SITE = tripwire.register_site(
    "adopted.vllm_cache_cuda.slot",
    description="CUDA reshape_and_cache_flash: a slot vs the KV cache's slots (row = the token)",
    fatal=True,
)

_module: ModuleType | None = None


def build(verbose: bool = False) -> ModuleType:
    """Compile (once; cached on disk by cpp_extension) and load. Before any capture: it may run nvcc."""
    global _module
    if _module is None:
        _module = _build(verbose)
    return _module


def _build(verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension as ce

    includes = [tripwire.include_dir(), str(HERE)]
    if ce.is_ninja_available():
        return ce.load(
            name=NAME, sources=[str(SOURCE)], extra_include_paths=includes, extra_cuda_cflags=FLAGS, verbose=verbose
        )
    # Without ninja, setuptools' build_ext (as examples/cuda_gather does), cached by the sources' hash.
    key = hashlib.sha256()
    for f in (
        SOURCE,
        HERE / "vote_variant.cuh",
        HERE / "original" / "cache_kernels.cuh",
        HERE / "guarded" / "cache_kernels.cuh",
    ):
        key.update(f.read_bytes())
    key.update((Path(tripwire.include_dir()) / "tripwire" / "guard.cuh").read_bytes())
    key.update(f"{torch.__version__} {torch.version.cuda} {sys.version} {FLAGS}".encode())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    out = root / f"{NAME}_{key.hexdigest()[:16]}"
    so = out / (NAME + importlib.machinery.EXTENSION_SUFFIXES[0])
    if not so.exists():
        from setuptools import setup

        ext = ce.CUDAExtension(
            NAME, [str(SOURCE)], include_dirs=includes, extra_compile_args={"cxx": ["-O3"], "nvcc": FLAGS}
        )
        args = ["build_ext", "--build-lib", str(out), "--build-temp", str(out / "tmp")]
        setup(
            name=NAME,
            ext_modules=[ext],
            cmdclass={"build_ext": ce.BuildExtension.with_options(use_ninja=False)},
            script_args=[*([] if verbose else ["-q"]), *args],
        )
    spec = importlib.util.spec_from_file_location(NAME, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the built extension {so}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def library_path() -> str:
    """The built extension's shared library (for ``tripwire resources --cuda`` and cuobjdump)."""
    mod = build()
    return str(mod.__file__)


def variant_of(kernel: str) -> str:
    """Which of the extension's kernels a function name (mangled, as cuobjdump prints it, or demangled, as the
    profiler does) is: "original" (vLLM's), "guarded_first" or "guarded_late" (the guarded copy testing the slot
    first, as launched in one wave, or after the index arithmetic, over several) or "vote" (the profiler's control,
    vote_variant.cuh)."""
    if "_vote" in kernel:
        return "vote"
    if "vllm_guarded" in kernel:
        # The TW_FIRST template argument: mangled Lb1E / Lb0E, demangled "true>" / "false>".
        return "guarded_first" if "Lb1E" in kernel or "true>" in kernel else "guarded_late"
    return "original"


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    guard: bool | str,
    ctr: torch.Tensor | None = None,
    requests: torch.Tensor | None = None,
) -> None:
    """vLLM's kernel (``guard=False``), the guarded copy (``guard=True``: ``ctr`` defaults to SITE's row of the
    default monitor; ``requests``: int64, one per token) or ``guard="vote"``, the profiler's control
    (vote_variant.cuh). The guarded copy tests the slot where the grid makes it cheapest (one wave: first; several:
    after the index arithmetic); ``guard="first"`` or ``"late"`` forces one. No sync, no allocation once built:
    capturable."""
    variants = {False: 0, True: 1, "vote": 2, "first": 3, "late": 4}
    if not isinstance(guard, (bool, str)) or guard not in variants:
        raise ValueError(f"guard must be one of False, True, 'vote', 'first', 'late'; got {guard!r}")
    mod = build()
    variant = variants[guard]
    if variant and ctr is None:
        ctr = tripwire.counter(SITE, key.device)
    mod.reshape_and_cache_flash(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, variant,
        slot_mapping if ctr is None else ctr, requests,
    )  # fmt: skip
