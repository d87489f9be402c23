"""q3's competing readers (:mod:`lab.step_loop`): the arms it runs beside the decode loop instead of,
or with, tripwire's reader -- a synchronous read every 50 ms, one polling thread per instrument row, tripwire
coordinated or holding the GIL -- and the CPU split that keeps the loop and the readers on different cores."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable

import torch

from tripwire import Monitor

N_ROWS = 64
# The validation control: tripwire's reader at 50 ms whose every tick also holds the GIL for 3 ms (a tick hook
# spinning in Python), a cost both estimators must see and agree on.
HEAVY = "tripwire_50ms_gil3ms"
HEAVY_HOLD_S = 0.003
# The two no-reader arms sit opposite each other in the rotation, so that their pair spans as much time (and host
# drift) as a reader's pair with them does; adjacent, the A/A floor came out optimistic.
VARIANTS = ("none_a", "tripwire_50ms", "tripwire_1ms", "none_b", "sync_50ms", "per_instrument_64", HEAVY)
READERS = tuple(v for v in VARIANTS if not v.startswith("none"))
# tripwire's variants: (interval s, GIL-holding tick hook).
TRIPWIRE = {"tripwire_50ms": (0.05, False), "tripwire_1ms": (0.001, False), HEAVY: (0.05, True)}


def cpu_split() -> tuple[set[int], set[int]] | None:
    """(engine core, reader cores): the first CPU this process may use for the engine thread, the rest for the
    readers; None where affinity cannot be set or there is one CPU."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return {cpus[0]}, set(cpus[1:])


class CompetingReaders:
    """The competing readers (started/stopped around one run)."""

    def __init__(
        self, m: Monitor, dev: str, split: tuple[set[int], set[int]] | None = None, store: object | None = None
    ) -> None:
        self.m = m
        self.dev = dev
        self.split = split
        # --coordinate: tripwire's variants run coordinated through this store (one rank), as an engine would.
        self.store = store
        self.coord: object | None = None
        self._heavy = False
        arena = m.arena.get(torch.device(dev) if dev == "cpu" else torch.device("cuda", torch.cuda.current_device()))
        assert arena is not None, "the monitor's arena is allocated before the readers are made"
        self.arena = arena
        self.stop_evt = threading.Event()
        self.threads: list[threading.Thread] = []
        self.reads = 0
        self._lock = threading.Lock()
        # The per-instrument readers' buffers, streams and events, made once here (pinned allocation is slow and
        # must not land inside a measured run).
        cuda = self.arena.is_cuda
        self._per_row = [
            (
                self.arena[i],
                torch.zeros(8, dtype=torch.int64, pin_memory=cuda),
                torch.cuda.Stream() if cuda else None,
                torch.cuda.Event() if cuda else None,
            )
            for i in range(N_ROWS)
        ]

    def start(self, variant: str) -> None:
        self.stop_evt.clear()
        self.reads = 0
        if self.split is None:
            self._start(variant)
            return
        # Threads inherit their creator's affinity: create the readers (tripwire's included, which the library
        # starts itself) while this thread is on the reader cores, then move this thread back to the engine core.
        os.sched_setaffinity(0, self.split[1])
        try:
            self._start(variant)
        finally:
            os.sched_setaffinity(0, self.split[0])

    def _start(self, variant: str) -> None:
        if variant in TRIPWIRE:
            iv, heavy = TRIPWIRE[variant]
            self.m.settings = self.m.settings.with_overrides(interval=iv)
            if heavy:
                self.m.add_tick_hook(_hold_gil)
                self._heavy = True
            self.m.start()
            if self.store is not None:
                from tripwire.distributed import coordinate

                self.coord = coordinate(self.store, rank=0, monitor=self.m, abort=False)
        elif variant == "sync_50ms":
            self._spawn(self._sync_loop)
        elif variant == "per_instrument_64":
            for i in range(N_ROWS):
                self._spawn(functools.partial(self._one_row_loop, i))

    def stop(self) -> None:
        if self.coord is not None:
            self.coord.close()  # type: ignore[attr-defined]
            self.coord = None
        self.m.stop()
        if self._heavy:
            self.m.remove_tick_hook(_hold_gil)
            self._heavy = False
        self.stop_evt.set()
        for t in self.threads:
            t.join()
        self.threads.clear()

    def _spawn(self, fn: Callable[[], None]) -> None:
        t = threading.Thread(target=fn, daemon=True)
        t.start()
        self.threads.append(t)

    def _count(self) -> None:
        with self._lock:
            self.reads += 1

    def _sync_loop(self) -> None:
        rows = self.arena[:N_ROWS]
        while not self.stop_evt.wait(0.05):
            rows.tolist()  # synchronous: on CUDA it waits for everything queued on the compute stream
            self._count()

    def _one_row_loop(self, i: int) -> None:
        row, buf, stream, ev = self._per_row[i]
        cuda = row.is_cuda
        pending = False
        if self.stop_evt.wait(0.05 * i / N_ROWS):  # stagger the 64 phases
            return
        while not self.stop_evt.wait(0.05):
            if cuda:
                if pending and not ev.query():  # type: ignore[union-attr]
                    continue
                with torch.cuda.stream(stream):
                    buf.copy_(row, non_blocking=True)
                    ev.record(stream)  # type: ignore[union-attr]
                pending = True
            else:
                buf.copy_(row)
            self._count()


def _hold_gil(m: Monitor) -> None:
    """HEAVY's tick hook: spin in Python (holding the GIL, under CPython's 5 ms switch interval) for 3 ms."""
    end = time.perf_counter() + HEAVY_HOLD_S
    while time.perf_counter() < end:
        pass
