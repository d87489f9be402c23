"""Reports: the reporters of each kind of row, their wording, and the aggregation window.

A confirmed rise (:mod:`tripwire._runtime.confirm`) goes to its kind's reporter, which arms the stop where its rules say so
and submits a report to the :class:`ReportWindow`. The window lets at most one report per site and device out per
``report_every`` seconds, carrying the whole delta since the previous one; nothing is dropped (deferred reports go
out on later ticks and at drain). A report that goes out is a :class:`Report`: its events (for the sinks) and its
wording (for the log): a first line of at most 200 characters, a detail line, and the explanation the log shows
once per site.

Reporters are plugged in per row kind with :func:`register_reporter` (the numeric instruments do it at import);
guard rows (kind ``"guard"``) have :class:`GuardReporter`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from ..errors import GuardTripped
from ..layout import (
    COUNT,
    VALUE_MAX,
    VALUE_MIN,
)
from ..sinks import LINE_LIMIT, Event, Offender
from ..sites import GUARD_KINDS, Site, SiteRegistry
from .hit import Hit, named

if TYPE_CHECKING:
    from ..config import Settings
    from ..contain import RequestNames, VerdictLedger


class Wording(NamedTuple):
    """A report's words: ``line`` (at most 200 characters: site, device, delta, total, first offender),
    ``detail`` (the rest of the numbers), ``explanation`` (what they mean and what to look at; the log shows it
    once per site). ``str()`` joins the three (an exception's message)."""

    line: str
    detail: str = ""
    explanation: str = ""

    def __str__(self) -> str:
        return " ".join(p for p in self if p)


@dataclass(frozen=True)
class Report:
    """What the window lets out: the events for the sinks and the wording for the log."""

    events: tuple[Event, ...]
    wording: Wording
    key: str  # the log explains each key once (a site's name)
    level: int = logging.WARNING


@dataclass(frozen=True)
class ReportContext:
    """What a reporter (and a verdict ring) may use of the monitor it reports for, and nothing more: its site
    registry, its settings (``settings()``: read when used; ``contain`` among them), its request names, its verdict
    ledger (the rows verdict rings cover and the offenders they consumed),
    the report window (``emit(key, total, now, render)``: one report per key and window, see :class:`ReportWindow`)
    and the stop (``arm(exc)``, ``armed()``). The monitor's pipeline makes one per monitor; reporters never hold the
    monitor itself, so nothing below the monitor imports it."""

    registry: SiteRegistry
    settings: Callable[[], Settings]
    requests: RequestNames
    ledger: VerdictLedger
    emit: Callable[[tuple[str, int], int, float, Callable[[int], Report]], None]
    arm: Callable[[GuardTripped], None]
    armed: Callable[[], GuardTripped | None]


class RowReporter(Protocol):
    """Turns confirmed rises of one kind of row into reports. ``count_slots``: the slots whose sum rising means
    new events. ``confirm`` runs under the monitor's lock on the reader thread (or drain's caller); ``tick`` runs on
    every Python tick with the latest rows of every device (heartbeats)."""

    count_slots: tuple[int, ...]

    def confirm(self, ctx: ReportContext, device: str, site: Site, row: np.ndarray, now: float) -> None: ...

    def tick(self, ctx: ReportContext, latest: dict[str, np.ndarray], now: float) -> None: ...


_FACTORIES: dict[str, Callable[[], Any]] = {}


def register_reporter(kind: str, factory: Callable[[], Any]) -> None:
    """Plug in the reporter for rows of ``kind`` (numeric instruments do this at import)."""
    _FACTORIES[kind] = factory


class Reporters:
    """One monitor's reporters, made lazily per kind (they keep per-row state, so reset() drops them)."""

    def __init__(self) -> None:
        self._made: dict[str, RowReporter] = {}

    def get(self, kind: str) -> RowReporter | None:
        """The reporter made for ``kind``, or None."""
        return self._made.get(kind)

    def make(self, kind: str) -> RowReporter:
        """The reporter for ``kind``, made on first use; KeyError when none is registered."""
        rep = self._made.get(kind)
        if rep is None:
            factory = _FACTORIES.get(kind)
            if factory is None:
                raise KeyError(f"no reporter registered for rows of kind {kind!r}")
            rep = self._made[kind] = factory()
        return rep

    def count_slots(self, kind: str) -> tuple[int, ...] | None:
        """The count slots of ``kind``'s reporter (making it), or None when no reporter is registered."""
        return tuple(self.make(kind).count_slots) if kind in _FACTORIES else None

    def slots(self, kind: str) -> tuple[int, ...] | None:
        """The count slots of ``kind`` without making its reporter (the made one's, else the factory's class
        attribute), or None when no reporter is registered. Safe outside the monitor's lock."""
        rep = self._made.get(kind)
        if rep is not None:
            return tuple(rep.count_slots)
        factory = _FACTORIES.get(kind)
        return None if factory is None else tuple(getattr(factory, "count_slots", (COUNT,)))

    def made(self) -> list[RowReporter]:
        return list(self._made.values())

    def clear(self) -> None:
        self._made.clear()


# ---------------------------------------------------------------------------------------------------- wording
def _fmt(v: int | None) -> str:
    if v is None:
        return "-"
    if v >= VALUE_MAX or v <= VALUE_MIN:
        return f"{v} (saturated: |value| >= 2**62)"
    return str(v)


def _num(v: int | None) -> str:
    """A value for the first line: the number alone (the detail line says when it is saturated)."""
    return "-" if v is None else str(v)


def _accesses(n: int) -> str:
    return f"out-of-range access{'' if n == 1 else 'es'}"


def short_name(make: Callable[[str], str], name: str, limit: int = LINE_LIMIT) -> str:
    """``make(repr(name))``, with the name shortened in the middle where the line would pass ``limit``."""
    line = make(repr(name))
    over = len(line) - limit
    if over <= 0:
        return line
    keep = max(len(name) - over - 3, 8)
    head = (keep + 1) // 2
    return make(repr(name[:head] + "..." + name[len(name) - (keep - head) :]))


def offenders_text(offenders: tuple[Offender, ...]) -> str:
    """``row 3 value 99 (request r7), ...``: the offenders kept on the device, for a report's detail line."""
    return ", ".join(
        f"row {o.row} value {_fmt(o.value)}" + ("" if o.request is None else f" (request {o.request})")
        for o in (Offender(*x) for x in offenders)
    )


def guard_wording(site: Site, device: str, hit: Hit, *, delta: int | None = None) -> Wording:
    """The words of a guard row's report (the logger's name already says tripwire, so no prefix)."""
    fatal = " (FATAL site)" if site.fatal else ""
    if delta is not None:
        what = f"{delta} new {_accesses(delta)} masked ({hit.count} total)"
    else:
        what = f"{hit.count} {_accesses(hit.count)} masked"
    first = f"First offender: row {_num(hit.first_row)}, value {_num(hit.first_value)}."
    line = short_name(lambda s: f"MASKED FAULT at site {s} on {device}{fatal}: {what}. {first}", site.name)
    detail = (
        f"Lifetime extremes: max row {_fmt(hit.max_row)}, value min {_fmt(hit.min_value)} max {_fmt(hit.max_value)}."
    )
    if hit.first_value is not None and (hit.first_value >= VALUE_MAX or hit.first_value <= VALUE_MIN):
        detail += f" First offender's value {_fmt(hit.first_value)}."
    if hit.offenders:
        detail += f" Offenders: {offenders_text(hit.offenders)}."
    desc = f" [{site.description}]" if site.description else ""
    durable = " The site is FATAL: the masked value was written somewhere durable." if site.fatal else ""
    explanation = (
        f"Those lanes did NOT compute a correct result.{desc}{durable} The first offender is one real hit; the "
        f"extremes are independent lifetime extremes, not one hit. Look at the metadata entry at the first "
        f"offender's row."
    )
    return Wording(line, detail, explanation)


def guard_message(site: Site, device: str, hit: Hit, *, delta: int | None = None) -> str:
    """The whole report of a guard row as one string (an exception's message)."""
    return str(guard_wording(site, device, hit, delta=delta))


def guard_event(site: Site, device: str, hit: Hit, delta: int) -> Event:
    """The event of a guard-layout row's report (its kind is the site's: ``"guard"`` or ``"nonfinite"``)."""
    return Event(
        kind=site.kind,
        site=site.name,
        device=device,
        delta=delta,
        total=hit.count,
        first_row=hit.first_row,
        first_value=hit.first_value,
        offenders=hit.offenders,
        time=time.time(),
        fatal=site.fatal,
    )


class GuardReporter:
    """The reporter of guard-layout rows: a report per confirmed rise (aggregated per site and device), and the
    stop armed in ``raise`` mode or for a fatal site. Subclasses change only the words (``wording``)."""

    count_slots: tuple[int, ...] = (COUNT,)
    wording = staticmethod(guard_wording)

    def confirm(self, ctx: ReportContext, device: str, site: Site, row: np.ndarray, now: float) -> None:
        ledger = ctx.ledger
        covered = ledger.covers(device, site.id)
        hit = named(Hit.from_row(row, site.kind), ctx.requests.name)
        if covered:
            # A verdict ring consumes this row's offenders every step: the reports carry the ones it consumed, then
            # the block's (the current step's, not yet taken).
            hit = replace(hit, offenders=_merged(ledger.offenders(device, site.id), hit.offenders))
        wording = self.wording

        def render(delta: int) -> Report:
            h = hit
            if covered:
                # The ledger read again when the report goes out, not only at this confirm: the ring may have consumed
                # this rise's offenders from the block before the reader's read and added them to the ledger only at
                # its take, after it. A report the window deferred (or the final drain's) then names them.
                h = replace(hit, offenders=_merged(ledger.offenders(device, site.id), hit.offenders))
            return Report((guard_event(site, device, h, delta),), wording(site, device, h, delta=delta), site.name)

        ctx.emit((device, site.id), hit.count, now, render)
        settings = ctx.settings()
        if covered and settings.contain:
            return  # the ring's same-step verdict fails the requests (or the step) and arms nothing: tripwire.verdict
        # A site no ring covers is not contained: the reader's confirmation comes too late to fail a request before
        # it is handed back (tripwire.contain), so it arms exactly as without containment.
        if site.fatal or settings.mode == "raise":
            ctx.arm(tripped_for(site, device, hit, lambda *a, **k: str(wording(*a, **k))))

    def tick(self, ctx: ReportContext, latest: dict[str, np.ndarray], now: float) -> None:
        return None


for _kind in GUARD_KINDS:
    register_reporter(_kind, GuardReporter)


def _merged(first: tuple[Offender, ...], then: tuple[Offender, ...]) -> tuple[Offender, ...]:
    return first + tuple(o for o in then if o not in first)


def tripped_for(site: Site, device: str, hit: Hit, message: Callable[..., str] = guard_message) -> GuardTripped:
    """The GuardTripped for a confirmed hit of a guard-layout row (``message`` words the report)."""
    return GuardTripped(
        "tripwire: " + message(site, device, hit) + " The engine was stopped by tripwire.check().",
        site=site.name,
        device=device,
        count=hit.count,
        first_row=hit.first_row,
        first_value=hit.first_value,
        fatal=site.fatal,
    )


def stop_line(exc: GuardTripped, mode: str) -> str:
    """The one log line of an armed stop: what stopped, why it stops in ``mode``, and what ``check()`` does now.
    The site's report (its WARNING, logged beside it) carries the numbers and their explanation, so the line repeats
    none of it (the exception's own message, which an engine shows without that report, does)."""
    if exc.count == 0:  # tripwire's own stop (a lost reader, a failed loop, a coordination failure): its reason
        what = str(exc).removeprefix("tripwire: ")
    else:
        if exc.rank is not None:
            why = f"rank {exc.rank} stopped: every coordinated rank stops"
        elif exc.fatal:
            why = "FATAL: stops in every mode"
        else:
            why = f"mode {mode}: every hit stops"
        first = "" if exc.first_row is None else f", first offender row {exc.first_row}, value {exc.first_value}"
        what = f"site {exc.site!r} on {exc.device} ({why}){first}"
    return f"stop ARMED: {what}; tripwire.check() raises until tripwire.reset()"


def decode_rows(
    registry: SiteRegistry,
    reporters: Reporters,
    device: str,
    rows: np.ndarray,
    offenders: Any = None,
) -> dict[tuple[str, str], Hit]:
    """``{(device, site name): Hit}`` for every row of ``rows`` with a non-zero count (the sum of its kind's count
    slots): guard-layout rows decoded in full (with their offender blocks when ``offenders`` has them: a mapping
    or an array by row), other layouts (clip) with the count only. Reporters are looked up, not made, so it is safe
    outside the monitor's lock."""
    out: dict[tuple[str, str], Hit] = {}
    sites = registry.all()
    for rid in np.nonzero(rows.any(axis=1))[0].tolist():
        site = sites[rid]
        slots = reporters.slots(site.kind)
        count = 0 if slots is None else int(rows[rid, list(slots)].sum())
        if count == 0:
            continue
        if site.kind in GUARD_KINDS:
            block = None if offenders is None else (offenders.get(rid) if hasattr(offenders, "get") else offenders[rid])
            row = rows[rid] if block is None else np.concatenate([rows[rid], block])
            out[(device, site.name)] = Hit.from_row(row, site.kind)
        else:
            out[(device, site.name)] = Hit(count, None, None, None, None, None, kind=site.kind)
    return out


# ---------------------------------------------------------------------------------------------------- the window
@dataclass
class _Key:
    logged_total: int = 0
    logged_at: float = float("-inf")
    total: int = 0
    render: Callable[[int], Report] | None = None  # set while a report is deferred by the window


@dataclass
class ReportWindow:
    """At most one report per key (site and device) per ``every`` seconds (a number, or a function returning it:
    the monitor's setting), each carrying the delta since the last.

    ``release(report)`` is called with each report that goes out. Not thread-safe: the monitor calls it under its
    lock."""

    every: float | Callable[[], float]
    release: Callable[[Report], None]
    _keys: dict[tuple[str, int], _Key] = field(default_factory=dict)

    def _every(self) -> float:
        return self.every() if callable(self.every) else self.every

    def submit(self, key: tuple[str, int], total: int, now: float, render: Callable[[int], Report]) -> None:
        """Release ``render(delta)`` for ``key`` now, or defer it until ``every`` has passed since the key's last
        report (then one report carries the whole delta)."""
        st = self._keys.get(key)
        if st is None:
            st = self._keys[key] = _Key()
        st.total = total
        if now - st.logged_at >= self._every():
            self._out(st, render, now)
        else:
            st.render = render

    def _out(self, st: _Key, render: Callable[[int], Report], now: float) -> None:
        delta = st.total - st.logged_total
        if delta <= 0:
            st.render = None  # nothing new since the last report: no report (and no event) of 0
            return
        st.logged_total, st.logged_at, st.render = st.total, now, None
        self.release(render(delta))

    def flush_due(self, now: float, *, force: bool = False) -> None:
        """Release the deferred reports whose window has passed (every deferred one with ``force``)."""
        for st in self._keys.values():
            if st.render is not None and (force or now - st.logged_at >= self._every()):
                self._out(st, st.render, now)

    def flush_keys(self, keys: list[tuple[str, int]], now: float) -> None:
        """Release the deferred reports of ``keys`` now, whatever their window says."""
        for key in keys:
            st = self._keys.get(key)
            if st is not None and st.render is not None:
                self._out(st, st.render, now)

    def next_due(self, now: float) -> float | None:
        """Seconds until the earliest deferred report is due (0 when overdue), or None when none is deferred."""
        every = self._every()
        due = [st.logged_at + every - now for st in self._keys.values() if st.render is not None]
        return max(min(due), 0.0) if due else None

    def deferred(self) -> int:
        return sum(st.render is not None for st in self._keys.values())

    def reported(self) -> dict[tuple[str, int], int]:
        """Per key, the total the reports let out so far carried (a deferred rise is not in it): what the log and
        the sinks have been told."""
        return {key: st.logged_total for key, st in self._keys.items() if st.logged_total > 0}

    def clear(self) -> None:
        self._keys.clear()
