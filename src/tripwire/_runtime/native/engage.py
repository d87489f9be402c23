"""Engaging the native quiet tick: handing a monitor's readers to the native thread and taking them back.

The native thread runs the quiet ticks while nothing needs Python every tick (nothing pending, no tick hook, every
reader readable natively); this module decides when, does the hand-over, folds the native thread's statistics back
in, and owns the process-wide concerns: stopping native threads at interpreter exit (before torch
frees the pinned mirrors they read) and forgetting them in a forked child (only the forking thread survives fork).
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from . import NativeTicker, NativeUnavailable

if TYPE_CHECKING:
    from ..reader import DeviceReader


log = logging.getLogger("tripwire")

_TRACE_SPANS = 8192  # Python tick spans kept for the benchmarks (a ring, like the native one)

# At exit, how long to wait for a native tick stuck in a driver call (a hung stream) before leaving it behind.
EXIT_JOIN_S: float | None = 1.0

# Engagements whose native tick may be running: stopped at interpreter exit (the Python reader is a daemon thread and
# is simply frozen; a native thread would keep running while torch frees what it reads).
_live: weakref.WeakSet[Engagement] = weakref.WeakSet()
_exit_hook = False


def _stop_native_at_exit() -> None:
    for e in list(_live):
        e.stop_event.set()
        ticker = e.ticker
        if ticker is not None and not ticker.stop(EXIT_JOIN_S):
            log.error("the native tick is stuck in a driver call at exit; leaving it behind")


def _forget_native_in_child() -> None:
    # The child has no native thread: drop the parent's tickers without calling into them (their mutex may have been
    # held at the fork); a start() in the child makes a new one.
    for e in list(_live):
        t = e.ticker
        if t is not None:
            t.forked = True
            if t.attached:
                t.detach()  # Python-only: hands the readers' copy state back
            e.ticker, e.off = None, "not started"


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_native_in_child)


def register_exit_hook() -> None:
    """Stop every live native tick at interpreter exit (registered once, on the first native tick made)."""
    global _exit_hook
    if not _exit_hook:
        _exit_hook = True
        atexit.register(_stop_native_at_exit)


class Engagement:
    """One monitor's native quiet tick: the ticker (None until made, or when it cannot be), why it is not used
    (``off``), and the tick statistics (:meth:`total`).

    ``lock``: the monitor's lock (an RLock); every hand-over happens under it. ``stop_event``: set at exit so the
    reader thread does not re-engage a stopped ticker."""

    def __init__(self, lock: threading.RLock, stop_event: threading.Event, native_tick: str) -> None:
        self._lock = lock
        self.stop_event = stop_event
        self._wanted = native_tick
        self.ticker: NativeTicker | None = None
        self.off: str | None = "not started" if native_tick != "off" else "native_tick=off"
        # Tick statistics: (ticks, idle skips, quiet reads) of the engagements that ended, and Python's (the monitor
        # counts those here, so that every total is one sum).
        self.native_done = [0, 0, 0]
        self.python = [0, 0, 0]
        self.last_active = float("-inf")  # the latest check() the native thread saw (monotonic seconds)
        self._last_tick = float("-inf")  # the latest tick of a ticker since detached
        self._trace = False
        self.python_spans: collections.deque[tuple[float, float]] | None = None
        self._rows_lock = threading.Lock()

    # ------------------------------------------------------------------ state
    @property
    def attached(self) -> bool:
        t = self.ticker
        return t is not None and t.attached

    @property
    def status(self) -> str:
        """``"engaged"`` while the native thread runs the quiet ticks, ``"ready"`` while Python ticks, else why the
        native tick is not used."""
        t = self.ticker
        if t is None or self.off is not None:
            return self.off or "not started"
        return "engaged" if t.attached else "ready"

    def live(self) -> tuple[int, int, int]:
        """(ticks, idle skips, quiet reads) of the engagement in progress (0s when none)."""
        t = self.ticker
        return t.live() if t is not None and t.attached else (0, 0, 0)

    def native_total(self, k: int) -> int:
        """Statistic ``k`` (0 ticks, 1 idle skips, 2 quiet reads) of the native thread, ended engagements and the
        one in progress."""
        return self.native_done[k] + self.live()[k]

    def total(self, k: int) -> int:
        """Statistic ``k``, Python's and the native thread's."""
        return self.python[k] + self.native_total(k)

    def last_tick(self) -> float | None:
        """When the native thread last ticked (monotonic seconds), None if it never did."""
        t = self.ticker
        live = t.last_tick() if t is not None else None
        last = max(self._last_tick, live if live is not None else float("-inf"))
        return None if last == float("-inf") else last

    # ------------------------------------------------------------------ making and ending it
    def make(self, interval: float, idle_tail: float, active: bytearray, n_rows: int) -> None:
        """Build (or load) the native tick and start its thread, idle until engaged. Under the monitor's lock, in
        start(). With ``native_tick=on``, raise NativeUnavailable where it cannot be built."""
        if self.ticker is not None or self._wanted == "off":
            return
        try:
            self.ticker = NativeTicker(interval, idle_tail, active, n_rows)
        except NativeUnavailable as e:
            if self._wanted == "on":
                raise NativeUnavailable(f"tripwire: native_tick=on (TRIPWIRE_NATIVE_TICK) but {e}") from None
            if self.off != str(e):
                # A WARNING: on an engine every tick then holds the engine's GIL (benchmarks/RESULTS.md, q3).
                log.warning(
                    "no native quiet tick (%s); every reader tick runs in Python, holding the engine's GIL "
                    "for the whole tick (set TRIPWIRE_NATIVE_TICK=off to choose this and silence the warning)",
                    e,
                )
            self.off = str(e)
            return
        self.off = None
        if self._trace:
            self.ticker.trace(on=True)
        _live.add(self)
        register_exit_hook()

    def set_rows(self, n_rows: int) -> None:
        """Rows to copy from the native tick's next tick on (a site was registered: no re-engagement)."""
        ticker = self.ticker
        if ticker is not None:
            with self._rows_lock:  # size read and stored in order: an older, smaller size never lands last
                ticker.set_rows(n_rows)

    def retire(self, ticker: NativeTicker, paused: bool, timeout: float | None) -> None:
        """After stop() joined the reader thread: close ``ticker`` (the one stop() kicked). A ticker stuck in a
        driver call (``paused`` False: a hung stream) keeps the readers it holds and exits when the call returns;
        it is never re-engaged."""
        if self.ticker is not ticker:
            return
        self.ticker = None
        if paused:
            self.off = "stopped"
            ticker.close(timeout)  # freed when collected: a concurrent stop() may still hold it
        else:
            self.off = "stuck in a driver call at stop()"
            ticker.close(0.0)
            log.error("the native tick is stuck in a driver call; leaving it behind")

    # ------------------------------------------------------------------ hand-over
    def pause(self, timeout: float | None = None) -> bool:
        """Take the readers back from the native tick, if it holds them (or handed them back), and fold its
        statistics in. Every Python access to a reader's copy state goes after this. Waits for a native tick in
        progress (microseconds; never the GPU), at most ``timeout`` seconds if given: False if it is still in a
        driver call then (the readers stay the native thread's)."""
        ticker = self.ticker
        if ticker is None or not ticker.attached:
            return True
        with self._lock:
            if not ticker.attached:
                return True
            if not ticker.pause(timeout):
                return False
            *stats, error = ticker.detach()
            for k, v in enumerate(stats):
                self.native_done[k] += v
            self.last_active = max(self.last_active, ticker.last_active)
            self._last_tick = max(self._last_tick, ticker.last_tick() or float("-inf"))
            if error is not None:
                # The Python tick that follows repeats the read: a persistent failure loses the reader there (and
                # arms the stop), exactly as without the native tick. Python ticks from now on.
                self.off = f"failed: {error}"
                log.warning("the native quiet tick failed (%s); the reader ticks in Python from now on", error)
        return True

    @property
    def can_engage(self) -> bool:
        """A ticker exists, is usable, and does not hold the readers already (a cheap check before the lock)."""
        t = self.ticker
        return t is not None and not t.attached and self.off is None and not self.stop_event.is_set()

    def maybe_engage(
        self,
        readers: list[DeviceReader],
        reference: Callable[[str], np.ndarray | None],
        *,
        busy: bool,
        relaxed: bool,
        relax: bool,
        n_rows: int,
        capacity: int,
        last_active: float,
    ) -> None:
        """Hand the quiet ticks of ``readers`` (the live ones) to the native thread when nothing needs Python every
        tick: not ``busy`` (no confirmation pending, no tick hook), every reader readable natively, and, with a CUDA
        reader, the capture mode relaxable (``relaxed``: the reader thread relaxed its own; ``relax``: the native
        thread relaxes its, False only in tests' controls). ``reference(device)``: the rows Python processed last.
        Under the monitor's lock, on the reader thread. A failure to engage (more devices than the native tick
        holds...) is logged and leaves Python ticking: nothing is lost."""
        ticker = self.ticker
        if ticker is None or not self.can_engage or busy:
            return
        if not readers or not all(r.supports_native for r in readers):
            return
        fn = None
        cuda = [r for r in readers if r.is_cuda]
        if cuda:
            if not relaxed:
                return  # the fallback pauses during visible captures: only Python ticks do that
            if relax:
                fn = cuda[0].driver.raw["cuThreadExchangeStreamCaptureMode"]  # type: ignore[union-attr]
                if fn is None:
                    return
        try:
            refs = [reference(r.name) for r in readers]
            ticker.engage(readers, refs, n_rows=n_rows, capacity=capacity, last_active=last_active, relax=fn)
        except Exception as e:
            self.off = f"failed to engage: {type(e).__name__}: {e}"
            log.warning("the native quiet tick cannot engage (%s); the reader ticks in Python", e)

    def wait(self, timeout: float) -> None:
        ticker = self.ticker
        if ticker is not None:
            ticker.wait(timeout)

    def kick(self) -> None:
        ticker = self.ticker
        if ticker is not None:
            ticker.kick()

    # ------------------------------------------------------------------ benchmarks
    def trace(self, on: bool | None = None) -> np.ndarray:
        """The native tick spans kept in the ring (``[k, 2]`` CLOCK_MONOTONIC ns), oldest first; ``on`` switches
        recording, for this ticker and the ones made by later starts (benchmarks only)."""
        if on is not None:
            self._trace = on
            self.python_spans = collections.deque(maxlen=_TRACE_SPANS) if on else None
        t = self.ticker
        return t.trace(on) if t is not None else np.zeros((0, 2), dtype=np.int64)

    def spans(self, on: bool | None = None) -> list[tuple[float, float]]:
        """Tick spans ``(start, end)`` in ``time.perf_counter`` seconds, sorted: the reader thread's Python ticks
        (the monitor appends them to ``python_spans`` while tracing) and the native thread's (CLOCK_MONOTONIC,
        perf_counter's clock on Linux), the last few thousand of each. ``on`` switches recording."""
        native = [(a / 1e9, b / 1e9) for a, b in self.trace(on).tolist()]
        return sorted([*(self.python_spans or ()), *native])

    def cpu_s(self) -> float | None:
        """The native thread's CPU time so far (s), or None (benchmarks)."""
        t = self.ticker
        return t.cpu_s() if t is not None else None
