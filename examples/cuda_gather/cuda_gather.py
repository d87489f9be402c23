"""The worked example of tripwire's CUDA C++ header: a guarded gather extension built with
``torch.utils.cpp_extension``.

    import cuda_gather                              # examples/cuda_gather on sys.path
    cuda_gather.build()                             # nvcc via cpp_extension (cached on disk); before any capture
    ctr = tripwire.counter(cuda_gather.SITE, "cuda")
    cuda_gather.gather(src, idx, out, ctr=ctr)      # out[i] = src[idx[i]]; a bad idx gives a zero row, counted
    cuda_gather.gather(src, idx, out, ctr=ctr, requests=req)  # ... and kept as an offender with req[i]
    torch.ops.cuda_gather.gather(src, idx, out, ctr, True)   # the same as a custom op, for torch.compile

The kernel is ``gather.cu``: ``tripwire::guard_index`` on the indices, one warp-aggregated vote per 32 rows; a bad
row's request (when a request map is given) is read by that lane only. docs/guarding.md walks through it.
"""

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
SOURCE = HERE / "gather.cu"
NAME = "tripwire_cuda_gather"
FLAGS = ["-O3", "-lineinfo"]

SITE = tripwire.register_site(
    "examples.cuda_gather.index",
    description="CUDA gather example: an index vs the source's rows (row = output row, value = the index)",
)

_module: ModuleType | None = None


def build(verbose: bool = False) -> ModuleType:
    """Compile (once; cached on disk) and load the extension. Call it before any capture: it may run nvcc."""
    global _module
    if _module is None:
        _module = _build(verbose)
    return _module


def _build(verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension as ce

    include = tripwire.include_dir()
    if ce.is_ninja_available():
        return ce.load(
            name=NAME, sources=[str(SOURCE)], extra_include_paths=[include], extra_cuda_cflags=FLAGS, verbose=verbose
        )
    # torch's load() needs ninja; without it, the same extension through setuptools' build_ext, which
    # cpp_extension's BuildExtension drives without ninja. Cached under a key of everything that goes into it.
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), (Path(include) / "tripwire" / "guard.cuh").read_bytes()):
        key.update(part)
    key.update(f"{torch.__version__} {torch.version.cuda} {sys.version} {FLAGS}".encode())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    out = root / f"{NAME}_{key.hexdigest()[:16]}"
    so = out / (NAME + importlib.machinery.EXTENSION_SUFFIXES[0])
    if not so.exists():
        from setuptools import setup

        ext = ce.CUDAExtension(
            NAME, [str(SOURCE)], include_dirs=[include], extra_compile_args={"cxx": ["-O3"], "nvcc": FLAGS}
        )
        setup(
            name=NAME,
            ext_modules=[ext],
            cmdclass={"build_ext": ce.BuildExtension.with_options(use_ninja=False)},
            script_args=[
                *([] if verbose else ["-q"]),
                "build_ext",
                "--build-lib",
                str(out),
                "--build-temp",
                str(out / "tmp"),
            ],
        )
    spec = importlib.util.spec_from_file_location(NAME, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the built extension {so}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gather(
    src: torch.Tensor,
    idx: torch.Tensor,
    out: torch.Tensor,
    *,
    ctr: torch.Tensor | None = None,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[i] = src[idx[i]]``; guarded, an index outside ``[0, len(src))`` gives a zero row and counts at
    :data:`SITE` (``ctr``: its counter row, default the default monitor's), kept as an offender (row ``i``, value the
    index, and ``requests[i]``: an int32/int64 request map of ``len(idx)`` entries, one per output row, when given).
    ``guard=False`` launches the unguarded twin (benchmarks and the sanitizer control only). No sync, no allocation
    once built: capturable."""
    mod = build()
    if guard and ctr is None:
        ctr = tripwire.counter(SITE, src.device)
    mod.gather(src, idx, out, idx if ctr is None else ctr, bool(guard), requests)  # the twin never reads ctr
    return out


@torch.library.custom_op("cuda_gather::gather", mutates_args=("out", "ctr"))
def gather_op(
    src: torch.Tensor,
    idx: torch.Tensor,
    out: torch.Tensor,
    ctr: torch.Tensor,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    """The custom-op form for torch.compile: ``out`` and ``ctr`` are declared mutated, so the compiler keeps and
    orders the call (and the counts) like any in-place op; ``requests`` is optional (callers that pass five
    arguments are unchanged)."""
    build().gather(src, idx, out, ctr, bool(guard), requests)


@gather_op.register_fake
def _(src, idx, out, ctr, guard=True, requests=None):  # type: ignore[no-untyped-def]
    return None
