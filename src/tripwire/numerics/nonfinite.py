"""Non-finite counter: counts NaN and +/-Inf elements of a tensor (logits, hidden states) into a site's row, on the
device, with no host sync.

Engines' own NaN checks (``torch.isnan(x).any().item()``) cost a host sync per step; this one costs one read of the
tensor and, only when something is non-finite, one set of atomics per program. The row uses the guard layout
(kind ``"nonfinite"``): slot 0 = non-finite elements, first offender = (row, column) of one real non-finite element,
extremes = max row and min/max column, each independent. Row = index along the first dimension; for a 1-D tensor
the column is 0 (e.g. one value per request).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..monitor import Monitor
from ..report import GuardReporter, Hit, Wording, register_reporter, short_name
from ..sites import Site
from ..triton import record_hits
from ..triton._budget import register_cap

__all__ = [
    "NonFiniteReporter",
    "count_nonfinite",
    "nonfinite_message",
    "nonfinite_wording",
    "register_nonfinite_site",
]

_FLOAT_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
# Launch shape: BLOCK elements per load step (4 KiB: one 16-byte load per thread at 8 warps), _ITERS steps per
# program (their loads in flight together, one reduction per program). Chosen by the sweep in
# the lab's ``benchmarks/lab/numerics.py`` (its figures, against a copy's bandwidth, are in benchmarks/RESULTS.md,
# q1): larger steps in one load, or larger unrolled blocks (register pressure), read slower.
_BLOCK_BYTES = 4096
_ITERS = 4
_NUM_WARPS = 8
# The fault path's tile (elements): one per thread at 8 warps.
_FAULT_TILE = tl.constexpr(256)


def register_nonfinite_site(
    name: str, *, description: str = "", fatal: bool = False, monitor: Monitor | None = None
) -> Site:
    """Register (or look up) a non-finite counting site (kind ``"nonfinite"``) in ``monitor``'s registry (the
    default monitor's when None). Call it at import or construction time, before any capture."""
    if monitor is None:
        from .._default import default_monitor

        monitor = default_monitor()
    return monitor.registry.register(name, description=description, fatal=fatal, kind="nonfinite")


# Every dtype is tested on its bit pattern, loaded through a same-width integer view: an element is NaN or Inf
# exactly when its exponent field is all ones (e4m3fn has no Inf; its NaN is S.1111.111, the same test with the
# mantissa bits included). Integer tests are exact for every dtype (a finite float64 is never upcast), independent
# of how a backend converts FP8 NaN (the Triton interpreter gets it wrong), and cheaper than float conversions.
_BITS = {
    torch.float64: (torch.int64, 0x7FF0000000000000),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float8_e4m3fn: (torch.uint8, 0x7F),
    torch.float8_e5m2: (torch.uint8, 0x7C),
}


@triton.jit(noinline=True)
def _record_nonfinite(x_ptr, ctr_ptr, numel, ncols, base, SPAN: tl.constexpr, MASK: tl.constexpr):
    """The fault path, out of line: the program's ``SPAN`` elements from ``base`` read again and the non-finite ones
    recorded, lowest offsets first, in tiles of _FAULT_TILE (one element per thread). Its arguments are scalars the
    kernel has anyway, so nothing of the fault path is live in the hot loop, and its tiles (rows, columns, the
    record's reductions) are allocated here, not beside the hot loop's BLOCK-wide loads (a kernel is allocated
    registers for its hungriest path, taken or not)."""
    lane = tl.arange(0, _FAULT_TILE)
    for j in tl.range(0, SPAN, _FAULT_TILE, loop_unroll_factor=1):
        start = base + j
        fo = start + lane
        fm = (fo < numel) & (j + lane < SPAN)  # a smaller program: its own range only
        fx = tl.load(x_ptr + fo, mask=fm, other=0)
        # (row, column) of each lane from the tile start's, divided once per tile: per-lane int64 divisions are
        # long emulated sequences whose registers the whole kernel is allocated (48 registers against the twin's
        # 26; 32 this way). A lane's offset into the start's row is below ncols + _FAULT_TILE: for an int32 ncols
        # (every launch whose rows are shorter than 2**31) unsigned 32-bit arithmetic is exact; a longer row is
        # crossed at most once by a tile.
        row0 = start // ncols
        if ncols.dtype == tl.int32:
            c = ((start - row0 * ncols) + lane).to(tl.uint32)
            wrap = c // ncols.to(tl.uint32)
            col = (c - wrap * ncols.to(tl.uint32)).to(tl.int64)
            wrap = wrap.to(tl.int64)
        else:
            c = (start - row0 * ncols) + lane
            wrap = (c >= ncols).to(tl.int64)
            col = c - wrap * ncols
        record_hits(ctr_ptr, ((fx & MASK) == MASK) & fm, row0 + wrap, col)


# ncols not specialised: a 1-D tensor's ncols is 1, which Triton would make a constant (a Python int), and the fault
# path reads its dtype to pick 32-bit arithmetic.
@triton.jit(do_not_specialize=["ncols"])
def _nonfinite_kernel(x_ptr, ctr_ptr, numel, ncols, BLOCK: tl.constexpr, ITERS: tl.constexpr, MASK: tl.constexpr,
                      GUARD: tl.constexpr):  # fmt: skip
    # ITERS blocks per program, unrolled (static_range) so that all their loads are in flight at once; the test is
    # OR-ed elementwise and reduced ONCE per program: a per-block reduction (shared memory + barrier) would stall
    # this read-only kernel's loads behind a barrier per block.
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    lanes = tl.arange(0, BLOCK)
    seen = tl.zeros([BLOCK], tl.int32)
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + lanes
        m = offs < numel
        # A plain load, no eviction hint: on sm_90 an evict_first load (an L2 cache-hint load with its policy) reads
        # slower than a plain one at every size and shape the benchmark sweeps, guarded and twin alike
        # (benchmarks/RESULTS.md, nonfinite-shapes); a plain load also leaves the tensor in L2 for whatever reads
        # it next (the sampler, after logits).
        x = tl.load(x_ptr + offs, mask=m, other=0)
        seen |= (((x & MASK) == MASK) & m).to(tl.int32)
    # The rare path (something is non-finite): the program's range read again and recorded, lowest offsets first,
    # a _FAULT_TILE tile at a time, by out-of-line functions (record_tiles): the hot loop's BLOCK-wide words are
    # dead by then and the fault path's (int64 rows and columns, the record's reductions) are never beside them.
    if tl.max(seen, axis=None) > 0:
        if GUARD:
            _record_nonfinite(x_ptr, ctr_ptr, numel, ncols, base, BLOCK * ITERS, MASK)
        else:
            # The twin the benchmark times the counter against: the same loads and vote, the fault path reduced
            # to one atomic (a program that saw something). Something must use the vote, or the compiler drops the
            # loads with it.
            tl.atomic_add(ctr_ptr, 1)


def count_nonfinite(
    tensor: torch.Tensor,
    site: Site | str,
    *,
    ctr: torch.Tensor | None = None,
    monitor: Monitor | None = None,
) -> None:
    """Count NaN/Inf elements of ``tensor`` (any float dtype, 1-D or 2-D, contiguous) into ``site``'s row.

    ``ctr``: the site's counter row (``monitor.counter(site, tensor.device)``); pass it on the step path to skip the
    lookup, which otherwise hits the monitor's view cache (and allocates the arena on the very first call, which is
    refused inside a capture: call it once before capturing, or prealloc). Capture-safe and sync-free: the result
    reaches the host only through the reader. Counts are exact; the first offender is one real non-finite element
    (the lowest (row, column) within the program that won the race).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"count_nonfinite needs a floating tensor ({', '.join(map(str, _FLOAT_DTYPES))}), got {tensor.dtype}"
        )
    if tensor.dim() not in (1, 2):
        raise ValueError(
            f"count_nonfinite takes a 1-D or 2-D tensor (row = first dim), got shape {tuple(tensor.shape)}"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"count_nonfinite needs a contiguous tensor, got strides {tuple(tensor.stride())}")
    if ctr is None:
        if monitor is None:
            from .._default import default_monitor

            monitor = default_monitor()
        if isinstance(site, str):
            site = monitor.registry.get(site)
        if site.kind != "nonfinite":
            raise ValueError(f"site {site.name!r} is of kind {site.kind!r}; register it with register_nonfinite_site")
        ctr = monitor.counter(site, tensor.device)
    if ctr.dtype != torch.int64 or ctr.shape != (8,) or not ctr.is_contiguous():
        raise ValueError(f"ctr must be a contiguous int64 [8] counter row, got {ctr.dtype} {tuple(ctr.shape)}")
    if ctr.device != tensor.device:
        raise ValueError(f"ctr is on {ctr.device}, the tensor on {tensor.device}")
    numel = tensor.numel()
    if numel == 0:
        return
    _launch(tensor, ctr, default_block(tensor.dtype), _NUM_WARPS, _ITERS)


def default_block(dtype: torch.dtype) -> int:
    """Elements per load step for ``dtype``: _BLOCK_BYTES worth, at least 1024 (float64: 8 KiB)."""
    return max(1024, _BLOCK_BYTES // dtype.itemsize)


def _launch(
    tensor: torch.Tensor, ctr: torch.Tensor, block: int, num_warps: int, iters: int = 1, guard: bool = True
) -> None:
    """The counter's launch at a given shape; ``guard=False`` compiles the twin the benchmark's sweep compares each
    shape with: the counter's loads and vote, its fault path reduced to adding 1 to slot 0 per program that saw a
    non-finite value (no exact count, no offenders). The guarded launch is compiled within the twin's register
    allocation where its own would be larger (:func:`tripwire.triton.register_cap`: the first launch of a
    shape compiles both)."""
    ncols = tensor.shape[1] if tensor.dim() == 2 else 1
    if ncols == 0:
        return
    numel = tensor.numel()
    int_dtype, mask = _BITS[tensor.dtype]
    grid = (triton.cdiv(numel, block * iters),)
    args = (tensor.view(int_dtype), ctr, numel, ncols)
    kw: dict = dict(BLOCK=block, ITERS=iters, MASK=mask, GUARD=guard, num_warps=num_warps)
    if guard:
        # Within the twin's registers (tripwire.triton._budget): the fault path, out of line, spills on its own
        # path rather than cost the hot loop programs per SM. The key is the compiled variant: Triton
        # specialises the data's 16-byte alignment, numel's type and divisibility and ncols' type.
        key = (tensor.dtype, block, iters, num_warps, tensor.device, tensor.data_ptr() % 16 == 0, numel % 16 == 0,
               numel == 1, numel < 2**31, ncols < 2**31)  # fmt: skip
        cap = register_cap(key, _nonfinite_kernel, grid, args, kw, {"GUARD": False})
        if cap is not None:
            kw["maxnreg"] = cap
    _nonfinite_kernel[grid](*args, **kw)


def _fmt(v: int | None) -> str:
    return "-" if v is None else str(v)


def nonfinite_wording(site: Site, device: str, hit: Hit, *, delta: int | None = None) -> Wording:
    """The words of a non-finite row's report: the count and the first element on the first line."""
    fatal = " (FATAL site)" if site.fatal else ""
    new = f"{delta} new, {hit.count} total" if delta is not None else f"{hit.count} total"
    line = short_name(
        lambda s: (
            f"NON-FINITE values at site {s} on {device}{fatal}: {new} NaN/Inf elements. First: row "
            f"{_fmt(hit.first_row)}, column {_fmt(hit.first_value)}."
        ),
        site.name,
    )
    detail = f"Lifetime extremes: max row {_fmt(hit.max_row)}, columns {_fmt(hit.min_value)}..{_fmt(hit.max_value)}."
    desc = f"[{site.description}] " if site.description else ""
    explanation = (
        f"{desc}The values were counted, not changed: whatever consumed them computed with NaN/Inf. The first element "
        f"is one real element; the extremes are independent, not one element."
    )
    return Wording(line, detail, explanation)


def nonfinite_message(site: Site, device: str, hit: Hit, *, delta: int | None = None) -> str:
    """The whole report of a non-finite row as one string."""
    return str(nonfinite_wording(site, device, hit, delta=delta))


class NonFiniteReporter(GuardReporter):
    """Reporter for ``"nonfinite"`` rows (guard layout): the guard reporter's aggregation and arming rules (``raise``
    mode or a fatal site arms), with wording about NaN/Inf instead of masked accesses."""

    wording = staticmethod(nonfinite_wording)


# Replaces the generic guard reporter for this kind (same arming rules, wording about NaN/Inf, not masked accesses).
register_reporter("nonfinite", NonFiniteReporter)
