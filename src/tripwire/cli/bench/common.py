"""The pieces ``tripwire bench``'s checks share: the run context, environment capture, statistics and the record
every check returns (the measurement lab in the repository's ``benchmarks/lab`` builds on them too).

A check module exposes ``run(ctx: Ctx) -> dict`` built with :class:`Result`. Figures carry min/median/max over their
repeats (plus p50/p99 when they are latency distributions); targets carry the figure they judge, the measured value
and a pass/short mark (``None`` when the figure could not be measured, which is never counted as a pass).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Sequence
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


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    tmp.replace(path)


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


def skipped(qid: str, modname: str, reason: str, ctx: Ctx) -> dict:
    """A question's record that carries no figures (not run, or failed: the caller sets ``status`` then)."""
    return {
        "id": qid,
        "title": modname,
        "status": "skipped",
        "reason": reason,
        "cpu_figures": not ctx.cuda,
        "device": ctx.device,
        "quick": ctx.quick,
        "figures": {},
        "targets": [],
        "notes": [],
    }


def mark(p: bool | None) -> str:
    return "PASS" if p is True else "SHORT" if p is False else "n/a"


def print_summary(res: dict) -> None:
    """One question's record as the runners print it (``tripwire bench`` and the lab's suite)."""
    tag = " [CPU figures]" if res.get("cpu_figures") else ""
    print(f"[{res['id']}] {res['title']}: {res['status']}{tag} ({res.get('elapsed_s', 0):.1f} s)", flush=True)
    if res.get("reason"):
        print(f"    {res['reason']}", flush=True)
    for key, f in res.get("figures", {}).items():
        if f.get("median") is None:
            continue
        extra = f" p99 {f['p99']:.4g}" if "p99" in f else ""
        print(
            f"    {key}: median {f['median']:.4g} {f['unit']} (min {f['min']:.4g}, max {f['max']:.4g}, n={f['n']})"
            f"{extra}",
            flush=True,
        )
    for t in res.get("targets", []):
        v = t.get("value")
        vs = "n/a" if v is None else f"{v:.4g}"
        print(f"    target {t['name']}: {t['target']} -> {vs} {mark(t['pass'])}", flush=True)
    for n in res.get("notes", []):
        print(f"    note: {n.splitlines()[0] if n else n}", flush=True)
