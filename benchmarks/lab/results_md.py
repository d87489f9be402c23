"""Render ``bench.json`` as Markdown tables, and bring ``benchmarks/RESULTS.md``'s suite rows up to a run.

    python -m lab.results_md BENCH_JSON                     # print the tables (what --out's results.md holds)
    python -m lab.results_md BENCH_JSON --update RESULTS.md  # replace the rows of the questions the run measured

RESULTS.md holds the current figure of each question, one row per target, between ``<!-- BEGIN GPU RESULTS -->``
and ``<!-- END GPU RESULTS -->`` for GPU runs and ``<!-- BEGIN CPU RESULTS -->`` / ``<!-- END CPU RESULTS -->`` for
CPU runs (``cpu_figures`` in the JSON), so the H200 figures and the CPU figures never overwrite each other. An
update replaces the rows of every question the run measured (skipped ones keep theirs), each carrying the run's
device, versions, command and date, and leaves every other row and line of the file as it was.
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


ROW_HEAD = [
    "| question | target | figure | mark | device | versions | command | date |",
    "|---|---|---|---|---|---|---|---|",
]


def rows(report: dict) -> dict[str, list[str]]:
    """RESULTS.md's rows of ``report``, by question: one per target of each question it measured (not skipped)."""
    env = report.get("env", {})
    device = env.get("device_name", "?")
    versions = f"torch {env.get('torch')}, triton {env.get('triton')}"
    command = _cell(report.get("command", "tripwire bench")).replace("`", "'")
    date = str(report.get("started", "?"))[:10]
    out: dict[str, list[str]] = {}
    for q in report.get("questions", {}).values():
        if q.get("status") == "skipped":
            continue
        got = out.setdefault(q["id"], [])
        if not q.get("targets"):
            got.append(
                f"| {q['id']} | {_cell(q.get('title', ''))} | *{q.get('status', '?')}*: "
                f"{_cell(q.get('reason', ''))} | n/a | {device} | {versions} | `{command}` | {date} |"
            )
        for t in q.get("targets", []):
            unit = q.get("figures", {}).get(t.get("figure"), {}).get("unit", "")
            got.append(
                f"| {q['id']} | {_cell(t['name'])}: {_cell(t['target'])} | {_num(t.get('value'))} {unit} "
                f"| {_mark(t.get('pass'))} | {device} | {versions} | `{command}` | {date} |"
            )
    return out


def merge(block: str, new: dict[str, list[str]]) -> str:
    """``block`` (the lines between one pair of markers) with the rows of each question in ``new`` replaced: a
    question's new rows go where its first old row was (at the end of the table if it had none)."""
    lines = block.strip("\n").splitlines() if block.strip() else list(ROW_HEAD)
    if not any(ln.startswith("| question |") for ln in lines):
        lines = list(ROW_HEAD) + lines
    out: list[str] = []
    placed: set[str] = set()
    for ln in lines:
        qid = ln.split("|")[1].strip() if ln.startswith("| q") else None
        if qid in new:
            if qid not in placed:
                out += new[qid]
                placed.add(qid)
            continue
        out.append(ln)
    last = max((i for i, ln in enumerate(out) if ln.startswith("|")), default=len(out) - 1)
    rest = [r for qid, rs in new.items() if qid not in placed for r in rs]
    return "\n".join(out[: last + 1] + rest + out[last + 1 :])


def update(results_md: Path, report: dict) -> None:
    """Replace the rows of the questions ``report`` measured in its section (GPU or CPU) of ``results_md``."""
    begin, end = MARKERS[bool(report.get("cpu_figures"))]
    text = results_md.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{results_md} has no {begin} ... {end} section to update")
    pre, rest = text.split(begin, 1)
    block, post = rest.split(end, 1)
    results_md.write_text(pre + begin + "\n" + merge(block, rows(report)) + "\n" + end + post)


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
