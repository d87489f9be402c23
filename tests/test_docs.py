"""The docs' and the README's Python snippets run, and the docs build.

Every fenced ``python`` block of ``README.md`` and ``docs/*.md`` runs: the blocks of one page in order, in one
namespace (a page reads top to bottom, and its later snippets use what the earlier ones made), in a fresh
interpreter per page (pages register sites, configure the default monitor and start readers), in a scratch folder,
under the Triton interpreter when CUDA is absent, exactly as CI runs the tests. A block the page marks with

    <!-- docs-test: skip (gpu|processes): why -->

on the line before its fence is not run, by design: it needs a GPU toolchain or several processes this machine
cannot give it. Each marked block is reported as a skip with its reason, and there may be only a few
(:data:`MOST_MARKED`). A page with a block that fails fails its test, naming the block's line.

``mkdocs build --strict`` runs in ``.ci/run``; here it runs too when mkdocs is installed (the ``docs`` extra).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The symlinked results page is benchmarks/RESULTS.md: its figures, no Python.
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if not p.is_symlink())]
MARK = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<why>gpu|processes)\)\s*:\s*(?P<reason>.*?)\s*-->")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})\s*(?P<info>[^\s`]*)")
PYTHON = {"python", "py", "python3"}
# Marked blocks, all pages together: the docs run, they do not describe.
MOST_MARKED = 5


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    code: str
    skip: tuple[str, str] | None  # (gpu|processes, reason)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path, text: str | None = None) -> list[Block]:
    """The Python blocks of ``page`` (or of ``text`` standing for it), in order, with their skip marks."""
    lines = (page.read_text() if text is None else text).splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, info = m["indent"], m["ticks"], m["info"].lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(ticks):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        if info not in PYTHON:
            continue
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mark = MARK.search(prev)
        skip = (mark["why"], mark["reason"]) if mark else None
        out.append(Block(page, start + 1, textwrap.dedent("\n".join(body)) + "\n", skip))
    return out


RUNNER = r"""
import json, sys, traceback
blocks = json.loads(open(sys.argv[1]).read())
ns = {"__name__": "__main__"}
for b in blocks:
    try:
        exec(compile(open(b["file"]).read(), b["file"], "exec"), ns)
    except BaseException:
        traceback.print_exc()
        print(f"DOCS-TEST: the snippet at {b['where']} failed", file=sys.stderr)
        sys.exit(1)
print(f"DOCS-TEST: {len(blocks)} snippet(s) ran")
"""


def run_page(
    page_blocks: list[Block], tmp: Path, timeout: float = 600, interpret: bool = True
) -> subprocess.CompletedProcess:
    """Run the blocks (skipped ones left out) in order in one fresh interpreter whose working folder is ``tmp``;
    with ``interpret`` False, TRITON_INTERPRET is left to the page (unset), as a reader's shell has it."""
    todo = []
    for b in page_blocks:
        if b.skip is None:
            # A real file (@triton.jit reads its function's source through inspect), padded so that a traceback's
            # line numbers are the page's.
            f = tmp / f"{b.page.name}.L{b.line}.py"
            f.write_text("\n" * b.line + b.code)
            todo.append({"where": b.where, "file": str(f)})
    (tmp / "blocks.json").write_text(json.dumps(todo))
    (tmp / "runner.py").write_text(RUNNER)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret and not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    # Let sinks' and plugins' files, and anything a page writes, land in the scratch folder.
    return subprocess.run(
        [sys.executable, str(tmp / "runner.py"), str(tmp / "blocks.json")],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


ALL = {p: blocks(p) for p in PAGES}
RUNNABLE = [p for p, bs in ALL.items() if any(b.skip is None for b in bs)]
MARKED = [b for bs in ALL.values() for b in bs if b.skip is not None]


@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(ROOT)) for p in RUNNABLE])
def test_page_snippets_run(page: Path, tmp_path: Path) -> None:
    p = run_page(ALL[page], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    ran = sum(b.skip is None for b in ALL[page])
    assert f"DOCS-TEST: {ran} snippet(s) ran" in p.stdout


def stated_output(text: str) -> list[str]:
    """The lines of the page's first ``text`` block: the output the page says its snippet logs."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip() == "```text")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
    return lines[start + 1 : end]


def logged_reports(stderr: str) -> list[str]:
    """tripwire's report lines in a run's stderr: each ``WARNING tripwire:`` record with its indented lines."""
    out: list[str] = []
    inside = False
    for ln in stderr.splitlines():
        if ln.startswith("WARNING tripwire: "):
            inside = True
        elif not ln.startswith("  "):
            inside = False
        if inside:
            out.append(ln)
    return out


def test_the_readme_runs_as_printed(tmp_path: Path) -> None:
    """The README's snippets in a shell without TRITON_INTERPRET (a reader's): on a CPU machine the page itself must
    choose the interpreter, or the first launch fails; and what they log is, line for line, what the README says
    they log (on a GPU, with the device's name for ``cpu``)."""
    p = run_page(ALL[ROOT / "README.md"], tmp_path, interpret=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    stated = stated_output((ROOT / "README.md").read_text())
    if torch.cuda.is_available():
        stated = [ln.replace(" on cpu:", " on cuda:0:") for ln in stated]
    assert len(stated) == 5 and logged_reports(p.stderr) == stated, p.stderr[-6000:]


def test_control_a_readme_output_that_differs_is_found() -> None:
    """Control: one report of all three (what a run without the snippet's sleep may log) is not the stated two."""
    stated = stated_output((ROOT / "README.md").read_text())
    one = (
        "WARNING tripwire: MASKED FAULT at site 'kernels.paged_gather.page' on cpu: 3 out-of-range accesses masked "
        "(3 total). First offender: row 6, value 4096.\n  Lifetime extremes: max row 6, value min 4096 max 4096.\n"
        "a line of the snippet's own\n"
    )
    assert logged_reports(one) == one.splitlines()[:2] and logged_reports(one) != stated
    assert logged_reports("\n".join(["noise", *stated, "more noise"])) == stated


FIGURE = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?: ?(?:%|ms|us|x))?")


def headline_figures(readme: str) -> list[str]:
    """The figures of the README's headline table (its "figure" column), each a number with its unit."""
    section = readme.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| question")]
    return [f for ln in rows for f in FIGURE.findall(ln.split("|")[2]) if any(c.isdigit() for c in f)]


def test_the_readme_headlines_are_results_figures() -> None:
    """Every figure of the README's headline table is written as RESULTS.md writes it: the README quotes, it does
    not measure (and a figure RESULTS.md has replaced cannot linger there)."""
    figures = headline_figures((ROOT / "README.md").read_text())
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert len(figures) >= 10, figures
    missing = [f for f in figures if f not in results]
    assert not missing, f"README headline figures not in RESULTS.md: {missing}"


def test_control_a_headline_figure_missing_from_results_is_found() -> None:
    readme = "## Benchmarks\n\n| question | figure | target | mark |\n|---|---|---|---|\n| q | 0.0217 % and 7.77 ms | x | y |\n"
    assert headline_figures(readme) == ["0.0217 %", "7.77 ms"]
    assert "7.77 ms" not in (ROOT / "benchmarks" / "RESULTS.md").read_text()


@pytest.mark.parametrize("block", MARKED, ids=[b.where for b in MARKED])
def test_marked_snippet(block: Block) -> None:
    """Not run, by design: say which and why."""
    why, reason = block.skip  # type: ignore[misc]
    assert reason, f"{block.where}: a skip mark must say why"
    compile(block.code, block.where, "exec")  # it is still Python
    pytest.skip(f"{block.where}: needs {'a GPU toolchain' if why == 'gpu' else 'several processes'}: {reason}")


def test_the_docs_have_snippets_and_few_marks() -> None:
    every = [b for bs in ALL.values() for b in bs]
    assert ROOT / "README.md" in RUNNABLE
    for name in ("getting-started.md", "guarding.md", "validators.md", "numerics.md", "observability.md"):
        assert ROOT / "docs" / name in RUNNABLE, name
    assert len(every) >= 20 and len(MARKED) <= MOST_MARKED, [b.where for b in MARKED]


def test_control_a_failing_snippet_fails_its_page(tmp_path: Path) -> None:
    """Controls: a page whose second block raises fails, naming that block; a block that uses what an earlier block
    of its page defined runs; a marked block is left out; a ``py`` fence is Python too, a ``text`` fence is not."""
    page = ROOT / "docs" / "control.md"
    text = "\n".join(
        [
            "```python",
            "x = 41",
            "```",
            "",
            "- an item",
            "",
            "    ```py",
            "    x += 1",
            "    ```",
            "",
            "<!-- docs-test: skip (gpu): nothing here needs one, it only must not run -->",
            "```python",
            "raise SystemExit('a marked block ran')",
            "```",
            "```text",
            "not python",
            "```",
            "```python",
            "assert x == 42",
            "raise RuntimeError('the second block')",
            "```",
        ]
    )
    bs = blocks(page, text)
    assert [b.line for b in bs] == [1, 7, 12, 18] and [b.skip is not None for b in bs] == [False, False, True, False]
    p = run_page(bs, tmp_path, timeout=120)
    assert p.returncode == 1 and "the snippet at docs/control.md:18 failed" in p.stderr, p.stderr[-2000:]
    assert "the second block" in p.stderr and "a marked block ran" not in p.stderr
    p = run_page(bs[:3], tmp_path, timeout=120)
    assert p.returncode == 0 and "DOCS-TEST: 2 snippet(s) ran" in p.stdout, p.stderr[-2000:]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """The site builds with every warning an error (broken links, missing pages, API objects that do not exist)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    p = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "tripwire" / "index.html").is_file()
