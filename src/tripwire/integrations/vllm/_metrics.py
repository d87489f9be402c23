"""tripwire's metrics on vLLM's own ``/metrics`` when vLLM serves its default registry (one API server).

With one API server vLLM serves ``prometheus_client``'s default registry of the API server process, while tripwire
counts in the engine core's processes (the model runner's, the scheduler's). Setting ``PROMETHEUS_MULTIPROC_DIR``
there ourselves would not do: vLLM would then serve a multiprocess registry, and its own metrics, made in
single-process mode, would vanish from ``/metrics``. So the counts travel through files:

* :func:`serve` (the plugin's ``register``, in every vLLM process while ``TRIPWIRE_VLLM`` names a mode): the first
  process, vLLM's API server, makes a folder and names it in :data:`ENV`, which the processes it starts inherit (a
  process that inherits none, an engine without an API server, makes its own), and every process registers a
  :class:`MetricsCollector` of that folder on its default registry (only the API server's is served).
* :class:`MetricsFileSink` (added to each process's monitor): a :class:`tripwire.sinks.Prometheus` on a registry of its
  own, whose samples are written, after each event and sync, to one JSON file per process, atomically.
* :class:`MetricsCollector`: at each scrape, reads every process's file and yields the Prometheus sink's own metric
  families (names, help, labels): counters summed over the processes, the stop gauge the largest live value (as
  ``prometheus_client``'s multiprocess mode does).

With ``PROMETHEUS_MULTIPROC_DIR`` set (several API servers) vLLM serves the multiprocess registry and each process
adds a Prometheus sink writing there (``tripwire.integrations.vllm``); none of this runs then, so nothing is reported
twice. Nothing here imports vLLM.

The collector is registered by the general plugin, which vLLM already runs in its API server (when it parses its
arguments), not through vLLM's stat-logger plugin group (``vllm.stat_logger_plugins``): an entry point there must
load a ``StatLoggerBase`` class even while ``TRIPWIRE_VLLM`` is unset, and any class there turns vLLM's stats
collection on under ``--disable-log-stats`` (``AsyncLLM``: ``log_stats or bool(custom_stat_loggers)``), so merely
installing tripwire would change vLLM.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from ...monitor import Monitor
from ...sinks import Event, Prometheus

__all__ = ["ENV", "MetricsCollector", "MetricsFileSink", "add_sink", "serve"]

log = logging.getLogger("tripwire")

ENV = "TRIPWIRE_VLLM_METRICS_DIR"
_SUFFIX = ".json"

_lock = threading.Lock()
_collected: set[str] = set()  # the folders whose collector this process registered (register() may run twice)


def _multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def serve() -> str | None:
    """Make the folder (unless ``TRIPWIRE_VLLM_METRICS_DIR`` names one: then it is made if missing) and register its
    :class:`MetricsCollector` on ``prometheus_client``'s default registry, once per process and folder; returns the
    folder, or None under ``PROMETHEUS_MULTIPROC_DIR`` or without ``prometheus_client`` (nothing made or registered).
    A folder this process made is named in ``TRIPWIRE_VLLM_METRICS_DIR``, so the processes it starts inherit it, and
    removed when this process exits."""
    if _multiprocess():
        return None
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return None
    with _lock:
        path = os.environ.get(ENV)
        if not path:
            path = tempfile.mkdtemp(prefix="tripwire-vllm-metrics-")
            os.environ[ENV] = path  # before vLLM starts its engine core: its processes inherit it
            atexit.register(_remove, path, os.getpid())
        else:
            os.makedirs(path, exist_ok=True)
        if path not in _collected:
            REGISTRY.register(MetricsCollector(path))
            _collected.add(path)
    return path


def _remove(path: str, owner: int) -> None:
    # Only the process that made it: a forked child inherits this hook with the module's state.
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def add_sink(monitor: Monitor) -> None:
    """Add a :class:`MetricsFileSink` of the folder :data:`ENV` names to ``monitor`` (nothing when unset, or under
    ``PROMETHEUS_MULTIPROC_DIR``: its Prometheus sink is the one)."""
    path = os.environ.get(ENV)
    if not path or _multiprocess():
        return
    try:
        sink = MetricsFileSink(path)
    except ImportError:
        log.warning("%s is set but prometheus_client is not installed: no metrics", ENV)
        return
    monitor.add_sink(sink)


class MetricsFileSink:
    """A :class:`tripwire.sinks.Prometheus` on a registry of its own, written to ``<folder>/<pid>.json`` after each
    event and sync (write a temporary file, then ``os.replace``: a reader sees the old file or the new one, whole).
    The file name takes the pid at each write, so a forked child never overwrites its parent's file. Like the
    multiprocess mode's, the tick counter and the stop gauge move at the monitor's syncs (the scrape is in another
    process). ``directory`` must exist (ValueError naming it otherwise); ``prometheus_client`` must be installed
    (ImportError). A write whose folder has gone (its API server exited) is dropped; any other failed write raises
    and leaves the previous file whole."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        from prometheus_client import CollectorRegistry

        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise ValueError(f"tripwire: {ENV}={self.directory!r} is not a directory")
        self._registry = CollectorRegistry(auto_describe=False)
        self._prom = Prometheus(registry=self._registry)
        self._lock = threading.Lock()  # one writer at a time, so a newer state is never replaced by an older one

    def __call__(self, event: Event) -> None:
        with self._lock:
            self._prom(event)
            self._write()

    def sync(self, health: Any) -> None:
        with self._lock:
            self._prom.sync(health)
            self._write()

    def _write(self) -> None:
        families = [
            {
                "name": m.name,
                "help": m.documentation,
                "type": m.type,
                # _created: a per-process timestamp, meaningless summed (the multiprocess mode drops it too).
                "samples": [[s.name, s.labels, s.value] for s in m.samples if not s.name.endswith("_created")],
            }
            for m in self._registry.collect()
        ]
        pid = os.getpid()
        path = os.path.join(self.directory, f"{pid}{_SUFFIX}")
        tmp = f"{path}.tmp"  # not *.json: the collector never reads a half-written file
        try:
            with open(tmp, "w") as f:
                json.dump({"pid": pid, "families": families}, f, separators=(",", ":"))
            os.replace(tmp, path)
        except FileNotFoundError:
            pass  # the folder is gone: the API server that made it (and served it) has exited

    def __repr__(self) -> str:
        return f"MetricsFileSink({self.directory!r})"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MetricsCollector:
    """A ``prometheus_client`` collector of the :class:`MetricsFileSink` files in ``directory``: at each scrape, every
    process's samples, counters summed per label set, gauges the largest among live processes (a dead process's stop
    is no one's); the metric families (names, help, labels) are the :class:`tripwire.sinks.Prometheus` sink's. A
    missing folder, or a file removed or replaced between the listing and the read, yields nothing for it."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.fspath(directory)

    def describe(self) -> list[Any]:
        return []  # a registry would otherwise collect at registration, to learn the names

    def collect(self) -> Iterator[Any]:
        from prometheus_client.metrics_core import Metric

        families: dict[str, Metric] = {}
        # family -> (sample name, label set) -> [sample name, labels in the sink's order, value]
        values: dict[str, dict[tuple[str, frozenset[tuple[str, str]]], list[Any]]] = {}
        for data in self._files():
            live = _alive(int(data.get("pid", 0)))
            for fam in data.get("families", ()):
                name, kind = fam["name"], fam["type"]
                if name not in families:
                    families[name] = Metric(name, fam["help"], kind)
                    values[name] = {}
                acc = values[name]
                for sample, labels, value in fam["samples"]:
                    if kind == "gauge" and not live:
                        continue  # a dead process's stop is no one's
                    seen = acc.setdefault((sample, frozenset(labels.items())), [sample, labels, None])
                    if seen[2] is None:
                        seen[2] = value
                    else:
                        seen[2] = max(seen[2], value) if kind == "gauge" else seen[2] + value
        for name, metric in families.items():
            for sample, labels, value in values[name].values():
                metric.add_sample(sample, labels, value)
            yield metric

    def _files(self) -> Iterator[dict[str, Any]]:
        try:
            names = sorted(n for n in os.listdir(self.directory) if n.endswith(_SUFFIX))
        except FileNotFoundError:
            return
        for n in names:
            try:
                with open(os.path.join(self.directory, n)) as f:
                    yield json.load(f)
            except (OSError, ValueError):
                continue  # a process's file replaced or removed between the listing and the read

    def __repr__(self) -> str:
        return f"MetricsCollector({self.directory!r})"
