"""The measurement lab (benchmarks/lab) and the hand-run benchmark scripts beside it (benchmarks/*.py): the suite's
runner writes the JSON record (device, versions, every figure) and RESULTS.md tables from it, never marks an
unmeasured or unresolvable figure as a pass, and the research statistics and harnesses hold their invariants on the CPU.

The end-to-end test runs a reduced subset (q5, q6 and a GPU-only question that must come back skipped on the CPU)
through the lab's runner in a subprocess, so TRITON_INTERPRET is set the way the runner sets it. It measures nothing:
figures belong in the benchmark output, not in assertions. ``tripwire bench`` (the self-check in the package) is
tests/cli/test_bench.py's.
"""

from __future__ import annotations

import builtins
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

# The lab and the scripts beside it are the repository's benchmarks/, outside the package: imported by path.
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

FIGURE_KEYS = {"unit", "label", "n", "min", "median", "max"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH), *filter(None, [env.get("PYTHONPATH")])])
    # Options before --quick on purpose: the runner must take them in any order.
    cmd = [sys.executable, "-m", "lab.run", "--only", "q7,q5,q6", "--quick", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=env)
    data = json.loads((out / "bench.json").read_text()) if (out / "bench.json").is_file() else {}
    return p, data, out


def test_quick_lab_run_writes_the_json(quick_run) -> None:
    p, data, out = quick_run
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    env = data["env"]
    for key in ("device_name", "driver", "torch", "triton", "python"):
        assert key in env
    assert env["torch"] == torch.__version__
    cpu = not torch.cuda.is_available()
    assert data["cpu_figures"] is cpu
    assert set(data["questions"]) == {"q5", "q6", "q7"}
    for qid in ("q5", "q6"):
        q = data["questions"][qid]
        assert q["status"] == "ok", q
        assert q["cpu_figures"] is cpu
        assert q["figures"] and q["targets"]
        for f in q["figures"].values():
            assert FIGURE_KEYS <= set(f)
        for t in q["targets"]:
            assert t["figure"] in q["figures"]
            assert t["pass"] in (True, False, None)
    # The latency distributions carry p50/p99 as well.
    assert {"p50", "p99"} <= set(data["questions"]["q5"]["figures"]["tick_wall_us_1024"])
    # One copy per tick is a property, not a timing: it holds on any machine.
    assert data["questions"]["q5"]["figures"]["copies_per_tick_1024"]["median"] == 1
    assert data["questions"]["q6"]["figures"]["copies_per_s_idle"]["median"] == 0
    if cpu:
        assert data["questions"]["q7"]["status"] == "skipped"
        assert "CPU figures" in p.stdout
    md = (out / "results.md").read_text()
    assert "### q5." in md
    assert ("(CPU figures)" in md) is cpu


def test_lab_questions_take_labels_and_module_names() -> None:
    """The lab's labels are RESULTS.md's (q1..q9, and the validator's); each names a module with ``run``, the lab's
    or ``tripwire bench``'s; a module's short name selects its question."""
    import importlib

    from lab.questions import QUESTIONS, label, selection

    assert sorted(q for q, _, _ in QUESTIONS) == sorted([f"q{i}" for i in range(1, 10)] + ["validator"])
    for qid, mod, _ in QUESTIONS:
        assert mod.startswith(("lab.", "tripwire.cli.bench.")) and label(mod) == qid
        assert callable(importlib.import_module(mod).run)
    assert selection("q2, tick_scaling,q3") == ({"q2", "q5", "q3"}, set())
    assert selection("") == (set(), set())
    assert selection("q42,q3_step_loop") == (set(), {"q42", "q3_step_loop"})  # neither a label nor a module
    with pytest.raises(KeyError):
        label("step_loop_stats")  # control: a helper module measures no question


def test_lab_unknown_question_is_refused(tmp_path) -> None:
    from lab.run import main

    assert main(["--only", "q42", "--out", str(tmp_path)]) == 2


def test_quick_bench_plot_or_clear_message(quick_run) -> None:
    p, _, out = quick_run
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed: plot skipped" in p.stdout
    else:
        assert (out / "bench.png").stat().st_size > 1000


def test_plot_without_matplotlib_skips_with_a_message(monkeypatch, tmp_path) -> None:
    from lab import plot

    real_import = builtins.__import__

    def no_mpl(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    msg = plot.plot({"questions": {}}, tmp_path / "x.png")
    assert "plot skipped" in msg and not (tmp_path / "x.png").exists()


def _report(pass_mark: bool | None) -> dict:
    return {
        "cpu_figures": False,
        "command": "tripwire bench",
        "env": {"device_name": "NVIDIA H200", "torch": "2.11", "triton": "3.6"},
        "questions": {
            "q2": {
                "id": "q2",
                "title": "Reader tick",
                "status": "ok",
                "cpu_figures": False,
                "figures": {
                    "tick_ms_tripwire": {
                        "unit": "ms",
                        "label": "tick",
                        "n": 3,
                        "min": 0.01,
                        "median": 0.02,
                        "max": 0.5,
                        "p50": 0.02,
                        "p99": 0.4,
                    }
                },
                "targets": [
                    {
                        "name": "tick p99",
                        "figure": "tick_ms_tripwire",
                        "target": "p99 < 1 ms",
                        "value": 0.4,
                        "pass": pass_mark,
                        "why": "",
                    }
                ],
                "notes": [],
            }
        },
    }


@pytest.mark.parametrize(("mark", "shown"), [(True, "**PASS**"), (False, "**SHORT**"), (None, "n/a")])
def test_results_md_marks(mark, shown) -> None:
    from lab.results_md import render

    md = render(_report(mark))
    row = next(ln for ln in md.splitlines() if ln.startswith("| q2 |"))
    assert shown in row
    if mark is not True:
        assert "PASS" not in row  # control: only a measured pass is ever shown as one


def test_results_md_update_replaces_only_the_measured_questions_rows(tmp_path) -> None:
    from lab.results_md import MARKERS, ROW_HEAD, update

    gb, ge = MARKERS[False]
    cb, ce = MARKERS[True]
    head = "\n".join(ROW_HEAD)
    old_q2 = "| q2 | tick p99: p99 < 1 ms | 0.9 ms | **PASS** | NVIDIA H200 | torch 2.10 | `old` | 2026-01-01 |"
    other = "| q5 | tick time: < 50 us | 40 us | **PASS** | NVIDIA H200 | torch 2.10 | `old` | 2026-01-01 |"
    skipped = "| q7 | failed captures: 0 | 0 captures | **PASS** | NVIDIA H200 | torch 2.10 | `old` | 2026-01-01 |"
    f = tmp_path / "RESULTS.md"
    f.write_text(f"head\n{gb}\n{head}\n{old_q2}\n{other}\n{skipped}\n{ge}\nmiddle\n{cb}\nOLD CPU\n{ce}\ntail\n")
    report = _report(True)
    report["started"] = "2026-12-02T00:00:00+00:00"
    report["questions"]["q7"] = {"id": "q7", "status": "skipped", "reason": "budget", "targets": []}
    update(f, report)
    text = f.read_text()
    lines = text.splitlines()
    assert old_q2 not in text and other in text and skipped in text  # the skipped question keeps its row
    new = next(ln for ln in lines if ln.startswith("| q2 |"))
    assert "0.4 ms | **PASS** | NVIDIA H200 | torch 2.11, triton 3.6 | `tripwire bench` | 2026-12-02 |" in new
    assert lines.index(new) < lines.index(other)  # in its old place
    assert "OLD CPU" in text and text.startswith("head\n") and text.endswith("tail\n")
    g = tmp_path / "bad.md"
    g.write_text("no markers")
    with pytest.raises(ValueError, match="no"):
        update(g, _report(True))


def test_results_md_update_adds_a_question_it_did_not_have(tmp_path) -> None:
    from lab.results_md import MARKERS, update

    gb, ge = MARKERS[False]
    f = tmp_path / "RESULTS.md"
    f.write_text(f"{gb}\n{ge}\n")
    update(f, _report(False))
    text = f.read_text()
    assert "| question | target |" in text and "| q2 | tick p99: p99 < 1 ms | 0.4 ms | **SHORT** |" in text


def test_step_loop_judge_respects_the_noise_floor() -> None:
    from lab.step_loop_stats import judge

    assert judge(0.05, 0.02) == (True, "")
    assert judge(0.3, 0.02)[0] is False
    # Control: with a floor above the target, an overhead under the target is not evidence of a pass.
    assert judge(0.05, 0.5)[0] is None
    assert judge(2.0, 0.5)[0] is False


def test_step_loop_median_and_se_resists_phase_rounds() -> None:
    """q3's estimator: the median of per-round paired overheads with a MAD-based standard error. Two rounds caught in
    a host phase change (+60 %) must not move it; the control, a plain mean, moves by several percent."""
    import statistics

    from lab.step_loop_stats import median_and_se

    rounds = [0.05, -0.05, 0.1, 0.0, -0.1, 0.05, 0.0, 60.0, -38.0, 0.02]
    med, se = median_and_se(rounds)
    assert abs(med - 0.01) < 1e-9 and 0 < se < 0.1
    assert abs(statistics.fmean(rounds) - med) > 2.0  # the control: the mean is dragged by the two phase rounds
    assert median_and_se([0.3]) == (0.3, float("inf"))


def _step_trace(n: int, seed: int, delay_at: list[float] | None = None, delay: float = 0.0):
    """A synthetic step loop: durations 0.7-1.3 ms (uniform, so a window is likelier to land on a long step),
    phases of 20 % slower steps lasting ~1 s, and ``delay`` added to the step running at each time in ``delay_at``."""
    import random

    rng = random.Random(seed)
    starts, durs = [], []
    t = 0.0
    todo = sorted(delay_at or [])
    while len(durs) < n:
        d = rng.uniform(0.0007, 0.0013) * (1.2 if int(t) % 2 else 1.0)
        while todo and todo[0] < t + d:  # the reader's tick lands in this step: it waits for the GIL
            d += delay
            todo.pop(0)
        starts.append(t)
        durs.append(d)
        t += d + 2e-6
    return starts, durs


def test_step_loop_attribution_recovers_a_planted_tick_cost_and_nothing_else() -> None:
    """The attribution measures the time ticks add to the steps they touch. On synthetic loops: a planted 60 us
    per tick (every 50 ms: 0.12 %) comes back within 0.03 %, and a loop without any cost comes back at 0 within
    0.03 %, although touched steps are length-biased. Control: the naive estimator (touched steps' mean against
    all steps' mean, no shifted windows) reports a cost where there is none."""
    import statistics

    from lab.step_loop_stats import ATTR_INTERVAL_S, ATTR_MARGIN_S, attribute, attributed_pct

    ticks = [0.013 + k * ATTR_INTERVAL_S for k in range(400)]  # 20 s of ticks
    spans = [(a, a + 1e-4) for a in ticks]
    runs_cost, runs_null, naive = [], [], []
    for seed in range(4):
        for planted, runs in ((60e-6, runs_cost), (0.0, runs_null)):
            starts, durs = _step_trace(20000, seed, [a + 5e-5 for a in ticks], planted)
            real, shifted, used = attribute(starts, durs, spans, ATTR_INTERVAL_S / 2, ATTR_MARGIN_S)
            assert used >= 390
            runs.append((real, shifted, sum(durs)))
            if planted == 0.0:
                s_arr, d_arr = np.asarray(starts), np.asarray(durs)
                touched = [int(np.searchsorted(s_arr, a, side="right")) - 1 for a, _ in spans if a < s_arr[-1]]
                naive.append((statistics.fmean(d_arr[touched]) / statistics.fmean(durs) - 1) * len(touched) / len(durs))
    total = sum(r[2] for r in runs_cost)
    expected = 60e-6 * sum(1 for a in ticks if a < total / 4) * 4 / total * 100
    cost, _ = attributed_pct(runs_cost)
    null, _ = attributed_pct(runs_null)
    assert abs(cost - expected) < 0.03, (cost, expected)
    assert abs(null) < 0.03, null
    assert statistics.fmean(naive) * 100 > 0.04  # the control: length bias alone looks like a cost


def test_step_loop_attribution_leaves_out_ticks_outside_the_run() -> None:
    from lab.step_loop_stats import attribute, virtual_spans

    starts, durs = _step_trace(100, 0)
    end = starts[-1] + durs[-1]
    spans = [(-0.01, -0.0099), (0.02, 0.0201), (end - 0.001, end - 0.0009)]  # before, inside, shifted past the end
    real, shifted, used = attribute(starts, durs, spans, 0.025, 0.0005)
    assert used == 1 and real > 0 and shifted > 0
    assert attribute([], [], spans, 0.025, 0.0005) == (0.0, 0.0, 0)
    v = virtual_spans(starts, durs, 1e-4, seed=1)
    assert v and all(starts[0] <= a < b <= end for a, b in v)
    assert all(abs((b2[0] - b1[0]) - 0.05) < 1e-12 for b1, b2 in itertools.pairwise(v))


def test_step_loop_judge_attributed() -> None:
    """The attribution's mark: evidence only when its floor is under the target, the GIL-holding control is seen
    and agrees with the run means, and the run means show no cost above their own floor."""
    from lab.step_loop_stats import judge_attributed

    ok_direct = (None, "not resolvable")
    heavy, heavy_direct = (4.0, 0.2), (4.3, 0.5)
    assert judge_attributed((0.02, 0.01), (0.005, 0.01), heavy, heavy_direct, ok_direct).passed is True
    assert judge_attributed((0.3, 0.02), (0.005, 0.01), heavy, heavy_direct, ok_direct).passed is False
    assert judge_attributed((0.09, 0.02), (0.005, 0.01), heavy, heavy_direct, ok_direct).passed is None  # straddles
    # Controls: each missing condition turns a would-be pass into n/a or short.
    assert judge_attributed((0.02, 0.01), (0.2, 0.01), heavy, heavy_direct, ok_direct).passed is None  # null offset
    v = judge_attributed((0.02, 0.01), (0.005, 0.01), heavy, (8.0, 0.5), ok_direct)  # control disagrees
    assert v.passed is None and "not validated" in v.why
    v = judge_attributed((0.02, 0.01), (0.005, 0.01), (0.01, 0.01), (4.0, 0.5), ok_direct)  # control unseen
    assert v.passed is None and "not validated" in v.why
    v = judge_attributed((0.02, 0.01), (0.005, 0.01), heavy, heavy_direct, (False, "exceeds the floor"))
    assert v.passed is False and "run means show more" in v.why


def _short_run(seed: int, *, drift: float, planted: float = 0.0, n: int = 250):
    """One bench-shaped run: ``n`` steps of 0.7-1.3 ms that get ``drift`` faster from first to last (a host
    warming up), reader ticks every 50 ms at a random phase, ``planted`` seconds added to the step each tick lands
    in. Returns (starts, durations, spans, planted total)."""
    import random

    rng = random.Random(seed)
    ticks = [rng.uniform(0, 0.05) + k * 0.05 for k in range(8)]
    starts, durs, t, todo, total = [], [], 0.0, list(ticks), 0.0
    for i in range(n):
        d = rng.uniform(0.0007, 0.0013) * (1 - drift * i / n)
        while todo and todo[0] + 5e-5 < t + d:
            if todo[0] + 5e-5 >= t:
                d += planted
                total += planted
            todo.pop(0)
        starts.append(t)
        durs.append(d)
        t += d + 2e-6
    return starts, durs, [(a, a + 1e-4) for a in ticks if a < t], total


def test_step_loop_attribution_is_unbiased_on_short_drifting_runs() -> None:
    """2000 runs shaped like the bench's (250 steps, a 5 % speed-up over each): without a cost the symmetric
    control reads ~0, with 60 us per tick it reads the planted total. Controls: a one-sided control (ticks moved
    one way only) reads the drift as a cost; requiring both control sides drops the ticks near the ends of each
    run."""
    from lab.step_loop_stats import ATTR_INTERVAL_S, ATTR_MARGIN_S, attribute

    half = ATTR_INTERVAL_S / 2

    def pooled(planted: float, **kw) -> tuple[float, float, int]:
        diff = total = truth = 0.0
        used = 0
        for seed in range(2000):
            starts, durs, spans, planted_total = _short_run(seed, drift=0.05, planted=planted)
            real, control, n = attribute(starts, durs, spans, half, ATTR_MARGIN_S, **kw)
            diff += real - control
            total += sum(durs)
            truth += planted_total
            used += n
        return diff / total * 100, truth / total * 100, used

    null, _, used = pooled(0.0)
    assert abs(null) < 0.015, null
    cost, truth, _ = pooled(60e-6)
    assert abs(cost - truth) < 0.015, (cost, truth)
    one_sided, _, _ = pooled(0.0, sides=(1,))
    assert one_sided > 0.025, one_sided  # the control: the drift read as a cost
    cost_both, _, used_both = pooled(60e-6, need_all_sides=True)
    assert used_both < 0.85 * used and truth - cost_both > 0.02  # the control: end ticks dropped, cost understated
    with pytest.raises(ValueError, match="shift"):
        attribute([0.0], [0.001], [], 0.0001, 0.0005)


def test_split_run_covers_every_step_and_tick_once():
    """q3 cuts its long runs into short-run-sized pieces for the attribution's per-run standard error: every step and
    every tick lands in exactly one piece, in order; a run shorter than two pieces stays whole."""
    from lab.step_loop_stats import split_run

    starts = [i * 0.001 for i in range(1037)]
    durs = [0.001] * 1037
    spans = [(t, t + 1e-4) for t in (0.0, 0.2495, 0.25, 0.6, 1.0365)]
    pieces = split_run((starts, durs, spans), 250)
    assert [len(p[0]) for p in pieces] == [250, 250, 250, 287]
    assert [s for p in pieces for s in p[0]] == starts and [d for p in pieces for d in p[1]] == durs
    assert [sp for p in pieces for sp in p[2]] == spans
    assert [len(p[2]) for p in pieces] == [2, 1, 1, 1]
    short = (starts[:400], durs[:400], spans[:2])
    assert split_run(short, 250) == [short]


def test_bench_numerics_merge_replaces_only_the_numerics_of_q1(tmp_path):
    """lab.numerics --merge folds a fresh numerics run into an earlier record's q1: the old fused FP8 and
    non-finite figures, targets and notes go, the guard figures stay, the new ones arrive through the same fold as a
    full run (numerics.fold, which guard_cost calls), and a note says what was re-measured when."""
    from lab import numerics as bench_numerics

    fused = {
        "tokens": 16,
        "heads": 8,
        "head_dim": 128,
        "regime": "healthy",
        "overhead_pct": 12.5,
        "config": [4, 1],
        "us": {"counted": 9.0, "bare": 8.0},
        "guard_only_overhead_pct": 0.1,
        "count_only_overhead_pct": 12.4,
        "gbps_counted": 100.0,
        "torch_count_over_fused": 10.0,
        "target_pct": 5.0,
        "pass": False,
    }
    res = {"quick": True, "device": "fake", "torch": "t", "triton": "tr", "repeats": 1, "fused_fp8": [fused]}
    old = {
        "questions": {
            "q1": {
                "title": "q1",
                "figures": {"overhead_pct_kv_zero": {"median": 0.1}, "overhead_pct_fp8_16x8x128_healthy": {"m": 7}},
                "targets": [
                    {"name": "kv_zero guard cost", "pass": True},
                    {"name": "fused FP8 counter fp8_16x8x128_healthy", "value": 7.0, "pass": False},
                ],
                "notes": ["guards measured", "fused FP8 and non-finite figures from benchmarks/bench_numerics.py"],
            }
        }
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(old))
    bench_numerics.merge(res, path)
    q1 = json.loads(path.read_text())["questions"]["q1"]
    assert q1["figures"]["overhead_pct_kv_zero"] == {"median": 0.1}
    assert q1["figures"]["overhead_pct_fp8_16x8x128_healthy"]["median"] == 12.5
    assert q1["figures"]["fused_count_only_pct_fp8_16x8x128_healthy"]["median"] == 12.4
    names = [t["name"] for t in q1["targets"]]
    assert names == [
        "kv_zero guard cost",
        "fused FP8 counter fp8_16x8x128_healthy",
        "fused FP8 counter fp8_16x8x128_healthy, vs count=False",
    ]
    assert [t["value"] for t in q1["targets"][1:]] == [12.5, 12.4]
    assert q1["notes"][0] == "guards measured" and len(q1["notes"]) == 3
    assert q1["notes"][-1].startswith("bench_numerics --merge: the fused FP8 and non-finite figures re-measured")


def test_bench_numerics_folds_each_sizes_sweep_as_a_target_of_its_slowest_shape(tmp_path):
    """The non-finite sweep's target (every launch shape at 90 % of a copy or more) is one q1 target per measured
    size, valued at the slowest shape: a size with one shape below the bar is SHORT, the other PASS."""
    from lab import numerics as bench_numerics

    def nonfinite(shape, ratios):
        return {
            "shape": shape, "dtype": "bfloat16", "us": 20.0, "us_with_7_nans": 20.5, "gbps": 3700.0, "copy_us": 38.0,
            "copy_gbps": 4000.0, "ratio_to_copy": ratios[0], "target": 0.8,
            "pass": ratios[0] >= 0.8, "sweep_target": 0.9, "sweep_min": min(ratios),
            "sweep_pass": min(ratios) >= 0.9,
            "sweep": [{"block": 1024 * (i + 1), "iters": 1, "num_warps": 8, "ratio_to_copy": r}
                      for i, r in enumerate(ratios)],
        }  # fmt: skip

    res = {"quick": False, "device": "fake", "torch": "t", "triton": "tr", "repeats": 5, "fused_fp8": [],
           "nonfinite": nonfinite([256, 152064], [0.933, 0.865, 0.941]),
           "nonfinite_large": nonfinite([1024, 152064], [1.05, 0.92, 1.0])}  # fmt: skip
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"questions": {"q1": {"title": "q1", "figures": {}, "targets": [], "notes": []}}}))
    bench_numerics.merge(res, path)
    targets = {t["name"]: t for t in json.loads(path.read_text())["questions"]["q1"]["targets"]}
    small = targets["non-finite counter sweep [256, 152064]: every shape"]
    large = targets["non-finite counter sweep [1024, 152064]: every shape"]
    assert (round(small["value"], 1), small["pass"]) == (86.5, False)
    assert (round(large["value"], 1), large["pass"]) == (92.0, True)
    assert targets["non-finite counter bandwidth"]["pass"] is True
    # The table names both sizes and marks each sweep.
    table = bench_numerics._table(res)
    assert "sweep (target >= 0.9 at every shape: SHORT)" in table and "at every shape: PASS" in table


def test_bench_numerics_merge_refuses_a_partial_run(tmp_path):
    """merge() replaces every numerics figure of q1: a run that measured a part (some fused batches, no non-finite
    counter) is refused, the record untouched; the control: the same result marked whole merges."""
    from lab import numerics as bench_numerics

    path = tmp_path / "bench.json"
    record = {"questions": {"q1": {"title": "q1", "figures": {"keep": {}}, "targets": [], "notes": []}}}
    path.write_text(json.dumps(record))
    res = {"quick": False, "device": "fake", "torch": "t", "triton": "tr", "repeats": 5, "fused_fp8": [],
           "partial": True}  # fmt: skip
    with pytest.raises(ValueError, match="whole numerics run"):
        bench_numerics.merge(res, path)
    assert json.loads(path.read_text()) == record
    bench_numerics.merge({**res, "partial": False}, path)
    assert json.loads(path.read_text()) != record


# ---------------------------------------------------------------------------------------------- guard benchmarks
def _fake_timers(module, monkeypatch):
    """Replace a guard benchmark's GPU timers: every body still runs (twice), every time is 1 ms, so the harness's
    plumbing (shapes, launches, byte counts, targets, JSON) runs on the CPU; no figure is real."""
    calls: list[str] = []

    def replay(bodies, *, per_graph, repeats, rep_ms):
        for name, body in bodies.items():
            body()
            body()
            calls.append(name)
        return {name: [1.0] * repeats for name in bodies}

    monkeypatch.setattr(module, "paired_replay_ms", replay)
    monkeypatch.setattr(module, "d2d_copy_ms", lambda n, repeats, rep_ms: [1.0] * repeats)
    return calls


def test_bench_decode_attention_harness_on_cpu(monkeypatch, tmp_path, kernel_device):
    import bench_decode_attention as bench

    calls = _fake_timers(bench, monkeypatch)
    shape = dict(batch=17, q_heads=4, kv_heads=2, head_dim=16, context=64, block_size=16)
    # The kernels' device in this process (the CPU under the interpreter, else the GPU): the timers are fake.
    res = bench.run(quick=True, device=kernel_device, shape=shape)
    json.dumps(res)  # JSON-ready
    assert res["default"]["outputs_equal"] and res["best"]["outputs_equal"]
    assert res["default"]["overhead_pct"] == 0.0
    assert len(res["sweep"]) == 4 and all("ms" in r for r in res["sweep"])
    assert res["hits_on_valid_metadata"] == 0
    assert res["faulting"]["bad_sequences"] == 2
    names = {t["name"] for t in res["targets"]}
    assert any("guard cost (default" in n for n in names) and any("KV bandwidth (best" in n for n in names)
    assert calls.count("guarded") == 3 and calls.count("twin") == 6
    kv, total = bench._bytes(bench._case(shape, "cpu"), 2)
    assert kv == 17 * 64 * 2 * 16 * 2 * 2 and total > kv


def _small_adopted(monkeypatch, kernel_device):
    """bench_adopted at small shapes, its timer replaced (every body runs; every time 1 ms), its resource reading
    left out (it compiles for sm_90: tests/test_register_rule.py holds the adopted kernels to the rule), and vLLM's
    side stood in by further loads of the guarded copy (this environment has no vLLM: the harness's plumbing only;
    the guarded copies against vLLM's own kernels are tests/test_adopted_vllm.py's)."""
    import adopted_vllm
    import bench_adopted as bench
    from tripwire import resources

    real = adopted_vllm.load

    def load(which, name, copy=0):  # type: ignore[no-untyped-def]
        return real("guarded", name, copy=copy + 100) if which == "original" else real(which, name, copy=copy)

    monkeypatch.setattr(adopted_vllm, "load", load)

    def replay(bodies, *, per_graph, repeats, rep_ms):
        for runs in bodies.values():
            for body in runs:
                body()
        return {n: [[1.0] * len(runs) for _ in range(repeats)] for n, runs in bodies.items()}

    monkeypatch.setattr(bench, "pooled_replay_ms", replay)
    monkeypatch.setattr(resources, "capture_launches", lambda fn: [])
    monkeypatch.setattr(bench, "CACHE", dict(kv_heads=2, head_dim=16, page=16))
    monkeypatch.setattr(bench, "DECODE", dict(batch=2, head_dim=16, context=64, page=16, splits=2))
    if kernel_device == "cpu":  # vLLM's reshape launcher asks the device's capability: answer for an H200
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    return bench


@pytest.mark.parametrize("case", ["reshape_triton_256", "decode_gqa"])
def test_bench_adopted_harness_on_cpu(monkeypatch, kernel_device, case):
    """bench_adopted's plumbing on the kernels' device (the interpreter on the CPU): each variant is its copies'
    loads (the original side's first the reference every load is checked against), the A/A further loads of the
    original side, the figures pooled."""
    bench = _small_adopted(monkeypatch, kernel_device)
    res = bench.run_case(case, rounds=3, rep_ms=1, copies=2, device=kernel_device)
    json.dumps(res)
    assert res["copies"] == 2 and res["rounds"] == 3
    assert res["cost_pct"] == res["aa_pct"] == res["one_load_cost_pct"] == 0.0
    assert set(res["copy_levels_us"]) == {"original", "guarded", "original_b"}
    assert all(v == [1000.0, 1000.0] for v in res["copy_levels_us"].values())


def test_bench_adopted_check_catches_a_load_that_writes_nothing(monkeypatch, kernel_device):
    """The control of the per-load check: a guarded load that launches nothing (what a copy that is not one would
    time as: fast, and wrong) fails the case's check, naming the load."""
    bench = _small_adopted(monkeypatch, kernel_device)
    from adopted_vllm import load

    mod = load("guarded", "triton_reshape_and_cache_flash", copy=1)
    monkeypatch.setattr(mod, "triton_reshape_and_cache_flash", lambda *a, **k: None)
    with pytest.raises(AssertionError, match="guarded load 1 differs"):
        bench.run_case("reshape_triton_256", rounds=1, rep_ms=1, copies=2, device=kernel_device)


def test_bench_cuda_gather_harness_on_cpu(monkeypatch):
    """The gather benchmark's plumbing with a torch stand-in for the extension (which needs nvcc and a GPU)."""
    import types

    import bench_cuda_gather as bench
    import tripwire

    calls = _fake_timers(bench, monkeypatch)

    def gather(src, idx, out, *, ctr=None, guard=True):
        assert (ctr is not None) == guard
        out.copy_(src[idx.long()])

    ext = types.SimpleNamespace(
        build=lambda: None,
        SITE=tripwire.register_site("bench.test.gather", description="the bench test's gather"),
        gather=gather,
    )
    res = bench.run(quick=True, device="cpu", shapes={"small": (64, 16, 40)}, ext=ext)
    json.dumps(res)
    r = res["shapes"]["small"]
    assert r["outputs_equal"] and r["row_bytes"] == 32 and r["overhead_pct"] == 0.0
    assert [t["pass"] for t in res["targets"]] == [True, True]
    assert calls == ["guarded", "twin"]


def _sweep_nonfinite_input(kernel_device, cols=5000):
    # 3 x 5000 bf16: 15000 elements, two spans at the counter's default 2048x4 (8192 elements), 15 at 1024x1 (more
    # than the interpreter's 4 resident programs: a persistent program loops).
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, cols, generator=g).to(torch.bfloat16).to(kernel_device)


def test_sweep_nonfinite_layouts_flag_exactly(kernel_device):
    """Every layout the non-finite sweep times reads every element: nothing flagged on finite data, the programs
    holding a NaN in the first and the last element flagged, at the first four of the sweep's shapes and at 1024x1/w8,
    where a persistent grid of 4 programs loops over 15 spans (the NaNs in two programs) and over 5 (3 x 1500: both
    in program 0, flagged once)."""
    import sweep_nonfinite as sweep

    sweep.check(_sweep_nonfinite_input(kernel_device), [*sweep.SHAPES[:4], (1024, 1, 8)])
    sweep.check(_sweep_nonfinite_input(kernel_device, cols=1500), [(1024, 1, 8)])


def test_sweep_nonfinite_check_catches_a_layout_that_skips_elements(monkeypatch, kernel_device):
    """The control: a launcher that reads all but the last element (a layout whose last span is short) fails the
    check, naming the layout and the shape."""
    import sweep_nonfinite as sweep

    real = sweep.launcher
    monkeypatch.setattr(sweep, "launcher", lambda x, ctr, shape, layout: real(x.view(-1)[:-1], ctr, shape, layout))
    with pytest.raises(AssertionError, match=r"\('step', \(1024, 8, 8\), 1, 2\)"):
        sweep.check(_sweep_nonfinite_input(kernel_device), sweep.SHAPES[:1])


# ---------------------------------------------------------------------------------------------- code placement
def test_pooled_cost_reads_the_code_not_where_one_load_landed():
    """The same code loaded at three addresses times at three levels (a placement offset, persistent over rounds).
    Pooled over the loads, a guard that costs nothing reads 0 %, and one that costs 2 % reads 2 %; the control
    compares one load of each side, as a comparison of one build each does, and reads the offset as a cost."""
    from lab.common import copy_levels_ms, copy_spread_pct, pooled_cost_pct

    place_o = [1.000, 1.010, 1.005]  # the original's three loads
    place_g = [1.010, 1.000, 1.005]  # the same offsets, drawn in another order
    rounds = 5
    for cost in (0.0, 2.0):
        times = {
            "original": [list(place_o) for _ in range(rounds)],
            "guarded": [[x * (1 + cost / 100) for x in place_g] for _ in range(rounds)],
        }
        assert pooled_cost_pct(times, "guarded", "original") == pytest.approx([cost] * rounds, abs=1e-9)
        # The control: the first load of each carries its placement (+1 %) into the figure.
        one_load = 100 * (times["guarded"][0][0] / times["original"][0][0] - 1)
        assert one_load == pytest.approx(cost + 1.0 + cost / 100, abs=1e-9)
    assert copy_levels_ms(times["original"]) == place_o
    assert copy_spread_pct(times["original"]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="different rounds"):
        pooled_cost_pct({"a": [[1.0]], "b": [[1.0], [1.0]]}, "a", "b")
