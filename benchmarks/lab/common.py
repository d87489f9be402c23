"""The lab's shared pieces: ``tripwire bench``'s record and statistics (:mod:`tripwire.cli.bench.common`) and the
GPU timing helpers (:mod:`tripwire.testing.timing`), re-exported here so a question or a script takes them from one
place, and what only the lab uses (children in process groups, a scheduler-like spin, RSS, one-load comparisons).

A question module exposes ``run(ctx: Ctx) -> dict`` built with :class:`Result`.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import tripwire
from tripwire.cli.bench.common import (
    SCHEMA,
    Ctx,
    Result,
    env_info,
    percentile,
    print_summary,
    single,
    skipped,
    sleep_cycles_per_ms,
    stats,
    write_json,
)
from tripwire.testing.timing import (
    capture,
    d2d_copy_ms,
    do_bench_ms,
    jit_copy,
    paired_replay_ms,
    pooled_cost_pct,
    pooled_ms,
    pooled_replay_ms,
    warm_up,
)

__all__ = [
    "SCHEMA",
    "Ctx",
    "Result",
    "calibrate_spin",
    "capture",
    "copy_levels_ms",
    "copy_spread_pct",
    "cuda_event_times_ms",
    "d2d_copy_ms",
    "do_bench_ms",
    "env_info",
    "finish",
    "jit_copy",
    "one_load_pct",
    "paired_replay_ms",
    "percentile",
    "pooled_cost_pct",
    "pooled_ms",
    "pooled_replay_ms",
    "print_summary",
    "python",
    "rss_mib",
    "run_child",
    "single",
    "skipped",
    "sleep_cycles_per_ms",
    "stats",
    "subprocess_env",
    "warm_up",
    "write_json",
]

# The folder holding the ``lab`` package: a question run as a child (``python -m lab.<question>``) needs it on its
# path, as it needs the folder holding this tripwire.
LAB_ROOT = Path(__file__).resolve().parents[1]


def finish(res: dict, out: Path | None) -> int:
    """The end of a standalone guard benchmark: one line per target, then the JSON to ``out`` (or stdout)."""
    for t in res.get("targets", []):
        print(f"{t['name']}: {t['target']}: {t['value']:.2f} {'PASS' if t['pass'] else 'SHORT'}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2) + "\n")
    else:
        print(json.dumps(res, indent=2))
    return 0


def cuda_event_times_ms(fn: Callable[[], Any], reps: int, warmup: int = 3) -> list[float]:
    """Per-call GPU times (ms) of ``fn`` with CUDA events, after ``warmup`` calls. One event pair per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def one_load_pct(times: dict[str, list[list[float]]], num: str, den: str) -> list[float]:
    """Per round, the first load of ``num`` over the first of ``den``, in percent: what a comparison of one build
    of each side measures (placement draw included), reported beside :func:`pooled_cost_pct`."""
    return [100.0 * (a[0] / b[0] - 1.0) for a, b in zip(times[num], times[den], strict=True)]


def copy_levels_ms(times: list[list[float]]) -> list[float]:
    """Each copy's median over the rounds (``times``: one variant's rounds from :func:`pooled_replay_ms`): the
    levels the placements give the same code."""
    return [statistics.median(r[i] for r in times) for i in range(len(times[0]))]


def copy_spread_pct(times: list[list[float]]) -> float:
    """How far apart the copies' levels are: the slowest over the fastest, in percent."""
    levels = copy_levels_ms(times)
    return 100.0 * (max(levels) / min(levels) - 1.0)


def calibrate_spin(target_us: float) -> Callable[[], list[int]]:
    """A pure-Python, scheduler-like workload (build per-request metadata lists and dicts) sized to take about
    ``target_us`` on this CPU; it returns the flat slot list it built. Sizing is measured, not assumed."""

    def make(n: int) -> Callable[[], list[int]]:
        def work() -> list[int]:
            # What a scheduler does per step: walk requests, extend block tables, build flat metadata lists.
            reqs: list[dict[str, Any]] = [
                {"id": i, "len": 100 + i, "blocks": [i * 4 + j for j in range(4)]} for i in range(n)
            ]
            slots: list[int] = []
            positions: list[int] = []
            for r in reqs:
                r["len"] += 1
                if r["len"] % 16 == 0:
                    r["blocks"].append(len(r["blocks"]))
                slots.append(r["blocks"][-1] * 16 + r["len"] % 16)
                positions.append(r["len"])
            return slots if positions else []

        return work

    n = 8
    while True:
        work = make(n)
        t = min(_time_once(work) for _ in range(5))
        if t * 1e6 >= target_us or n > 1 << 16:
            break
        n = max(n + 1, int(n * min(4.0, target_us / max(t * 1e6, 1.0))))
    return work


def _time_once(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rss_mib() -> float:
    """Resident set size now (MiB), from /proc when available (ru_maxrss is a peak, not a level)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def subprocess_env() -> dict[str, str]:
    """The environment for a child Python (``python -m lab.<question>``): the folder holding ``lab`` and the one
    holding this tripwire (a checkout's ``src``, or site-packages) first on its path."""
    env = dict(os.environ)
    pkg = str(Path(tripwire.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([str(LAB_ROOT), pkg, *filter(None, [env.get("PYTHONPATH")])])
    return env


def python() -> str:
    return sys.executable


def run_child(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group; on timeout kill the whole group (a tool such as compute-sanitizer
    runs the Python child as its own child, which must not outlive it holding the GPU). Returns (exit code or
    None on timeout, the tail of stdout+stderr)."""
    import signal

    p = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = p.communicate(timeout=max(timeout, 1.0))
        return p.returncode, (out or "")[-4000:]
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        out, _ = p.communicate()
        return None, f"timed out after {timeout:.0f} s; " + (out or "")[-2000:]
