"""tripwire's pytest plugin (src/tripwire_pytest.py): off by default, warn reports, strict fails a test that tripped a
guard (with the report), tripwire_allow lets a test hit guards on purpose. Each session is a subprocess (its own
default monitor), as a user's run would be."""

from __future__ import annotations

import importlib.metadata

import pytest

SUITE = """
import pytest
import tripwire
from tripwire.layout import COUNT, FIRST_ROW, FIRST_VALUE, encode

SITE = tripwire.register_site("plugin.gather", description="a gather's index")


def hit(n, row=3, value=99):
    ctr = tripwire.counter(SITE, "cpu")  # what a guarded kernel writes
    ctr[COUNT] += n
    if int(ctr[FIRST_ROW]) == 0:
        ctr[FIRST_ROW], ctr[FIRST_VALUE] = encode(row), encode(value)


def test_clean():
    tripwire.counter(SITE, "cpu")  # the monitor and its arena exist, nothing counts


def test_trips_a_guard():
    hit(2)


@pytest.mark.tripwire_allow("plugin.gather")
def test_hits_on_purpose():
    hit(1)


@pytest.mark.tripwire_allow("some.other.site")
def test_allowed_elsewhere_only():
    hit(4)
"""


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_suite=SUITE)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "-rA", *args)


def test_the_plugin_is_the_pytest11_entry_point():
    eps = [e for e in importlib.metadata.entry_points(group="pytest11") if e.name == "tripwire"]
    assert [e.value for e in eps] == ["tripwire_pytest"]


def test_off_by_default_changes_nothing(pytester):
    r = run(pytester)
    r.assert_outcomes(passed=4, warnings=0)
    assert "guards counted" not in r.stdout.str() and "TripwireGuardWarning" not in r.stdout.str()


def test_off_by_default_imports_nothing(pytester):
    """Loading the plugin (every pytest run where tripwire is installed) imports neither tripwire nor torch."""
    pytester.makepyfile(
        test_light="import sys\n\ndef test_light():\n    assert 'torch' not in sys.modules and 'tripwire' not in sys.modules\n"
    )
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    r.assert_outcomes(passed=1)
    assert "tripwire_pytest" in pytester.runpytest_subprocess("--trace-config", "-q").stdout.str()  # loaded


def test_warn_reports_and_passes(pytester):
    r = run(pytester, "--tripwire=warn")
    r.assert_outcomes(passed=4, warnings=2)
    out = r.stdout.str()
    assert "TripwireGuardWarning" in out and "site 'plugin.gather' on cpu: 2 masked out-of-range access(es)" in out
    assert "first offender: row 3, value 99" in out


def test_strict_fails_the_test_that_tripped_a_guard_with_the_report(pytester):
    r = run(pytester, "--tripwire=strict")
    r.assert_outcomes(passed=2, failed=2)  # the control, test_clean, and the allowed one pass
    out = r.stdout.str()
    assert (
        "FAILED test_suite.py::test_trips_a_guard" in out and "FAILED test_suite.py::test_allowed_elsewhere_only" in out
    )
    assert "PASSED test_suite.py::test_clean" in out and "PASSED test_suite.py::test_hits_on_purpose" in out
    assert "site 'plugin.gather' on cpu: 2 masked out-of-range access(es) during this test (2 in all)" in out
    assert "first offender: row 3, value 99" in out and "did NOT compute a correct result" in out
    # Each failure prints its report once (the failure's message), not again as a captured section.
    failure = out.split("_ test_trips_a_guard _", 1)[1].split("short test summary", 1)[0].split("_ test_", 1)[0]
    assert failure.count("guards counted during this test") == 1, failure


def test_the_ini_option_sets_the_default_and_a_bad_value_is_refused(pytester):
    pytester.makeini("[pytest]\ntripwire = strict\n")
    run(pytester).assert_outcomes(passed=2, failed=2)
    pytester.makeini("[pytest]\ntripwire = loud\n")
    r = run(pytester)
    assert r.ret != 0 and "tripwire = 'loud'" in r.stderr.str()
    assert run(pytester, "--tripwire=loud").ret != 0
