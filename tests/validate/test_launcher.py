"""The validator's bound launch (tripwire.validate._launcher.Launcher): what decides between the compiled kernel's
own launcher and the JITFunction, and, on a GPU, that the bound path is taken, counts exactly what the JIT path does,
and is not bound to the sizes of its first call.
"""

from __future__ import annotations

import pytest
import torch
import triton

from conftest import one_call_then_three
from tripwire import Monitor, SiteRegistry
from tripwire.validate import Validator
from tripwire.validate import _launcher as vk


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
    assert plan.launch.path == "triton"
    fixed = slots.clone()
    v(slots=fixed)
    torch.cuda.synchronize()
    assert fixed.tolist() == [1, 0, -1, 3, 0]
    row = mon.counter(v.sites()["slots"], "cuda")
    assert int(row[0]) == 4 * 2


def _declared(name: str, mon: Monitor, device: str = "cuda") -> Validator:
    """Every rule kind and auxiliary tensor: a padded 1-D index, a table with lengths and requests, a CSR layout."""
    v = Validator(name, device, policy="mask", monitor=mon)
    v.index("slots", hi=100, padding=-1, safe=0)
    v.index("table", hi=50, safe=0, lengths="lens", requests="req")
    v.csr("kv", indptr="ptr", hi=64, safe=0)
    return v


def _inputs(device: str = "cuda") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    slots = torch.randint(-1, 100, (300,), generator=g)
    slots[[4, 150, 299]] = torch.tensor([100, -9, 1000])
    table = torch.randint(0, 50, (24, 9), generator=g, dtype=torch.int32)
    table[[1, 7, 20], [0, 8, 3]] = torch.tensor([50, -1, 77], dtype=torch.int32)
    lens = torch.randint(0, 10, (24,), generator=g, dtype=torch.int32)
    lens[[2, 9]] = torch.tensor([10, -3], dtype=torch.int32)  # lengths outside [0, 9]
    kv = torch.randint(0, 64, (500,), generator=g, dtype=torch.int32)
    kv[[0, 17, 333]] = torch.tensor([64, -2, 99], dtype=torch.int32)
    ptr = torch.tensor([0, 100, 100, 250, 400, 480], dtype=torch.int32)
    req = torch.arange(1000, 1024, dtype=torch.int64)
    md = {"slots": slots, "table": table, "lens": lens, "kv": kv, "ptr": ptr, "req": req}
    return {k: t.to(device) for k, t in md.items()}


def _one_entry(md: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``md`` as a one-token step's call: a one-entry slot mapping and a one-column table (sizes Triton compiles as
    the constant 1), the lengths clamped to that column."""
    return {
        **md,
        "slots": md["slots"][:1].clone(),
        "table": md["table"][:, :1].contiguous(),
        "lens": md["lens"].clamp(0, 1),
    }


def test_one_launch_per_call(monkeypatch, kernel_device):
    """Every rule of a call in one launch of the kernel (compiled on a GPU; on the CPU the Triton backend, under the
    interpreter). Control: the same rules as three validators are three launches (what the one-launch design
    avoids)."""
    from tripwire.validate import _triton

    launches = []
    real = _triton._validate

    class Counting:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(_triton, "_validate", Counting())
    one_call_then_three(kernel_device, launches, backend="triton")


@pytest.mark.parametrize("dtype_key", [False, True])
def test_each_specialisation_gets_its_own_register_budget(monkeypatch, kernel_device, dtype_key):
    """The register budget (_triton._with_cap: its cap and CALLS) is found per compiled kernel: three calls that
    Triton compiles three ways (full sizes; one-entry sizes; misaligned views with sizes off 16) ask three times,
    each under the call's own spec_key. The control (``dtype_key``): the budget keyed on the tensors' dtypes alone
    asks once, and the other two kernels would launch under the first one's allocation."""
    from tripwire.validate import _triton
    from tripwire.validate._launcher import Launcher

    asked: list[tuple] = []

    def record(key, fn, grid, args, kw, twin, options):  # type: ignore[no-untyped-def]
        if key not in asked:
            asked.append(key)
        return dict(options[0])  # no cap: the launch is the compiler's own

    monkeypatch.setattr(_triton, "budget_choice", record)
    if dtype_key:
        with_cap = _triton._with_cap
        monkeypatch.setattr(_triton, "_with_cap", lambda arena, consts, key, total, args, builds: with_cap(
            arena, consts, key[0], total, args, builds))  # fmt: skip
    v = _declared("caps", Monitor(registry=SiteRegistry(capacity=16), capacity=16), kernel_device)
    plan = v._build_plan()
    launch = Launcher(v._arena, plan.rules, mask=True)
    md = _inputs(kernel_device)
    one = _one_entry(md)
    off = {k: _misaligned(t[:-1] if k in ("slots", "kv") else t) for k, t in md.items()}
    calls = [md, one, off]
    for call in calls:
        launch([call[n] for n in plan.names])
    main = [plan.names[i] for i in plan.rules.tensor]
    keys = [_triton.spec_key([c[n] for n in plan.names], [c[n].numel() for n in plan.names],
                             [c[n].shape[1] if c[n].dim() == 2 else 1 for n in main]) for c in calls]  # fmt: skip
    assert len(set(keys)) == 3
    if dtype_key:
        assert len(asked) == 1
    else:
        assert [k[3] for k in asked] == keys


@pytest.mark.gpu
@pytest.mark.parametrize("old_key", [False, True])
def test_gpu_a_first_call_with_one_entry_does_not_bind_later_calls_to_one(monkeypatch, old_key):
    """A first call whose slot mapping has one entry (a one-token step) and whose table is one column wide: Triton
    specialises those sizes (1) into the kernel it compiles. The next call, 300 slots and 9 columns, counts every
    bad entry: the bound kernel's key has which sizes are 1. The control (``old_key``): keyed on the dtypes alone, the
    later call runs the one-entry kernel and counts short."""
    from tripwire.validate._launcher import Launcher

    if old_key:
        monkeypatch.setattr(
            Launcher, "_key", staticmethod(lambda tensors, numels, widths: (tuple(t.dtype for t in tensors),))
        )
    mon = Monitor(registry=SiteRegistry(capacity=16), capacity=16)
    v = _declared("one", mon)
    md = _inputs()
    first = _one_entry(md)
    v(**first)  # compiles and binds the one-entry kernel
    torch.cuda.synchronize()
    mon.reset()
    for _ in range(2):
        v(**{k: t.clone() for k, t in md.items()})
    # The reference: a validator whose calls all have the full sizes.
    m_ref = Monitor(registry=SiteRegistry(capacity=16), capacity=16)
    ref = _declared("one", m_ref)
    for _ in range(2):
        ref(**{k: t.clone() for k, t in md.items()})
    torch.cuda.synchronize()
    counts = {key: hit.count for key, hit in mon.snapshot().items()}
    want = {key: hit.count for key, hit in m_ref.snapshot().items()}
    assert want[("cuda:0", "one.slots")] == 2 * 3
    if old_key:
        # The bad slots past the first are missed (a row with no count is absent from the snapshot).
        assert counts.get(("cuda:0", "one.slots"), 0) < want[("cuda:0", "one.slots")]
    else:
        assert counts == want
        assert v._plan.launch.path == "triton"
        assert len(v._plan.launch._bound) == 2  # the one-entry kernel and the full one


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a contiguous view whose address is one element past an allocation's start (not a multiple of
    16 bytes for int32 and int64)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


@pytest.mark.gpu
def test_gpu_misaligned_views_and_sizes_off_16_get_their_own_kernel():
    """A first call at aligned tensors whose sizes are multiples of 16 (what Triton specialises a tuple element on),
    then calls at misaligned views of other sizes: they run their own kernel and count what a validator that never
    saw the first call counts. The control: the dtypes alone (a key without the specialisation) are the same for both
    calls, and the two kernels the JITFunction compiled for them are specialised differently: keyed on the dtypes,
    the later calls would have run the first kernel (vector loads a misaligned view cannot take)."""
    from tripwire.validate._launcher import Launcher

    g = torch.Generator().manual_seed(7)
    first = {
        "slots": torch.randint(-1, 100, (32,), generator=g),
        "table": torch.randint(0, 50, (16, 16), generator=g, dtype=torch.int32),
        "lens": torch.randint(0, 17, (16,), generator=g, dtype=torch.int32),
        "kv": torch.randint(0, 64, (64,), generator=g, dtype=torch.int32),
        "ptr": torch.arange(0, 64, 4, dtype=torch.int32),
        "req": torch.arange(16, dtype=torch.int64),
    }
    first = {k: t.cuda() for k, t in first.items()}
    assert all(t.data_ptr() % 16 == 0 and t.numel() % 16 == 0 for t in first.values())
    mon = Monitor(registry=SiteRegistry(capacity=16), capacity=16)
    v = _declared("align", mon)
    v(**first)
    torch.cuda.synchronize()
    mon.reset()
    later = {k: _misaligned(t) for k, t in _inputs().items()}
    for _ in range(2):
        v(**{k: _misaligned(t) for k, t in later.items()})
    m_ref = Monitor(registry=SiteRegistry(capacity=16), capacity=16)
    ref = _declared("align", m_ref)
    for _ in range(2):
        ref(**{k: _misaligned(t) for k, t in later.items()})
    torch.cuda.synchronize()
    counts = {key: hit.count for key, hit in mon.snapshot().items()}
    want = {key: hit.count for key, hit in m_ref.snapshot().items()}
    assert want[("cuda:0", "align.slots")] == 2 * 3
    assert counts == want
    launch = v._plan.launch
    assert len(launch._bound) == 2
    (k_first, _), (k_later, _) = launch._bound.values()
    assert k_first.src.attrs != k_later.src.attrs
    names = v._plan.names

    def old_key(md: dict[str, torch.Tensor]) -> tuple:
        return Launcher._key([md[n] for n in names], [md[n].numel() for n in names], [])[0]

    assert old_key(first) == old_key(later)


def test_key_holds_what_triton_specialises_a_tuple_element_on():
    """Per size: 1, a multiple of 16, past int32 (a 64-bit parameter), or none; per tensor: a 16-byte aligned
    address or not; and the dtypes. Sizes that differ in none of these share a key (one compiled kernel)."""
    from tripwire.validate._launcher import Launcher

    buf = torch.zeros(8, dtype=torch.int64)
    aligned, off = buf[:4], buf[1:5]
    assert aligned.data_ptr() % 16 == 0 and off.data_ptr() % 16 == 8
    key = Launcher._key
    assert key([aligned], [3], [5]) == key([aligned], [7], [9])
    assert key([aligned], [3], [5]) != key([off], [3], [5])
    # The sizes' classes: the numels', then the widths'.
    assert key([aligned], [1], [5])[1] == (1, 0) and key([aligned], [32], [5])[1] == (2, 0)
    assert key([aligned], [2**31 + 3], [5])[1] == (4, 0) and key([aligned], [2**31], [5])[1] == (6, 0)
    assert key([aligned], [3], [1])[1] == (0, 1) and key([aligned], [3], [16])[1] == (0, 2)
    assert key([aligned], [3], [5])[0] != key([aligned.int()], [3], [5])[0]
