"""q2. Reader tick latency under a busy compute stream: tripwire's tick vs a synchronous ``.tolist()`` read.

``torch.cuda._sleep`` parks 100 ms kernels on the compute stream (the legacy default stream, where the work of an
engine that never set a stream goes). While they run:

* tripwire: ``Monitor.poll()`` every millisecond on a CUDA arena of 64 rows. The copy goes on the reader's own
  side stream (created non-blocking by torch), so it neither waits for nor is ordered after the sleeping kernels;
  the tick only queries the previous copy's event. We also count how many copies LANDED during the busy period:
  a tick that never blocks but never gets data would be no reader at all.
* synchronous: ``arena[:64].tolist()``, the read a naive reader (or an engine's own stats code) does: it queues
  behind the compute stream, so it returns only when the parked work is done.

Target: tripwire tick p99 < 1 ms.

Without a GPU: the tick on a CPU arena of the same rows (nothing to copy: the tick reads the rows in place), the same
target.
"""

from __future__ import annotations

import time

import torch

from tripwire import Monitor, SiteRegistry

from .common import Ctx, Result, single, sleep_cycles_per_ms, stats
from .questions import label

N_ROWS = 64
PARK_MS = 100


def run(ctx: Ctx) -> dict:
    res = Result(label(__name__), "Reader tick under a busy compute stream", ctx)
    if not ctx.cuda:
        return _cpu(res, ctx)
    busy_ms = 500 if ctx.quick else 1500
    n_sync = 3 if ctx.quick else 8
    reg = SiteRegistry(capacity=N_ROWS)
    for i in range(N_ROWS):
        reg.register(f"bench.q2.site{i}")
    m = Monitor(registry=reg, capacity=N_ROWS, mode="warn", interval=1.0, idle_tail=3600.0, report_every=3600.0)
    m.prealloc("cuda")
    reader = next(iter(m.readers().values()))
    arena = m.arena.get(reader.device)
    assert arena is not None
    cpm = sleep_cycles_per_ms()
    for _ in range(20):  # warm-up: first copies, numpy paths
        m.poll()
        reader.stream.synchronize()
    arena[:N_ROWS].tolist()
    torch.cuda.synchronize()

    # tripwire's tick while busy_ms of kernels sit on the compute stream.
    for _ in range(busy_ms // PARK_MS):
        torch.cuda._sleep(int(cpm * PARK_MS))
    done = torch.cuda.Event()
    done.record()
    c0 = reader.copies
    ticks: list[float] = []
    t_end = time.perf_counter() + busy_ms * 0.8 / 1e3
    while time.perf_counter() < t_end:
        t0 = time.perf_counter_ns()
        m.poll()
        ticks.append((time.perf_counter_ns() - t0) / 1e6)
        time.sleep(0.001)
    still_busy = not done.query()
    landed = reader.copies - c0  # a tick starts a new copy only once the previous one has landed
    torch.cuda.synchronize()

    # The native quiet tick (the reader thread's ticks while nothing changes), timed from its span ring, while the
    # same busy_ms of kernels sit on the compute stream.
    native: list[float] = []
    m.settings = m.settings.with_overrides(interval=0.001)
    m.start()
    try:
        if m.native.ticker is not None:
            time.sleep(0.05)  # engaged after its first Python tick
            m.native.trace(on=True)
            for _ in range(busy_ms // PARK_MS):
                torch.cuda._sleep(int(cpm * PARK_MS))
            t_start = time.monotonic_ns()
            t_end = time.perf_counter() + busy_ms * 0.8 / 1e3
            while time.perf_counter() < t_end:
                m.check()
                time.sleep(0.001)
            native = [(b - a) / 1e6 for a, b in m.native.trace().tolist() if a >= t_start]
    finally:
        m.stop()
    torch.cuda.synchronize()

    # The synchronous reader, each sample behind one parked kernel.
    sync: list[float] = []
    for _ in range(n_sync):
        torch.cuda._sleep(int(cpm * PARK_MS))
        t0 = time.perf_counter_ns()
        arena[:N_ROWS].tolist()
        sync.append((time.perf_counter_ns() - t0) / 1e6)
    torch.cuda.synchronize()

    res.fig("tick_ms_tripwire", stats(ticks, unit="ms", label="tripwire Monitor.poll() while busy", dist=True))
    res.fig("tick_ms_sync", stats(sync, unit="ms", label=f"arena.tolist() behind a {PARK_MS} ms kernel", dist=True))
    if native:
        res.fig("tick_ms_native", stats(native, unit="ms", label="tripwire native quiet tick while busy", dist=True))
        p99n = res.figures["tick_ms_native"]["p99"]
        res.target("tripwire native tick p99", "tick_ms_native", "p99 < 1 ms", p99n, p99n < 1.0)
    else:
        res.note("no native tick here (it could not be built): only Python ticks were timed")
    res.fig("copies_landed_while_busy", single(landed, unit="copies", label="tripwire copies landed while busy"))
    res.fig("sleep_cycles_per_ms", single(cpm, unit="cycles/ms", label="torch.cuda._sleep calibration"))
    p99 = res.figures["tick_ms_tripwire"]["p99"]
    res.target("tripwire tick p99", "tick_ms_tripwire", "p99 < 1 ms", p99, p99 < 1.0)
    res.target(
        "tripwire reads while busy",
        "copies_landed_while_busy",
        "copies land while the compute stream is busy (> 1)",
        landed,
        landed > 1,
        why="" if landed > 1 else "the side-stream copy waited for the compute stream",
    )
    if not still_busy:
        res.note("the parked work finished before the tick loop ended: part of the ticks ran on an idle GPU")
    res.note(f"{busy_ms} ms of torch.cuda._sleep parked in {PARK_MS} ms kernels; one tick per ms; {N_ROWS} rows")
    return res.to_dict()


def _cpu(res: Result, ctx: Ctx) -> dict:
    """The tick on a CPU arena: ``Monitor.poll()`` every millisecond with nothing to report."""
    reg = SiteRegistry(capacity=N_ROWS)
    for i in range(N_ROWS):
        reg.register(f"bench.q2.site{i}")
    m = Monitor(registry=reg, capacity=N_ROWS, mode="warn", interval=1.0, idle_tail=3600.0, report_every=3600.0)
    m.prealloc("cpu")
    for _ in range(20):  # warm-up: numpy paths
        m.poll()
    ticks: list[float] = []
    for _ in range(300 if ctx.quick else 1000):
        t0 = time.perf_counter_ns()
        m.poll()
        ticks.append((time.perf_counter_ns() - t0) / 1e6)
        time.sleep(0.001)
    res.fig("tick_ms_tripwire", stats(ticks, unit="ms", label="tripwire Monitor.poll(), CPU arena", dist=True))
    p99 = res.figures["tick_ms_tripwire"]["p99"]
    res.target("tripwire tick p99", "tick_ms_tripwire", "p99 < 1 ms", p99, p99 < 1.0)
    res.note(f"CPU arena of {N_ROWS} rows, one tick per ms, nothing to report")
    return res.to_dict()
