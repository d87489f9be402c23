"""The per-lane record (:func:`tripwire.triton.record_lanes`): every bad lane records itself, in PTX, behind one branch
per lane for all its sites, so a clean program runs a compare and a branch and waits for nothing.

Why it exists: the block helpers vote first (a reduction over the program) and record after it. A program cannot
finish before its reduction does, and when the reduction's input is a load that depends on another load (a block id
read through a table row), its latency adds to every clean program's. For a kernel of a few programs (an engine
step's) that is the guard's whole cost. Lanes that record themselves need no vote.

The words, their order and the claims are the block helpers' (tripwire.triton's module docstring): the count first,
then the extremes, the first pair (a compare-and-swap of slot 4 from 0, the winner writing slot 5: one real hit,
here whichever lane lands first), then the offender claim (:func:`tripwire.triton._callee.walk_ptx`, the walk
of the block helpers' claims, per lane) and the offender block's done count. Values are saturated and biased as the
block helpers do it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..layout import GUARD_BIAS, KEY_MIX, OFF_DONE, OFF_ENTRY, OFF_HEADER, OFFENDERS
from ..layout import VALUE_MAX as VMAX
from ..layout import VALUE_MIN as VMIN
from ._callee import walk_ptx

_B = GUARD_BIAS


def _fmix(h: str, s: str) -> str:
    """MurmurHash3's fmix64 of register ``h`` in place (``s`` a scratch register), as tripwire.layout.offender_key."""
    return (
        f"shr.u64 {s}, {h}, 33; xor.b64 {h}, {h}, {s}; mul.lo.u64 {h}, {h}, {KEY_MIX[0]:#x}U; "
        f"shr.u64 {s}, {h}, 33; xor.b64 {h}, {h}, {s}; mul.lo.u64 {h}, {h}, {KEY_MIX[1]:#x}U; "
        f"shr.u64 {s}, {h}, 33; xor.b64 {h}, {h}, {s}; "
    )


def _biased(dst: str, src: str) -> str:
    """``dst`` = the word of register ``src``: saturated into [VALUE_MIN, VALUE_MAX] (kept in ``t``), then biased."""
    return f"max.s64 t, {src}, {VMIN}; min.s64 t, t, {VMAX}; add.s64 {dst}, t, {_B}; "


def _site(i: int, bad: str, ctr: str, value: str) -> str:
    """One site's record for the lane, when its flag ``bad`` is set: the words from ``value`` (the row's and the
    request's, ``rb`` and ``qb``, are the lane's, formed once), the count first, then the extremes, the first pair,
    the offender claim and the done count (labels suffixed by the site)."""
    end_label = f"S{i}E${{:uid}}"
    return (
        f"setp.eq.s32 p, {bad}, 0; @p bra {end_label}; "
        + _biased("vb", value)
        + f"neg.s64 nb, t; add.s64 nb, nb, {_B}; "
        f"atom.global.acq_rel.gpu.add.u64 old, [{ctr}], 1; "
        f"atom.global.acq_rel.gpu.max.s64 old, [{ctr}+8], rb; "
        f"atom.global.acq_rel.gpu.max.s64 old, [{ctr}+16], vb; "
        f"atom.global.acq_rel.gpu.max.s64 old, [{ctr}+24], nb; "
        f"atom.global.acq_rel.gpu.cas.b64 old, [{ctr}+32], 0, rb; setp.ne.s64 p, old, 0; @p bra S{i}P${{:uid}}; "
        f"atom.global.acq_rel.gpu.exch.b64 old, [{ctr}+40], vb; "
        f"S{i}P${{:uid}}: ld.global.b64 addr, [{ctr}+{8 * OFFENDERS}]; setp.eq.s64 p, addr, 0; @p bra {end_label}; "
        # The block is full when its last entry's key is set (read once: a fault storm costs one load).
        f"ld.global.b64 t, [addr+8]; mul.lo.s64 t, t, {8 * OFF_ENTRY}; add.s64 end, addr, {8 * OFF_HEADER}; "
        f"add.s64 end, end, t; ld.global.b64 old, [end+{-8 * OFF_ENTRY}]; setp.ne.s64 p, old, 0; "
        f"@p bra S{i}D${{:uid}}; "
        "mov.b64 h, rb; "
        + _fmix("h", "s")
        + "xor.b64 h, h, vb; "
        + _fmix("h", "s")
        + "xor.b64 h, h, qb; "
        + _fmix("h", "s")
        + "or.b64 h, h, 1; "
        f"add.s64 e, addr, {8 * OFF_HEADER}; "
        + walk_ptx("end", "h", "qb", "vb", "rb", f"S{i}D${{:uid}}", tag=f"S{i}")
        + f"S{i}D${{:uid}}: atom.global.acq_rel.gpu.add.u64 old, [addr+{8 * OFF_DONE}], 1; "
        f"{end_label}: "
    )


def _lanes_ptx(n: int) -> str:
    """The record of ``n`` sites for one lane. Operands: $0 (unused output), $1..$n the sites' flags (b32), then
    their counter rows' addresses, the lane's row, the sites' values and the lane's request (s64; negative: not
    known). One branch skips it all for a clean lane, so a clean program runs a compare and a branch and waits for
    nothing. Every atomic is acq_rel at gpu scope, as Triton's default atomics in the block helpers (a later word is
    ordered after the count), but an offender's ROW, exchanged last with release at system scope as in the walk.
    ${:uid} makes the labels unique per copy of the block."""
    bad = [f"${1 + i}" for i in range(n)]
    ctr = [f"${1 + n + i}" for i in range(n)]
    row = f"${1 + 2 * n}"
    val = [f"${2 + 2 * n + i}" for i in range(n)]
    req = f"${2 + 3 * n}"
    any_bad = "mov.b32 w, " + bad[0] + "; " + "".join(f"or.b32 w, w, {b}; " for b in bad[1:])
    return (
        "{ .reg .pred p; .reg .b32 w; .reg .b64 t, rb, vb, nb, qb, h, s, addr, e, end, old; "
        + any_bad
        + "setp.eq.s32 p, w, 0; @p bra DONE${:uid}; "
        + _biased("rb", row)
        + _biased("qb", req)
        + f"setp.lt.s64 p, {req}, 0; selp.b64 qb, 0, qb, p; "
        + "".join(_site(i, bad[i], ctr[i], val[i]) for i in range(n))
        + "DONE${:uid}: mov.u32 $0, 0; }"
    )


def _constraints(n: int) -> str:
    return "=r," + ",".join(["r"] * n + ["l"] * (2 * n + 2))


_PTX1 = tl.constexpr(_lanes_ptx(1))
_PTX2 = tl.constexpr(_lanes_ptx(2))
_PTX3 = tl.constexpr(_lanes_ptx(3))
_C1 = tl.constexpr(_constraints(1))
_C2 = tl.constexpr(_constraints(2))
_C3 = tl.constexpr(_constraints(3))


@triton.jit
def _flag(bad):
    return (bad != 0).to(tl.int32)


@triton.jit
def _addr(ctr_ptr):
    return ctr_ptr.to(tl.int64, bitcast=True)


@triton.jit
def _lane_records(ctr_ptrs, bads, rows, values, reqs):
    """tripwire.triton.record_lanes, compiled: the PTX record of 1 to 3 sites over the lanes of the blocks (flags as
    int32, the rows' addresses, rows, values and requests as int64; a request of -1, not known, without ``reqs``)."""
    r = rows.to(tl.int64)
    q = r * 0 - 1
    if reqs is not None:
        q = reqs.to(tl.int64) + r * 0
    if len(bads) == 1:
        tl.inline_asm_elementwise(
            _PTX1, _C1, [_flag(bads[0]), _addr(ctr_ptrs[0]), r, values[0].to(tl.int64), q],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    elif len(bads) == 2:
        tl.inline_asm_elementwise(
            _PTX2, _C2,
            [_flag(bads[0]), _flag(bads[1]), _addr(ctr_ptrs[0]), _addr(ctr_ptrs[1]), r, values[0].to(tl.int64),
             values[1].to(tl.int64), q],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.inline_asm_elementwise(
            _PTX3, _C3,
            [_flag(bads[0]), _flag(bads[1]), _flag(bads[2]), _addr(ctr_ptrs[0]), _addr(ctr_ptrs[1]),
             _addr(ctr_ptrs[2]), r, values[0].to(tl.int64), values[1].to(tl.int64), values[2].to(tl.int64), q],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
