"""q9. Soak: CUDA-graph replay with the reader at 1 ms and hits injected at known steps.

The graph: a guarded gather (tripwire.testing.gather) through a static index tensor plus a few small ops. Every
step: ``check()``, stage the step's indices (good ones, or at injection steps a known number of bad lanes) into the
static tensor from a pinned buffer, replay, read a token back (the per-step sync). The reader (warn mode, non-fatal
site, ``report_every`` 1 s so aggregation is exercised) runs at 1 ms throughout.

Checked: no hang (a watchdog records any step slower than 10 s and the longest step), no missed or extra counts
(the arena count after ``drain()``, and the sum of the deltas in the WARNING lines, both equal the injected total),
memory flat (RSS and ``torch.cuda.memory_allocated`` sampled every second; drift after warm-up reported).

Length: ``--soak-minutes`` (10 for the full soak); the suite's default is 60 s (10 s with --quick), and the
result says which was run.
"""

from __future__ import annotations

import logging
import re
import threading
import time

import numpy as np
import torch

from tripwire import Monitor, SiteRegistry

from .common import Ctx, Result, capture, rss_mib, single, stats
from .questions import label

BS = 256
_DELTA = re.compile(r"(\d+) new out-of-range access(?:es)? masked \((\d+) total\)")


class _Lines(logging.Handler):
    def __init__(self, site: str) -> None:
        super().__init__(level=logging.WARNING)
        self.site = site
        self.deltas: list[int] = []
        self.totals: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if self.site in msg:
            mt = _DELTA.search(msg)
            if mt:
                self.deltas.append(int(mt.group(1)))
                self.totals.append(int(mt.group(2)))


def run(ctx: Ctx) -> dict:
    res = Result(label(__name__), "Soak: graph replay, reader at 1 ms, injected hits", ctx)
    if not ctx.cuda:
        return res.skip("needs a CUDA GPU")
    if ctx.soak_minutes is not None:
        seconds = ctx.soak_minutes * 60
    else:
        seconds = 10.0 if ctx.quick else 60.0
        res.note(f"SHORT soak: {seconds:.0f} s (the suite's default); run with --soak-minutes 10 for the full soak")
    from tripwire.testing import gather_rows

    reg = SiteRegistry(capacity=16)
    site = reg.register("bench.q9.gather", description="q9 soak probe")
    m = Monitor(registry=reg, capacity=16, mode="warn", interval=0.001, idle_tail=2.0, report_every=1.0)
    m.prealloc("cuda")
    ctr = m.counter(site, "cuda")
    table = torch.randn(4096, 64, device="cuda")
    idx = torch.zeros(BS, dtype=torch.int64, device="cuda")
    g_out = torch.empty(BS, 64, device="cuda")
    tok = torch.zeros(1, dtype=torch.int64, device="cuda")
    good_host = torch.arange(BS, dtype=torch.int64).pin_memory()
    # Bad buffers with 1, 2 and 3 bad lanes (values past the table's end).
    bad_host = []
    for k in (1, 2, 3):
        b = torch.arange(BS, dtype=torch.int64)
        b[-k:] = 4096 + torch.arange(k)
        bad_host.append(b.pin_memory())

    def body() -> None:
        gather_rows(table, idx, g_out, ctr=ctr)
        torch.argmax(g_out.sum(dim=1), dim=0, keepdim=True, out=tok)

    graph = capture(body)
    m.reset()

    log = logging.getLogger("tripwire")
    lines = _Lines(site.name)
    old_prop, old_level = log.propagate, log.level
    log.addHandler(lines)
    log.propagate = False
    log.setLevel(logging.WARNING)

    injected = 0
    inject_steps = 0
    step = 0
    progress: list[float] = [0, time.perf_counter()]
    hang = threading.Event()
    stop = threading.Event()

    def watchdog() -> None:
        last: float = -1
        while not stop.wait(1.0):
            if progress[0] == last and time.perf_counter() - progress[1] > 10.0:
                hang.set()
            last = progress[0]

    wd = threading.Thread(target=watchdog, daemon=True)
    samples: list[tuple[float, float, int]] = []
    # Step times go into a ring buffer allocated (and touched) up front: a growing list would itself show up as
    # RSS drift over a 10-minute soak.
    ring = np.zeros(1 << 18)
    ring.fill(0.0)
    worst_step = 0.0
    m.start()
    wd.start()
    t_start = time.perf_counter()
    next_sample = t_start
    try:
        while time.perf_counter() - t_start < seconds:
            t0 = time.perf_counter()
            m.check()
            # Known injection schedule: every 97th step gets 1..3 bad lanes (k cycles with the step count).
            if step % 97 == 13:
                k = (step // 97) % 3 + 1
                idx.copy_(bad_host[k - 1], non_blocking=True)
                injected += k
                inject_steps += 1
            else:
                idx.copy_(good_host, non_blocking=True)
            graph.replay()
            tok.item()
            step += 1
            progress[0], progress[1] = step, time.perf_counter()
            dt = progress[1] - t0
            ring[step % ring.shape[0]] = dt
            worst_step = max(worst_step, dt)
            if progress[1] >= next_sample:
                samples.append((progress[1] - t_start, rss_mib(), torch.cuda.memory_allocated()))
                next_sample += 1.0
        alive = m.reader_alive
        ticks = m.ticks
    finally:
        stop.set()
        m.stop()
        snap = m.drain()
        log.removeHandler(lines)
        log.propagate, log.level = old_prop, old_level
    dev_name = next(iter(m.readers()))
    hit = snap.get((dev_name, site.name))
    count = hit.count if hit is not None else 0
    logged = sum(lines.deltas)
    res.fig("steps", single(step, unit="steps", label="steps replayed"))
    res.fig("seconds", single(seconds, unit="s", label="soak length"))
    res.fig("injected_hits", single(injected, unit="hits", label=f"hits injected ({inject_steps} steps)"))
    res.fig("counted_hits", single(count, unit="hits", label="arena count after drain"))
    res.fig("logged_hits", single(logged, unit="hits", label="sum of WARNING deltas"))
    res.fig("warning_lines", single(len(lines.deltas), unit="lines", label="WARNING lines (aggregated per 1 s)"))
    res.fig("reader_ticks_per_s", single(ticks / seconds, unit="1/s", label="reader ticks per second"))
    recent = ring[: min(step, ring.shape[0])].tolist()
    res.fig("step_ms", stats(recent, unit="ms", label=f"step time (last {len(recent)} steps)", dist=True, scale=1e3))
    res.fig("worst_step_ms", single(worst_step * 1e3, unit="ms", label="longest step of the whole soak"))
    warm = [s for s in samples if s[0] >= min(10.0, seconds / 5)] or samples
    rss = [s[1] for s in warm]
    cuda_mem = [s[2] for s in warm]
    rss_drift = rss[-1] - rss[0] if rss else None
    cuda_drift = (cuda_mem[-1] - cuda_mem[0]) / 2**20 if cuda_mem else None
    res.fig("rss_drift_mib", single(rss_drift, unit="MiB", label="RSS, last - first sample after warm-up"))
    res.fig("rss_mib", stats(rss, unit="MiB", label="RSS samples (1/s)"))
    res.fig("cuda_alloc_drift_mib", single(cuda_drift, unit="MiB", label="memory_allocated, last - first"))
    res.target(
        "no hang",
        "worst_step_ms",
        "no step > 10 s, reader alive at the end",
        None if hang.is_set() else 0.0,
        not hang.is_set() and alive,
    )
    res.target(
        "no missed or extra counts",
        "counted_hits",
        "arena count == logged deltas == injected",
        count,
        count == injected and logged == injected,
    )
    flat = rss_drift is not None and abs(rss_drift) < 16.0 and cuda_drift == 0
    res.target("memory flat", "rss_drift_mib", "RSS drift < 16 MiB, memory_allocated drift 0", rss_drift, flat)
    return res.to_dict()
