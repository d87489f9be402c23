"""q5. Scaling: reader tick CPU time and bytes copied vs the number of rows (sites and clip counters, 16..1024).

A tick is one ``Monitor.poll()``: on CUDA, query the previous copy's event, take its rows, start the next copy
(one ``cudaMemcpyAsync`` of the registered rows); on CPU, read the rows directly. Then the rise detection over
every row. Between ticks (outside the timing) the side stream is synchronised, so every timed tick finds its copy
landed. Two series: ``tick_wall_us_N`` makes every tick a changed one (outside the timing the monitor's last processed
rows are made to differ from the copy in one word): compare, copy and full decode, the worst case per tick, which
the target judges;
``tick_wall_quiet_us_N`` is the common tick, whose landed copy equals the rows processed last and skips the decode.

Targets: one copy per device per tick at every row count; tick < 50 us at 1024 rows (median wall time, worst case).
"""

from __future__ import annotations

import time

from tripwire import Monitor, SiteRegistry
from tripwire._runtime.report import Reporters

from .common import Ctx, Result, single, stats
from .questions import label

ROWS = (16, 64, 256, 1024)


def instrument_kind() -> str | None:
    """The kind of the FP8 clip counter rows, when tripwire.numerics is there to report them."""
    try:
        import tripwire.numerics  # noqa: F401  (registers its reporters)
    except ImportError:
        return None
    for kind in ("clip", "fp8_clip", "fp8clip"):
        if Reporters().slots(kind) is not None:  # a reporter is registered for that kind
            return kind
    return None


def build(n_rows: int, device: str, clip_kind: str | None) -> tuple[Monitor, SiteRegistry]:
    reg = SiteRegistry(capacity=n_rows)
    for i in range(n_rows):
        # Half guard sites, half clip counters when the numerics reporter exists (it has its own count slots).
        if clip_kind is not None and i % 2:
            reg.register(f"bench.q5.clip{i}", kind=clip_kind)
        else:
            reg.register(f"bench.q5.site{i}")
    m = Monitor(registry=reg, capacity=n_rows, mode="warn", interval=1.0, idle_tail=3600.0, report_every=3600.0)
    m.prealloc(device)
    return m, reg


def run(ctx: Ctx) -> dict:
    res = Result(label(__name__), "Scaling: tick CPU time and bytes copied vs rows", ctx)
    ticks = 300 if ctx.quick else 1000
    clip_kind = instrument_kind()
    if clip_kind is None:
        res.note("tripwire.numerics (clip counters) not importable: every row is a guard site")
    else:
        res.note(f"half the rows are guard sites, half '{clip_kind}' counters")
    dev = "cuda" if ctx.cuda else "cpu"
    one_copy = True
    for n in ROWS:
        m, _ = build(n, dev, clip_kind)
        reader = next(iter(m.readers().values()))
        for _ in range(5):  # warm-up: first copy, numpy paths, kind index
            _settle(reader)
            m.poll()
        c0, b0 = reader.copies, reader.bytes_copied
        wall, cpu = _timed_ticks(m, reader, ticks, decode=True)
        quiet, _ = _timed_ticks(m, reader, ticks, decode=False)
        copies = reader.copies - c0
        per_tick = copies / (2 * ticks)
        bytes_per_tick = (reader.bytes_copied - b0) / max(copies, 1)
        one_copy &= copies == 2 * ticks
        res.fig(f"tick_wall_us_{n}", stats(wall, unit="us", label=f"tick wall time, {n} rows (full decode)", dist=True))
        res.fig(
            f"tick_cpu_us_{n}", stats(cpu, unit="us", label=f"tick thread CPU time, {n} rows (full decode)", dist=True)
        )
        res.fig(
            f"tick_wall_quiet_us_{n}",
            stats(quiet, unit="us", label=f"tick wall time, {n} rows (quiet tick)", dist=True),
        )
        native = _native_quiet_ticks(m)
        if native is not None:
            res.fig(
                f"tick_wall_native_us_{n}",
                stats(native, unit="us", label=f"native quiet tick span, {n} rows (no Python, no GIL)", dist=True),
            )
        res.fig(f"copies_per_tick_{n}", single(per_tick, unit="copies", label=f"copies per tick, {n} rows"))
        res.fig(f"bytes_per_copy_{n}", single(bytes_per_tick, unit="B", label=f"bytes per copy, {n} rows"))
        ctx.log(f"{n} rows: tick p50 {res.figures[f'tick_wall_us_{n}']['p50']:.1f} us, {per_tick:.2f} copies/tick")
    res.target(
        "one copy per device per tick",
        "copies_per_tick_1024",
        "copies/tick == 1 at 16..1024 rows",
        res.figures["copies_per_tick_1024"]["median"],
        one_copy,
    )
    v = res.figures["tick_wall_us_1024"]["median"]
    res.target("tick time at 1024 rows", "tick_wall_us_1024", "median < 50 us", v, v < 50.0)
    if not ctx.cuda:
        res.note("CPU arenas: a 'copy' is a direct numpy read of the rows (no side stream, no event)")
    return res.to_dict()


def _timed_ticks(m: Monitor, reader, ticks: int, *, decode: bool) -> tuple[list[float], list[float]]:  # type: ignore[no-untyped-def]
    """``ticks`` timed ``poll()`` calls (wall and thread CPU, us), each with its copy landed; with ``decode`` the
    monitor's last processed rows are forgotten first (outside the timing), so the tick decodes in full."""
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(ticks):
        _settle(reader)
        if decode:
            # As if a counter had changed: with the last processed rows forgotten, the landed copy is copied and
            # decoded in full (confirmed progress is kept: nothing is reported).
            m.confirmer.forget_latest()
        t_cpu = time.thread_time_ns()
        t_wall = time.perf_counter_ns()
        m.poll()
        wall.append((time.perf_counter_ns() - t_wall) / 1e3)
        cpu.append((time.thread_time_ns() - t_cpu) / 1e3)
    return wall, cpu


def _native_quiet_ticks(m: Monitor, seconds: float = 0.3) -> list[float] | None:
    """The native thread's quiet tick spans (us) with the reader at 1 ms for ``seconds`` (check() called
    throughout, so it never idles); None where the native tick is unavailable."""
    m.settings = m.settings.with_overrides(interval=0.001)
    m.start()
    try:
        if m.native.ticker is None:
            return None
        m.native.trace(on=True)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            m.check()
            time.sleep(0.001)
        spans = m.native.trace()
    finally:
        m.stop()
        m.settings = m.settings.with_overrides(interval=1.0)
    return [(b - a) / 1e3 for a, b in spans.tolist()]


def _settle(reader) -> None:  # type: ignore[no-untyped-def]
    # Outside the timing: let the copy in flight land, so the timed tick takes its rows and starts the next one.
    if reader.is_cuda:
        reader.stream.synchronize()
