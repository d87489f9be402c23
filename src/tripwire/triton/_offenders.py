"""The row's offender block on the device (tripwire.layout): where it is, whether it has room, and the claims of
one offender (a compare-and-swap of its key into the first empty entry; a repeat claims nothing). The fault paths
of ``tripwire.triton`` call these; their module docstring has the protocol.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..layout import E_REQ, E_ROW, E_VALUE, OFF_DONE, OFF_ENTRY, OFF_HEADER, OFFENDERS
from ._callee import _bound, _cold
from ._words import _offender_key

_OFF_SLOT = tl.constexpr(OFFENDERS)
_HEADER = tl.constexpr(OFF_HEADER)
_DONE = tl.constexpr(OFF_DONE)
_ENTRY = tl.constexpr(OFF_ENTRY)
_EROW = tl.constexpr(E_ROW)
_EVALUE = tl.constexpr(E_VALUE)
_EREQ = tl.constexpr(E_REQ)


@_cold
def _offender_block(ctr_ptr):
    """:func:`_offender_addr`, out of line (for a hot-path caller)."""
    return _offender_addr(ctr_ptr)


@triton.jit
def _offender_addr(ctr_ptr):
    """The address of the row's offender block (tripwire.layout), or 0 for a counter row that is not an arena's (a
    caller's own [8] tensor). Slot 7 is layout, written by the host: every thread reads the same word, so a branch
    on it is uniform. Whether the block still has room is :func:`_room`'s (its keys change under other programs'
    claims). Inline, for a caller that is itself out of line (tripwire.triton's ``CALLS``)."""
    return tl.load(ctr_ptr + _OFF_SLOT)


@triton.jit
def _room(addr):
    """Whether the offender block at ``addr`` (non-zero) has room: its last entry's key still 0. A full block is
    read once and left alone, so a fault storm costs one read per record, not a walk of compare-and-swaps.

    The key is read by ONE thread and handed to the program's others (a scalar atomic whose result is used: Triton
    does it in one thread and broadcasts it through shared memory), so every thread gets the same answer. Other
    programs claim entries while this one reads, and a plain scalar load is made by every thread: threads that read
    before and after a claim disagree, and the claims that follow (block reductions, barriers) then run in some
    warps and not in others, which leaves reductions reading partials nobody wrote and counts that are garbage
    (tests/numerics/test_nonfinite.py, one bad element per tile). Inline: before Triton 3.9 an out-of-line function
    must use no shared memory (tripwire.triton._callee)."""
    blk = addr.to(tl.pointer_type(tl.int64))
    k = tl.load(blk + 1)  # K: layout
    room = k > 0
    if room:
        # Adding 0 changes nothing (claims compare-and-swap the key from 0): an atomic read.
        room = tl.atomic_add(blk + _HEADER + (k - 1) * _ENTRY, k * 0) == 0
    return room


@triton.jit
def _claim_entry(blk, j, key, rb, vb, qb):
    """Entry ``j`` of the block at ``blk`` claimed with ``key`` (the winner writes the offender's words); returns
    whether the claim must go on (the entry holds another key)."""
    slot = blk + _HEADER + j * _ENTRY
    old = tl.atomic_cas(slot, key * 0, key)
    if old == 0:
        # ROW last, released: a reader that sees it sees REQ and VALUE too. REQ 0 is a legal word
        # ("not known"), so it cannot tell a reader that it landed; ROW (never 0) tells for all three.
        tl.store(slot + _EREQ, qb)
        tl.store(slot + _EVALUE, vb)
        tl.atomic_xchg(slot + _EROW, rb, sem="release", scope="sys")
    return (old != 0) & (old != key)


@triton.jit
def _claim(addr, rb, vb, qb):
    """Keep one offender (biased words) in the block at ``addr``: a scalar walk over its ``k`` entries, a
    compare-and-swap of its key into each; the entry it finds empty is its own, one holding its key means a
    repeat. Returns True when every entry holds another key (the block is full).

    Inlined, not called: it runs inside the claim loop, where the block's words are live, and a call there keeps
    them in registers of their own beside the callee's (a called walk cost the non-finite counter a register unit
    on sm_90); inline, the walk reuses the registers the loop's reductions are done with."""
    blk = addr.to(tl.pointer_type(tl.int64))
    k = tl.load(blk + 1)
    key = _offender_key(rb, vb, qb)
    pending = k >= 0
    for j in range(0, _bound(k)):
        if pending:
            pending = _claim_entry(blk, j, key, rb, vb, qb)
    return pending


@_cold
def _offenders_done(ctr_ptr, n):
    """:func:`_mark_done`, out of line (for a hot-path caller)."""
    _mark_done(ctr_ptr, n)


@triton.jit
def _mark_done(ctr_ptr, n):
    """Last, after the claims and their words (an atomic: ordered after them): these ``n`` hits' offenders are in
    (the block's OFF_DONE count, the reader's sign). Inline, for a caller that is itself out of line."""
    addr = tl.load(ctr_ptr + _OFF_SLOT)
    if addr != 0:
        tl.atomic_add(addr.to(tl.pointer_type(tl.int64)) + _DONE, n)
