"""tripwire.contain through Monitor.take_tainted(): attributed hits taint their requests instead of arming the stop;
what cannot be attributed fails closed. Hits come from the real validator kernel (the interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from tripwire import GuardTripped, Monitor, SiteRegistry
from tripwire.validate import Validator


@pytest.fixture
def raising():
    """raise mode with the contain setting on."""
    m = Monitor(registry=SiteRegistry(capacity=32), capacity=32, mode="raise", interval=0.01, offenders=4, contain=True)
    yield m
    m.stop()


@pytest.fixture
def raising_uncontained():
    m = Monitor(registry=SiteRegistry(capacity=32), capacity=32, mode="raise", interval=0.01, offenders=4)
    yield m
    m.stop()


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


def _call(v, dev, bad_tokens, *, requests=True):
    """Three requests of 3, 2 and 3 tokens (ids 10, 11, 12); ``bad_tokens`` get out-of-range slots."""
    slots = torch.arange(8, device=dev)
    for t in bad_tokens:
        slots[t] = 1000 + t
    args = {"slots": slots}
    if requests:
        args["req"] = torch.tensor([10, 11, 12], device=dev)
        args["cu"] = torch.tensor([0, 3, 5, 8], dtype=torch.int32, device=dev)
    v(**args)


def test_attributed_hits_taint_instead_of_arming(raising, kernel_device):
    v = _validator(raising, kernel_device)
    assert raising.take_tainted() == []
    _call(v, kernel_device, [4, 6])
    raising.drain()
    taints = raising.take_tainted()
    assert sorted((t.request, t.row, t.value) for t in taints) == [(11, 4, 1004), (12, 6, 1006)]
    assert all(t.site == "c.slots" and t.device == str(v.device) for t in taints)
    assert raising.armed is None
    raising.check()  # does not raise
    assert raising.take_tainted() == []  # taken once
    # A repeat of the same offenders taints nothing new and still does not arm.
    _call(v, kernel_device, [4])
    raising.drain()
    assert raising.take_tainted() == [] and raising.armed is None


def test_control_without_containment_the_same_hit_arms(raising_uncontained, kernel_device):
    m = raising_uncontained
    v = _validator(m, kernel_device)
    assert m.take_tainted() == []  # reading taints changes no policy: containment stays off
    _call(v, kernel_device, [4])
    m.drain()
    assert isinstance(m.armed, GuardTripped) and m.armed.site == "c.slots"


def test_a_hit_without_a_request_fails_closed(raising, kernel_device):
    v = _validator(raising, kernel_device, requests=False)
    raising.take_tainted()
    _call(v, kernel_device, [1], requests=False)
    raising.drain()
    (taint,) = raising.take_tainted()
    assert taint.request is None and taint.row == 1 and taint.value == 1001
    assert isinstance(raising.armed, GuardTripped)  # raise mode: as without containment


def test_padding_tokens_past_the_last_request_name_none(raising, kernel_device):
    v = _validator(raising, kernel_device)
    raising.take_tainted()
    slots = torch.arange(10, device=kernel_device)
    slots[9] = 5000  # token 9 is past cu's last offset (8): padding of a captured batch
    v(
        slots=slots,
        req=torch.tensor([10, 11, 12], device=kernel_device),
        cu=torch.tensor([0, 3, 5, 8], dtype=torch.int32, device=kernel_device),
    )
    raising.drain()
    (taint,) = raising.take_tainted()
    assert taint.request is None and raising.armed is not None


def test_a_full_offender_block_fails_closed(raising, kernel_device):
    """K = 4: six distinct bad tokens in one call keep four offenders; the two dropped may name other requests, so
    the rise is not attributed (a None taint, and raise mode arms). Control: four bad tokens fit and stay contained."""
    v = _validator(raising, kernel_device)
    raising.take_tainted()
    _call(v, kernel_device, [0, 1, 2, 3])
    raising.drain()
    assert len(raising.take_tainted()) == 4 and raising.armed is None
    raising.reset()
    raising.take_tainted()
    _call(v, kernel_device, [0, 1, 2, 3, 4, 5])
    raising.drain()
    taints = raising.take_tainted()
    assert len([t for t in taints if t.request is not None]) == 4
    assert any(t.request is None for t in taints)
    assert raising.armed is not None


def test_a_fatal_site_still_stops(kernel_device):
    m = Monitor(registry=SiteRegistry(capacity=32), capacity=32, mode="warn", interval=0.01, contain=True)
    v = _validator(m, kernel_device, fatal=True)
    m.take_tainted()
    _call(v, kernel_device, [4])
    m.drain()
    assert m.take_tainted() == []  # a fatal site taints nothing: it stops
    assert isinstance(m.armed, GuardTripped) and m.armed.fatal


def test_reset_forgets_offenders_and_taints(raising, kernel_device):
    v = _validator(raising, kernel_device)
    raising.take_tainted()
    _call(v, kernel_device, [4])
    raising.reset()  # the final read confirms the rise (a taint), then everything is forgotten
    assert raising.take_tainted() == []
    _call(v, kernel_device, [4])  # the same offender after a reset is new again
    raising.drain()
    assert [t.request for t in raising.take_tainted()] == [11]


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
