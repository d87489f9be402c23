"""tripwire.verdict: same-step verdicts over the real validator kernel (the interpreter on the CPU, the GPU when there
is one): what a step's hits taint, per-step offenders, fail-closed, the stop without containment, the reader's
deference to the ring, and the bad-input errors, each with a control that re-creates what it guards against."""

from __future__ import annotations

import pytest
import torch

from tripwire import CaptureError, GuardTripped, Monitor, SiteRegistry
from tripwire.contain import VerdictLedger
from tripwire.validate import Validator
from tripwire.verdict import Verdicts

HAS_CUDA = torch.cuda.is_available()


def _monitor(**settings):
    settings.setdefault("mode", "warn")
    return Monitor(registry=SiteRegistry(capacity=32), capacity=32, interval=0.01, offenders=4, **settings)


def _setup(mon, dev, *, fatal=False):
    v = Validator("s", dev, policy="mask", monitor=mon)
    v.index("slots", hi=100, padding=-1, fatal=fatal, requests="req", segments="cu")
    ring = mon.verdicts(dev, [v.rules["slots"].site])
    return v, ring


def _step(v, mon, dev, bad_tokens, ids=("a", "b", "c")):
    """Three requests of 3, 2 and 3 tokens named by the engine ids ``ids``; ``bad_tokens`` get out-of-range slots."""
    slots = torch.arange(8, device=dev)
    for t in bad_tokens:
        slots[t] = 1000 + t
    req = torch.tensor([mon.requests.number(i) for i in ids], device=dev)
    v(slots=slots, req=req, cu=torch.tensor([0, 3, 5, 8], dtype=torch.int32, device=dev))


def _sync(dev):
    if dev != "cpu":
        torch.cuda.synchronize()


def test_a_step_verdict_names_the_engine_ids_it_hit(kernel_device):
    mon = _monitor(contain=True)
    v, ring = _setup(mon, kernel_device)
    _step(v, mon, kernel_device, [])
    t = ring.enqueue()
    _sync(kernel_device)
    assert ring.take(t).clean
    _step(v, mon, kernel_device, [4, 6])
    t = ring.enqueue()
    _sync(kernel_device)
    verdict = ring.take(t)
    assert verdict.tainted == {"b", "c"} and not verdict.fail_all and verdict.stop is None
    (h,) = verdict.hits
    assert (h.site, h.delta, h.total, h.attributed) == ("s.slots", 2, 2, True)
    assert sorted((o.row, o.value, o.request) for o in h.offenders) == [(4, 1004, "b"), (6, 1006, "c")]
    assert verdict.failure("b").row == 4 and verdict.failure("a") is None
    assert mon.armed is None
    # The next step is clean: the rise was accounted for, and its offenders were consumed on the device.
    _step(v, mon, kernel_device, [])
    t = ring.enqueue()
    _sync(kernel_device)
    assert ring.take(t).clean


def test_offenders_are_per_step(kernel_device):
    """K = 4. Four distinct bad tokens in each of two steps: each step is attributed in full, because the first
    verdict consumed its offenders. Control: the same eight offenders without a verdict in between fill the block,
    so the second step's rise cannot be attributed (fail closed)."""
    mon = _monitor(contain=True)
    v, ring = _setup(mon, kernel_device)
    _step(v, mon, kernel_device, [0, 1, 2, 3])
    t = ring.enqueue()
    _sync(kernel_device)
    assert ring.take(t).tainted == {"a", "b"}
    _step(v, mon, kernel_device, [4, 5, 6, 7], ids=("d", "e", "f"))
    t = ring.enqueue()
    _sync(kernel_device)
    second = ring.take(t)
    assert second.tainted == {"e", "f"} and not second.fail_all
    # Control: two steps' offenders, one verdict.
    _step(v, mon, kernel_device, [0, 1, 2, 3], ids=("g", "h", "i"))
    _step(v, mon, kernel_device, [4, 5, 6, 7], ids=("j", "k", "l"))
    t = ring.enqueue()
    _sync(kernel_device)
    both = ring.take(t)
    assert both.fail_all and both.hits[0].delta == 8 and len(both.hits[0].offenders) == 4


def test_more_than_k_in_one_step_fails_the_step_and_later_steps_are_attributed_again(kernel_device):
    mon = _monitor(contain=True, mode="raise")
    v, ring = _setup(mon, kernel_device)
    _step(v, mon, kernel_device, [0, 1, 2, 3, 4, 5])
    t = ring.enqueue()
    _sync(kernel_device)
    verdict = ring.take(t)
    assert verdict.fail_all and verdict.stop is None and mon.armed is None
    assert verdict.failure("zzz") is not None and verdict.failure("zzz").request is None
    _step(v, mon, kernel_device, [6])
    t = ring.enqueue()
    _sync(kernel_device)
    again = ring.take(t)
    assert again.tainted == {"c"} and not again.fail_all


def test_without_containment_a_fatal_site_stops_in_the_same_step(kernel_device):
    mon = _monitor()
    v, ring = _setup(mon, kernel_device, fatal=True)
    _step(v, mon, kernel_device, [1])
    t = ring.enqueue()
    _sync(kernel_device)
    verdict = ring.take(t)
    assert isinstance(verdict.stop, GuardTripped) and verdict.stop.site == "s.slots" and verdict.stop.fatal
    assert mon.armed is verdict.stop and verdict.tainted == {"a"}
    with pytest.raises(GuardTripped):
        mon.check()


def test_under_containment_a_fatal_site_is_contained_and_the_reader_defers(kernel_device):
    """A contained write: the verdict taints its request and arms nothing, and the reader's confirmation of the same
    rise (drain) does not arm either. Control: the same site without a ring is armed by the reader."""
    mon = _monitor(contain=True)
    v, ring = _setup(mon, kernel_device, fatal=True)
    _step(v, mon, kernel_device, [3])
    t = ring.enqueue()
    _sync(kernel_device)
    assert ring.take(t).tainted == {"b"}
    snap = mon.drain()
    assert mon.armed is None
    (off,) = snap[(str(v.device), "s.slots")].offenders
    assert off.request == "b", "the snapshot names the engine's id, and keeps the offender the verdict consumed"
    control = _monitor(contain=True)
    cv = Validator("s", kernel_device, policy="mask", monitor=control)
    cv.index("slots", hi=100, padding=-1, fatal=True, requests="req", segments="cu")
    _step(cv, control, kernel_device, [3])
    control.drain()
    assert isinstance(control.armed, GuardTripped)


def test_reading_a_verdict_changes_no_policy(kernel_device):
    """A verdict's taints are read, never a switch: in ``raise`` mode without the contain setting, reading the
    verdict's taints and failures leaves containment off and the stop armed in the step. Control: the same hit with
    the setting on arms nothing."""
    for contain in (False, True):
        mon = _monitor(mode="raise", contain=contain)
        v, ring = _setup(mon, kernel_device)
        _step(v, mon, kernel_device, [2])
        t = ring.enqueue()
        _sync(kernel_device)
        verdict = ring.take(t)
        assert [tt.request for tt in verdict.taints] == ["a"] and verdict.failure("a").row == 2
        assert mon.contain is contain
        if contain:
            assert verdict.stop is None and mon.armed is None and mon.health()["armed"] is False
        else:
            assert isinstance(verdict.stop, GuardTripped) and mon.armed is verdict.stop
            assert mon.health()["armed"] is True
        mon.stop()


def test_reset_rebaselines_the_ring(kernel_device):
    mon = _monitor(contain=True)
    v, ring = _setup(mon, kernel_device)
    _step(v, mon, kernel_device, [4])
    t = ring.enqueue()
    _sync(kernel_device)
    assert ring.take(t).tainted == {"b"}
    mon.reset()
    _step(v, mon, kernel_device, [4])
    t = ring.enqueue()
    _sync(kernel_device)
    assert ring.take(t).tainted == {"b"}, "after a reset the same offender counts again"


def test_bad_input(kernel_device):
    mon = _monitor(contain=True)
    _v, ring = _setup(mon, kernel_device)
    with pytest.raises(ValueError, match="already has a verdict ring"):
        mon.verdicts(kernel_device, ["s.slots"])
    with pytest.raises(ValueError, match="depth"):
        mon.verdicts(kernel_device, [mon.registry.register("other")], depth=0)
    t = ring.enqueue()
    _sync(kernel_device)
    ring.take(t)
    with pytest.raises(ValueError, match="not an open ticket"):
        ring.take(t)
    small = mon.verdicts(kernel_device, [mon.registry.register("third")], depth=2)
    small.enqueue()
    small.enqueue()
    with pytest.raises(RuntimeError, match="none is free"):
        small.enqueue()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_copy_that_has_not_landed_is_refused_and_stays_takeable():
    mon = _monitor(contain=True)
    v, ring = _setup(mon, "cuda")
    side = torch.cuda.Stream()
    slots = torch.arange(8, device="cuda")
    slots[4] = 1004
    req = torch.tensor([mon.requests.number(i) for i in ("a", "b", "c")], device="cuda")
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32, device="cuda")
    # A clean step first, taken: the validator's and the ring's kernels are compiled and loaded before the sleep (a
    # first launch's compile inside the window, in a loaded test process, outlasted the sleep and the copy landed).
    with torch.cuda.stream(side):
        v(slots=torch.arange(8, device="cuda"), req=req, cu=cu)
        assert ring.take(ring.enqueue(side), wait=True).tainted == frozenset()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        # Only device work from here: the stream stays busy, so the verdict's copy cannot have landed at the take.
        torch.cuda._sleep(2_000_000_000)
        v(slots=slots, req=req, cu=cu)
        t = ring.enqueue(side)
    with pytest.raises(RuntimeError, match="has not landed"):
        ring.take(t)
    verdict = ring.take(t, wait=True)  # the bounded wait
    assert verdict.tainted == {"b"}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_captured_verdict_reads_each_replay():
    mon = _monitor(contain=True)
    v, ring = _setup(mon, "cuda")
    slots = torch.arange(8, device="cuda")
    req = torch.tensor([mon.requests.number(i) for i in ("a", "b", "c")], device="cuda")
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32, device="cuda")
    src = slots.clone()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        v(slots=slots, req=req, cu=cu)  # warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        slots.copy_(src)
        v(slots=slots, req=req, cu=cu)
        t = ring.enqueue()
    with pytest.raises(CaptureError):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=s):
            ring.take(t)
    for bad, want in ((None, set()), (6, {"c"}), (1, {"a"}), (None, set())):
        src.copy_(torch.arange(8, device="cuda"))
        if bad is not None:
            src[bad] = 5000
        g.replay()
        torch.cuda.synchronize()
        assert set(ring.take(t).tainted) == want


def test_a_report_names_the_offenders_a_later_take_consumed(monkeypatch):
    """The reader can read a rise after the ring consumed its offenders from the block and before the take. A report
    the window deferred goes out with the ledger as it is then, and on the CPU the enqueue put them there before it
    cleared the block: a report released at that confirm (no window) names the request too. Control: without the
    enqueue's ledger entry, the released report cannot name it (the deferred one still does, from the take)."""

    def run(report_every):
        mon = _monitor(contain=True, report_every=report_every)
        events = []
        mon.add_sink(events.append)
        v, ring = _setup(mon, "cpu")
        _step(v, mon, "cpu", [4])  # the site's first rise: its report leaves at once
        ring.take(ring.enqueue())
        for _ in range(3):
            mon.poll()
        _step(v, mon, "cpu", [6])
        t = ring.enqueue()  # the block's offender consumed into the ring's slot
        for _ in range(3):
            mon.poll()  # the reader confirms the rise before the take
        assert ring.take(t).tainted == {"c"}
        mon.drain()
        mon.stop()
        return [{o.request for o in e.offenders} for e in events if e.kind == "guard"]

    deferred = run(report_every=60.0)
    assert len(deferred) == 2 and "c" in deferred[1], deferred
    released = run(report_every=1e-6)
    assert len(released) == 2 and "c" in released[1], released
    # The control: the enqueue consumes the block without a ledger entry (only the take adds them). The CPU enqueue's
    # sole ledger writes are those entries, so the ledger's public add is dropped while an enqueue runs.
    enqueuing = [False]
    add, enqueue = VerdictLedger.add, Verdicts.enqueue

    def add_unless_enqueuing(self, device, row, offenders):  # type: ignore[no-untyped-def]
        if not enqueuing[0]:
            add(self, device, row, offenders)

    def enqueue_flagged(self, stream=None):  # type: ignore[no-untyped-def]
        enqueuing[0] = True
        try:
            return enqueue(self, stream)
        finally:
            enqueuing[0] = False

    monkeypatch.setattr(VerdictLedger, "add", add_unless_enqueuing)
    monkeypatch.setattr(Verdicts, "enqueue", enqueue_flagged)
    assert "c" in run(report_every=60.0)[1]
    released = run(report_every=1e-6)
    assert len(released) == 2 and "c" not in released[1], released


def test_a_dirty_verdict_has_reached_the_sinks_when_take_returns(kernel_device):
    """An engine fails the requests a verdict names as soon as ``take`` returns: by then the event naming them has
    reached every sink, also for a second rise inside the report window (which a reader report would defer), and
    the reader does not report the same rise again. Control: a ring built without the monitor's report leaves the
    sink empty at that moment (the event comes only from the reader's later read)."""
    for report in (True, False):
        mon = _monitor(contain=True, report_every=60.0)
        events: list = []
        mon.add_sink(events.append)
        v = Validator("s", kernel_device, policy="mask", monitor=mon)
        v.index("slots", hi=100, padding=-1, requests="req", segments="cu")
        site = v.rules["slots"].site
        if report:
            ring = mon.verdicts(kernel_device, [site])
        else:
            # The same ring without the monitor's synchronous report (what an engine had before it).
            dev = torch.device(kernel_device if kernel_device == "cpu" else "cuda:0")
            ring = Verdicts(mon.pipeline.context, dev, [site], 4, prealloc=mon.prealloc, offenders=mon.arena.offenders)
            mon.pipeline.ledger.cover(str(dev), site.id)
        for step, (bad, ids) in enumerate((([4], ("a", "b", "c")), ([1], ("d", "e", "f")))):
            _step(v, mon, kernel_device, bad, ids=ids)
            t = ring.enqueue()
            _sync(kernel_device)
            verdict = ring.take(t)
            named = [o.request for e in events if e.kind == "guard" for o in e.offenders]
            want = {"b"} if step == 0 else {"d"}
            assert verdict.tainted == want
            if report:
                assert want <= set(named), (step, named)  # explained before the engine fails the request
            else:
                assert named == [], named
        if report:
            mon.poll()
            mon.poll()
            mon.drain()
            guard = [e for e in events if e.kind == "guard"]
            assert [e.delta for e in guard] == [1, 1] and guard[-1].total == 2  # nothing reported twice
        mon.stop()


def _ring_with_sink(kernel_device):
    mon = _monitor(contain=True, report_every=60.0)
    events: list = []
    mon.add_sink(events.append)
    v = Validator("s", kernel_device, policy="mask", monitor=mon)
    v.index("slots", hi=100, padding=-1, requests="req", segments="cu")
    return mon, events, v, mon.verdicts(kernel_device, [v.rules["slots"].site])


def _guard(events: list) -> list:
    """Each guard event's delta and the newest request it names (a report carries the row's lifetime offenders,
    the ones consumed by earlier verdicts first)."""
    return [(e.delta, e.offenders[-1].request) for e in events if e.kind == "guard"]


def test_a_rise_the_reader_confirmed_first_is_out_when_take_returns(kernel_device):
    """The reader confirms a second rise before the engine takes the step's verdict: its report, deferred by the
    report window, is released by the take (every hit row's report, not only those the verdict confirms itself).
    Control: the same order without the take leaves the report deferred (the sink lacks the request)."""
    for take in (True, False):
        mon, events, v, ring = _ring_with_sink(kernel_device)
        _step(v, mon, kernel_device, [4])
        ring.take(_enqueued(ring, kernel_device))  # the first rise, reported at once
        _step(v, mon, kernel_device, [1], ids=("d", "e", "f"))
        t = ring.enqueue()
        _sync(kernel_device)
        for _ in range(3):
            mon.poll()  # the reader's ticks between the step's kernels and the take: confirmed, deferred
        if take:
            assert ring.take(t).tainted == {"d"}
            assert _guard(events) == [(1, "b"), (1, "d")]
        else:
            assert _guard(events) == [(1, "b")]  # deferred by the window
        mon.drain()
        assert _guard(events) == [(1, "b"), (1, "d")]  # nothing twice either way
        mon.stop()


@pytest.mark.gpu
def test_gpu_the_final_read_names_the_offenders_of_a_verdict_never_taken(monkeypatch):
    """A CUDA enqueue consumes its step's offenders on the device; a verdict never taken (an engine stopped between
    the step and the take) holds them only in its slot. The final read puts them in the ledger, so drain's report
    names the step's request. Control: without that, the report names the request an earlier verdict consumed."""
    for absorb in (True, False):
        mon, events, v, ring = _ring_with_sink("cuda")
        if not absorb:
            monkeypatch.setattr(ring, "absorb_untaken", lambda: None)
        _step(v, mon, "cuda", [4])
        ring.take(_enqueued(ring, "cuda"))
        _step(v, mon, "cuda", [1], ids=("d", "e", "f"))
        ring.enqueue()
        mon.drain()
        assert _guard(events) == [(1, "b"), (1, "d" if absorb else "b")]
        mon.stop()


def test_a_stale_reader_copy_after_the_take_reports_nothing_again(kernel_device):
    """A reader copy that landed before the step's kernel counted, processed after the verdict's report, must not
    lower what was reported (the next copy would confirm the same rise again: a second report, a second arming).
    The stale copy is made by the reader itself: the counter row is given its pre-step words for one landed copy,
    then its own back. Control: once a copy has caught up with the verdict's complete read (the floor it leaves is
    gone), the same stale copy lowers it. Either way no second event goes out (the window releases no report of 0)."""
    for keep_floor in (True, False):
        mon, events, v, ring = _ring_with_sink(kernel_device)
        assert not mon.reader_alive  # no reader thread: the polls below are the only copies
        site = v.rules["slots"].site
        dev = str(torch.device(kernel_device if kernel_device == "cpu" else "cuda:0"))
        ctr = mon.counter(site, dev)  # the site's row of the arena
        before = mon.read_rows(dev).copy()
        _step(v, mon, kernel_device, [4])
        ring.take(_enqueued(ring, kernel_device))
        assert _guard(events) == [(1, "b")]
        now = mon.read_rows(dev).copy()
        assert [r for r in range(now.shape[0]) if (now[r] != before[r]).any()] == [site.id]  # the step's one row
        if not keep_floor:
            _poll_until_processed(mon, dev, now)  # caught up: the floor is gone
        own = ctr.clone()
        ctr.copy_(torch.from_numpy(before[site.id]))  # the words a copy landed before the kernel would hold
        _sync(kernel_device)
        _poll_until_processed(mon, dev, before)
        assert mon.pipeline.confirmer.reported(dev, site.id) == (1 if keep_floor else 0)
        ctr.copy_(own)
        _sync(kernel_device)
        for _ in range(5):
            mon.check()
            mon.poll()
        mon.drain()
        assert _guard(events) == [(1, "b")]
        assert mon.pipeline.confirmer.reported(dev, site.id) == 1
        mon.stop()


def _poll_until_processed(mon, dev, rows):
    """Reader ticks (each after an engine step's check) until the rows processed last are ``rows``: a GPU copy
    lands at a poll after the one that starts it."""
    import time

    import numpy as np

    deadline = time.monotonic() + 30
    while True:
        mon.check()
        mon.poll()
        latest = mon.pipeline.confirmer.latest(dev)
        if latest is not None and np.array_equal(latest[: rows.shape[0]], rows):
            return
        assert time.monotonic() < deadline, (latest, rows)


def _enqueued(ring, kernel_device):
    t = ring.enqueue()
    _sync(kernel_device)
    return t
