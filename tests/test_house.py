"""The package's layout rules (DESIGN.md, "Layout"), read from the source with ``ast`` (nothing is imported).

Every import counts, wherever it stands: at module level, inside a function (a lazy import is a dependency all the
same), under ``if TYPE_CHECKING:`` (a cycle a type checker sees is one a reader has to untangle too); relative
imports are resolved against the module that makes them.

* No import cycle among tripwire's modules.
* No upward import: a layer does not import the layers built on it (:data:`LAYERS`).

  - ``tripwire._runtime``, the machinery, is owned by no caller: it imports none of the public modules built on it
    (:data:`ABOVE_RUNTIME`: the package root, ``_default``, ``monitor``, ``verdict``, ``report``, ``resources``,
    ``testing``, ``kernels``, ``numerics``, ``validate``, ``integrations``, ``distributed``, ``cli``). Reporters get
    a narrow context, not the Monitor. The process's default Monitor (built from it) sits above it, in
    ``tripwire._default``.
  - ``tripwire.triton``, the device helpers, sits under the kernels that use it: it imports none of those modules
    and not ``_runtime`` either (the launch recorder the register budget reads lives in ``triton._callee``).
  - Nothing imports the command (``tripwire.cli``) but the command itself and ``tripwire.__main__``.
  - Nothing imports the package root (``tripwire``, the public face that imports everything) but the command and
    the test helpers (``tripwire.testing``).
  - The numeric instruments and the integrations use the public reporter API (``tripwire.report``), not the
    machinery's modules behind it (``_runtime.report``, ``_runtime.hit``).

* No package module imports the lab: ``benchmarks``, ``scripts`` (or ``tests``), by an import statement or by
  ``importlib.import_module`` / ``__import__`` of a constant name.
* No test imports a private module (``tripwire._x``, ``tripwire.x._y``): tests go through the public functions.
  The white-box tests of ``_runtime`` (:data:`RUNTIME_WHITE_BOX`, by name) may import ``tripwire._runtime``'s
  modules, and no other test imports any. Code a test runs in a subprocess (a string that parses as Python) counts
  as the test's own.
* Every repository path that the sources, tests, docs, benchmarks and scripts name exists (a file moved leaves
  pointers behind that send a reader nowhere).

``import tripwire`` starting no thread, initialising no CUDA and loading no driver is ``tests/test_import.py``'s.
Each rule has a control: the same check fed a synthetic package (or test tree) that breaks it.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC.parent
TESTS = ROOT / "tests"
TOP = "tripwire"
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


class Layer(NamedTuple):
    """``importers`` (subtrees, relative to the package: ``""`` is all of it) import none of ``targets`` (subtrees;
    ``""`` is the package root alone), unless they are under ``exempt``."""

    importers: tuple[str, ...]
    targets: tuple[str, ...]
    exempt: tuple[str, ...] = ()


# The public modules built on the machinery (relative names; "" is the package root).
ABOVE_RUNTIME = ("", "_default", "monitor", "verdict", "report", "resources", "testing", "kernels", "numerics",
                 "validate", "integrations", "distributed", "cli")  # fmt: skip
LAYERS = (
    Layer(("_runtime",), ABOVE_RUNTIME),
    Layer(("triton",), (*ABOVE_RUNTIME, "_runtime")),
    Layer(("",), ("cli",), exempt=("cli", "__main__")),
    Layer(("",), ("",), exempt=("cli", "__main__", "testing")),
    Layer(("numerics", "integrations"), ("_runtime.report", "_runtime.hit")),
)
LAB = ("benchmarks", "scripts", "tests")

# The white-box tests of the machinery: they may import tripwire._runtime's modules (and only those privately).
# test_import.py reads the machinery's import-time state (arenas made, the driver binding).
RUNTIME_WHITE_BOX = frozenset({
    "tests/_runtime/test_arena.py",
    "tests/_runtime/test_confirm.py",
    "tests/_runtime/test_driver.py",
    "tests/_runtime/test_native.py",
    "tests/_runtime/test_reader.py",
    "tests/_runtime/test_report.py",
    "tests/test_import.py",
})  # fmt: skip


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


def _under(module: str, tree: str) -> bool:
    return module == tree or module.startswith(tree + ".")


def _abs(top: str, rel: str) -> str:
    return f"{top}.{rel}" if rel else top


def _rel(top: str, module: str) -> str:
    return module[len(top) + 1 :] if module != top else ""


def upward_imports(
    graph: dict[str, set[str]],
    top: str = TOP,
    layers: Iterable[Layer] = LAYERS,
) -> list[tuple[str, str]]:
    """(importer, imported) pairs, relative to ``top``, that break one of ``layers``."""
    found = set()
    for layer in layers:
        for m, targets in graph.items():
            if not any(_under(m, _abs(top, i)) for i in layer.importers):
                continue
            if any(_under(m, _abs(top, e)) for e in layer.exempt):
                continue
            for t in targets:
                if any(t == top if x == "" else _under(t, _abs(top, x)) for x in layer.targets):
                    found.add((_rel(top, m), _rel(top, t)))
    return sorted(found)


def lab_imports(src: Path, top: str = TOP, lab: Collection[str] = LAB) -> list[tuple[str, str]]:
    """(module, what it imports) where a module of the package imports one of ``lab``'s top-level packages: by an
    import statement anywhere in it, or by ``importlib.import_module`` / ``__import__`` of a constant name."""
    found = set()
    for name, path in modules(src, top).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                    names = [node.args[0].value]
            found.update((name, n) for n in names if n.split(".")[0] in lab)
    return sorted(found)


def is_private(module: str, top: str = TOP) -> bool:
    """``tripwire._x`` or ``tripwire.x._y`` (a dunder such as ``tripwire.__main__`` is not private)."""
    parts = module.split(".")
    return parts[0] == top and any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def _absolute_imports(tree: ast.AST, mods: Collection[str]) -> Iterator[str]:
    """The modules a test's code imports (``from a import b`` is ``a.b`` where that is a module), anywhere in it,
    and in the code it hands a subprocess: a string constant that parses as Python with an import in it."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for a in node.names:
                yield f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                inner = ast.parse(textwrap.dedent(node.value))
            except SyntaxError:
                continue
            yield from _absolute_imports(inner, mods)


def private_test_imports(tests: Path, mods: Collection[str], top: str = TOP) -> set[tuple[str, str]]:
    """(test file, relative to the tests folder's parent; private module it imports). This module is left out: its
    controls hold private imports on purpose."""
    found = set()
    for f in sorted(p for p in tests.rglob("*.py") if p != Path(__file__).resolve()):
        rel = f.relative_to(tests.parent).as_posix()
        found.update((rel, m) for m in _absolute_imports(ast.parse(f.read_text(), str(f)), mods) if is_private(m, top))
    return found


def private_import_debt(
    found: Iterable[tuple[str, str]], white_box: Collection[str], runtime: str = f"{TOP}._runtime"
) -> set[tuple[str, str]]:
    """``found`` less the white-box tests' imports of the machinery."""
    return {(f, m) for f, m in found if not (f in white_box and _under(m, runtime))}


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


def test_no_upward_imports():
    assert upward_imports(import_graph(SRC)) == []


def test_the_package_does_not_import_the_lab():
    assert lab_imports(SRC) == []


def test_tests_import_no_private_module_but_the_white_box_ones():
    debt = private_import_debt(private_test_imports(TESTS, modules(SRC)), RUNTIME_WHITE_BOX)
    assert sorted(debt) == [], "tests reaching into private modules: use a public function"
    assert all((ROOT / f).is_file() for f in RUNTIME_WHITE_BOX)


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
    """The checks above read the real package: its machinery, the public modules that use it, and an import made
    inside a function (resources' launch recorder)."""
    graph = import_graph(SRC)
    assert "tripwire._runtime.pipeline" in graph["tripwire.monitor"]
    assert "tripwire._runtime.report" in graph["tripwire._runtime.pipeline"]
    assert "tripwire.report" in graph["tripwire.numerics.clip"]
    assert "tripwire.triton._callee" in graph["tripwire.resources"]
    assert len(graph) > 50


def test_the_private_rule_reads_the_tests():
    """The rule above reads the real tests: a white-box test's import of the machinery is seen (and allowed)."""
    found = private_test_imports(TESTS, modules(SRC))
    pair = ("tests/_runtime/test_driver.py", "tripwire._runtime.driver")
    assert pair in found and pair not in private_import_debt(found, RUNTIME_WHITE_BOX)


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


def test_control_upward_imports_are_found(tmp_path):
    """Each layer rule, broken once (one of them by an import inside a function), beside imports that keep them:
    downward ones, the command's and the test helpers'."""
    src = _package(
        tmp_path,
        {
            "__init__.py": "from .monitor import M\n",
            "__main__.py": "from .cli import main\n",
            "layout.py": "X = 1\n",
            "monitor.py": "from ._runtime.part import P\n",
            "testing.py": "import pkg\n",
            "_runtime/__init__.py": "",
            "_runtime/part.py": "from ..layout import X\n\ndef f():\n    from ..monitor import M\n",
            "_runtime/default.py": "from ..monitor import M\n",
            "_runtime/hit.py": "",
            "triton/__init__.py": "",
            "triton/_budget.py": "def g():\n    from ..kernels import _common\n",
            "kernels/__init__.py": "",
            "kernels/_common.py": "from ..triton import _budget\n",
            "numerics/__init__.py": "from .._runtime.hit import Hit\n",
            "integrations/__init__.py": "",
            "integrations/x.py": "from ..cli import run\nimport pkg\n",
            "cli/__init__.py": "import pkg\nfrom . import run\n",
            "cli/run.py": "",
        },
    )
    graph = import_graph(src, "pkg")
    assert upward_imports(graph, "pkg", LAYERS) == [
        ("_runtime.default", "monitor"),
        ("_runtime.part", "monitor"),
        ("integrations.x", ""),
        ("integrations.x", "cli.run"),
        ("numerics", "_runtime.hit"),
        ("triton._budget", "kernels._common"),
    ]


def test_control_lab_imports_are_found(tmp_path):
    src = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "def f():\n    import benchmarks.bench_x\n",
            "b.py": "from scripts.gpu import run\n",
            "c.py": "import importlib\nimportlib.import_module('tests.helpers')\n",
            "d.py": "import benchmarks_util\nfrom . import a\nimportlib.import_module(name)\n",
        },
    )
    assert lab_imports(src, "pkg") == [
        ("pkg.a", "benchmarks.bench_x"),
        ("pkg.b", "scripts.gpu"),
        ("pkg.c", "tests.helpers"),
    ]


def test_control_private_imports_in_tests_are_found(tmp_path):
    """A private import at module level, inside a function, by ``from package import _module`` and in code a test
    hands a subprocess; public and dunder imports are not; a white-box test may import the machinery only."""
    tests = tmp_path / "tests"
    (tests / "_runtime").mkdir(parents=True)
    (tests / "_runtime" / "test_x.py").write_text(
        "from tripwire._runtime.arena import is_kept\nfrom tripwire.kernels import _common\n"
    )
    (tests / "test_a.py").write_text(
        "import tripwire\nfrom tripwire import Monitor\nimport tripwire.__main__\n"
        'CODE = """\nimport tripwire.validate._torch as t\nt.run()\n"""\n'
        "def f():\n    from tripwire.triton._budget import register_cap\n"
    )
    found = private_test_imports(tests, modules(SRC))
    assert found == {
        ("tests/_runtime/test_x.py", "tripwire._runtime.arena"),
        ("tests/_runtime/test_x.py", "tripwire.kernels._common"),
        ("tests/test_a.py", "tripwire.validate._torch"),
        ("tests/test_a.py", "tripwire.triton._budget"),
    }
    white_box = {"tests/_runtime/test_x.py"}
    assert private_import_debt(found, white_box) == found - {("tests/_runtime/test_x.py", "tripwire._runtime.arena")}


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
