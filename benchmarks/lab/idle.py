"""q6. Idle: arena copies per second while the engine calls check(), then after check() stops (before and after
the idle tail), then after check() resumes.

Why it matters: a copy every interval keeps an idle GPU out of its low-power state, at several times its idle
power. The reader still wakes up every interval (cheap, CPU only) but must start no copy once ``idle_tail`` has
passed without a check(). The bench uses a short tail (0.25 s) and interval (5 ms) so the
phases are short; the logic is the same at the defaults (2 s, 50 ms).

Target: 0 copies per second after the tail.
"""

from __future__ import annotations

import time

from tripwire import Monitor, SiteRegistry

from .common import Ctx, Result, single
from .questions import label

INTERVAL = 0.005
TAIL = 0.25


def _copies(m: Monitor) -> int:
    return sum(r.copies for r in m.readers().values())


def run(ctx: Ctx) -> dict:
    res = Result(label(__name__), "Idle: copies per second before/after the idle tail", ctx)
    window = 0.5 if ctx.quick else 1.0
    reg = SiteRegistry(capacity=64)
    for i in range(64):
        reg.register(f"bench.q6.site{i}")
    m = Monitor(registry=reg, capacity=64, mode="warn", interval=INTERVAL, idle_tail=TAIL, report_every=3600.0)
    m.prealloc("cuda" if ctx.cuda else "cpu")
    m.start()
    try:
        # Active: the engine calls check() every millisecond.
        c0, t0, k0 = _copies(m), time.perf_counter(), m.ticks
        last_check = t0
        while time.perf_counter() - t0 < window:
            m.check()
            last_check = time.perf_counter()
            time.sleep(0.001)
        active_rate = (_copies(m) - c0) / (time.perf_counter() - t0)
        active_ticks = (m.ticks - k0) / (time.perf_counter() - t0)

        # The tail itself: copies continue until idle_tail has passed since the last check().
        c_tail = _copies(m)
        time.sleep(TAIL + 4 * INTERVAL)
        tail_copies = _copies(m) - c_tail

        # Idle: no check() at all.
        c1, t1, k1, s1 = _copies(m), time.perf_counter(), m.ticks, m.idle_skips
        time.sleep(window)
        idle_rate = (_copies(m) - c1) / (time.perf_counter() - t1)
        idle_ticks = (m.ticks - k1) / (time.perf_counter() - t1)
        idle_skips = m.idle_skips - s1

        # Resume: the first check() wakes the copies again.
        c2, t2 = _copies(m), time.perf_counter()
        first_copy_after = None
        while time.perf_counter() - t2 < window:
            m.check()
            if first_copy_after is None and _copies(m) > c2:
                first_copy_after = (time.perf_counter() - t2) * 1e3
            time.sleep(0.001)
        resume_rate = (_copies(m) - c2) / (time.perf_counter() - t2)
    finally:
        m.stop()
    del last_check
    res.fig("copies_per_s_active", single(active_rate, unit="1/s", label="copies/s while check() is called"))
    res.fig("ticks_per_s_active", single(active_ticks, unit="1/s", label="reader ticks/s while active"))
    res.fig("copies_during_tail", single(tail_copies, unit="copies", label=f"copies in the {TAIL} s tail"))
    res.fig("copies_per_s_idle", single(idle_rate, unit="1/s", label="copies/s after the idle tail"))
    res.fig("ticks_per_s_idle", single(idle_ticks, unit="1/s", label="reader wake-ups/s after the tail (no copy)"))
    res.fig("idle_skips", single(idle_skips, unit="ticks", label="ticks skipped as idle"))
    res.fig("copies_per_s_resumed", single(resume_rate, unit="1/s", label="copies/s after check() resumes"))
    res.fig(
        "resume_ms",
        single(first_copy_after, unit="ms", label="first copy after check() resumes"),
    )
    res.target("no copies when idle", "copies_per_s_idle", "0 copies/s after the tail", idle_rate, idle_rate == 0)
    res.note(f"interval {INTERVAL * 1e3:.0f} ms, idle_tail {TAIL} s (bench settings; defaults are 50 ms / 2 s)")
    if not ctx.cuda:
        res.note("CPU arena: a 'copy' is a direct read; on the GPU each is a cudaMemcpyAsync on the side stream")
    return res.to_dict()
