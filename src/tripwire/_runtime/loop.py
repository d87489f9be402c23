"""The reader thread's schedule: when a tick runs, not what it does (the monitor's tick reads the arenas and feeds the
pipeline). While the native thread holds the quiet ticks (:mod:`tripwire._runtime.native.engage`) this thread sleeps
with the GIL released until a copy changed, a native call failed, someone paused it, the monitor stops, or a Python
duty (a deferred report, a heartbeat) is due; otherwise it ticks every interval, and every
:data:`~tripwire._runtime.confirm.CONFIRM_REPOLL_S` while a rise waits for its confirming copy."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from . import confirm
from .native.engage import Engagement

log = logging.getLogger("tripwire")


def run_reader(
    interval: float,
    native: Engagement,
    stop: threading.Event,
    *,
    prepare: Callable[[], None],
    duty_wait: Callable[[float], float],
    tick: Callable[[], None],
    failed: Callable[[Exception], None],
    pending: Callable[[], bool],
) -> None:
    """Run the reader thread until ``stop`` is set. ``prepare()`` once first (a failure there leaves the ticks to
    Python); then per tick ``tick()``, whose exceptions go to ``failed(e)`` and never end the loop. ``duty_wait(now)``:
    how long the native thread may keep the ticks; ``pending()``: whether a rise waits for its confirming copy."""
    wait = interval
    try:
        prepare()
    except Exception:
        log.exception("engaging the native tick failed; the reader ticks in Python")
        native.off = "failed to engage"
    while True:
        if native.attached:
            native.wait(duty_wait(time.monotonic()))
            if stop.is_set():
                break
        elif stop.wait(wait):
            break
        t0 = time.perf_counter()
        try:
            tick()
        except Exception as e:  # the loop itself failed: the caller logs and arms; keep going
            failed(e)
        if native.python_spans is not None:
            native.python_spans.append((t0, time.perf_counter()))
        # While a rise waits for its confirming copy (already in flight: it was started by the tick that saw the
        # rise), re-poll after CONFIRM_REPOLL_S instead of a full interval, so detection costs about one interval,
        # not two.
        wait = min(interval, confirm.CONFIRM_REPOLL_S) if pending() else interval
