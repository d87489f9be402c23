"""The metadata validator's kernel: every rule of one :class:`tripwire.validate.Validator` call in ONE launch.

A rule is a tuple slot of the kernel: its tensors and sizes are the ``i``-th elements of tuple arguments, its kind,
flags, bounds and counter rows the ``i``-th elements of constexpr tuples, and ``tl.static_range`` unrolls one branch
per rule. The grid is the rules' programs laid end to end: rule ``i`` owns ``cdiv(N[i], BLOCK)`` programs for its
entries plus, when it owns its auxiliary tensor (a lengths or an indptr), one more program that checks that tensor.
Every entry is read by exactly one program, so a bad entry counts exactly once per call.

Kinds:
* ``INDEX``: a 1-D or 2-D tensor (flattened row-major, ``W`` columns; 1-D has ``W == 1``). An entry is bad when it is
  not the padding value and not in ``[LO, HI)``. With lengths, only the first ``lengths[row]`` entries of a row are
  checked (clamped into ``[0, W]``: the owner program counts a length outside it).
* ``CSR``: 1-D indices with an indptr. Only the used entries are checked: ``[0, E)`` where ``E`` is the largest
  in-range indptr value (``0 <= indptr[k] <= len(indices)``, ``k >= 1``), which is the end of the last row once the
  indptr is repaired. The owner program checks the indptr itself (see :func:`_indptr_check`).

Races inside the launch are harmless by construction: the programs that read an auxiliary tensor derive the same
effective value from its original and its repaired entries (lengths are clamped on read; ``E`` is the same before and
after the indptr repair), so it does not matter which of the two they see.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from .. import triton as tw_triton
from ._rules import ABLOCK, BLOCK, Rules
from ._triton_fault import _entries_fault, _indptr_bad, _indptr_fault, _lengths_fault


@triton.jit
def _check(
    ctr_ptr,
    t_ptr,
    a_ptr,
    m,
    v,
    start,
    end,
    w,
    rq_ptr,
    rqn,
    sg_ptr,
    sgn,
    KIND: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_LEN: tl.constexpr,
    REQ: tl.constexpr,
    LO: tl.constexpr,
    HI: tl.constexpr,
    PAD: tl.constexpr,
    SAFE: tl.constexpr,
    MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    FAULT: tl.constexpr,
    CALLS: tl.constexpr,
):
    """The bounds rule over one block of entries ``v`` (live lanes ``m``): an entry outside ``[LO, HI)`` that is not
    the padding value is bad. One vote; a block with a bad entry is counted (against the row of each entry, for
    offenders and requests) and with ``MASK`` each bad entry overwritten in place with ``SAFE``, out of line
    (:func:`_entries_fault`, which reads the block again). A clean block stores nothing."""
    bad = m & ((v < LO) | (v >= HI))
    if HAS_PAD:
        bad = bad & (v != PAD)
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        if FAULT:
            _entries_fault(
                ctr_ptr, t_ptr, a_ptr, rq_ptr, sg_ptr, start, end, w, rqn, sgn, KIND, HAS_PAD, HAS_LEN, REQ, LO, HI,
                PAD, SAFE, MASK, BLOCK, CALLS,
            )  # fmt: skip
        else:
            tl.atomic_add(ctr_ptr, 1)  # the twin (see _validate's FAULT)


@triton.jit
def _index_block(
    ctr_ptr,
    t_ptr,
    a_ptr,
    blk,
    n,
    w,
    lo,
    hi,
    pad,
    safe,
    rq_ptr,
    rqn,
    sg_ptr,
    sgn,
    HAS_PAD: tl.constexpr,
    HAS_LEN: tl.constexpr,
    REQ: tl.constexpr,
    MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    FAULT: tl.constexpr,
    CALLS: tl.constexpr,
):
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(t_ptr + offs, mask=m, other=0).to(tl.int64)
    row = offs // w
    if HAS_LEN:
        # Clamped on read: a length past the width checks the whole row, a negative one checks nothing.
        ln = tl.load(a_ptr + row, mask=m, other=0).to(tl.int64)
        m = m & ((offs - row * w) < ln)
    _check(
        ctr_ptr, t_ptr, a_ptr, m, v, blk.to(tl.int64) * BLOCK, n, w, rq_ptr, rqn, sg_ptr, sgn, 1, HAS_PAD, HAS_LEN, REQ,
        lo, hi, pad, safe, MASK, BLOCK, FAULT, CALLS,
    )  # fmt: skip


@triton.jit
def _csr_used_end(a_ptr, an, ni, ABLOCK: tl.constexpr):
    """``E``: the largest in-range indptr entry past the first (0 when there is none)."""
    e = tl.zeros([ABLOCK], tl.int64)
    for s in range(0, an, ABLOCK):
        k = s + tl.arange(0, ABLOCK).to(tl.int64)
        v = tl.load(a_ptr + k, mask=k < an, other=0).to(tl.int64)
        ok = (k >= 1) & (k < an) & (v >= 0) & (v <= ni)
        e = tl.maximum(e, tl.where(ok, v, 0))
    return tl.max(e, axis=0)


@triton.jit
def _csr_block(
    ctr_ptr,
    t_ptr,
    a_ptr,
    blk,
    n,
    an,
    lo,
    hi,
    pad,
    safe,
    rq_ptr,
    rqn,
    HAS_PAD: tl.constexpr,
    REQ: tl.constexpr,
    MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    ABLOCK: tl.constexpr,
    FAULT: tl.constexpr,
    CALLS: tl.constexpr,
):
    used = _csr_used_end(a_ptr, an, n, ABLOCK)
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < used
    v = tl.load(t_ptr + offs, mask=m, other=0).to(tl.int64)
    # A CSR rule's requests are per row of its layout: the segments are its own indptr.
    _check(
        ctr_ptr, t_ptr, a_ptr, m, v, blk.to(tl.int64) * BLOCK, used, 1, rq_ptr, rqn, a_ptr, an, 2, HAS_PAD, False,
        REQ, lo, hi, pad, safe, MASK, BLOCK, FAULT, CALLS,
    )  # fmt: skip


@triton.jit
def _lengths_check(
    ctr_ptr,
    a_ptr,
    an,
    w,
    rq_ptr,
    rqn,
    sg_ptr,
    sgn,
    REQ: tl.constexpr,
    MASK: tl.constexpr,
    ABLOCK: tl.constexpr,
    FAULT: tl.constexpr,
    CALLS: tl.constexpr,
):
    """A per-row count outside ``[0, W]`` is bad (row = the table row, with the table rule's request of that row);
    mask clamps it into the range. One out-of-line call after the loop, for the whole tensor, when a chunk had a
    bad count: nothing of the loop is live across it."""
    nbad = tl.zeros([], tl.int32)
    for s in range(0, an, ABLOCK):
        k = s + tl.arange(0, ABLOCK).to(tl.int64)
        valid = k < an
        ln = tl.load(a_ptr + k, mask=valid, other=0).to(tl.int64)
        nbad += tl.max((valid & ((ln < 0) | (ln > w))).to(tl.int32), axis=0)
    if nbad > 0:  # counted and repaired out of line, from the tensor read again
        if FAULT:
            _lengths_fault(ctr_ptr, a_ptr, rq_ptr, sg_ptr, an, w, rqn, sgn, REQ, MASK, CALLS)
        else:
            tl.atomic_add(ctr_ptr, 1)  # the twin


@triton.jit
def _indptr_check(ctr_ptr, a_ptr, an, ni, MASK: tl.constexpr, ABLOCK: tl.constexpr, FAULT: tl.constexpr,
                  CALLS: tl.constexpr):  # fmt: skip
    """Entry ``k`` of the indptr is bad when ``k == 0`` and it is not 0, or ``k >= 1`` and it is outside
    ``[0, len(indices)]`` or below the last good entry before it. Mask replaces a bad entry by the last good entry
    before it (0 for ``k == 0``): the row that ends there becomes empty and every row stays in range.

    The last good entry before ``k`` equals the exclusive prefix max of the in-range entries (a bad in-range entry is
    below an earlier good one, so it never raises the max), which is a parallel scan: chunks of ``ABLOCK`` carry the
    max of the chunks before them. One out-of-line call after the loop, as :func:`_lengths_check`."""
    carry = tl.zeros([], tl.int64)  # entry 0 counts as 0, whatever it holds (it is repaired to 0)
    nbad = tl.zeros([], tl.int32)
    for s in range(0, an, ABLOCK):
        k = s + tl.arange(0, ABLOCK).to(tl.int64)
        valid = k < an
        # The entry before each lane from this chunk only (the chunks before are in `carry`).
        v, in_range, _, bad = _indptr_bad(a_ptr, k, valid, s, ni, carry)
        carry = tl.maximum(carry, tl.max(tl.where(valid & (k >= 1) & in_range, v, -1), axis=0))
        nbad += tl.max(bad.to(tl.int32), axis=0)
    if nbad > 0:  # counted and repaired out of line, from the tensor read again
        if FAULT:
            _indptr_fault(ctr_ptr, a_ptr, an, ni, MASK, CALLS)
        else:
            tl.atomic_add(ctr_ptr, 1)  # the twin


# The flags ask for no value or alignment specialisation; Triton (3.6, and its native specialiser since) applies
# them to a parameter as a whole and specialises each tuple element with its defaults all the same, so the bound
# launch keys the compiled kernel on what those elements are (_launcher.Launcher.__call__).
@triton.jit(do_not_specialize=["N", "W", "AN", "RQN", "SGN"], do_not_specialize_on_alignment=["T", "A", "RQ", "SG"])
def _validate(
    ctr_ptr,
    T,
    A,
    RQ,
    SG,
    N,
    W,
    AN,
    RQN,
    SGN,
    KIND: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_LEN: tl.constexpr,
    OWN_AUX: tl.constexpr,
    REQ: tl.constexpr,
    LO: tl.constexpr,
    HI: tl.constexpr,
    PAD: tl.constexpr,
    SAFE: tl.constexpr,
    C: tl.constexpr,
    AC: tl.constexpr,
    MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    ABLOCK: tl.constexpr,
    FAULT: tl.constexpr,
    CALLS: tl.constexpr,
):
    # A rule's bounds, values and counter rows are constexprs (fixed when its validator's rules are); only the
    # tensors and their sizes are runtime arguments, which keeps the host-side launch cheap. FAULT=False builds the
    # twin a register cap is found against (_with_cap): the same votes, each bad block or chunk only counted.
    pid = tl.program_id(0)
    beg = 0
    for i in tl.static_range(len(KIND)):
        nb = tl.cdiv(N[i], BLOCK)
        local = pid - beg
        if (local >= 0) & (local < nb):
            if KIND[i] == 1:
                _index_block(
                    ctr_ptr + C[i],
                    T[i],
                    A[i],
                    local,
                    N[i],
                    W[i],
                    LO[i],
                    HI[i],
                    PAD[i],
                    SAFE[i],
                    RQ[i],
                    RQN[i],
                    SG[i],
                    SGN[i],
                    HAS_PAD[i],
                    HAS_LEN[i],
                    REQ[i],
                    MASK,
                    BLOCK,
                    FAULT,
                    CALLS,
                )
            else:
                _csr_block(
                    ctr_ptr + C[i],
                    T[i],
                    A[i],
                    local,
                    N[i],
                    AN[i],
                    LO[i],
                    HI[i],
                    PAD[i],
                    SAFE[i],
                    RQ[i],
                    RQN[i],
                    HAS_PAD[i],
                    REQ[i],
                    MASK,
                    BLOCK,
                    ABLOCK,
                    FAULT,
                    CALLS,
                )
        if OWN_AUX[i]:
            if local == nb:
                if KIND[i] == 1:
                    _lengths_check(
                        ctr_ptr + AC[i], A[i], AN[i], W[i], RQ[i], RQN[i], SG[i], SGN[i], REQ[i], MASK, ABLOCK, FAULT,
                        CALLS,
                    )  # fmt: skip
                else:
                    _indptr_check(ctr_ptr + AC[i], A[i], AN[i], N[i], MASK, ABLOCK, FAULT, CALLS)
        beg += nb + OWN_AUX[i]


def launch(arena: torch.Tensor, rules: Rules, tensors: Sequence[torch.Tensor], *, mask: bool) -> None:
    """Launch the kernel over ``rules`` with the call's ``tensors``. ``arena`` is the device's counter arena
    (``int64 [capacity, 8]``).

    Preconditions (the Validator checks them, with errors that name the tensor, before calling this): every tensor
    is a contiguous int32/int64 tensor on the arena's device, 1-D or 2-D as its rule needs; a lengths tensor has one
    entry per row of its table; the rows are inside the arena. Host arithmetic only: no sync, no allocation, so the
    launch is captured into a CUDA graph like any kernel.
    """
    if not rules.kind:
        return
    main = tuple(tensors[i] for i in rules.tensor)
    aux = tuple(tensors[i] for i in rules.aux)
    rq = tuple(tensors[i] for i in rules.requests)
    sg = tuple(tensors[i] for i in rules.segments)
    n = tuple(t.numel() for t in main)
    total = sum(triton.cdiv(x, BLOCK) for x in n) + sum(rules.own_aux)
    if total == 0:
        return
    args = (
        arena,
        main,
        aux,
        rq,
        sg,
        n,
        tuple(t.shape[1] if t.dim() == 2 else 1 for t in main),
        tuple(t.numel() for t in aux),
        tuple(t.numel() for t in rq),
        tuple(t.numel() for t in sg),
    )
    consts = _constexprs(arena, rules, mask)
    key = spec_key(tensors, [t.numel() for t in tensors], list(args[6]))
    kw = _with_cap(arena, consts, key, total, args)
    _validate[(total,)](*args, **kw)


_I32_MAX = 2**31 - 1  # a size above it is a 64-bit parameter


def spec_key(tensors: Sequence[torch.Tensor], numels: Sequence[int], widths: Sequence[int]) -> tuple:
    """What the compiled kernel is specialised on, for a call with ``tensors`` (each tensor's ``numels``, each
    rule's ``widths``): the tensors' dtypes; per size (the numels, then the widths) 1 when it is 1, plus 2 when it
    is a multiple of 16, plus 4 when it needs 64 bits (Triton types it i64); per tensor whether its address is a
    multiple of 16.

    Why those: Triton specialises each element of a tuple argument with its defaults, whatever
    ``do_not_specialize`` and ``do_not_specialize_on_alignment`` say (they apply to a parameter as a whole), and
    the rules' tensors and sizes are tuple elements: a size of 1 becomes a constant, a size divisible by 16 and an
    address aligned to 16 are compiled as such. Two calls with equal keys run the same compiled kernel; the bound
    launch (:class:`tripwire.validate._launcher.Launcher`) and the register cap (:func:`_with_cap`) are keyed on
    it. Host arithmetic on values the call reads anyway, no device access."""
    return (
        tuple([t.dtype for t in tensors]),
        tuple([(x == 1) + 2 * ((x & 15) == 0) + 4 * (x > _I32_MAX) for x in (*numels, *widths)]),
        tuple([(t.data_ptr() & 15) == 0 for t in tensors]),
    )


def _constexprs(arena: torch.Tensor, rules: Rules, mask: bool) -> tuple:
    """The kernel's constexprs for ``rules``, in its parameter order (:data:`_CONST_NAMES`)."""
    slots = arena.shape[1]
    return (
        rules.kind,
        rules.has_pad,
        rules.has_len,
        rules.own_aux,
        rules.req,
        rules.lo,
        rules.hi,
        rules.pad,
        rules.safe,
        tuple(r * slots for r in rules.row),
        tuple(r * slots for r in rules.aux_row),
        mask,
        BLOCK,
        ABLOCK,
        True,  # FAULT: the fault paths (False: the twin a register cap is found against)
    )


# The builds the register budget chooses between, per Validator(fault_calls=...): the choice cache's key prefix (a
# forced build's choice is cached apart from the free one's) and the options offered. Built once, read by reference.
BUILDS: dict[bool | None, tuple[Any, tuple[dict[str, bool], ...]]] = {
    None: ("validate", ({"CALLS": True}, {"CALLS": False})),
    True: (("validate", "CALLS", True), ({"CALLS": True},)),
    False: (("validate", "CALLS", False), ({"CALLS": False},)),
}


def _with_cap(
    arena: torch.Tensor, consts: tuple, key: tuple, total: int, args: tuple, builds: tuple = BUILDS[None]
) -> dict[str, Any]:
    """The launch's keyword arguments: the constexprs, ``CALLS`` and, where the kernel's own allocation is larger
    than its twin's (the same rules with the fault path reduced to a count: ``FAULT=False``), ``maxnreg`` at the
    twin's (tripwire.triton._budget: the out-of-line fault paths spill on their own path instead of costing the
    votes programs per SM). ``CALLS``: whether the out-of-line fault functions call the record's atomics
    (``tripwire.triton.record_hits``) or inline them: calling where that build fits the twin's allocation, else
    the build allocated fewer registers (:func:`tripwire.triton.budget_choice`, which compiles the inlining
    build only when calling does not fit; which one fits depends on the Triton version and the rules). ``key``: the
    call's :func:`spec_key`. The choice and the cap are found per compiled kernel (device,
    constexprs, :func:`spec_key`), at the first call of that kernel, by compiling it and its twin at the call's own
    specialisation, as Triton's first launch compiles it: a cap found at one specialisation (a one-entry slot
    mapping, whose size is a constant) is not the allocation of another. ``builds``: the entry of :data:`BUILDS`
    the validator was built with (both builds offered, or one forced)."""
    kw: dict[str, Any] = dict(zip(_CONST_NAMES, consts, strict=True))
    prefix, options = builds
    # Through the public module's attribute, not a name bound here: a tool that wraps
    # tripwire.triton.budget_choice (to log or count the choices) sees each compiled kernel's.
    kw.update(
        tw_triton.budget_choice(
            (prefix, arena.device, consts, key), _validate, (total,), args, kw, {"FAULT": False}, options
        )
    )
    return kw


_CONST_NAMES = ("KIND", "HAS_PAD", "HAS_LEN", "OWN_AUX", "REQ", "LO", "HI", "PAD", "SAFE", "C", "AC", "MASK", "BLOCK",
                "ABLOCK", "FAULT")  # fmt: skip
