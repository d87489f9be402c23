"""The monitor: the sites' reported state, the armed stop, the reader thread and the lifecycle.

Lifecycle in an engine::

    tripwire.prealloc(device)        # before any capture: arena + the reader's mirror, stream and event
    ... warm-up, capture graphs ...
    tripwire.start()                 # post-capture hooks, then the reader thread (unless mode is off)
    loop: tripwire.check(); step()   # one attribute read per step; raises GuardTripped when armed
    shutdown: tripwire.drain()       # a final synchronous read: a hit on the last step is not lost

Reporting: a rise first seen in copy k is confirmed and reported from copy k+1 (kernels bump the count before the
extremes, so copy k may hold the count without them). Reports are aggregated per site and device: at most one line
per ``report_every`` seconds, carrying the delta since the last line.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ._native import NativeTicker, NativeUnavailable
from .arena import Arena, normalize_device, unindexed_cuda
from .capture import install_capture_watch, is_capturing, relax_thread_capture_mode, visible_captures
from .config import Settings, load_settings
from .errors import CaptureError, GuardTripped
from .layout import (
    COUNT,
    FIRST_ROW,
    FIRST_VALUE,
    MAX_ROW,
    MAX_VALUE,
    NEG_MIN,
    SLOTS,
    VALUE_MAX,
    VALUE_MIN,
    decode,
    decode_neg,
)
from .reader import DeviceReader
from .sites import GUARD_KINDS, Site, SiteRegistry, default_registry

__all__ = ["GuardReporter", "Hit", "Monitor", "RowReporter", "register_reporter"]

log = logging.getLogger("tripwire")

# Monitors whose native tick may be running: stopped at interpreter exit, before torch frees the pinned mirrors it
# reads (the Python reader is a daemon thread and is simply frozen; a native thread would keep running).
_live_tickers: weakref.WeakSet[Monitor] = weakref.WeakSet()
_exit_hook = False


# At exit, how long to wait for a native tick stuck in a driver call (a hung stream) before leaving it behind.
_EXIT_JOIN_S = 1.0


def _stop_native_at_exit() -> None:
    for m in list(_live_tickers):
        m._stop_evt.set()
        ticker = m._native
        if ticker is not None and not ticker.stop(_EXIT_JOIN_S):
            log.error("tripwire: the native tick is stuck in a driver call at exit; leaving it behind")


def _forget_native_in_child() -> None:
    # The child has no native thread (only the forking thread survives fork): drop the parent's tickers without
    # calling into them (their mutex may have been held at the fork); a start() in the child makes a new one.
    for m in list(_live_tickers):
        t = m._native
        if t is not None:
            t._forked = True
            if t.attached:
                t.detach()  # Python-only: hands the readers' copy state back
            m._native, m._native_off = None, "not started"


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_native_in_child)


def _register_exit_hook() -> None:
    global _exit_hook
    if not _exit_hook:
        _exit_hook = True
        atexit.register(_stop_native_at_exit)


# A confirmation waits at most this many extra copies for a first-offender pair that has not landed yet.
_MAX_EXTRA_CONFIRM_COPIES = 3
# Re-poll delay while a confirmation is pending (a D2H copy of the arena lands in tens of microseconds).
_CONFIRM_REPOLL_S = 0.001


@dataclass(frozen=True)
class Hit:
    """Decoded guard row. ``first_row``/``first_value`` are one real hit; the extremes are independent lifetime
    extremes (the max row and the max value may come from different hits). None where nothing was recorded."""

    count: int
    first_row: int | None
    first_value: int | None
    max_row: int | None
    max_value: int | None
    min_value: int | None

    @classmethod
    def from_row(cls, row: np.ndarray) -> Hit:
        return cls(
            count=int(row[COUNT]),
            first_row=decode(int(row[FIRST_ROW])),
            first_value=decode(int(row[FIRST_VALUE])),
            max_row=decode(int(row[MAX_ROW])),
            max_value=decode(int(row[MAX_VALUE])),
            min_value=decode_neg(int(row[NEG_MIN])),
        )


class RowReporter(Protocol):
    """Turns confirmed rises of one kind of row into reports. ``count_slots``: the slots whose sum rising means
    new events. ``confirm`` runs under the monitor's lock on the reader thread (or drain's caller); ``tick`` runs on
    every poll with the latest rows of every device (for heartbeats)."""

    count_slots: tuple[int, ...]

    def confirm(self, monitor: Monitor, device: str, site: Site, row: np.ndarray, now: float) -> None: ...

    def tick(self, monitor: Monitor, latest: dict[str, np.ndarray], now: float) -> None: ...


_REPORTER_FACTORIES: dict[str, Callable[[], Any]] = {}


def register_reporter(kind: str, factory: Callable[[], Any]) -> None:
    """Plug in the reporter for rows of ``kind`` (numeric instruments do this at import)."""
    _REPORTER_FACTORIES[kind] = factory


def _fmt(v: int | None) -> str:
    if v is None:
        return "-"
    if v >= VALUE_MAX or v <= VALUE_MIN:
        return f"{v} (saturated: |value| >= 2**62)"
    return str(v)


def _accesses(n: int) -> str:
    return f"{n} out-of-range access{'' if n == 1 else 'es'}"


def guard_message(site: Site, device: str, hit: Hit, *, delta: int | None = None) -> str:
    """The report of a guard row (the logger's name already says tripwire, so no prefix)."""
    fatal = " (FATAL site: the masked value was written somewhere durable)" if site.fatal else ""
    if delta is not None:
        what = f"{delta} new {_accesses(delta)[len(str(delta)) + 1 :]} masked ({hit.count} total)"
    else:
        what = f"{_accesses(hit.count)} masked"
    desc = f" [{site.description}]" if site.description else ""
    return (
        f"MASKED FAULT at site {site.name!r} on {device}{fatal}: {what}; those lanes did NOT compute a correct "
        f"result.{desc} First offender: row {_fmt(hit.first_row)}, value {_fmt(hit.first_value)}. Lifetime "
        f"extremes (independent, not one hit): max row {_fmt(hit.max_row)}, value min {_fmt(hit.min_value)} max "
        f"{_fmt(hit.max_value)}. Look at the metadata entry at the first offender's row."
    )


class GuardReporter:
    """The reporter of guard-layout rows: a WARNING per confirmed rise (aggregated per site and device), and the
    stop armed in ``raise`` mode or for a fatal site. Subclasses change only the wording (``message``)."""

    count_slots: tuple[int, ...] = (COUNT,)
    message = staticmethod(guard_message)

    def confirm(self, monitor: Monitor, device: str, site: Site, row: np.ndarray, now: float) -> None:
        hit = Hit.from_row(row)
        message = self.message
        monitor.emit((device, site.id), hit.count, now, lambda delta: message(site, device, hit, delta=delta))
        if monitor.settings.mode == "raise" or site.fatal:
            monitor.arm(monitor.tripped_for(site, device, hit, message))

    def tick(self, monitor: Monitor, latest: dict[str, np.ndarray], now: float) -> None:
        return None


for _kind in GUARD_KINDS:
    register_reporter(_kind, GuardReporter)


@dataclass
class _Emitted:
    logged_total: int = 0
    logged_at: float = float("-inf")
    total: int = 0
    render: Callable[[int], str] | None = None  # set while a line is deferred by the window
    level: int = logging.WARNING


class Monitor:
    """Holds the reported state of every row, the armed stop and the reader thread.

    Every setting is a keyword argument (``mode``, ``interval``, ``idle_tail``, ``report_every``, ``capacity``,
    ``heartbeat``, ``native_tick``), validated exactly like the ``TRIPWIRE_*`` variables it overrides. A fresh
    Monitor has its own arena, reader and reported state, so tests can build one each. ``registry`` defaults to the
    process-wide one.
    """

    def __init__(
        self,
        *,
        mode: str | None = None,
        interval: float | None = None,
        idle_tail: float | None = None,
        report_every: float | None = None,
        capacity: int | None = None,
        heartbeat: float | None = None,
        native_tick: str | None = None,
        registry: SiteRegistry | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.settings: Settings = load_settings(
            env,
            mode=mode,
            interval=interval,
            idle_tail=idle_tail,
            report_every=report_every,
            capacity=capacity,
            heartbeat=heartbeat,
            native_tick=native_tick,
        )
        self.registry = registry if registry is not None else default_registry()
        self.arena = Arena(self.registry, self.settings.capacity)
        self._lock = threading.RLock()
        self._readers: dict[torch.device, DeviceReader] = {}
        # The armed stop. check() reads only this attribute (and sets _act).
        self._tripped: GuardTripped | None = None
        # check() sets this byte (the reader's idle detection). A bytearray, not a bool attribute, so that the native
        # tick reads and clears it without the GIL (it exchanges it to 0 in C; Python clears it in _poll).
        self._act = bytearray(b"\x01")
        self._last_active = time.monotonic()
        self._thread: threading.Thread | None = None
        self._stop_evt = threading.Event()
        self._started = False
        self._hooks: list[Callable[[], Any]] = []
        self._hooks_run = 0
        self._tick_hooks: list[Callable[[Monitor], None]] = []
        self._arm_listeners: list[Callable[[GuardTripped], None]] = []
        self._arm_queue: list[GuardTripped] = []  # armed under the lock, listeners not yet called
        self._reporters: dict[str, RowReporter] = {}
        # Per device: reported progress per row, and the rows pending confirmation
        # (row -> [extra copies waited, progress seen in the newest copy]).
        self._reported: dict[str, np.ndarray] = {}
        self._pending: dict[str, dict[int, list[int]]] = {}
        self._latest: dict[str, np.ndarray] = {}
        self._emitted: dict[tuple[str, int], _Emitted] = {}
        # Per registry size: the row ids of each kind, and the progress plan (slot, 0/1 mask or None = every row).
        self._kind_index: tuple[int, dict[str, np.ndarray], tuple[tuple[int, np.ndarray | None], ...]] = (-1, {}, ())
        self._relaxed: str | None = None  # how the latest reader thread's capture mode was relaxed
        # The capture mode is per THREAD: a reader thread started again after stop() must relax its own.
        self._tls = threading.local()
        self._skip_relax = False  # tests' control only: a reader that keeps the global mode
        self._ticks = 0
        self._native_ticks = 0  # of which the native thread ran (folded in when it hands the readers back)
        self._quiet_ticks = 0
        self._idle_skips = 0
        self.loop_errors = 0
        # The native quiet tick (tripwire._native): made at start() unless native_tick is off or it cannot be built
        # (_native_off then says why, for the log and the tests).
        self._native: NativeTicker | None = None
        self._rows_lock = threading.Lock()
        self._native_off: str | None = "not started" if self.settings.native_tick != "off" else "native_tick=off"
        self.registry.add_listener(self._on_register)

    # ------------------------------------------------------------------ statistics
    def _native_live(self, k: int) -> int:
        """The native thread's ``live()[k]`` (ticks, idle skips, quiet reads) since it engaged; 0 when not engaged
        (detach has folded them into Python's counters)."""
        t = self._native
        return t.live()[k] if t is not None and t.attached else 0

    @property
    def ticks(self) -> int:
        """Reader ticks so far: Python's and the native tick's."""
        return self._ticks + self._native_live(0)

    @property
    def idle_skips(self) -> int:
        """Ticks that copied nothing because no check() arrived for idle_tail."""
        return self._idle_skips + self._native_live(1)

    @property
    def quiet_ticks(self) -> int:
        """Device reads that landed unchanged and were not decoded (one per device per tick)."""
        return self._quiet_ticks + self._native_live(2)

    @property
    def native_tick(self) -> str:
        """``"engaged"`` while the native thread runs the quiet ticks, ``"ready"`` while Python ticks (a change is
        being confirmed, a tick hook is installed...), else why it is not used."""
        t = self._native
        if t is None or self._native_off is not None:
            return self._native_off or "not started"
        return "engaged" if t.attached else "ready"

    # ------------------------------------------------------------------ arena
    def prealloc(self, device: torch.device | str | int) -> torch.Tensor:
        """Allocate ``device``'s arena and its reader's pinned mirror, side stream and event. Call it before any
        capture (raises CaptureError inside one, leaving the capture usable). Idempotent."""
        dev = normalize_device(device)
        with self._lock:
            if is_capturing() and (self.arena.get(dev) is None or dev not in self._readers):
                raise CaptureError(
                    f"tripwire.prealloc({str(dev)!r}) inside a CUDA-graph capture: the arena and the reader's "
                    f"mirror must be allocated before capturing"
                )
            t = self.arena.prealloc(dev)
            if dev not in self._readers:
                self._native_pause()  # the native tick reads a fixed set of readers: re-engage with this one too
                self._readers[dev] = DeviceReader(dev, t)
            return t

    def counter(self, site: Site, device: torch.device | str | int) -> torch.Tensor:
        """``site``'s int64 ``[8]`` row on ``device``, for a kernel argument. The hot path is one dict lookup; the
        first call for a (site, device) may allocate the arena, which raises CaptureError inside a capture."""
        hit = self.arena._views.get((id(site), device))
        if hit is not None and hit[0] is site:
            return hit[1]
        # "cuda" (no index) is normalised on every call, never cached as is: it means the CURRENT device, which
        # can change (a cached row of cuda:0 handed to a kernel on cuda:1 would be an illegal access).
        dev = normalize_device(device)
        if self.arena.get(dev) is None or dev not in self._readers:
            self.registry.resolve(site)  # a bad site is the clearer error
            if is_capturing():
                raise CaptureError(
                    f"tripwire: counter({getattr(site, 'name', site)!r}, {str(dev)!r}) inside a CUDA-graph capture "
                    f"but no arena exists for {dev}; call tripwire.prealloc({str(dev)!r}) before capturing"
                )
            self.prealloc(dev)
        return self.arena.counter(site, dev if unindexed_cuda(device) else device)

    # ------------------------------------------------------------------ the stop
    def check(self) -> None:
        """Raise the armed :class:`GuardTripped`, if any. Call it at the top of each engine step.

        It reads one attribute and sets one byte (the reader's idle detection); it never touches the GPU. The raise
        is late by up to about two reader intervals, and local to this process unless
        :func:`tripwire.distributed.coordinate` is on.
        """
        tripped = self._tripped
        if tripped is not None:
            # Drop the previous raise's traceback: an engine that catches and retries must not grow it forever.
            raise tripped.with_traceback(None)
        self._act[0] = 1  # one byte store (~20 ns); the reader (Python or native) clears it

    @property
    def armed(self) -> GuardTripped | None:
        return self._tripped

    def arm(self, exc: GuardTripped) -> None:
        """Arm the stop with ``exc`` (the first arming wins; later ones are logged, not lost).

        Arm listeners (tripwire.distributed publishing the stop) never run under the monitor's lock: when the
        caller holds it (a confirmation inside a tick or a drain), they run once the lock is released.
        """
        nested = self._lock._is_owned()  # type: ignore[attr-defined]  # RLock: does this thread hold it?
        with self._lock:
            if self._tripped is not None:
                log.debug("tripwire: already armed; also: %s", exc)
                return
            self._tripped = exc
            self._arm_queue.append(exc)
        log.error("stop ARMED: %s", exc)
        if not nested:
            self._fire_arm_listeners()

    def _fire_arm_listeners(self) -> None:
        with self._lock:
            queued, self._arm_queue = self._arm_queue, []
            listeners = list(self._arm_listeners)
        for exc in queued:
            for fn in listeners:
                try:
                    fn(exc)
                except Exception:
                    log.exception("tripwire: an arm listener failed")

    def tripped_for(
        self, site: Site, device: str, hit: Hit, message: Callable[..., str] = guard_message
    ) -> GuardTripped:
        """The GuardTripped for a confirmed hit of a guard-layout row (``message`` words the report)."""
        return GuardTripped(
            "tripwire: " + message(site, device, hit) + " The engine was stopped by tripwire.check().",
            site=site.name,
            device=device,
            count=hit.count,
            first_row=hit.first_row,
            first_value=hit.first_value,
            fatal=site.fatal,
        )

    def add_arm_listener(self, fn: Callable[[GuardTripped], None]) -> None:
        """Call ``fn(exc)`` when the stop is armed (used by tripwire.distributed to publish it)."""
        if not callable(fn):
            raise TypeError(f"an arm listener must be callable, got {fn!r}")
        self._arm_listeners.append(fn)

    def remove_arm_listener(self, fn: Callable[[GuardTripped], None]) -> None:
        with self._lock:
            if fn in self._arm_listeners:
                self._arm_listeners.remove(fn)

    def add_tick_hook(self, fn: Callable[[Monitor], None]) -> None:
        """Call ``fn(monitor)`` on every reader tick, idle ones included (tripwire.distributed polls its store)."""
        if not callable(fn):
            raise TypeError(f"a tick hook must be callable, got {fn!r}")
        with self._lock:  # atomic with _maybe_engage's hook check (made under the lock)
            self._tick_hooks.append(fn)
            self._native_pause()  # hooks run on Python ticks: every tick must be Python's while any is installed

    def remove_tick_hook(self, fn: Callable[[Monitor], None]) -> None:
        if fn in self._tick_hooks:
            self._tick_hooks.remove(fn)

    # ------------------------------------------------------------------ lifecycle
    def register_post_capture_hook(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` once at :meth:`start` (or at once, if start already ran). A failing hook is logged and does
        not stop the others or the engine."""
        if not callable(fn):
            raise TypeError(f"a post-capture hook must be callable, got {fn!r}")
        with self._lock:
            self._hooks.append(fn)
            run_now = self._started
        if run_now:
            self.run_post_capture_hooks()

    def run_post_capture_hooks(self) -> None:
        """Run every hook that has not run yet, each once, in registration order."""
        while True:
            with self._lock:
                if self._hooks_run >= len(self._hooks):
                    return
                fn = self._hooks[self._hooks_run]
                self._hooks_run += 1
            try:
                fn()
            except Exception:
                log.exception("tripwire: post-capture hook %r failed; continuing with the others", fn)

    def start(self) -> None:
        """Run the post-capture hooks, then start the reader thread unless mode is off. Idempotent.

        Call it after warm-up and capture. The reader relaxes its own capture mode, so later captures (new batch
        sizes, torch.compile's lazily recorded graphs) stay safe too.
        """
        with self._lock:
            first = not self._started
            self._started = True
            self._act[0] = 1
            self._last_active = time.monotonic()
        if first:
            self.run_post_capture_hooks()
        if self.settings.mode == "off":
            return
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._make_native()
            self._stop_evt.clear()
            self._thread = threading.Thread(target=self._run, name="tripwire-reader", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop and join the reader thread and the native tick (reports already made stay made; use drain for a
        final read)."""
        with self._lock:
            thread = self._thread
            self._stop_evt.set()
        ticker = self._native
        if ticker is not None:
            ticker.kick()  # ends the reader thread's native wait
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.error("tripwire: the reader thread did not stop within %s s", timeout)
        paused = self._native_pause(timeout)
        with self._lock:
            if self._thread is thread:
                self._thread = None
            if ticker is not None and self._native is ticker and (thread is None or not thread.is_alive()):
                self._native = None
                if paused:
                    self._native_off = "stopped"
                    ticker.close(timeout)  # freed when collected: a concurrent stop() may still hold it
                else:
                    # A native tick stuck in a driver call (a hung stream): it keeps the readers it holds and exits
                    # when the call returns; Python never re-engages it (nor touches those readers' copies safely).
                    self._native_off = "stuck in a driver call at stop()"
                    ticker.close(0.0)
                    log.error("tripwire: the native tick is stuck in a driver call; leaving it behind")

    # ------------------------------------------------------------------ the native quiet tick
    def _make_native(self) -> None:
        """Build (or load) the native tick and start its thread, idle until engaged. Under the lock, in start()."""
        if self._native is not None or self.settings.native_tick == "off":
            return
        try:
            self._native = NativeTicker(
                self.settings.interval,
                self.settings.idle_tail,
                self._act,
                min(len(self.registry), self.settings.capacity),
            )
        except NativeUnavailable as e:
            if self.settings.native_tick == "on":
                raise NativeUnavailable(f"tripwire: native_tick=on (TRIPWIRE_NATIVE_TICK) but {e}") from None
            if self._native_off != str(e):
                # A WARNING: on an engine this costs the step loop ~10x more reader time (the GIL, every tick).
                log.warning(
                    "tripwire: no native quiet tick (%s); every reader tick runs in Python, holding the engine's GIL "
                    "~0.2 ms per tick (set TRIPWIRE_NATIVE_TICK=off to choose this and silence the warning)",
                    e,
                )
            self._native_off = str(e)
            return
        self._native_off = None
        _live_tickers.add(self)
        _register_exit_hook()

    def _on_register(self, n: int) -> None:
        """A site was registered: the native tick copies its row from its next tick on (no re-engagement)."""
        ticker = self._native
        if ticker is not None:
            with self._rows_lock:  # size read and stored in order: an older, smaller size never lands last
                ticker.set_rows(min(len(self.registry), self.settings.capacity))

    def _native_pause(self, timeout: float | None = None) -> bool:
        """Take the readers back from the native tick, if it holds them (or handed them back), and fold its
        statistics in. Every Python access to a reader's copy state goes after this. Waits for a native tick in
        progress (microseconds; never the GPU), at most ``timeout`` seconds if given: False if it is still in a
        driver call then (the readers stay the native thread's)."""
        ticker = self._native
        if ticker is None or not ticker.attached:
            return True
        with self._lock:
            if not ticker.attached:
                return True
            if not ticker.pause(timeout):
                return False
            ticks, idle, quiet, error = ticker.detach()
            self._ticks += ticks
            self._native_ticks += ticks
            self._idle_skips += idle
            self._quiet_ticks += quiet
            self._last_active = max(self._last_active, ticker.last_active)
            if error is not None:
                # The Python tick that follows repeats the read: a persistent failure loses the reader there (and
                # arms the stop), exactly as without the native tick. Python ticks from now on.
                self._native_off = f"failed: {error}"
                log.warning(
                    "tripwire: the native quiet tick failed (%s); the reader ticks in Python from now on", error
                )
        return True

    def _maybe_engage(self) -> None:
        """Hand the quiet ticks to the native thread when nothing needs Python every tick: no confirmation pending,
        no tick hook, every live reader readable natively, the capture mode relaxable. On the reader thread."""
        ticker = self._native
        if ticker is None or ticker.attached or self._native_off is not None or self._stop_evt.is_set():
            return
        with self._lock:
            if any(self._pending.values()) or self._tick_hooks:
                return
            readers = [r for r in self._readers.values() if r.lost is None]
            if not readers or not all(r.supports_native for r in readers):
                return
            relax = None
            cuda = [r for r in readers if r.is_cuda]
            if cuda:
                if self._relaxed is None:
                    return  # the fallback pauses during visible captures: only Python ticks do that
                if not self._skip_relax:
                    relax = cuda[0]._drv.raw["cuThreadExchangeStreamCaptureMode"]  # type: ignore[union-attr]
                    if relax is None:
                        return
            try:
                ticker.engage(
                    readers,
                    [self._quiet_reference(r.name) for r in readers],
                    n_rows=min(len(self.registry), self.settings.capacity),
                    capacity=self.settings.capacity,
                    last_active=self._last_active,
                    relax=relax,
                )
            except Exception as e:  # e.g. more devices than the native tick holds: Python ticks, nothing is lost
                self._native_off = f"failed to engage: {type(e).__name__}: {e}"
                log.warning("tripwire: the native quiet tick cannot engage (%s); the reader ticks in Python", e)

    def _duty_wait(self) -> float:
        """How long the reader thread may leave every tick to the native thread: until the next deferred report line
        is due, and at most a quarter of the heartbeat (the numeric instruments' heartbeats run on Python ticks)."""
        s = self.settings
        wait = max(s.interval, s.heartbeat / 4)
        now = time.monotonic()
        with self._lock:
            for st in self._emitted.values():
                if st.render is not None:
                    wait = min(wait, st.logged_at + s.report_every - now)
        return max(wait, 0.0)

    @property
    def reader_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        interval = self.settings.interval
        # While a rise waits for its confirming copy (already in flight: it was started by the tick that saw the
        # rise), re-poll after ~1 ms instead of a full interval, so detection costs about one interval, not two.
        fast = min(interval, _CONFIRM_REPOLL_S)
        wait = interval
        try:
            # A restart (stop/start) already knows every device's last rows: hand the quiet ticks to the native thread
            # at once rather than after a first Python tick (that tick is where most of a Python tick's cost is).
            self._relax_once()
            self._maybe_engage()
        except Exception:
            log.exception("tripwire: engaging the native tick failed; the reader ticks in Python")
            self._native_off = "failed to engage"
        while True:
            ticker = self._native
            if ticker is not None and ticker.attached:
                # The native thread ticks; this thread sleeps with the GIL released until a copy changed, a native
                # call failed, someone paused it (drain, poll, prealloc), stop(), or a Python duty is due.
                ticker.wait(self._duty_wait())
                if self._stop_evt.is_set():
                    break
            elif self._stop_evt.wait(wait):
                break
            try:
                self._native_pause()
                self._poll(on_reader_thread=True)
                self._maybe_engage()
            except Exception as e:  # the loop itself failed: log, arm, keep going
                self.loop_errors += 1
                log.exception("tripwire: reader tick failed")
                self.arm(
                    GuardTripped(
                        f"tripwire: the reader loop failed ({type(e).__name__}: {e}); hits may go unseen, so the "
                        f"engine is stopped",
                        site="<reader>",
                        device="*",
                        count=0,
                    )
                )
            wait = fast if any(self._pending.values()) else interval

    # ------------------------------------------------------------------ reading
    def poll(self) -> None:
        """One reader tick on the calling thread (tests and tools). Never waits on the GPU. Under ``off`` it reads
        nothing (the mode's contract)."""
        if self.settings.mode == "off":
            return
        self._poll(on_reader_thread=False)  # it takes the readers back from the native tick, under the lock

    def _relax_once(self) -> None:
        if getattr(self._tls, "relax_tried", False) or not torch.cuda.is_initialized():
            return
        self._tls.relax_tried = True
        if self._skip_relax:
            self._relaxed = "skipped (control)"
            return
        self._relaxed = relax_thread_capture_mode()
        if self._relaxed is None:
            install_capture_watch()

    def _poll(self, *, on_reader_thread: bool) -> None:
        now = time.monotonic()
        if on_reader_thread:
            self._relax_once()  # before this thread's first CUDA call (reads, or a tick hook's abort)
        with self._lock:
            # Under the lock: between a pause taken before it and this lock, the reader thread could re-engage.
            self._native_pause()
            self._ticks += 1
            if self._act[0]:
                self._act[0] = 0
                self._last_active = now
            pending = any(self._pending.values())
            idle = not pending and now - self._last_active > self.settings.idle_tail
            if idle:
                self._idle_skips += 1
            else:
                self._read_all(now, on_reader_thread=on_reader_thread)
            self._flush_due(now)
            for reporter in list(self._reporters.values()):
                reporter.tick(self, self._latest, now)
        self._fire_arm_listeners()
        for fn in list(self._tick_hooks):
            try:
                fn(self)
            except Exception:
                log.exception("tripwire: tick hook %r failed", fn)

    def _read_all(self, now: float, *, on_reader_thread: bool) -> None:
        n = min(len(self.registry), self.settings.capacity)
        for reader in list(self._readers.values()):
            if reader.lost is not None:
                continue
            if reader.is_cuda and on_reader_thread:
                self._relax_once()  # CUDA may have been initialised since the top of the tick
                if self._relaxed is None and visible_captures() > 0:
                    continue  # fallback: pause while a capture we can see is in progress
            same_as = self._quiet_reference(reader.name)
            try:
                rows = reader.poll(n, same_as)
            except Exception as e:
                self._lose(reader, e)
                continue
            if rows is None:
                continue
            if rows is same_as:
                self._quiet_ticks += 1
                continue
            self._process(reader.name, rows, now, final=False)

    def _quiet_reference(self, device: str) -> np.ndarray | None:
        """The rows a landed copy may be compared with to skip its decode (the quiet-tick fast path), or None.

        Rows identical to the last processed ones change nothing in _process (no rise, no fall, same registry
        size), unless a confirmation is waiting: those count copies (and give up after a few), so then every landed
        copy must reach _process."""
        return None if self._pending.get(device) else self._latest.get(device)

    def _lose(self, reader: DeviceReader, e: BaseException) -> None:
        # Stop polling this device, but KEEP its arena: captured graphs still write there.
        reader.lost = e
        latest = self._latest.get(reader.name)
        if latest is not None and self._pending.get(reader.name):
            # Rises already seen there would otherwise never be reported (nobody polls the device again).
            self._process(reader.name, latest, time.monotonic(), final=True)
        self._pending.pop(reader.name, None)
        log.error(
            "tripwire: reading the counters of %s failed (%s: %s); no longer polling it",
            reader.name,
            type(e).__name__,
            e,
        )
        self.arm(
            GuardTripped(
                f"tripwire: lost the reader of {reader.name} ({type(e).__name__}: {e}); fatal-site hits there can no "
                f"longer be seen, so the engine is stopped",
                site="<reader>",
                device=reader.name,
                count=0,
            )
        )

    def _reporter(self, kind: str) -> RowReporter:
        rep = self._reporters.get(kind)
        if rep is None:
            factory = _REPORTER_FACTORIES.get(kind)
            if factory is None:
                raise KeyError(f"no reporter registered for rows of kind {kind!r}")
            rep = self._reporters[kind] = factory()
        return rep  # type: ignore[no-any-return]

    def _kinds(self, n: int) -> tuple[dict[str, np.ndarray], tuple[tuple[int, np.ndarray | None], ...]]:
        """Row ids per kind, and how to compute every row's progress (the sum of its kind's count slots) as a few
        whole-column numpy operations: ``(slot, mask)`` pairs, mask None when every row counts that slot. Built
        once per registry size: the tick then does no fancy indexing (it cost ~20 ns per row per tick)."""
        cached_n, index, plan = self._kind_index
        if cached_n != n:
            groups: dict[str, list[int]] = {}
            for site in self.registry.all()[:n]:
                if site.kind not in _REPORTER_FACTORIES:
                    # Logged once per registry change, not every tick; such rows are read but never reported.
                    log.error(
                        "tripwire: no reporter for rows of kind %r (site %r): import the module that defines it",
                        site.kind,
                        site.name,
                    )
                    continue
                groups.setdefault(site.kind, []).append(site.id)
            index = {k: np.asarray(v, dtype=np.int64) for k, v in groups.items()}
            counts = np.zeros((n, SLOTS), dtype=bool)
            counts[:, COUNT] = True  # rows without a reporter: slot 0, like guard rows (read, never reported)
            for kind, ids in index.items():
                counts[ids] = False
                for slot in self._reporter(kind).count_slots:
                    counts[ids, slot] = True
            plan = tuple(
                (slot, None if counts[:, slot].all() else counts[:, slot].astype(np.int64))
                for slot in range(SLOTS)
                if counts[:, slot].any()
            )
            self._kind_index = (n, index, plan)
        return index, plan

    def _process(self, device: str, rows: np.ndarray, now: float, *, final: bool) -> None:
        n = rows.shape[0]
        self._latest[device] = rows
        reported = self._reported.get(device)
        if reported is None or reported.shape[0] < self.settings.capacity:
            grown = np.zeros(self.settings.capacity, dtype=np.int64)
            if reported is not None:
                grown[: reported.shape[0]] = reported
            reported = self._reported[device] = grown
        pending = self._pending.setdefault(device, {})
        index, plan = self._kinds(n)
        for kind in index:
            # Reporters are made lazily and reset() drops them; _poll ticks (heartbeats) only those that exist.
            self._reporter(kind)
        # progress = the sum of each row's count slots, one whole-column operation per slot in use (see _kinds).
        progress = np.zeros(n, dtype=np.int64)
        for slot, mask in plan:
            progress += rows[:, slot] if mask is None else rows[:, slot] * mask
        # A counter that went down was zeroed behind our back (reset of another kind): follow it, report nothing.
        down = progress < reported[:n]
        reported[:n][down] = progress[down]
        # 1) Confirm what an earlier copy saw rise, with THIS copy's row (it has the extremes). Wait (a bounded number
        #    of extra copies) while the first-offender pair has not landed, or while the count is still rising: a hit
        #    counted in this copy may not have its extremes in it yet, and confirming now would mark it reported.
        for rid in sorted(pending):
            site = self.registry.by_id(rid)
            row = rows[rid]
            waited, seen = pending[rid]
            not_landed = site.kind in GUARD_KINDS and (row[FIRST_ROW] == 0 or row[FIRST_VALUE] == 0)
            if not final and (not_landed or progress[rid] > seen) and waited < _MAX_EXTRA_CONFIRM_COPIES:
                pending[rid] = [waited + 1, int(progress[rid])]
                continue
            del pending[rid]
            reported[rid] = progress[rid]
            self._reporter(site.kind).confirm(self, device, site, row, now)
        # 2) New rises: pending now, reported from the next copy (or at once when this read is final).
        for rid in np.nonzero(progress > reported[:n])[0].tolist():
            if self.registry.by_id(rid).kind not in _REPORTER_FACTORIES:
                continue
            if final:
                site = self.registry.by_id(rid)
                reported[rid] = progress[rid]
                self._reporter(site.kind).confirm(self, device, site, rows[rid], now)
            elif rid not in pending:
                pending[rid] = [0, int(progress[rid])]

    # ------------------------------------------------------------------ aggregated logging
    def emit(
        self, key: tuple[str, int], total: int, now: float, render: Callable[[int], str], level: int = logging.WARNING
    ) -> None:
        """Log ``render(delta)`` for ``key`` now, or defer it until ``report_every`` has passed since the key's
        last line (then one line carries the whole delta). Nothing is dropped: deferred lines flush on later ticks
        and at drain."""
        st = self._emitted.get(key)
        if st is None:
            st = self._emitted[key] = _Emitted()
        st.total = total
        st.level = level
        if now - st.logged_at >= self.settings.report_every:
            self._log_line(st, render, now)
        else:
            st.render = render

    def _log_line(self, st: _Emitted, render: Callable[[int], str], now: float) -> None:
        delta = st.total - st.logged_total
        st.logged_total, st.logged_at, st.render = st.total, now, None
        log.log(st.level, "%s", render(delta))

    def _flush_due(self, now: float, *, force: bool = False) -> None:
        for st in self._emitted.values():
            if st.render is not None and (force or now - st.logged_at >= self.settings.report_every):
                self._log_line(st, st.render, now)

    # ------------------------------------------------------------------ tools
    def drain(self, raise_on_fatal: bool = False) -> dict[tuple[str, str], Hit]:
        """The final synchronous read, for shutdown and stage ends.

        Synchronises each device, reads every arena through its mirror, reports what the reader had not yet (no
        confirmation wait: the read is complete), flushes aggregated lines, and returns the snapshot. With
        ``raise_on_fatal``, raises GuardTripped for a fatal-site hit (or any hit under raise). Under ``off`` it
        reads nothing and returns ``{}``. Blocking: never call it on the step path or inside a capture.
        """
        if self.settings.mode == "off":
            return {}
        if is_capturing():
            raise CaptureError("tripwire.drain() synchronises the device and cannot run inside a CUDA-graph capture")
        snap = self._final_read()
        if raise_on_fatal:
            for (device, name), hit in snap.items():
                site = self.registry.get(name)
                if site.fatal or self.settings.mode == "raise":
                    armed = self._tripped
                    raise armed if armed is not None else self.tripped_for(site, device, hit)
            if self._tripped is not None:  # armed otherwise: a fatal instrument, a lost reader, a peer's stop
                raise self._tripped
        return snap

    def _final_read(self) -> dict[tuple[str, str], Hit]:
        """Synchronise and read every device, report every rise not yet reported (no confirmation wait: the read
        is complete), flush deferred lines; return the snapshot. Blocking (drain and reset only)."""
        now = time.monotonic()
        snap: dict[tuple[str, str], Hit] = {}
        with self._lock:
            self._native_pause()
            n = min(len(self.registry), self.settings.capacity)
            for reader in list(self._readers.values()):
                if reader.lost is not None:
                    log.error("tripwire: skipping %s, whose reader was lost (%s)", reader.name, reader.lost)
                    continue
                try:
                    rows = reader.read_now(n)
                except Exception as e:
                    self._lose(reader, e)
                    continue
                self._process(reader.name, rows, now, final=True)
                snap.update(self._decode(reader.name, rows))
            self._flush_due(now, force=True)
        self._fire_arm_listeners()
        return snap

    def _decode(self, device: str, rows: np.ndarray) -> dict[tuple[str, str], Hit]:
        out: dict[tuple[str, str], Hit] = {}
        for rid in np.nonzero(rows[:, COUNT])[0].tolist():
            site = self.registry.by_id(rid)
            if site.kind in GUARD_KINDS:
                out[(device, site.name)] = Hit.from_row(rows[rid])
        return out

    def snapshot(self) -> dict[tuple[str, str], Hit]:
        """``{(device, site_name): Hit}`` for every guard row with a non-zero count. A synchronous read (it waits
        for each device's current stream): a tool's call, never the step path's. Call it from the engine thread, or
        while no capture runs (a synchronous copy from another thread invalidates a global-mode capture)."""
        n = min(len(self.registry), self.settings.capacity)
        out: dict[tuple[str, str], Hit] = {}
        for dev, t in self.arena.items():
            out.update(self._decode(str(dev), t[:n].cpu().numpy()))
        return out

    def read_rows(self, device: torch.device | str | int) -> np.ndarray:
        """A synchronous copy of ``device``'s registered rows (tools and numeric instruments' ``totals()``)."""
        dev = normalize_device(device)
        t = self.arena.get(dev)
        n = min(len(self.registry), self.settings.capacity)
        if t is None:
            return np.zeros((n, 8), dtype=np.int64)
        return t[:n].cpu().numpy()

    def reset(self) -> None:
        """Report what is still unreported (a final read, unless mode is off), then zero the counters, forget reported
        counts and pending confirmations, and disarm -- all three, or the next hit would be invisible. Synchronous
        (waits for the device): a tool's call. Call it from the engine thread, or while no capture runs: a
        synchronising call from another thread would invalidate a global-mode capture in progress."""
        if is_capturing():
            raise CaptureError("tripwire.reset() cannot run inside a CUDA-graph capture")
        if self.settings.mode != "off":
            # Nothing is lost: rises seen but not yet confirmed, and lines deferred by the report window, are
            # reported before the counters they describe are zeroed.
            self._final_read()
        with self._lock:
            self._native_pause()  # the reader thread may have re-engaged it since the final read
            self.arena.zero_()
            for dev, reader in self._readers.items():
                if reader.is_cuda:
                    torch.cuda.synchronize(dev)
                reader.discard()  # a copy in flight may hold pre-zero counts
            self._reported.clear()
            self._pending.clear()
            self._latest.clear()
            self._emitted.clear()
            self._reporters.clear()  # reporters keep per-row state (logged totals) too
            self._arm_queue.clear()
            self._tripped = None

    def readers(self) -> dict[str, DeviceReader]:
        return {r.name: r for r in self._readers.values()}
