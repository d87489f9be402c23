"""Events and the sinks they go to.

Every confirmed report is one or more :class:`Event` (one per counter that rose: a clip report's K and V are two),
handed to each sink a monitor has: the log (built in: every report is one record on the ``tripwire`` logger, see
:class:`Log`), a :class:`JsonLines` file (``TRIPWIRE_EVENT_LOG``), a :class:`Prometheus` exporter, or any callable
given to :meth:`tripwire.Monitor.add_sink`. Reports are aggregated by the monitor's window before they become
events (at most one per site and device per ``report_every`` seconds, carrying the delta since the last one), so a
hot bad site cannot flood a sink either; ``drain()`` flushes what the window holds.

A sink is called on the thread that confirmed the report (the reader thread, or ``drain()``'s caller), never under
the monitor's lock and never on the engine's step path. It must return quickly (it delays the reader's next tick,
not the engine). A sink that raises is logged (at most once per report window, with the number of failures since
the last line), counted in ``Monitor.health()["sink_errors"]``, and called again for the next event: it never stops
the reader. A sink object may also have ``sync(health)``: called with :meth:`tripwire.Monitor.health` at once
after the stop is armed or reset, else on the reader's Python ticks at most once a second (:class:`Prometheus`
keeps its gauges and its tick counter there); and ``bind(health)``: called once by
:meth:`tripwire.Monitor.add_sink` with the monitor's ``health`` method, for a sink that reads the health itself
when it is asked (:class:`Prometheus`, at each scrape).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time as _time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple

__all__ = [
    "EVENT_FIELDS",
    "LINE_LIMIT",
    "SYNC_EVERY_S",
    "Event",
    "JsonLines",
    "Log",
    "Offender",
    "Prometheus",
    "Sink",
    "SinkSet",
    "current_rank",
    "stop_event",
]

log = logging.getLogger("tripwire")

# The log sink's first line: what a log pipeline shows in one row (site, device, delta, total, first offender).
LINE_LIMIT = 200
# Sinks' sync(health) on ticks: at most this often (a scrape is seconds apart).
SYNC_EVERY_S = 1.0

Sink = Callable[["Event"], None]


class Offender(NamedTuple):
    """One offending entry: its row, its value and, where the caller passed a row-to-request map, the request."""

    row: int
    value: int
    request: int | str | None = None


@dataclass(frozen=True)
class Event:
    """One confirmed report of one counter.

    ``kind``: ``"guard"`` (masked out-of-range accesses), ``"nonfinite"`` (NaN/Inf elements), ``"clip_k"`` /
    ``"clip_v"`` (FP8 K or V elements saturated), ``"stop"`` (the stop was armed; ``delta`` 0) or a custom
    reporter's kind. ``site``: the site (a clip counter's layer). ``device``: ``"cuda:0"``, ``"cpu"``, ``"*"``.
    ``rank``: the rank that saw it (torch.distributed's when initialised, a peer's for a learned stop; None when
    local to an undistributed process). ``delta``: new since this site's previous event; ``total``: its count now.
    ``first_row``/``first_value``: the first offender pair the kernel recorded (None where the row has none).
    ``offenders``: the first distinct offenders kept on the device (empty while the arena keeps only the first
    pair). ``time``: wall-clock seconds (``time.time()``). ``fatal``: the site (or counter) is fatal.
    """

    kind: str
    site: str
    device: str
    rank: int | None = None
    delta: int = 0
    total: int = 0
    first_row: int | None = None
    first_value: int | None = None
    offenders: tuple[Offender, ...] = ()
    time: float = field(default_factory=_time.time)
    fatal: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The event as plain JSON types, under the field names (offenders as ``{"row", "value", "request"}``)."""
        d = asdict(self)
        d["offenders"] = [Offender(*o)._asdict() for o in self.offenders]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False, separators=(",", ":"))


EVENT_FIELDS = tuple(Event.__dataclass_fields__)


def stop_event(exc: Any) -> Event:
    """The ``"stop"`` event of an armed :class:`tripwire.GuardTripped`."""
    return Event(
        kind="stop",
        site=exc.site,
        device=exc.device,
        rank=exc.rank,
        total=exc.count,
        first_row=exc.first_row,
        first_value=exc.first_value,
        fatal=exc.fatal,
    )


def current_rank() -> int | None:
    """This process's rank: torch.distributed's when a process group is initialised, else ``$RANK`` (what a
    launcher sets before the group exists), else None."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # a half-torn-down group: the rank is not worth failing a report for
        pass
    raw = os.environ.get("RANK", "").strip()
    return int(raw) if raw.isdigit() else None


# ---------------------------------------------------------------------------------------------------- delivery
class _Slot:
    def __init__(self, fn: Sink) -> None:
        self.fn = fn
        self.failures = 0
        self.unlogged = 0
        self.logged_at = float("-inf")


class SinkSet:
    """A monitor's sinks, and their failures: each failure is counted (``errors``, and per sink); the log gets at
    most one line per sink per window (``window()`` seconds), with the failures since its last line."""

    def __init__(self, window: Callable[[], float]) -> None:
        self._window = window
        self._slots: list[_Slot] = []
        self.errors = 0
        self._synced_at = float("-inf")

    def __bool__(self) -> bool:
        return bool(self._slots)

    def __iter__(self) -> Iterator[Sink]:
        return iter([s.fn for s in self._slots])

    def add(self, sink: Sink) -> bool:
        """Add ``sink`` (TypeError unless callable); False when it was already there."""
        if not callable(sink):
            raise TypeError(f"a sink must be callable (it is called with each tripwire.Event), got {sink!r}")
        if any(s.fn == sink for s in self._slots):
            return False
        self._slots = [*self._slots, _Slot(sink)]  # a new list: deliver() iterates a snapshot without a lock
        return True

    def remove(self, sink: Sink) -> None:
        keep = [s for s in self._slots if s.fn != sink]
        if len(keep) == len(self._slots):
            raise ValueError(f"{sink!r} is not a sink of this monitor")
        self._slots = keep

    def deliver(self, events: list[Event], health: Callable[[], Mapping[str, Any]], *, urgent: bool = False) -> None:
        """Hand ``events`` to every sink (a local event without a rank gets this process's, when it has one), then
        ``health()`` to those with ``sync``: when ``urgent`` (a stop, a reset, a new sink), else at most once per
        :data:`SYNC_EVERY_S` (building it costs the reader's tick some GIL time)."""
        slots = self._slots
        if not slots:
            return
        rank = current_rank() if events else None
        if rank is not None:
            events = [replace(ev, rank=rank) if ev.rank is None else ev for ev in events]
        h = None
        now = _time.monotonic()
        if (urgent or now - self._synced_at >= SYNC_EVERY_S) and any(hasattr(s.fn, "sync") for s in slots):
            h, self._synced_at = health(), now
        for slot in slots:
            for ev in events:
                self._call(slot, slot.fn, ev)
            if h is not None and hasattr(slot.fn, "sync"):
                self._call(slot, slot.fn.sync, h)  # type: ignore[attr-defined]

    def _call(self, slot: _Slot, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            fn(arg)
        except Exception as e:
            # Counted every time, logged at most once per window: a sink that always fails must neither flood the
            # log nor stop the reader.
            slot.failures += 1
            slot.unlogged += 1
            self.errors += 1
            now = _time.monotonic()
            if now - slot.logged_at >= self._window():
                log.error(
                    "sink %r failed (%s: %s); %d failure(s) since its last line, %d in all",
                    slot.fn,
                    type(e).__name__,
                    e,
                    slot.unlogged,
                    slot.failures,
                )
                slot.logged_at, slot.unlogged = now, 0


# ---------------------------------------------------------------------------------------------------- the log
class Log:
    """The built-in sink: one record per report on the ``tripwire`` logger.

    The record's first line is at most :data:`LINE_LIMIT` characters (site, device, delta, total, first offender:
    what a log pipeline shows); a second line carries the detail (lifetime extremes, a suggested scale); the first
    report of each site adds the explanation (what the numbers mean, what to look at) once, not on every line."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self.logger = logger
        self._explained: set[str] = set()

    def write(
        self, line: str, *, key: str, detail: str = "", explanation: str = "", level: int = logging.WARNING
    ) -> None:
        lines = [fit(line)]
        if detail:
            lines.append("  " + detail)
        if explanation and key not in self._explained:
            self._explained.add(key)
            lines.append("  " + explanation)
        self.logger.log(level, "%s", "\n".join(lines))


def fit(line: str, limit: int = LINE_LIMIT) -> str:
    """``line`` cut to ``limit`` characters (a last resort: the wording keeps its lines short itself)."""
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------- JSON lines
class JsonLines:
    """Appends one JSON object per event to ``path`` (the :class:`Event` field names; ``TRIPWIRE_EVENT_LOG``).

    The file is opened at construction, so a path that cannot be written is a clear error there, not a lost event
    later. Each line is one ``write(2)`` on an ``O_APPEND`` descriptor: several processes (one per rank) can share
    one file without interleaving within a line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path).strip():
            raise ValueError(f"tripwire: the event log path must be a non-empty path, got {path!r}")
        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            raise ValueError(f"tripwire: the event log {self.path!r} is a directory, not a file")
        try:
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ValueError(
                f"tripwire: the event log {self.path!r} cannot be opened for appending ({e.strerror or e})"
            ) from None

    def __call__(self, event: Event) -> None:
        fd = self._fd
        if fd is None:
            raise ValueError(f"tripwire: the event log {self.path!r} is closed")
        data = (event.to_json() + "\n").encode()
        while data:
            data = data[os.write(fd, data) :]

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"JsonLines({self.path!r})"


# ---------------------------------------------------------------------------------------------------- Prometheus
class _Refresh:
    """Registered on a registry before tripwire's metrics, so that a scrape (which collects a registry's collectors in
    their registration order) first brings the tick counter and the stop gauge up to each bound sink's monitor.
    While the native tick is engaged the reader's Python ticks, where ``sync`` otherwise runs, are seconds apart: a
    ``rate()`` over the counter would call a live reader dead."""

    def __init__(self) -> None:
        self.sinks: weakref.WeakSet[Prometheus] = weakref.WeakSet()

    def describe(self) -> list[Any]:
        return []  # no metric of its own (a registry asks at registration)

    def collect(self) -> list[Any]:
        for sink in list(self.sinks):
            sink.refresh()
        return []


class _Metrics(NamedTuple):
    refresh: _Refresh
    masked: Any
    clipped: Any
    nonfinite: Any
    armed: Any
    ticks: Any


# One set of metrics per registry: a second sink on the same registry shares them (prometheus_client refuses to
# register a metric name twice).
_METRICS: weakref.WeakKeyDictionary[Any, _Metrics] = weakref.WeakKeyDictionary()


def _metrics(registry: Any) -> _Metrics:
    from prometheus_client import Counter, Gauge

    m = _METRICS.get(registry)
    if m is None:
        refresh = _Refresh()
        registry.register(refresh)  # first: see _Refresh
        m = _METRICS[registry] = _Metrics(
            refresh,
            Counter(
                "tripwire_masked_accesses_total",
                "Out-of-range accesses masked by tripwire guards (those lanes did not compute a correct result)",
                ["site", "device", "rank"],
                registry=registry,
            ),
            Counter(
                "tripwire_fp8_clipped_total",
                "FP8 KV-cache elements saturated by a static scale",
                ["site", "tensor", "device", "rank"],
                registry=registry,
            ),
            Counter(
                "tripwire_nonfinite_total",
                "NaN/Inf elements counted by tripwire's non-finite instruments",
                ["site", "device", "rank"],
                registry=registry,
            ),
            # livemax: in multiprocess mode, the largest value among live processes (each rank has its own label).
            Gauge(
                "tripwire_stop_armed",
                "1 while tripwire's stop is armed (the engine raises GuardTripped at its next check)",
                ["device", "rank"],
                registry=registry,
                multiprocess_mode="livemax",
            ),
            Counter(
                "tripwire_reader_ticks_total",
                "tripwire reader ticks while that device's reader is live",
                ["device", "rank"],
                registry=registry,
            ),
        )
    return m


class Prometheus:
    """Counts events into Prometheus metrics (needs ``prometheus_client``: ``pip install 'tripwire[prometheus]'``).

    Metrics: ``tripwire_masked_accesses_total{site,device,rank}``, ``tripwire_fp8_clipped_total{site,tensor,device,
    rank}`` (tensor ``k``/``v``), ``tripwire_nonfinite_total{site,device,rank}``, ``tripwire_stop_armed{device,rank}``
    (a gauge) and ``tripwire_reader_ticks_total{device,rank}``. ``rank`` is this process's rank
    (:func:`current_rank`; empty when there is none). ``registry``: a ``prometheus_client.CollectorRegistry``
    (default: the global one).

    Multiprocess mode (engines' worker processes): with ``PROMETHEUS_MULTIPROC_DIR`` set before
    ``prometheus_client`` is first imported, values go to that directory's files and the process that serves
    ``/metrics`` collects them with ``prometheus_client.multiprocess.MultiProcessCollector``; counters add up across
    processes, the gauge takes the largest live value. The directory is checked here: one that does not exist or
    cannot be written is a clear error (its metrics would otherwise be lost).

    Counters move when the monitor's window releases a report (at most ``report_every`` seconds after a rise; at
    once for a site's first rise and at ``drain()``). The tick counter and the stop gauge (0 for every device of the
    monitor until its stop is armed) are brought up to the monitor at each scrape of ``registry``, the native
    tick's ticks included, and at the monitor's syncs (see :meth:`sync`). In multiprocess mode the scrape happens in
    another process, so there they move at the syncs only: at once when the stop is armed or reset, else on the
    reader's Python ticks (seconds apart while the native tick is engaged).
    """

    def __init__(self, registry: Any = None) -> None:
        try:
            import prometheus_client
        except ImportError:
            raise ImportError(
                "tripwire.sinks.Prometheus needs prometheus_client: pip install 'tripwire[prometheus]'"
            ) from None
        multiproc = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")
        if multiproc is not None and not (os.path.isdir(multiproc) and os.access(multiproc, os.W_OK | os.X_OK)):
            raise ValueError(
                f"PROMETHEUS_MULTIPROC_DIR={multiproc!r} is not a writable directory: prometheus_client's "
                f"multiprocess mode would lose tripwire's metrics"
            )
        self.multiprocess = multiproc is not None
        self.registry = registry if registry is not None else prometheus_client.REGISTRY
        self._m = _metrics(self.registry)
        self._ticks_seen = 0
        self._armed_labels: set[tuple[str, str]] = set()
        self._health: Callable[[], Callable[[], Mapping[str, Any]] | None] | None = None
        self._sync_lock = threading.Lock()  # the reader thread's syncs and a scrape's refresh

    @staticmethod
    def _rank() -> str:
        r = current_rank()
        return "" if r is None else str(r)

    def __call__(self, event: Event) -> None:
        rank, k = self._rank(), event.kind
        if k == "guard" and event.delta > 0:
            self._m.masked.labels(event.site, event.device, rank).inc(event.delta)
        elif k in ("nonfinite", "nonfinite_rows") and event.delta > 0:
            # One family for NaN/Inf: elements at a count_nonfinite site, rows at a per-row site (the site says which).
            self._m.nonfinite.labels(event.site, event.device, rank).inc(event.delta)
        elif k in ("clip_k", "clip_v") and event.delta > 0:
            self._m.clipped.labels(event.site, k[-1], event.device, rank).inc(event.delta)
        elif k == "stop":
            self._m.armed.labels(event.device, rank).set(1)
            self._armed_labels.add((event.device, rank))

    def bind(self, health: Callable[[], Mapping[str, Any]]) -> None:
        """Read ``health`` (a monitor's :meth:`~tripwire.Monitor.health`, held weakly) at each scrape of the
        registry (:meth:`tripwire.Monitor.add_sink` calls this)."""
        self._health = weakref.WeakMethod(health) if hasattr(health, "__self__") else (lambda: health)  # type: ignore[arg-type]
        self._m.refresh.sinks.add(self)

    def refresh(self) -> None:
        """Sync with the bound monitor's health now (a scrape's; nothing when unbound or the monitor is gone)."""
        fn = self._health() if self._health is not None else None
        if fn is not None:
            self.sync(fn())

    def sync(self, health: Mapping[str, Any]) -> None:
        """Bring the tick counter and the stop gauge up to ``health`` (a :meth:`tripwire.Monitor.health` dict)."""
        with self._sync_lock:
            rank = self._rank()
            ticks = int(health["ticks"])
            # Never counted twice: a total read while an engagement's ticks are being folded in may dip for a moment.
            new, self._ticks_seen = max(ticks - self._ticks_seen, 0), max(ticks, self._ticks_seen)
            stop = health.get("stop")
            armed_dev = None if stop is None else str(stop["device"])
            now_armed: set[tuple[str, str]] = set()
            shown: set[tuple[str, str]] = set()
            for device, info in health["devices"].items():
                ticks_of = self._m.ticks.labels(device, rank)  # exported from the start, at 0
                if new and info.get("lost") is None:
                    ticks_of.inc(new)
                shown.add((device, rank))
                if armed_dev in (device, "*"):
                    now_armed.add((device, rank))
            if armed_dev is not None:
                now_armed.add((armed_dev, rank))
            for labels in shown | self._armed_labels | now_armed:
                self._m.armed.labels(*labels).set(1 if labels in now_armed else 0)
            self._armed_labels = now_armed

    def __repr__(self) -> str:
        return f"Prometheus(multiprocess={self.multiprocess})"
