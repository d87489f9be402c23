"""Triton device helpers that record masked faults into a site's counter row.

A kernel receives its site's row (``tripwire.counter(site, device)``, an int64 ``[8]`` view) as ``ctr_ptr`` and
calls one of:

* :func:`record_hit` ``(ctr_ptr, row, value, req=None)`` -- one hit per program that reaches it; call it under the
  kernel's own ``if bad:``.
* :func:`record_hits` ``(ctr_ptr, bad, rows, values, reqs=None, CALLS=True)`` -- every true lane of a block: one
  reduction and at most one set of atomics per program (no atomics at all when no lane is bad, which is the hot
  path). ``CALLS=False`` for a caller that is itself out of line (its docstring says when).
* :func:`guard_index` ``(idx, lo, hi, ctr_ptr, row, mask=None, count=None, req=None)`` -> ``(safe_idx, ok)``: the index
  clamped into ``[lo, hi)`` and the in-range mask; the out-of-range lanes inside ``mask`` and ``count`` are
  recorded. Always use ``ok`` to mask the access too: ``safe_idx`` is only in range when ``hi > lo``.
* :func:`record_lanes` ``(ctr_ptrs, bads, rows, values, reqs=None)`` -- for one to three sites (tuples), every true
  lane, each lane by itself (compiled: PTX behind one branch per lane): no vote, so a clean program waits for
  nothing. For a kernel of a few programs whose checks read a dependent load (an engine step's slot mapping), where
  a vote's latency is the guard's cost.
* :func:`record_tiles` ``(ctr_ptr, TILE, C, args, tiles)`` -- the fault path of a kernel whose hot path keeps only a
  vote: ``TILE(C, args, t)`` (a ``@triton.jit`` function; ``C`` constexprs, ``args`` a tuple of scalars) forms tile
  ``t``'s ``(bad, rows, values, reqs)`` again from memory, inside out-of-line functions, and each tile is recorded as
  ``record_hits`` would record it. No lane's words are live across a call or beside the caller's code.
* :func:`any_outside` ``(ptr, start, end, lo, hi, BLOCK)`` -> scalar: whether any of ``ptr[start:end]`` lies outside
  ``[lo, hi)``; reads only, records nothing. The pre-check of a loop's indices (a split's page ids): run the
  kernel's own loop when it is False and a masking copy of the loop only when it is True (docs/guarding.md).
  Compiled, on int32/int64 entries, one warp vote per warp and no barrier (``_precheck``).

Cost: the fault path is out of line (called ``noinline`` functions, not code inlined into the kernel), so a clean
launch runs the caller's own code and the record's atomics, loops and 64-bit words do not raise its registers.
Triton's ``noinline`` functions take scalars only: ``record_hit`` is out of line as a whole; ``record_hits`` and
``guard_index`` reduce their block in the caller (after the vote, which is the whole hot path) and call out for
the rest (``record_hits``' ``CALLS=False``: inline the rest, from a caller that is itself out of line).
``record_lanes`` is the exception: its record is per-lane PTX inline in the kernel, behind one branch per lane (no
vote, no call), so it does cost registers of its own. ``tripwire resources`` shows what a guarded
kernel occupies beside its twin (docs/guarding.md).

The register budget, for a launcher of a guarded kernel whose out-of-line fault path needs more registers than its
hot path: :func:`register_cap` ``(key, kernel, grid, args, kwargs, twin)`` -> the ``maxnreg`` that keeps the launch
within its twin's allocation (None: none needed, or none found); :func:`budget_choice` ``(..., twin, options)`` ->
the keyword arguments of the first of several builds (``CALLS`` of ``record_hits``) that fits it, with its cap.
Both compile at the first launch of a key (make it before a CUDA graph capture) and cache the answer per key; under
the interpreter they compile nothing. :func:`ptxas_report` ``(ptx, options=None)`` -> :class:`PtxasReport` is what
they and ``tripwire resources`` read of a compiled kernel: ``ptxas -v``'s registers and spills of its entry function
(its callees' spills apart), run with the options Triton's own ptxas command passes (:func:`triton_ptxas_options`),
or with ``options`` instead. Its two readings, for output of one's own: :func:`parse_ptxas` ``(text)`` ->
:class:`PtxasReport` of ``ptxas -v``'s text, and :func:`return_address_saves` ``(sass)`` -> the bytes of the entry
function's spill count that are its calls' saved return addresses (``cuobjdump -sass``), which ptxas_report takes
out of the spills.

Units: a Triton program is the unit of scalar code, so ``record_hit`` counts once per program, not per thread;
``record_hits`` counts LANES. A count should mean bad ENTRIES: where one entry is held by several lanes (a page id
broadcast over the token lanes of its page) or read by several programs (head or split programs of one sequence),
restrict the counting to one lane and one program (``guard_index(..., count=...)``; docs/guarding.md shows the
patterns). Masking is per lane regardless: every lane that reads through a bad entry must be masked.

Write order: the count is bumped first and the extremes after it, so a reader copy that sees a new count may miss
the extremes; the reader therefore reports from the *next* copy. The first offender is claimed with a
compare-and-swap of slot 4 from 0 and only the winner writes slot 5, so (slot 4, slot 5) is one real hit.
"First" within a program means the lowest row, then the lowest value in that row; across programs, whichever
program wins the CAS (with ``record_lanes``, whichever lane does).

Offenders: the fault path also keeps the row's first K distinct (row, value, request) offenders in the row's
offender block (:mod:`tripwire.layout`): programs in the order they arrive, a program's own lowest (row, value,
request) first. ``req``/``reqs`` name the request of each hit (a row-to-request map the kernel loads; omit it when the
kernel has none; a negative id means not known). Distinct means a distinct 64-bit key of the three: a repeat of an
offender already kept claims nothing. A kept offender, like the first pair, is written after the count, so the
reader waits for it the same way. The claims run one offender at a time (scalar code), so the compiled fault path
adds no per-lane state to a kernel's register budget, taken or not. Whether the block has room (its last key
still 0) is read by one thread and handed to the program's others: the claims are collective, and other programs
fill the block while this one reads. ``record_lanes`` claims lane by lane, in the order the lanes land, and adds
each lane's hit to the block's done count after its own claim.

Rows and values must be integer tensors (program ids, loaded indices), not Python ints or constexprs. Values
beyond the encodable range (|v| >= 2**62, e.g. junk int64 metadata) are recorded saturated at +-(2**62 - 1);
reports mark them "saturated". Counts and masking are exact regardless.
All of this runs unchanged under ``TRITON_INTERPRET=1``. ``include/tripwire/guard.cuh`` is the same protocol for
CUDA C++ kernels (``tripwire.include_dir()``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._budget import PtxasReport as PtxasReport
from ._budget import budget_choice as budget_choice
from ._budget import parse_ptxas as parse_ptxas
from ._budget import ptxas_report as ptxas_report
from ._budget import register_cap as register_cap
from ._budget import return_address_saves as return_address_saves
from ._budget import triton_ptxas_options as triton_ptxas_options
from ._callee import _INTERP as _INTERP
from ._callee import _PTX as _PTX
from ._callee import CALLEE_SMEM_SAFE as CALLEE_SMEM_SAFE
from ._callee import _bound, _claim_walk_ptx, _cold, _cold_block, _first_pair_ptx
from ._lanes import _lane_records
from ._offenders import _ENTRY, _HEADER, _claim, _mark_done, _offender_addr, _offender_block, _offenders_done, _room
from ._precheck import any_outside as any_outside
from ._words import _VMAX, _VMIN, _offender_key, _req_words, _saturate
from ._words import GUARD_BIAS as GUARD_BIAS

__all__ = [
    "CALLEE_SMEM_SAFE",
    "GUARD_BIAS",
    "PtxasReport",
    "any_outside",
    "budget_choice",
    "guard_index",
    "parse_ptxas",
    "ptxas_report",
    "record_hit",
    "record_hits",
    "record_lanes",
    "record_tiles",
    "register_cap",
    "return_address_saves",
    "triton_ptxas_options",
]

# Larger than any encoded word: the neutral element of the "lowest row" reduction.
_NO_ROW = tl.constexpr((1 << 63) - 1)
# ------------------------------------------------------------------------------------------- the cold fault path
# Out of line (noinline): a call, not code inlined into the caller. Inlined, the fault path's atomics, loops and
# 64-bit scalars are scheduled and register-allocated with the caller's hot code, and a kernel is allocated
# registers for its hungriest path, taken or not: a compiled-in fault path raised kernels' registers and cut their
# occupancy. Out of line, the caller keeps its own code; what is live at a call is a few scalars. Triton's
# noinline functions take scalars only, so the block reductions (which lanes, the extremes, the lowest offender)
# stay in the caller, after the vote, and everything from the atomics on is out of line.


@_cold
def _record_words(ctr_ptr, n, max_rb, max_vb, neg_min, first_rb, first_vb):
    """The slots of ``n`` (> 0) hits, from the biased words of their extremes and of their lowest (row, value)."""
    _write_words(ctr_ptr, n, max_rb, max_vb, neg_min, first_rb, first_vb)


@triton.jit
def _write_words(ctr_ptr, n, max_rb, max_vb, neg_min, first_rb, first_vb):
    """:func:`_record_words`' atomics, inline (for a caller that is itself out of line)."""
    # Count first (see the module docstring for why the reader waits one copy for the rest).
    tl.atomic_add(ctr_ptr + 0, n)
    tl.atomic_max(ctr_ptr + 1, max_rb)
    tl.atomic_max(ctr_ptr + 2, max_vb)
    tl.atomic_max(ctr_ptr + 3, neg_min)
    if _PTX:
        _first_pair_ptx((ctr_ptr + 4).to(tl.int64, bitcast=True), first_rb, first_vb)
    else:
        # The comparand must be int64 like the slot (an int32 literal 0 is mis-typed by the interpreter).
        old = tl.atomic_cas(ctr_ptr + 4, first_rb * 0, first_rb)
        if old == 0:
            tl.atomic_xchg(ctr_ptr + 5, first_vb)


@_cold
def _record_one(ctr_ptr, r, v, qb):
    """The whole fault path of one hit (``record_hit``): saturated row ``r`` and value ``v``, request word ``qb``."""
    rb = r + GUARD_BIAS
    vb = v + GUARD_BIAS
    one = rb * 0 + 1
    _record_words(
        ctr_ptr, one, rb, vb, (0 - v) + GUARD_BIAS, rb, vb
    )  # tensor first: constexpr - scalar is a list in the interpreter
    addr = _offender_block(ctr_ptr)
    if addr != 0:
        if _PTX:
            # Thread 0 alone walks (PTX, nothing collective after it), so its own read of the last key is the one
            # that counts, and a plain load will do: _room's broadcast would need shared memory, which an
            # out-of-line function must not use before Triton 3.9.
            blk = addr.to(tl.pointer_type(tl.int64))
            k = tl.load(blk + 1)
            if k > 0:
                if tl.load(blk + _HEADER + (k - 1) * _ENTRY) == 0:
                    first = (blk + _HEADER).to(tl.int64, bitcast=True)
                    end = (blk + _HEADER + k * _ENTRY).to(tl.int64, bitcast=True)
                    _claim_walk_ptx(first, end, _offender_key(rb, vb, qb), rb, vb, qb)
        elif _room(addr):
            _claim(addr, rb, vb, qb)
    _offenders_done(ctr_ptr, one)


@triton.jit
def _claim_offenders(ctr_ptr, b, rb, vb, qb, CALLS: tl.constexpr = True):
    """The program's distinct offenders one at a time, lowest (row, value, request) first like the first pair: each
    candidate is three reductions over the block, then a scalar claim (inlined: see _claim). Scalar, not one claim per
    lane: per-lane keys and compare-and-swap results are live across the whole block, and in a kernel whose hot path
    is a wide read that extra register pressure (a compiled-in fault path counts, taken or not) cut the occupancy.
    At most 2k candidates matter: each either takes an empty entry (k of them) or repeats a kept key (k distinct);
    the loop stops once the block is full or the lanes are used up. ``CALLS``: as :func:`record_hits`'."""
    if CALLS:
        addr = _offender_block(ctr_ptr)
    else:
        addr = _offender_addr(ctr_ptr)
    if addr != 0:
        if _room(addr):
            k = tl.load(addr.to(tl.pointer_type(tl.int64)) + 1)
            active = b
            full = k * 0 != 0
            for _ in range(0, 2 * _bound(k)):
                if (tl.sum(active.to(tl.int32), axis=None) > 0) & (full == 0):
                    cr = tl.min(tl.where(active, rb, _NO_ROW), axis=None)
                    at_r = active & (rb == cr)
                    cv = tl.min(tl.where(at_r, vb, _NO_ROW), axis=None)
                    at_v = at_r & (vb == cv)
                    cq = tl.min(tl.where(at_v, qb, _NO_ROW), axis=None)
                    active = active & ((at_v & (qb == cq)) == 0)  # every lane of this offender is handled by this claim
                    full = _claim(addr, cr, cv, cq)


@triton.jit
def _fault(ctr_ptr, n, b, r, v, qb, CALLS: tl.constexpr = True):
    """The fault path of the block helpers: ``n`` (> 0) hits, the true lanes of ``b``, at saturated rows ``r`` and
    values ``v``, requests ``qb`` (biased words, 0 = not known); all one block shape, at least 1-D. The reductions
    run here, in the caller's code; the atomics out of line (``CALLS``), or inline where the caller is itself out
    of line (see :func:`record_hits`)."""
    rb = r + GUARD_BIAS
    vb = v + GUARD_BIAS
    # A real pair: the lowest bad row, and the lowest bad value within that row.
    first_r = tl.min(tl.where(b, rb, _NO_ROW), axis=None)
    first_v = tl.min(tl.where(b & (rb == first_r), vb, _NO_ROW), axis=None)
    max_r = tl.max(tl.where(b, rb, 0), axis=None)
    max_v = tl.max(tl.where(b, vb, 0), axis=None)
    neg_min = tl.max(tl.where(b, GUARD_BIAS - v, 0), axis=None)
    if CALLS:
        _record_words(ctr_ptr, n, max_r, max_v, neg_min, first_r, first_v)
    else:
        _write_words(ctr_ptr, n, max_r, max_v, neg_min, first_r, first_v)
    _claim_offenders(ctr_ptr, b, rb, vb, qb, CALLS)
    if CALLS:
        _offenders_done(ctr_ptr, n)
    else:
        _mark_done(ctr_ptr, n)


@triton.jit
def record_hit(ctr_ptr, row, value, req=None):
    """Record one hit at (``row``, ``value``), both scalars (a tensor or a plain number); ``req``: the request it
    belongs to (a scalar), kept with the offender. Call it under the kernel's ``if bad:``.

    Counts once per PROGRAM that reaches the call (scalar Triton code runs once per program, not per thread). When
    several programs see the same bad entry (head or split programs of one sequence), each counts: put the program
    condition into the kernel's ``if`` (``if bad & (pid_head == 0):``) so one of them records it.
    """
    # Everything from here on is out of line (_record_one): the caller's `if bad:` is the whole hot path. tl.cast, not
    # .to(): a plain number (record_hit(ctr, 0, v)) has no .to(); for a tensor the two are the same cast.
    r = _saturate(tl.cast(row, tl.int64))
    v = _saturate(tl.cast(value, tl.int64))
    _record_one(ctr_ptr, r, v, _req_words(req, r))


@triton.jit
def record_hits(ctr_ptr, bad, rows, values, reqs=None, CALLS: tl.constexpr = True):
    """Record every true lane of ``bad``. ``bad``, ``rows`` and ``values`` (and ``reqs``, the request of each lane,
    when given) broadcast against each other (a scalar row with a block of values is fine); the count is the number
    of true lanes AFTER broadcasting, in this program.

    ``CALLS``: whether the atomics are called out of line (the default, for a caller whose clean path this is) or
    inlined into the caller, for a caller that is itself an out-of-line fault path: there a nested call only adds
    the call's own registers to the kernel's allocation, or saves nothing, depending on the compiler; a launcher
    that compiles both picks (:func:`budget_choice`). The records are the same either way.

    One reduction per call; atomics (one set, for all lanes together) only when some lane is bad. Each program
    counts its own lanes: an entry held by several lanes or read by several programs counts once per lane and
    program that passes it as bad, so restrict ``bad`` to one lane and one program per entry
    (``guard_index(..., count=...)``).
    """
    r = _saturate(tl.cast(rows, tl.int64))  # tl.cast: a plain number too (see record_hit)
    v = _saturate(tl.cast(values, tl.int64))
    b64 = tl.cast(bad != 0, tl.int64)
    # Broadcast all three to one block shape (at least 1-D, so the reductions below always have an axis).
    zero = r * 0 + v * 0 + b64 * 0 + tl.zeros([1], tl.int64)
    r = r + zero
    v = v + zero
    b = (b64 + zero) != 0
    n = tl.sum(b.to(tl.int64), axis=None)
    if n > 0:
        _fault(ctr_ptr, n, b, r, v, _req_words(reqs, zero), CALLS)


@triton.jit
def _narrow(x):
    """``x`` as the narrowest integer type that holds every value it can have: int32 for integers of at most 32 bits
    (uint32 excepted), else saturated int64 (see :func:`_saturate`). Every int32 is encodable as it is, and 32-bit
    lanes and reductions need half the registers of 64-bit ones."""
    if (x.dtype.primitive_bitwidth < 32) | ((x.dtype.primitive_bitwidth == 32) & x.dtype.is_int_signed()):
        y = x.to(tl.int32)
    else:
        y = _saturate(x.to(tl.int64))
    return y


@triton.jit
def _top(x):
    """The highest value of ``x``'s type after :func:`_narrow` (the neutral element of a "lowest" reduction over
    some lanes, at least one of them real: a real lane holding it gives the same result)."""
    if x.dtype == tl.int32:
        top = 0x7FFFFFFF
    else:
        top = _VMAX
    return top


@triton.jit
def _bottom(x):
    """The lowest value of ``x``'s type after :func:`_narrow`."""
    if x.dtype == tl.int32:
        bottom = -0x80000000
    else:
        bottom = _VMIN
    return bottom


@triton.jit
def _tile_lanes(TILE: tl.constexpr, C: tl.constexpr, args, t):
    """Tile ``t`` formed by ``TILE``: ``(b, r, v, reqs)``, the bad lanes and their rows and values narrowed
    (:func:`_narrow`), all three broadcast to one block shape."""
    bad, rows, values, reqs = TILE(C, args, t)
    r = _narrow(rows)
    v = _narrow(values)
    b = bad != 0
    b, r = tl.broadcast(b, r)
    b, v = tl.broadcast(b, v)
    b, r = tl.broadcast(b, r)
    return b, r, v, reqs


@_cold_block
def _tile_first(TILE: tl.constexpr, C: tl.constexpr, args, t):
    """Tile ``t``'s count and its lowest (row, value): a real pair, narrowed (:func:`_narrow`). Out of line: the
    tile's lanes are formed and reduced here and nothing per lane outlives the call. The reductions run in the rows'
    and values' own (narrowed) types and only their results are biased into words: the words are unchanged."""
    b, r, v, _ = _tile_lanes(TILE, C, args, t)
    n = tl.sum(b.to(tl.int32), axis=None)
    first_r = tl.min(tl.where(b, r, _top(r)), axis=None)
    first_v = tl.min(tl.where(b & (r == first_r), v, _top(v)), axis=None)
    return n, first_r, first_v


@_cold_block
def _tile_record(TILE: tl.constexpr, C: tl.constexpr, args, t, ctr_ptr, n, first_r, first_v):
    """Tile ``t``'s ``n`` (> 0) hits recorded: its extremes reduced (the highest row and value, the lowest value)
    and the slots written with them and the first pair's words. A call of its own (the tile formed again): fewer
    reductions in flight together than with :func:`_tile_first`'s, and the extremes' words never reach the
    caller."""
    b, r, v, _ = _tile_lanes(TILE, C, args, t)
    max_r = tl.max(tl.where(b, r, _bottom(r)), axis=None)
    max_v = tl.max(tl.where(b, v, _bottom(v)), axis=None)
    min_v = tl.min(tl.where(b, v, _top(v)), axis=None)
    _write_words(
        ctr_ptr, n.to(tl.int64), max_r.to(tl.int64) + GUARD_BIAS, max_v.to(tl.int64) + GUARD_BIAS,
        (0 - min_v.to(tl.int64)) + GUARD_BIAS, first_r.to(tl.int64) + GUARD_BIAS, first_v.to(tl.int64) + GUARD_BIAS,
    )  # fmt: skip


@_cold_block
def _tile_next(TILE: tl.constexpr, C: tl.constexpr, args, t, pr, pv, pq, after):
    """The lowest (row, value, request) of tile ``t``'s bad lanes (``after``: above ``(pr, pv, pq)`` in that order,
    the claim order of :func:`_claim_offenders`), and whether there is one. The row and value come back in their
    narrowed types (:func:`_narrow`) and so does the caller keep them, the request as its word. Out of line, like
    :func:`_tile_first`."""
    b, r, v, reqs = _tile_lanes(TILE, C, args, t)
    qb = _req_words(reqs, r.to(tl.int64) * 0)
    above = b & ((after == 0) | (r > pr) | ((r == pr) & ((v > pv) | ((v == pv) & (qb > pq)))))
    found = tl.sum(above.to(tl.int32), axis=None) > 0
    cr = tl.min(tl.where(above, r, _top(r)), axis=None)
    at_r = above & (r == cr)
    cv = tl.min(tl.where(at_r, v, _top(v)), axis=None)
    cq = tl.min(tl.where(at_r & (v == cv), qb, _NO_ROW), axis=None)
    return found, cr, cv, cq


# The tile functions out of line on every Triton version, for a caller that keeps nothing in shared memory across
# the call (record_tiles' KEEPS_SMEM=False): before 3.9 (CALLEE_SMEM_SAFE) a callee's shared memory starts at the
# kernel's 0, where such a caller has only the scratch of single operations, dead at the call. From 3.9 on they are
# the functions above.
if CALLEE_SMEM_SAFE:
    _tile_first_ool, _tile_record_ool, _tile_next_ool = _tile_first, _tile_record, _tile_next
else:
    _tile_first_ool = _cold(_tile_first.fn)
    _tile_record_ool = _cold(_tile_record.fn)
    _tile_next_ool = _cold(_tile_next.fn)


@triton.jit
def _fault_tiles(ctr_ptr, TILE: tl.constexpr, C: tl.constexpr, args, tiles, KEEPS_SMEM: tl.constexpr):
    """The fault path of :func:`record_tiles`: per tile with a bad lane, the same words, claims and order as
    :func:`_fault`, each tile's lanes formed again by the out-of-line functions; only scalars here."""
    for t in range(0, _bound(tiles)):
        if KEEPS_SMEM:
            n, first_r, first_v = _tile_first(TILE, C, args, t)
        else:
            n, first_r, first_v = _tile_first_ool(TILE, C, args, t)
        if n > 0:
            if KEEPS_SMEM:
                _tile_record(TILE, C, args, t, ctr_ptr, n, first_r, first_v)
            else:
                _tile_record_ool(TILE, C, args, t, ctr_ptr, n, first_r, first_v)
            addr = _offender_block(ctr_ptr)
            if addr != 0:
                addr = tl.where(_room(addr), addr, 0)
            if addr != 0:
                k = tl.load(addr.to(tl.pointer_type(tl.int64)) + 1).to(tl.int32)
                # The previous candidate (narrowed, as _tile_next returns it); `after` is False for the first.
                pr = first_r
                pv = first_v
                pq = n.to(tl.int64) * 0
                after = k < 0
                more = k > 0
                for _ in range(0, 2 * _bound(k)):
                    if more:
                        if KEEPS_SMEM:
                            found, cr, cv, cq = _tile_next(TILE, C, args, t, pr, pv, pq, after)
                        else:
                            found, cr, cv, cq = _tile_next_ool(TILE, C, args, t, pr, pv, pq, after)
                        more = found
                        if found:
                            more = _claim(addr, cr.to(tl.int64) + GUARD_BIAS, cv.to(tl.int64) + GUARD_BIAS, cq) == 0
                        # Unconditionally (nothing follows a miss): the previous candidate dies at the call instead
                        # of staying live across it, beside what the callee needs.
                        pr = cr
                        pv = cv
                        pq = cq
                        after = k >= 0
            _offenders_done(ctr_ptr, n.to(tl.int64))


@triton.jit
def record_tiles(ctr_ptr, TILE: tl.constexpr, C: tl.constexpr, args, tiles, KEEPS_SMEM: tl.constexpr = True):
    """Record the bad lanes of ``tiles`` tiles that ``TILE`` forms again from memory: the fault path of a kernel
    whose hot path keeps only a vote (``if any_bad: record_tiles(...)``). ``TILE(C, args, t)`` is a ``@triton.jit``
    function returning blocks ``(bad, rows, values, reqs)`` of tile ``t``, as :func:`record_hits` takes them
    (``reqs``: a block, negative where not known; not None); ``C`` a tuple of constexprs (a kernel's switches),
    ``args`` a tuple of scalars (pointers, sizes, program ids) it reads them from. Constexprs belong in ``C``: a
    constant in ``args`` becomes a runtime value in the out-of-line functions.

    Counts, extremes, first pair and offenders are those of ``record_hits`` over each tile in turn. The tiles are
    formed and reduced in out-of-line functions that return scalars only, twice per tile and once more per
    offender claimed, so no lane's words are live across a call or beside the caller's hot code. Their reductions
    run in 32 bits for int32 rows and values (the words are the same). Make a tile one element per thread
    (``32 * num_warps`` lanes) and ``args`` small: the out-of-line functions receive them in registers.

    ``KEEPS_SMEM``: whether the caller may keep shared memory of its own across the call (a dot operand, a pipelined
    load's buffer). Before Triton 3.9 an out-of-line function's shared memory starts at the kernel's 0 and would
    overwrite it (:data:`CALLEE_SMEM_SAFE`), so there the tile functions are inlined, which raises the caller's
    registers. A caller with only the scratch of single operations (a vote's reduction, dead at the call) passes
    False: its tile functions are out of line on every version."""
    _fault_tiles(ctr_ptr, TILE, C, args, tiles, KEEPS_SMEM)


@triton.jit
def record_lanes(ctr_ptrs, bads, rows, values, reqs=None):
    """Record, for each of one to three sites, every true lane of its block, each lane by itself: the same words as
    :func:`record_hits` (counts and extremes exact), with no reduction. ``ctr_ptrs``, ``bads`` and ``values`` are
    tuples, one entry per site (counter rows, block masks, the values recorded); ``rows`` the lanes' rows and
    ``reqs`` their requests (negative where not known), shared by the sites. All blocks of one shape, and each lane
    held by ONE thread: a 1-D block of at least ``32 * num_warps`` lanes. A smaller block is replicated across
    threads, and compiled, every copy records (the PTX runs per thread; Triton masks the copies of its own stores and
    atomics, not of inline PTX), so a bad lane would count once per copy.

    Compiled, each lane runs one compare and one branch over its whole record (PTX, tripwire.triton._lanes): a
    clean program waits on nothing, where a vote makes it wait for the reduction and with it for the loads its
    input depends on (a block id read through a table row). For a kernel of a few programs that wait is the guard's
    cost. The first pair is one real hit (whichever lane lands first, not the program's lowest); the offenders are
    distinct, in the order they land, and each lane adds its one hit to the block's done count after its claim.
    One to three sites, the three tuples of one length (checked when compiling). A bad lane costs its own atomics:
    for many bad lanes per program :func:`record_hits` (one set of atomics) is cheaper. Under the interpreter it is
    :func:`record_hits`, per site.
    """
    tl.static_assert(len(bads) >= 1 and len(bads) <= 3, "record_lanes takes 1 to 3 sites")
    tl.static_assert(len(ctr_ptrs) == len(bads) and len(values) == len(bads), "one counter row and values per site")
    if _INTERP:
        for i in tl.static_range(len(bads)):
            record_hits(ctr_ptrs[i], bads[i], rows, values[i], reqs)
    else:
        _lane_records(ctr_ptrs, bads, rows, values, reqs)


@triton.jit
def guard_index(idx, lo, hi, ctr_ptr, row, mask=None, count=None, req=None):
    """``(safe_idx, ok)``: ``idx`` clamped into ``[lo, hi)`` and the in-range mask (within ``mask``, when given).

    ``mask``: the lanes that exist (a tile's tail is not an access); ``ok`` is False outside it and nothing there
    is recorded. ``count``: the lanes that COUNT (a block mask or a scalar, broadcast; default: ``mask``). A lane is
    recorded, at ``(row, idx)``, when it is out of range, inside ``mask`` and inside ``count``; ``ok`` still masks
    every out-of-range lane, counted or not. Pass ``count`` when one entry is held by several lanes or read by
    several programs, so that each bad ENTRY counts once: ``count=(tok % block_size == 0)`` for the first token lane
    of each page, ``count=(pid_head == 0)`` for one of the programs reading it (docs/guarding.md). ``req``: the
    request of each lane (or of the program), kept with its offender.

    Mask the guarded access with ``ok``.
    """
    ok = (idx >= lo) & (idx < hi)
    bad = ok == 0
    # where(), not `&`: the interpreter mis-types a bool scalar & a bool block; where() takes either shape.
    if mask is not None:
        bad = tl.where(mask, bad, False)
        ok = tl.where(mask, ok, False)
    if count is not None:
        bad = tl.where(count, bad, False)
    record_hits(ctr_ptr, bad, row, idx, req)
    safe = tl.minimum(tl.maximum(idx, lo), hi - 1)
    return safe, ok
