"""Containment: a masked fault fails the request it hit instead of the engine.

A guard row keeps its first K distinct offenders with the request each belongs to (where the kernel had a
row-to-request map: :mod:`tripwire.layout`). Engines name their requests with strings; kernels take integers:
:class:`RequestNames` (``Monitor.requests``) gives each engine id a number for the kernels' request maps and turns the
numbers back into the engine's ids in reports, events and taints (an operator greps the engine's own logs for them).

Containment is ONE monitor setting, ``contain``: ``Monitor(contain=True)``, ``TRIPWIRE_CONTAIN=1``, or
:meth:`tripwire.Monitor.set_contain` (the call an integration's ``install(contain=True)`` makes). Reading a verdict or
its taints never changes it.

There is one containment path: the same-step verdict (:mod:`tripwire.verdict`). An engine's verdict ring decides,
for the sites it covers, before any request of the step is handed back: under containment it names the requests to
fail (:class:`Taint`) and arms nothing. The reader still reports those sites' rises (its reports carry the offenders
the verdicts consumed, which :class:`VerdictLedger` keeps) and, under containment, leaves the decision to the ring.
A site no ring covers is never contained: the reader's verdict comes about two reader intervals after the kernel
ran, so a request that finishes sooner would be handed back with its masked result as a success; such a site arms
the stop exactly as without containment (a fatal site, or any hit in ``raise`` mode).

Fail closed: a rise a verdict cannot attribute in full (an offender without a request, hits without offenders, or a
full block: K distinct kept, whose count rose by more than its offenders) yields a taint with ``request=None``, and
the engine fails every request of that step (:attr:`tripwire.verdict.Verdict.fail_all`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .sinks import Offender

__all__ = ["RequestNames", "Taint", "VerdictLedger"]


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
    """What the same-step verdicts share with the reader of one monitor: the rows verdict rings cover, per device
    (under containment the reader leaves their decision to the ring), and the offenders the verdicts consumed from
    the device blocks (the first K distinct of each row's life: the block holds only the current step's, and the
    reader's reports and snapshots name these first). Thread-safe: the engine's verdicts add, the reader reads."""

    def __init__(self, offenders_per_row: int) -> None:
        self._k = offenders_per_row
        self._lock = threading.Lock()
        self._covered: set[tuple[str, int]] = set()
        self._offenders: dict[tuple[str, int], list[Offender]] = {}

    def cover(self, device: str, row: int) -> None:
        """Mark ``row`` on ``device`` as a ring's (ValueError when another ring has it)."""
        with self._lock:
            if (device, row) in self._covered:
                raise ValueError(
                    f"row {row} on {device} is already covered by a verdict ring: a second ring would find its "
                    f"offenders consumed by the first"
                )
            self._covered.add((device, row))

    def covers(self, device: str, row: int) -> bool:
        return (device, row) in self._covered

    def add(self, device: str, row: int, offenders: tuple[Offender, ...]) -> None:
        """Keep the ``offenders`` a verdict consumed from ``row``'s block (each once, at most K)."""
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
