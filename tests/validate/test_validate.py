"""tripwire.validate: the metadata validator against a Python reference, exact counts, masking, bad input.

The reference (:func:`reference`) re-states the documented semantics entry by entry, in plain Python: an index entry
is bad when it is not the padding and not in [lo, hi); a 2-D table checks only ``lengths[row]`` entries (clamped into
[0, width]), a length outside [0, width] is itself bad; a CSR layout checks the indices up to the largest in-range
indptr entry, and an indptr entry is bad when it is not 0 at position 0, or out of [0, len(indices)], or below the last
good entry before it (mask replaces it with that entry).

Backends: CUDA tensors run the Triton kernel; CPU tensors run the plain torch path (``tripwire.validate._torch``).
Without a GPU every test here runs twice (the ``backend`` fixture): on the torch path, and on the Triton kernel under
the interpreter (``Validator(..., backend="triton")``); ``tests/validate/test_torch.py`` compares the two on the same
calls, every arena and offender word and every repaired entry.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import HAS_CUDA
from tripwire import Monitor, SiteRegistry
from tripwire.validate import Validator


@pytest.fixture(autouse=True, params=["cuda"] if HAS_CUDA else ["torch", "interpreter"])
def backend(request, monkeypatch):
    """``torch``: CPU validators run the plain torch path; ``interpreter``: they run the Triton kernel under the
    interpreter instead (the same arena, the same tensors); ``cuda``: the kernel, compiled. Every validator this
    module builds is built through its module-level name ``Validator``, which the interpreter's case binds to the
    Triton backend for the test."""
    if request.param == "interpreter":
        monkeypatch.setitem(globals(), "Validator", functools.partial(Validator, backend="triton"))
    return request.param


# ---------------------------------------------------------------------------------------------- the reference


def ref_index(values, lo, hi, pad, safe, width=None, lengths=None):
    """(repaired flat values, bad [(row, value)], repaired lengths, bad lengths [(row, value)])."""
    out = list(values)
    bad = []
    new_len = None if lengths is None else list(lengths)
    bad_len = []
    if lengths is not None:
        for r, ln in enumerate(lengths):
            if ln < 0 or ln > width:
                bad_len.append((r, ln))
                new_len[r] = min(max(ln, 0), width)
    for e, v in enumerate(values):
        row = e if width is None else e // width
        if lengths is not None and e % width >= min(max(lengths[row], 0), width):
            continue
        if v != pad and not lo <= v < hi:
            bad.append((row, v))
            out[e] = safe
    return out, bad, new_len, bad_len


def ref_csr(indices, indptr, lo, hi, pad, safe):
    """(repaired indices, bad [(pos, value)], repaired indptr, bad indptr [(pos, value)])."""
    ni = len(indices)
    new_ptr = list(indptr)
    bad_ptr = []
    last_good = 0
    for k, v in enumerate(indptr):
        if k == 0:
            if v != 0:
                bad_ptr.append((0, v))
                new_ptr[0] = 0
            continue
        if v < 0 or v > ni or v < last_good:
            bad_ptr.append((k, v))
            new_ptr[k] = last_good
        else:
            last_good = v
    used = max([v for v in indptr[1:] if 0 <= v <= ni], default=0)
    out = list(indices)
    bad = []
    for e in range(used):
        v = indices[e]
        if v != pad and not lo <= v < hi:
            bad.append((e, v))
            out[e] = safe
    return out, bad, new_ptr, bad_ptr


def expect_hit(snap, device, site, bad):
    """The row of ``site`` matches the bad list exactly: count, extremes, and a first offender that is the lowest
    row (then lowest value) when one program covered the rule, which is the case for every small tensor here."""
    hit = snap.get((device, site))
    if not bad:
        assert hit is None, f"{site}: expected no hit, got {hit}"
        return
    assert hit is not None, f"{site}: expected {len(bad)} hits, got none"
    assert hit.count == len(bad)
    assert hit.max_row == max(r for r, _ in bad)
    assert hit.max_value == max(v for _, v in bad)
    assert hit.min_value == min(v for _, v in bad)
    assert (hit.first_row, hit.first_value) == min(bad)


@pytest.fixture
def mon():
    m = Monitor(registry=SiteRegistry(capacity=64), capacity=64, interval=0.01)
    yield m
    m.stop()


def _t(values, dtype, device, shape=None):
    t = torch.tensor(values, dtype=dtype, device=device)
    return t if shape is None else t.reshape(shape)


# ---------------------------------------------------------------------------------------------- equivalence
metadata = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from([torch.int32, torch.int64]),
        "policy": st.sampled_from(["mask", "flag"]),
        "hi": st.integers(1, 40),
        "slots": st.lists(st.integers(-6, 50), max_size=40),
        "rows": st.integers(0, 5),
        "width": st.integers(0, 9),
        "table": st.lists(st.integers(-3, 50), min_size=45, max_size=45),
        "lengths": st.lists(st.integers(-2, 11), min_size=5, max_size=5),
        "indptr": st.lists(st.integers(-3, 25), min_size=1, max_size=7),
        "indices": st.lists(st.integers(-3, 50), max_size=25),
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(md=metadata)
def test_matches_reference(md, mon, kernel_device):
    _matches_reference(md, mon, kernel_device)


@pytest.mark.parametrize("calls", [True, False])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(md=metadata)
def test_each_fault_build_matches_reference(md, mon, kernel_device, backend, calls):
    """Both builds the register budget chooses between (the out-of-line fault functions calling the record's
    atomics, or inlining them) record and repair exactly as the reference, each forced in turn
    (``Validator(fault_calls=...)``: every launch of the validator is that build; tests/validate/test_launcher.py shows
    that the forced build is the one launched, and on a GPU that the two compile to different code)."""
    if backend == "torch":
        pytest.skip("the Triton kernel's two builds: the interpreter and cuda backends run them")
    _matches_reference(md, mon, kernel_device, fault_calls=calls)


def _matches_reference(md, mon, kernel_device, fault_calls=None):
    dt, hi = md["dtype"], md["hi"]
    v = Validator("ref", kernel_device, policy=md["policy"], monitor=mon, fault_calls=fault_calls)
    v.index("slots", hi=hi, padding=-1, fatal=True)
    v.index("table", hi=hi, safe=0, lengths="lengths")
    v.csr("kv", indptr="kv_ptr", hi=hi, safe=hi - 1)
    R, W = md["rows"], md["width"]
    table_vals = md["table"][: R * W]
    lens = md["lengths"][:R]
    indptr = sorted(md["indptr"]) if md["indptr"][0] % 3 else md["indptr"]  # mostly sane, sometimes broken
    tensors = {
        "slots": _t(md["slots"], dt, kernel_device),
        "table": _t(table_vals, dt, kernel_device, (R, W)),
        "lengths": _t(lens, dt, kernel_device),
        "kv": _t(md["indices"], dt, kernel_device),
        "kv_ptr": _t(indptr, dt, kernel_device),
    }
    before = {k: t.clone() for k, t in tensors.items()}
    mon.reset()
    v(**tensors)
    snap = mon.snapshot()
    dev = str(v.device)

    s_out, s_bad, _, _ = ref_index(md["slots"], 0, hi, -1, -1)
    t_out, t_bad, l_out, l_bad = ref_index(table_vals, 0, hi, None, 0, width=W, lengths=lens)
    k_out, k_bad, p_out, p_bad = ref_csr(md["indices"], indptr, 0, hi, None, hi - 1)
    expect_hit(snap, dev, "ref.slots", s_bad)
    expect_hit(snap, dev, "ref.table", t_bad)
    expect_hit(snap, dev, "ref.lengths", l_bad)
    expect_hit(snap, dev, "ref.kv", k_bad)
    expect_hit(snap, dev, "ref.kv_ptr", p_bad)
    if md["policy"] == "flag":
        for k, t in tensors.items():
            assert torch.equal(t, before[k]), f"flag must leave {k} untouched"
    else:
        assert tensors["slots"].tolist() == s_out
        assert tensors["table"].reshape(-1).tolist() == t_out
        assert tensors["lengths"].tolist() == l_out
        assert tensors["kv"].tolist() == k_out
        assert tensors["kv_ptr"].tolist() == p_out
        # Control: the repaired metadata is clean, so a second call counts nothing new.
        mon.reset()
        v(**tensors)
        assert mon.snapshot() == {}


def test_every_entry_counts_once_across_programs(mon, kernel_device):
    # 5000 slots (5 programs), a 3 x 1500 table with lengths (5 programs), 3000 CSR indices behind a 1500-entry indptr
    # (the indptr check loops over two chunks): every bad entry counts exactly once.
    g = torch.Generator().manual_seed(7)
    v = Validator("big", kernel_device, monitor=mon)
    v.index("slots", hi=1000, padding=-1)
    v.index("table", hi=100, safe=0, lengths="n")
    v.csr("kv", indptr="ptr", hi=64, safe=0)
    slots = torch.randint(0, 1000, (5000,), generator=g)
    bad_pos = torch.randperm(5000, generator=g)[:137]
    slots[bad_pos] = 1000 + bad_pos
    table = torch.randint(0, 100, (3, 1500), generator=g, dtype=torch.int32)
    n = torch.tensor([1500, 700, 1300], dtype=torch.int32)
    table[0, 1499] = 100  # the last checked entry of row 0
    table[1, 699] = -5  # the last checked entry of row 1
    table[1, 700] = 10**6  # past row 1's length: not checked
    kv = torch.randint(0, 64, (3000,), generator=g)
    kv[2999] = 64  # the last used entry
    ptr = torch.arange(0, 3001, 2)  # 1501 entries: 1500 rows of 2
    tensors = {"slots": slots, "table": table, "n": n, "kv": kv, "ptr": ptr}
    tensors = {k: t.to(kernel_device) for k, t in tensors.items()}
    v(**tensors)
    snap = mon.snapshot()
    assert snap[(str(v.device), "big.slots")].count == 137
    assert snap[(str(v.device), "big.table")].count == 2
    assert snap[(str(v.device), "big.kv")].count == 1
    assert (str(v.device), "big.ptr") not in snap and (str(v.device), "big.n") not in snap
    assert int((tensors["slots"] >= 1000).sum()) == 0
    assert int(tensors["table"][1, 700]) == 10**6  # unchecked entries are left alone


def test_shared_lengths_count_once(mon, kernel_device):
    v = Validator("shared", kernel_device, monitor=mon)
    v.index("a", hi=10, safe=0, lengths="n")
    v.index("b", hi=10, safe=0, lengths="n")
    a = torch.zeros((2, 3), dtype=torch.int64, device=kernel_device)
    b = torch.zeros((2, 3), dtype=torch.int64, device=kernel_device)
    n = torch.tensor([4, -1], device=kernel_device)
    v(a=a, b=b, n=n)
    assert mon.snapshot()[(str(v.device), "shared.n")].count == 2
    assert n.tolist() == [3, 0]


def test_empty_tensors(mon, kernel_device):
    v = Validator("empty", kernel_device, monitor=mon)
    v.index("a", hi=10, padding=-1)
    v.index("b", hi=10, safe=0, lengths="n")
    v.csr("c", indptr="p", hi=10, safe=0)
    e = torch.zeros(0, dtype=torch.int64, device=kernel_device)
    v(
        a=e,
        b=torch.zeros((0, 4), dtype=torch.int32, device=kernel_device),
        n=e,
        c=e,
        p=torch.tensor([0], device=kernel_device),
    )
    assert mon.snapshot() == {}
    p = torch.tensor([3, 0], device=kernel_device)  # entry 0 not 0 and entry 1 ... fine; indices empty
    v(a=e, b=torch.zeros((0, 4), dtype=torch.int32, device=kernel_device), n=e, c=e, p=p)
    assert mon.snapshot()[(str(v.device), "empty.p")].count == 1
    assert p.tolist() == [0, 0]


def test_sites_and_attributes(mon, kernel_device):
    v = Validator("eng", kernel_device, monitor=mon)
    s = v.index("slot_mapping", hi=8, padding=-1, fatal=True)
    v.index("w0", hi=8, safe=0, site="eng.shared")
    v.index("w1", hi=16, safe=0, site="eng.shared")
    assert s.name == "eng.slot_mapping" and s.fatal
    assert v.sites()["w0"] is v.sites()["w1"]
    t = torch.tensor([9], device=kernel_device)
    u = torch.tensor([12, 17], device=kernel_device)
    v(slot_mapping=torch.tensor([-1], device=kernel_device), w0=t, w1=u)
    assert mon.snapshot()[(str(v.device), "eng.shared")].count == 2  # 9 >= 8 in w0, 17 >= 16 in w1


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("policy", "decl", "error", "words"),
    [
        ("mask", {"hi": 10}, ValueError, "needs a value to rewrite"),
        ("mask", {"hi": 10, "safe": 10}, ValueError, "outside [0, 10)"),
        ("mask", {"hi": 10, "lo": 10, "safe": 0}, ValueError, "must be > lo"),
        ("mask", {"hi": 10.0, "safe": 0}, TypeError, "hi must be an int"),
        ("mask", {"hi": True, "safe": 0}, TypeError, "hi must be an int"),
        ("mask", {"hi": 1 << 70, "safe": 0}, ValueError, "does not fit in int64"),
        ("mask", {"hi": 10, "safe": 0, "lengths": "not an id"}, ValueError, "must name a tensor"),
        ("mask", {"hi": 10, "safe": 0, "lengths": "a"}, ValueError, "already the name of a rule"),
    ],
)
def test_bad_declarations(mon, kernel_device, policy, decl, error, words):
    v = Validator("bad", kernel_device, policy=policy, monitor=mon)
    v.index("a", hi=10, safe=0)
    with pytest.raises(error, match=re.escape(words)):
        v.index("b" if decl.get("lengths") != "a" else "c", **decl)


def test_bad_validators_and_names(mon, kernel_device):
    with pytest.raises(ValueError, match="policy='drop'"):
        Validator("x", kernel_device, policy="drop", monitor=mon)
    with pytest.raises(ValueError, match="non-empty"):
        Validator(" ", kernel_device, monitor=mon)
    with pytest.raises(ValueError, match="counts on CUDA and CPU"):
        Validator("x", "meta", monitor=mon)
    v = Validator("x", kernel_device, monitor=mon)
    v.index("a", hi=4, safe=0)
    with pytest.raises(ValueError, match="already declared"):
        v.index("a", hi=4, safe=0)
    with pytest.raises(ValueError, match="identifier"):
        v.index("a-b", hi=4, safe=0)
    v.index("t", hi=4, safe=0, lengths="n")
    with pytest.raises(ValueError, match="already declared as a lengths"):
        v.csr("k", indptr="n", hi=4, safe=0)
    # The flag policy needs no safe value.
    Validator("f", kernel_device, policy="flag", monitor=mon).index("a", hi=4)


def test_backend_and_build_choices(mon, kernel_device, triton_interpret):
    """``backend`` and ``fault_calls`` are checked when the validator is built, each refusal naming what is wrong;
    the device's own backend is the default. The Triton backend on the CPU runs under the interpreter only: with
    the interpreter off (a process that compiles for a GPU) it is refused before any call (the control: on, the
    same validator builds)."""
    from tripwire.validate import BACKENDS
    from tripwire.validate import Validator as Built  # the class itself, whatever the fixture binds

    assert BACKENDS == ("triton", "torch")
    assert Built("d", kernel_device, monitor=mon).backend == ("torch" if kernel_device == "cpu" else "triton")
    with pytest.raises(ValueError, match="backend='numpy' is not a validator backend; expected one of triton, torch"):
        Built("x", kernel_device, monitor=mon, backend="numpy")
    if kernel_device == "cpu":
        with pytest.raises(ValueError, match=r"fault_calls=True picks a build of the Triton kernel.*runs 'torch'"):
            Built("x", "cpu", monitor=mon, fault_calls=True)
        assert Built("k", "cpu", monitor=mon, backend="triton", fault_calls=False).fault_calls is False
        triton_interpret(False)
        with pytest.raises(RuntimeError, match="backend='triton' on the CPU runs the kernel under Triton's interp"):
            Built("x", "cpu", monitor=mon, backend="triton")
        triton_interpret(True)
        assert Built("x", "cpu", monitor=mon, backend="triton").backend == "triton"
    else:
        with pytest.raises(ValueError, match="backend='torch' reads its tensors on the host"):
            Built("x", kernel_device, monitor=mon, backend="torch")
    with pytest.raises(ValueError, match="fault_calls=1 picks a build"):
        Built("x", kernel_device, monitor=mon, backend="triton", fault_calls=1)


def test_bad_calls(mon, kernel_device):
    v = Validator("call", kernel_device, monitor=mon)
    v.index("slots", hi=10, padding=-1)
    v.index("table", hi=10, safe=0, lengths="n")
    v.csr("kv", indptr="ptr", hi=10, safe=0)
    ok = {
        "slots": torch.zeros(4, dtype=torch.int64, device=kernel_device),
        "table": torch.zeros((2, 3), dtype=torch.int32, device=kernel_device),
        "n": torch.zeros(2, dtype=torch.int32, device=kernel_device),
        "kv": torch.zeros(3, dtype=torch.int64, device=kernel_device),
        "ptr": torch.tensor([0, 3], device=kernel_device),
    }
    v(**ok)  # control: the good call passes

    def call(**changes):
        args = {**ok, **changes}
        for k in [k for k, t in changes.items() if t is None]:
            del args[k]
        v(**args)

    with pytest.raises(TypeError, match=r"missing \['ptr'\]"):
        call(ptr=None)
    with pytest.raises(TypeError, match=r"unknown \['extra'\]"):
        call(extra=ok["slots"])
    with pytest.raises(TypeError, match="'slots' must be int32 or int64, got float32"):
        call(slots=torch.zeros(4, device=kernel_device))
    with pytest.raises(TypeError, match=r"'slots' must be a torch\.Tensor"):
        call(slots=[0, 1])
    with pytest.raises(ValueError, match="'slots' is on meta"):
        call(slots=torch.zeros(4, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="'table' must be contiguous"):
        call(table=torch.zeros((3, 2), dtype=torch.int32, device=kernel_device).t())
    with pytest.raises(ValueError, match="'table' must be 2-D"):
        call(table=torch.zeros(6, dtype=torch.int32, device=kernel_device))
    with pytest.raises(ValueError, match="'slots' must be 1-D or 2-D"):
        call(slots=torch.zeros((1, 1, 4), dtype=torch.int64, device=kernel_device))
    with pytest.raises(ValueError, match="'kv' must be 1-D"):
        call(kv=torch.zeros((1, 3), dtype=torch.int64, device=kernel_device))
    with pytest.raises(ValueError, match="'n' has 3 entries but 'table' has 2 rows"):
        call(n=torch.zeros(3, dtype=torch.int32, device=kernel_device))
    with pytest.raises(ValueError, match="indptr 'ptr' is empty"):
        call(ptr=torch.zeros(0, dtype=torch.int64, device=kernel_device))
    assert mon.snapshot() == {}  # no refused call launched anything


# ---------------------------------------------------------------------------------------------- torch.compile
def test_compiled_fullgraph_matches_eager(mon, kernel_device):
    v = Validator("comp", kernel_device, monitor=mon)
    v.index("slots", hi=100, padding=-1, fatal=True)
    v.csr("kv", indptr="ptr", hi=30, safe=0)

    def step(slots, kv, ptr, x):
        v(slots=slots, kv=kv, ptr=ptr)
        return x + 1

    backend = "aot_eager" if kernel_device == "cpu" else "inductor"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    slots = torch.tensor([1, -1, 100, 5, -2, 99], device=kernel_device)
    kv = torch.tensor([0, 31, 2, -1, 5, 99, 99], dtype=torch.int32, device=kernel_device)
    ptr = torch.tensor([0, 2, 1, 5], device=kernel_device)
    compiled(slots, kv, ptr, torch.ones(2, device=kernel_device))
    assert slots.tolist() == [1, -1, -1, 5, -1, 99]
    assert kv.tolist() == [0, 0, 2, 0, 5, 99, 99]
    assert ptr.tolist() == [0, 2, 2, 5]
    snap = mon.snapshot()
    assert [snap[(str(v.device), f"comp.{n}")].count for n in ("slots", "kv", "ptr")] == [2, 2, 1]


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_graph_replay_counts_every_replay():
    m = Monitor(registry=SiteRegistry(capacity=64), capacity=64)
    v = Validator("graph", "cuda", policy="flag", monitor=m)
    v.index("slots", hi=1000, padding=-1, fatal=True)
    v.index("table", hi=100, safe=0, lengths="n")
    v.csr("kv", indptr="ptr", hi=64, safe=0)
    slots = torch.arange(256, device="cuda")
    slots[[3, 77]] = torch.tensor([1000, -7], device="cuda")
    table = torch.zeros((256, 128), dtype=torch.int32, device="cuda")
    table[5, 2] = 100
    n = torch.full((256,), 128, dtype=torch.int32, device="cuda")
    kv = torch.zeros(32768, dtype=torch.int32, device="cuda")
    kv[[0, 32767]] = 64
    ptr = torch.arange(0, 32769, 128, device="cuda")
    args = {"slots": slots, "table": table, "n": n, "kv": kv, "ptr": ptr}
    v(**args)  # compile and load before the capture
    torch.cuda.synchronize()
    m.reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        v(**args)
    torch.cuda.synchronize()
    assert m.snapshot() == {}  # capture records, it does not run
    for _ in range(7):
        g.replay()
    torch.cuda.synchronize()
    snap = m.snapshot()
    assert snap[("cuda:0", "graph.slots")].count == 2 * 7
    assert snap[("cuda:0", "graph.table")].count == 7
    assert snap[("cuda:0", "graph.kv")].count == 2 * 7
    # Mask on the GPU: the bad entries are rewritten to the padding value.
    mm = Validator("graphmask", "cuda", monitor=m)
    mm.index("slots", hi=1000, padding=-1, fatal=True)
    mm(slots=slots)
    torch.cuda.synchronize()
    assert slots[3].item() == -1 and slots[77].item() == -1
    assert m.snapshot()[("cuda:0", "graphmask.slots")].count == 2


@pytest.mark.gpu
def test_compiled_reduce_overhead_counts():
    m = Monitor(registry=SiteRegistry(capacity=64), capacity=64)
    v = Validator("ro", "cuda", policy="flag", monitor=m)
    v.index("slots", hi=10, padding=-1)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(slots, x):
        v(slots=slots)
        return x * 2

    slots = torch.tensor([1, 10, 3, -4], device="cuda")
    x = torch.ones(8, device="cuda")
    for _ in range(5):
        step(slots, x)
    torch.cuda.synchronize()
    assert m.snapshot()[("cuda:0", "ro.slots")].count == 2 * 5


# ---------------------------------------------------------------------------------------------- attribution
def ref_segment(pos, offsets):
    """The segment b with offsets[b] <= pos < offsets[b + 1], or None."""
    for b in range(len(offsets) - 1):
        if offsets[b] <= pos < offsets[b + 1]:
            return b
    return None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lens=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    extra=st.integers(0, 3),
    bad=st.lists(st.integers(0, 40), max_size=6, unique=True),
    data=st.data(),
)
def test_requests_by_segments_match_reference(lens, extra, bad, data, mon, kernel_device):
    """Tokens of a batch (segments = cu_seq_lens) carry their request; padding tokens past the last segment carry
    none. Offenders (K = 8 here) are the distinct bad entries in order, each with the reference's request."""
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    total = offsets[-1] + extra  # `extra` padding tokens after the last request
    bad = sorted(b for b in bad if b < total)[:8]
    req_ids = data.draw(st.lists(st.integers(0, 1000), min_size=len(lens), max_size=len(lens)))
    slots = list(range(total))
    for b in bad:
        slots[b] = 500 + b
    v = Validator("seg", kernel_device, policy="flag", monitor=mon)
    v.index("slots", hi=100, padding=-1, requests="req", segments="cu")
    mon.reset()
    v(
        slots=torch.tensor(slots, dtype=torch.int64, device=kernel_device),
        req=torch.tensor(req_ids, dtype=torch.int64, device=kernel_device),
        cu=torch.tensor(offsets, dtype=torch.int32, device=kernel_device),
    )
    hit = mon.snapshot().get((str(v.device), "seg.slots"))
    if not bad:
        assert hit is None
        return
    want = []
    for b in bad:
        seg = ref_segment(b, offsets)
        want.append((b, 500 + b, None if seg is None else req_ids[seg]))
    assert hit.count == len(bad)
    assert sorted(hit.offenders) == sorted(want)


def test_requests_per_row_and_csr(mon, kernel_device):
    dev = kernel_device
    v = Validator("att", dev, monitor=mon)
    v.index("table", hi=50, safe=0, requests="row_req")
    v.csr("kv", indptr="kv_ptr", hi=30, safe=0, requests="seq_req")
    v(
        table=torch.tensor([[1, 2], [60, 3], [4, -9]], dtype=torch.int32, device=dev),
        row_req=torch.tensor([80, 81, -1], device=dev),  # a negative id: not known
        kv=torch.tensor([0, 1, 2, 40, 4, 5], dtype=torch.int32, device=dev),
        kv_ptr=torch.tensor([0, 2, 4, 6], device=dev),
        seq_req=torch.tensor([90, 91, 92], dtype=torch.int32, device=dev),
    )
    snap = mon.snapshot()
    assert sorted(snap[(str(v.device), "att.table")].offenders) == [(1, 60, 81), (2, -9, None)]
    assert snap[(str(v.device), "att.kv")].offenders == ((3, 40, 91),)


def test_requests_at_a_lengths_site(mon, kernel_device):
    """A bad length's offender carries the request of its table row (the table rule's ``requests``), like the
    table's own entries do. Control: the rule without requests keeps the offender with no request."""
    dev = kernel_device
    for with_req in (True, False):
        m = Monitor(registry=SiteRegistry(capacity=16), capacity=16)
        v = Validator("len", dev, monitor=m)
        v.index("table", hi=50, safe=0, lengths="n", requests="req" if with_req else None)
        kw = dict(req=torch.tensor([70, 71, 72], device=dev)) if with_req else {}
        v(table=torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32, device=dev),
          n=torch.tensor([2, 9, -1], dtype=torch.int32, device=dev), **kw)  # fmt: skip
        hit = m.snapshot()[(str(v.device), "len.n")]
        want = [(1, 9, 71), (2, -1, 72)] if with_req else [(1, 9, None), (2, -1, None)]
        assert hit.count == 2 and sorted(hit.offenders) == want
        m.stop()


def test_offenders_keep_the_first_k_distinct(kernel_device):
    """K = 4: twelve bad entries with six distinct values in one program keep the first four distinct ones in entry
    order (one program: lanes claim in order); the count stays exact; repeats in a later call add nothing."""
    m = Monitor(registry=SiteRegistry(capacity=16), capacity=16, offenders=4)
    v = Validator("k", kernel_device, policy="flag", monitor=m)
    v.index("x", hi=10)
    vals = [1, 11, 12, 11, 13, 12, 14, 15, 16, 11, 2, 17, 18, 13, 3, 16]
    x = torch.tensor(vals, device=kernel_device)
    v(x=x)
    hit = m.snapshot()[(str(v.device), "k.x")]
    assert hit.count == sum(1 for a in vals if a >= 10)
    assert [(o.row, o.value) for o in hit.offenders] == [(1, 11), (2, 12), (3, 11), (4, 13)]
    v(x=x)  # the same offenders again: claimed already
    hit = m.snapshot()[(str(v.device), "k.x")]
    assert hit.count == 2 * sum(1 for a in vals if a >= 10) and len(hit.offenders) == 4
    # Control: with room for all, every distinct (row, value) is kept (the limit above was K, not the kernel).
    m2 = Monitor(registry=SiteRegistry(capacity=16), capacity=16, offenders=32)
    w = Validator("k", kernel_device, policy="flag", monitor=m2)
    w.index("x", hi=10)
    w(x=x)
    assert len(m2.snapshot()[(str(w.device), "k.x")].offenders) == sum(1 for a in vals if a >= 10)


def test_bad_attribution_declarations(mon, kernel_device):
    v = Validator("attr", kernel_device, monitor=mon)
    with pytest.raises(ValueError, match="give both"):
        v.index("a", hi=4, safe=0, segments="cu")
    with pytest.raises(ValueError, match="requests= must name a tensor"):
        v.index("a", hi=4, safe=0, requests="not id")
    v.index("t", hi=4, safe=0, lengths="n")
    with pytest.raises(ValueError, match="already declared as a lengths"):
        v.index("u", hi=4, safe=0, requests="n")
    with pytest.raises(ValueError, match="already declared as a requests"):
        v.index("u", hi=4, safe=0, requests="r", segments="r")
