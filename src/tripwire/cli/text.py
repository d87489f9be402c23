"""The command's text: ``--help`` descriptions from docstrings, and tables as aligned columns (``tripwire sites``,
the demos' summaries)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..sites import Site


def help_text(doc: str | None) -> str:
    """A command's ``--help`` description from its module's docstring: the first paragraph as plain text (reST's
    double backquotes and roles dropped), whole, not its first line."""
    para = (doc or "").strip().split("\n\n", 1)[0]
    text = " ".join(para.split())
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "").replace("\\", "")


def format_table(rows: Sequence[Sequence[str]], right: tuple[int, ...] = (), indent: str = "") -> str:
    """``rows`` (the first is the header) as aligned columns two spaces apart, each as wide as its widest cell;
    the columns in ``right`` are right-aligned, the last column is left ragged."""
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, width, strict=True))]
        cells[-1] = r[-1]
        lines.append((indent + "  ".join(cells)).rstrip())
    return "\n".join(lines)


def sites_table(sites: Sequence[Site]) -> str:
    """``tripwire sites``' table: a header and one aligned row per site (id, kind, FATAL, name, description)."""
    rows = [("ID", "KIND", "FATAL", "NAME", "DESCRIPTION")]
    rows += [(str(s.id), s.kind, "FATAL" if s.fatal else "", s.name, s.description) for s in sites]
    return format_table(rows, right=(0,))
