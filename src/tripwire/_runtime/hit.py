"""A counter row decoded on the host: :class:`Hit` (the guard layout's words, :mod:`tripwire.layout`), its offender
block's entries, and the engine's request ids put back in place of the numbers kernels keep."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..layout import (
    COUNT,
    E_KEY,
    E_REQ,
    E_ROW,
    E_VALUE,
    FIRST_ROW,
    FIRST_VALUE,
    MAX_ROW,
    MAX_VALUE,
    NEG_MIN,
    OFF_ENTRY,
    OFF_HEADER,
    SLOTS,
    decode,
    decode_neg,
)
from ..sinks import Offender


@dataclass(frozen=True)
class Hit:
    """A decoded row. ``first_row``/``first_value`` are one real hit; the extremes are independent lifetime extremes
    (the max row and the max value may come from different hits). None where nothing was recorded.

    ``kind``: the row's kind (``"guard"``, ``"nonfinite"``: the guard layout; ``"clip"``: ``count`` is the K plus V
    elements clipped, and the other fields are None: ``ClipCounter.totals()`` has the split and the maxima).
    ``offenders``: the first K distinct offenders kept on the device (``TRIPWIRE_OFFENDERS``), in claim order
    (:mod:`tripwire.layout`):
    :class:`tripwire.sinks.Offender` (row, value, request: None where the kernel had no row-to-request map). More
    than K distinct offenders keep the first K; the count stays exact."""

    count: int
    first_row: int | None
    first_value: int | None
    max_row: int | None
    max_value: int | None
    min_value: int | None
    offenders: tuple[Offender, ...] = ()
    kind: str = "guard"

    @classmethod
    def from_row(cls, row: np.ndarray, kind: str = "guard") -> Hit:
        """Decode a guard-layout row (the one place a row becomes a Hit). A row read with its offender block carries
        the block after its ``SLOTS`` words."""
        return cls(
            count=int(row[COUNT]),
            first_row=decode(int(row[FIRST_ROW])),
            first_value=decode(int(row[FIRST_VALUE])),
            max_row=decode(int(row[MAX_ROW])),
            max_value=decode(int(row[MAX_VALUE])),
            min_value=decode_neg(int(row[NEG_MIN])),
            offenders=decode_offenders(row[SLOTS:]) if row.shape[0] > SLOTS else (),
            kind=kind,
        )


def decode_offenders(block: np.ndarray) -> tuple[Offender, ...]:
    """The offenders of a row's offender block (tripwire.layout), in claim order: the claimed entries whose owner's
    words have landed (a claimed entry still being written is left out)."""
    out = []
    for entry in block[OFF_HEADER:].reshape(-1, OFF_ENTRY):
        if entry[E_KEY] == 0:
            break  # entries are claimed in order: the first free one ends the list
        row, value = decode(int(entry[E_ROW])), decode(int(entry[E_VALUE]))
        if row is None or value is None:
            continue
        out.append(Offender(row, value, decode(int(entry[E_REQ]))))
    return tuple(out)


def named(hit: Hit, name: Callable[[Any], Any]) -> Hit:
    """``hit`` with its offenders' request numbers turned into the engine's request ids (``name``: a monitor's
    ``requests.name``; a number nobody named stays as it is)."""
    if not any(o.request is not None for o in hit.offenders):
        return hit
    return replace(
        hit, offenders=tuple(o if o.request is None else o._replace(request=name(o.request)) for o in hit.offenders)
    )
