"""Containment: a masked fault fails the request it hit instead of the engine.

A guard row keeps its first K distinct offenders with the request each belongs to (where the kernel had a
row-to-request map: :mod:`tripwire.layout`). When a rise of a NON-fatal site is confirmed, :class:`Containment` turns
the offenders it has not seen yet into :class:`Taint` records, which the engine takes with
:meth:`tripwire.Monitor.take_tainted` and fails request by request. With containment on, such a rise does not arm
the stop even in ``raise`` mode, as long as every new hit is attributed. A fatal site still stops (its damage is
durable, not the request's alone).

Fail closed: a rise that cannot be attributed in full -- an offender without a request, a counter without an offender
block, or a full block (K distinct kept) whose count rose by more than its new offenders (one dropped may have named
another request) -- yields a taint with ``request=None``, which an engine must treat as "fail everything", and arms
the stop under ``raise`` exactly as without containment.

Latency: a taint exists once the reader confirmed the rise, about two reader intervals after the kernel ran; a
request that finishes sooner completes with the masked result (its events still name it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .report import Hit
    from .sites import Site

__all__ = ["Containment", "Taint"]


@dataclass(frozen=True)
class Taint:
    """A request a masked fault hit (``request`` None: a hit that names no request, see the module docstring): the
    site, the device, and the offending entry (its row and value)."""

    request: int | str | None
    site: str
    device: str
    row: int | None
    value: int | None

    def message(self) -> str:
        """The error an engine gives the failed request."""
        return (
            f"tripwire contained a masked fault in this request at site {self.site!r} on {self.device}: entry row "
            f"{self.row}, value {self.value} was out of range and was masked, so this request's result is not "
            f"correct; the rest of the batch went on"
        )


class Containment:
    """The taints of one monitor. ``enabled``: whether attributed rises of non-fatal sites stop arming the stop
    (switched on by the first :meth:`take`, or by an integration). Thread-safe: the reader adds, the engine takes."""

    def __init__(self, offenders_per_row: int) -> None:
        self.enabled = False
        self._k = offenders_per_row
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int], set[tuple[int, int, object]]] = {}
        self._counts: dict[tuple[str, int], int] = {}
        self._taints: list[Taint] = []

    def note(self, site: Site, device: str, hit: Hit) -> bool:
        """A confirmed rise of a guard row: record the taints of its new offenders; True when every new hit of the
        rise is attributed to a request (the stop need not arm for it)."""
        key = (device, site.id)
        with self._lock:
            delta = hit.count - self._counts.get(key, 0)
            self._counts[key] = hit.count
            if site.fatal or delta <= 0:
                return False
            seen = self._seen.setdefault(key, set())
            new = [o for o in hit.offenders if (o.row, o.value, o.request) not in seen]
            seen.update((o.row, o.value, o.request) for o in new)
            attributed = (
                bool(hit.offenders)
                and all(o.request is not None for o in new)
                and (len(hit.offenders) < self._k or delta <= len(new))
            )
            self._taints.extend(Taint(o.request, site.name, device, o.row, o.value) for o in new)
            if not attributed and all(o.request is not None for o in new):
                self._taints.append(Taint(None, site.name, device, hit.first_row, hit.first_value))
            return attributed

    def take(self) -> list[Taint]:
        """The taints since the last call (and containment on from now)."""
        with self._lock:
            self.enabled = True
            taints, self._taints = self._taints, []
            return taints

    def clear(self) -> None:
        """Forget every offender seen and every taint not taken (a reset zeroes the counters they came from)."""
        with self._lock:
            self._seen.clear()
            self._counts.clear()
            self._taints.clear()
