"""A reference kernel given CPU tensors in a process that compiles Triton for a GPU: a clear error saying what to do
(Triton's own is "0 active drivers"); the control: under the interpreter the same call runs and counts."""

from __future__ import annotations

import os
import subprocess
import sys

CALL = """
import torch
from tripwire.kernels import paged_gather as pg
cache, table = torch.randn(64, 16), torch.randint(0, 64, (8, 4))
table[1, 2] = 4096
out = torch.empty(8, 4, 16)
pg.paged_gather(cache, table, out)
import tripwire
print("counted", tripwire.drain()[("cpu", "kernels.paged_gather.page")].count)
"""


def _call(interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("TRIPWIRE_")}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", CALL], capture_output=True, text=True, env=env, timeout=300)


def test_cpu_tensors_without_the_interpreter_get_a_clear_error():
    p = _call(interpret=False)
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: cache is on the CPU") and "set TRITON_INTERPRET=1" in last, p.stderr[-2000:]
    assert "active drivers" not in p.stderr


def test_control_under_the_interpreter_the_call_runs_and_counts():
    p = _call(interpret=True)
    assert p.returncode == 0 and "counted 1" in p.stdout, p.stderr[-2000:]


def test_recorded_launches_take_cpu_tensors_without_the_interpreter():
    """`tripwire resources` records launches instead of running them (to compile them for a GPU target): there the
    same CPU call is recorded, not refused."""
    code = """
import torch
from tripwire.kernels import paged_gather as pg
from tripwire.resources import capture_launches
cache, table, out = torch.randn(64, 16), torch.randint(0, 64, (8, 4), dtype=torch.int32), torch.empty(8, 4, 16)
print("recorded", [launch.name for launch in capture_launches(lambda: pg.paged_gather(cache, table, out))])
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("TRIPWIRE_")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and "recorded ['_paged_gather']" in p.stdout, p.stderr[-2000:]


def test_the_launchers_ask_whether_triton_interprets_at_each_call(triton_interpret):
    """Which of the two above a call gets is decided at the call, from Triton's own setting (``TRITON_INTERPRET``,
    which Triton 3.4 and later hold as ``triton.knobs.runtime.interpret``): turned off in a process whose kernels
    were imported interpreted, the same CPU call is refused while it is off and runs once it is back on, twice over.
    The control is the call itself, refused and run on one process's kernels: a launcher that read the setting once
    (at its import) would run every time, or refuse every time."""
    import pytest
    import torch

    from tripwire.kernels import paged_gather as pg

    if not triton_interpret():
        pytest.skip("in-process under the interpreter (CI's); the subprocess tests above cover a compiling process")
    cache, table, out = torch.randn(64, 16), torch.randint(0, 64, (8, 4)), torch.empty(8, 4, 16)
    for _ in range(2):
        triton_interpret(False)
        with pytest.raises(RuntimeError, match="cache is on the CPU"):
            pg.paged_gather(cache, table, out)
        triton_interpret(True)
        pg.paged_gather(cache, table, out)  # runs: read again at this call
