"""Shared pieces of the benchmark suite: the run context, environment capture, statistics, timers, and the
result record every question returns.

A question module exposes ``run(ctx: Ctx) -> dict`` built with :class:`Result`. Figures always carry
min/median/max over their repeats (plus p50/p99 when they are latency distributions); targets carry the figure
they judge, the measured value and a pass/short mark (``None`` when the figure could not be measured, which is
never counted as a pass).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SCHEMA = 1


@dataclass
class Ctx:
    """What a question needs to know about the run."""

    quick: bool
    device: str  # "cuda" or "cpu"
    out: Path
    soak_minutes: float | None = None  # None: the suite's short default
    verbose: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def log(self, msg: str) -> None:
        if self.verbose:
            print(f"  {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------- environment
def _driver_version() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return lines[0] if lines else None


def env_info() -> dict[str, Any]:
    """Versions and the device: what a reader of the JSON needs to reproduce or compare the figures."""
    import numpy as np
    import triton

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "numpy": np.__version__,
        "cpu_count": os.cpu_count(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        import tripwire

        info["tripwire"] = tripwire.__version__
    except ImportError:
        info["tripwire"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device_name=props.name,
            device_count=torch.cuda.device_count(),
            sm_count=props.multi_processor_count,
            device_memory_gib=round(props.total_memory / 2**30, 1),
            cuda_runtime=torch.version.cuda,
            driver=_driver_version(),
        )
    else:
        info.update(device_name=f"CPU ({platform.processor() or platform.machine()})", driver=None, cuda_runtime=None)
    return info


# ---------------------------------------------------------------------------------------------------- statistics
def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]."""
    if not xs:
        raise ValueError("percentile of no samples")
    s = sorted(xs)
    if len(s) == 1:
        return float(s[0])
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def stats(xs: Sequence[float], *, unit: str, label: str = "", dist: bool = False, scale: float = 1.0) -> dict:
    """min/median/max (and p50/p99 for a latency distribution) of ``xs * scale``."""
    vals = [float(x) * scale for x in xs]
    if not vals:
        return {"unit": unit, "label": label, "n": 0, "min": None, "median": None, "max": None}
    out = {
        "unit": unit,
        "label": label,
        "n": len(vals),
        "min": min(vals),
        "median": statistics.median(vals),
        "max": max(vals),
    }
    if dist:
        out["p50"] = percentile(vals, 50)
        out["p99"] = percentile(vals, 99)
    return out


def single(value: float | None, *, unit: str, label: str = "") -> dict:
    """A figure that is one number (a count, a ratio computed from medians)."""
    return {
        "unit": unit,
        "label": label,
        "n": 1 if value is not None else 0,
        "min": value,
        "median": value,
        "max": value,
    }


# ---------------------------------------------------------------------------------------------------- results
class Result:
    """The record one question returns (``.to_dict()``)."""

    def __init__(self, qid: str, title: str, ctx: Ctx) -> None:
        self.qid = qid
        self.title = title
        self.ctx = ctx
        self.figures: dict[str, dict] = {}
        self.targets: list[dict] = []
        self.notes: list[str] = []
        self.status = "ok"
        self.reason = ""
        self.cpu_figures = not ctx.cuda
        self._t0 = time.perf_counter()

    def fig(self, key: str, figure: dict) -> dict:
        self.figures[key] = figure
        return figure

    def target(
        self, name: str, figure: str, text: str, value: float | None, passed: bool | None, why: str = ""
    ) -> None:
        """``passed`` None means "not measured" (shown as n/a, never as a pass)."""
        self.targets.append(
            {"name": name, "figure": figure, "target": text, "value": value, "pass": passed, "why": why}
        )

    def note(self, text: str) -> None:
        self.notes.append(text)

    def skip(self, reason: str) -> dict:
        self.status = "skipped"
        self.reason = reason
        return self.to_dict()

    def to_dict(self) -> dict:
        return {
            "id": self.qid,
            "title": self.title,
            "status": self.status,
            "reason": self.reason,
            "cpu_figures": self.cpu_figures,
            "device": self.ctx.device,
            "quick": self.ctx.quick,
            "figures": self.figures,
            "targets": self.targets,
            "notes": self.notes,
            "elapsed_s": round(time.perf_counter() - self._t0, 2),
        }


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


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------------- graphs
def warm_up(body: Callable[[], Any], calls: int = 3) -> None:
    """Run ``body`` ``calls`` times on a side stream and wait for it: Triton compiles, cuBLAS handles and the
    caching allocator's first blocks are made here, outside any capture (PyTorch's own warm-up recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(calls):
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture(body: Callable[[], Any], *, warm: int = 3, repeat: int = 1) -> torch.cuda.CUDAGraph:
    """``body`` warmed up (:func:`warm_up`), then captured ``repeat`` times back to back in one CUDA graph."""
    warm_up(body, warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            body()
    torch.cuda.synchronize()
    return graph


# ---------------------------------------------------------------------------------------------------- timing
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


def do_bench_ms(fn: Callable[[], Any], *, rep_ms: int = 100, warmup_ms: int = 25) -> float:
    """``triton.testing.do_bench`` median (ms): it flushes L2 between calls and warms up first."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def d2d_copy_ms(n: int, repeats: int, rep_ms: int) -> list[float]:
    """``repeats`` do_bench medians (ms) of a device-to-device copy of ``n`` bytes: the bandwidth reference (read
    + write bytes per second) of the guard-cost benchmarks. Frees its buffers before returning."""
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = [do_bench_ms(lambda: dst.copy_(src), rep_ms=rep_ms) for _ in range(repeats)]
    src = dst = None  # type: ignore[assignment]  # free the buffers before the kernels' cases
    torch.cuda.empty_cache()
    return times


def paired_replay_ms(
    bodies: dict[str, Callable[[], Any]], *, per_graph: int, repeats: int, rep_ms: int
) -> dict[str, list[float]]:
    """Per-call GPU time (ms) of each body, graph-replayed: each is captured ``per_graph`` times back to back in one
    CUDA graph (so Python's launch overhead is not measured), then every repeat times every graph with do_bench,
    in an order that alternates between repeats (drift -- clocks, temperature -- hits every body alike). Returns
    ``repeats`` samples per body, each a median over do_bench's runs divided by ``per_graph``."""
    rounds = pooled_replay_ms({n: [b] for n, b in bodies.items()}, per_graph=per_graph, repeats=repeats,
                              rep_ms=rep_ms)  # fmt: skip
    return {n: [copies[0] for copies in r] for n, r in rounds.items()}


# ------------------------------------------------------------------------------------------ code placement
# Where a kernel's code lands in device memory moves its time: the same binary, loaded as K separate modules (each
# one graph), times as K persistent levels a few tenths of a percent apart (benchmarks/RESULTS.md, "Where the code
# lands"), as large as the costs a 1 % target judges. A comparison of one load of each side measures the guard plus
# one draw of that offset; the pooled comparison below measures each side over K loads.
def jit_copy(fn: Any) -> Any:
    """A new ``triton.JITFunction`` of ``fn``'s Python function with ``fn``'s options: it compiles to the same binary
    (from Triton's cache) but keeps its own compiled kernels, each loaded as a module of its own, so its code sits at
    another address than ``fn``'s. Under the interpreter (nothing is compiled or loaded) a new interpreted function
    of the same Python function and options."""
    import triton
    import triton.runtime.jit as triton_jit

    given = getattr(fn, "kwargs", None)
    if isinstance(given, dict):
        copy = triton.jit(fn.fn, **given)  # the interpreter's function keeps its options as they were given
    else:
        copy = triton.jit(
            fn.fn,
            version=fn.version,
            repr=fn._repr,
            launch_metadata=fn.launch_metadata,
            do_not_specialize=list(fn.do_not_specialize),
            do_not_specialize_on_alignment=list(fn.do_not_specialize_on_alignment),
            debug=fn.debug,
            noinline=fn.noinline,
        )
    # Triton 3.9 registers every JITFunction under its module and name, the last one made winning: the copy must not
    # take the original's entry.
    registry = getattr(triton_jit, "_triton_jit_function_registry", None)
    key = f"{fn.fn.__module__}:{fn.fn.__qualname__}"
    if isinstance(registry, dict) and registry.get(key) is copy:
        registry[key] = fn
    return copy


def pooled_replay_ms(
    bodies: Mapping[str, Sequence[Callable[[], Any]]], *, per_graph: int, repeats: int, rep_ms: int
) -> dict[str, list[list[float]]]:
    """:func:`paired_replay_ms` over copies of the code: each variant is a list of bodies that run the same code
    loaded again (:func:`jit_copy`, a module imported again), each captured in a graph of its own. Every round times
    every graph, the variants' copies interleaved (each variant's copy 0, then each one's copy 1, ...), in an order
    that alternates between rounds. Returns, per variant, ``repeats`` rounds of one per-call time (ms) per copy."""
    width = {len(v) for v in bodies.values()}
    if not bodies or 0 in width:
        raise ValueError("pooled_replay_ms: every variant needs at least one body")
    order = [(n, i) for i in range(max(width)) for n in bodies if i < len(bodies[n])]
    graphs = {key: capture(bodies[key[0]][key[1]], warm=2, repeat=per_graph) for key in order}
    out: dict[str, list[list[float]]] = {n: [[0.0] * len(v) for _ in range(repeats)] for n, v in bodies.items()}
    for r in range(repeats):
        for n, i in order if r % 2 == 0 else order[::-1]:
            out[n][r][i] = do_bench_ms(graphs[(n, i)].replay, rep_ms=rep_ms) / per_graph
    return out


def pooled_cost_pct(times: dict[str, list[list[float]]], num: str, den: str) -> list[float]:
    """Per round, ``num`` over ``den`` in percent, each side the median of its copies' times (``times`` from
    :func:`pooled_replay_ms`). The figure is the median of these rounds; their spread is the round-to-round noise."""
    if len(times[num]) != len(times[den]):
        raise ValueError(f"{num} and {den} were timed over different rounds")
    return [100.0 * (statistics.median(a) / statistics.median(b) - 1.0) for a, b in zip(times[num], times[den],
                                                                                     strict=True)]  # fmt: skip


def pooled_ms(times: list[list[float]]) -> float:
    """One variant's time (ms): the median over rounds of its copies' median (``times``: its rounds from
    :func:`pooled_replay_ms`)."""
    return statistics.median(statistics.median(r) for r in times)


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


def sleep_cycles_per_ms() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on this GPU (measured, not the nominal clock)."""
    cycles = 20_000_000
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(cycles)
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e))
    return cycles / best


def subprocess_env() -> dict[str, str]:
    """The environment for a child Python (``python -m tripwire.cli.bench.<question>``) that must import this
    tripwire: the folder holding the package first on its path (a checkout's ``src``, or site-packages)."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
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
