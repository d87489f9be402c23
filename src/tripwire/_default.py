"""The process-wide default Monitor and the module-level functions that act on it.

The default monitor is built lazily, from the ``TRIPWIRE_*`` variables, on first use (never at import: importing
tripwire must not read settings, touch CUDA or start a thread).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from .config import load_settings
from .monitor import Hit, Monitor
from .sites import Site

_lock = threading.Lock()
_monitor: Monitor | None = None


def default_monitor() -> Monitor:
    """The default Monitor (built from the environment on first use; a broken setting raises ValueError here)."""
    m = _monitor
    if m is None:
        return _build()
    return m


def _build() -> Monitor:
    global _monitor
    with _lock:
        if _monitor is None:
            _monitor = Monitor()
        return _monitor


def configure(*, replace_live: bool = False, **settings: Any) -> Monitor:
    """Replace the default monitor with ``Monitor(**settings)`` (same names as the TRIPWIRE_* variables).

    Call it before ``prealloc`` and before anything counts: once the default monitor has an arena, kernels (and
    graphs captured with them) keep counting into it, and a replacement would never read those counts. So a
    default monitor whose arenas exist is not replaced: RuntimeError, naming them. ``replace_live=True`` replaces
    it anyway (tests and tools that know nothing still writes there): the old monitor's reader is stopped and its
    arenas stay allocated forever (graphs may hold them).
    """
    global _monitor
    # The settings are checked first: a broken setting is the caller's error to hear about, whatever the state of
    # the monitor it would have replaced.
    load_settings(settings.get("env"), **{k: v for k, v in settings.items() if k not in ("env", "registry")})
    with _lock:
        old = _monitor
    if old is not None and not replace_live:
        devices = [str(d) for d in old.arena.devices()]
        if devices:
            raise RuntimeError(
                f"tripwire.configure(): the default monitor already has counter arenas on {', '.join(devices)}; "
                f"kernels and captured graphs keep counting into them, so a new monitor would never see those "
                f"counts. Call configure() before prealloc()/counter(), or pass replace_live=True if nothing "
                f"writes there any more."
            )
    new = Monitor(**settings)
    with _lock:
        old, _monitor = _monitor, new
    if old is not None:
        old.stop()
    return new


def prealloc(device: torch.device | str | int) -> torch.Tensor:
    """Allocate the default monitor's arena and reader state for ``device``; call before any capture."""
    return default_monitor().prealloc(device)


def counter(site: Site, device: torch.device | str | int) -> torch.Tensor:
    """``site``'s counter row on ``device`` (a cached view; CaptureError if it would allocate inside a capture)."""
    m = _monitor
    return (m if m is not None else _build()).counter(site, device)


def check() -> None:
    """Raise :class:`tripwire.GuardTripped` if the stop is armed. One attribute read; never touches the GPU.

    Late by up to about two reader intervals; local to this process unless tripwire.distributed coordinates ranks.
    """
    m = _monitor
    (m if m is not None else _build()).check()


def start() -> None:
    """Run the post-capture hooks, then start the reader (unless mode is off). Idempotent."""
    default_monitor().start()


def stop(timeout: float | None = 5.0) -> None:
    """Stop and join the default monitor's reader thread and native tick, waiting at most ``timeout`` seconds for
    each (None: no limit)."""
    m = _monitor
    if m is not None:
        m.stop(timeout)


def health() -> dict[str, Any]:
    """The default monitor's :meth:`Monitor.health` (built on first use, like every function here)."""
    return default_monitor().health()


def built() -> bool:
    """Whether the default monitor exists yet (importing tripwire must not build it)."""
    return _monitor is not None


def poll() -> None:
    """One reader tick on the calling thread."""
    default_monitor().poll()


def drain(raise_on_fatal: bool = False) -> dict[tuple[str, str], Hit]:
    """Final synchronous read (see :meth:`Monitor.drain`)."""
    return default_monitor().drain(raise_on_fatal)


def snapshot() -> dict[tuple[str, str], Hit]:
    """``{(device, site_name): Hit}`` for every non-zero guard row; synchronous, a tool's call."""
    return default_monitor().snapshot()


def reset() -> None:
    """Zero counters, forget reported state and disarm (see :meth:`Monitor.reset`)."""
    default_monitor().reset()


def register_post_capture_hook(fn: Callable[[], Any]) -> None:
    """Run ``fn`` once at start(), or at once if start() already ran."""
    default_monitor().register_post_capture_hook(fn)


def run_post_capture_hooks() -> None:
    """Run the post-capture hooks that have not run yet."""
    default_monitor().run_post_capture_hooks()
