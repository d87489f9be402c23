"""The non-finite counter's read over launch shapes and layouts, against a device-to-device copy.

The question it answers: whether a shape of the sweep in ``lab.numerics`` that reads short of its
target is the counter's doing or the shape's. Each of the sweep's seven shapes (elements per load step x steps per
program x warps) is timed as the shipped counter (guarded), its twin (the same loads and vote, nothing recorded), and
the twin's read in four other layouts, each compiled from this file's kernel:

* ``step``: the shipped layout (``ITERS`` loads of ``BLOCK`` elements each, unrolled), compiled here: the control
  that this file's kernel reads as the shipped twin does;
* ``tile``: each program's ``ITERS x BLOCK`` elements as one ``[ITERS, BLOCK]`` load (16-byte loads per thread
  whatever ``BLOCK``);
* ``cg``: the step layout with ``.cg`` loads (L2 only, no L1 allocation);
* ``persistent``: as many programs as are resident, each looping over spans.

Every layout is checked first: on clean data nothing is flagged, and a NaN in the first and in the last element is
flagged in each program that holds one (``check``, which the CPU tests run under the Triton interpreter). Timings are
as in lab.numerics: CUDA-graph replays of 10 calls, do_bench medians, alternated over 5 rounds.

Run ``python benchmarks/sweep_nonfinite.py [ROWS ...]`` on a GPU (default 256 and 1024 rows of 152064 bf16: 78 and
311 MB); it prints one line per shape, each column a read's bandwidth over the copy's.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from lab.numerics import SWEEP_SHAPES
from tripwire.numerics import nonfinite as nf

# The sweep's shapes: (elements per load step, steps per program, warps).
SHAPES = list(SWEEP_SHAPES)
# name -> (TILE, PERSISTENT, CG)
LAYOUTS = {"step": (False, False, False), "tile": (True, False, False), "cg": (False, False, True),
           "persistent": (False, True, False)}  # fmt: skip
_BF16_EXP = 0x7F80  # a bf16 element is NaN or Inf when these bits are all set (tripwire.numerics.nonfinite._BITS)


@triton.jit
def _load(ptr, offs, m, CG: tl.constexpr):
    if CG:
        return tl.load(ptr + offs, mask=m, other=0, cache_modifier=".cg")
    return tl.load(ptr + offs, mask=m, other=0)


@triton.jit
def _span_vote(x_ptr, base, seen, lanes, rel, numel, BLOCK: tl.constexpr, ITERS: tl.constexpr, MASK: tl.constexpr,
               TILE: tl.constexpr, CG: tl.constexpr):  # fmt: skip
    """``seen`` OR-ed with the non-finite test of the span of ``BLOCK * ITERS`` elements from ``base``."""
    if TILE:
        offs = base + rel
        m = offs < numel
        x = _load(x_ptr, offs, m, CG)
        seen |= (((x & MASK) == MASK) & m).to(tl.int32)
    else:
        for i in tl.static_range(ITERS):
            offs = base + i * BLOCK + lanes
            m = offs < numel
            x = _load(x_ptr, offs, m, CG)
            seen |= (((x & MASK) == MASK) & m).to(tl.int32)
    return seen


@triton.jit
def _read_vote(x_ptr, ctr_ptr, numel, BLOCK: tl.constexpr, ITERS: tl.constexpr, MASK: tl.constexpr,
               TILE: tl.constexpr, PERSISTENT: tl.constexpr, CG: tl.constexpr):  # fmt: skip
    """The twin's read and vote in one of the layouts above: one atomic per program that saw a non-finite element
    (persistent: in any of its spans). Something must use the vote, or the compiler drops the loads with it."""
    SPAN: tl.constexpr = BLOCK * ITERS
    lanes = tl.arange(0, BLOCK)
    if TILE:
        rel = tl.arange(0, ITERS)[:, None] * BLOCK + lanes[None, :]
        seen = tl.zeros([ITERS, BLOCK], tl.int32)
    else:
        rel = lanes
        seen = tl.zeros([BLOCK], tl.int32)
    if PERSISTENT:
        for s in tl.range(tl.program_id(0), tl.cdiv(numel, SPAN), tl.num_programs(0)):
            seen = _span_vote(x_ptr, tl.cast(s, tl.int64) * SPAN, seen, lanes, rel, numel, BLOCK, ITERS, MASK, TILE, CG)
    else:  # straight-line, as the shipped kernel: one span, no loop
        base = tl.program_id(0).to(tl.int64) * SPAN
        seen = _span_vote(x_ptr, base, seen, lanes, rel, numel, BLOCK, ITERS, MASK, TILE, CG)
    if tl.max(seen, axis=None) > 0:
        tl.atomic_add(ctr_ptr, 1)


def resident_programs(device: torch.device, num_warps: int) -> int:
    """Programs of ``num_warps`` warps resident at once on ``device`` when threads alone bound them (2048 per SM on
    sm_90); on the CPU (the interpreter) 4, so that a persistent grid loops there too."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count * (2048 // (32 * num_warps))


def launcher(x: torch.Tensor, ctr: torch.Tensor, shape: tuple[int, int, int], layout: str) -> Callable[[], None]:
    """One launch of the read-and-vote over bf16 ``x`` at ``shape`` in ``layout``, adding 1 to ``ctr[0]`` per
    program that saw a non-finite element."""
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous bfloat16 tensor, got {x.dtype}, contiguous={x.is_contiguous()}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    block, iters, warps = shape
    tile, persistent, cg = LAYOUTS[layout]
    xi, numel = x.view(torch.int16), x.numel()
    spans = triton.cdiv(numel, block * iters)
    grid = (min(spans, resident_programs(x.device, warps)),) if persistent else (spans,)

    def go() -> None:
        _read_vote[grid](xi, ctr, numel, BLOCK=block, ITERS=iters, MASK=_BF16_EXP, TILE=tile, PERSISTENT=persistent,
                         CG=cg, num_warps=warps)  # fmt: skip

    return go


def check(x: torch.Tensor, shapes: list[tuple[int, int, int]] = SHAPES) -> None:
    """Every layout at every shape flags nothing on ``x`` (finite) and, with a NaN in its first and its last element,
    exactly the programs that hold them: 2 when they fall in different spans (1 persistent when one program's loop
    holds both). Raises AssertionError naming the layout and shape otherwise."""
    ctr = torch.zeros(8, dtype=torch.int64, device=x.device)
    bad = x.clone()
    bad.view(-1)[[0, bad.numel() - 1]] = float("nan")
    for shape in shapes:
        span = shape[0] * shape[1]
        spans = triton.cdiv(x.numel(), span)
        for layout in LAYOUTS:
            ctr.zero_()
            launcher(x, ctr, shape, layout)()
            assert int(ctr[0]) == 0, (layout, shape, "flagged clean data", int(ctr[0]))
            launcher(bad, ctr, shape, layout)()
            if spans == 1:
                want = 1
            elif LAYOUTS[layout][1]:  # persistent: program p holds spans p, p + grid, ...
                grid = min(spans, resident_programs(x.device, shape[2]))
                want = 1 if (spans - 1) % grid == 0 else 2
            else:
                want = 2
            assert int(ctr[0]) == want, (layout, shape, int(ctr[0]), want)


def measure(rows: int) -> None:
    """Time every shape and layout over ``[rows, 152064]`` bf16 and print the table."""
    from lab.numerics import _time

    x = torch.randn((rows, 152064), device="cuda").to(torch.bfloat16)
    check(x)
    dst = torch.empty_like(x)
    ctr = torch.zeros(8, dtype=torch.int64, device="cuda")
    fns: dict[str, Callable[[], object]] = {"copy": functools.partial(dst.copy_, x)}
    for shape in SHAPES:
        b, it, w = shape
        fns[f"guarded_{shape}"] = functools.partial(nf._launch, x, ctr, b, w, it)
        fns[f"twin_{shape}"] = functools.partial(nf._launch, x, ctr, b, w, it, guard=False)
        for layout in LAYOUTS:
            fns[f"{layout}_{shape}"] = launcher(x, ctr, shape, layout)
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    t = _time(fns, 5, 100, 10)
    nbytes = x.numel() * x.element_size()
    copy_gbps = 2 * nbytes / (t["copy"] * 1e-3) / 1e9  # a copy reads and writes
    names = ["guarded", "twin", *LAYOUTS]

    def ratio(name: str, shape: tuple[int, int, int]) -> float:
        return nbytes / (t[f"{name}_{shape}"] * 1e-3) / 1e9 / copy_gbps

    print(f"== [{rows}, 152064] bf16, {nbytes / 1e6:.0f} MB: copy {t['copy'] * 1e3:.1f} us, {copy_gbps:.0f} GB/s")
    print("shape      " + " ".join(f"{n:>10}" for n in names))
    for shape in SHAPES:
        print(f"{shape[0]}x{shape[1]}/w{shape[2]}".ljust(11) + " ".join(f"{ratio(n, shape):10.3f}" for n in names))
    best = min(max(ratio(n, shape) for n in names) for shape in SHAPES)
    print(f"the best layout at each shape, at the slowest shape: {best:.3f}", flush=True)


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (the layouts are timed compiled)", file=sys.stderr)
        return 2
    for rows in map(int, argv or ["256", "1024"]):
        measure(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
