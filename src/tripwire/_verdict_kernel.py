"""The verdict's gather-and-consume kernel (:mod:`tripwire.verdict`) and its launcher.

One program per site of a ring: it copies the site's arena row and offender block into the ring's device staging
slot, then zeroes the block's entries (the header's K and recorded-hits word stay: they are layout and the reader's
lifetime count). The staging slot then goes to pinned host memory in one copy. Both run in the step's stream order,
so the copy holds every hit the step's kernels made, offenders included.

Eager enqueues replay a small CUDA graph per slot (the kernel and the copy, captured at bind time): one graph
launch costs less host time than a Triton launch and a copy from Python, on every Triton version.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .layout import OFF_HEADER, SLOTS

__all__ = ["bind"]


@triton.jit
def _gather_consume(
    rows_ptr,
    off_ptr,
    ids_ptr,
    dst_ptr,
    ROW_W: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HEADER: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    r = tl.load(ids_ptr + i)
    w = tl.arange(0, BLOCK)
    in_row = w < ROW_W
    in_blk = (w >= ROW_W) & (w < WIDTH)
    b = tl.where(in_blk, w - ROW_W, 0)
    row = tl.load(rows_ptr + r * ROW_W + w, mask=in_row, other=0)
    blk = tl.load(off_ptr + r * BLOCK_W + b, mask=in_blk, other=0)
    tl.store(dst_ptr + i * WIDTH + w, tl.where(in_row, row, blk), mask=w < WIDTH)
    # The loads above feed the store; the barrier keeps the zeroing after them in every thread of the program.
    tl.debug_barrier()
    tl.store(off_ptr + r * BLOCK_W + b, tl.zeros_like(blk), mask=in_blk & (b >= HEADER))


def _direct(
    rows: torch.Tensor, off: torch.Tensor, ids: torch.Tensor, staging: torch.Tensor, width: int
) -> Callable[[int], None]:
    n = int(ids.numel())
    block = triton.next_power_of_2(width)
    bw = int(off.shape[1])

    def launch(slot: int) -> None:
        _gather_consume[(n,)](rows, off, ids, staging[slot], SLOTS, bw, OFF_HEADER, width, block)

    return launch


def bind(
    rows: torch.Tensor, off: torch.Tensor, ids: torch.Tensor, staging: torch.Tensor, width: int
) -> Callable[[int], None]:
    """The launcher of ``_gather_consume`` over ``ids`` into ``staging[slot]``; every tensor is CUDA, int64 and
    contiguous, and lives as long as the ring (a captured graph holds their addresses)."""
    for name, t in (("rows", rows), ("offenders", off), ("ids", ids), ("staging", staging)):
        if t.device.type != "cuda" or t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"the verdict kernel's {name} must be a contiguous CUDA int64 tensor, got {t.dtype}")
    if staging.shape[1:] != (ids.numel(), width) or rows.shape[1] != SLOTS or width != SLOTS + off.shape[1]:
        raise ValueError(f"staging {tuple(staging.shape)} does not fit {ids.numel()} sites of {width} words")
    return _direct(rows, off, ids, staging, width)


def slot_graphs(
    launch: Callable[[int], None], staging: torch.Tensor, host: torch.Tensor, depth: int, device: torch.device
) -> list[torch.cuda.CUDAGraph]:
    """One CUDA graph per ring slot holding the kernel and the copy of that slot to pinned memory (built at the
    ring's construction, before the engine captures anything). The kernel is compiled first on scratch tensors of
    the same shapes and alignment: running it on the arena would consume offenders of hits made before the ring."""
    n, width = int(staging.shape[1]), int(staging.shape[2])
    scratch_rows = torch.zeros((1, SLOTS), dtype=torch.int64, device=device)
    scratch_off = torch.zeros((1, width - SLOTS), dtype=torch.int64, device=device)
    scratch_ids = torch.zeros(n, dtype=torch.int64, device=device)
    scratch_dst = torch.zeros((1, n, width), dtype=torch.int64, device=device)
    _direct(scratch_rows, scratch_off, scratch_ids, scratch_dst, width)(0)
    torch.cuda.synchronize(device)
    graphs = []
    for slot in range(depth):
        g = torch.cuda.CUDAGraph()
        # thread_local: a capture made while the engine's other threads (the reader) run CUDA calls stays valid.
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            launch(slot)
            host[slot].copy_(staging[slot], non_blocking=True)
        graphs.append(g)
    return graphs
