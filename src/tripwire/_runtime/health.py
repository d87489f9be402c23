"""The health record (:meth:`tripwire.Monitor.health`): a monitor's state as plain JSON types, read from its parts
without reading a device or waiting on anything."""

from __future__ import annotations

import time
from typing import Any

from ..errors import GuardTripped
from .native.engage import Engagement
from .reader import Readers


def health_record(
    *,
    stop: GuardTripped | None,
    alive: bool,
    mode: str,
    native: Engagement,
    last_python_tick: float | None,
    devices: Readers,
    counts: dict[str, dict[str, int]],
    loop_errors: int,
    sink_errors: int,
) -> dict[str, Any]:
    """The record of :meth:`tripwire.Monitor.health` (its docstring has the keys): ``stop`` the armed stop (None when
    not armed), ``alive`` whether the reader thread runs, ``last_python_tick`` the latest Python tick (the native
    tick's comes from ``native``), ``counts`` the confirmed counts per device."""
    last = max((t for t in (last_python_tick, native.last_tick()) if t is not None), default=None)
    status = {r.name: r.status() for r in devices.all()}
    lost = any(d["lost"] is not None for d in status.values())
    return {
        "ok": stop is None and not lost and (alive or mode == "off"),
        "mode": mode,
        "armed": stop is not None,
        "stop": None if stop is None else stop.as_dict(),
        "reader_alive": alive,
        "last_tick_age": None if last is None else max(time.monotonic() - last, 0.0),
        "native_tick": native.status,
        "devices": status,
        "counts": counts,
        "ticks": native.total(0),
        "python_ticks": native.python[0],
        "native_ticks": native.native_total(0),
        "idle_skips": native.total(1),
        "quiet_ticks": native.total(2),
        "loop_errors": loop_errors,
        "sink_errors": sink_errors,
    }
