"""The ``tripwire`` command line: ``sites`` into a closed pipe, ``bench`` outside a checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
