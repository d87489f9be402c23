"""The block helpers decide whether the offender block has room the same way in every thread of a program
(tripwire.triton._room).

The claims after that decision reduce over the block and wait at barriers, so every thread must take the same
branch. The last key, which says the block is full, changes while other programs claim entries: read by every
thread with a plain scalar load, threads that read before and after a claim disagree, the claims run in some warps
and not in others, and counts come out as garbage (reductions read partials nobody wrote). Seen on the H200 with one
bad element per tile over several programs and an empty block; the interpreter runs programs one after another and
cannot show it, and compute-sanitizer's racecheck serialises the warps and hides it too.

On the GPU (``_offender_room.py``, a process of its own per case): the non-finite counter (record_hits) and
slot_mapping at a bandwidth launch (record_tiles), each launch on a fresh arena, count exactly every time. The
control: the same launches with the plain per-thread load in ``_room``'s place miscount.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("_offender_room.py")
RUNS = 20
CONTROL_RUNS = 40  # the control miscounted 20 of 20 (record_hits) and 6 of 20 (record_tiles) launches on the H200


def _run(tmp_path: Path, variant: str, case: str, runs: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / f"cache-{variant}")  # the control's kernels never reach a shared cache
    env["PYTHONPATH"] = os.pathsep.join([str(PROBE.parents[2] / "src"), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, str(PROBE), variant, case, str(runs)], capture_output=True, text=True, env=env, timeout=600
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["nonfinite", "slot_mapping"])
def test_counts_exact_while_programs_fill_the_block(tmp_path, case):
    fixed = _run(tmp_path, "fixed", case, RUNS)
    assert fixed == {"runs": RUNS, "wrong": 0, "examples": []}, fixed
    racy = _run(tmp_path, "racy", case, CONTROL_RUNS)
    assert racy["wrong"] > 0, racy
