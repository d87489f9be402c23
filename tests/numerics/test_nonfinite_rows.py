"""Non-finite rows (tripwire.numerics.nonfinite_rows): one hit per row holding NaN/Inf whatever its count of them
and however many chunks they span, the row's request among the offenders (none past the request map's end), the
first non-finite column of the recording chunk, the repair under mask (non-finite values to 0, nothing else), none
under flag, on the torch path and on the kernel (Triton's interpreter on the CPU, compiled on the GPU), with the
epoch's control: the same epoch twice records the row once."""

from __future__ import annotations

import math

import pytest
import torch

from tripwire.numerics import NonFiniteRows, register_nonfinite_rows_site
from tripwire.numerics.nonfinite_rows import _CHUNK, _launch

NAN, INF = float("nan"), float("inf")


def planted(dtype: torch.dtype, device: str, cols: int = 2 * _CHUNK + 100) -> tuple[torch.Tensor, dict[int, int]]:
    """9 rows: rows 1, 4, 8 bad (row 4 in three chunks, row 8 past a 7-entry request map); row -> first column."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, cols, generator=g).to(dtype)
    x[1, 77] = NAN
    x[4, 5] = -INF
    x[4, _CHUNK + 3] = NAN
    x[4, 2 * _CHUNK + 9] = INF
    x[8, cols - 1] = INF
    return x.to(device), {1: 77, 4: 5, 8: cols - 1}


def epoch(value: int, device: str) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64, device=device)


def offenders(monitor, site, device) -> tuple[int, set[tuple[int, int, int | None]]]:
    (hit,) = [h for (_, name), h in monitor.snapshot().items() if name == site.name]
    return hit.count, {(o.row, o.value, o.request) for o in hit.offenders}


def run(kind: str, monitor, device: str, x: torch.Tensor, req: torch.Tensor, mask: bool):
    site = register_nonfinite_rows_site("t.logits", monitor=monitor)
    ctr = monitor.counter(site, device)
    if kind == "torch":
        NonFiniteRows(ctr, 16).check(x, req, mask=mask)
    else:
        _launch(x, ctr, req, torch.zeros(16, dtype=torch.int64, device=device), epoch(1, device), mask)
    monitor.drain()
    return site, ctr


@pytest.mark.parametrize("kind", ["torch", "kernel"])
@pytest.mark.parametrize("mask", [True, False])
def test_one_hit_per_row_with_its_request(monitor, kernel_device, kind, mask):
    if kind == "torch" and kernel_device != "cpu":
        pytest.skip("the torch path is the CPU's")
    x, first = planted(torch.float32, kernel_device)
    before = x.clone()
    req = torch.tensor([100, 101, 102, 103, 104, 105, 106], dtype=torch.int64, device=kernel_device)
    site, _ = run(kind, monitor, kernel_device, x, req, mask)
    count, offs = offenders(monitor, site, kernel_device)
    assert count == 3
    # Row 4's three chunks each see a value: one records (its own first column), the row counts once.
    rows = {r: (v, q) for r, v, q in offs}
    assert set(rows) == {1, 4, 8}
    assert rows[1] == (77, 101) and rows[8] == (first[8], None)
    assert rows[4][1] == 104 and rows[4][0] in (5, _CHUNK + 3, 2 * _CHUNK + 9)
    bad = ~torch.isfinite(before)
    if mask:
        assert torch.isfinite(x).all()
        assert (x[bad] == 0).all() and torch.equal(x[~bad], before[~bad])
    else:
        assert torch.equal(x.isnan(), before.isnan()) and torch.equal(x[~bad], before[~bad])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_clean_rows_record_nothing(monitor, kernel_device, dtype):
    x = torch.randn(4, 3000).to(dtype).to(kernel_device)
    site = register_nonfinite_rows_site("t.clean", monitor=monitor)
    ctr = monitor.counter(site, kernel_device)
    NonFiniteRows(ctr, 4).check(x, None, mask=True)
    monitor.drain()
    assert int(ctr[0]) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "plant,rows",
    [
        ({1: float("inf")}, 1),
        ({2: float("-inf")}, 1),
        ({0: float("inf"), 3: float("-inf")}, 2),  # the sum is NaN, not Inf
        ({1: float("nan"), 2: float("inf")}, 2),
        ({}, 0),
    ],
)
def test_the_cpu_clean_test_misses_no_row(monitor, dtype, plant, rows):
    """The CPU path's clean test (a float32 sum, then the exponent field of every element where the sum is not
    finite) lets no non-finite row through, whatever the mix of +Inf, -Inf and NaN, and takes no finite value for
    one: the dtype's largest finite value (twice in one row: the sum overflows) and its smallest subnormal count
    nothing, and the check says nothing rose. Control: the sum alone is not finite on the clean tensor (it would
    have taken the overflow for a fault)."""
    x = torch.randn(4, 3000).to(dtype)
    x[3, 0] = torch.finfo(dtype).max
    x[3, 1] = torch.finfo(dtype).max
    x[2, 5] = torch.finfo(dtype).smallest_normal / 4
    if dtype != torch.float16:  # fp16's largest value sums to well inside float32: no overflow to show
        assert not math.isfinite(x.sum(dtype=torch.float32).item())
    for r, v in plant.items():
        x[r, 7 + r] = v
    site = register_nonfinite_rows_site(f"t.cpu{len(plant)}", monitor=monitor)
    ctr = monitor.counter(site, "cpu")
    rose = NonFiniteRows(ctr, 4).check(x, torch.arange(4), mask=False)
    assert rose == bool(rows)
    assert int(ctr[0]) == rows


def test_epoch_makes_each_call_count(monitor, kernel_device):
    """A row bad in two calls counts twice; the control re-uses one epoch (a claim that never resets) and the second
    call's row is not recorded."""
    site = register_nonfinite_rows_site("t.epoch", monitor=monitor)
    ctr = monitor.counter(site, kernel_device)
    seen = torch.zeros(4, dtype=torch.int64, device=kernel_device)
    x = torch.zeros(2, 50, device=kernel_device)
    for e in (1, 2):
        x[1, 3] = NAN
        _launch(x, ctr, None, seen, epoch(e, kernel_device), False)
    assert int(ctr[0]) == 2
    _launch(x, ctr, None, seen, epoch(2, kernel_device), False)  # control: the same epoch again
    assert int(ctr[0]) == 2


@pytest.mark.gpu
def test_each_graph_replay_counts():
    """A check captured into a CUDA graph counts a row bad in each of three replays three times (the epoch is a
    device word the captured call increments). Control: the captured launch alone, its epoch increment left out
    (what a host counter passed as an argument replays), records the row in the first replay only."""
    from tripwire import Monitor

    m = Monitor()
    d = torch.device("cuda")
    m.prealloc(d)
    site = register_nonfinite_rows_site("t.graph", monitor=m)
    ctr = m.counter(site, d)
    rows = NonFiniteRows(ctr, 8)
    x = torch.randn(4, 1000, device=d)
    q = torch.arange(4, device=d)
    s = torch.cuda.Stream()
    seen = torch.zeros(8, dtype=torch.int64, device=d)
    fixed = epoch(1, "cuda")
    with torch.cuda.stream(s):
        rows.check(x, q, mask=True)
        _launch(x, ctr, q, seen, fixed, True)
    torch.cuda.synchronize()
    graphs = []
    for fn in (lambda: rows.check(x, q, mask=True), lambda: _launch(x, ctr, q, seen, fixed, True)):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            fn()
        graphs.append(g)
    got = []
    for g in graphs:
        base = int(ctr[0])
        for _ in range(3):
            x[2, 5] = NAN
            g.replay()
            torch.cuda.synchronize()
        got.append(int(ctr[0]) - base)
    m.stop()
    assert got == [3, 1]


def test_bad_input_is_named(monitor, kernel_device):
    site = register_nonfinite_rows_site("t.bad", monitor=monitor)
    rows = NonFiniteRows(monitor.counter(site, kernel_device), 2)
    with pytest.raises(ValueError, match="2-D float"):
        rows.check(torch.zeros(3, dtype=torch.int64, device=kernel_device), None, mask=False)
    with pytest.raises(ValueError, match="more than the 2"):
        rows.check(torch.zeros(3, 4, device=kernel_device), None, mask=False)
    with pytest.raises(ValueError, match="requests must be"):
        rows.check(torch.full((2, 4), NAN, device=kernel_device), torch.zeros(2, dtype=torch.int32), mask=False)
    with pytest.raises(ValueError, match="max_rows"):
        NonFiniteRows(monitor.counter(site, kernel_device), 0)


def test_report_names_rows(monitor, kernel_device, caplog):
    x, _ = planted(torch.float32, kernel_device)
    with caplog.at_level("WARNING", logger="tripwire"):
        run("torch" if kernel_device == "cpu" else "kernel", monitor, kernel_device, x, None, True)
    text = "\n".join(r.getMessage() for r in caplog.records)
    # The first row is the first recorded: row 1 on the torch path, whichever program won on a GPU.
    assert "NON-FINITE ROWS at site 't.logits'" in text and "3 new, 3 total rows held NaN/Inf. First: row " in text
