"""The counter row layout and its integer encoding (pure Python: no torch, no triton): the ABI between the kernels
that write counter rows (:mod:`tripwire.triton`'s helpers, ``include/tripwire/guard.cuh``, any kernel of one's own)
and the host that reads them, written down here once. ``tripwire.GUARD_BIAS``, ``tripwire.SLOTS`` and the
``encode``/``decode`` functions are these names.

Every site and instrument owns one row of ``SLOTS`` int64 words in its device's arena.

Guard rows (sites):
    slot 0 ``COUNT``       hits, plain count
    slot 1 ``MAX_ROW``     max offending row, biased
    slot 2 ``MAX_VALUE``   max offending value, biased
    slot 3 ``NEG_MIN``     max of the negated offending value, biased (so min survives atomic_max on zeros)
    slot 4 ``FIRST_ROW``   first offender's row, biased, claimed by compare-and-swap from 0
    slot 5 ``FIRST_VALUE`` first offender's value, biased, written only by the CAS winner
    slot 6 spare
    slot 7 ``OFFENDERS``   the address of the row's offender block (written when the arena is allocated, never
                           zeroed; every arena row has one, whatever its kind; 0 in a counter that is not an arena
                           row, which then keeps no offenders)

Offender block (per row, in the same allocation as the rows, after them): ``OFF_HEADER`` header words, then ``K``
entries of ``OFF_ENTRY`` words (``K``: ``TRIPWIRE_OFFENDERS``, fixed with the arena). Header word 0 is a scratch word
that stays 0 (a lane that must not claim compares it against -1: a no-op), word 1 holds ``K``, word 2 (``OFF_DONE``)
counts the hits whose offenders have been recorded: the fault path adds its hits there AFTER its claims and words,
so a reader that sees ``OFF_DONE`` equal the row's count has every offender of those hits (the count itself is
bumped first, as for the extremes). An entry is
``[KEY, ROW, VALUE, REQ]``: ``KEY`` is a non-zero 64-bit hash of (row, value, request), claimed by compare-and-swap
from 0 (the first hit with that key owns the entry; a hit whose key is already there is a repeat and claims nothing);
the owner then writes ``REQ`` (the request id biased, 0 = not known) and ``VALUE`` (biased like the slots), and
``ROW`` (biased) LAST, with release ordering: ``REQ`` may legally be 0, so only ``ROW`` (never 0 once written) can
tell a reader that the entry is complete. So the block holds the first ``K`` DISTINCT offenders in claim order
(programs, or warps in ``guard.cuh``, as they arrive; a Triton program claims its own lowest (row, value, request)
first; with ``record_lanes``, lanes as they arrive), and a reader that sees a claimed key waits (like for the first
pair) until its ``ROW`` and ``VALUE`` have landed.
The key (:func:`offender_key`; the Triton helpers and ``guard.cuh`` compute it bit for bit the same) chains
MurmurHash3's 64-bit finalizer ``fmix`` (a bijection: xor-shifts by 33, multiplies by ``KEY_MIX``, mod 2**64) over
the biased row, value and request words::

    key = fmix(fmix(fmix(rb) ^ vb) ^ qb) | 1

Not a linear mix: the encoding's special words (the bias 2**62 of a known request against 0 for "not known", the
saturated values +-(2**62 - 1)) differ in their top bits, and a linear combination of them collides outright (two
distinct offenders would share one entry, and one request would go unreported). Writing offenders is the fault path
only: a row without hits is never touched.

Encoding: a stored word is ``v + GUARD_BIAS`` with ``GUARD_BIAS = 2**62``. A zeroed buffer then means "nothing
recorded" and atomic_max works for negative values too. The round-trip holds for ``-2**62 < v < 2**62``
(``encode`` refuses anything outside); indices, rows and positions of real kernels are far inside it.
The four extremes are independent lifetime extremes, not pairs: the max row and the max value may come from
different hits. Only slots 4/5 are one real observed pair.
"""

from __future__ import annotations

__all__ = [
    "OFFENDERS",
    "OFF_DONE",
    "OFF_ENTRY",
    "OFF_HEADER",
    "E_KEY",
    "E_REQ",
    "E_ROW",
    "E_VALUE",
    "KEY_MIX",
    "offender_block_words",
    "offender_key",
    "COUNT",
    "FIRST_ROW",
    "FIRST_VALUE",
    "GUARD_BIAS",
    "MAX_ROW",
    "MAX_VALUE",
    "NEG_MIN",
    "SLOTS",
    "VALUE_MAX",
    "VALUE_MIN",
    "decode",
    "decode_neg",
    "encode",
    "encode_neg",
]

SLOTS = 8
COUNT, MAX_ROW, MAX_VALUE, NEG_MIN, FIRST_ROW, FIRST_VALUE = 0, 1, 2, 3, 4, 5
OFFENDERS = 7
OFF_HEADER, OFF_ENTRY = 4, 4
OFF_DONE = 2
E_KEY, E_ROW, E_VALUE, E_REQ = 0, 1, 2, 3
# The multipliers of the offender key's finalizer (MurmurHash3's fmix64), as unsigned 64-bit numbers.
KEY_MIX = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)
GUARD_BIAS = 1 << 62
# Exclusive bounds of what round-trips: v + BIAS must be in (0, 2**63) and BIAS - v as well.
VALUE_MIN = -GUARD_BIAS + 1
VALUE_MAX = GUARD_BIAS - 1


def encode(v: int) -> int:
    """The stored word for value ``v``; ValueError outside ``[VALUE_MIN, VALUE_MAX]``."""
    if not VALUE_MIN <= v <= VALUE_MAX:
        raise ValueError(f"{v} is outside the encodable range [{VALUE_MIN}, {VALUE_MAX}]")
    return v + GUARD_BIAS


def encode_neg(v: int) -> int:
    """The stored word of the NEG_MIN slot for value ``v`` (the negated value, biased)."""
    if not VALUE_MIN <= v <= VALUE_MAX:
        raise ValueError(f"{v} is outside the encodable range [{VALUE_MIN}, {VALUE_MAX}]")
    return GUARD_BIAS - v


def decode(word: int) -> int | None:
    """The value of a biased slot, or None when the slot is 0 (nothing recorded)."""
    return None if word == 0 else int(word) - GUARD_BIAS


def decode_neg(word: int) -> int | None:
    """The minimum from the NEG_MIN slot, or None when nothing was recorded."""
    return None if word == 0 else GUARD_BIAS - int(word)


def offender_block_words(k: int) -> int:
    """Words of one row's offender block for ``k`` offenders."""
    return OFF_HEADER + k * OFF_ENTRY


def _fmix(h: int) -> int:
    m = (1 << 64) - 1
    h ^= h >> 33
    h = (h * KEY_MIX[0]) & m
    h ^= h >> 33
    h = (h * KEY_MIX[1]) & m
    return h ^ (h >> 33)


def offender_key(rb: int, vb: int, qb: int) -> int:
    """The offender key of biased row, value and request words (``qb`` 0 = request not known), as the stored int64
    word (never 0): see the module docstring."""
    m = (1 << 64) - 1
    h = _fmix(_fmix(_fmix(rb & m) ^ (vb & m)) ^ (qb & m)) | 1
    return h - (1 << 64) if h >> 63 else h
