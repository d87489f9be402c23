"""tripwire's pytest plugin (the ``pytest11`` entry point ``tripwire``): ``--tripwire=off|warn|strict``.

Off by default: installing tripwire changes nobody's test run. This module is outside the ``tripwire`` package
so that loading it imports nothing (not tripwire, not torch); tripwire is imported only when the option is on.

* ``warn``: after each test, the guards that counted during it (the default monitor's arenas, read synchronously
  before and after the test's call) are reported as a pytest warning.
* ``strict``: a test during which any guard counted fails, with the report (site, device, how many, the first
  offender). ``@pytest.mark.tripwire_allow`` allows it (every site, or only the sites named:
  ``@pytest.mark.tripwire_allow("paged.block_table")``), for tests that hit guards on purpose.

Only the default monitor is watched (what ``tripwire.counter`` and the reference kernels count into), and only if
it exists: the plugin never builds it. Only guard rows count (masked accesses); numeric instruments do not.
Each watched test reads the arenas twice: a device sync each time, which a test can afford and an engine cannot.
"""

from __future__ import annotations

from typing import Any

import pytest

MODES = ("off", "warn", "strict")


class TripwireGuardWarning(UserWarning):
    """A guard counted during a test (``--tripwire=warn``)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tripwire")
    group.addoption(
        "--tripwire",
        action="store",
        default=None,
        choices=MODES,
        help="watch tripwire's guards during each test: off (default), warn (a warning per test that tripped one), "
        "strict (such a test fails, with the report)",
    )
    parser.addini("tripwire", "the default of --tripwire (off, warn or strict)", default="off")


def _mode(config: pytest.Config) -> str:
    mode = config.getoption("--tripwire") or config.getini("tripwire") or "off"
    if mode not in MODES:
        raise pytest.UsageError(f"tripwire = {mode!r} (ini): expected one of {', '.join(MODES)}")
    return str(mode)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "tripwire_allow(*sites): guards may count during this test (all sites, or the ones named)"
    )
    _mode(config)


def _counts() -> dict[tuple[str, str], Any]:
    """The default monitor's guard rows with a count, ``{(device, site): Hit}``; {} while it does not exist."""
    import tripwire._default as default

    if not default.built():
        return {}
    m = default.default_monitor()
    return {k: h for k, h in m.snapshot().items() if h.kind == "guard"}


def _report(before: dict[tuple[str, str], Any], after: dict[tuple[str, str], Any], allowed: set[str] | None) -> str:
    lines = []
    for (device, site), hit in sorted(after.items()):
        old = before.get((device, site))
        delta = hit.count - (old.count if old is not None else 0)
        if delta <= 0 or (allowed is not None and (not allowed or site in allowed)):
            continue
        lines.append(
            f"  site {site!r} on {device}: {delta} masked out-of-range access(es) during this test ({hit.count} in "
            f"all); first offender: row {hit.first_row}, value {hit.first_value}; max row {hit.max_row}, value "
            f"min {hit.min_value} max {hit.max_value}"
        )
    if not lines:
        return ""
    return "tripwire: guards counted during this test (those lanes did NOT compute a correct result):\n" + "\n".join(
        lines
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    mode = _mode(item.config)
    if mode == "off":
        return (yield)
    marker = item.get_closest_marker("tripwire_allow")
    allowed = None if marker is None else {str(a) for a in marker.args}
    before = _counts()
    failed = True
    try:
        result = yield
        failed = False
        return result
    finally:
        report = _report(before, _counts(), allowed)
        if report:
            if mode == "strict" and not failed:
                pytest.fail(report, pytrace=False)  # the failure's message is the report: printed once
            # A warning, or beside a test's own failure: kept with the test's output too.
            item.add_report_section("call", "tripwire", report)
            item.warn(TripwireGuardWarning(report))
