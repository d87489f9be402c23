"""The package's layout rules, read from the source with ``ast`` (nothing is imported):

* no import cycle among tripwire's modules, counting every import: at module level, inside functions, and under
  ``if TYPE_CHECKING:`` (a cycle a type checker sees is one a reader has to untangle too);
* no module over :data:`MAX_LINES` lines;
* no module under ``tripwire._runtime`` imports a public module that imports it back (the machinery sits below the
  public face; the reporters get a context, not the Monitor);
* every repository path that the sources, tests, docs, benchmarks and scripts name exists (a file moved leaves
  pointers behind that send a reader nowhere).

``import tripwire`` starting no thread and initialising no CUDA is ``tests/test_import.py``'s. Each rule has a
control: the same check fed a synthetic package that breaks it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 520
RUNTIME = "tripwire._runtime"
ROOT = SRC.parent
# Where the path rule reads (CHANGELOG.md names files as they were when it was written: history, not pointers).
NAMING = ("src/**/*.py", "src/**/*.cuh", "tests/**/*.py", "docs/**/*.md", "benchmarks/**/*.py", "benchmarks/**/*.md",
          "scripts/*", "README.md", "Makefile", ".ci/run", "pyproject.toml", "mkdocs.yml")  # fmt: skip
# Named on purpose without existing: the note of an older run's record (tests/cli/test_bench.py's merge test) and a
# synthetic page's name (tests/test_docs.py).
NAMED_ON_PURPOSE = frozenset({"benchmarks/bench_numerics.py", "docs/control.md"})
_PATH = re.compile(
    r"\b(?:benchmarks|scripts|docs|tests|src/tripwire|examples)/[A-Za-z0-9_./-]+\."
    r"(?:py|md|sh|cuh|cu|h|cpp|json|txt|toml|yml|yaml)\b"
)


def modules(src: Path, top: str = "tripwire") -> dict[str, Path]:
    """Every module of the package ``top`` under ``src``, by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted((src / top).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(node: ast.Import | ast.ImportFrom, name: str, is_pkg: bool, mods: Collection[str]) -> Iterator[str]:
    """The modules an import statement of module ``name`` imports: ``from a import b`` is ``a.b`` where that is a
    module, else ``a`` (``b`` is a name defined there)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
        return
    if node.level:
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    for a in node.names:
        yield f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module


def import_graph(src: Path, top: str = "tripwire") -> dict[str, set[str]]:
    """Module -> the package's modules it imports, wherever the import statement stands (module level, a function,
    ``if TYPE_CHECKING:``). A package's own parent packages, imported implicitly, are not edges."""
    mods = modules(src, top)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(node, name, is_pkg, mods):
                    if target in mods and target != name:
                        edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each holds at least one cycle), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def long_modules(src: Path, top: str = "tripwire", limit: int = MAX_LINES) -> dict[str, int]:
    """Modules over ``limit`` lines, with their line counts."""
    counts = {m: len(p.read_text().splitlines()) for m, p in modules(src, top).items()}
    return {m: n for m, n in counts.items() if n > limit}


def upward_imports(graph: dict[str, set[str]], lower: str = RUNTIME) -> list[tuple[str, str]]:
    """(lower module, public module) pairs where a module under ``lower`` imports a module outside it that imports
    it back: the machinery reaching up into the module that owns it."""
    inside = {m for m in graph if m == lower or m.startswith(lower + ".")}
    return sorted((m, up) for m in inside for up in graph[m] if up not in inside and m in graph.get(up, ()))


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / "pkg" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def missing_paths(root: Path, files: Iterable[Path]) -> dict[str, list[str]]:
    """Repository paths (``docs/x.md``, ``tests/y.py``, ...) named in ``files`` that do not exist under ``root``:
    path -> the files that name it."""
    out: dict[str, list[str]] = {}
    for f in files:
        for m in sorted(set(_PATH.findall(f.read_text(errors="replace")))):
            if m not in NAMED_ON_PURPOSE and not (root / m).exists():
                out.setdefault(m, []).append(f.relative_to(root).as_posix())
    return out


def naming_files(root: Path) -> list[Path]:
    return sorted({p for g in NAMING for p in root.glob(g) if p.is_file() and "__pycache__" not in p.parts})


# ------------------------------------------------------------------------------------------------ the rules
def test_no_import_cycles():
    assert cycles(import_graph(SRC)) == []


def test_no_module_over_the_limit():
    assert long_modules(SRC) == {}


def test_runtime_does_not_import_up_into_its_owner():
    assert upward_imports(import_graph(SRC)) == []


def test_every_named_path_exists():
    # This module is left out: its control names missing paths on purpose.
    files = [f for f in naming_files(ROOT) if f != Path(__file__).resolve()]
    assert missing_paths(ROOT, files) == {}


def test_the_path_rule_reads_the_repository():
    """The rule above reads the real files, and the paths they name: this module and a few it must see."""
    files = {f.relative_to(ROOT).as_posix() for f in naming_files(ROOT)}
    assert {"tests/test_house.py", "README.md", "docs/guarding.md", "src/tripwire/include/tripwire/guard.cuh"} <= files
    assert "tests/test_include.py" in _PATH.findall((SRC / "tripwire/include/tripwire/guard.cuh").read_text())


def test_the_graph_sees_the_package():
    """The checks above read the real package: its machinery and the public modules that use it."""
    graph = import_graph(SRC)
    assert "tripwire._runtime.pipeline" in graph["tripwire.monitor"]
    assert "tripwire._runtime.report" in graph["tripwire._runtime.pipeline"]
    assert len(graph) > 50


# ------------------------------------------------------------------------------------------------ controls
def test_control_a_cycle_through_type_checking_is_found(tmp_path):
    src = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from .b import B\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
            "c.py": "def f():\n    from . import d\n",
            "d.py": "import pkg.c\n",
            "e.py": "from . import a\n",
        },
    )
    graph = import_graph(src, "pkg")
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_control_no_cycle_in_a_chain(tmp_path):
    src = _package(tmp_path, {"__init__.py": "", "a.py": "from .b import x\n", "b.py": "x = 1\n"})
    assert cycles(import_graph(src, "pkg")) == []


def test_control_a_long_module_is_found(tmp_path):
    src = _package(tmp_path, {"__init__.py": "", "big.py": "x = 1\n" * (MAX_LINES + 1), "ok.py": "x = 1\n" * MAX_LINES})
    assert long_modules(src, "pkg") == {"pkg.big": MAX_LINES + 1}


def test_control_an_upward_import_is_found(tmp_path):
    src = _package(
        tmp_path,
        {
            "__init__.py": "",
            "owner.py": "from ._runtime.part import Part\n",
            "leaf.py": "X = 1\n",
            "_runtime/__init__.py": "",
            "_runtime/part.py": "from ..owner import helper\nfrom ..leaf import X\n",
        },
    )
    assert upward_imports(import_graph(src, "pkg"), "pkg._runtime") == [("pkg._runtime.part", "pkg.owner")]


def test_control_a_moved_file_is_found(tmp_path):
    """A file naming a path that is not there is flagged, one naming a path that is (or one named on purpose) is not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("see docs/here.md")
    (tmp_path / "docs" / "a.md").write_text(
        "run tests/test_gone.py, then read docs/here.md (and benchmarks/bench_numerics.py); see `docs/gone.md`."
    )
    assert missing_paths(tmp_path, naming_files(tmp_path)) == {
        "docs/gone.md": ["docs/a.md"],
        "tests/test_gone.py": ["docs/a.md"],
    }
