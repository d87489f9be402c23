"""Draw ``bench.png`` from a bench report: one panel per question that has figures to show.

    python -m lab.plot BENCH_JSON [OUT_PNG]

matplotlib is optional (``pip install tripwire[bench]``): without it the plot is skipped with a message, never an
error.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path


def _figs(report: dict, qid: str) -> dict:
    q = report.get("questions", {}).get(qid)
    if not q or q.get("status") != "ok":
        return {}
    return q.get("figures", {})


def _bar(ax, labels: list[str], values: list[float], errs: list[tuple[float, float]] | None, ylabel: str) -> None:  # type: ignore[no-untyped-def]
    x = range(len(labels))
    if errs:
        lo = [max(v - e[0], 0) for v, e in zip(values, errs, strict=True)]
        hi = [max(e[1] - v, 0) for v, e in zip(values, errs, strict=True)]
        ax.bar(x, values, yerr=[lo, hi], capsize=3, color="#4477aa")
    else:
        ax.bar(x, values, color="#4477aa")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel, fontsize=8)


def _q1(ax, f: dict) -> bool:  # type: ignore[no-untyped-def]
    keys = [k for k in f if k.startswith("overhead_pct_")]
    if not keys:
        return False
    vals = [f[k]["median"] for k in keys]
    _bar(ax, [k.removeprefix("overhead_pct_") for k in keys], vals, None, "guarded vs unguarded (%)")
    ax.axhline(1.0, color="red", lw=0.8, ls="--", label="1 % target")
    ax.legend(fontsize=7)
    ax.set_title("q1 guard cost", fontsize=9)
    return True


def _q2(ax, f: dict) -> bool:  # type: ignore[no-untyped-def]
    if "tick_ms_tripwire" not in f or "tick_ms_sync" not in f:
        return False
    labels, vals = [], []
    for name, key in (("tripwire", "tick_ms_tripwire"), ("sync .tolist()", "tick_ms_sync")):
        for p in ("p50", "p99"):
            labels.append(f"{name} {p}")
            vals.append(max(f[key][p], 1e-4))
    _bar(ax, labels, vals, None, "tick latency (ms)")
    ax.set_yscale("log")
    ax.axhline(1.0, color="red", lw=0.8, ls="--")
    ax.set_title("q2 reader tick, busy compute stream", fontsize=9)
    return True


def _q3(ax, f: dict) -> bool:  # type: ignore[no-untyped-def]
    keys = [k for k in f if k.startswith("step_us_")]
    if not keys:
        return False
    vals = [f[k]["median"] for k in keys]
    errs = [(f[k]["min"], f[k]["max"]) for k in keys]
    _bar(ax, [k.removeprefix("step_us_") for k in keys], vals, errs, "mean step time (us)")
    lo = min(e[0] for e in errs)
    hi = max(e[1] for e in errs)
    ax.set_ylim(lo * 0.98, hi * 1.02)
    ax.set_title("q3 engine-like step loop", fontsize=9)
    return True


def _q4(ax, f: dict) -> bool:  # type: ignore[no-untyped-def]
    ivs = sorted({int(k.rsplit("_", 1)[1].removesuffix("ms")) for k in f if k.startswith("warn_ms_")})
    if not ivs:
        return False
    for kind, mk in (("warn_ms_", "o"), ("raise_ms_", "s")):
        xs = [i for i in ivs if f"{kind}{i}ms" in f]
        ax.errorbar(
            xs,
            [f[f"{kind}{i}ms"]["median"] for i in xs],
            yerr=[
                [f[f"{kind}{i}ms"]["median"] - f[f"{kind}{i}ms"]["min"] for i in xs],
                [f[f"{kind}{i}ms"]["max"] - f[f"{kind}{i}ms"]["median"] for i in xs],
            ],
            marker=mk,
            capsize=3,
            label="to WARNING" if kind == "warn_ms_" else "to GuardTripped",
        )
    ax.plot(ivs, [2 * i + 5 for i in ivs], "r--", lw=0.8, label="2 intervals + 5 ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("reader interval (ms)", fontsize=8)
    ax.set_ylabel("detection latency (ms)", fontsize=8)
    ax.legend(fontsize=7)
    ax.set_title("q4 detection latency", fontsize=9)
    return True


def _q5(ax, f: dict) -> bool:  # type: ignore[no-untyped-def]
    rows = sorted(int(k.rsplit("_", 1)[1]) for k in f if k.startswith("tick_wall_us_"))
    if not rows:
        return False
    ax.plot(rows, [f[f"tick_wall_us_{n}"]["p50"] for n in rows], "o-", label="wall p50")
    ax.plot(rows, [f[f"tick_wall_us_{n}"]["p99"] for n in rows], "^-", label="wall p99")
    ax.plot(rows, [f[f"tick_cpu_us_{n}"]["p50"] for n in rows], "s-", label="thread CPU p50")
    ax.axhline(50, color="red", lw=0.8, ls="--", label="50 us")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows", fontsize=8)
    ax.set_ylabel("tick (us)", fontsize=8)
    ax.legend(fontsize=7)
    ax.set_title("q5 tick vs rows (1 copy/tick)", fontsize=9)
    return True


def _q6(ax, f: dict) -> bool:  # type: ignore[no-untyped-def]
    keys = [("active", "copies_per_s_active"), ("idle", "copies_per_s_idle"), ("resumed", "copies_per_s_resumed")]
    if not all(k in f for _, k in keys):
        return False
    _bar(ax, [n for n, _ in keys], [f[k]["median"] for _, k in keys], None, "copies / s")
    ax.set_title("q6 idle tail", fontsize=9)
    return True


PANELS: list[tuple[str, Callable]] = [("q1", _q1), ("q2", _q2), ("q3", _q3), ("q4", _q4), ("q5", _q5), ("q6", _q6)]


def plot(report: dict, path: Path) -> str:
    """Write the PNG; return what happened (for the run's log)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: plot skipped (pip install matplotlib, then run python -m lab.plot)"
    todo = [(q, fn) for q, fn in PANELS if _figs(report, q)]
    if not todo:
        return "no question with plottable figures: plot skipped"
    cols = min(3, len(todo))
    rows = (len(todo) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
    drawn = 0
    for (q, fn), ax in zip(todo, axes.flat, strict=False):
        if fn(ax, _figs(report, q)):
            drawn += 1
        else:
            ax.set_visible(False)
    for ax in list(axes.flat)[len(todo) :]:
        ax.set_visible(False)
    env = report.get("env", {})
    kind = "CPU figures" if report.get("cpu_figures") else "GPU figures"
    fig.suptitle(
        f"tripwire bench ({kind}): {env.get('device_name')}, torch {env.get('torch')}, triton {env.get('triton')}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path} ({drawn} panels)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: plot.py BENCH_JSON [OUT_PNG]", file=sys.stderr)
        return 2
    src = Path(argv[0])
    dst = Path(argv[1]) if len(argv) > 1 else src.with_suffix(".png")
    print(plot(json.loads(src.read_text()), dst))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
