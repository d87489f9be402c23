"""The few names the guarded copies (``guarded/``) import from the rest of vLLM, answered the same way with or
without vLLM installed: the guarded code then runs the same against any installed release (the GPU image's vLLM is
another release than the one the copies come from, and its names move between releases). Only what the kernels and
their launchers touch on an NVIDIA GPU with a bf16/fp16 cache."""

from __future__ import annotations

import enum
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import triton
import triton.language as tl


class _Platform:
    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def has_device_capability(self, cap: int) -> bool:
        if not torch.cuda.is_available():
            return True
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor >= cap

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn


def _is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype.startswith(("fp8", "int8", "int4", "nvfp4"))


def _fp8_min_max() -> tuple[float, float]:
    info = torch.finfo(torch.float8_e4m3fn)
    return float(info.min), float(info.max)


class _KVQuantMode(enum.Enum):
    NONE = 0
    INT4_PER_TOKEN_HEAD = 1


def modules() -> dict[str, types.ModuleType]:
    """Module objects named as vLLM names them, holding the shims (the parent packages empty)."""
    names: dict[str, dict[str, object]] = {
        "vllm": {},
        "vllm.platforms": {"current_platform": _Platform()},
        "vllm.triton_utils": {"tl": tl, "triton": triton},
        "vllm.model_executor": {},
        "vllm.model_executor.layers": {},
        "vllm.model_executor.layers.quantization": {},
        "vllm.model_executor.layers.quantization.utils": {},
        "vllm.model_executor.layers.quantization.utils.quant_utils": {
            "FP8_DTYPE": torch.float8_e4m3fn,
            "get_fp8_min_max": _fp8_min_max,
        },
        "vllm.utils": {},
        "vllm.utils.torch_utils": {"is_quantized_kv_cache": _is_quantized_kv_cache},
        "vllm.v1": {},
        "vllm.v1.kv_cache_interface": {"KVQuantMode": _KVQuantMode},
    }
    out = {}
    for name, attrs in names.items():
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        out[name] = m
    return out


@contextmanager
def installed() -> Iterator[None]:
    """The shims in sys.modules while a guarded copy is imported, in place of any real vLLM module of those names
    (put back after): the copy keeps the shims' objects, vLLM's own modules keep theirs."""
    shims = modules()
    saved = {name: sys.modules.get(name) for name in shims}
    sys.modules.update(shims)
    try:
        yield
    finally:
        for name, m in saved.items():
            if m is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = m
