"""Render ``bench.json`` as Markdown tables, and splice them into ``benchmarks/RESULTS.md``.

    python benchmarks/results_md.py BENCH_JSON                     # print the tables
    python benchmarks/results_md.py BENCH_JSON --update RESULTS.md  # replace the GPU (or CPU) section in place

The section replaced is the one between ``<!-- BEGIN GPU RESULTS -->`` and ``<!-- END GPU RESULTS -->`` for a GPU
run, or ``<!-- BEGIN CPU RESULTS -->`` / ``<!-- END CPU RESULTS -->`` for a CPU run (``cpu_figures`` in the JSON),
so the H200 figures and the CPU figures never overwrite each other.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MARKERS = {
    False: ("<!-- BEGIN GPU RESULTS -->", "<!-- END GPU RESULTS -->"),
    True: ("<!-- BEGIN CPU RESULTS -->", "<!-- END CPU RESULTS -->"),
}


def _num(v: float | None) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v)
    if v == int(v) and abs(v) < 1e9:
        return str(int(v))
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _mark(p: bool | None) -> str:
    return "**PASS**" if p is True else "**SHORT**" if p is False else "n/a"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_question(q: dict) -> str:
    tag = " (CPU figures)" if q.get("cpu_figures") else ""
    lines = [f"### {q['id']}. {q['title']}{tag}", ""]
    if q.get("status") != "ok":
        lines += [f"*{q.get('status', '?')}*: {_cell(q.get('reason', ''))}", ""]
        if not q.get("figures"):
            return "\n".join(lines)
    if q.get("targets"):
        lines += ["| target | measured | mark | note |", "|---|---|---|---|"]
        for t in q["targets"]:
            fig = q.get("figures", {}).get(t.get("figure"), {})
            unit = fig.get("unit", "")
            lines.append(
                f"| {_cell(t['name'])}: {_cell(t['target'])} | {_num(t.get('value'))} {unit} | {_mark(t.get('pass'))} "
                f"| {_cell(t.get('why', ''))} |"
            )
        lines.append("")
    figs = q.get("figures", {})
    if figs:
        lines += ["| figure | median | min | max | p99 | n |", "|---|---|---|---|---|---|"]
        for key, f in figs.items():
            label = f.get("label") or key
            unit = f.get("unit", "")
            lines.append(
                f"| {_cell(label)} ({unit}) | {_num(f.get('median'))} | {_num(f.get('min'))} | {_num(f.get('max'))} "
                f"| {_num(f.get('p99')) if 'p99' in f else ''} | {f.get('n', '')} |"
            )
        lines.append("")
    for n in q.get("notes", []):
        first = n.strip().splitlines()[0] if n.strip() else ""
        if first:
            lines.append(f"- {_cell(first)}")
    if q.get("notes"):
        lines.append("")
    return "\n".join(lines)


def render(report: dict) -> str:
    env = report.get("env", {})
    cpu = report.get("cpu_figures", False)
    head = [
        f"**{'CPU figures' if cpu else 'GPU figures'}** -- device: {env.get('device_name')}"
        + (f", driver {env.get('driver')}, CUDA {env.get('cuda_runtime')}" if not cpu else ""),
        "",
        f"torch {env.get('torch')}, triton {env.get('triton')}, python {env.get('python')}, "
        f"tripwire {env.get('tripwire')}; started {report.get('started')}, {report.get('elapsed_s', '?')} s; "
        f"quick={report.get('quick')}",
        "",
        f"Command: `{report.get('command', 'tripwire bench')}`",
        "",
    ]
    if report.get("soak_minutes") is None and report.get("questions", {}).get("q9", {}).get("status") == "ok":
        head += ["(q9 ran the suite's short default soak, not the 10-minute one: `--soak-minutes 10` gives that.)", ""]
    # Summary of every target first, then the detail per question.
    summary = ["| question | target | measured | mark |", "|---|---|---|---|"]
    for q in report.get("questions", {}).values():
        if q.get("status") == "skipped":
            summary.append(f"| {q['id']} | {_cell(q.get('reason', ''))} | | skipped |")
            continue
        for t in q.get("targets", []):
            unit = q.get("figures", {}).get(t.get("figure"), {}).get("unit", "")
            summary.append(
                f"| {q['id']} | {_cell(t['name'])}: {_cell(t['target'])} | {_num(t.get('value'))} {unit} "
                f"| {_mark(t.get('pass'))} |"
            )
    body = [render_question(q) for q in report.get("questions", {}).values()]
    return "\n".join(head + summary + [""] + body)


def update(results_md: Path, report: dict) -> None:
    """Replace this run's section (GPU or CPU) of ``results_md`` with the tables of ``report``."""
    begin, end = MARKERS[bool(report.get("cpu_figures"))]
    text = results_md.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{results_md} has no {begin} ... {end} section to replace")
    pre, rest = text.split(begin, 1)
    _, post = rest.split(end, 1)
    results_md.write_text(pre + begin + "\n" + render(report).rstrip() + "\n" + end + post)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", type=Path)
    p.add_argument("--update", type=Path, default=None, help="RESULTS.md to update in place")
    a = p.parse_args(argv)
    report = json.loads(a.json.read_text())
    if a.update is not None:
        update(a.update, report)
        print(f"updated {a.update}")
    else:
        sys.stdout.write(render(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
