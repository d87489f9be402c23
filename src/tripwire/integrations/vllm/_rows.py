"""The guard of vLLM V2's batch-row -> request-state-row map (``idx_mapping``), in two kernels around V2's own
``prepare_attn`` (:mod:`tripwire.integrations.vllm._v2`).

``idx_mapping[b]`` is the request-state row of batch row ``b``. Everything after it indexes through it: V2's block
table gather and slot-mapping kernels (``block_table[row]``, ``num_blocks[row]``), the sampler (per-request
temperature, seeds, penalties) and ``post_update`` (which WRITES the row's computed-token count, last sampled token,
token history and penalty counts). An out-of-range entry is an illegal access in each of them; masked to some other
row, it would make the victim's KV writes and its sampled token land in that row's request. So a bad entry is masked
to a SCRATCH row: one no live request holds this step (V2's free list), where the victim's writes harm nobody. Where
every row is live (a full batch), no row is harmless: the entry is masked to a row of this step and the hit carries
no request, so the verdict fails every request of the step (fail closed) and no request outside it is touched.

* :func:`rows` (before ``prepare_attn``): counts each bad entry at its site (row ``b``, value the entry, the batch
  row's request), masks it to the scratch row and flags ``b``.
* :func:`fence` (after ``prepare_attn``, per KV-cache group): for a flagged row, the gathered table row is zeroed
  (vLLM's null block) and its tokens' slots set to PAD (no KV write), since both were computed from the scratch
  row's table; for every other row, the row's used block count is gathered from the (validated) ``num_blocks`` for
  the outputs' validator.

Both are one launch, no sync, no allocation. Under ``flag`` nothing is rewritten (diagnosis only) and a flagged
row's count is 0 (its ``num_blocks`` entry is not read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernels._common import check_tensor
from ...triton import record_hits

__all__ = ["fence", "rows"]

_BLOCK = 128


# The step's sizes and the scratch row change from step to step: not specialised on (Triton would compile a variant
# for a value of 1 or a multiple of 16, in the middle of serving).
@triton.jit(do_not_specialize=["n", "scratch", "attributed"])
def _rows_kernel(idx_ptr, flags_ptr, req_ptr, ctr_ptr, total_ptr, n, bound, scratch, attributed,
                 MASK: tl.constexpr, HAS_TOTAL: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # One program: a step has at most max_num_reqs rows (hundreds), one vote per block of them.
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        m = offs < n
        r = tl.load(idx_ptr + offs, mask=m, other=0)
        bad = m & ((r < 0) | (r >= bound))
        tl.store(flags_ptr + offs, bad.to(tl.int32), mask=m)
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            # The fault path: the batch row's request (none when no scratch row is free: fail closed).
            q = tl.load(req_ptr + offs, mask=m, other=-1)
            q = tl.where(attributed != 0, q, -1)
            record_hits(ctr_ptr, bad, offs, r, q)
            if MASK:
                tl.store(idx_ptr + offs, (r * 0 + scratch).to(r.dtype), mask=bad)
                if HAS_TOTAL:
                    if attributed != 0:
                        # The free scratch row's token count is its last owner's: post_update appends the victim's
                        # token at that offset of the row's history, which past the row's end is the next row's.
                        tl.store(total_ptr + scratch, 0)


@triton.jit
def _fence_kernel(flags_ptr, idx_ptr, qsl_ptr, nb_ptr, counts_ptr, table_ptr, width, slots_ptr,
                  MASK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    if tl.load(flags_ptr + b) != 0:
        if MASK:
            row = table_ptr + b.to(tl.int64) * width
            for c in range(0, width, BLOCK):
                o = c + tl.arange(0, BLOCK)
                tl.store(row + o, tl.zeros([BLOCK], tl.int32), mask=o < width)
            lo = tl.load(qsl_ptr + b)
            hi = tl.load(qsl_ptr + b + 1)
            for t in range(lo, hi, BLOCK):
                o = t + tl.arange(0, BLOCK)
                tl.store(slots_ptr + o, tl.full([BLOCK], -1, tl.int64), mask=o < hi)
        tl.store(counts_ptr + b, 0)
    else:
        r = tl.load(idx_ptr + b).to(tl.int64)
        tl.store(counts_ptr + b, tl.load(nb_ptr + r))


def rows(
    idx: torch.Tensor,
    flags: torch.Tensor,
    req: torch.Tensor,
    ctr: torch.Tensor,
    bound: int,
    scratch: int,
    attributed: bool,
    *,
    mask: bool,
    total_len: torch.Tensor | None = None,
) -> None:
    """Check ``idx`` (``idx_mapping[:num_reqs]``, int32 or int64) against ``[0, bound)``: count each bad entry at
    ``ctr`` (the site's arena row) with ``req[b]`` (int64) as its request when ``attributed``, write ``flags[b]``
    (int32, at least as long as ``idx``) and, under ``mask``, rewrite the bad entries to ``scratch`` (in range) and,
    when ``attributed`` (the scratch row is free), zero ``total_len[scratch]`` (V2's per-row token count, which
    ``post_update`` appends the row's next token at)."""
    n = idx.shape[0]
    if n == 0:
        return
    if flags.shape[0] < n or req.shape[0] < n or not 0 <= scratch < bound:
        raise ValueError(
            f"tripwire: vLLM V2 row guard: {n} rows, flags of {flags.shape[0]}, requests of {req.shape[0]}, "
            f"scratch row {scratch} of {bound}"
        )
    total = flags if total_len is None else total_len  # HAS_TOTAL False: never read
    _rows_kernel[(1,)](idx, flags, req, ctr, total, n, bound, scratch, int(attributed), MASK=mask,
                       HAS_TOTAL=total_len is not None, BLOCK=_BLOCK)  # fmt: skip


def fence(
    flags: torch.Tensor,
    idx: torch.Tensor,
    qsl: torch.Tensor,
    num_blocks: torch.Tensor,
    counts: torch.Tensor,
    table: torch.Tensor,
    slots: torch.Tensor,
    *,
    mask: bool,
) -> None:
    """After ``prepare_attn``, for one KV-cache group (see the module docstring): ``flags``/``idx``/``qsl`` as
    :func:`rows` left them (``idx`` and ``qsl`` validated), ``num_blocks`` the group's per-state-row counts
    (validated), ``counts`` the batch-order counts written here, ``table`` the gathered ``[rows, width]`` int32 table
    (contiguous), ``slots`` the group's int64 slot mapping."""
    n = idx.shape[0]
    if n == 0:
        return
    if table.dim() != 2 or not table.is_contiguous() or table.shape[0] < n or counts.shape[0] < n:
        raise ValueError(
            f"tripwire: vLLM V2 fence: a gathered table {tuple(table.shape)} (contiguous: {table.is_contiguous()}) "
            f"and counts of {counts.shape[0]} for {n} rows"
        )
    _fence_kernel[(n,)](flags, idx, qsl, num_blocks, counts, table, table.shape[1], slots, MASK=mask, BLOCK=_BLOCK)


def check_buffers(device: torch.device, **tensors: tuple[torch.Tensor, torch.dtype]) -> None:
    """Build-time checks of the persistent buffers :func:`rows` and :func:`fence` are given every step, the
    engine's among them (their per-step checks read sizes only): each 1-D, contiguous, of its dtype, on ``device``.
    The first that is not is refused naming it (an engine that lays them out otherwise)."""
    for name, (t, dtype) in tensors.items():
        check_tensor(name, t, dtypes=(dtype,), ndim=1)
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, not on {device}")
