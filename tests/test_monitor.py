"""The monitor on CPU arenas: confirmation, modes, arming, loss, hooks, reset, aggregation, idle."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import tripwire
from conftest import offenders_recorded
from tripwire import GuardTripped, Monitor
from tripwire.layout import COUNT, FIRST_ROW, FIRST_VALUE, MAX_ROW, MAX_VALUE, NEG_MIN, encode, encode_neg


def write_count(ctr: torch.Tensor, n: int = 1) -> None:
    """What a kernel does first: bump the count (the extremes land after it)."""
    ctr[COUNT] += n


def write_extremes(ctr: torch.Tensor, row: int, value: int) -> None:
    ctr[MAX_ROW] = max(int(ctr[MAX_ROW]), encode(row))
    ctr[MAX_VALUE] = max(int(ctr[MAX_VALUE]), encode(value))
    ctr[NEG_MIN] = max(int(ctr[NEG_MIN]), encode_neg(value))
    if int(ctr[FIRST_ROW]) == 0:
        ctr[FIRST_ROW] = encode(row)
        ctr[FIRST_VALUE] = encode(value)
    offenders_recorded(ctr, 1)  # the hit's fault path ends with its offender (tripwire.layout)


def hit(ctr: torch.Tensor, row: int, value: int, n: int = 1) -> None:
    write_count(ctr, n)
    write_extremes(ctr, row, value)
    offenders_recorded(ctr, n - 1)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tripwire" and r.levelno == logging.WARNING]


@pytest.fixture(autouse=True)
def _caplog_level(caplog):
    caplog.set_level(logging.INFO, logger="tripwire")


def test_rise_is_reported_one_copy_later_with_confirming_extremes(registry, monitor, caplog):
    s = registry.register("k.site", description="block table row")
    ctr = monitor.counter(s, "cpu")
    write_count(ctr, 2)  # copy k sees the count without extremes
    monitor.poll()
    assert warnings(caplog) == []
    write_extremes(ctr, 17, 4096)
    write_extremes(ctr, 3, -1)
    monitor.poll()  # copy k+1 confirms, with its extremes
    (line,) = warnings(caplog)
    assert "MASKED FAULT" in line and "'k.site'" in line and "cpu" in line
    assert "First offender: row 17, value 4096" in line
    assert "max row 17, value min -1 max 4096" in line and "independent" in line
    assert "2 new out-of-range accesses masked (2 total)" in line
    assert monitor.armed is None  # warn mode, not fatal


def test_confirmation_waits_for_first_offender_pair(registry, monitor, caplog):
    s = registry.register("k.site")
    ctr = monitor.counter(s, "cpu")
    write_count(ctr)
    monitor.poll()
    monitor.poll()  # pair has not landed: wait
    assert warnings(caplog) == []
    write_extremes(ctr, 1, 99)
    monitor.poll()
    assert "row 1, value 99" in warnings(caplog)[0]


def test_raise_mode_arms_on_any_hit(registry):
    m = Monitor(registry=registry, capacity=64, mode="raise")
    s = registry.register("k.nonfatal")
    hit(m.counter(s, "cpu"), 5, 77)
    m.check()
    m.poll()
    m.check()  # first sight: not yet confirmed
    m.poll()
    with pytest.raises(GuardTripped) as e:
        m.check()
    exc = e.value
    assert (exc.site, exc.device, exc.count, exc.first_row, exc.first_value, exc.rank) == (
        "k.nonfatal",
        "cpu",
        1,
        5,
        77,
        None,
    )
    assert isinstance(exc, RuntimeError) and "MASKED FAULT" in str(exc) and "row 5" in str(exc)
    with pytest.raises(GuardTripped):  # stays armed
        m.check()


def test_warn_mode_arms_only_fatal(registry, monitor):
    a = registry.register("k.a")
    b = registry.register("k.b", fatal=True)
    hit(monitor.counter(a, "cpu"), 1, 2)
    monitor.poll()
    monitor.poll()
    monitor.check()  # non-fatal under warn: reported, not armed
    hit(monitor.counter(b, "cpu"), 3, 4)
    monitor.poll()
    monitor.poll()
    with pytest.raises(GuardTripped) as e:
        monitor.check()
    assert e.value.site == "k.b" and e.value.fatal


def test_the_stop_line_is_short_and_says_why(registry, caplog):
    """The stop's ERROR line names the site and why it stops in this mode, in one short line without the report
    the WARNING before it carried. Control: the exception's message (what the line once was) is the whole report,
    prefixed."""
    m = Monitor(registry=registry, capacity=64, mode="warn")
    s = registry.register("k.fatal.line", fatal=True, description="a durable write")
    _hit_and_confirm(m, m.counter(s, "cpu"), 3, 4)
    errors = [r.getMessage() for r in caplog.records if r.name == "tripwire" and r.levelno == logging.ERROR]
    assert errors == [
        "stop ARMED: site 'k.fatal.line' on cpu (FATAL: stops in every mode), first offender row 3, value 4; "
        "tripwire.check() raises until tripwire.reset()"
    ]
    exc = m.armed
    assert exc is not None and str(exc).startswith("tripwire: MASKED FAULT") and len(str(exc)) > 2 * len(errors[0])
    assert "Lifetime extremes" in str(exc) and "Lifetime extremes" not in errors[0]
    raised = Monitor(registry=registry, capacity=64, mode="raise")
    t = registry.register("k.plain.line")
    _hit_and_confirm(raised, raised.counter(t, "cpu"), 1, 9)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR][-1].startswith(
        "stop ARMED: site 'k.plain.line' on cpu (mode raise: every hit stops), first offender row 1"
    )


def test_off_mode_reads_nothing(registry):
    m = Monitor(registry=registry, capacity=64, mode="off")
    s = registry.register("k.fatal", fatal=True)
    ctr = m.counter(s, "cpu")
    hit(ctr, 1, 2)
    m.start()
    assert not m.reader_alive  # no reader thread at all
    assert m.drain(raise_on_fatal=True) == {}
    m.check()
    assert int(ctr[COUNT]) == 1  # kernels still count


def test_drain_reports_what_the_reader_had_not(registry, monitor, caplog):
    s = registry.register("k.fatal", fatal=True)
    hit(monitor.counter(s, "cpu"), 9, -7, n=3)
    snap = monitor.drain()  # no poll before: the last step's hit
    hit_ = snap[("cpu", "k.fatal")]
    assert (hit_.count, hit_.first_row, hit_.first_value, hit_.min_value, hit_.max_value) == (3, 9, -7, -7, -7)
    assert len(warnings(caplog)) == 1
    with pytest.raises(GuardTripped):
        monitor.drain(raise_on_fatal=True)


def test_drain_raise_on_fatal_only_for_fatal_under_warn(registry, monitor):
    s = registry.register("k.nonfatal")
    hit(monitor.counter(s, "cpu"), 1, 1)
    assert ("cpu", "k.nonfatal") in monitor.drain(raise_on_fatal=True)


class _BrokenReporter:
    """A reporter whose confirmation raises: a bug inside the reader loop (not a read failure)."""

    count_slots = (COUNT,)
    calls = 0

    def confirm(self, ctx, device, site, row, now):
        _BrokenReporter.calls += 1
        raise ValueError("boom")

    def tick(self, ctx, latest, now):
        return None


def test_reader_loop_exception_logs_arms_and_keeps_going(registry, caplog):
    from tripwire.report import register_reporter

    register_reporter("test.broken", _BrokenReporter)
    m = Monitor(registry=registry, capacity=64, interval=0.005)
    hit(m.counter(registry.register("k.broken", kind="test.broken"), "cpu"), 1, 1)
    ticks = []
    m.add_tick_hook(lambda _m: ticks.append(1))
    m.start()
    deadline = time.monotonic() + 5
    while len(ticks) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    m.stop()
    assert _BrokenReporter.calls == 1 and len(ticks) >= 5 and m.loop_errors == 1  # it kept ticking after the error
    assert m.armed is not None and "reader loop failed" in str(m.armed) and "boom" in str(m.armed)


def test_hooks(registry):
    m = Monitor(registry=registry, capacity=64, mode="off")
    ran = []

    def bad():
        ran.append("bad")
        raise RuntimeError("hook broke")

    m.register_post_capture_hook(lambda: ran.append(1))
    m.register_post_capture_hook(bad)
    m.register_post_capture_hook(lambda: ran.append(2))
    assert ran == []
    m.start()
    assert ran == [1, "bad", 2]  # a failing hook does not stop the others
    m.start()  # idempotent: hooks run once
    assert ran == [1, "bad", 2]
    m.register_post_capture_hook(lambda: ran.append(3))  # late: runs at once
    assert ran == [1, "bad", 2, 3]
    with pytest.raises(TypeError, match="callable"):
        m.register_post_capture_hook("not a function")


def test_start_is_idempotent_one_thread(registry):
    import threading

    m = Monitor(registry=registry, capacity=64, interval=0.01)
    m.start()
    m.start()
    try:
        assert [t.name for t in threading.enumerate()].count("tripwire-reader") == 1
    finally:
        m.stop()
    assert not m.reader_alive


def _hit_and_confirm(m, ctr, row, value):
    hit(ctr, row, value)
    m.poll()
    m.poll()


def test_reset_makes_the_next_hit_visible(registry, caplog):
    m = Monitor(registry=registry, capacity=64, mode="raise")
    s = registry.register("k.site")
    ctr = m.counter(s, "cpu")
    _hit_and_confirm(m, ctr, 1, 10)
    assert m.armed is not None
    m.reset()
    assert m.armed is None and int(ctr[COUNT]) == 0
    m.check()
    _hit_and_confirm(m, ctr, 2, 20)
    assert m.armed is not None and m.armed.first_row == 2 and m.armed.count == 1
    assert len(warnings(caplog)) == 2


@pytest.mark.parametrize("skip", ["zero", "forget", "disarm"])
def test_reset_control_skipping_one_part_loses_the_next_hit(registry, caplog, monkeypatch, skip):
    """Control: a reset that skips any one of its three parts makes the next hit invisible or misreported."""
    m = Monitor(registry=registry, capacity=64, mode="raise")
    s = registry.register("k.site")
    ctr = m.counter(s, "cpu")
    for i in range(3):
        _hit_and_confirm(m, ctr, i, 10 + i)  # 3 hits reported
    first = m.armed
    # reset() with one of its parts undone, each through the monitor's public pieces: the arena's zeroing and the
    # pipeline's forgetting are no-ops for this reset, and a reset that kept the stop armed is one re-armed with it.
    with monkeypatch.context() as mp:
        if skip == "zero":
            mp.setattr(m.arena, "zero_", lambda: None)
        if skip == "forget":
            mp.setattr(m.pipeline, "clear", lambda: None)  # confirmations, the report window, reporters
        m.reset()
    if skip == "disarm":
        m.arm(first)
    caplog.clear()
    _hit_and_confirm(m, ctr, 7, 70)
    lines = warnings(caplog)
    if skip == "forget":
        assert lines == []  # count 1 <= reported 3: the new hit is invisible
    elif skip == "zero":
        assert m.armed is not None and m.armed.first_row != 7  # the stale first offender is reported instead
    else:
        assert m.armed is first  # still armed with the old hit: the new one is not what check() raises


def test_aggregation_bounds_lines_and_keeps_delta(registry, caplog):
    m = Monitor(registry=registry, capacity=64, report_every=3600)
    s = registry.register("k.hot")
    ctr = m.counter(s, "cpu")
    for i in range(100):
        hit(ctr, i, i)
        m.poll()
    m.poll()
    lines = warnings(caplog)
    # a count still rising is confirmed after at most 3 extra copies (its newest hits may lack their extremes)
    assert len(lines) == 1 and "5 new out-of-range accesses masked (5 total)" in lines[0]
    m.drain()  # flushes the deferred line with the whole delta
    lines = warnings(caplog)
    assert len(lines) == 2 and "95 new out-of-range accesses masked (100 total)" in lines[1]


def test_aggregation_window_flushes_on_tick(registry, caplog):
    m = Monitor(registry=registry, capacity=64, report_every=0.05)
    s = registry.register("k.hot")
    ctr = m.counter(s, "cpu")
    for i in range(10):
        hit(ctr, i, i)
        m.poll()
    time.sleep(0.06)
    m.poll()
    lines = warnings(caplog)
    assert len(lines) == 2 and "5 new out-of-range accesses masked (10 total)" in lines[1]


def test_aggregation_control_without_window_floods(registry, caplog):
    """Control: with a window shorter than a tick, every confirmation (every fifth tick while hits keep
    coming) logs a line."""
    m = Monitor(registry=registry, capacity=64, report_every=1e-9)
    s = registry.register("k.hot")
    ctr = m.counter(s, "cpu")
    for i in range(20):
        hit(ctr, i, i)
        m.poll()
    assert len(warnings(caplog)) == 4


def test_idle_skip_and_resume(registry):
    m = Monitor(registry=registry, capacity=64, idle_tail=0.05)
    s = registry.register("k.site")
    ctr = m.counter(s, "cpu")
    reader = m.readers()["cpu"]
    m.check()
    m.poll()
    copies = reader.copies
    time.sleep(0.08)
    for _ in range(5):
        m.poll()
    assert reader.copies == copies and m.idle_skips == 5  # idle: no copies after the tail
    m.check()  # resumes on check
    m.poll()
    assert reader.copies == copies + 1
    # never while a confirmation is pending
    hit(ctr, 1, 1)
    m.poll()  # first sight
    time.sleep(0.08)
    m.poll()  # idle by time, but pending: copies and confirms
    assert reader.copies == copies + 3
    assert m.confirmer.reported("cpu", s.id) == 1


def test_idle_control_without_tail_keeps_copying(registry):
    m = Monitor(registry=registry, capacity=64, idle_tail=3600)
    registry.register("k.site")
    m.prealloc("cpu")
    reader = m.readers()["cpu"]
    for _ in range(5):
        m.poll()
    assert reader.copies == 5


def test_reader_thread_end_to_end(registry, caplog):
    m = Monitor(registry=registry, capacity=64, interval=0.005, mode="warn")
    s = registry.register("k.fatal", fatal=True)
    ctr = m.counter(s, "cpu")
    m.start()
    try:
        hit(ctr, 4, 44)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                m.check()
            except GuardTripped as e:
                assert (e.site, e.first_row, e.first_value) == ("k.fatal", 4, 44)
                break
            time.sleep(0.002)
        else:
            pytest.fail("the reader never armed")
    finally:
        m.stop()


def test_counter_argument_errors(registry, monitor):
    s = registry.register("k.site")
    with pytest.raises(ValueError, match="CUDA and CPU"):
        monitor.counter(s, "meta")
    with pytest.raises(ValueError, match="another registry"):
        monitor.counter(tripwire.SiteRegistry(capacity=4).register("x"), "cpu")
    small = Monitor(registry=registry, capacity=1)
    registry.register("k.other")
    with pytest.raises(ValueError, match="raise the monitor's capacity"):
        small.counter(registry.get("k.other"), "cpu")


def test_counter_is_cached_view(registry, monitor):
    s = registry.register("k.site")
    a = monitor.counter(s, "cpu")
    b = monitor.counter(s, torch.device("cpu"))
    assert a is monitor.counter(s, "cpu")
    assert a.data_ptr() == b.data_ptr() and a.shape == (8,) and a.dtype == torch.int64


def test_snapshot_and_module_level_default(monkeypatch):
    m = tripwire.configure(mode="warn", interval=0.01, replace_live=True)  # other tests may have used the default
    try:
        s = tripwire.register_site("test_monitor.default", description="x")
        ctr = tripwire.counter(s, "cpu")
        tripwire.reset()
        hit(ctr, 2, 3)
        snap = tripwire.snapshot()
        assert snap[("cpu", "test_monitor.default")].count == 1
        tripwire.reset()
        assert ("cpu", "test_monitor.default") not in tripwire.snapshot()
        assert tripwire.default_monitor() is m
    finally:
        tripwire.stop()


def test_a_hit_counted_before_its_extremes_is_not_lost(registry, monitor, caplog):
    """Hit B's count lands in the confirming copy but its extremes do not: the confirmation waits for the count to
    settle, so B's value is in the report (control: confirming at once would log only A's extremes)."""
    s = registry.register("k.site")
    ctr = monitor.counter(s, "cpu")
    hit(ctr, 1, 5)  # A
    monitor.poll()  # copy k: first sight
    write_count(ctr)  # B's count, extremes not yet written
    monitor.poll()  # copy k+1: still rising -> wait
    assert warnings(caplog) == []
    write_extremes(ctr, 900, 1_000_000)
    monitor.poll()  # copy k+2: settled, with B's extremes
    (line,) = warnings(caplog)
    assert "2 new out-of-range accesses masked (2 total)" in line and "max row 900" in line and "1000000" in line


def test_lost_reader_reports_what_it_had_seen_and_stops_fast_polling(registry, caplog):
    m = Monitor(registry=registry, capacity=64, interval=0.05)
    s = registry.register("k.site")
    hit(m.counter(s, "cpu"), 3, 77)
    m.poll()  # rise seen, confirmation pending
    reader = m.readers()["cpu"]

    def broken(n):
        raise RuntimeError("gone")

    reader.poll = broken
    m.poll()
    assert any("row 3, value 77" in line for line in warnings(caplog))  # the seen hit is reported, not dropped
    assert not m.confirmer.any_pending()  # so the reader does not re-poll every millisecond forever
    assert m.armed is not None and "lost the reader" in str(m.armed)


def test_reset_reports_unconfirmed_and_deferred_hits_first(registry, caplog):
    m = Monitor(registry=registry, capacity=64, report_every=3600)
    s = registry.register("k.site")
    ctr = m.counter(s, "cpu")
    _hit_and_confirm(m, ctr, 1, 10)  # reported
    hit(ctr, 7, 4242)
    m.poll()
    m.poll()  # confirmed but deferred by the window
    hit(ctr, 8, 4343)
    m.poll()  # seen, not confirmed
    m.reset()
    lines = warnings(caplog)
    assert len(lines) == 2 and "2 new out-of-range accesses masked (3 total)" in lines[1]
    assert "max row 8" in lines[1] and "max 4343" in lines[1]


def test_drain_raise_on_fatal_raises_when_armed_otherwise(registry):
    m = Monitor(registry=registry, capacity=64)
    m.prealloc("cpu")
    m.arm(GuardTripped("armed by an instrument", site="layer0", device="cpu", count=1, fatal=True))
    assert m.drain() == {}
    with pytest.raises(GuardTripped, match="armed by an instrument"):
        m.drain(raise_on_fatal=True)


def test_poll_reads_nothing_under_off(registry):
    m = Monitor(registry=registry, capacity=64, mode="off")
    s = registry.register("k.fatal", fatal=True)
    hit(m.counter(s, "cpu"), 1, 1)
    m.poll()
    m.poll()
    assert m.readers()["cpu"].copies == 0 and m.armed is None


def _lock_free(m: Monitor) -> bool:
    """Whether another thread can take the monitor's lock now (poll() takes it) within 0.5 s."""
    import threading

    t = threading.Thread(target=m.poll, daemon=True)
    t.start()
    t.join(0.5)
    return not t.is_alive()


def test_arm_listeners_run_outside_the_monitor_lock(registry):
    m = Monitor(registry=registry, capacity=64, mode="raise")
    s = registry.register("k.site")
    seen = []
    m.add_arm_listener(lambda exc: seen.append((exc.site, _lock_free(m))))
    hit(m.counter(s, "cpu"), 1, 1)
    m.drain()  # confirmation (and arming) happens under the lock
    assert seen == [("k.site", True)]


class _LockProbe:
    """A reporter whose heartbeat tick (which runs under the monitor's lock) probes the lock."""

    count_slots = (COUNT,)
    seen: list[bool] = []
    monitor: Monitor | None = None  # the monitor whose lock it probes (a reporter is given its context, not it)

    def confirm(self, ctx, device, site, row, now):
        return None

    def tick(self, ctx, latest, now):
        import threading

        if threading.current_thread() is threading.main_thread():  # not the probe's own poll, on its thread
            assert _LockProbe.monitor is not None
            _LockProbe.seen.append(_lock_free(_LockProbe.monitor))


def test_control_the_probe_sees_the_lock_held(registry):
    """Control for the test above: called where the monitor's lock is held, the probe says so."""
    from tripwire.report import register_reporter

    register_reporter("test.lockprobe", _LockProbe)
    m = Monitor(registry=registry, capacity=64)
    _LockProbe.monitor = m
    m.counter(registry.register("k.probe", kind="test.lockprobe"), "cpu")
    m.poll()  # the first decode makes the reporter; its tick runs under the lock
    assert _LockProbe.seen == [False]


def test_control_confirming_at_once_loses_the_late_extremes(registry, monitor, caplog, monkeypatch):
    monitor.confirmer.max_extra_copies = 0
    monitor.confirmer.offenders_wait_s = 0.0  # no wait of any kind
    s = registry.register("k.site")
    ctr = monitor.counter(s, "cpu")
    hit(ctr, 1, 5)
    monitor.poll()
    write_count(ctr)
    monitor.poll()  # confirmed at once, with B counted but its extremes missing
    write_extremes(ctr, 900, 1_000_000)
    monitor.poll()
    monitor.poll()
    assert all("max row 900" not in line for line in warnings(caplog))


def test_saturated_values_are_marked_in_reports(registry, monitor, caplog):
    from tripwire.layout import VALUE_MAX

    s = registry.register("k.site")
    hit(monitor.counter(s, "cpu"), 1, VALUE_MAX)
    monitor.poll()
    monitor.poll()
    assert "saturated: |value| >= 2**62" in warnings(caplog)[0]


def test_unknown_kind_is_logged_once_not_a_loop_failure(registry, caplog):
    m = Monitor(registry=registry, capacity=64)
    s = registry.register("k.weird", kind="no-such-kind")
    m.counter(s, "cpu")[0] = 3
    for _ in range(5):
        m.poll()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "no reporter" in r.getMessage()]
    assert len(errors) == 1 and m.armed is None and m.loop_errors == 0


def test_progress_sums_each_kinds_own_count_slots(registry, monitor, caplog):
    """A row's progress is the sum of ITS kind's count slots (computed as whole-column operations): a clip row's
    V count (slot 1) is progress, a guard row's slot 1 (its max row) is not, and a row of a kind with no reporter
    is read but never reported."""
    import tripwire.numerics  # noqa: F401  (registers the "clip" reporter)

    g = registry.register("k.guard")
    c = registry.register("k.clip", kind="clip")
    u = registry.register("k.unknown", kind="no-such-kind")
    gr, cr, ur = (monitor.counter(s, "cpu") for s in (g, c, u))
    cr[1] = 3  # V clipped count only
    gr[MAX_ROW] = encode(9)  # an extreme without a count: no progress for a guard row
    ur[COUNT] = 5
    for _ in range(6):  # past the bounded wait for a first offender that never lands
        monitor.poll()
    lines = warnings(caplog)
    assert len(lines) == 1 and "'k.clip'" in lines[0]
    assert monitor.snapshot().get(("cpu", "k.guard")) is None
    # The same plan after the registry grows (the cached plan is rebuilt for the new size).
    g2 = registry.register("k.guard2")
    hit(monitor.counter(g2, "cpu"), 4, 7)
    monitor.poll()
    monitor.poll()
    assert any("'k.guard2'" in line for line in warnings(caplog))


def test_quiet_ticks_skip_the_decode_and_miss_nothing(registry, monitor, caplog):
    s = registry.register("k.site")
    ctr = monitor.counter(s, "cpu")
    c = monitor.confirmer
    for _ in range(5):
        monitor.poll()
    # The first copy is decoded; the four identical ones after it are not.
    assert c.decoded == 1 and monitor.quiet_ticks == 4
    hit(ctr, 7, 300, n=3)
    monitor.poll()  # the rise is decoded (pending), and the next copy confirms it although it is identical
    monitor.poll()
    assert c.decoded == 3 and int(c.latest("cpu")[s.id, COUNT]) == 3 and monitor.quiet_ticks == 4
    (line,) = warnings(caplog)
    assert "3 new out-of-range accesses masked (3 total)" in line and "row 7, value 300" in line
    for _ in range(3):
        monitor.poll()
    assert c.decoded == 3 and monitor.quiet_ticks == 7
    hit(ctr, 9, 500, n=2)  # a later rise after quiet ticks is seen on the very next copy, confirmed on the one after
    monitor.poll()
    assert c.reported("cpu", s.id) == 3 and c.pending("cpu") == (s.id,)
    monitor.poll()
    assert c.reported("cpu", s.id) == 5 and c.pending("cpu") == ()
    # Registry growth changes the rows' shape: decoded, never mistaken for quiet.
    registry.register("k.other")
    monitor.poll()
    assert c.decoded == 6


def test_control_quiet_skip_while_pending_loses_the_report(registry, monitor, caplog, monkeypatch):
    """Control: skipping identical copies even while a confirmation is pending (it counts copies) never reports
    a rise whose extremes have already landed; the real monitor reports it on the next copy."""
    s = registry.register("k.site")
    ctr = monitor.counter(s, "cpu")
    monkeypatch.setattr(monitor.confirmer, "quiet_reference", monitor.confirmer.latest)
    monitor.poll()
    hit(ctr, 7, 300, n=3)
    for _ in range(6):
        monitor.poll()
    assert warnings(caplog) == []
    assert monitor.confirmer.reported("cpu", s.id) == 0


# ---------------------------------------------------------------------------------------------------- health
def test_health_of_a_running_reader(registry):
    m = Monitor(registry=registry, capacity=64, interval=0.005)
    s = registry.register("k.health")
    hit(m.counter(s, "cpu"), 1, 2, n=3)
    assert m.health()["ok"] is False and m.health()["last_tick_age"] is None  # not started yet
    m.start()
    try:
        deadline = time.monotonic() + 5
        while m.health()["counts"].get("cpu", {}).get("k.health") != 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        h = m.health()
    finally:
        m.stop()
    assert h["ok"] and h["reader_alive"] and not h["armed"] and h["stop"] is None and h["mode"] == "warn"
    assert h["counts"] == {"cpu": {"k.health": 3}} and h["devices"]["cpu"]["lost"] is None
    assert 0 <= h["last_tick_age"] < 1.0 and h["ticks"] == h["python_ticks"] + h["native_ticks"] > 0
    assert h["native_tick"] in ("engaged", "ready") or h["native_tick"].startswith("no ")
    import json

    json.dumps(h)  # plain JSON types, for a health endpoint


def test_health_counts_are_what_the_reports_said(registry, caplog):
    """``counts`` is each site's total as the reports let out so far carried it: one report of 1 and a rise of 4
    the window defers read 1 (the log said 1), and 5 once drain's report says 5. Control: the confirmed progress,
    which ``counts`` must not read, is already 5 while the log has said 1."""
    m = Monitor(registry=registry, capacity=64, report_every=60)
    s = registry.register("k.counts")
    ctr = m.counter(s, "cpu")
    _hit_and_confirm(m, ctr, 7, 300)
    assert m.health()["counts"] == {"cpu": {"k.counts": 1}}
    hit(ctr, 8, 301, n=4)
    m.poll()
    m.poll()
    assert [w.split(": ", 1)[1].split(".")[0] for w in warnings(caplog)] == [
        "1 new out-of-range access masked (1 total)"
    ]
    assert m.health()["counts"] == {"cpu": {"k.counts": 1}}
    assert m.confirmer.reported("cpu", s.id) == 5  # control: confirmed, its report deferred by the window
    m.drain()
    assert warnings(caplog)[-1].split(": ", 1)[1].startswith("4 new out-of-range accesses masked (5 total)")
    assert m.health()["counts"] == {"cpu": {"k.counts": 5}}
    m.reset()
    assert m.health()["counts"] == {}


def test_health_shows_an_armed_stop_and_a_lost_reader(registry):
    m = Monitor(registry=registry, capacity=64, mode="raise")
    s = registry.register("k.armed")
    hit(m.counter(s, "cpu"), 4, 44)
    _hit_and_confirm(m, m.counter(s, "cpu"), 4, 44)
    h = m.health()
    assert h["armed"] and not h["ok"]
    assert (h["stop"]["site"], h["stop"]["device"], h["stop"]["first_row"], h["stop"]["fatal"]) == (
        "k.armed",
        "cpu",
        4,
        False,
    )
    assert "MASKED FAULT" in h["stop"]["message"]
    m.reset()
    assert not m.health()["armed"]

    def broken(n, same_as=None):
        raise RuntimeError("device fell off the bus")

    m.readers()["cpu"].poll = broken
    m.poll()
    h = m.health()
    assert h["armed"] and h["stop"]["site"] == "<reader>" and not h["ok"]
    assert h["devices"]["cpu"]["lost"] == "RuntimeError: device fell off the bus"


def test_health_of_a_stuck_reader_shows_its_last_tick_ageing(registry):
    """Control for the tick age: a reader that stops ticking (stopped here) leaves an age that keeps growing."""
    m = Monitor(registry=registry, capacity=64, interval=0.005)
    m.prealloc("cpu")
    m.start()
    time.sleep(0.05)
    m.stop()
    a = m.health()["last_tick_age"]
    time.sleep(0.1)
    assert m.health()["last_tick_age"] >= a + 0.09 and not m.health()["reader_alive"]


# ---------------------------------------------------------------------------------------------------- papercuts
def test_settings_are_read_only_attributes(registry):
    m = Monitor(registry=registry, capacity=64, mode="raise", interval=0.02, report_every=3.0)
    assert (m.mode, m.interval, m.report_every, m.capacity, m.idle_tail) == ("raise", 0.02, 3.0, 64, 2.0)
    assert m.native_tick == "not started" and m.event_log is None and m.store_poll == 0.5
    with pytest.raises(AttributeError, match="read-only"):
        m.mode = "off"
    assert m.mode == "raise"


def test_configure_refuses_to_replace_a_default_monitor_with_arenas():
    first = tripwire.configure(mode="warn", replace_live=True)
    second = tripwire.configure(mode="warn", interval=0.02)  # control: no arena yet, so it may be replaced
    assert second is tripwire.default_monitor() and second is not first
    tripwire.counter(tripwire.register_site("test_monitor.configure"), "cpu")
    with pytest.raises(RuntimeError, match=r"already has counter arenas on cpu.*replace_live=True"):
        tripwire.configure(mode="raise")
    # A broken setting is named first, whatever the monitor it would replace (the CLI turns it into one line).
    with pytest.raises(tripwire.errors.SettingError, match="interval"):
        tripwire.configure(mode="raise", interval=-1)
    assert tripwire.default_monitor() is second and second.mode == "warn"  # untouched
    third = tripwire.configure(mode="raise", replace_live=True)
    assert tripwire.default_monitor() is third and third.mode == "raise"
    tripwire.stop(timeout=1.0)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "1", True])
def test_stop_timeout_is_validated(registry, bad):
    m = Monitor(registry=registry, capacity=64, interval=0.01)
    m.start()
    with pytest.raises(ValueError, match="stop"):
        m.stop(timeout=bad)
    m.stop(timeout=0.5)
    assert not m.reader_alive
    m.start()
    m.stop(timeout=None)
    assert not m.reader_alive
