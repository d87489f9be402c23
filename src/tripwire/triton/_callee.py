"""The out-of-line fault path's calls across Triton versions and the interpreter: which helper functions can be
called out of line (``noinline``) and which must be inlined, the PTX claims that use no shared memory, and loop
bounds the interpreter takes. ``tripwire.triton`` imports what it needs from here; nothing here is public but
:data:`CALLEE_SMEM_SAFE`, which ``tripwire.triton`` exports (and ``interpreting`` and the launch recorder, which the
launchers share).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import triton
import triton.language as tl

from ..layout import E_REQ as _E_REQ
from ..layout import E_ROW as _E_ROW
from ..layout import E_VALUE as _E_VALUE
from ..layout import OFF_ENTRY as _OFF_ENTRY


def _version(v: str) -> tuple[int, int]:
    major, minor = [*v.split("+")[0].split("."), "0"][:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``) rather than compiling them (the one
    test of it: the kernels' launchers and the fused FP8 counter call this too)."""
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; older ones read the variable directly
    return bool(knobs.runtime.interpret) if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"


# How the launches of this process run is one question with three answers: interpreted (above), compiled and run, or
# recorded instead of run (tripwire.resources.capture_launches). The recorder is here, beside the interpreter's test,
# so that both the launchers (tripwire.kernels) and the register budget (tripwire.triton._budget) read it from below.
# The open recorded_launches() blocks (a count: they nest).
_recording = 0
# The innermost block's compiler: (jit function, args, kwargs) -> Triton's compiled kernel, for the GPU target the
# recorder compiles for (a launcher that compiles before it launches asks it: tripwire.triton._budget).
_recorded_compile: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None = None


def recording() -> bool:
    """Whether launches are being recorded instead of run (within :func:`recorded_launches`)."""
    return _recording > 0


def recorded_compile() -> Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None:
    """The innermost :func:`recorded_launches` block's compiler, or None (none open, or one opened without)."""
    return _recorded_compile


@contextmanager
def recorded_launches(compile: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None = None) -> Iterator[None]:
    """Within it the launchers take CPU tensors without Triton's interpreter: their launches are being recorded
    instead of run (nothing reaches a driver), to be compiled for a GPU target from the recorded arguments
    (``compile``, the recorder's own compiler)."""
    global _recording, _recorded_compile
    saved = _recorded_compile
    _recording += 1
    _recorded_compile = compile
    try:
        yield
    finally:
        _recording -= 1
        _recorded_compile = saved


# Before Triton 3.9 a noinline function's shared memory is the kernel's from offset 0, not the offset the caller's
# allocator reserved for the call (triton-lang/triton#11267): whatever the caller keeps live in shared memory across
# the call (a dot operand, a pipelined load's buffer) is overwritten by the callee's scratch. On those versions the
# out-of-line functions must use no shared memory. Theirs is Triton's own: a scalar atomic whose result is used is
# done by one thread and broadcast through shared memory, and a block reduction across warps goes through it too.
# So there (compiled, not interpreted): the out-of-line claims are PTX done by thread 0 with nothing broadcast
# (_first_pair_ptx, _claim_walk_ptx), and the tile functions, whose reductions span warps, are inlined.
# tests/triton/test_callee_smem.py compiles the callees for sm_90 and checks that they touch no shared memory.
CALLEE_SMEM_SAFE = _version(triton.__version__) >= (3, 9)
_PTX = tl.constexpr(not CALLEE_SMEM_SAFE and not interpreting())
_INTERP = tl.constexpr(interpreting())


def _cold(fn):  # type: ignore[no-untyped-def]
    """``@triton.jit(noinline=True)``: out of line (tripwire.triton's "cold fault path" says why)."""
    return triton.jit(noinline=True)(fn)


def _cold_block(fn):  # type: ignore[no-untyped-def]
    """Out of line where a callee's shared memory is its own (the function reduces blocks across warps, through
    shared memory); inlined before Triton 3.9 (see CALLEE_SMEM_SAFE)."""
    return triton.jit(noinline=True)(fn) if CALLEE_SMEM_SAFE else triton.jit(fn)


# The claims of the out-of-line functions as PTX (_PTX), done by thread 0 alone with nothing broadcast: Triton's
# own atomics would hand their results to the other threads through shared memory. The winner's writes are in the
# same block. ${:uid} makes the walk's labels unique per copy of the block.
_FIRST_PAIR_PTX = tl.constexpr(
    "{ .reg .pred p; .reg .b64 old; mov.u32 $0, %tid.x; setp.ne.u32 p, $0, 0; @p bra DONE${:uid}; "
    "atom.global.acq_rel.gpu.cas.b64 old, [$1], 0, $2; setp.ne.s64 p, old, 0; @p bra DONE${:uid}; "
    "atom.global.acq_rel.gpu.exch.b64 old, [$1+8], $3; DONE${:uid}: }"
)


@triton.constexpr_function
def walk_ptx(bound: str, key: str, qb: str, vb: str, rb: str, done: str, tag: str = "", left: bool = False) -> str:
    """The offender claim as PTX, from the entry at register ``e`` up to ``bound``: ``key`` compare-and-swapped into
    each entry's KEY from 0; the entry found empty is taken (REQ ``qb``, VALUE ``vb``, then ROW ``rb`` last, released
    at system scope), one holding ``key`` means a repeat; either way, or past ``bound``, on to label ``done``. The
    caller declares ``p``, ``e`` and ``old``; ``tag`` keeps the labels apart where one block walks more than once.

    ``bound`` is the address past the last entry (a 64-bit register), or, with ``left``, a 32-bit register holding
    the number of entries from ``e`` (the block's capacity, at most 256), counted down: one register where the end
    address takes two, for a walk inlined where registers peak (tripwire.triton._lanes)."""
    test = f"setp.eq.u32 p, {bound}, 0; " if left else f"setp.ge.u64 p, e, {bound}; "
    step = f"sub.u32 {bound}, {bound}, 1; " if left else ""
    return (
        f"{tag}LOOP${{:uid}}: {test}@p bra {done}; "
        f"atom.global.acq_rel.gpu.cas.b64 old, [e], 0, {key}; setp.eq.s64 p, old, 0; @p bra {tag}WIN${{:uid}}; "
        f"setp.eq.s64 p, old, {key}; @p bra {done}; "
        f"add.s64 e, e, {8 * _OFF_ENTRY}; {step}bra {tag}LOOP${{:uid}}; "
        f"{tag}WIN${{:uid}}: st.global.b64 [e+{8 * _E_REQ}], {qb}; st.global.b64 [e+{8 * _E_VALUE}], {vb}; "
        f"atom.global.sys.release.exch.b64 old, [e+{8 * _E_ROW}], {rb}; "
    )


# Registers are few on purpose: a kernel is given the registers of its hungriest callee too.
_WALK_PTX = tl.constexpr(
    "{ .reg .pred p; .reg .b64 e, old; mov.u32 $0, %tid.x; setp.ne.u32 p, $0, 0; @p bra DONE${:uid}; "
    "mov.b64 e, $1; " + walk_ptx("$2", "$3", "$4", "$5", "$6", "DONE${:uid}") + "DONE${:uid}: }"
)


@triton.jit
def _first_pair_ptx(slot4, first_rb, first_vb):
    """Slot 4 claimed from 0 with ``first_rb`` and, on a win, slot 5 set to ``first_vb`` (``slot4``: slot 4's
    address, an int64); by thread 0, nothing returned."""
    tl.inline_asm_elementwise(
        _FIRST_PAIR_PTX, "=r,l,l,l", [slot4, first_rb, first_vb], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _claim_walk_ptx(first, end, key, rb, vb, qb):
    """``tripwire.triton._claim``'s walk over the entries from ``first`` to ``end`` (addresses, int64), by thread 0: the first
    empty entry taken (its words written, ROW last and released), a repeat of ``key`` ends it."""
    tl.inline_asm_elementwise(
        _WALK_PTX, "=r,l,l,l,l,l,l", [first, end, key, qb, vb, rb], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _bound(k):
    """``k`` (a scalar computed in the kernel) as a ``range`` bound. Triton 3.6's interpreter holds such a scalar as
    a 1-element array, which ``range`` cannot take (it calls ``int()`` on it): there the bound is the array as a
    0-d one. Compiled, ``k`` itself: the loops stay the for loops they are (a while loop instead raised registers)."""
    if _INTERP:
        k = k.handle.data.reshape(())
    return k
