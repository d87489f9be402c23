"""Containment: a masked fault fails the request it hit instead of the engine.

A guard row keeps its first K distinct offenders with the request each belongs to (where the kernel had a
row-to-request map: :mod:`tripwire.layout`). Engines name their requests with strings; kernels take integers:
:class:`RequestNames` (``Monitor.requests``) gives each engine id a number for the kernels' request maps and turns the
numbers back into the engine's ids in reports, events and taints (an operator greps the engine's own logs for them).

Containment is an explicit setting (``Monitor(contain=True)``, ``TRIPWIRE_CONTAIN=1``, or an integration's
``install(contain=True)``); reading taints never changes it. Two paths decide what to fail:

* The same-step verdict (:mod:`tripwire.verdict`), for the sites an engine's verdict ring covers: the ring decides
  before the step's requests are handed back. The reader reports those sites' rises and, under containment, leaves
  the decision to the ring (:class:`VerdictLedger` says which rows it covers and holds the offenders it consumed).
* The reader, for every other site: when a rise of a NON-fatal site is confirmed, :class:`Containment` turns the
  offenders it has not seen yet into :class:`Taint` records, which the engine takes with
  :meth:`tripwire.Monitor.take_tainted`. Such a rise does not arm the stop even in ``raise`` mode, as long as every
  new hit is attributed; a fatal site still stops. Latency: a taint exists about two reader intervals after the
  kernel ran, so a request that finishes sooner is handed back with the masked result: use a verdict ring for that.

Fail closed: a rise that cannot be attributed in full -- an offender without a request, a counter without an offender
block, or a full block (K distinct kept) whose count rose by more than its new offenders (one dropped may have named
another request) -- yields a taint with ``request=None``, which an engine must treat as "fail everything", and arms
the stop under ``raise`` exactly as without containment.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._runtime.hit import Hit
    from .sinks import Offender
    from .sites import Site

__all__ = ["Containment", "RequestNames", "Taint", "VerdictLedger"]


@dataclass(frozen=True)
class Taint:
    """A request a masked fault hit (``request`` None: a hit that names no request, see the module docstring): the
    site, the device, and the offending entry (its row and value)."""

    request: int | str | None
    site: str
    device: str
    row: int | None
    value: int | None
    kind: str = "guard"

    def message(self) -> str:
        """The error an engine gives the failed request."""
        if self.kind == "nonfinite_rows":
            return (
                f"tripwire contained a numeric fault in this request at site {self.site!r} on {self.device}: its row "
                f"{self.row} held NaN/Inf (column {self.value}), so this request's result is not correct; the rest of "
                f"the batch went on"
            )
        return (
            f"tripwire contained a masked fault in this request at site {self.site!r} on {self.device}: entry row "
            f"{self.row}, value {self.value} was out of range and was masked, so this request's result is not "
            f"correct; the rest of the batch went on"
        )


class RequestNames:
    """Engine request ids <-> the numbers kernels keep with offenders. ``number(rid)`` is stable for a request while
    it is among the last ``keep`` numbered; ``name(n)`` returns its engine id, ``None`` for a number given here and
    forgotten since (a request that outlived ``keep`` newer ones: its name is unknown, so whatever it hit fails
    closed rather than naming no live request), or ``n`` itself for a number never given here (a caller's own request
    map). Thread-safe: the engine numbers, the reader names."""

    def __init__(self, keep: int = 1 << 16) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._numbers: dict[Any, int] = {}
        self._names: OrderedDict[int, Any] = OrderedDict()
        self._next = 0

    def number(self, request_id: Any) -> int:
        n = self._numbers.get(request_id)  # the hot path: one dict lookup per request per step
        if n is not None:
            return n
        with self._lock:
            n = self._numbers.get(request_id)
            if n is None:
                n = self._numbers[request_id] = self._next
                self._next += 1
                self._names[n] = request_id
                while len(self._names) > self._keep:  # the oldest requests finished long ago
                    _, old = self._names.popitem(last=False)
                    self._numbers.pop(old, None)
            return n

    def name(self, n: int) -> Any:
        got = self._names.get(n)
        if got is not None:
            return got
        return None if 0 <= n < self._next else n


class VerdictLedger:
    """The rows verdict rings cover, per device, and the offenders their verdicts consumed (the first K distinct of
    each row's life, for the reader's reports: the device block holds only the current step's). Thread-safe: the
    engine's verdicts add, the reader reads."""

    def __init__(self, offenders_per_row: int) -> None:
        self._k = offenders_per_row
        self._lock = threading.Lock()
        self._covered: set[tuple[str, int]] = set()
        self._offenders: dict[tuple[str, int], list[Offender]] = {}

    def cover(self, device: str, row: int) -> None:
        with self._lock:
            if (device, row) in self._covered:
                raise ValueError(
                    f"row {row} on {device} is already covered by a verdict ring: a second ring would find its "
                    f"offenders consumed by the first"
                )
            self._covered.add((device, row))

    def covers(self, device: str, row: int) -> bool:
        return (device, row) in self._covered

    def add(self, device: str, row: int, total: int, offenders: tuple[Offender, ...]) -> None:
        with self._lock:
            kept = self._offenders.setdefault((device, row), [])
            for o in offenders:
                if len(kept) >= self._k:
                    break
                if o not in kept:
                    kept.append(o)

    def offenders(self, device: str, row: int) -> tuple[Offender, ...]:
        with self._lock:
            return tuple(self._offenders.get((device, row), ()))

    def clear(self) -> None:
        """Forget the offenders (a reset zeroes the counters they came from); the rows stay covered."""
        with self._lock:
            self._offenders.clear()


class Containment:
    """The taints of one monitor. ``enabled``: whether attributed rises of non-fatal sites stop arming the stop (the
    monitor's ``contain`` setting, or an integration's ``install(contain=True)``; never a side effect of reading).
    Thread-safe: the reader adds, the engine takes."""

    def __init__(self, offenders_per_row: int, enabled: bool = False) -> None:
        self.enabled = enabled
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
        """The taints since the last call. Reading them changes no policy."""
        with self._lock:
            taints, self._taints = self._taints, []
            return taints

    def clear(self) -> None:
        """Forget every offender seen and every taint not taken (a reset zeroes the counters they came from)."""
        with self._lock:
            self._seen.clear()
            self._counts.clear()
            self._taints.clear()
