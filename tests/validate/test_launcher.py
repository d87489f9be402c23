"""The Triton backend's launch (tripwire.validate's bound launch): one launch per call, the launch path a validator
takes (``Validator.launch_path``) and the compiled kernels it binds (``Validator.kernels``), the register budget
asked once per compiled kernel, and, on a GPU, that the bound path counts exactly what the JIT path does and is not
bound to the sizes or the alignment of its first call.

Launches are counted where Triton sees them (conftest's ``triton_launches``: a launch hook on a GPU, the interpreter's
own run under it); the register budget's asks through ``tripwire.triton.budget_choice``, which the kernel's launch
calls through that public module.
"""

from __future__ import annotations

import pytest
import torch
import triton

import tripwire.triton as tw_triton
from conftest import one_call_then_three, triton_launches
from tripwire import Monitor, SiteRegistry
from tripwire.validate import Validator


def _monitor() -> Monitor:
    return Monitor(registry=SiteRegistry(capacity=16), capacity=16)


def _counts(mon: Monitor) -> dict[str, int]:
    return {site: hit.count for (_dev, site), hit in mon.snapshot().items()}


def test_one_launch_per_call(kernel_device):
    """Every rule of a call in one Triton launch (compiled on a GPU; on the CPU the Triton backend, under the
    interpreter), and that launch is the validator's kernel. Control: the same rules as three validators are three
    launches (what the one-launch design avoids)."""
    with triton_launches() as seen:
        one_call_then_three(kernel_device, seen, backend="triton")
    assert {name for name, _ in seen} == {"_validate"}


def test_torch_backend_launches_nothing():
    """A torch-backend validator's call is torch ops only: no Triton launch, and its launch path says so (the
    control is the test above: the same counter sees the Triton backend's launches)."""
    mon = _monitor()
    v = Validator("host", "cpu", monitor=mon)
    v.index("slots", hi=10, padding=-1)
    with triton_launches() as seen:
        v(slots=torch.tensor([1, 30, -1]))
    assert seen == []
    assert v.launch_path == "torch" and v.kernels == ()
    assert _counts(mon) == {"host.slots": 1}


def test_launch_path_before_and_after_a_call(kernel_device):
    """Before its first call a Triton validator launches through the JITFunction; under the interpreter it stays
    there (nothing compiled to bind), on a GPU the first call binds its kernel."""
    v = Validator("path", kernel_device, backend="triton", monitor=_monitor())
    v.index("slots", hi=10, padding=-1)
    assert v.launch_path == "jit" and v.kernels == ()
    v(slots=torch.tensor([1, 2], device=kernel_device))
    if kernel_device == "cpu":
        assert v.launch_path == "jit" and v.kernels == ()
    else:
        assert v.launch_path == "triton" and len(v.kernels) == 1


@pytest.mark.parametrize("fault_calls", [True, False])
def test_the_forced_build_is_the_one_launched(kernel_device, fault_calls):
    """``fault_calls`` picks the build every launch of the validator runs: each launch carries it as the kernel's
    ``CALLS`` (under the interpreter, where the launch's keyword arguments are seen; on a GPU the compiled builds'
    code differs: test_gpu_the_two_builds_compile_to_different_code). Control: the other validator, forced the other
    way, launches the other build."""
    if kernel_device != "cpu":
        pytest.skip("a launch hook sees no launch arguments; the GPU test below compares the builds' code")
    builds = {}
    for forced in (fault_calls, not fault_calls):
        v = Validator("build", "cpu", backend="triton", fault_calls=forced, monitor=_monitor())
        v.index("slots", hi=10, padding=-1)
        with triton_launches() as seen:
            for _ in range(2):
                v(slots=torch.tensor([1, 30, -1]))
        builds[forced] = [kw["CALLS"] for _, kw in seen]
    assert builds[fault_calls] == [fault_calls] * 2
    assert builds[not fault_calls] == [not fault_calls] * 2


def test_rule_groups_of_none_one_and_several_tensors(kernel_device):
    """The kernel takes each group of a call's tensors (the rules', the lengths and indptrs, the requests, the
    segments) as a tuple, of any size: none (a rule without requests), one (a single rule), several. Each layout
    counts and attributes exactly."""
    mon = _monitor()
    one = Validator("one", kernel_device, backend="triton", policy="flag", monitor=mon)
    one.index("slots", hi=10, padding=-1)
    one(slots=torch.tensor([1, 30, -1, -4], device=kernel_device))
    many = Validator("many", kernel_device, backend="triton", policy="flag", monitor=mon)
    many.index("a", hi=10, requests="req")
    many.index("b", hi=10, lengths="n")
    many.csr("c", indptr="p", hi=10, requests="seq")
    t = torch.tensor([1, 12, 3], device=kernel_device)
    many(
        a=t,
        req=torch.tensor([7, 8, 9], device=kernel_device),
        b=t.reshape(1, 3).clone(),
        n=torch.tensor([5], device=kernel_device),  # past the width: counted at many.n
        c=t.clone(),
        p=torch.tensor([0, 1, 3], device=kernel_device),
        seq=torch.tensor([40, 41], device=kernel_device),
    )
    assert _counts(mon) == {"one.slots": 2, "many.a": 1, "many.b": 1, "many.n": 1, "many.c": 1}
    snap = {site: hit for (_dev, site), hit in mon.snapshot().items()}
    assert [tuple(o) for o in snap["many.a"].offenders] == [(1, 12, 8)]
    assert [tuple(o) for o in snap["many.c"].offenders] == [(1, 12, 41)]


def _declared(name: str, mon: Monitor, device: str = "cuda") -> Validator:
    """Every rule kind and auxiliary tensor: a padded 1-D index, a table with lengths and requests, a CSR layout."""
    v = Validator(name, device, policy="mask", monitor=mon, backend="triton")
    v.index("slots", hi=100, padding=-1, safe=0)
    v.index("table", hi=50, safe=0, lengths="lens", requests="req")
    v.csr("kv", indptr="ptr", hi=64, safe=0)
    return v


def _inputs(device: str = "cuda", slots: int = 300, rows: int = 24) -> dict[str, torch.Tensor]:
    """A call of ``_declared``'s validator: ``slots`` slots, a ``rows`` x 9 table; bad entries in every rule."""
    g = torch.Generator().manual_seed(5)
    sm = torch.randint(-1, 100, (slots,), generator=g)
    sm[[4, 150, slots - 1]] = torch.tensor([100, -9, 1000])
    table = torch.randint(0, 50, (rows, 9), generator=g, dtype=torch.int32)
    table[[1, 7, 20], [0, 8, 3]] = torch.tensor([50, -1, 77], dtype=torch.int32)
    lens = torch.randint(0, 10, (rows,), generator=g, dtype=torch.int32)
    lens[[2, 9]] = torch.tensor([10, -3], dtype=torch.int32)  # lengths outside [0, 9]
    kv = torch.randint(0, 64, (500,), generator=g, dtype=torch.int32)
    kv[[0, 17, 333]] = torch.tensor([64, -2, 99], dtype=torch.int32)
    ptr = torch.tensor([0, 100, 100, 250, 400, 480], dtype=torch.int32)
    req = torch.arange(1000, 1000 + rows, dtype=torch.int64)
    md = {"slots": sm, "table": table, "lens": lens, "kv": kv, "ptr": ptr, "req": req}
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


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a contiguous view whose address is one element past an allocation's start (not a multiple of
    16 bytes for int32 and int64)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


def _budget_asks(monkeypatch) -> list:  # type: ignore[no-untyped-def]
    """The distinct keys the register budget is asked under (``tripwire.triton.budget_choice`` wrapped: each answer
    is the first build, uncapped, as the interpreter's)."""
    asked: list = []

    def record(key, fn, grid, args, kw, twin, options):  # type: ignore[no-untyped-def]
        if key not in asked:
            asked.append(key)
        return dict(options[0])

    monkeypatch.setattr(tw_triton, "budget_choice", record)
    return asked


def test_each_specialisation_gets_its_own_register_budget(monkeypatch, kernel_device):
    """The register budget (its cap and its build) is found per compiled kernel: calls that Triton compiles
    differently ask anew, calls it compiles the same way share the first one's answer. Full sizes; one-entry sizes
    (a size of 1 is a constant); misaligned views with sizes off 16; the table's width a multiple of 16; int32 slots
    where they were int64: five kernels, five asks. A call whose sizes differ from the first but fall in the same
    classes (none 1, none a multiple of 16, every tensor aligned) asks nothing. The control: every call has the
    tensors' dtypes of the first but the int32 one, so a budget keyed on the dtypes alone would ask twice, and the
    other kernels would launch under the first one's allocation."""
    asked = _budget_asks(monkeypatch)
    v = _declared("caps", _monitor(), kernel_device)
    md = _inputs(kernel_device)
    wide = {**md, "table": torch.zeros(24, 16, dtype=torch.int32, device=kernel_device)}
    calls = [
        md,
        _one_entry(md),
        {k: _misaligned(t[:-1] if k in ("slots", "kv") else t) for k, t in md.items()},
        wide,
        {**md, "slots": md["slots"].int()},
    ]
    for call in calls:
        v(**{k: t.clone() if t.data_ptr() % 16 == 0 else _misaligned(t) for k, t in call.items()})
    assert len(asked) == 5
    v(**_inputs(kernel_device, slots=301, rows=25))  # 301 slots, 25 rows: the classes of 300 and 24
    assert len(asked) == 5
    dtypes = {tuple(t.dtype for t in call.values()) for call in calls}
    assert len(dtypes) == 2


@pytest.mark.gpu
def test_gpu_bound_launch_is_taken_and_counts_exactly():
    """After its first call a CUDA validator launches through the bound kernel (no JITFunction), and every bound
    call counts and masks like the first."""
    mon = _monitor()
    v = Validator("launch", "cuda", policy="mask", monitor=mon)
    v.index("slots", hi=100, padding=-1, safe=0)
    slots = torch.tensor([1, 200, -1, 3, -5], device="cuda")
    for _ in range(3):
        v(slots=slots.clone())
    assert v.launch_path == "triton" and len(v.kernels) == 1
    fixed = slots.clone()
    v(slots=fixed)
    torch.cuda.synchronize()
    assert fixed.tolist() == [1, 0, -1, 3, 0]
    row = mon.counter(v.sites()["slots"], "cuda")
    assert int(row[0]) == 4 * 2


@pytest.mark.gpu
def test_gpu_a_launch_hook_sees_every_call_and_an_empty_chain_does_not(monkeypatch):
    """Triton's launch hooks are HookChains, never None: an empty chain is no hook (the validator binds its kernel
    and calls it directly), a chain with a hook is one (every launch through the JITFunction, which hands the hook
    its metadata: one per call, bound validators included). The control: the empty chain is not None, so a
    validator that took `hook is not None` for hooked would never bind (its launch path "jit")."""
    rt = triton.knobs.runtime
    monkeypatch.setattr(rt, "launch_enter_hook", type(rt.launch_enter_hook)())
    monkeypatch.setattr(rt, "launch_exit_hook", type(rt.launch_exit_hook)())
    mon = _monitor()
    bound = Validator("bound", "cuda", monitor=mon)
    bound.index("slots", hi=10, padding=-1, safe=0)
    for _ in range(2):
        bound(slots=torch.tensor([1, 30, -1], device="cuda"))
    assert bound.launch_path == "triton" and len(bound.kernels) == 1
    assert rt.launch_enter_hook is not None  # the control's test would call this hooked
    seen: list = []
    rt.launch_enter_hook.add(seen.append)
    assert bound.launch_path == "jit"  # hooked: the next call goes through the JITFunction
    fresh = Validator("fresh", "cuda", monitor=mon)
    fresh.index("slots", hi=10, padding=-1, safe=0)
    for _ in range(3):
        fresh(slots=torch.tensor([1, 30, -1], device="cuda"))
    bound(slots=torch.tensor([1, 30, -1], device="cuda"))
    torch.cuda.synchronize()
    assert [md.data["name"] for md in seen] == ["_validate"] * 4
    assert fresh.launch_path == "jit" and fresh.kernels == ()  # nothing bound while hooked
    rt.launch_enter_hook.remove(seen.append)
    fresh(slots=torch.tensor([1, 30, -1], device="cuda"))
    torch.cuda.synchronize()
    assert len(seen) == 4 and fresh.launch_path == "triton" and len(fresh.kernels) == 1
    assert _counts(mon) == {"bound.slots": 3, "fresh.slots": 4}


@pytest.mark.gpu
def test_gpu_the_two_builds_compile_to_different_code():
    """``fault_calls=True`` calls the record's atomics out of line, ``False`` inlines them: the kernels the two
    validators bind are different code, the calling build's with more functions of its own in its PTX (the
    record's). Both count the same."""
    mon = _monitor()
    funcs = {}
    for calls in (True, False):
        v = Validator(f"build{int(calls)}", "cuda", monitor=mon, fault_calls=calls)
        v.index("slots", hi=10, padding=-1, safe=0)
        v(slots=torch.tensor([1, 30, -1], device="cuda"))
        (k,) = v.kernels
        funcs[calls] = k.asm["ptx"].count(".func ")
    torch.cuda.synchronize()
    assert funcs[True] > funcs[False], funcs
    assert _counts(mon) == {"build1.slots": 1, "build0.slots": 1}


@pytest.mark.gpu
def test_gpu_a_first_call_with_one_entry_does_not_bind_later_calls_to_one():
    """A first call whose slot mapping has one entry (a one-token step) and whose table is one column wide: Triton
    compiles those sizes as the constant 1. The next calls, 300 slots and 9 columns, count every bad entry, as a
    validator that never saw the one-entry call counts: they bound a kernel of their own. What a binding keyed on
    the dtypes alone would have run for them instead: the one-entry kernel, whose sizes are constants (Triton's own
    record of what it compiled, ``src.constants``, holds more of them than the full kernel's)."""
    mon = _monitor()
    v = _declared("one", mon)
    md = _inputs()
    first = _one_entry(md)
    v(**first)  # compiles and binds the one-entry kernel
    torch.cuda.synchronize()
    mon.reset()
    for _ in range(2):
        v(**{k: t.clone() for k, t in md.items()})
    # The reference: a validator whose calls all have the full sizes.
    m_ref = _monitor()
    ref = _declared("one", m_ref)
    for _ in range(2):
        ref(**{k: t.clone() for k, t in md.items()})
    torch.cuda.synchronize()
    want = _counts(m_ref)
    assert want["one.slots"] == 2 * 3
    assert _counts(mon) == want
    assert v.launch_path == "triton"
    k_one, k_full = v.kernels  # the one-entry kernel and the full one
    assert len(k_one.src.constants) > len(k_full.src.constants)


@pytest.mark.gpu
def test_gpu_misaligned_views_and_sizes_off_16_get_their_own_kernel():
    """A first call at aligned tensors whose sizes are multiples of 16 (what Triton specialises a tuple element on),
    then calls at misaligned views of other sizes: they run their own kernel and count what a validator that never
    saw the first call counts. What a binding keyed on the dtypes alone would have run: the dtypes of the two calls
    are the same, and the two kernels Triton compiled for them are specialised differently (the first one's vector
    loads a misaligned view cannot take)."""
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
    mon = _monitor()
    v = _declared("align", mon)
    v(**first)
    torch.cuda.synchronize()
    mon.reset()
    later = {k: _misaligned(t) for k, t in _inputs().items()}
    for _ in range(2):
        v(**{k: _misaligned(t) for k, t in later.items()})
    m_ref = _monitor()
    ref = _declared("align", m_ref)
    for _ in range(2):
        ref(**{k: _misaligned(t) for k, t in later.items()})
    torch.cuda.synchronize()
    want = _counts(m_ref)
    assert want["align.slots"] == 2 * 3
    assert _counts(mon) == want
    k_first, k_later = v.kernels
    assert k_first.src.attrs != k_later.src.attrs
    assert [t.dtype for t in first.values()] == [t.dtype for t in later.values()]
