"""The monitor: the lifecycle, the reader thread, the armed stop, and the tools.

Lifecycle in an engine::

    tripwire.prealloc(device)        # before any capture: arena + the reader's mirror, stream and event
    ... warm-up, capture graphs ...
    tripwire.start()                 # post-capture hooks, then the reader thread (unless mode is off)
    loop: tripwire.check(); step()   # one attribute read per step; raises GuardTripped when armed
    shutdown: tripwire.drain()       # a final synchronous read: a hit on the last step is not lost

A tick: :mod:`tripwire._runtime.reader` copies each arena without waiting on the GPU (quiet ticks run natively:
:mod:`tripwire._runtime.native.engage`), then :mod:`tripwire._runtime.pipeline` confirms, reports and delivers what changed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ._runtime.arena import Arena, normalize_device, unindexed_cuda
from ._runtime.capture import PostCaptureHooks, is_capturing
from ._runtime.health import health_record
from ._runtime.hit import Hit
from ._runtime.loop import run_reader
from ._runtime.native.engage import Engagement
from ._runtime.pipeline import Callbacks, Pipeline
from ._runtime.reader import DeviceReader, Readers
from ._runtime.report import GuardReporter, ReportContext, RowReporter, register_reporter, stop_line, tripped_for
from .config import Settings, SettingView, check_timeout, load_settings
from .contain import RequestNames
from .errors import CaptureError, GuardTripped
from .sinks import Event, JsonLines
from .sites import GUARD_KINDS, Site, SiteRegistry, default_registry

__all__ = ["GuardReporter", "Hit", "Monitor", "ReportContext", "RowReporter", "register_reporter"]

log = logging.getLogger("tripwire")


class Monitor:
    """Holds the reported state of every row, the armed stop and the reader thread.

    Every setting is a keyword argument (``mode``, ``interval``, ``idle_tail``, ``report_every``, ``capacity``,
    ``offenders``, ``heartbeat``, ``native_tick``, ``event_log``, ``store_poll``, ``contain``), validated exactly like the ``TRIPWIRE_*``
    variable it overrides, and readable as a read-only attribute (``monitor.mode``); containment alone is switched on
    a built monitor too, with :meth:`set_contain` (what integrations call). A fresh Monitor has its own
    arena, reader and reported state, so tests can build one each. ``registry`` defaults to the process-wide one.
    """

    mode = SettingView()
    interval = SettingView()
    idle_tail = SettingView()
    report_every = SettingView()
    capacity = SettingView()
    offenders = SettingView()
    heartbeat = SettingView()
    event_log = SettingView()
    store_poll = SettingView()
    contain = SettingView(setter="set_contain")

    def __init__(
        self, *, registry: SiteRegistry | None = None, env: dict[str, str] | None = None, **settings: Any
    ) -> None:
        self.settings: Settings = load_settings(env, **settings)
        self.registry = registry if registry is not None else default_registry()
        self.arena = Arena(self.registry, self.settings.capacity, self.settings.offenders)
        self._lock = threading.RLock()
        self.devices = Readers()
        # The armed stop. check() reads only this attribute (and sets _act).
        self._tripped: GuardTripped | None = None
        # check() sets this byte (the reader's idle detection). A bytearray, not a bool attribute, so that the native
        # tick reads and clears it without the GIL (it exchanges it to 0 in C; Python clears it in _poll).
        self._act = bytearray(b"\x01")
        self._last_active = time.monotonic()
        self._thread: threading.Thread | None = None
        self._stop_evt = threading.Event()
        self._hooks = PostCaptureHooks()
        self._tick_hooks = Callbacks("a tick hook")
        # Engine request ids <-> the numbers kernels keep with offenders (reports and taints name the engine's ids).
        self.requests = RequestNames()
        self.pipeline = Pipeline(self.registry, lambda: self.settings, self.requests, self.arm, lambda: self.armed)
        self._rings: list[Any] = []  # the verdict rings (tripwire.verdict), re-baselined by reset()
        self.confirmer, self.sinks = self.pipeline.confirmer, self.pipeline.sinks
        self._last_tick: float | None = None
        self.loop_errors = 0
        # The native quiet tick: made at start() unless native_tick is off or it cannot be built.
        self.native = Engagement(self._lock, self._stop_evt, self.settings.native_tick)
        self.registry.add_listener(self._on_register)
        if self.settings.event_log is not None:
            self.add_sink(JsonLines(self.settings.event_log))  # opened now: an unwritable path fails here

    # ------------------------------------------------------------------ statistics (health() has them all)
    @property
    def ticks(self) -> int:
        """Reader ticks so far: Python's and the native tick's."""
        return self.native.total(0)

    @property
    def idle_skips(self) -> int:
        """Ticks that copied nothing because no check() arrived for idle_tail."""
        return self.native.total(1)

    @property
    def quiet_ticks(self) -> int:
        """Device reads that landed unchanged and were not decoded (one per device per tick)."""
        return self.native.total(2)

    @property
    def native_tick(self) -> str:
        """``"engaged"`` (the native thread runs the quiet ticks), ``"ready"`` (Python ticks), or why it is unused."""
        return self.native.status

    # ------------------------------------------------------------------ arena
    def prealloc(self, device: torch.device | str | int) -> torch.Tensor:
        """Allocate ``device``'s arena and its reader's pinned mirror, side stream and event. Call it before any
        capture (raises CaptureError inside one, leaving the capture usable). Idempotent."""
        dev = normalize_device(device)
        with self._lock:
            if is_capturing() and (self.arena.get(dev) is None or dev not in self.devices):
                raise CaptureError(
                    f"tripwire.prealloc({str(dev)!r}) inside a CUDA-graph capture: the arena and the reader's "
                    f"mirror must be allocated before capturing"
                )
            t = self.arena.prealloc(dev)
            if dev not in self.devices:
                self.native.pause()  # the native tick reads a fixed set of readers: re-engage with this one too
                self.devices.add(dev, t, self.arena.offenders(dev))
            return t

    def counter(self, site: Site, device: torch.device | str | int) -> torch.Tensor:
        """``site``'s int64 ``[8]`` row on ``device``, for a kernel argument. The hot path is one dict lookup; the
        first call for a (site, device) may allocate the arena, which raises CaptureError inside a capture."""
        hit = self.arena.views.get((id(site), device))
        if hit is not None and hit[0] is site:
            return hit[1]
        dev = normalize_device(device)  # "cuda" (the CURRENT device) is never cached as is: see Arena.counter
        if self.arena.get(dev) is None or dev not in self.devices:
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
        """Raise the armed :class:`GuardTripped`, if any; call it at the top of each engine step. It reads one
        attribute and sets one byte (the reader's idle detection), never the GPU. The raise is late by up to about
        two reader intervals, and local to this process unless :func:`tripwire.distributed.coordinate` is on."""
        tripped = self._tripped
        if tripped is not None:
            # Drop the previous raise's traceback: an engine that catches and retries must not grow it forever.
            raise tripped.with_traceback(None)
        self._act[0] = 1  # one byte store, no lock; the reader (Python or native) clears it

    @property
    def armed(self) -> GuardTripped | None:
        return self._tripped

    def arm(self, exc: GuardTripped) -> None:
        """Arm the stop with ``exc`` (the first arming wins; later ones are logged, not lost). Arm listeners
        (tripwire.distributed publishing the stop) and sinks never run under the monitor's lock: when the caller
        holds it (a confirmation inside a tick or a drain), they run once it is released."""
        nested = self._lock._is_owned()  # type: ignore[attr-defined]  # RLock: does this thread hold it?
        with self._lock:
            if self._tripped is not None:
                log.debug("already armed; a later stop, not armed: %s", str(exc).removeprefix("tripwire: "))
                return
            self._tripped = exc
            self.pipeline.queue_stop(exc)
        log.error("%s", stop_line(exc, self.settings.mode))
        if not nested:
            self._deliver()

    def _deliver(self, wait: bool = True) -> None:
        """Outside the lock: the arm listeners of new stops, then the queued events and the health, to the sinks
        (:meth:`Pipeline.deliver_queued`; ``wait=False``: not while another thread delivers, the reader's tick)."""
        self.pipeline.deliver_queued(self._lock, self.health, wait=wait)

    def add_arm_listener(self, fn: Callable[[GuardTripped], None]) -> None:
        """Call ``fn(exc)`` when the stop is armed (used by tripwire.distributed to publish it)."""
        self.pipeline.arm_listeners.add(fn)

    def remove_arm_listener(self, fn: Callable[[GuardTripped], None]) -> None:
        with self._lock:
            self.pipeline.arm_listeners.discard(fn)

    def add_tick_hook(self, fn: Callable[[Monitor], None]) -> None:
        """Call ``fn(monitor)`` on every reader tick, idle ones included. While any hook is installed every tick is
        a Python tick (the native tick cannot call Python): a cost on the engine's GIL."""
        with self._lock:  # atomic with _maybe_engage's hook check (made under the lock)
            self._tick_hooks.add(fn)
            self.native.pause()  # hooks run on Python ticks: every tick must be Python's while any is installed

    def remove_tick_hook(self, fn: Callable[[Monitor], None]) -> None:
        self._tick_hooks.discard(fn)

    # ------------------------------------------------------------------ reports and sinks
    def add_sink(self, sink: Callable[[Event], None]) -> None:
        """Hand every event from now on to ``sink`` (a callable taking a :class:`tripwire.Event`; see
        :mod:`tripwire.sinks`). The log always gets the reports. Adding the same sink twice adds it once. A sink
        with ``bind`` gets this monitor's :meth:`health` (a metrics sink reads it at each scrape)."""
        with self._lock:
            added = self.pipeline.add_sink(sink)
        if added and hasattr(sink, "bind"):
            sink.bind(self.health)

    def remove_sink(self, sink: Callable[[Event], None]) -> None:
        """Stop handing events to ``sink`` (ValueError if it was not added)."""
        with self._lock:
            self.sinks.remove(sink)

    # ------------------------------------------------------------------ lifecycle
    def register_post_capture_hook(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` once at :meth:`start` (or at once, if start already ran). A failing hook is logged and does
        not stop the others or the engine."""
        self._hooks.register(fn)

    def run_post_capture_hooks(self) -> None:
        """Run every hook that has not run yet, each once, in registration order."""
        self._hooks.run()

    def start(self) -> None:
        """Run the post-capture hooks, then start the reader thread unless mode is off. Idempotent. Call it after
        warm-up and capture; the reader relaxes its own capture mode, so later captures (new batch sizes,
        torch.compile's lazily recorded graphs) stay safe too."""
        with self._lock:
            self._act[0] = 1
            self._last_active = time.monotonic()
        if self._hooks.start():
            self._hooks.run()
        if self.settings.mode == "off":
            return
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            s = self.settings
            self.native.make(s.interval, s.idle_tail, self._act, min(len(self.registry), s.capacity))
            self._stop_evt.clear()
            self._thread = threading.Thread(target=self._run, name="tripwire-reader", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop and join the reader thread and the native tick, waiting at most ``timeout`` seconds for each (None:
        no limit). Reports already made stay made; use drain for a final read."""
        check_timeout("stop", timeout)
        with self._lock:
            thread = self._thread
            self._stop_evt.set()
        ticker = self.native.ticker
        self.native.kick()  # ends the reader thread's native wait
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.error("the reader thread did not stop within %s s", timeout)
        paused = self.native.pause(timeout)
        with self._lock:
            if self._thread is thread:
                self._thread = None
            if ticker is not None and (thread is None or not thread.is_alive()):
                self.native.retire(ticker, paused, timeout)

    @property
    def reader_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def on_reader_thread(self) -> bool:
        """True when called on this monitor's reader thread (which must never wait on anything)."""
        return threading.current_thread() is self._thread

    # ------------------------------------------------------------------ the reader thread
    def _on_register(self, n: int) -> None:
        """A site was registered: the native tick copies its row from its next tick on (no re-engagement)."""
        self.native.set_rows(min(len(self.registry), self.settings.capacity))

    def _maybe_engage(self) -> None:
        """Hand the quiet ticks to the native thread if it may take them (on the reader thread)."""
        if self.native.can_engage:
            with self._lock:
                self.native.maybe_engage(
                    self.devices.live(),
                    self.confirmer.quiet_reference,
                    busy=self.confirmer.any_pending() or bool(self._tick_hooks),
                    relaxed=self.devices.relaxed is not None,
                    relax=self.devices.relax_capture,
                    n_rows=min(len(self.registry), self.settings.capacity),
                    capacity=self.settings.capacity,
                    last_active=max(self._last_active, self.native.last_active),
                )

    def _run(self) -> None:
        def prepare() -> None:
            # A restart (stop/start) already knows every device's last rows: hand the quiet ticks to the native thread
            # at once rather than after a first Python tick (that tick is where most of a Python tick's cost is).
            self.devices.relax_once()
            self._maybe_engage()

        def duty_wait(now: float) -> float:
            with self._lock:
                return self.pipeline.duty_wait(now)

        def tick() -> None:
            self.native.pause()
            self._poll(on_reader_thread=True)
            self._maybe_engage()

        def failed(e: Exception) -> None:
            self.loop_errors += 1
            log.exception("reader tick failed")
            why = f"the reader loop failed ({type(e).__name__}: {e}); hits may go unseen, so the engine is stopped"
            self.arm(GuardTripped.internal(f"tripwire: {why}"))

        run_reader(
            self.settings.interval,
            self.native,
            self._stop_evt,
            prepare=prepare,
            duty_wait=duty_wait,
            tick=tick,
            failed=failed,
            pending=self.confirmer.any_pending,
        )

    # ------------------------------------------------------------------ reading
    def poll(self) -> None:
        """One reader tick on the calling thread (tests and tools). Never waits on the GPU. Under ``off`` it reads
        nothing (the mode's contract)."""
        if self.settings.mode == "off":
            return
        self._poll(on_reader_thread=False)  # it takes the readers back from the native tick, under the lock

    def _poll(self, *, on_reader_thread: bool) -> None:
        now, thread = time.monotonic(), on_reader_thread
        if thread:
            self.devices.relax_once()  # before this thread's first CUDA call (reads, or a tick hook's abort)
        with self._lock:
            # Under the lock: between a pause taken before it and this lock, the reader thread could re-engage.
            self.native.pause()
            self.native.python[0] += 1
            self._last_tick = now
            if self._act[0]:
                self._act[0] = 0
                self._last_active = now
            pending = self.confirmer.any_pending()
            if not pending and now - max(self._last_active, self.native.last_active) > self.settings.idle_tail:
                self.native.python[1] += 1
            else:
                n = min(len(self.registry), self.settings.capacity)
                for reader, rows in self.devices.poll(n, self.confirmer.quiet_reference, on_reader_thread=thread):
                    if isinstance(rows, BaseException):
                        self._lose(reader, rows)
                    elif rows is None:
                        self.native.python[2] += 1
                    else:
                        self.pipeline.process_read(reader, rows, now, final=False)
            self.pipeline.tick(now)
        self._deliver(wait=False)  # a delivery in progress elsewhere: these events go with the next one
        self._tick_hooks.call(self)

    def _lose(self, reader: DeviceReader, e: BaseException) -> None:
        exc = self.devices.lose(reader, e)
        self.pipeline.lose(reader.name, time.monotonic())  # rises seen there: reported now (nobody polls it again)
        self.arm(exc)

    # ------------------------------------------------------------------ tools
    def drain(self, raise_on_fatal: bool = False) -> dict[tuple[str, str], Hit]:
        """The final synchronous read, for shutdown and stage ends: synchronises each device, reads every arena
        through its mirror, reports what the reader had not yet (no confirmation wait: the read is complete),
        flushes aggregated reports, and returns the snapshot (see :meth:`snapshot`). With ``raise_on_fatal``,
        raises GuardTripped for a fatal-site hit (or any guard hit under raise), or when the stop is armed
        otherwise. Under ``off`` it reads nothing and returns ``{}``. Blocking: never on the step path or inside a
        capture."""
        if self.settings.mode == "off":
            return {}
        if is_capturing():
            raise CaptureError("tripwire.drain() synchronises the device and cannot run inside a CUDA-graph capture")
        snap = self._final_read()
        if raise_on_fatal:
            for (device, name), hit in snap.items():
                site = self.registry.get(name)
                if site.kind in GUARD_KINDS and (site.fatal or self.settings.mode == "raise"):
                    armed = self._tripped
                    raise armed if armed is not None else tripped_for(site, device, hit)
            if self._tripped is not None:  # armed otherwise: a fatal instrument, a lost reader, a peer's stop
                raise self._tripped
        return snap

    def _final_read(self) -> dict[tuple[str, str], Hit]:
        """Synchronise and read every device, report every rise not yet reported (no confirmation wait: the read
        is complete), flush deferred reports; return the snapshot. Blocking (drain and reset only)."""
        now = time.monotonic()
        snap: dict[tuple[str, str], Hit] = {}
        with self._lock:
            self.native.pause()
            reads = list(self.devices.read_now(min(len(self.registry), self.settings.capacity)))
            for ring in self._rings:
                # A verdict enqueued but never taken consumed its step's offenders on the device: they are only in
                # its slot, and this complete read's report must still name them.
                ring.absorb_untaken()
            for reader, rows in reads:
                if isinstance(rows, BaseException):
                    self._lose(reader, rows)
                    continue
                self.pipeline.process_read(reader, rows, now, final=True)
                snap.update(self.pipeline.decode(reader.name, rows, reader.landed_offenders))
            self.pipeline.window.flush_due(now, force=True)
        self._deliver()
        return snap

    def snapshot(self) -> dict[tuple[str, str], Hit]:
        """``{(device, site_name): Hit}`` for every row with a non-zero count: guard and non-finite rows decoded in
        full, clip rows with ``count`` = K + V clipped (``Hit.kind`` tells them apart). A synchronous read (it
        waits for each device's current stream): a tool's call, never the step path's. Call it from the engine
        thread, or while no capture runs (a synchronous copy from another thread invalidates a global-mode
        capture)."""
        out: dict[tuple[str, str], Hit] = {}
        n = min(len(self.registry), self.settings.capacity)
        for dev in self.arena.devices():
            out.update(self.pipeline.decode(str(dev), self.read_rows(dev), self.arena.read_offenders(dev, n)))
        return out

    def read_rows(self, device: torch.device | str | int) -> np.ndarray:
        """A synchronous copy of ``device``'s registered rows (tools and numeric instruments' ``totals()``)."""
        t = self.arena.get(normalize_device(device))
        n = min(len(self.registry), self.settings.capacity)
        return np.zeros((n, 8), dtype=np.int64) if t is None else t[:n].cpu().numpy()

    def reset(self) -> None:
        """Report what is still unreported (a final read, unless mode is off), then zero the counters, forget reported
        counts and pending confirmations, and disarm -- all three, or the next hit would be invisible. Synchronous
        (waits for the device): a tool's call. Call it from the engine thread, or while no capture runs: a
        synchronising call from another thread would invalidate a global-mode capture in progress."""
        if is_capturing():
            raise CaptureError("tripwire.reset() cannot run inside a CUDA-graph capture")
        if self.settings.mode != "off":
            # Nothing is lost: rises seen but not yet confirmed, and reports deferred by the window, go out before
            # the counters they describe are zeroed.
            self._final_read()
        with self._lock:
            self.native.pause()  # the reader thread may have re-engaged it since the final read
            self.arena.zero_()
            for reader in self.devices.all():
                if reader.is_cuda:
                    torch.cuda.synchronize(reader.device)
                reader.discard()  # a copy in flight may hold pre-zero counts
            self.pipeline.clear()
            for ring in self._rings:
                ring.forget()
            self.pipeline.drop_stops()  # and the sinks' health is due
            self._tripped = None
        self._deliver()

    def set_contain(self, on: bool) -> None:
        """Switch containment (the ``contain`` setting, as ``Monitor(contain=...)`` and ``TRIPWIRE_CONTAIN``) on or
        off: the call an integration's ``install(contain=True)`` makes, and an engine of one's own. Under it a
        same-step verdict (:meth:`verdicts`) arms nothing and names the requests to fail; sites no ring covers arm
        as without it (:mod:`tripwire.contain`). Read at each dirty verdict and reader confirmation, so rings built
        before the call follow it. TypeError unless ``on`` is a bool."""
        if not isinstance(on, bool):
            raise TypeError(f"Monitor.set_contain(on) takes True or False, got {on!r}")
        with self._lock:  # Settings are immutable: one replacement, seen whole by every reader
            self.settings = self.settings.with_overrides(contain=on)

    def verdicts(self, device: torch.device | str | int, sites: Any, *, depth: int = 4) -> Any:
        """A ring of same-step verdicts over ``sites`` (Site objects or registered names) on ``device``
        (:class:`tripwire.verdict.Verdicts`). Build it before any capture: it allocates its pinned slots, its
        device staging area and, on CUDA, one small graph per slot. Each (device, site) belongs to one ring."""
        from .verdict import Verdicts

        dev = normalize_device(device)
        if is_capturing():
            raise CaptureError(f"monitor.verdicts({str(dev)!r}) allocates its ring: build it before capturing")
        resolved = [self.registry.resolve(s) for s in ([sites] if isinstance(sites, (str, Site)) else list(sites))]
        with self._lock:
            for s in resolved:
                if self.pipeline.ledger.covers(str(dev), s.id):
                    raise ValueError(
                        f"site {s.name!r} on {dev} already has a verdict ring: a second ring would find its offenders "
                        f"consumed by the first"
                    )
            report = self.pipeline.locked_report(self._lock, self._deliver)  # before take() returns: the sinks
            ring = Verdicts(self.pipeline.context, dev, resolved, depth, prealloc=self.prealloc,
                            offenders=self.arena.offenders, report=report)  # fmt: skip
            for s in resolved:
                self.pipeline.ledger.cover(str(dev), s.id)
            self._rings.append(ring)
        return ring

    def readers(self) -> dict[str, DeviceReader]:
        return {r.name: r for r in self.devices.all()}

    def health(self) -> dict[str, Any]:
        """The state for an engine's health endpoint, as plain JSON types; it reads no device and waits on nothing.

        ``ok``: not armed, no reader lost, the reader running (or mode off). ``armed``; ``stop``: the armed
        GuardTripped's fields and message (None when not armed). ``reader_alive``. ``last_tick_age``: seconds since
        the latest tick, Python's or native (None before the first; growing past a few intervals: a stuck reader).
        ``native_tick``. ``devices``: per device, ``lost`` (why its reader was lost, or None) and ``reads``.
        ``counts``: per device, each site's count as reported so far (the total its latest report, log line and
        event, carried; a rise not yet confirmed, or confirmed while the report window defers it, is not in it).
        ``ticks``, ``python_ticks``, ``native_ticks``, ``idle_skips``, ``quiet_ticks``, ``loop_errors``,
        ``sink_errors``."""
        return health_record(
            stop=self._tripped,
            alive=self.reader_alive,
            mode=self.settings.mode,
            native=self.native,
            last_python_tick=self._last_tick,
            devices=self.devices,
            counts=self.pipeline.counts(),
            loop_errors=self.loop_errors,
            sink_errors=self.sinks.errors,
        )

    def trace(self, on: bool | None = None) -> list[tuple[float, float]]:
        """Tick spans ``(start, end)`` in ``time.perf_counter`` seconds, Python's and native (benchmarks only: see
        ``Engagement.spans``); ``on`` switches recording, for this start and later ones."""
        return self.native.spans(on)
