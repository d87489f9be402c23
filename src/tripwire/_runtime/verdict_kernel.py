"""The verdict's gather-and-consume kernel (:mod:`tripwire.verdict`) and its launcher.

One program per site of a ring: it copies the site's arena row and offender block into the ring's slot, then zeroes
the block's entries (the header's K and recorded-hits word stay: they are layout and the reader's lifetime count).
It runs in the step's stream order, so the slot holds every hit the step's kernels made, offenders included.

The slot is pinned host memory written by the kernel itself (zero-copy: pinned memory is device-accessible under
unified addressing), so a verdict is ONE kernel node, not a kernel and a copy; where the kernel cannot take the host
pointer the ring falls back to a device staging slot and a copy (:func:`zero_copy`). Eager enqueues launch a small
CUDA graph per slot, captured at construction, through the driver (``cuGraphLaunch`` and ``cuEventRecord``,
:mod:`tripwire._runtime.driver`): a few microseconds of host time where a Triton launch from Python costs tens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from ..layout import OFF_HEADER, SLOTS
from .driver import Driver

log = logging.getLogger("tripwire")


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


def bind(
    rows: torch.Tensor, off: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, width: int
) -> Callable[[int], None]:
    """The launcher of ``_gather_consume`` over ``ids`` into ``slots[slot]`` (``[depth, sites, width]``, on the device
    or pinned host memory); every tensor is int64 and contiguous and lives as long as the ring (a captured graph holds
    their addresses)."""
    for name, t in (("rows", rows), ("offenders", off), ("ids", ids), ("slots", slots)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"the verdict kernel's {name} must be a contiguous int64 tensor, got {t.dtype}")
        if t.device.type != "cuda" and not (name == "slots" and t.is_pinned()):
            raise ValueError(f"the verdict kernel's {name} must be a CUDA tensor (slots: or pinned host memory)")
    if slots.shape[1:] != (ids.numel(), width) or rows.shape[1] != SLOTS or width != SLOTS + off.shape[1]:
        raise ValueError(f"slots {tuple(slots.shape)} do not fit {ids.numel()} sites of {width} words")
    n = int(ids.numel())
    block = triton.next_power_of_2(width)
    bw = int(off.shape[1])
    views = [slots[i] for i in range(slots.shape[0])]  # made once: a view per launch would allocate on the step path

    def launch(slot: int) -> None:
        _gather_consume[(n,)](rows, off, ids, views[slot], SLOTS, bw, OFF_HEADER, width, block)

    return launch


def _scratch(device: torch.device, n: int, width: int, dst: torch.Tensor) -> Callable[[int], None]:
    # The same shapes, dtypes and alignment as the ring's (so the compiled kernel is the one the ring uses), on
    # scratch rows: running the kernel on the arena would consume offenders of hits made before the ring.
    rows = torch.zeros((1, SLOTS), dtype=torch.int64, device=device)
    rows[0, 0] = 7
    off = torch.zeros((1, width - SLOTS), dtype=torch.int64, device=device)
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    return bind(rows, off, ids, dst, width)


def zero_copy(device: torch.device, n: int, width: int) -> bool:
    """Whether the kernel can write the ring's pinned host slots directly on this stack (probed once per ring at its
    construction: a launch into a pinned scratch slot, synchronised, then read back)."""
    dst = torch.zeros((1, n, width), dtype=torch.int64, pin_memory=True)
    try:
        _scratch(device, n, width, dst)(0)
        torch.cuda.synchronize(device)
    except Exception as e:  # Triton refusing a host pointer: the staging path
        log.info("the verdict kernel cannot write pinned memory here (%s); it stages and copies", e)
        return False
    return bool(dst[0, 0, 0] == 7)


def slot_graphs(
    launch: Callable[[int], None],
    depth: int,
    device: torch.device,
    copy: Callable[[int], None] | None,
    compile_into: torch.Tensor,
) -> list[torch.cuda.CUDAGraph]:
    """One CUDA graph per ring slot: the kernel (and ``copy(slot)``, the staging path's copy to pinned memory). Built
    at the ring's construction, before the engine captures anything; ``compile_into`` is a scratch slot array of the
    ring's kind (device or pinned) for the first, compiling launch."""
    n, width = int(compile_into.shape[1]), int(compile_into.shape[2])
    _scratch(device, n, width, compile_into)(0)
    torch.cuda.synchronize(device)
    graphs = []
    for slot in range(depth):
        g = torch.cuda.CUDAGraph()
        # thread_local: a capture made while the engine's other threads (the reader) run CUDA calls stays valid.
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            launch(slot)
            if copy is not None:
                copy(slot)
        graphs.append(g)
    return graphs


def graph_driver(graphs: list[Any]) -> Driver | None:
    """The driver to launch the slots' graphs and record and query their events through (the runtime's handles are
    the driver's), or None where libcuda or a graph's raw handle is not available (torch's Python calls then)."""
    if not all(hasattr(g, "raw_cuda_graph_exec") for g in graphs):
        return None
    return Driver.get()
