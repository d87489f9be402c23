"""mkdocs hooks (``mkdocs.yml``'s ``hooks``): the docstrings name objects with Sphinx roles (``:class:`Monitor```),
which mkdocstrings' Markdown leaves as text before the code span; the API pages show the code span alone."""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):(?=<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    return ROLE.sub("", html)
