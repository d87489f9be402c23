"""The split-K plan of :mod:`tripwire.kernels.decode_attention`: its launch shape (:class:`Config`), how many splits
a launch takes (:func:`default_splits`), the head tile of a KV group, and the partials' workspace
(:class:`Workspace`, :func:`alloc_workspace`), allocated before any capture because the launcher never allocates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

# Query heads per program: one [BLOCK_H, D] tile; a KV group larger than this is split over head tiles (each reads
# the group's K/V again). 16 is the smallest M of a tensor-core dot, so smaller groups are padded up to it.
_MAX_BLOCK_H = 64
_MIN_BLOCK_H = 16


@dataclass(frozen=True)
class Config:
    """Launch shape of the split kernel: ``block_n`` tokens per tile (a power of two >= 16), ``num_warps``, and
    ``num_stages`` (software pipelining of the K/V loads; 1 = none). The reduce kernel's shape is fixed."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps", "num_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Config.{name} must be a positive int, got {v!r}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"Config.block_n must be a power of two >= 16, got {self.block_n}")
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"Config.num_warps must be a power of two, got {self.num_warps}")


class Workspace(NamedTuple):
    """The split-K partials: ``out`` float32 ``[B, Hq, S, D]`` (each split's normalised output) and ``lse``
    float32 ``[B, Hq, S]`` (its log2-sum-exp, -inf for an empty split). ``S`` is the number of splits."""

    out: torch.Tensor
    lse: torch.Tensor


def _block_h(group: int) -> int:
    return max(_MIN_BLOCK_H, min(_MAX_BLOCK_H, triton.next_power_of_2(group)))


def default_splits(
    batch: int, kv_heads: int, q_heads: int, table_width: int, block_size: int, device: torch.device | str
) -> int:
    """Splits per sequence for a launch shape: enough programs for about 32 per SM, so the launch runs in several
    waves and its last, partial wave is a small part of its time; but at least 256 tokens per split (a split's fixed
    costs -- query load, page check, epilogue, its share of the reduce -- amortise over its tokens). 1 (which also
    skips the reduce) when the batch alone is that many programs. A host-side heuristic: it reads the device's SM
    count, never device memory; ``benchmarks/bench_decode_attention.py`` sweeps the alternatives."""
    dev = torch.device(device)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
    group = max(1, q_heads // max(1, kv_heads))
    programs = max(1, batch * kv_heads * triton.cdiv(group, _block_h(group)))
    by_fill = triton.cdiv(32 * sms, programs)
    by_length = max(1, (table_width * block_size) // 256)
    return int(min(by_fill, by_length))


def alloc_workspace(
    q: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    kv_heads: int,
    *,
    num_splits: int | None = None,
) -> Workspace | None:
    """Allocate the split-K partials for launches of ``q``'s shape (call once, before any capture; the launcher
    never allocates). ``num_splits`` defaults to :func:`default_splits`; ``None`` is returned when that is 1 (the
    launcher then writes ``out`` directly)."""
    B, Hq, D = q.shape
    S = (
        default_splits(B, kv_heads, Hq, block_table.shape[1], block_size, q.device)
        if num_splits is None
        else num_splits
    )
    if isinstance(S, bool) or not isinstance(S, int) or S < 1:
        raise ValueError(f"num_splits must be a positive int, got {S!r}")
    if S == 1:
        return None
    return Workspace(
        torch.empty(B, Hq, S, D, dtype=torch.float32, device=q.device),
        torch.empty(B, Hq, S, dtype=torch.float32, device=q.device),
    )
