"""Small guarded kernels shared by the core GPU tests (not a test module)."""

from __future__ import annotations

import triton
import triton.language as tl

from tripwire.triton import guard_index


@triton.jit
def guarded_gather(ctr, idx_ptr, src_ptr, out_ptr, n, size, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    idx = tl.load(idx_ptr + offs, mask=m, other=0)
    safe, ok = guard_index(idx, 0, size, ctr, offs, mask=m)
    v = tl.load(src_ptr + safe, mask=ok, other=0.0)
    tl.store(out_ptr + offs, v, mask=m)


def launch_gather(ctr, idx, src, out, block=128):
    n = idx.numel()
    guarded_gather[(triton.cdiv(n, block),)](ctr, idx, src, out, n, src.numel(), BLOCK=block)
