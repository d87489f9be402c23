"""The validator's torch backend (CPU tensors): its plain torch path, proven equal to the Triton kernel.

The kernel runs here under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU) on the
same calls as the torch path, and every word both leave behind is compared: the arena rows, the offender blocks, the
repaired tensors. ``tests/validate/test_validate.py`` runs the validator's semantic tests on both paths.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

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


def _perturbed_claim_order(off: torch.Tensor) -> torch.Tensor:
    """``off`` (offender blocks, one row per site) with the claimed entries of the first block holding two or more
    in reverse order: what a path that claims offenders highest first leaves."""
    from tripwire.layout import E_KEY, OFF_ENTRY, OFF_HEADER

    out = off.clone()
    for r in range(out.shape[0]):
        entries = out[r, OFF_HEADER:].view(-1, OFF_ENTRY)
        claimed = int((entries[:, E_KEY] != 0).sum())
        if claimed >= 2:
            entries[:claimed] = entries[:claimed].flip(0).clone()
            return out
    raise AssertionError("no offender block holds two entries: the control would compare equal words")


@needs_interpreter
def test_word_comparison_can_fail():
    """Control for the comparison above: the words of a torch path that claims offenders in another order (highest
    first), or counts one hit too many, are caught word for word. The torch path's words of one run, so perturbed,
    against the kernel's words of the same run, which they equal unperturbed."""
    from tripwire.layout import COUNT

    (rows_t, off_t, _), (rows_k, off_k, _) = _twin_call(4, 11, True, 1)
    assert torch.equal(rows_t, rows_k) and torch.equal(off_t, off_k)
    assert not torch.equal(_perturbed_claim_order(off_t), off_k)
    one_more = rows_t.clone()
    one_more[int(one_more[:, COUNT].nonzero()[0]), COUNT] += 1
    assert not torch.equal(one_more, rows_k)


# ---------------------------------------------------------------------------------------------- the clean path
class _Ops(TorchDispatchMode):
    """The aten ops a block dispatches, as (op, input shapes): torch's own view of the work a call does."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[tuple[int, ...], ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append((str(func), tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))

    def searched(self) -> list[tuple[int, ...]]:
        """The shape searched by each exact path that ran: a rule's exact path finds its bad entries with one
        ``nonzero`` over the rule's flattened tensor (its entries, its lengths, its indptr); the clean path, the host
        clean test, searches nothing."""
        return [shapes[0] for op, shapes in self.ops if op == "aten.nonzero.default"]


class _GateLooseByOne(TorchFunctionMode):
    """The torch path's clean path loosened by one past ``hi``: its reads of a tensor (a small one's list, a larger
    one's extremes) see ``hi`` as ``hi - 1``. The exact path (torch comparisons, no such read) is untouched."""

    def __init__(self, hi: int) -> None:
        super().__init__()
        self.hi = hi

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.tolist:
            return [self.hi - 1 if x == self.hi else x for x in out] if out and isinstance(out[0], int) else out
        if func is torch.aminmax:
            return type(out)(torch.where(t == self.hi, self.hi - 1, t) for t in out)
        return out


# A list read (8 entries), and a tensor's extremes (300): the torch path reads a decode step's metadata as lists, a
# larger tensor through one aminmax; `padded_exact`: whether a clean call whose slots hold the padding takes the
# exact path (the extremes of a large tensor whose extreme is the padding say nothing of the entries between it and
# the range, so it does, and counts nothing).
@pytest.mark.parametrize(("n", "padded_exact"), [(8, False), (300, True)])
def test_clean_path_gates_the_exact_path_with_the_host_clean_test(n, padded_exact):
    """The torch path's clean path is the host clean test (each rule's public ``clean``, ``clean_lengths``,
    ``clean_indptr``): clean calls run no exact path; one entry past a bound, a count past the width or a decreasing
    indptr runs exactly that rule's (the one whose clean test fails) and counts it once. Control: with the clean
    path loosened by one past hi (its reads see the entry at hi as hi - 1), the entry at hi goes uncounted."""

    def call(slots_hi=False, count_past=False, ptr_down=False, slot_pad=True, mode=None):  # type: ignore[no-untyped-def]
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
        table, kv = torch.zeros(n, 4, dtype=torch.int32), torch.zeros(n, dtype=torch.int64)
        rules = v.rules
        unclean = [
            shape
            for shape, clean in (
                ((n,), rules["slots"].clean(slots.tolist())),
                ((4 * n,), rules["table"].clean(table.view(-1).tolist())),
                ((n,), rules["table"].clean_lengths(ln.tolist(), 4)),
                ((n,), rules["kv"].clean(kv.tolist())),
                ((n + 1,), rules["kv"].clean_indptr(ptr.tolist(), n)),
            )
            if not clean
        ]
        ops = _Ops()
        with mode if mode is not None else contextlib.nullcontext(), ops:
            v(slots=slots, table=table, n=ln, kv=kv, ptr=ptr)
        searched = ops.searched()
        if mode is None and not (padded_exact and slot_pad):
            assert searched == unclean  # the exact paths that ran are the rules whose host clean test fails
        return searched, {site: hit.count for (_d, site), hit in m.snapshot().items()}

    assert call() == (([(n,)] if padded_exact else []), {})
    assert call(slot_pad=False) == ([], {})
    assert call(slots_hi=True) == ([(n,)], {"gate.slots": 1})
    assert call(count_past=True, slot_pad=False) == ([(n,)], {"gate.n": 1})
    assert call(ptr_down=True, slot_pad=False) == ([(n + 1,)], {"gate.ptr": 1})
    assert call(slots_hi=True, slot_pad=False) == ([(n,)], {"gate.slots": 1})
    assert call(slots_hi=True, slot_pad=False, mode=_GateLooseByOne(10)) == ([], {})


def _rule_ops(rules: str, md: dict[str, torch.Tensor]) -> Counter:
    """The aten ops (by name) of one call of a fresh torch-path validator with ``rules`` (of: a padded 1-D index
    ``a``, a table ``b`` with lengths, a CSR layout ``c``, and ``d``: ``a``'s rule again over its tensor) on copies
    of ``md``."""
    v = Validator("pass", "cpu", policy="flag", monitor=Monitor(registry=SiteRegistry(capacity=16), capacity=16))
    if "a" in rules:
        v.index("a", hi=10, padding=-1)
    if "b" in rules:
        v.index("b", hi=10, safe=0, lengths="n")
    if "c" in rules:
        v.csr("c", indptr="p", hi=10, safe=0)
    if "d" in rules:
        v.index("d", hi=10, padding=-1)
    ops = _Ops()
    with ops:
        v(**{k: md[k if k != "d" else "a"].clone() for k in v.names})
    return Counter(op for op, _ in ops.ops)


def test_a_call_is_one_pass_over_its_rules():
    """A CPU validator's call runs the torch path once over every rule together (as a CUDA call is one launch:
    tests/validate/test_launcher.py): the ops three rules' call dispatches are exactly those of each rule's own call,
    nothing repeated and nothing per call beyond them. Control: a rule checked twice in a call (``d``: ``a``'s rule
    again over the same tensor) adds a second pass of ``a``'s ops, which the same count sees."""
    t = torch.tensor([1, 2, 30])
    md = {"a": t, "b": t.reshape(1, 3), "n": torch.tensor([3]), "c": t, "p": torch.tensor([0, 3])}
    alone = {r: _rule_ops(r, md) for r in "abc"}
    assert all(alone.values())
    assert _rule_ops("abc", md) == alone["a"] + alone["b"] + alone["c"]
    assert _rule_ops("abcd", md) == alone["a"] + alone["a"] + alone["b"] + alone["c"]
