"""tripwire.contain: containment is ONE monitor setting (``Monitor(contain=True)``, ``TRIPWIRE_CONTAIN``,
``Monitor.set_contain``) and ONE path, the same-step verdict: under it a verdict's attributed hit fails its requests
instead of arming the stop, what cannot be attributed fails the whole step, and a site no verdict ring covers is
never contained (the reader's late confirmation arms as without containment). Hits come from the real validator
kernel (the interpreter on the CPU, the GPU when there is one)."""

from __future__ import annotations

import pytest
import torch

from tripwire import GuardTripped, Monitor, SiteRegistry
from tripwire.validate import Validator


def _monitor(**settings):
    settings.setdefault("mode", "raise")
    return Monitor(registry=SiteRegistry(capacity=32), capacity=32, interval=0.01, offenders=4, **settings)


def _validator(m, dev, *, fatal=False, requests=True):
    v = Validator("c", dev, policy="mask", monitor=m)
    v.index(
        "slots",
        hi=100,
        padding=-1,
        fatal=fatal,
        requests="req" if requests else None,
        segments="cu" if requests else None,
    )
    return v


def _call(v, dev, bad_tokens, *, requests=True, tokens=8):
    """Three requests of 3, 2 and 3 tokens (ids 10, 11, 12; ``tokens`` past 8 are padding past the last request);
    ``bad_tokens`` get out-of-range slots."""
    slots = torch.arange(tokens, device=dev)
    for t in bad_tokens:
        slots[t] = 1000 + t
    args = {"slots": slots}
    if requests:
        args["req"] = torch.tensor([10, 11, 12], device=dev)
        args["cu"] = torch.tensor([0, 3, 5, 8], dtype=torch.int32, device=dev)
    v(**args)


def _verdict(ring, dev):
    t = ring.enqueue()
    if dev != "cpu":
        torch.cuda.synchronize()
    return ring.take(t)


def _ring(m, v, dev):
    return m.verdicts(dev, [v.rules["slots"].site])


@pytest.mark.parametrize("how", ["keyword", "environment", "set_contain"])
def test_containment_is_one_setting_three_ways(how, kernel_device):
    """Each way to switch containment on is the same setting, read by the verdict: in ``raise`` mode an attributed
    hit fails its requests and arms nothing. ``set_contain`` reaches a ring built before the call. Control: the same
    monitor and ring with the setting off (``set_contain(False)``) arm the stop in the step."""
    if how == "keyword":
        m = _monitor(contain=True)
    elif how == "environment":
        m = _monitor(env={"TRIPWIRE_CONTAIN": "1"})
    else:
        m = _monitor()
        assert m.contain is False
    v = _validator(m, kernel_device)
    ring = _ring(m, v, kernel_device)
    if how == "set_contain":
        m.set_contain(True)  # after the ring was built: it reads the setting at each dirty verdict
    assert m.contain is True
    _call(v, kernel_device, [4, 6])
    verdict = _verdict(ring, kernel_device)
    assert verdict.tainted == {11, 12} and not verdict.fail_all and verdict.stop is None
    assert sorted((t.request, t.row, t.value) for t in verdict.taints) == [(11, 4, 1004), (12, 6, 1006)]
    m.drain()  # the reader's confirmation of the same rise defers to the ring
    assert m.armed is None
    m.check()  # does not raise
    # Control: containment switched off on the same monitor and ring; the next hit arms in its own step.
    m.set_contain(False)
    assert m.contain is False
    _call(v, kernel_device, [1])
    off = _verdict(ring, kernel_device)
    assert isinstance(off.stop, GuardTripped) and m.armed is off.stop and off.tainted == {10}
    m.stop()


def test_set_contain_bad_input():
    m = _monitor()
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match=r"set_contain\(on\) takes True or False"):
            m.set_contain(bad)
    with pytest.raises(AttributeError, match=r"Monitor\.contain is read-only: call \.set_contain\(True\)"):
        m.contain = True
    with pytest.raises(AttributeError, match=r"Monitor\.mode is read-only: build it with mode=\.\.\. instead"):
        m.mode = "warn"
    assert m.contain is False and m.mode == "raise"


@pytest.mark.parametrize("covered", [True, False], ids=["ring", "no-ring"])
def test_a_site_no_ring_covers_is_not_contained(covered, kernel_device):
    """The verdict is the one containment path: with a ring over the site the attributed hit fails its request and
    arms nothing, and the reader's confirmation defers to the ring; without one the reader's confirmation (about two
    intervals late: a request may have been handed back) arms the stop in ``raise`` mode, exactly as without
    containment."""
    m = _monitor(contain=True)
    v = _validator(m, kernel_device)
    ring = _ring(m, v, kernel_device) if covered else None
    _call(v, kernel_device, [4])
    if ring is not None:
        assert _verdict(ring, kernel_device).tainted == {11}
    m.drain()
    if covered:
        assert m.armed is None
    else:
        assert isinstance(m.armed, GuardTripped) and m.armed.site == "c.slots" and m.armed.count == 1
    m.stop()


def test_a_fatal_site_no_ring_covers_stops_in_warn_mode(kernel_device):
    """A fatal site (a KV write) outside any ring stops under containment, as without it. Control: a non-fatal site
    outside any ring in ``warn`` mode is reported and arms nothing."""
    for fatal in (True, False):
        m = _monitor(mode="warn", contain=True)
        v = _validator(m, kernel_device, fatal=fatal)
        _call(v, kernel_device, [4])
        snap = m.drain()
        assert snap[(str(v.device), "c.slots")].count == 1
        if fatal:
            assert isinstance(m.armed, GuardTripped) and m.armed.fatal
        else:
            assert m.armed is None
        m.stop()


def test_a_hit_without_a_request_fails_the_step(kernel_device):
    """A kernel without a request map: the verdict cannot say whose result is wrong, so every request of the step
    fails (``fail_all``, a taint naming no request), and under containment nothing arms. Control: the same hit with
    the map names its request and fails nothing else."""
    for requests in (False, True):
        m = _monitor(contain=True)
        v = _validator(m, kernel_device, requests=requests)
        ring = _ring(m, v, kernel_device)
        _call(v, kernel_device, [1], requests=requests)
        verdict = _verdict(ring, kernel_device)
        assert verdict.stop is None and m.armed is None
        if requests:
            assert verdict.tainted == {10} and not verdict.fail_all
            assert verdict.failure(11) is None
        else:
            assert verdict.fail_all and verdict.tainted == frozenset()
            assert [(t.request, t.row, t.value) for t in verdict.taints] == [(None, 1, 1001), (None, 1, 1001)]
            assert verdict.failure("anyone").request is None
        m.stop()


def test_padding_tokens_past_the_last_request_fail_the_step(kernel_device):
    """Token 9 is past the map's last offset (8): padding of a captured batch, owned by no request. Its hit fails the
    step. Control: a bad token inside the map (token 7, request 12) fails only request 12."""
    for bad, want_all in ((9, True), (7, False)):
        m = _monitor(contain=True)
        v = _validator(m, kernel_device)
        ring = _ring(m, v, kernel_device)
        _call(v, kernel_device, [bad], tokens=10)
        verdict = _verdict(ring, kernel_device)
        assert verdict.fail_all is want_all and m.armed is None
        assert verdict.tainted == (frozenset() if want_all else {12})
        m.stop()


def test_a_forgotten_request_number_names_no_request():
    """A request that outlived ``keep`` newer numberings lost its number: its offender must name no request (the
    step fails closed), not the bare number (which names no live request, so nothing would fail and the masked
    result would be handed back). Control: a number never given here (a caller's own map) is kept as it is."""
    from tripwire.contain import RequestNames

    names = RequestNames(keep=4)
    first = names.number("req-0")
    for i in range(1, 6):
        names.number(f"req-{i}")
    assert names.name(first) is None  # forgotten: unknown, fail closed
    assert names.name(names.number("req-5")) == "req-5"
    assert names.name(10_000) == 10_000  # never numbered here
