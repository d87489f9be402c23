"""Kernels for the out-of-line functions' shared-memory test (tests/triton/test_callee_smem.py): a dot whose operands sit
in shared memory across a call of ``record_hit``'s out-of-line fault path, and the control, the same kernel whose
call is a noinline function using Triton's own compare-and-swap (its result goes to the other threads through
shared memory). Before Triton 3.9 a callee's shared memory starts at the kernel's offset 0, over the operands."""

from __future__ import annotations

import triton
import triton.language as tl

from tripwire.triton import record_hit


@triton.jit(noinline=True)
def _cas_callee(ctr_ptr, v):
    old = tl.atomic_cas(ctr_ptr + 4, v * 0, v)
    if old == 0:
        tl.atomic_add(ctr_ptr, 1)


@triton.jit
def dot_across_a_record(a_ptr, b_ptr, out_ptr, ctr_ptr, flag_ptr, n, CONTROL: tl.constexpr):
    """``out = n * (a @ b)`` for ``[16, 16]`` float16 ``a`` and ``b``; a hit is recorded first when ``flag != 0``."""
    offs = tl.arange(0, 16)
    tile = offs[:, None] * 16 + offs[None, :]
    a = tl.load(a_ptr + tile)
    b = tl.load(b_ptr + tile)
    acc = tl.zeros([16, 16], dtype=tl.float32)
    f = tl.load(flag_ptr)
    if f != 0:
        if CONTROL:
            _cas_callee(ctr_ptr, f.to(tl.int64))
        else:
            record_hit(ctr_ptr, f, f)
    for _ in range(0, n):
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + tile, acc)
