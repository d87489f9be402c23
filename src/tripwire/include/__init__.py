"""Where the CUDA C++ header lives: ``tripwire/guard.cuh``, the device helpers for extensions built with
``torch.utils.cpp_extension`` (the same counter rows and protocol as :mod:`tripwire.triton`)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["include_dir"]


def include_dir() -> str:
    """The directory to put on a CUDA extension's include path (``extra_include_paths=[tripwire.include_dir()]``);
    it holds ``tripwire/guard.cuh``, so kernels ``#include <tripwire/guard.cuh>``. Shipped in the wheel and the
    sdist; reading it initialises nothing."""
    return str(Path(__file__).resolve().parent)
