"""Which releases of an engine an integration accepts: one rule for both (vLLM and transformers), since each reads
its engine's private layout and refuses a release it was not checked against."""

from __future__ import annotations

__all__ = ["in_range"]


def in_range(version: str, supported: tuple[str, str]) -> bool:
    """Whether ``version`` lies in ``[supported[0], supported[1])``, compared by release numbers to the bounds'
    precision: a pre-release or a local build of a supported minor counts (``0.32.0rc1``, ``0.32.0+cpu``)."""
    from packaging.version import Version

    lo, hi = (Version(v).release for v in supported)
    got = Version(version).release
    return lo <= got[: len(lo)] and got[: len(hi)] < hi
