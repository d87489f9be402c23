"""``tripwire bench``: a self-check of this machine, in about a minute: what tripwire costs here.

    tripwire bench [--quick] [--out DIR] [--only q4,validator] [--quiet]

The checks, by label (RESULTS.md's, the JSON record's and ``--only``'s; :mod:`tripwire.cli.bench.questions`):
q4 the detection latency (a hit to its WARNING and to GuardTripped, reader at 1, 10 and 50 ms), q2 the reader's
tick, ``validator`` one metadata validator call, q1 the guard cost of the reference kernels against their unguarded
twins. It writes ``DIR/bench.json`` (rewritten after every check, so a run cut short still leaves what it measured).

Without a GPU every check runs on the CPU, Triton's kernels in its interpreter, and every figure is labelled a CPU
figure. The research questions (the step loop, the soak, the other tools, ...) are the measurement lab's, in the
repository's ``benchmarks/lab``.
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
from .questions import LAB_COMMAND, LAB_QUESTIONS, QUESTIONS, selection

# The options of the research suite that moved to the lab, with what each was for.
LAB_OPTIONS = {
    "--soak-minutes": "the q9 soak's length",
    "--budget-s": "the research suite's time budget",
    "--coordinate": "q3 with tripwire.distributed.coordinate()",
    "--no-plot": "the research suite's plot (bench.png)",
}


def _parse(argv: list[str]) -> argparse.Namespace:
    from ..text import help_text

    p = argparse.ArgumentParser(prog="tripwire bench", description=help_text(__doc__))
    p.add_argument("--quick", action="store_true", help="fewer repeats and trials (well under a minute)")
    p.add_argument("--out", default="bench-out", help="output folder (default: ./bench-out)")
    p.add_argument("--only", default="", help="comma-separated check ids or their modules' names, e.g. q4,validator")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def _lab_option(argv: list[str]) -> str | None:
    """The first option of ``argv`` that the lab took over, or None."""
    for a in argv:
        name = a.split("=", 1)[0]
        if name in LAB_OPTIONS:
            return name
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    moved = _lab_option(argv)
    if moved is not None:
        print(
            f"tripwire bench: {moved} ({LAB_OPTIONS[moved]}) belongs to the measurement lab, which is not part of the "
            f"installed package: run {LAB_COMMAND}",
            file=sys.stderr,
        )
        return 2
    args = _parse(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    only, lab, unknown = selection(args.only)
    if lab:
        names = ", ".join(f"{q} ({LAB_QUESTIONS[q]})" for q in sorted(lab))
        print(
            f"tripwire bench: {names}: the measurement lab's, not this self-check's: run {LAB_COMMAND}", file=sys.stderr
        )
        return 2
    if unknown:
        known = [q for q, _, _ in QUESTIONS]
        print(f"tripwire bench: unknown check(s) {sorted(unknown)}; known: {known}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(quick=args.quick, device=device, out=out, verbose=not args.quiet)
    cpu = device == "cpu"
    label = "CPU figures (no GPU: Triton's kernels interpreted, reader on CPU arenas)" if cpu else "GPU figures"
    print(f"tripwire bench: {label}; quick={args.quick}; out={out}", flush=True)
    report = {
        "schema": SCHEMA,
        "command": "tripwire bench " + " ".join(argv),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "device": device,
        "cpu_figures": cpu,
        "label": label,
        "env": env_info(),
        "questions": {},
    }
    json_path = out / "bench.json"
    t0 = time.perf_counter()
    errors = 0
    for qid, modname, needs_gpu in QUESTIONS:
        if only and qid not in only:
            continue
        if needs_gpu and cpu:
            report["questions"][qid] = skipped(qid, modname, "needs a CUDA GPU (CPU run)", ctx)
            continue
        print(f"[{qid}] {modname} ...", flush=True)
        tq = time.perf_counter()
        try:
            mod = importlib.import_module(f"{__package__}.{modname}")
            res = mod.run(ctx)
        except BrokenPipeError:
            raise  # our reader went away (`| head`): not the check's error; the command ends quietly
        except Exception as e:  # one broken check must not lose the others' figures
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
    print(f"tripwire bench: wrote {json_path} in {report['elapsed_s']:.1f} s", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    raise SystemExit(main())
