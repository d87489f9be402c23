"""The ``tripwire`` command line: ``sites`` into a closed pipe, ``bench`` outside a checkout, ``doctor``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tripwire.cli import bench_dir

REPO = Path(__file__).resolve().parents[1]


def _into_closed_pipe(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` with its stdout a pipe whose reader is already gone (what ``| head`` leaves behind)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(cmd, stdout=w, stderr=subprocess.PIPE, text=True, timeout=300, check=False)
    finally:
        os.close(w)


def test_sites_into_a_closed_pipe_ends_quietly():
    out = _into_closed_pipe([sys.executable, "-m", "tripwire", "sites"])
    assert out.returncode == 0 and "BrokenPipeError" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_control_a_plain_print_into_a_closed_pipe_raises():
    out = _into_closed_pipe([sys.executable, "-c", "print('x' * 100_000)"])
    assert "BrokenPipeError" in out.stderr


def test_sites_lists_the_sites():
    out = subprocess.run([sys.executable, "-m", "tripwire", "sites"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "numerics.fp8_cache.slot" in out.stdout and "FATAL" in out.stdout


# ---------------------------------------------------------------------------------------------------- bench
def test_the_bench_is_found_in_a_source_checkout():
    d, why = bench_dir()
    assert d == REPO / "benchmarks" and why == ""


def test_an_installed_copy_says_where_the_bench_is(tmp_path):
    pkg = tmp_path / "lib" / "python3.11" / "site-packages" / "tripwire"
    pkg.mkdir(parents=True)
    (tmp_path / "lib" / "python3.11" / "benchmarks").mkdir()  # a stray folder of that name is not the suite
    d, why = bench_dir(pkg)
    assert d is None and "not run from a source checkout" in why and "pip install -e" in why
    assert "TRIPWIRE_BENCH_DIR" in why


def test_a_bad_bench_dir_variable_is_named(tmp_path):
    env = dict(os.environ, TRIPWIRE_BENCH_DIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-m", "tripwire", "bench", "--quick"], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 2 and f"TRIPWIRE_BENCH_DIR={str(tmp_path)!r} has no run_all.py" in out.stderr


# ---------------------------------------------------------------------------------------------------- doctor
def doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TRIPWIRE_")}
    e.update(env)
    return subprocess.run(
        [sys.executable, "-m", "tripwire", "doctor", *args], capture_output=True, text=True, env=e, timeout=300
    )


def checks(out: subprocess.CompletedProcess) -> dict[str, dict]:
    return {c["name"]: c for c in json.loads(out.stdout)}


def test_doctor_runs_here_and_says_what_would_not_work():
    out = doctor()
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    for name in ("versions", "settings", "CUDA", "capture-mode relax", "native tick", "compute-sanitizer", "sinks"):
        assert f"] {name}" in text, name
    c = checks(doctor("--json"))
    assert c["native tick"]["status"] == "ok" and "engaged" in c["native tick"]["found"]
    import torch

    if not torch.cuda.is_available():
        assert c["CUDA"]["status"] == "warn" and "TRITON_INTERPRET" in c["CUDA"]["consequence"]


def test_doctor_fails_on_a_broken_setting():
    out = doctor(TRIPWIRE_MODE="loud")
    assert out.returncode == 1 and "[FAIL] settings: TRIPWIRE_MODE='loud' is not a mode" in out.stdout


def test_doctor_says_when_the_native_tick_cannot_be_built(tmp_path):
    c = checks(doctor("--json", CC=str(tmp_path / "no-cc"), XDG_CACHE_HOME=str(tmp_path)))
    nt = c["native tick"]
    assert (
        nt["status"] == "warn" and "cannot be built" in nt["found"] and "holding the engine's GIL" in nt["consequence"]
    )


def test_doctor_fails_on_an_unwritable_event_log(tmp_path):
    (tmp_path / "plain").write_text("")
    c = checks(doctor("--json", TRIPWIRE_EVENT_LOG=str(tmp_path / "plain" / "e.jsonl")))
    assert c["sinks"]["status"] == "fail" and "event log cannot be opened" in c["sinks"]["consequence"]


@pytest.mark.gpu
def test_doctor_on_a_gpu_finds_cuda_the_relax_and_the_native_tick():
    c = checks(doctor("--json"))
    assert c["CUDA"]["status"] == "ok" and "fast path" in c["CUDA"]["found"]
    assert c["capture-mode relax"]["status"] == "ok"
    assert c["native tick"]["status"] == "ok"
