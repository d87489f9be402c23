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


@triton.constexpr_function
def _fmix(h: str, s: str) -> str:
    """MurmurHash3's fmix64 of register ``h`` in place (``s`` a scratch register), as tripwire.layout.offender_key."""
    return (
        f"shr.u64 {s}, {h}, 33; xor.b64 {h}, {h}, {s}; mul.lo.u64 {h}, {h}, {KEY_MIX[0]:#x}U; "
        f"shr.u64 {s}, {h}, 33; xor.b64 {h}, {h}, {s}; mul.lo.u64 {h}, {h}, {KEY_MIX[1]:#x}U; "
        f"shr.u64 {s}, {h}, 33; xor.b64 {h}, {h}, {s}; "
    )


@triton.constexpr_function
def _biased(dst: str, src: str) -> str:
    """``dst`` = the word of register ``src``: saturated into [VALUE_MIN, VALUE_MAX] (kept in ``t``), then biased."""
    return f"max.s64 t, {src}, {VMIN}; min.s64 t, t, {VMAX}; add.s64 {dst}, t, {_B}; "


@triton.constexpr_function
def _site(i: int, bad: str, ctr: str, value: str, bits: int) -> str:
    """One site's record for the lane, when its flag ``bad`` is set: the words from ``value`` (the row's and the
    request's, ``rb`` and ``qb``, are the lane's, formed once), the count first, then the extremes, the first pair,
    the offender claim and the done count (labels suffixed by the site). ``value`` is ``bits`` wide."""
    end_label = f"S{i}E${{:uid}}"
    return (
        f"setp.eq.s32 p, {bad}, 0; @p bra {end_label}; "
        + _wide("t", value, bits)
        + _biased("vb", value if bits == 64 else "t")
        + f"neg.s64 nb, t; add.s64 nb, nb, {_B}; "
        f"atom.global.acq_rel.gpu.add.u64 old, [{ctr}], 1; "
        f"atom.global.acq_rel.gpu.max.s64 old, [{ctr}+8], rb; "
        f"atom.global.acq_rel.gpu.max.s64 old, [{ctr}+16], vb; "
        f"atom.global.acq_rel.gpu.max.s64 old, [{ctr}+24], nb; "
        f"atom.global.acq_rel.gpu.cas.b64 old, [{ctr}+32], 0, rb; setp.ne.s64 p, old, 0; @p bra S{i}P${{:uid}}; "
        f"atom.global.acq_rel.gpu.exch.b64 old, [{ctr}+40], vb; "
        f"S{i}P${{:uid}}: ld.global.b64 addr, [{ctr}+{8 * OFFENDERS}]; setp.eq.s64 p, addr, 0; @p bra {end_label}; "
        # The block is full when its last entry's key is set (read once: a fault storm costs one load).
        f"ld.global.b64 t, [addr+8]; mul.lo.s64 t, t, {8 * OFF_ENTRY}; add.s64 old, addr, t; "
        f"ld.global.b64 old, [old+{8 * (OFF_HEADER - OFF_ENTRY)}]; setp.ne.s64 p, old, 0; @p bra S{i}D${{:uid}}; "
        "mov.b64 h, rb; "
        + _fmix("h", "s")
        + "xor.b64 h, h, vb; "
        + _fmix("h", "s")
        + "xor.b64 h, h, qb; "
        + _fmix("h", "s")
        + "or.b64 h, h, 1; "
        # The walk counts the block's capacity down (its low 32-bit word: at most 256) instead of comparing with an
        # end address, and the block's address is read again after the walk (the capacity and the address are fixed
        # with the arena): one 32-bit register is live through the walk, where the record's registers peak (the
        # compare-and-swap's register quad beside the key and the words), not a 64-bit end and the address. Fault
        # path only; tests/test_register_rule.py holds the kernels that use it to their twins' registers.
        f"ld.global.b32 k, [addr+8]; add.s64 e, addr, {8 * OFF_HEADER}; "
        + walk_ptx("k", "h", "qb", "vb", "rb", f"S{i}D${{:uid}}", tag=f"S{i}", left=True)
        + f"S{i}D${{:uid}}: ld.global.b64 addr, [{ctr}+{8 * OFFENDERS}]; "
        f"atom.global.acq_rel.gpu.add.u64 old, [addr+{8 * OFF_DONE}], 1; "
        f"{end_label}: "
    )


@triton.constexpr_function
def _wide(dst: str, src: str, bits: int) -> str:
    """``dst`` = operand ``src`` as a 64-bit register: sign-extended from 32 bits, or ``src`` itself (empty code)."""
    return f"cvt.s64.s32 {dst}, {src}; " if bits == 32 else ""


@triton.constexpr_function
def _lanes_ptx(row_bits: int, value_bits: tuple[int, ...], req_bits: int) -> str:
    """The record of ``len(value_bits)`` sites for one lane. Operands: $0 (unused output), then the sites' flags
    (b32), their counter rows' addresses, the lane's row, the sites' values and, with ``req_bits`` (0: none), the
    lane's request (negative: not known). The row, values and request come in their own width (``*_bits``: 32 or
    64) and are sign-extended on the fault path only: a 32-bit index occupies one register beside the hot path,
    not two, and the clean lanes run no conversion. One branch skips it all for a clean lane, so a clean program
    runs a compare and a branch and waits for nothing. Every atomic is acq_rel at gpu scope, as Triton's default
    atomics in the block helpers (a later word is ordered after the count), but an offender's ROW, exchanged last
    with release at system scope as in the walk. ${:uid} makes the labels unique per copy of the block."""
    n = len(value_bits)
    bad = [f"${1 + i}" for i in range(n)]
    ctr = [f"${1 + n + i}" for i in range(n)]
    row = f"${1 + 2 * n}"
    val = [f"${2 + 2 * n + i}" for i in range(n)]
    req = f"${2 + 3 * n}"
    any_bad = "mov.b32 w, " + bad[0] + "; " + "".join(f"or.b32 w, w, {b}; " for b in bad[1:])
    if req_bits:
        # A request's word: biased, or 0 where it is not known (negative).
        wide_req = req if req_bits == 64 else "t"
        requests = (
            _wide("t", req, req_bits) + f"setp.lt.s64 p, {wide_req}, 0; " + _biased("qb", wide_req)
            + "selp.b64 qb, 0, qb, p; "
        )  # fmt: skip
    else:
        requests = "mov.b64 qb, 0; "
    return (
        "{ .reg .pred p; .reg .b32 w, k; .reg .b64 t, rb, vb, nb, qb, h, s, addr, e, old; "
        + any_bad
        + "setp.eq.s32 p, w, 0; @p bra DONE${:uid}; "
        + _wide("t", row, row_bits)
        + _biased("rb", row if row_bits == 64 else "t")
        + requests
        + "".join(_site(i, bad[i], ctr[i], val[i], value_bits[i]) for i in range(n))
        + "DONE${:uid}: mov.u32 $0, 0; }"
    )


@triton.constexpr_function
def _constraints(row_bits: int, value_bits: tuple[int, ...], req_bits: int) -> str:
    n = len(value_bits)
    widths = [row_bits, *value_bits] + ([req_bits] if req_bits else [])
    ops = ["r"] * n + ["l"] * n + ["r" if b == 32 else "l" for b in widths]
    return "=r," + ",".join(ops)


@triton.constexpr_function
def _width(dtype):  # type: ignore[no-untyped-def]
    """The record's operand width for an integer ``dtype``: signed integers of 32 bits or fewer go as 32
    (sign-extended in the record), anything else as 64."""
    return 32 if dtype.is_int_signed() and dtype.primitive_bitwidth <= 32 else 64


@triton.constexpr_function
def _widths(req, row, values):  # type: ignore[no-untyped-def]
    """``(row_bits, value_bits, req_bits)`` of a record over blocks of these dtypes (``req``: None, 0 bits)."""
    return _width(row), tuple(_width(v) for v in values), 0 if req is None else _width(req)


@triton.constexpr_function
def _record_ptx(req, row, *values):  # type: ignore[no-untyped-def]
    """The PTX of a lane record over blocks of these dtypes (``req``: None for no request)."""
    return _lanes_ptx(*_widths(req, row, values))


@triton.constexpr_function
def _record_constraints(req, row, *values):  # type: ignore[no-untyped-def]
    """The operand constraints of :func:`_record_ptx`'s record."""
    return _constraints(*_widths(req, row, values))


@triton.jit
def _flag(bad):
    return (bad != 0).to(tl.int32)


@triton.constexpr_function
def _operand_dtype(dtype):  # type: ignore[no-untyped-def]
    return tl.int32 if _width(dtype) == 32 else tl.int64


@triton.jit
def _operand(x):
    """An integer block as the record's operand, in its width (:func:`_width`)."""
    return x.to(_operand_dtype(x.dtype))


@triton.jit
def _addr(ctr_ptr):
    return ctr_ptr.to(tl.int64, bitcast=True)


@triton.jit
def _lane_records(ctr_ptrs, bads, rows, values, reqs):
    """tripwire.triton.record_lanes, compiled: the PTX record of 1 to 3 sites over the lanes of the blocks (flags as
    int32, the rows' addresses as int64; rows, values and requests in their own width, :func:`_operand`; without
    ``reqs`` no request operand: not known). One call per number of sites, with and without requests: an asm's
    operand list is a literal in Triton, not one that can be built up piecewise."""
    if len(bads) == 1:
        if reqs is None:
            tl.inline_asm_elementwise(
                _record_ptx(None, rows.dtype, values[0].dtype),
                _record_constraints(None, rows.dtype, values[0].dtype),
                [_flag(bads[0]), _addr(ctr_ptrs[0]), _operand(rows), _operand(values[0])],
                dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip
        else:
            tl.inline_asm_elementwise(
                _record_ptx(reqs.dtype, rows.dtype, values[0].dtype),
                _record_constraints(reqs.dtype, rows.dtype, values[0].dtype),
                [_flag(bads[0]), _addr(ctr_ptrs[0]), _operand(rows), _operand(values[0]), _operand(reqs)],
                dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip
    elif len(bads) == 2:
        if reqs is None:
            tl.inline_asm_elementwise(
                _record_ptx(None, rows.dtype, values[0].dtype, values[1].dtype),
                _record_constraints(None, rows.dtype, values[0].dtype, values[1].dtype),
                [_flag(bads[0]), _flag(bads[1]), _addr(ctr_ptrs[0]), _addr(ctr_ptrs[1]), _operand(rows),
                 _operand(values[0]), _operand(values[1])],
                dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip
        else:
            tl.inline_asm_elementwise(
                _record_ptx(reqs.dtype, rows.dtype, values[0].dtype, values[1].dtype),
                _record_constraints(reqs.dtype, rows.dtype, values[0].dtype, values[1].dtype),
                [_flag(bads[0]), _flag(bads[1]), _addr(ctr_ptrs[0]), _addr(ctr_ptrs[1]), _operand(rows),
                 _operand(values[0]), _operand(values[1]), _operand(reqs)],
                dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip
    else:
        if reqs is None:
            tl.inline_asm_elementwise(
                _record_ptx(None, rows.dtype, values[0].dtype, values[1].dtype, values[2].dtype),
                _record_constraints(None, rows.dtype, values[0].dtype, values[1].dtype, values[2].dtype),
                [_flag(bads[0]), _flag(bads[1]), _flag(bads[2]), _addr(ctr_ptrs[0]), _addr(ctr_ptrs[1]),
                 _addr(ctr_ptrs[2]), _operand(rows), _operand(values[0]), _operand(values[1]), _operand(values[2])],
                dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip
        else:
            tl.inline_asm_elementwise(
                _record_ptx(reqs.dtype, rows.dtype, values[0].dtype, values[1].dtype, values[2].dtype),
                _record_constraints(reqs.dtype, rows.dtype, values[0].dtype, values[1].dtype, values[2].dtype),
                [_flag(bads[0]), _flag(bads[1]), _flag(bads[2]), _addr(ctr_ptrs[0]), _addr(ctr_ptrs[1]),
                 _addr(ctr_ptrs[2]), _operand(rows), _operand(values[0]), _operand(values[1]), _operand(values[2]),
                 _operand(reqs)],
                dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip
