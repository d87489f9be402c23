"""tripwire.testing: the public fault injectors and fixtures (documented, loaded on first use), the host-written guard
hit (word for word a kernel's: the reader reports it as it reports a kernel's), the shared guarded gather, and the
GPU timing helpers (graph replays, the code's loads pooled)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import tripwire.testing as tt
from tripwire import Monitor, SiteRegistry
from tripwire.layout import COUNT, FIRST_ROW, FIRST_VALUE, MAX_ROW, MAX_VALUE, NEG_MIN, encode, encode_neg
from tripwire.sinks import Offender
from tripwire.testing import write_hit


# ---------------------------------------------------------------------------------------------------- the package
def test_every_public_name_is_documented_and_resolves():
    assert len(tt.__all__) == len(set(tt.__all__)) == 24
    doc = tt.__doc__ or ""
    for name in tt.__all__:
        assert name in doc, f"tripwire.testing.{name} is not in the package's docstring"
        assert getattr(tt, name) is not None
    assert "write_hit" in dir(tt)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        tt.nothing_here  # noqa: B018


def test_importing_the_package_loads_neither_triton_nor_transformers():
    """The names load on first use: ``import tripwire.testing`` costs a user's test nothing it does not use (the
    control: asking for gather_rows imports Triton)."""
    code = (
        "import sys, tripwire.testing as t; print('triton' in sys.modules, 'transformers' in sys.modules); "
        "t.gather_rows; print('triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["False", "False", "True"]


# ---------------------------------------------------------------------------------------------------- write_hit
def _monitor() -> tuple[Monitor, SiteRegistry]:
    reg = SiteRegistry(capacity=8)
    return Monitor(registry=reg, capacity=8, mode="warn", interval=3600.0), reg


def test_write_hit_writes_the_words_a_guarded_kernel_writes(kernel_device):
    """The row and its offender block after write_hit (a CPU row) equal, word for word, what a guarded kernel's fault
    path leaves for the same hit (the gather where kernels run: one bad index at output row 2, value 32)."""
    m, reg = _monitor()
    by_kernel = reg.register("testing.kernel")
    by_host = reg.register("testing.host")
    table = torch.randn(32, 4, device=kernel_device)
    idx = torch.tensor([3, 0, 32, 7], device=kernel_device)
    ctr = m.counter(by_kernel, kernel_device)
    tt.gather_rows(table, idx, torch.empty(4, 4, device=kernel_device), ctr=ctr)
    write_hit(m.counter(by_host, "cpu"), 2, 32)
    kdev = ctr.device
    k_rows, h_rows = m.read_rows(kdev), m.read_rows("cpu")
    assert int(k_rows[by_kernel.id, COUNT]) == 1
    assert np.array_equal(k_rows[by_kernel.id, :7], h_rows[by_host.id, :7])
    k_blocks = m.arena.read_offenders(kdev, len(reg))
    h_blocks = m.arena.read_offenders(torch.device("cpu"), len(reg))
    assert k_blocks is not None and h_blocks is not None
    assert np.array_equal(k_blocks[by_kernel.id], h_blocks[by_host.id])
    hit = m.drain()[("cpu", by_host.name)]
    assert (hit.count, hit.first_row, hit.first_value) == (1, 2, 32)
    assert hit.offenders == (Offender(2, 32, None),)


def test_write_hit_counts_n_hits_and_names_the_request():
    m, reg = _monitor()
    site = reg.register("testing.n")
    ctr = m.counter(site, "cpu")
    write_hit(ctr, 5, -3, n=3, request=11)
    write_hit(ctr, 9, 70)
    hit = m.drain()[(next(iter(m.readers())), site.name)]
    assert (hit.count, hit.first_row, hit.first_value, hit.max_row, hit.max_value, hit.min_value) == (
        4,
        5,
        -3,
        9,
        70,
        -3,
    )
    assert hit.offenders == (Offender(5, -3, 11), Offender(9, 70, None))


@pytest.mark.parametrize(
    ("args", "kwargs", "err", "match"),
    [
        ((torch.zeros(8, dtype=torch.int32), 0, 1), {}, ValueError, "int64 \\[8\\] counter row"),
        ((torch.zeros(4, 8, dtype=torch.int64), 0, 1), {}, ValueError, "int64 \\[8\\] counter row"),
        (([0] * 8, 0, 1), {}, ValueError, "got list"),
        ((torch.zeros(8, dtype=torch.int64), 0, 1.5), {}, TypeError, "value must be an int, got float"),
        ((torch.zeros(8, dtype=torch.int64), True, 1), {}, TypeError, "row must be an int, got bool"),
        ((torch.zeros(8, dtype=torch.int64), 0, 1), {"n": 0}, ValueError, "n must be >= 1"),
        ((torch.zeros(8, dtype=torch.int64), 0, 1 << 62), {}, ValueError, "encodable range"),
        ((torch.zeros(8, dtype=torch.int64), 0, 1), {"request": -1}, ValueError, "request must be None or an int"),
    ],
)
def test_write_hit_refuses_bad_input_naming_it(args, kwargs, err, match):
    ctr = args[0]
    before = ctr.clone() if isinstance(ctr, torch.Tensor) else None
    with pytest.raises(err, match=match):
        write_hit(*args, **kwargs)
    if before is not None:
        assert torch.equal(ctr, before)  # nothing written


def _row_words_only(ctr: torch.Tensor, row: int, value: int) -> None:
    """A hit's row words without its offender block's last word: what a writer that skips the offenders leaves."""
    ctr[COUNT] += 1
    ctr[MAX_ROW] = max(int(ctr[MAX_ROW]), encode(row))
    ctr[MAX_VALUE] = max(int(ctr[MAX_VALUE]), encode(value))
    ctr[NEG_MIN] = max(int(ctr[NEG_MIN]), encode_neg(value))
    ctr[FIRST_ROW] = encode(row)
    ctr[FIRST_VALUE] = encode(value)


@pytest.mark.parametrize("writer", ["write_hit", "row_words_only"])
def test_a_host_hit_is_reported_at_once_only_with_its_offenders(caplog, writer):
    """write_hit's hit is reported by the poll after the one that saw it rise, as a kernel's is. The control, a
    hit written without its offender block's recorded-hits word (what ``tripwire bench``'s q4 wrote on the CPU,
    which made its figure the reader's wait for offenders, 250 ms and more): no report for those polls, one only
    once the reader gives up waiting for offenders that never land."""
    caplog.set_level(logging.WARNING, logger="tripwire")
    m, reg = _monitor()
    site = reg.register("testing.timing")
    ctr = m.counter(site, "cpu")
    (write_hit if writer == "write_hit" else _row_words_only)(ctr, 0, 1000)
    t0 = time.monotonic()
    for _ in range(3):
        m.poll()
    quick = [r for r in caplog.records if site.name in r.getMessage()]
    if writer == "write_hit":
        assert len(quick) == 1
        return
    if time.monotonic() - t0 < 0.2:  # a machine that stalls past the wait cannot show the control's first half
        assert quick == []
    time.sleep(0.3)
    m.poll()
    m.poll()
    assert len([r for r in caplog.records if site.name in r.getMessage()]) == 1


# ---------------------------------------------------------------------------------------------------- gather_rows
def test_bench_gather_kernel_counts_and_masks(kernel_device) -> None:
    """The shared guarded gather (``tripwire bench``'s q4, the lab's reader questions, the reader's GPU tests and
    scripts/gpu_distributed.py inject faults through it)."""
    from tripwire import Monitor, SiteRegistry
    from tripwire.testing import gather_rows

    reg = SiteRegistry(capacity=4)
    site = reg.register("bench.test.gather")
    m = Monitor(registry=reg, capacity=4)
    ctr = m.counter(site, kernel_device)
    table = torch.randn(32, 16, device=kernel_device)
    good = torch.tensor([3, 0, 31, 7], device=kernel_device)
    out = torch.empty(4, 16, device=kernel_device)
    gather_rows(table, good, out, ctr=ctr)
    assert torch.equal(out, table[good]) and int(m.read_rows(kernel_device)[site.id, 0]) == 0
    twin = torch.empty_like(out)
    gather_rows(table, good, twin, guard=False)
    assert torch.equal(twin, out)
    bad = good.clone()
    bad[2] = 32  # one past the end
    gather_rows(table, bad, out, ctr=ctr)
    snap = m.drain()
    hit = snap[(next(iter(m.readers())), site.name)]
    assert (hit.count, hit.first_row, hit.first_value) == (1, 2, 32)
    assert not out[2].any() and torch.equal(out[[0, 1, 3]], table[good[[0, 1, 3]]])
    with pytest.raises(ValueError, match="ctr"):
        gather_rows(table, good, out)
    # One element per row (the reader's GPU tests), int32 indices: one hit per bad index, at its position.
    m.reset()
    src = torch.randn(100, device=kernel_device)
    idx = torch.arange(40, dtype=torch.int32, device=kernel_device)
    idx[[5, 17]] = torch.tensor([107, -1], dtype=torch.int32, device=kernel_device)
    flat = torch.empty(40, device=kernel_device)
    gather_rows(src, idx, flat, ctr=ctr)
    hit = m.drain()[(next(iter(m.readers())), site.name)]
    assert (hit.count, hit.max_row, hit.max_value, hit.min_value) == (2, 17, 107, -1)
    assert flat[5] == 0 and flat[17] == 0 and torch.equal(flat[:5], src[:5])
    with pytest.raises(ValueError, match="out must be"):
        gather_rows(src, idx, torch.empty(40, 1, device=kernel_device), ctr=ctr)


def _fake_graphs(monkeypatch, levels: dict[str, list[float]]):
    """pooled_replay_ms with its GPU parts replaced: each body's "graph" replays as the tag it was made with, and
    do_bench_ms returns that copy's level (ms per graph), recording the order it was asked in."""
    from tripwire.testing import timing

    asked: list[tuple[str, int]] = []

    class Graph:
        def __init__(self, tag):
            self.replay = tag

    def fake_capture(body, *, warm, repeat):
        return Graph(body())

    def fake_bench(fn, *, rep_ms):
        asked.append(fn)
        name, i = fn
        return levels[name][i]

    monkeypatch.setattr(timing, "capture", fake_capture)
    monkeypatch.setattr(timing, "do_bench_ms", fake_bench)
    bodies = {n: [lambda n=n, i=i: (n, i) for i in range(len(v))] for n, v in levels.items()}
    return timing, bodies, asked


def test_pooled_replay_times_every_copy_interleaved_and_alternating(monkeypatch):
    timing, bodies, asked = _fake_graphs(monkeypatch, {"original": [2.0, 4.0], "guarded": [6.0, 8.0], "one": [10.0]})
    out = timing.pooled_replay_ms(bodies, per_graph=2, repeats=3, rep_ms=1)
    first = [("original", 0), ("guarded", 0), ("one", 0), ("original", 1), ("guarded", 1)]
    assert asked == first + first[::-1] + first
    # Per variant, per round, one per-call time per copy (the graph's time over its calls).
    assert out == {"original": [[1.0, 2.0]] * 3, "guarded": [[3.0, 4.0]] * 3, "one": [[5.0]] * 3}
    # The single-copy form is the same timing, one sample per round.
    assert timing.paired_replay_ms({"one": bodies["one"][0]}, per_graph=2, repeats=2, rep_ms=1) == {"one": [5.0, 5.0]}
    with pytest.raises(ValueError, match="at least one body"):
        timing.pooled_replay_ms({"empty": []}, per_graph=1, repeats=1, rep_ms=1)


def test_jit_copy_is_the_same_kernel_under_another_function(kernel_device):
    """A copy runs the same Python function with the same options (the interpreter keeps them as given, a
    JITFunction as attributes), computes what the kernel does, and leaves the kernel its name in Triton's registry."""
    import triton.runtime.jit as triton_jit

    from tripwire.testing import jit_copy

    copy = jit_copy(_add_one)
    assert copy is not _add_one and copy.fn is _add_one.fn
    if hasattr(_add_one, "kwargs"):  # the interpreter
        assert copy.kwargs == _add_one.kwargs and copy.kwargs["do_not_specialize"] == ["n"]
    else:
        assert copy.do_not_specialize == _add_one.do_not_specialize == ["n"]
    registry = getattr(triton_jit, "_triton_jit_function_registry", {})
    assert all(v is not copy for v in registry.values())
    x = torch.arange(8, device=kernel_device, dtype=torch.int32)
    a, b = torch.empty_like(x), torch.empty_like(x)
    _add_one[(1,)](x, a, 8, BLOCK=8)
    copy[(1,)](x, b, 8, BLOCK=8)
    assert torch.equal(a, x + 1) and torch.equal(b, a)


def test_jit_copy_leaves_the_kernel_its_registry_entry(monkeypatch):
    """Triton 3.9 registers every JITFunction under its module and name, the last one made winning (the control: a
    plain second ``triton.jit`` of the function takes the entry); ``jit_copy`` gives the entry back to the kernel."""
    import triton.runtime.jit as triton_jit

    from tripwire.testing import jit_copy

    registry = getattr(triton_jit, "_triton_jit_function_registry", None)
    if registry is None:
        pytest.skip(f"Triton {triton.__version__} keeps no registry of its JITFunctions (3.9 does)")
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)  # JITFunctions, not interpreted functions
    key = f"{_add_one.fn.__module__}:{_add_one.fn.__qualname__}"
    monkeypatch.setitem(registry, key, registry.get(key))  # the entry as it was, after the test
    kernel = triton.jit(_add_one.fn)
    plain = triton.jit(_add_one.fn)
    assert registry[key] is plain  # the control
    registry[key] = kernel
    copy = jit_copy(kernel)
    assert copy is not kernel and registry[key] is kernel


@pytest.mark.gpu
def test_gpu_jit_copy_loads_the_code_apart():
    """The copy's compiled kernel is a module of its own (another CUfunction) with the kernel's binary; the control:
    the kernel launched again is the same function of the same module."""
    from tripwire.testing import jit_copy

    copy = jit_copy(_add_one)
    x = torch.arange(8, device="cuda", dtype=torch.int32)
    y = torch.empty_like(x)
    k1 = _add_one[(1,)](x, y, 8, BLOCK=8)
    k2 = _add_one[(1,)](x, y, 8, BLOCK=8)
    kc = copy[(1,)](x, y, 8, BLOCK=8)
    torch.cuda.synchronize()
    assert k1.function == k2.function and k1.module == k2.module  # the control: one load
    assert kc.function != k1.function and kc.module != k1.module
    assert kc.asm["cubin"] == k1.asm["cubin"]  # the same binary, loaded twice


@triton.jit(do_not_specialize=["n"])
def _add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < n) + 1, mask=o < n)


# --------------------------------------------------------------------------- vllm_proc: vLLM's start-up race, retried
_FAKE_ENGINE = """#!/bin/sh
# Stands in for the vLLM environment's python: run_engine calls it as `PY -m tripwire.testing.vllm_run CONFIG`, in
# the run's own folder. Each start is counted in ./starts; the first DIE starts die with STDERR's words.
n=$(( $(cat starts 2>/dev/null || echo 0) + 1 )); echo $n > starts
if [ $n -le {die} ]; then
  {inject}
  echo "{stderr}" >&2; exit 1
fi
echo '{{"hooked": true, "rounds": []}}'
"""


def _fake_engine(tmp_path, *, die: int, stderr: str, inject: bool = False):
    py = tmp_path / "fake-python"
    line = 'echo \'{"kind": "read"}\' > "$TRIPWIRE_VLLM_FAULTS_LOG"' if inject else ":"
    py.write_text(_FAKE_ENGINE.format(die=die, stderr=stderr, inject=line))
    py.chmod(0o755)
    return str(py)


_RACE = "AssertionError: Error in memory profiling. Initial free memory 70.1 GiB, current free memory 71.3 GiB."


@pytest.mark.parametrize(
    ("die", "stderr", "inject", "starts", "restarts", "alive"),
    [
        (2, _RACE, False, 3, 2, True),  # the race twice: started again twice, the third start runs
        (5, _RACE, False, 3, 2, False),  # the race every time: given up after PROFILE_RACE_RESTARTS, the death kept
        (1, "RuntimeError: CUDA error: an illegal memory access was encountered", False, 1, 0, False),  # control
        (1, _RACE, True, 1, 0, False),  # control: a fault was injected before it died: the run's own outcome
    ],
)
def test_run_engine_starts_again_only_a_run_lost_to_vllms_startup_race(tmp_path, die, stderr, inject, starts,
                                                                        restarts, alive):  # fmt: skip
    """An engine run that died of vLLM's start-up memory-profiling assertion (another process on the GPU freed
    memory while it sized its KV cache), with no fault injected and no event written, is started again, at most
    twice, and the restarts are counted; any other death, or one after a fault was injected, is returned as it
    is (the controls: the observation flips to one start and no restart)."""
    from tripwire.testing.vllm_proc import PROFILE_RACE, PROFILE_RACE_RESTARTS, run_engine

    assert PROFILE_RACE in _RACE and PROFILE_RACE_RESTARTS == 2
    py = _fake_engine(tmp_path, die=die, stderr=stderr, inject=inject)
    run = run_engine(tmp_path / "work", "race", {"rounds": []}, python=py, timeout=60)
    assert int((tmp_path / "work" / "race" / "starts").read_text()) == starts
    assert run.restarts == restarts
    assert (run.result is not None) is alive
    assert run.rc == (0 if alive else 1)
