"""Request rows: the guard of an engine's batch-row -> request-state-row map, and the fence after the metadata
kernels that read through it.

Engines keep per-request state in rows of persistent tensors (block table, block counts, token counts, sampling
parameters) and build, each step, a map from the step's batch rows to those state rows: vLLM V2's ``idx_mapping``,
SGLang's ``req_pool_indices``. ``rows[b]`` is the state row of batch row ``b``, and everything after it indexes
through it: the block-table gather and the slot mapping (``block_table[rows[b]]``), the sampler's per-request
parameters, and the state update that WRITES the row (its token count, last token, history). An out-of-range entry
is an illegal access in each of them; masked to some other live row, it would make the victim's KV writes and its
sampled token land in that row's request. So a bad entry is masked to a SCRATCH row: one no live request holds this
step (the engine's free list), where the victim's writes harm nobody. Where every row is live (a full batch), no row
is harmless: the entry is masked to a row of this step (``scratch_free=False``) and the hit carries no request, so a
same-step verdict fails every request of the step (fail closed) and no request outside it is touched.

* :func:`guard_rows` (before the metadata kernels): counts each bad entry at the caller's site (row ``b``, value
  the entry, request ``requests[b]``), masks it to the scratch row and flags ``b``.
* :func:`fence_rows` (after them, per KV-cache group): for a flagged row, the gathered table row is zeroed (block 0:
  vLLM's null block, which no request owns) and its tokens' slots set to PAD (``-1``: no KV write), since both were
  computed from the scratch row's table; for every other row, the row's used block count is gathered from
  ``num_blocks`` (validated by the caller) into batch order, for a validator of the gathered tables.

The site is the caller's: the launchers count at the counter row ``ctr`` they are given (an engine adapter's, such
as ``vllm.idx_mapping``), so this module registers none. Each launcher is one launch, no sync, no allocation: they
run on an engine's step path, once per step and once per KV-cache group. ``mask=False`` rewrites nothing (diagnosis
only: the bad access still happens downstream) and a flagged row's count is 0 (its ``num_blocks`` entry is not read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layout import SLOTS
from ..triton import record_hits
from ._common import INDEX_DTYPES, check_ctr, check_int_arg, check_same_device, check_tensor
from ._common import INT64_MAX as _INT64_MAX

__all__ = ["fence_rows", "guard_rows"]

_BLOCK = 128


# The step's sizes and the scratch row change from step to step: not specialised on (Triton would compile a variant
# for a value of 1 or a multiple of 16, in the middle of serving).
@triton.jit(do_not_specialize=["n", "scratch", "attributed"])
def _guard_rows(idx_ptr, flags_ptr, req_ptr, ctr_ptr, total_ptr, n, bound, scratch, attributed,
                MASK: tl.constexpr, HAS_TOTAL: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # One program: a step has at most the engine's max_num_reqs rows (hundreds), one vote per block of them.
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
                        # The free scratch row's token count is its last owner's: the state update appends the
                        # victim's token at that offset of the row's history, which past the row's end is the next
                        # row's.
                        tl.store(total_ptr + scratch, 0)


@triton.jit
def _fence_rows(flags_ptr, idx_ptr, qsl_ptr, nb_ptr, counts_ptr, table_ptr, width, slots_ptr,
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


# The launchers' step-path checks. An engine calls them every step on its persistent buffers, so a call is first
# tested by one expression of attribute reads (exact types, dtypes, ranks, contiguity, sizes, one CUDA device):
# whatever it passes, the named checks below pass too. Only a call it refuses (a CPU tensor under the interpreter, a
# [1, 8] counter row, a subclass such as a FakeTensor, or a real error) pays for the named checks, which raise the
# error naming the argument or let the call through.
_T = torch.Tensor
_I32, _I64 = torch.int32, torch.int64


def _vec(t: torch.Tensor, dev: torch.device) -> bool:
    """An index vector of ``dev``: exactly a Tensor, int32 or int64, 1-D, contiguous."""
    return (type(t) is _T and (t.dtype is _I32 or t.dtype is _I64) and t.dim() == 1
            and t.is_contiguous() and t.device == dev)  # fmt: skip


def _i32(t: torch.Tensor, dev: torch.device, ndim: int = 1) -> bool:
    return (type(t) is _T and t.dtype is _I32 and t.dim() == ndim and t.is_contiguous()
            and t.device == dev)  # fmt: skip


def _guard_ok(rows: torch.Tensor, flags: torch.Tensor, requests: torch.Tensor, ctr: torch.Tensor, bound: int,
              scratch: int, total_len: torch.Tensor | None) -> bool:  # fmt: skip
    if type(rows) is not _T or rows.dim() != 1 or type(bound) is not int or type(scratch) is not int:
        return False  # (a rank other than 1 before rows.shape[0] is read: the named check refuses it)
    dev = rows.device
    n = rows.shape[0]
    return (dev.type == "cuda" and _vec(rows, dev) and _i32(flags, dev) and _vec(requests, dev)
            and 0 <= scratch < bound <= _INT64_MAX and flags.shape[0] >= n and requests.shape[0] >= n
            and type(ctr) is _T and ctr.dtype is _I64 and ctr.shape == (SLOTS,) and ctr.is_contiguous()
            and ctr.device == dev
            and (total_len is None or (_vec(total_len, dev) and total_len.shape[0] >= bound)))  # fmt: skip


def _fence_ok(flags: torch.Tensor, rows: torch.Tensor, qsl: torch.Tensor, num_blocks: torch.Tensor,
              counts: torch.Tensor, table: torch.Tensor, slots: torch.Tensor) -> bool:  # fmt: skip
    if type(rows) is not _T or rows.dim() != 1:
        return False
    dev = rows.device
    n = rows.shape[0]
    return (dev.type == "cuda" and _vec(rows, dev) and _i32(flags, dev) and _vec(qsl, dev) and _vec(num_blocks, dev)
            and _i32(counts, dev) and _i32(table, dev, 2) and type(slots) is _T and slots.dtype is _I64
            and slots.dim() == 1 and slots.is_contiguous() and slots.device == dev
            and flags.shape[0] >= n and qsl.shape[0] >= n + 1 and counts.shape[0] >= n
            and table.shape[0] >= n)  # fmt: skip


def _at_least(name: str, t: torch.Tensor, n: int, what: str) -> None:
    if t.shape[0] < n:
        raise ValueError(f"{name} has {t.shape[0]} entries, fewer than the {n} {what}")


def guard_rows(
    rows: torch.Tensor,
    flags: torch.Tensor,
    requests: torch.Tensor,
    ctr: torch.Tensor,
    num_state_rows: int,
    scratch: int,
    *,
    scratch_free: bool = True,
    mask: bool = True,
    total_len: torch.Tensor | None = None,
) -> None:
    """Check the step's map ``rows`` against the state rows ``[0, num_state_rows)``; count, flag and mask each bad
    entry (see the module docstring).

    Args:
        rows: int32/int64 ``[n]``, the state row of each batch row (``idx_mapping[:num_reqs]``,
            ``req_pool_indices``); under ``mask`` a bad entry is rewritten to ``scratch`` in place.
        flags: int32, at least ``n`` entries: ``flags[b]`` written 1 for a bad entry, else 0 (:func:`fence_rows`
            reads it).
        requests: int32/int64, at least ``n`` entries: the request id of each batch row, kept with its offender
            when ``scratch_free`` (read on the fault path only).
        ctr: int64 ``[8]``, the counter row of the caller's site (``Monitor.counter(site, device)``).
        num_state_rows: the state rows' count (the bound), a host int > 0.
        scratch: the state row a bad entry is masked to, in ``[0, num_state_rows)``.
        scratch_free: True when no live request holds ``scratch`` this step: the hits name their batch rows'
            requests and ``total_len[scratch]`` is zeroed. False (every row live, ``scratch`` a row of this step):
            the hits name no request, so a verdict fails the whole step, and ``total_len`` is left alone.
        mask: False counts and flags only (rewrites nothing).
        total_len: int32/int64, at least ``num_state_rows`` entries, or None: the per-state-row token count at
            which the engine's state update appends the row's next token (vLLM V2's ``req_states.total_len``).

    One program, no sync, no allocation.
    """
    if not _guard_ok(rows, flags, requests, ctr, num_state_rows, scratch, total_len):
        _check_guard(rows, flags, requests, ctr, num_state_rows, scratch, total_len)
    n = rows.shape[0]
    if n == 0:
        return
    total = flags if total_len is None else total_len  # HAS_TOTAL False: never read
    _guard_rows[(1,)](rows, flags, requests, ctr, total, n, num_state_rows, scratch, int(scratch_free),
                      MASK=bool(mask), HAS_TOTAL=total_len is not None, BLOCK=_BLOCK)  # fmt: skip


def _check_guard(rows: torch.Tensor, flags: torch.Tensor, requests: torch.Tensor, ctr: torch.Tensor,
                 num_state_rows: int, scratch: int, total_len: torch.Tensor | None) -> None:  # fmt: skip
    """:func:`guard_rows`' preconditions, each refused naming the argument."""
    check_tensor("rows", rows, dtypes=INDEX_DTYPES, ndim=1)
    n = rows.shape[0]
    check_tensor("flags", flags, dtypes=(torch.int32,), ndim=1)
    check_tensor("requests", requests, dtypes=INDEX_DTYPES, ndim=1)
    bound = check_int_arg("num_state_rows", num_state_rows, lo=1)
    check_int_arg("scratch", scratch)
    if scratch >= bound:
        raise ValueError(f"scratch row {scratch} is not one of the {bound} state rows")
    _at_least("flags", flags, n, "batch rows")
    _at_least("requests", requests, n, "batch rows")
    named = {"rows": rows, "flags": flags, "requests": requests}
    if total_len is not None:
        check_tensor("total_len", total_len, dtypes=INDEX_DTYPES, ndim=1)
        _at_least("total_len", total_len, bound, "state rows")
        named["total_len"] = total_len
    dev = check_same_device(**named)
    check_ctr("ctr", ctr, dev)


def fence_rows(
    flags: torch.Tensor,
    rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_blocks: torch.Tensor,
    counts: torch.Tensor,
    table: torch.Tensor,
    slots: torch.Tensor,
    *,
    mask: bool = True,
) -> None:
    """After the metadata kernels, for one KV-cache group: fence the rows :func:`guard_rows` flagged and gather
    every other row's used block count (see the module docstring). One program per batch row.

    Args:
        flags: int32, at least ``n`` entries, as :func:`guard_rows` left them.
        rows: int32/int64 ``[n]``, the map as :func:`guard_rows` left it: every unflagged entry a state row of
            ``num_blocks``.
        query_start_loc: int32/int64, at least ``n + 1`` entries: batch row ``b``'s tokens are ``[qsl[b],
            qsl[b + 1])`` (validated by the caller).
        num_blocks: int32/int64, the group's used block count of each state row (validated by the caller).
        counts: int32, at least ``n`` entries: ``counts[b]`` written, the batch row's count (0 when flagged).
        table: int32 ``[>= n, width]``, contiguous: the group's table gathered into batch order; a flagged row
            zeroed under ``mask``.
        slots: int64, covering every token of the ``n`` rows: the group's slot mapping; a flagged row's tokens set
            to -1 under ``mask``.
        mask: False rewrites nothing (the counts are written all the same).
    """
    if not _fence_ok(flags, rows, query_start_loc, num_blocks, counts, table, slots):
        _check_fence(flags, rows, query_start_loc, num_blocks, counts, table, slots)
    n = rows.shape[0]
    if n == 0:
        return
    _fence_rows[(n,)](flags, rows, query_start_loc, num_blocks, counts, table, table.shape[1], slots,
                      MASK=bool(mask), BLOCK=_BLOCK)  # fmt: skip


def _check_fence(flags: torch.Tensor, rows: torch.Tensor, query_start_loc: torch.Tensor, num_blocks: torch.Tensor,
                 counts: torch.Tensor, table: torch.Tensor, slots: torch.Tensor) -> None:  # fmt: skip
    """:func:`fence_rows`' preconditions, each refused naming the argument."""
    check_tensor("rows", rows, dtypes=INDEX_DTYPES, ndim=1)
    n = rows.shape[0]
    check_tensor("flags", flags, dtypes=(torch.int32,), ndim=1)
    check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, ndim=1)
    check_tensor("num_blocks", num_blocks, dtypes=INDEX_DTYPES, ndim=1)
    check_tensor("counts", counts, dtypes=(torch.int32,), ndim=1)
    check_tensor("table", table, dtypes=(torch.int32,), ndim=2)
    check_tensor("slots", slots, dtypes=(torch.int64,), ndim=1)
    _at_least("flags", flags, n, "batch rows")
    _at_least("query_start_loc", query_start_loc, n + 1, "batch rows' bounds")
    _at_least("counts", counts, n, "batch rows")
    _at_least("table", table, n, "batch rows")
    check_same_device(rows=rows, flags=flags, query_start_loc=query_start_loc, num_blocks=num_blocks, counts=counts,
                      table=table, slots=slots)  # fmt: skip
