"""A validator's rules as its two backends see them (pure Python: no torch kernel, no triton).

:class:`tripwire.validate.Validator` fixes one :class:`Rules` once its rules are declared; the Triton kernel
(:mod:`tripwire.validate._triton`, CUDA tensors) and the plain torch implementation (:mod:`tripwire.validate._torch`,
CPU tensors) both run from it, with the same counts, offenders and masking. It lives apart from both so that the CPU
path never imports triton.
"""

from __future__ import annotations

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
