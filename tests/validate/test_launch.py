"""The validator's bound launch (tripwire.validate._triton.Launcher): what decides between the compiled kernel's own
launcher and the JITFunction, whether the launcher's C function is called directly, and, on a GPU, that the bound
path is taken and counts exactly what the JIT path does.
"""

from __future__ import annotations

import types

import pytest
import torch
import triton

from tripwire import Monitor, SiteRegistry
from tripwire.triton._callee import _version
from tripwire.validate import Validator
from tripwire.validate import _triton as vk
from tripwire.validate._triton import _C_LAUNCH_RELEASES, _c_launch


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
    # On the releases whose launcher's C function is known (Triton 3.6), the bound call is that function's.
    ((_, c_launch),) = plan.launch._bound.values()
    assert (c_launch is not None) == (_version(triton.__version__) in _C_LAUNCH_RELEASES)
    fixed = slots.clone()
    v(slots=fixed)
    torch.cuda.synchronize()
    assert fixed.tolist() == [1, 0, -1, 3, 0]
    row = mon.counter(v.sites()["slots"], "cuda")
    assert int(row[0]) == 4 * 2


class CudaLauncher:
    """Stands in for a compiled kernel's Triton 3.6 launcher (the attributes _c_launch reads)."""

    def __init__(self, **kw: object) -> None:
        self.launch = lambda *a: a
        self.global_scratch_size = 0
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = True
        self.__dict__.update(kw)


@pytest.mark.parametrize(
    "version,kw,direct",
    [
        ("3.6.0", {}, True),
        ("3.6.1+git", {}, True),
        ("3.9.0", {}, False),  # another launcher signature
        ("3.7.1", {}, False),
        ("3.6.0", {"global_scratch_size": 8}, False),  # scratch the wrapper would allocate
        ("3.6.0", {"profile_scratch_size": 8}, False),
        ("3.6.0", {"arg_annotations": ()}, False),  # the annotated launcher's shape
    ],
)
def test_the_c_launch_is_used_only_where_it_skips_nothing(monkeypatch, version, kw, direct):
    monkeypatch.setattr(triton, "__version__", version)
    k = types.SimpleNamespace(run=CudaLauncher(**kw))
    got = _c_launch(k)
    assert (got is not None) == direct
    if direct:
        assert got == (k.run.launch, False, True)
