"""The reporter API: what an instrument of one's own uses to turn its counter rows into reports.

A kind of row (a guard's, a numeric counter's) gets its reporter with :func:`register_reporter` at import. The
monitor makes the reporter on first use and hands it confirmed rises (:class:`RowReporter`'s ``confirm``) with a
:class:`ReportContext`: the narrow view of the monitor a reporter may use (the site registry, the settings, the
report window, the stop), never the monitor itself. A report that goes out is a :class:`Report`: its
:class:`Event` values for the sinks and its :class:`Wording` for the log. A reporter of guard-layout rows
subclasses :class:`GuardReporter` and changes only the words; :func:`short_name` keeps a first line within the log's
limit and :func:`offenders_text` words the offending entries (:class:`Offender`) of a decoded row (:class:`Hit`).
:func:`current_rank` is the rank a report is made on.

tripwire's numeric instruments (:mod:`tripwire.numerics`) are written with this API alone.
"""

from __future__ import annotations

from ._runtime.hit import Hit
from ._runtime.report import (
    GuardReporter,
    Report,
    ReportContext,
    RowReporter,
    Wording,
    offenders_text,
    register_reporter,
    short_name,
)
from .sinks import LINE_LIMIT, Event, Offender, current_rank

__all__ = [
    # plugging a reporter in
    "register_reporter",
    "RowReporter",
    "ReportContext",
    "GuardReporter",
    # what it makes
    "Report",
    "Wording",
    "Event",
    "LINE_LIMIT",
    "short_name",
    # what it reads
    "Hit",
    "Offender",
    "offenders_text",
    "current_rank",
]
