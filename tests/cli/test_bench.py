"""``tripwire bench``, the self-check in the package: it runs its checks on this machine (on the CPU here: Triton's
kernels interpreted), writes the JSON record (device, versions, every figure), never marks an unmeasured figure as a
pass, and refuses what moved to the measurement lab (benchmarks/lab) with where the lab is.

The end-to-end run goes through the real command line in a subprocess, so TRITON_INTERPRET is set the way
``tripwire bench`` sets it. It asserts properties, not timings, except q4's: a CPU hit is reported within the
reader's own cycle, not after the wait for offenders that never land (tests/test_testing.py holds the control).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tripwire.cli import main

FIGURE_KEYS = {"unit", "label", "n", "min", "median", "max"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    # Options before --quick on purpose: the CLI must pass them through in order.
    cmd = [sys.executable, "-m", "tripwire", "bench", "--only", "q4,q2,validator,q1", "--quick", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    data = json.loads((out / "bench.json").read_text()) if (out / "bench.json").is_file() else {}
    return p, data, out


def test_quick_bench_writes_the_json(quick_run) -> None:
    p, data, _ = quick_run
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    env = data["env"]
    for key in ("device_name", "driver", "torch", "triton", "python"):
        assert key in env
    assert env["torch"] == torch.__version__
    cpu = not torch.cuda.is_available()
    assert data["cpu_figures"] is cpu and ("CPU figures" in p.stdout) is cpu
    assert set(data["questions"]) == {"q1", "q2", "q4", "validator"}
    for q in data["questions"].values():
        assert q["status"] == "ok", q
        assert q["cpu_figures"] is cpu
        assert q["figures"]
        for f in q["figures"].values():
            assert FIGURE_KEYS <= set(f)
        for t in q["targets"]:
            assert t["figure"] in q["figures"]
            assert t["pass"] in (True, False, None)
    assert {"p50", "p99"} <= set(data["questions"]["q2"]["figures"]["tick_ms_tripwire"])
    assert data["questions"]["validator"]["figures"]["eager_host_us"]["n"] >= 3
    assert not any("counted hits" in n for n in data["questions"]["validator"]["notes"])  # clean metadata
    q1 = data["questions"]["q1"]
    assert {f"overhead_pct_{k}" for k in ("block_table", "slot_mapping", "kv_zero", "paged_gather", "rope")} <= set(
        q1["figures"]
    )
    assert not any("DIFFER" in n or "guard hits" in n for n in q1["notes"]), q1["notes"]
    assert (q1["targets"] == []) is cpu  # interpreted figures are judged against no GPU target


def test_quick_bench_q4_reports_within_the_readers_cycle(quick_run) -> None:
    """q4's hit reaches its WARNING within the reader's cycle, far below the reader's wait for offenders
    (``OFFENDERS_WAIT_S``, 250 ms): a CPU hit written without its offenders made every trial that wait."""
    _, data, _ = quick_run
    q4 = data["questions"]["q4"]
    for iv in (1, 10):
        warn = q4["figures"][f"warn_ms_{iv}ms"]
        assert warn["n"] > 0 and warn["median"] < 200.0, warn
    assert not any("expected exactly 1" in n for n in q4["notes"]), q4["notes"]  # one hit, one GuardTripped count


@pytest.mark.parametrize("option", ["--soak-minutes", "--budget-s=60", "--coordinate", "--no-plot"])
def test_the_labs_options_are_refused_naming_the_lab(tmp_path, capsys, option) -> None:
    assert main(["bench", "--quick", option, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert option.split("=")[0] in err and "benchmarks/lab" in err and "python -m lab.run" in err
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.parametrize(("only", "named"), [("q3", "q3 (step_loop)"), ("q4,soak", "q9 (soak)")])
def test_the_labs_questions_are_refused_naming_the_lab(tmp_path, capsys, only, named) -> None:
    assert main(["bench", "--only", only, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert named in err and "benchmarks/lab" in err
    assert not (tmp_path / "bench.json").exists()  # a known check writes it (the quick run above)


def test_unknown_check_is_refused(tmp_path, capsys) -> None:
    assert main(["bench", "--only", "q42", "--out", str(tmp_path)]) == 2
    assert "unknown check(s) ['q42']" in capsys.readouterr().err


def test_only_takes_labels_and_module_names() -> None:
    """``--only`` keeps the labels (RESULTS.md's and the records'); a module's name selects its check."""
    import importlib

    from tripwire.cli.bench.questions import LAB_QUESTIONS, QUESTIONS, label, selection

    assert [q for q, _, _ in QUESTIONS] == ["q4", "q2", "validator", "q1"]
    assert not set(LAB_QUESTIONS) & {q for q, _, _ in QUESTIONS}
    for qid, mod, _ in QUESTIONS:
        assert label(f"tripwire.cli.bench.{mod}") == qid
        assert callable(importlib.import_module(f"tripwire.cli.bench.{mod}").run)
    assert selection("q2, detection,validator") == ({"q2", "q4", "validator"}, set(), set())
    assert selection("") == (set(), set(), set())
    assert selection("tick_scaling,q3") == (set(), {"q5", "q3"}, set())
    assert selection("q42,q3_step_loop") == (set(), set(), {"q42", "q3_step_loop"})
    with pytest.raises(KeyError):
        label("common")  # control: a helper module measures no check


def test_the_package_holds_no_lab() -> None:
    """The lab's modules live in benchmarks/lab, not in the installed package."""
    here = Path(__import__("tripwire.cli.bench", fromlist=["x"]).__file__).parent
    assert sorted(p.stem for p in here.glob("*.py")) == [
        "__init__",
        "common",
        "detection",
        "guard_cost",
        "questions",
        "run",
        "tick_latency",
        "validator",
    ]


def test_stats_and_percentile_match_numpy() -> None:
    import numpy as np

    from tripwire.cli.bench.common import percentile, stats

    xs = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0, 7.5]
    for q in (0, 25, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    s = stats(xs, unit="ms", dist=True, scale=2.0)
    assert (s["min"], s["median"], s["max"], s["n"]) == (2.0, 8.0, 20.0, 7)
    assert s["p99"] == pytest.approx(float(np.percentile(xs, 99)) * 2)


def test_guard_cost_cases_match_the_kernel_launchers(kernel_device) -> None:
    """q1 calls every reference launcher with the bench's own arguments: shrunk to a few KB they must run under
    the interpreter (or the GPU), the guarded and unguarded outputs must agree, and valid metadata counts nothing."""
    from tripwire import Monitor, SiteRegistry
    from tripwire.cli.bench.guard_cost import build_cases

    m = Monitor(registry=SiteRegistry(capacity=64), capacity=64)
    builders = build_cases(m, kernel_device, shrink=1024)
    assert set(builders) == {"block_table", "slot_mapping", "kv_zero", "paged_gather", "state_copy", "rope"}
    for name, build in builders.items():
        case = build()
        case.guarded()
        case.unguarded()
        assert case.nbytes > 0
        if case.check is not None:
            assert case.check(), name
    assert int(m.read_rows(kernel_device)[:, 0].sum()) == 0
