"""The guarded copy of vLLM's CUDA ``reshape_and_cache_flash_kernel`` (and the profiler's vote control) as a torch
extension (``reshape_and_cache.cu``), built with ``torch.utils.cpp_extension`` on first use (needs nvcc and a GPU build
of torch); vLLM's own kernel is vLLM's compiled op, from an installed GPU vLLM (:func:`vllm_op`): no wheel ships its
source, and this folder keeps no copy of it."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import tripwire

from . import INSTALL_HINT, NoVllm, vllm_version

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "reshape_and_cache.cu"
NAME = "tripwire_adopted_vllm_cache"
FLAGS = ["-O3", "-lineinfo", "-std=c++17"]

SITE = tripwire.register_site(
    "adopted.vllm_cache_cuda.slot",
    description="CUDA reshape_and_cache_flash: a slot vs the KV cache's slots (row = the token)",
    fatal=True,
)

_modules: dict[int, Any] = {}


def build(verbose: bool = False, copy: int = 0) -> Any:
    """Compile (once; cached on disk by cpp_extension) and load. Before any capture: it may run nvcc.

    ``copy`` > 0: the built library copied to a directory of its own and loaded from there, a second time in this
    process (:class:`_Copy`): its kernels are registered with the CUDA runtime as a module of their own, at other
    addresses than copy 0's. It has the module's ``reshape_and_cache_flash`` and ``__file__``."""
    if not isinstance(copy, int) or copy < 0:
        raise ValueError(f"copy must be an int >= 0, got {copy!r}")
    mod = _modules.get(copy)
    if mod is None:
        mod = _build(verbose) if copy == 0 else _load_copy(Path(str(build(verbose).__file__)), copy)
        _modules[copy] = mod
    return mod


def _load_copy(so: Path, copy: int) -> Any:
    dst = so.parent / f"copy{copy}" / so.name
    if not dst.exists() or dst.stat().st_mtime < so.stat().st_mtime:
        dst.parent.mkdir(exist_ok=True)
        tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
        shutil.copyfile(so, tmp)
        os.replace(tmp, dst)  # whole or absent: another process may be loading it
    return _Copy(dst)


class _Copy:
    """A second load of the library: the copied file opened by the dynamic loader (a new mapping: it maps a file by
    its identity), its kernels registered again by its own static constructors. Its function is called through its
    C symbol, ``tw_reshape_and_cache_flash_call`` (reshape_and_cache.cu): importing the copy as a module would give
    back copy 0's module object, whose functions launch copy 0's kernels (pybind11 keeps one module per name)."""

    def __init__(self, path: Path) -> None:
        self.__file__ = str(path)
        lib = ctypes.PyDLL(str(path), mode=ctypes.RTLD_LOCAL)  # PyDLL: called with the GIL held, errors raised
        self._call = lib.tw_reshape_and_cache_flash_call
        self._call.restype = ctypes.py_object
        self._call.argtypes = [ctypes.py_object]

    def reshape_and_cache_flash(self, *args: Any) -> None:
        self._call(args)


def _import(so: Path) -> ModuleType:
    # Under the library's own module name (its init function's), not registered in sys.modules, as cpp_extension
    # loads a built library. Not a way to a second load: for a copy of the file it returns this module (_Copy).
    spec = importlib.util.spec_from_file_location(NAME, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the built extension {so}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    return _import(so)


# vLLM's kernel as cuda_ext launches it, among the instantiations in vLLM's library: bf16 key, value and cache, kAuto
# (mangled: the template arguments __nv_bfloat16, __nv_bfloat16, 0).
VLLM_KERNEL_MATCH = r"^_ZN4vllm30reshape_and_cache_flash_kernelI13__nv_bfloat16S1_L.*E0EEEv"

# The extension module that registers vLLM's _C_cache_ops, by release: vllm._C_stable_libtorch in 0.26 (its
# libtorch-stable build), vllm._C in 0.32.
_VLLM_LIBRARIES = ("vllm._C_stable_libtorch", "vllm._C")


def _vllm_library() -> ModuleType:
    import importlib

    version = vllm_version()  # NoVllm, naming what to install, where there is no vLLM
    for name in _VLLM_LIBRARIES:
        try:
            lib = importlib.import_module(name)
        except (ImportError, OSError):  # absent in this release, or built against another torch
            continue
        op = getattr(torch.ops._C_cache_ops, "reshape_and_cache_flash", None)
        if op is not None and torch._C._dispatch_has_kernel_for_dispatch_key(op._qualified_op_name, "CUDA"):
            return lib
    raise NoVllm(
        f"vLLM {version} here has no CUDA reshape_and_cache_flash (torch.ops._C_cache_ops, from one of "
        f"{_VLLM_LIBRARIES}): vLLM's CUDA kernel comes from a GPU build of vLLM; {INSTALL_HINT}"
    )


def vllm_op() -> Any:
    """vLLM's compiled ``torch.ops._C_cache_ops.reshape_and_cache_flash`` (its CUDA kernel, as the installed GPU vLLM
    built it); :class:`NoVllm` where there is no GPU build of vLLM."""
    _vllm_library()
    return torch.ops._C_cache_ops.reshape_and_cache_flash


def vllm_library_path() -> str:
    """The installed vLLM's library that holds its CUDA reshape_and_cache_flash_kernel (for cuobjdump)."""
    return str(_vllm_library().__file__)


def library_path() -> str:
    """The built extension's shared library, the guarded kernels' (for ``tripwire resources --cuda`` and cuobjdump)."""
    mod = build()
    return str(mod.__file__)


def variant_of(kernel: str) -> str:
    """Which of the extension's kernels a function name (mangled, as cuobjdump prints it, or demangled, as the
    profiler does) is: "original" (vLLM's, in vLLM's library), "guarded_first" or "guarded_late" (the guarded copy testing the slot
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
    copy: int = 0,
) -> None:
    """vLLM's kernel (``guard=False``: the installed vLLM's compiled op, :func:`vllm_op`; ``ctr``, ``requests`` and
    ``copy`` do not apply), the guarded copy (``guard=True``: ``ctr`` defaults to SITE's row of the default monitor;
    ``requests``: int64, one per token) or ``guard="vote"``, the profiler's control (vote_variant.cuh). The guarded
    copy tests the slot where the grid makes it cheapest (one wave: first; several: after the index arithmetic);
    ``guard="first"`` or ``"late"`` forces one. ``copy``: which load of the extension runs it (:func:`build`). No
    sync, no allocation once built: capturable."""
    variants = {True: 1, "vote": 2, "first": 3, "late": 4}
    if guard is False:
        vllm_op()(key, value, key_cache, value_cache, slot_mapping, "auto", k_scale, v_scale)
        return
    if not isinstance(guard, (bool, str)) or guard not in variants:
        raise ValueError(f"guard must be one of False, True, 'vote', 'first', 'late'; got {guard!r}")
    mod = build(copy=copy)
    if ctr is None:
        ctr = tripwire.counter(SITE, key.device)
    mod.reshape_and_cache_flash(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, variants[guard], ctr, requests
    )
