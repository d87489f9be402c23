"""A validator's rules as its two backends see them (pure Python: no torch kernel, no triton).

:class:`tripwire.validate.Validator` fixes one :class:`Rules` once its rules are declared; the Triton kernel
(:mod:`tripwire.validate._triton`, CUDA tensors) and the plain torch implementation (:mod:`tripwire.validate._torch`,
CPU tensors) both run from it, with the same counts, offenders and masking. It lives apart from both so that the CPU
path never imports triton.

The host clean test lives here too, once: :func:`entries_clean`, :func:`lengths_clean` and :func:`indptr_clean` say
of one rule's values, read into a Python list, that the validator would count none of them and change none. The
torch path runs them on a small tensor's ``tolist()`` (and on a large one's extremes), vLLM's CPU step check
(``tripwire.integrations.vllm._steps``) on its buffers' views, and :class:`tripwire.validate.Rule` offers them per
rule; the Triton kernel's clean test is the same rules on the device.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

INDEX, CSR = 1, 2
# Entries per program of the kernel. The validator reads a few kilobytes per call; a large block keeps the grid (and
# the launch's fixed cost) small. The torch path groups its fault-path writes by the same blocks, so the offenders'
# claim order is the kernel's.
BLOCK = 1024
# Auxiliary entries per loop iteration of an owner program (it loops over the whole lengths/indptr).
ABLOCK = 1024


@dataclass(frozen=True)
class Rules:
    """A validator's rules as the kernel sees them, fixed once they are declared: per rule its kind (``INDEX`` or
    ``CSR``), flags, bounds, mask value and the arena rows of its sites, plus which call tensors it reads (``tensor``
    and ``aux`` index the call's tensor list; ``aux`` is ``tensor`` when the rule has no lengths/indptr)."""

    kind: tuple[int, ...]
    has_pad: tuple[bool, ...]
    has_len: tuple[bool, ...]
    own_aux: tuple[bool, ...]
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    pad: tuple[int, ...]
    safe: tuple[int, ...]
    row: tuple[int, ...]
    aux_row: tuple[int, ...]
    tensor: tuple[int, ...]
    aux: tuple[int, ...]
    # Attribution: 0 none, 1 requests[row], 2 requests[segment of row] (a CSR rule: its indptr's rows); which call
    # tensors hold the requests and the segments (the rule's own tensor where unused).
    req: tuple[int, ...]
    requests: tuple[int, ...]
    segments: tuple[int, ...]


# ---------------------------------------------------------------------------------------------- the host clean test
# These run on every step of a CPU engine (vLLM's CPU build), on lists of a few dozen entries: each is one sort (one
# C call, which leaves both extremes at the ends; min() and max() would be two slower generic iterations) and a few
# comparisons. They are plain functions taking the bounds as arguments, so a caller pays one call per rule: a
# closure per rule with its bounds bound in was timed too and is no faster.


def entries_clean(vals: list[int], lo: int, hi: int, pad: int | None = None) -> bool:
    """True when every one of ``vals`` is in ``[lo, hi)`` or equal to ``pad`` (an empty list: True): an index or CSR
    rule's entries of which the validator counts none. Every entry is tested, used or not (a test that holds for all
    holds for the used ones). SORTS ``vals`` IN PLACE: pass a list of your own, such as a fresh ``tolist()``."""
    vals.sort()
    if not vals or (lo <= vals[0] and vals[-1] < hi):
        return True
    if pad is None or lo <= pad < hi:
        return False  # an entry outside the range that is not the padding
    # Sorted: the entries below lo are a prefix and those from hi on a suffix; each must be padding only, which its
    # two ends being the padding proves.
    below, above = bisect_left(vals, lo), bisect_left(vals, hi)
    return (below == 0 or vals[0] == pad == vals[below - 1]) and (above == len(vals) or vals[above] == pad == vals[-1])


def lengths_clean(vals: list[int], width: int) -> bool:
    """True when every per-row count (a table rule's ``lengths``) is in ``[0, width]``, ``width`` being the table's
    columns: none the validator counts or clamps. SORTS ``vals`` IN PLACE, like :func:`entries_clean`."""
    vals.sort()
    return not vals or (0 <= vals[0] and vals[-1] <= width)


def indptr_clean(vals: list[int], end: int) -> bool:
    """True when a CSR indptr (``vals``, B + 1 entries) starts at 0, never decreases and ends within ``end`` (the
    indices' length), so every entry is in ``[0, end]``: none the validator counts or rewrites. An empty indptr is
    not clean (the validator refuses it). ``vals`` is left as it is (its order is what is tested)."""
    return bool(vals) and vals[0] == 0 and vals[-1] <= end and vals == sorted(vals)
