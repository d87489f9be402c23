"""A guard hit written on the host into a CPU arena row, word for word as a kernel's fault path writes it: the count
first, then the extremes and the first-offender pair, then the offender entry, and the offender block's
recorded-hits word last (:mod:`tripwire.layout`).

For a test or a measurement that needs a hit at a chosen instant without a kernel launch (an interpreted launch takes
milliseconds). A row written without its offender block's last word is a hit whose offenders never land: the reader
then waits for them (``tripwire._runtime.confirm.OFFENDERS_WAIT_S``) before it reports, which is a different event
from the one a kernel makes.
"""

from __future__ import annotations

import torch

from ..layout import GUARD_BIAS, SLOTS, VALUE_MAX, encode

__all__ = ["write_hit"]


def write_hit(ctr: torch.Tensor, row: int, value: int, *, n: int = 1, request: int | None = None) -> None:
    """Record ``n`` hits at ``row`` with ``value`` (and the engine's ``request``, when known) in ``ctr``, a CPU int64
    ``[SLOTS]`` counter row (``Monitor.counter(site, "cpu")``), the way ``tripwire.triton.record_hit`` records them
    from one program. A counter of one's own (no offender block behind it) gets the row's words only."""
    from ..validate._torch import _fault, offender_block

    if not isinstance(ctr, torch.Tensor) or ctr.dtype != torch.int64 or tuple(ctr.shape) != (SLOTS,):
        got = f"{tuple(ctr.shape)} {ctr.dtype}" if isinstance(ctr, torch.Tensor) else type(ctr).__name__
        raise ValueError(f"write_hit: ctr must be an int64 [{SLOTS}] counter row, got {got}")
    if ctr.device.type != "cpu":
        raise ValueError(f"write_hit: ctr must be a CPU counter row (a kernel writes a GPU one), got {ctr.device}")
    for what, v in (("row", row), ("value", value), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"write_hit: {what} must be an int, got {type(v).__name__}")
    if n < 1:
        raise ValueError(f"write_hit: n must be >= 1, got {n}")
    encode(row)  # ValueError naming the range for a row or value no word can hold
    encode(value)
    if request is not None and (isinstance(request, bool) or not isinstance(request, int) or request < 0):
        raise ValueError(f"write_hit: request must be None or an int >= 0, got {request!r}")
    lanes = torch.zeros(n, dtype=torch.int64)
    q = 0 if request is None else min(request, VALUE_MAX) + GUARD_BIAS
    _fault(ctr, offender_block(ctr), lanes, lanes + row, lanes + value, lanes + q)
