"""The event pipeline after the copy: a landed copy's rows are confirmed (:mod:`tripwire._runtime.confirm`), the confirmed
rises go to their kind's reporter (:mod:`tripwire._runtime.report`), which arms the stop where its rules say so and submits
a report to the window, and the reports the window lets out go to the log and, as events, to the sinks
(:mod:`tripwire.sinks`).

Everything here but :meth:`Pipeline.take_events` and the sinks' delivery runs under the monitor's lock; the sinks
are called once it is released (a slow sink must not hold the lock other threads take).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..contain import RequestNames, VerdictLedger
from ..errors import GuardTripped
from ..sinks import Event, Log, SinkSet, stop_event
from ..sites import SiteRegistry
from .confirm import Confirmed, Confirmer
from .hit import Hit, named
from .report import Report, ReportContext, Reporters, ReportWindow, decode_rows

if TYPE_CHECKING:
    from ..config import Settings
    from .reader import DeviceReader

log = logging.getLogger("tripwire")


class Callbacks(list):  # type: ignore[type-arg]
    """A list of callbacks (arm listeners, tick hooks): ``add`` refuses what is not callable, ``discard`` ignores
    what is not there, ``call(arg)`` calls each in order and logs (never raises) a failing one."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def add(self, fn: Callable[..., Any]) -> None:
        if not callable(fn):
            raise TypeError(f"{self.what} must be callable, got {fn!r}")
        self.append(fn)

    def discard(self, fn: Callable[..., Any]) -> None:
        if fn in self:
            self.remove(fn)

    def call(self, arg: Any) -> None:
        for fn in list(self):
            try:
                fn(arg)
            except Exception:
                log.exception("%s %r failed", self.what, fn)


class Pipeline:
    """One monitor's confirmer, reporters, report window, log and sinks. Given the monitor's parts, never the
    monitor: ``registry``, ``settings()`` (the monitor's settings, read when used), ``requests`` (its request names),
    ``arm(exc)`` and ``armed()`` (its stop). :attr:`context` is what the reporters get."""

    def __init__(
        self,
        registry: SiteRegistry,
        settings: Callable[[], Settings],
        requests: RequestNames,
        arm: Callable[[GuardTripped], None],
        armed: Callable[[], GuardTripped | None],
    ) -> None:
        self.registry = registry
        self.settings = settings
        self.requests = requests
        self.reporters = Reporters()
        s = settings()
        self.confirmer = Confirmer(registry, s.capacity, self.reporters.count_slots)
        # The window and the sink-failure log follow the monitor's setting (read when used).
        self.window = ReportWindow(lambda: settings().report_every, self._release)
        self.log = Log()
        self.sinks = SinkSet(lambda: settings().report_every)
        self.ledger = VerdictLedger(s.offenders)
        self.context = ReportContext(registry, settings, requests, self.ledger, self.submit, arm, armed)
        self._events: list[Event] = []
        self.arm_listeners = Callbacks("an arm listener")
        self._stops: list[GuardTripped] = []  # armed under the monitor's lock, delivered once it is released
        self._sync_due = False  # the sinks' health is due (a stop, a reset, a new sink)
        # One delivery at a time (deliver_queued); reentrant: a sink or arm listener may arm the stop, which delivers.
        self._delivering = threading.RLock()

    def process(self, device: str, rows: np.ndarray, now: float, *, final: bool, offenders: Any = None) -> None:
        """A landed copy of ``device``'s rows (every row complete when ``final``): confirm, report. ``offenders``:
        the offender blocks that came with it, by row (None where the arena keeps none)."""
        confirmed = self.confirmer.process(device, rows, final=final, offenders=offenders, now=now)
        for kind in self.confirmer.kinds:
            # Reporters are made lazily and reset() drops them; heartbeats tick only those that exist.
            self.reporters.make(kind)
        self._confirm(device, confirmed, now)

    def process_read(self, reader: DeviceReader, rows: np.ndarray, now: float, *, final: bool) -> None:
        """:meth:`process` a copy ``reader`` landed, with the offender blocks it brought; then ask the reader for the
        blocks of the rows still pending, so that its next copy brings them (a quiet tick copies no block)."""
        blocks = reader.landed_offenders if reader.offenders is not None else None
        self.process(reader.name, rows, now, final=final, offenders=blocks)
        reader.want_offenders(self.confirmer.pending(reader.name))

    def report_now(self, device: str, rows: dict[int, np.ndarray], now: float) -> None:
        """Report the rises ``rows`` show (a complete read of those rows: a verdict's) at once: confirmed without
        waiting, and released past the report window (a contained request is explained when it fails, not a window
        later). Under the monitor's lock; the events go out at its next delivery."""
        confirmed = self.confirmer.confirm_now(device, rows)
        self._confirm(device, confirmed, now)
        # Every row's key, not only the ones confirmed here: a rise the reader confirmed first may be waiting in the
        # window (its report deferred), and the engine is about to act on it.
        self.window.flush_keys([(device, rid) for rid in rows], now)

    def locked_report(self, lock: Any, deliver: Callable[[], None]) -> Callable[[str, dict[int, np.ndarray]], None]:
        """:meth:`report_now` under the monitor's ``lock``, then ``deliver`` (outside it, as every delivery): what a
        verdict ring calls with its rows, so that a verdict's rises have reached the sinks before its ``take``
        returns and the engine acts on it. Nothing under ``off``."""

        def report(device: str, rows: dict[int, np.ndarray]) -> None:
            if self.settings().mode != "off":
                with lock:
                    self.report_now(device, rows, time.monotonic())
                deliver()

        return report

    def lose(self, device: str, now: float) -> None:
        """``device``'s reader is lost: report what it had seen rising (nobody polls it again)."""
        self._confirm(device, self.confirmer.lose(device), now)

    def _confirm(self, device: str, confirmed: list[Confirmed], now: float) -> None:
        for site, row in confirmed:
            self.reporters.make(site.kind).confirm(self.context, device, site, row, now)

    def tick(self, now: float) -> None:
        """Once per Python tick: release the reports whose window passed, tick the reporters (heartbeats)."""
        self.window.flush_due(now)
        latest = self.confirmer.all_latest()
        for reporter in self.reporters.made():
            reporter.tick(self.context, latest, now)

    def _release(self, report: Report) -> None:
        """The window let ``report`` out: log it now, queue its events for the sinks."""
        w = report.wording
        self.log.write(w.line, key=report.key, detail=w.detail, explanation=w.explanation, level=report.level)
        if self.sinks:
            self._events.extend(report.events)

    def submit(self, key: tuple[str, int], total: int, now: float, render: Callable[[int], Report]) -> None:
        self.window.submit(key, total, now, render)

    def duty_wait(self, now: float) -> float:
        """How long the reader thread may leave every tick to the native thread: until the next deferred report is
        due, and at most a quarter of the heartbeat (the numeric instruments' heartbeats run on Python ticks)."""
        s = self.settings()
        wait = max(s.interval, s.heartbeat / 4)
        due = self.window.next_due(now)
        return wait if due is None else min(wait, due)

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def queue_stop(self, exc: GuardTripped) -> None:
        """The stop was armed with ``exc`` (under the monitor's lock): its listeners and sinks get it at the next
        delivery."""
        self._stops.append(exc)

    def drop_stops(self) -> None:
        """The stop was disarmed (reset): stops not delivered yet are dropped, and the sinks' health is due."""
        self._stops.clear()
        self._sync_due = True

    def add_sink(self, sink: Callable[[Event], None]) -> bool:
        """Add ``sink`` (False when it was there already); a new sink gets the health at the next delivery."""
        added = self.sinks.add(sink)
        self._sync_due |= added
        return added

    def take_delivery(self) -> tuple[list[GuardTripped], list[Event], bool]:
        """Under the monitor's lock: the stops armed and the events released since the last delivery, and whether
        the health is due now (after a stop, a reset or a new sink; else the sinks send it now and then)."""
        stops, self._stops = self._stops, []
        urgent, self._sync_due = self._sync_due or bool(stops), False
        return stops, self.take_events(), urgent

    def deliver_queued(self, lock: Any, health: Callable[[], Any], *, wait: bool = True) -> None:
        """Take what is queued under the monitor's ``lock`` and :meth:`deliver` it outside it, one delivery at a time:
        when a waiting call returns, every event queued before it has reached the sinks, whichever thread took them
        (a verdict's take relies on it). ``wait=False`` (the reader's tick) leaves the queue to the next delivery
        while another thread delivers, so a slow sink there never holds the reader up."""
        if not self._delivering.acquire(blocking=wait):
            return
        try:
            with lock:
                taken = self.take_delivery()
            self.deliver(taken, health)
        finally:
            self._delivering.release()

    def deliver(self, taken: tuple[list[GuardTripped], list[Event], bool], health: Callable[[], Any]) -> None:
        """Outside the monitor's lock: what :meth:`take_delivery` took, the stops to the arm listeners, then the events
        and the stops' events, with ``health``, to the sinks."""
        stops, events, urgent = taken
        for exc in stops:
            self.arm_listeners.call(exc)
        self.sinks.deliver([*events, *map(stop_event, stops)], health, urgent=urgent)

    def decode(self, device: str, rows: np.ndarray, offenders: Any = None) -> dict[tuple[str, str], Hit]:
        """The snapshot of ``device``'s rows: requests by the engine's ids, and for the rows a verdict ring covers the
        offenders its verdicts consumed first (the device block holds only the step's since)."""
        out = decode_rows(self.registry, self.reporters, device, rows, offenders)
        name = self.requests.name
        for key, hit in out.items():
            hit = named(hit, name)
            site = self.registry.get(key[1])
            if self.ledger.covers(device, site.id):
                kept = self.ledger.offenders(device, site.id)
                hit = replace(hit, offenders=kept + tuple(o for o in hit.offenders if o not in kept))
            out[key] = hit
        return out

    def counts(self) -> dict[str, dict[str, int]]:
        """Per device, each site's count as the reports let out so far said it (the latest report's total): what
        the log and the sinks were told. A rise the reader confirmed while the window defers its report is not in
        it until that report goes out (a later tick, or drain)."""
        sites = self.registry.all()
        out: dict[str, dict[str, int]] = {}
        for (device, rid), total in sorted(self.window.reported().items()):
            out.setdefault(device, {})[sites[rid].name] = total
        return out

    def clear(self) -> None:
        """Forget every confirmation, deferred report and reporter (reporters keep per-row state too). Events
        already released stay queued for the sinks."""
        self.confirmer.clear()
        self.window.clear()
        self.reporters.clear()
        self.ledger.clear()
