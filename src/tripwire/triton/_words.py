"""The words of a guard row that a kernel forms: values saturated into the encodable range and biased, the offender
key, the request words (tripwire.layout has the encoding; include/tripwire/guard.cuh forms the same words)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..layout import GUARD_BIAS as _GUARD_BIAS_INT
from ..layout import KEY_MIX as _KEY_MIX
from ..layout import VALUE_MAX as _VALUE_MAX
from ..layout import VALUE_MIN as _VALUE_MIN

# A constexpr, because a plain module-level int is not readable from a @triton.jit body.
GUARD_BIAS = tl.constexpr(_GUARD_BIAS_INT)
# Values are saturated into the encodable range before biasing: corrupted int64 metadata (uninitialised memory,
# a pointer-sized junk value) must not wrap around the bias and be reported as something else, or as nothing.
_VMIN = tl.constexpr(_VALUE_MIN)
_VMAX = tl.constexpr(_VALUE_MAX)
# The offender key's finalizer multipliers (tripwire.layout.offender_key; include/tripwire/guard.cuh computes the same
# key), as the int64 numbers with their bits: int64 multiplication wraps like the unsigned one.
_M1 = tl.constexpr(_KEY_MIX[0] - (1 << 64))
_M2 = tl.constexpr(_KEY_MIX[1] - (1 << 64))


@triton.jit
def _saturate(x):
    return tl.minimum(tl.maximum(x, _VMIN), _VMAX)


@triton.jit
def _fmix(h):
    # `>>` is arithmetic on int64: masking the 31 bits that remain makes it the logical shift.
    h = h ^ ((h >> 33) & 0x7FFFFFFF)
    h = h * _M1
    h = h ^ ((h >> 33) & 0x7FFFFFFF)
    h = h * _M2
    return h ^ ((h >> 33) & 0x7FFFFFFF)


@triton.jit
def _offender_key(rb, vb, qb):
    """A non-zero 64-bit key of an offender's biased row, value and request words (tripwire.layout.offender_key:
    chained finalizers in wrapping int64 arithmetic, not a linear mix, whose collisions the bias would hit)."""
    return _fmix(_fmix(_fmix(rb) ^ vb) ^ qb) | 1


@triton.jit
def _req_words(reqs, like):
    """Biased request words of ``reqs`` broadcast to ``like``'s shape; 0 (not known) when ``reqs`` is None and for
    negative request ids (the convention for "this lane has no request": padding, a lookup that found none)."""
    # if/else, not an early return: the compiler (unlike the interpreter) goes on past a `return` inside a static
    # `if` and would then call .to() on None.
    if reqs is None:
        q = like * 0
    else:
        r = tl.cast(reqs, tl.int64) + like * 0  # a plain number too (record_hit's req)
        q = tl.where(r < 0, 0, _saturate(r) + GUARD_BIAS)
    return q
