"""Non-finite counter (tripwire.numerics.nonfinite): exact NaN/+Inf/-Inf counts, the first offender one real
(row, column), extremes, zero on clean data, several programs, float64 not upcast (with the control that shows a
float32 upcast would count a finite value), the reporter's wording and arming. GPU: compiled on a logits-sized
tensor, and a captured CUDA graph replayed N times counts exactly N x, reported by the reader."""

from __future__ import annotations

import logging

import pytest
import torch

from tripwire import Monitor, SiteRegistry
from tripwire.layout import decode, decode_neg
from tripwire.numerics import count_nonfinite, register_nonfinite_site
from tripwire.numerics.nonfinite import _launch

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def decoded(monitor, site, device) -> dict:
    r = [int(w) for w in monitor.read_rows(device)[site.id]]
    return {
        "count": r[0],
        "max_row": decode(r[1]),
        "max_col": decode(r[2]),
        "min_col": decode_neg(r[3]),
        "first": (decode(r[4]), decode(r[5])),
        "spare": r[6:7],  # slot 7 is layout (the offender block's address)
    }


def plant(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[:9]
    specials = [float("nan"), float("inf"), float("-inf")] * 3
    for i, v in zip(idx.tolist(), specials, strict=True):
        flat[i] = v
    return x.to(device), sorted(idx.tolist())


def expected(idx: list[int], ncols: int) -> dict:
    rc = [(i // ncols, i % ncols) for i in idx]
    return {
        "count": len(rc),
        "max_row": max(r for r, _ in rc),
        "max_col": max(c for _, c in rc),
        "min_col": min(c for _, c in rc),
        "pairs": set(rc),
        "lowest": min(rc),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 33), (130,)])
def test_planted_exact(monitor, kernel_device, dtype, shape):
    site = register_nonfinite_site("logits", monitor=monitor)
    x, idx = plant(shape, dtype, kernel_device, seed=1)
    count_nonfinite(x, site, monitor=monitor)
    got = decoded(monitor, site, kernel_device)
    ref = expected(idx, shape[1] if len(shape) == 2 else 1)
    assert got["count"] == ref["count"] == 9
    assert (got["max_row"], got["max_col"], got["min_col"]) == (ref["max_row"], ref["max_col"], ref["min_col"])
    # One program covers this tensor: the first offender is the lowest (row, column).
    assert got["first"] == ref["lowest"]
    assert got["spare"] == [0]
    if len(shape) == 1:
        assert ref["max_col"] == 0  # 1-D: row = index, column 0


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_fp8(monitor, kernel_device, dtype):
    site = register_nonfinite_site("fp8", monitor=monitor)
    x = torch.zeros(4, 8, dtype=torch.uint8)
    x.view(dtype)[:] = 1.0
    if dtype == torch.float8_e5m2:
        x[1, 2], x[3, 0] = 0x7C, 0xFC  # +inf, -inf
        x[2, 5] = 0x7E  # nan
        n = 3
    else:
        x[1, 2], x[3, 0] = 0x7F, 0xFF  # e4m3fn has no inf: both are NaN
        n = 2
    count_nonfinite(x.view(dtype).to(kernel_device), site, monitor=monitor)
    got = decoded(monitor, site, kernel_device)
    assert got["count"] == n and got["first"] == (1, 2)


def test_clean_data_records_nothing(monitor, kernel_device):
    site = register_nonfinite_site("clean", monitor=monitor)
    x = torch.randn(16, 100, device=kernel_device, dtype=torch.bfloat16) * 1e4
    x[0, 0] = torch.finfo(torch.bfloat16).max
    x[1, 1] = -torch.finfo(torch.bfloat16).max
    count_nonfinite(x, site, monitor=monitor)
    assert monitor.read_rows(kernel_device)[site.id, :7].tolist() == [0] * 7  # slot 7 is layout (the offender block)


def test_float64_is_not_upcast(monitor, kernel_device):
    site = register_nonfinite_site("f64", monitor=monitor)
    x = torch.zeros(3, 4, dtype=torch.float64, device=kernel_device)
    x[1, 1] = 1e300  # finite in float64
    x[2, 3] = float("nan")
    count_nonfinite(x, site, monitor=monitor)
    assert decoded(monitor, site, kernel_device)["count"] == 1
    # Control: through float32 the finite value becomes inf and would have been counted.
    assert torch.isinf(x.float()).sum() == 1


@pytest.mark.parametrize("iters", [1, 3])
def test_many_programs_accumulate(monitor, kernel_device, iters):
    """Small blocks: many programs, each with at most one set of atomics; counts add across programs and calls.
    With iters=3, several load steps per program and a partial last program."""
    site = register_nonfinite_site("blocks", monitor=monitor)
    x, idx = plant((20, 50), torch.float32, kernel_device, seed=3)
    ctr = monitor.counter(site, kernel_device)
    _launch(x, ctr, block=64, num_warps=4, iters=iters)
    _launch(x, ctr, block=64, num_warps=4, iters=iters)
    got = decoded(monitor, site, kernel_device)
    ref = expected(idx, 50)
    assert got["count"] == 2 * ref["count"]
    assert (got["max_row"], got["max_col"], got["min_col"]) == (ref["max_row"], ref["max_col"], ref["min_col"])
    assert got["first"] in ref["pairs"]  # a real offender (which program wins the race is not specified)


def test_the_twin_counts_programs_not_elements(monitor, kernel_device):
    """``_launch(guard=False)``, the benchmark's twin, adds 1 per program that saw a non-finite value and records
    nothing else; the same launch guarded counts every planted element (the control)."""
    site = register_nonfinite_site("twin", monitor=monitor)
    x, idx = plant((20, 50), torch.float32, kernel_device, seed=5)
    ctr = monitor.counter(site, kernel_device)
    _launch(x, ctr, block=64, num_warps=4, iters=2, guard=False)
    twin = decoded(monitor, site, kernel_device)
    programs = len({i // 128 for i in idx})  # 64 x 2 elements per program
    assert twin["count"] == programs < len(idx) and twin["first"] == (None, None)
    _launch(x, ctr, block=64, num_warps=4, iters=2)
    assert decoded(monitor, site, kernel_device)["count"] == programs + expected(idx, 50)["count"]


def test_site_by_name_and_ctr(monitor, kernel_device):
    site = register_nonfinite_site("hidden", monitor=monitor, fatal=True)
    assert site.kind == "nonfinite" and site.fatal
    x = torch.tensor([1.0, float("nan")], device=kernel_device)
    count_nonfinite(x, "hidden", monitor=monitor)
    count_nonfinite(x, site, ctr=monitor.counter(site, kernel_device))
    assert decoded(monitor, site, kernel_device)["count"] == 2


@pytest.mark.parametrize(
    "x, site_kind, err",
    [
        (torch.zeros(4, dtype=torch.int32), "nonfinite", "floating"),
        (torch.zeros(2, 2, 2), "nonfinite", "1-D or 2-D"),
        (torch.zeros(4, 6).t(), "nonfinite", "contiguous"),
        (torch.zeros(4), "guard", "register_nonfinite_site"),
    ],
)
def test_rejects_bad_arguments(monitor, registry, x, site_kind, err):
    site = (
        registry.register("s", kind=site_kind)
        if site_kind == "guard"
        else register_nonfinite_site("s", monitor=monitor)
    )
    with pytest.raises((TypeError, ValueError), match=err):
        count_nonfinite(x, site, monitor=monitor)
    with pytest.raises(ValueError, match="int64"):
        count_nonfinite(torch.zeros(4), site, ctr=torch.zeros(8, dtype=torch.int32))


def test_empty_tensor_is_a_no_op(monitor):
    site = register_nonfinite_site("empty", monitor=monitor)
    count_nonfinite(torch.zeros(0, 5), site, monitor=monitor)
    assert monitor.read_rows("cpu")[site.id, :7].tolist() == [0] * 7  # slot 7 is layout (the offender block)


# ------------------------------------------------------------------------------------------------------ reporting


def first_sight(monitor, device) -> None:
    """Process the first reader copy that holds the counts (CPU: read directly; CUDA: one copy must land first)."""
    if device != "cpu":
        torch.cuda.synchronize()
        monitor.poll()  # starts a copy
        torch.cuda.synchronize()
    monitor.poll()


def next_copy(monitor, device, until=lambda: True, copies: int = 1) -> None:
    """One more reader copy processed; on CUDA up to ``copies`` of them, until ``until()`` holds (a GPU read lands
    a poll after it starts, and confirmation takes a copy after the first sight)."""
    for _ in range(copies if device != "cpu" else 1):
        if device != "cpu":
            torch.cuda.synchronize()
        monitor.poll()
        if until():
            return


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "NON-FINITE" in r.getMessage()]


def test_reported_with_its_own_wording_warn_mode_does_not_arm(monitor, kernel_device, caplog):
    site = register_nonfinite_site("logits", monitor=monitor, description="lm_head output")
    x = torch.zeros(4, 10, device=kernel_device)
    x[2, 7] = float("nan")
    x[3, 1] = float("inf")
    count_nonfinite(x, site, monitor=monitor)
    first_sight(monitor, kernel_device)
    assert warnings_of(caplog) == []  # confirmed one copy later
    next_copy(monitor, kernel_device, lambda: warnings_of(caplog) != [], copies=4)
    (msg,) = warnings_of(caplog)
    assert "'logits'" in msg and "2 new, 2 total NaN/Inf" in msg and "First: row 2, column 7" in msg
    assert "max row 3, columns 1..7" in msg and "lm_head output" in msg
    assert "out-of-range" not in msg  # not the guard wording
    assert monitor.armed is None  # warn mode, not fatal


def test_raise_mode_and_fatal_site_arm(kernel_device):
    reg = SiteRegistry(capacity=16)
    m = Monitor(registry=reg, capacity=16, mode="raise")
    s = register_nonfinite_site("logits", monitor=m)
    count_nonfinite(torch.tensor([float("nan")], device=kernel_device), s, monitor=m)
    first_sight(m, kernel_device)
    next_copy(m, kernel_device, lambda: m.armed is not None, copies=4)
    assert m.armed is not None and m.armed.site == "logits" and "NON-FINITE" in str(m.armed)
    assert m.armed.first_row == 0 and m.armed.first_value == 0
    reg2 = SiteRegistry(capacity=16)
    w = Monitor(registry=reg2, capacity=16, mode="warn")
    f = register_nonfinite_site("hidden", monitor=w, fatal=True)
    count_nonfinite(torch.tensor([1.0, float("inf")], device=kernel_device), f, monitor=w)
    w.drain()
    assert w.armed is not None and w.armed.fatal and w.armed.first_row == 1


# ------------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_logits_sized(dtype):
    reg = SiteRegistry(capacity=16)
    m = Monitor(registry=reg, capacity=16)
    site = register_nonfinite_site("logits", monitor=m)
    x = torch.randn(256, 152064, device="cuda").to(dtype)
    x[0, 151000] = float("nan")
    x[17, 3] = float("inf")
    x[255, 152063] = float("-inf")
    x[100, 0] = float("nan")
    count_nonfinite(x, site, monitor=m)
    got = decoded(m, site, "cuda")
    assert got["count"] == int((~torch.isfinite(x)).sum()) == 4
    assert (got["max_row"], got["max_col"], got["min_col"]) == (255, 152063, 0)
    assert got["first"] in {(0, 151000), (17, 3), (255, 152063), (100, 0)}


@pytest.mark.gpu
@pytest.mark.parametrize("block,iters,warps", [(2048, 4, 8), (2048, 2, 8), (4096, 4, 8), (2048, 4, 4)])
def test_gpu_capped_fault_path_counts_exactly(block, iters, warps):
    """At shapes of the sweep where the launch is compiled within its twin's registers (its fault path, out of
    line, spilling on its own path: tripwire.triton._budget), the fault path still counts every element, the
    extremes and the first element exactly, over a dense stretch (a whole program's range and more) and scattered
    elements; the launch then leaves the clean data counted as before."""
    reg = SiteRegistry(capacity=16)
    m = Monitor(registry=reg, capacity=16)
    site = register_nonfinite_site("logits", monitor=m)
    ncols = 152064
    x, idx = plant((64, ncols), torch.bfloat16, "cuda", seed=5)
    x.view(-1)[3 * ncols + 17 : 3 * ncols + 17 + 3 * block * iters] = float("nan")
    ref = expected(sorted({*idx, *range(3 * ncols + 17, 3 * ncols + 17 + 3 * block * iters)}), ncols)
    assert int((~torch.isfinite(x)).sum()) == ref["count"]
    _launch(x, m.counter(site, "cuda"), block, warps, iters)
    got = decoded(m, site, "cuda")
    assert got["count"] == ref["count"]
    assert (got["max_row"], got["max_col"], got["min_col"]) == (ref["max_row"], ref["max_col"], ref["min_col"])
    assert got["first"] in ref["pairs"]


@pytest.mark.gpu
def test_gpu_graph_replay_counts_n_times(caplog):
    caplog.set_level(logging.INFO, logger="tripwire")
    reg = SiteRegistry(capacity=16)
    m = Monitor(registry=reg, capacity=16, interval=0.01)
    m.prealloc("cuda")
    site = register_nonfinite_site("logits", monitor=m)
    ctr = m.counter(site, "cuda")
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    x[5, 9] = float("nan")
    x[40, 4095] = float("-inf")
    count_nonfinite(x, site, ctr=ctr)  # compile before capturing
    torch.cuda.synchronize()
    m.reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        count_nonfinite(x, site, ctr=ctr)
    n = 11
    for _ in range(n):
        g.replay()
    torch.cuda.synchronize()
    got = decoded(m, site, "cuda")
    assert got["count"] == 2 * n and got["first"] in {(5, 9), (40, 4095)}
    for _ in range(4):
        m.poll()
        torch.cuda.synchronize()
    msgs = warnings_of(caplog)
    assert msgs and f"{2 * n} total" in msgs[-1] and "cuda:0" in msgs[-1]
