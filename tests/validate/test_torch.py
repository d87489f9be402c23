"""tripwire.validate._torch: the validator's plain torch CPU path, proven equal to the Triton kernel.

The kernel runs here under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU) on the
same calls as the torch path, and every word both leave behind is compared: the arena rows, the offender blocks, the
repaired tensors. ``tests/validate/test_validate.py`` runs the validator's semantic tests on both paths.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tripwire.validate._torch as _vt
from conftest import one_call_then_three
from tripwire import Monitor, SiteRegistry
from tripwire.validate import Validator


def test_cpu_path_needs_no_triton():
    """A CPU validator runs in a process where triton cannot be imported at all (vLLM's CPU build), with its exact
    counts, offenders and masking. Control: the same process fails on a validator of the Triton backend."""
    code = """
import sys
sys.modules["triton"] = None  # `import triton` raises ImportError from here on
import torch
from tripwire import Monitor, SiteRegistry
from tripwire.validate import Validator
m = Monitor(registry=SiteRegistry(capacity=16), capacity=16)
v = Validator("cpu", "cpu", monitor=m)
v.index("slots", hi=10, padding=-1, requests="req")
s = torch.tensor([1, 12, -1, -3])
v(slots=s, req=torch.tensor([5, 6, 7, 8]))
hit = m.snapshot()[("cpu", "cpu.slots")]
print(s.tolist(), hit.count, [tuple(o) for o in hit.offenders])
try:
    Validator("kernel", "cpu", monitor=m, backend="triton")
except ImportError:
    print("the triton backend needs triton")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["[1, -1, -1, -1] 2 [(1, 12, 6), (3, -3, 8)]", "the triton backend needs triton"]


# ---------------------------------------------------------------------------------------------- the two CPU paths
def _twin_call(k_offenders, seed, mask, calls):
    """Two monitors with the same rules (so the same arena rows), one run on the torch path and one on the kernel
    under the interpreter (``backend="triton"``), over the same calls: returns both arenas' words (rows less slot 7,
    the offender block's address; offender blocks whole) and both runs' repaired tensors."""
    from tripwire.layout import OFFENDERS

    g = torch.Generator().manual_seed(seed)
    out = []
    for backend in ("torch", "triton"):
        m = Monitor(registry=SiteRegistry(capacity=32), capacity=32, offenders=k_offenders)
        v = Validator("twin", "cpu", policy="mask" if mask else "flag", monitor=m, backend=backend)
        v.index("slots", hi=900, padding=-1, fatal=True, requests="req", segments="cu")
        v.index("table", hi=50, safe=0, lengths="n", requests="row_req")
        v.index("pos", hi=64, safe=0, site="twin.shared")
        v.index("pos2", hi=40, safe=0, site="twin.shared")
        v.csr("kv", indptr="ptr", hi=30, safe=0, requests="seq_req")
        tensors_per_call = []
        g.manual_seed(seed)
        for _ in range(calls):
            n_tok = int(torch.randint(1, 2600, (1,), generator=g))
            slots = torch.randint(0, 900, (n_tok,), generator=g)
            slots[torch.randint(0, n_tok, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g)] = (
                torch.randint(-5, 3000, (1,), generator=g).item()
            )
            slots[torch.randint(0, n_tok, (5,), generator=g)] = -1
            cu = torch.sort(torch.randint(0, n_tok + 1, (6,), generator=g)).values
            cu[0] = 0
            if int(torch.randint(0, 4, (1,), generator=g)) == 0:
                cu = cu.flip(0)  # unsorted segments: the kernel's bisection, whatever it finds
            table = torch.randint(0, 50, (300, 7), generator=g, dtype=torch.int32)  # rows straddle programs
            bad = torch.randint(0, 2100, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g)
            table.view(-1)[bad] = torch.randint(-100, 10**6, (bad.numel(),), generator=g, dtype=torch.int32)
            n = torch.randint(-1, 9, (300,), generator=g, dtype=torch.int32)
            pos = torch.randint(0, 70, (1500,), generator=g)
            pos2 = torch.randint(0, 45, (30,), generator=g)
            kv = torch.randint(-2, 33, (200,), generator=g, dtype=torch.int32)
            ptr = torch.sort(torch.randint(0, 200, (9,), generator=g)).values
            ptr[int(torch.randint(0, 9, (1,), generator=g))] = int(torch.randint(-3, 260, (1,), generator=g))
            tensors_per_call.append(
                {
                    "slots": slots,
                    "req": torch.randint(-1, 1 << 40, (5,), generator=g),
                    "cu": cu.to(torch.int32),
                    "table": table,
                    "n": n,
                    "row_req": torch.arange(300) * 3 - 2,
                    "pos": pos,
                    "pos2": pos2,
                    "kv": kv,
                    "ptr": ptr,
                    "seq_req": torch.arange(8, dtype=torch.int32) + 1000,
                }
            )
        for tensors in tensors_per_call:
            v(**tensors)
        rows = m.arena.get(torch.device("cpu")).clone()
        rows[:, OFFENDERS] = 0
        out.append((rows, m.arena.offenders(torch.device("cpu")).clone(), tensors_per_call))
    return out


# The kernel's program order is the interpreter's (one after another); on a GPU its programs race for the first
# pair and the offender entries, so only the interpreter gives words to compare one for one (CI runs these).
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="compares words with the kernel's sequential program order"
)


@needs_interpreter
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k_off=st.sampled_from([2, 4, 8]), seed=st.integers(0, 10**6), mask=st.booleans(), calls=st.integers(1, 2))
def test_torch_path_equals_the_kernel_word_for_word(k_off, seed, mask, calls):
    """The CPU path against the Triton kernel under the interpreter, on calls of up to 2600 tokens (three programs),
    a 300 x 7 table (rows straddling programs), broken lengths and indptrs, two rules sharing a site, requests by
    row, by CSR row and by (sometimes unsorted) segments, small K (full offender blocks, repeats over calls): every
    arena word, every offender word and every repaired entry equal."""
    (rows_t, off_t, calls_t), (rows_k, off_k, calls_k) = _twin_call(k_off, seed, mask, calls)
    assert int(rows_t[:, 0].sum()) > 0  # the calls did fault (or the comparison would be of zeros)
    assert torch.equal(rows_t, rows_k), (rows_t[rows_t.any(1)], rows_k[rows_k.any(1)])
    assert torch.equal(off_t, off_k)
    for a, b in zip(calls_t, calls_k, strict=True):
        for name in a:
            assert torch.equal(a[name], b[name]), name


@needs_interpreter
def test_word_comparison_can_fail(monkeypatch):
    """Control for the comparison above: a torch path that claims offenders in another order (highest first), or
    counts one hit too many, is caught word for word."""
    real_claim, real_fault = _vt._claim, _vt._fault
    monkeypatch.setattr(_vt, "_claim", lambda block, cands: real_claim(block, sorted(cands, reverse=True)))
    (_, off_t, _), (_, off_k, _) = _twin_call(4, 11, True, 1)
    assert not torch.equal(off_t, off_k)
    monkeypatch.setattr(_vt, "_claim", real_claim)

    def one_more(ctr, block, groups, rows, vals, q):  # type: ignore[no-untyped-def]
        real_fault(ctr, block, groups, rows, vals, q)
        ctr[0] += 1

    monkeypatch.setattr(_vt, "_fault", one_more)
    (rows_t, _, _), (rows_k, _, _) = _twin_call(4, 11, True, 1)
    assert not torch.equal(rows_t, rows_k)


# ---------------------------------------------------------------------------------------------- the clean path
@pytest.mark.parametrize("n", [8, 300])  # a list read, and a tensor's extremes (past _vt._SMALL)
def test_clean_path_gates_the_exact_path_with_the_host_clean_test(monkeypatch, n):
    """The torch path's clean path is the host clean test: clean calls (padding included, on a small tensor) run no
    exact path; one entry past a bound, a count past the width or a decreasing indptr runs exactly that rule's
    and counts it once. Control: with the shared range test loosened by one past hi, the entry at hi goes
    uncounted."""
    ran: list[str] = []
    for name in ("_entries", "_lengths", "_indptr"):
        real = getattr(_vt, name)
        monkeypatch.setattr(_vt, name, lambda *a, _n=name, _r=real: (ran.append(_n), _r(*a))[1])

    def call(slots_hi=False, count_past=False, ptr_down=False, slot_pad=True):  # type: ignore[no-untyped-def]
        ran.clear()
        m = Monitor(registry=SiteRegistry(capacity=16), capacity=16)
        v = Validator("gate", "cpu", policy="flag", monitor=m)
        v.index("slots", hi=10, padding=-1)
        v.index("table", hi=10, lengths="n")
        v.csr("kv", indptr="ptr", hi=10)
        slots = torch.full((n,), 9)
        if slot_pad:
            slots[1] = -1
        if slots_hi:
            slots[2] = 10
        ln = torch.full((n,), 4, dtype=torch.int32)
        if count_past:
            ln[3] = 5
        ptr = torch.arange(n + 1)
        if ptr_down:
            ptr[4] = 2
        v(slots=slots, table=torch.zeros(n, 4, dtype=torch.int32), n=ln, kv=torch.zeros(n, dtype=torch.int64), ptr=ptr)
        return sorted(ran), {site: hit.count for (_d, site), hit in m.snapshot().items()}

    # A large tensor whose extreme is the padding takes the exact path (its extremes cannot show the entries
    # between the padding and the range), which counts nothing.
    assert call() == (([] if n <= _vt._SMALL else ["_entries"]), {})
    assert call(slot_pad=False) == ([], {})
    assert call(slots_hi=True) == (["_entries"], {"gate.slots": 1})
    assert call(count_past=True, slot_pad=False) == (["_lengths"], {"gate.n": 1})
    assert call(ptr_down=True, slot_pad=False) == (["_indptr"], {"gate.ptr": 1})
    real_clean = _vt.entries_clean
    monkeypatch.setattr(_vt, "entries_clean", lambda vals, lo, hi, pad=None: real_clean(vals, lo, hi + 1, pad))
    assert call(slots_hi=True, slot_pad=False) == ([], {})


def test_one_pass_per_call(monkeypatch):
    """A CPU validator's call runs the torch path once for every rule together (as a CUDA call is one launch:
    tests/validate/test_launcher.py). Control: the same rules as three validators are three passes."""
    passes = []
    real = _vt.launch

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        passes.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(_vt, "launch", counting)
    one_call_then_three("cpu", passes)
