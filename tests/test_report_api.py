"""The public reporter API (tripwire.report): its names, the older paths that still lead to them, and a reporter of
one's own written with it alone, driven by a monitor on a CPU arena."""

from __future__ import annotations

import numpy as np

import tripwire
import tripwire.monitor
import tripwire.report as report
import tripwire.sinks
from tripwire import Monitor
from tripwire.layout import COUNT

# What instruments import from here (tripwire.numerics does), by the groups of tripwire.report.__all__.
API = {
    "register_reporter",
    "RowReporter",
    "ReportContext",
    "GuardReporter",
    "Report",
    "Wording",
    "Event",
    "LINE_LIMIT",
    "short_name",
    "Hit",
    "Offender",
    "offenders_text",
    "current_rank",
}


def test_the_api_is_exported_whole():
    assert set(report.__all__) == API and len(report.__all__) == len(API)
    assert all(getattr(report, name) is not None for name in API)


def test_the_older_paths_lead_to_the_same_objects():
    """tripwire.Offender, tripwire.sinks.Offender / current_rank / Event, tripwire.Hit and the reporter names
    tripwire.monitor exports are the objects tripwire.report exports, not copies."""
    assert tripwire.Offender is tripwire.sinks.Offender is report.Offender
    assert tripwire.sinks.current_rank is report.current_rank
    assert tripwire.Event is tripwire.sinks.Event is report.Event
    assert tripwire.Hit is tripwire.monitor.Hit is report.Hit
    for name in ("GuardReporter", "ReportContext", "RowReporter", "register_reporter"):
        assert getattr(tripwire.monitor, name) is getattr(report, name), name


class _Counting:
    """A reporter of one's own: one event per confirmed rise, its words from the public helpers."""

    count_slots = (COUNT,)

    def confirm(self, ctx: report.ReportContext, device: str, site, row: np.ndarray, now: float) -> None:
        total = int(row[COUNT])

        def render(delta: int) -> report.Report:
            line = report.short_name(lambda n: f"{n} on {device}: {delta} new", site.name)
            event = report.Event("test.own", site.name, device, delta=delta, total=total)
            return report.Report((event,), report.Wording(line), site.name)

        ctx.emit((device, site.id), total, now, render)

    def tick(self, ctx: report.ReportContext, latest: dict, now: float) -> None:
        return None


def test_a_reporter_of_ones_own_reports_through_the_sinks(registry):
    """Registered through tripwire.report, its rows reach it and its events reach the monitor's sinks. Control: a
    row of a kind with no reporter registered makes no event."""
    report.register_reporter("test.own", _Counting)
    m = Monitor(registry=registry, capacity=64)
    events: list = []
    m.add_sink(events.append)
    own = m.counter(registry.register("k.own", kind="test.own"), "cpu")
    other = m.counter(registry.register("k.other", kind="test.unregistered"), "cpu")
    own[COUNT] += 2
    other[COUNT] += 5
    for _ in range(4):
        m.poll()
    m.drain()
    assert [(e.kind, e.site, e.delta, e.total) for e in events] == [("test.own", "k.own", 2, 2)]
