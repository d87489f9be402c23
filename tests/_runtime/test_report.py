"""Reports (tripwire._runtime.report): the wording's short first line, the aggregation window, decoding, the reporter table."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tripwire import SiteRegistry
from tripwire._runtime.hit import Hit
from tripwire._runtime.report import (
    GuardReporter,
    Report,
    Reporters,
    ReportWindow,
    Wording,
    decode_rows,
    guard_event,
    guard_wording,
    short_name,
)
from tripwire.layout import (
    COUNT,
    FIRST_ROW,
    FIRST_VALUE,
    MAX_ROW,
    MAX_VALUE,
    NEG_MIN,
    SLOTS,
    VALUE_MAX,
    encode,
    encode_neg,
)
from tripwire.sinks import LINE_LIMIT, Event, Log, Offender


def guard_row(count: int, first: tuple[int, int], lo: int, hi: int, max_row: int) -> np.ndarray:
    r = np.zeros(SLOTS, dtype=np.int64)
    r[COUNT], r[FIRST_ROW], r[FIRST_VALUE] = count, encode(first[0]), encode(first[1])
    r[MAX_ROW], r[MAX_VALUE], r[NEG_MIN] = encode(max_row), encode(hi), encode_neg(lo)
    return r


# ---------------------------------------------------------------------------------------------------- wording
def test_the_first_line_carries_site_device_delta_total_and_first_offender():
    site = SiteRegistry(capacity=4).register("paged.block_table", description="block id", fatal=True)
    hit = Hit.from_row(guard_row(5, (17, 4096), -1, 4096, 803))
    w = guard_wording(site, "cuda:0", hit, delta=2)
    assert w.line == (
        "MASKED FAULT at site 'paged.block_table' on cuda:0 (FATAL site): 2 new out-of-range accesses masked "
        "(5 total). First offender: row 17, value 4096."
    )
    assert len(w.line) <= LINE_LIMIT
    assert w.detail == "Lifetime extremes: max row 803, value min -1 max 4096."
    assert "NOT compute a correct result" in w.explanation and "[block id]" in w.explanation
    assert "written somewhere durable" in w.explanation and "independent" in w.explanation
    assert str(w) == " ".join((w.line, w.detail, w.explanation))


@pytest.mark.parametrize("name_len", [10, 150, 400])
def test_the_first_line_fits_even_with_long_names_and_huge_values(name_len):
    site = SiteRegistry(capacity=4).register("x" * (name_len - 4) + ".end")
    hit = Hit.from_row(guard_row(10**15, (VALUE_MAX, VALUE_MAX), -VALUE_MAX, VALUE_MAX, VALUE_MAX))
    w = guard_wording(site, "cuda:15", hit, delta=10**15)
    assert len(w.line) <= LINE_LIMIT and w.line.endswith(f"row {VALUE_MAX}, value {VALUE_MAX}.")
    assert ".end" in w.line  # shortened in the middle: both ends of the name stay
    assert "saturated" in w.detail  # the first line has the number; the detail says what it means


def test_control_without_shortening_a_long_name_overflows_the_line():
    make = lambda s: f"MASKED FAULT at site {s} on cpu: 1 new out-of-range access masked (1 total)."  # noqa: E731
    name = "layers." + "deep." * 60 + "gather"
    assert len(make(repr(name))) > LINE_LIMIT
    assert len(short_name(make, name)) <= LINE_LIMIT and short_name(make, "short") == make("'short'")


def test_offenders_go_into_the_detail_and_the_event():
    """The row's offenders (empty while the arena keeps only the first pair) reach the report and its event from
    the Hit: filling Hit.offenders is the one change that makes them appear everywhere."""
    site = SiteRegistry(capacity=4).register("s")
    hit = Hit(3, 4, 9, 8, 9, 1, offenders=(Offender(4, 9, "req-1"), Offender(8, 1)))
    w = guard_wording(site, "cpu", hit, delta=3)
    assert w.detail.endswith("Offenders: row 4 value 9 (request req-1), row 8 value 1.")
    assert guard_event(site, "cpu", hit, 3).offenders == hit.offenders
    assert "Offenders" not in guard_wording(site, "cpu", Hit(3, 4, 9, 8, 9, 1), delta=3).detail  # control


def test_the_event_of_a_guard_report():
    site = SiteRegistry(capacity=4).register("s", fatal=True)
    ev = guard_event(site, "cpu", Hit.from_row(guard_row(3, (4, -5), -5, 9, 4)), delta=2)
    assert (ev.kind, ev.site, ev.device, ev.delta, ev.total, ev.first_row, ev.first_value, ev.fatal) == (
        "guard", "s", "cpu", 2, 3, 4, -5, True
    )  # fmt: skip
    assert ev.offenders == () and ev.rank is None and ev.time > 0


# ---------------------------------------------------------------------------------------------------- the window
def _window(every: float):
    out: list[Report] = []
    w = ReportWindow(every, out.append)

    def render(delta: int) -> Report:
        return Report((Event("guard", "s", "cpu", delta=delta),), Wording(f"delta {delta}"), "s")

    return w, out, render


def test_the_window_lets_one_report_out_per_key_and_period_with_the_whole_delta():
    w, out, render = _window(10.0)
    w.submit(("cpu", 0), 1, 0.0, render)  # the first: at once
    w.submit(("cpu", 0), 4, 1.0, render)  # deferred
    w.submit(("cpu", 0), 9, 2.0, render)  # deferred, replaces the render
    w.submit(("cpu", 1), 2, 2.5, render)  # another key: its own window
    assert [r.wording.line for r in out] == ["delta 1", "delta 2"]
    assert w.deferred() == 1 and w.next_due(5.0) == 5.0
    w.flush_due(9.0)
    assert len(out) == 2
    w.flush_due(10.0)
    assert out[-1].wording.line == "delta 8" and w.deferred() == 0 and w.next_due(10.0) is None


def test_force_flushes_and_the_window_follows_its_setting():
    every = [10.0]
    out: list[Report] = []
    w = ReportWindow(lambda: every[0], out.append)
    render = lambda d: Report((), Wording(str(d)), "s")  # noqa: E731
    w.submit(("cpu", 0), 1, 0.0, render)
    w.submit(("cpu", 0), 3, 0.1, render)
    w.flush_due(0.2, force=True)
    assert [r.wording.line for r in out] == ["1", "2"]
    every[0] = 0.01
    w.submit(("cpu", 0), 4, 0.3, render)
    assert out[-1].wording.line == "1"


def test_control_a_window_shorter_than_a_submit_releases_every_one():
    w, out, render = _window(0.0)
    for i in range(5):
        w.submit(("cpu", 0), i + 1, float(i), render)
    assert len(out) == 5


# ---------------------------------------------------------------------------------------------------- the log sink
def test_the_log_explains_each_site_once(caplog):
    log = Log()
    with caplog.at_level(logging.WARNING, logger="tripwire"):
        for _ in range(3):
            log.write("first line", key="site.a", detail="numbers", explanation="what it means")
        log.write("first line", key="site.b", detail="numbers", explanation="what it means")
    msgs = caplog.messages
    assert msgs[0] == "first line\n  numbers\n  what it means"
    assert msgs[1] == msgs[2] == "first line\n  numbers"
    assert msgs[3].endswith("what it means")
    assert all(len(m.splitlines()[0]) <= LINE_LIMIT for m in msgs)


# ---------------------------------------------------------------------------------------------------- decoding
def test_decode_rows_decodes_each_layout():
    import tripwire.numerics  # noqa: F401  (the clip and non-finite reporters)

    reg = SiteRegistry(capacity=8)
    g, nf, clip, unknown, idle = (
        reg.register("g"),
        reg.register("nf", kind="nonfinite"),
        reg.register("clip", kind="clip"),
        reg.register("?", kind="no-such-kind"),
        reg.register("idle"),
    )
    rows = np.zeros((5, SLOTS), dtype=np.int64)
    rows[g.id] = guard_row(2, (1, 2), 2, 2, 1)
    rows[nf.id] = guard_row(3, (0, 7), 7, 7, 0)
    rows[clip.id, 0], rows[clip.id, 1], rows[clip.id, 2] = 4, 5, 123  # K, V, K max bits
    rows[unknown.id, 0] = 9
    rows[idle.id, MAX_ROW] = encode(3)  # an extreme, no count
    snap = decode_rows(reg, Reporters(), "cpu", rows)
    assert set(snap) == {("cpu", "g"), ("cpu", "nf"), ("cpu", "clip")}
    assert snap[("cpu", "g")] == Hit(2, 1, 2, 1, 2, 2)
    assert snap[("cpu", "nf")].kind == "nonfinite" and snap[("cpu", "nf")].first_value == 7
    assert snap[("cpu", "clip")] == Hit(9, None, None, None, None, None, kind="clip")


def test_the_reporter_table():
    reps = Reporters()
    assert reps.get("guard") is None and reps.slots("guard") == (COUNT,) and reps.get("guard") is None
    assert reps.count_slots("guard") == (COUNT,) and isinstance(reps.get("guard"), GuardReporter)
    assert reps.make("guard") is reps.make("guard") and reps.count_slots("no-such-kind") is None
    with pytest.raises(KeyError, match="no reporter registered"):
        reps.make("no-such-kind")
    reps.clear()
    assert reps.made() == []


def test_the_window_releases_no_report_of_nothing_new():
    """A key submitted again at the total it last reported releases nothing (no "0 new" line or event); control:
    one more hit releases a report of 1."""
    out: list = []
    w = ReportWindow(0.0, out.append)
    w.submit(("cpu", 1), 3, 0.0, lambda d: d)
    w.submit(("cpu", 1), 3, 1.0, lambda d: d)
    assert out == [3]
    w.submit(("cpu", 1), 4, 2.0, lambda d: d)
    assert out == [3, 1]
