"""The validator's bound launch (tripwire.validate._triton.Launcher): what decides between the compiled kernel's own
launcher and the JITFunction, and, on a GPU, that the bound path is taken and counts exactly what the JIT path does.
"""

from __future__ import annotations

import pytest
import torch
import triton

from tripwire import Monitor, SiteRegistry
from tripwire.validate import Validator
from tripwire.validate import _triton as vk


def test_hooked_only_when_a_hook_is_installed(monkeypatch):
    """Triton's launch hooks are HookChains, never None: an empty chain is no hook (the bound launch may run), a
    chain with a hook is one (every launch through the JITFunction, which hands the hook its metadata). The control:
    the test `hook is not None`, which took every launch as hooked, says True for the empty chain."""
    rt = triton.knobs.runtime
    chain = type(rt.launch_enter_hook)()
    monkeypatch.setattr(rt, "launch_enter_hook", chain)
    monkeypatch.setattr(rt, "launch_exit_hook", type(rt.launch_exit_hook)())
    assert vk._hooked() is False
    assert rt.launch_enter_hook is not None  # the control's test would call this hooked
    chain.add(lambda metadata: None)
    assert vk._hooked() is True


def test_getter_always_returns_a_tuple():
    ts = [torch.zeros(1), torch.ones(2), torch.zeros(3)]
    assert vk._getter(())(ts) == ()
    (one,) = vk._getter((1,))(ts)
    assert one is ts[1]
    assert [t.numel() for t in vk._getter((2, 0))(ts)] == [3, 1]


@pytest.mark.gpu
def test_gpu_bound_launch_is_taken_and_counts_exactly():
    """After its first call a CUDA validator launches through the bound kernel (no JITFunction), and every bound
    call counts and masks like the first."""
    mon = Monitor(registry=SiteRegistry(capacity=16), capacity=16)
    v = Validator("launch", "cuda", policy="mask", monitor=mon)
    v.index("slots", hi=100, padding=-1, safe=0)
    slots = torch.tensor([1, 200, -1, 3, -5], device="cuda")
    for _ in range(3):
        v(slots=slots.clone())
    plan = v._plan
    assert plan is not None and len(plan.launch._bound) == 1
    fixed = slots.clone()
    v(slots=fixed)
    torch.cuda.synchronize()
    assert fixed.tolist() == [1, 0, -1, 3, 0]
    row = mon.counter(v.sites()["slots"], "cuda")
    assert int(row[0]) == 4 * 2
