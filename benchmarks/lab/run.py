"""The lab's suite: run the benchmark questions, write ``bench.json``, ``bench.png`` and ``results.md``.

    PYTHONPATH=benchmarks python -m lab.run [--quick] [--out DIR] [--only q2,q3] [--soak-minutes M] [--budget-s S] [--coordinate]

The questions, by label (RESULTS.md's, the JSON record's and ``--only``'s), are listed with the modules that
measure them in :mod:`lab.questions`.

Without a GPU only the questions that need none run (q3's CPU step-loop variant, q4, q5, q6), and every figure is
labelled a CPU figure. On a GPU the whole suite runs, sized to fit one device call of 10 minutes (``--quick``: a
short pass; ``--budget-s`` skips questions that would start late). The soak (q9) is short by default (60 s; 10 s
with --quick) and says so; ``--soak-minutes 10`` gives the full 10-minute soak.

The JSON is rewritten after every question, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

from .common import SCHEMA, Ctx, env_info, print_summary, skipped, write_json
from .questions import QUESTIONS, selection


def _parse(argv: list[str]) -> argparse.Namespace:
    from tripwire.cli.text import help_text

    p = argparse.ArgumentParser(prog="python -m lab.run", description=help_text(__doc__))
    p.add_argument("--quick", action="store_true", help="reduced sizes and repeats (about 2 minutes)")
    p.add_argument("--out", default="bench-out", help="output folder (default: ./bench-out)")
    p.add_argument(
        "--only", default="", help="comma-separated question ids or their modules' names, e.g. q2,q3 or tick_latency"
    )
    p.add_argument(
        "--soak-minutes", type=float, default=None, help="q9 soak length (default 1 min; 10 gives the full soak)"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip questions that would start after this many seconds (default 480, plus the soak when given)",
    )
    p.add_argument(
        "--coordinate",
        action="store_true",
        help="q3: run tripwire's variants with tripwire.distributed.coordinate() on (one rank, a local TCPStore)",
    )
    p.add_argument("--no-plot", action="store_true", help="do not draw bench.png")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only, unknown = selection(args.only)
    if unknown:
        known = sorted(q for q, _, _ in QUESTIONS)
        print(f"lab.run: unknown question(s) {sorted(unknown)}; known: {known}", file=sys.stderr)
        return 2
    if args.soak_minutes is not None and not args.soak_minutes > 0:
        print("lab.run: --soak-minutes must be > 0", file=sys.stderr)
        return 2
    budget = args.budget_s
    if budget is None:
        budget = 480.0 + (args.soak_minutes * 60 if args.soak_minutes else 0.0)
    ctx = Ctx(quick=args.quick, device=device, out=out, soak_minutes=args.soak_minutes, verbose=not args.quiet)
    ctx.extra["coordinate"] = args.coordinate

    cpu = device == "cpu"
    label = "CPU figures (no GPU: reduced suite, reader on CPU arenas)" if cpu else "GPU figures"
    print(f"lab.run: {label}; quick={args.quick}; out={out}", flush=True)
    if cpu:
        print(
            "lab.run: no CUDA device: running only the questions that need no GPU (q3 CPU variant, q4, q5, "
            "q6); their numbers are CPU figures, not H200 ones",
            flush=True,
        )

    report = {
        "schema": SCHEMA,
        "command": "python -m lab.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "device": device,
        "cpu_figures": cpu,
        "label": label,
        "soak_minutes": args.soak_minutes,
        "env": env_info(),
        "questions": {},
    }
    json_path = out / "bench.json"
    t0 = time.perf_counter()
    # Questions that run children with their own timeouts (q8's compute-sanitizer) size them to end by this time,
    # so one slow tool cannot push the whole call past the device's per-call limit.
    ctx.extra["deadline"] = t0 + budget + 60.0
    errors = 0
    for qid, modname, needs_gpu in QUESTIONS:
        if only and qid not in only:
            continue
        if needs_gpu and cpu:
            report["questions"][qid] = skipped(qid, modname, "needs a CUDA GPU (CPU run)", ctx)
            continue
        spent = time.perf_counter() - t0
        if spent > budget:
            report["questions"][qid] = skipped(qid, modname, f"time budget of {budget:.0f} s spent", ctx)
            print(f"[{qid}] skipped: time budget spent ({spent:.0f} s)", flush=True)
            continue
        print(f"[{qid}] {modname} ...", flush=True)
        tq = time.perf_counter()
        try:
            mod = importlib.import_module(modname)
            res = mod.run(ctx)
        except BrokenPipeError:
            raise  # our reader went away (`| head`): not the question's error; the command ends quietly
        except Exception as e:  # one broken question must not lose the others' figures
            errors += 1
            traceback.print_exc()
            res = skipped(qid, modname, f"{type(e).__name__}: {e}", ctx)
            res["status"] = "error"
            res["notes"] = [traceback.format_exc(limit=8)]
        res["elapsed_s"] = round(time.perf_counter() - tq, 2)
        report["questions"][qid] = res
        report["elapsed_s"] = round(time.perf_counter() - t0, 2)
        write_json(json_path, report)
        print_summary(res)
    report["elapsed_s"] = round(time.perf_counter() - t0, 2)
    write_json(json_path, report)

    from .results_md import render

    (out / "results.md").write_text(render(report))
    if not args.no_plot:
        from .plot import plot

        msg = plot(report, out / "bench.png")
        print(f"lab.run: {msg}", flush=True)
    print(f"lab.run: wrote {json_path} and {out / 'results.md'} in {report['elapsed_s']:.1f} s", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    raise SystemExit(main())
