"""tripwire's log lines: no message names tripwire itself (the logger's name does), and where an application
configured no logging the lines still say whose they are (``tripwire._runtime.logs``)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tripwire"
LEVELS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}


def _leading_text(node: ast.expr) -> str | None:
    """The text a message argument starts with, where the source says it (a literal, an f-string's head, the left
    side of a concatenation)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    if isinstance(node, ast.BinOp):
        return _leading_text(node.left)
    return None


def prefixed_log_calls(source: str, where: str) -> list[str]:
    """``where:line`` of each call ``<log>.<level>(msg, ...)`` (a receiver whose name holds "log") whose message
    starts with "tripwire" followed by a colon: the logger's name says it already."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in LEVELS or not isinstance(node.func.value, ast.Name):
            continue
        if "log" not in node.func.value.id.lower():
            continue
        args = node.args[1:] if node.func.attr == "log" else node.args
        text = _leading_text(args[0]) if args else None
        if text is not None and text.lower().startswith("tripwire:"):
            out.append(f"{where}:{node.lineno}")
    return out


def test_no_log_message_starts_with_tripwire():
    found = [
        hit for p in sorted(SRC.rglob("*.py")) for hit in prefixed_log_calls(p.read_text(), str(p.relative_to(SRC)))
    ]
    assert found == []


def test_control_a_prefixed_log_call_is_found():
    source = textwrap.dedent(
        """
        log.warning("tripwire: %s", fault)
        logger.log(30, f"tripwire: lost {name}")
        log.error("tripwire: a" + b)
        log.warning("stop ARMED: %s", exc)
        log.info("tripwire contained it")
        print("tripwire: not a log call")
        """
    )
    assert prefixed_log_calls(source, "x.py") == ["x.py:2", "x.py:3", "x.py:4"]


SCRIPT = r"""
import logging, sys
import tripwire  # installs the fallback on the tripwire logger

log, child = logging.getLogger("tripwire"), logging.getLogger("tripwire.demo")
log.warning("lost the reader of cpu")
log.info("an INFO line")  # below the last resort's level: not shown
child.error("a child's line")
if sys.argv[1] == "configured":
    logging.basicConfig(format="%(name)s|%(message)s", stream=sys.stderr)
    log.warning("once, through the application's handler")
elif sys.argv[1] == "control":
    for h in list(log.handlers):
        log.removeHandler(h)
    log.warning("bare, through Python's last resort")
"""


def _stderr(mode: str, tmp_path: Path) -> str:
    script = tmp_path / "logs.py"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stderr


def test_unconfigured_logging_shows_the_level_and_the_logger(tmp_path):
    """No logging configured: each WARNING and above once, as ``LEVEL name: message``; once an application
    configures logging, its handler alone shows the line (never twice)."""
    assert (
        _stderr("bare", tmp_path) == "WARNING tripwire: lost the reader of cpu\nERROR tripwire.demo: a child's line\n"
    )
    assert _stderr("configured", tmp_path).splitlines()[2:] == ["tripwire|once, through the application's handler"]


def test_control_without_the_fallback_a_line_does_not_say_whose_it_is(tmp_path):
    assert _stderr("control", tmp_path).splitlines()[2:] == ["bare, through Python's last resort"]
