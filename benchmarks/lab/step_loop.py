"""q3. Reader cost on an engine-like step loop.

One step, as an engine's decode loop does it:
  1. ``check()`` (tripwire's one attribute read),
  2. scheduler-like Python work building per-request metadata (calibrated to ~300 us on this CPU),
  3. the metadata copied into a static device tensor (pinned host buffer, non_blocking),
  4. a CUDA-graph replay of a decode step: 48 layers of small elementwise launches plus one guarded gather per
     layer (tripwire.testing.gather) counting into that layer's row of the arena (64 rows), then a logits matmul and
     an argmax,
  5. a host read of the sampled tokens (``.tolist()``: the per-step sync every engine has).

Variants, run in one process, interleaved in rotated order over several rounds (paired):
  * ``none_a`` / ``none_b``: no reader (twice: their difference is the noise floor),
  * ``tripwire_50ms`` / ``tripwire_1ms``: tripwire's reader thread at that interval,
  * ``sync_50ms``: a naive reader thread doing ``arena.tolist()`` every 50 ms (a synchronous D2H that queues
    behind the compute stream),
  * ``per_instrument_64``: "one reader per instrument": 64 threads, each copying its own counter row every 50 ms
    with its own pinned buffer, side stream and event (the non-blocking discipline, but 64 copies and 64 wake-ups
    instead of one),
  * ``tripwire_50ms_gil3ms``: the validation control, tripwire at 50 ms whose reader thread also holds the GIL for
    3 ms every tick: a known cost both estimators below must see and agree on.

Two estimators. (1) Run means: the MEAN step time (total time / steps; a reader that costs one step in fifty would
vanish in a median), each variant against the no-reader arms OF ITS OWN ROUND (on the GPU 42 rounds of 250 steps,
every variant once per round in rotated order: a GPU host's step time moves by tens of percent for seconds at a
time, so runs are short and many). The judged figure is the larger of the median over rounds of that paired overhead
and the pooled means; the noise floor is the largest of the median and pooled A/A differences (none_a vs none_b) and
twice the median's robust standard error. That floor (the ``noise_floor_pct`` figure) is far above 0.1 % on the GPU
hosts: run means cannot resolve the target.
(2) Attribution (:func:`step_loop_stats.attribute`): every tick's span is traced, and the time of the few steps it touched is
compared with the steps touched by the same ticks moved half an interval away (same selection, same host phase, no
tick): the ticks' own cost, with the noise of a few steps per tick; its floor comes from virtual ticks on the
no-reader runs. It is validated by the GIL-holding control (it must see the control's cost and agree with the run
means on it), and the run means must not show more than their floor (a cost spread out in time, which the
attribution cannot see). The mark is judged on the attribution under those conditions
(:func:`step_loop_stats.judge_attributed`). The statistics live in ``step_loop_stats.py``; this module runs the loop.

The engine thread is pinned to one core with every reader thread on the others (``os.sched_setaffinity``: no
migration, no reader sharing the engine's core). The reader thread's own CPU time per wall time is measured too.

Without a GPU the same loop runs with an eager CPU "decode step" (torch ops on small tensors, an index_select for
the gather) and CPU arenas: it measures what a reader thread costs the engine thread through the GIL alone.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from math import inf

import torch

from tripwire import Monitor, SiteRegistry

from .common import Ctx, Result, calibrate_spin, capture, single, stats
from .questions import label
from .step_loop_readers import HEAVY, HEAVY_HOLD_S, N_ROWS, READERS, TRIPWIRE, VARIANTS, CompetingReaders, cpu_split
from .step_loop_stats import (
    ATTR_INTERVAL_S,
    ATTR_MARGIN_S,
    Run,
    attribute,
    attributed_pct,
    judge,
    judge_attributed,
    median_and_se,
    split_run,
    virtual_spans,
)

# Attribution (step_loop_stats.attribute): only where ticks are far apart compared with a step; at 1 ms every step is
# touched.
ATTRIBUTED = ("tripwire_50ms", HEAVY)
# The long steady runs (GPU): tripwire at 50 ms, then no reader, about a thousand (virtual) ticks each, pooled into the
# judged attribution and its null with the short runs' (the per-tick noise of a host whose step time jumps between
# phases needs that many ticks to resolve 0.1 %).
STEADY_STEPS = 60000


class _Decode:
    """The decode step: ``prepare(slots)`` stages the metadata, ``step()`` runs the compute, ``tokens()`` reads the
    sampled tokens back to the host."""

    def __init__(self, m: Monitor, reg: SiteRegistry, cuda: bool, quick: bool) -> None:
        self.cuda = cuda
        dev = "cuda" if cuda else "cpu"
        self.layers = 48 if cuda else 8
        bs, d, vocab, rows = (64, 256, 4096, 4096) if cuda else (16, 64, 512, 256)
        self.bs, self.rows = bs, rows
        g = torch.Generator(device="cpu").manual_seed(3)
        self.w = [torch.randn(d, generator=g).to(dev) * 0.01 + 1 for _ in range(self.layers)]
        self.b = [torch.randn(d, generator=g).to(dev) * 0.01 for _ in range(self.layers)]
        self.table = torch.randn(rows, d, generator=g).to(dev)
        self.w_out = (torch.randn(d, vocab, generator=g) * 0.05).to(dev)
        self.x = torch.randn(bs, d, generator=g).to(dev)
        self.idx = torch.zeros(bs, dtype=torch.int64, device=dev)
        self.idx_host = torch.zeros(bs, dtype=torch.int64, pin_memory=cuda)
        self.h = torch.empty(bs, d, device=dev)
        self.t = torch.empty(bs, d, device=dev)
        self.gath = torch.empty(bs, d, device=dev)
        self.toks = torch.empty(bs, dtype=torch.int64, device=dev)
        self.ctrs = [m.counter(reg.by_id(i), dev) for i in range(self.layers)]
        self.graph = None
        if cuda:
            from tripwire.testing import gather_rows

            self._gather = gather_rows
            self.graph = capture(self._body)

    def _body(self) -> None:
        h, t = self.h, self.t
        h.copy_(self.x)
        for i in range(self.layers):
            torch.mul(h, self.w[i], out=t)
            torch.add(t, self.b[i], out=t)
            if self.cuda:
                self._gather(self.table, self.idx, self.gath, ctr=self.ctrs[i])
            else:
                torch.index_select(self.table, 0, self.idx, out=self.gath)
            torch.add(t, self.gath, alpha=0.01, out=h)
            torch.tanh(h, out=h)
        torch.argmax(h @ self.w_out, dim=-1, out=self.toks)

    def prepare(self, slots: list[int]) -> None:
        vals = [s % self.rows for s in slots[: self.bs]]
        vals += [0] * (self.bs - len(vals))
        self.idx_host.copy_(torch.tensor(vals, dtype=torch.int64))
        self.idx.copy_(self.idx_host, non_blocking=True)

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()

    def tokens(self) -> list[int]:
        return self.toks.tolist()


class _TickTrace:
    """Records when each reader tick ran: ``(start, end)`` on the steps' clock (perf_counter), from the monitor's
    own trace (:meth:`tripwire.Monitor.trace`): a Python tick is the reader thread's whole loop body -- taking the
    readers back from the native tick, the tick itself, handing them back; native quiet ticks come from the native
    thread's span ring (CLOCK_MONOTONIC, which is perf_counter's clock on Linux: checked). With coordination on, the
    coordinator's store rounds (its own threads, sharing the engine's GIL) are traced and attributed too."""

    def __init__(self, m: Monitor) -> None:
        self.spans: list[tuple[float, float]] = []
        self.since = -inf
        self.variant = ""
        self.kinds: dict[str, list[int]] = {}  # variant -> [Python ticks, native ticks] run
        impl = time.get_clock_info("perf_counter").implementation
        if "CLOCK_MONOTONIC" not in impl or "RAW" in impl:
            raise RuntimeError(f"perf_counter is {impl}, not CLOCK_MONOTONIC: native tick spans would be misplaced")
        self._h0: dict = {}

    def clear(self) -> None:
        self.spans.clear()
        self.since = time.perf_counter()

    def arm(self, m: Monitor, coord: object | None = None) -> None:
        """Start recording (right after start(): each start makes a new native thread)."""
        m.trace(on=True)
        if coord is not None:
            coord.trace(on=True)  # type: ignore[attr-defined]
        self._h0 = m.health()

    def add_native(self, m: Monitor, coord: object | None = None) -> None:
        """Take the ticks since :meth:`clear` (call before stop(), which frees the native thread)."""
        self.spans = [sp for sp in m.trace() if sp[0] >= self.since]
        if coord is not None:
            self.spans = sorted(self.spans + [sp for sp in coord.trace() if sp[0] >= self.since])  # type: ignore[attr-defined]
        h = m.health()
        k = self.kinds.setdefault(self.variant, [0, 0])
        k[0] += h["python_ticks"] - self._h0.get("python_ticks", 0)
        k[1] += h["native_ticks"] - self._h0.get("native_ticks", 0)


def _run_variant(
    dec: _Decode, work: Callable[[], list[int]], m: Monitor, steps: int
) -> tuple[float, list[float], list[float]]:
    """Mean step time (us), every measured step's duration and its start (s, perf_counter)."""
    warm = max(steps // 10, 20)
    times: list[float] = []
    starts: list[float] = []
    t_all = 0.0
    for s in range(warm + steps):
        t0 = time.perf_counter()
        m.check()
        dec.prepare(work())
        dec.step()
        dec.tokens()
        dt = time.perf_counter() - t0
        if s >= warm:
            times.append(dt)
            starts.append(t0)
            t_all += dt
    return t_all / steps * 1e6, times, starts


def _reader_cpu_s(m: Monitor) -> float | None:
    """CPU seconds tripwire's reader has used so far: its Python thread's clock plus its native thread's, None if
    not available."""
    t = m._thread  # the bench reads the library's private thread handle: the only way to its CPU clock
    if t is None or t.ident is None or not t.is_alive() or not hasattr(time, "pthread_getcpuclockid"):
        return None
    native = m.native.cpu_s()
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident)) + (native or 0.0)


def _rounds(
    dec: _Decode,
    work: Callable[[], list[int]],
    m: Monitor,
    readers: CompetingReaders,
    trace: _TickTrace,
    steps: int,
    rounds: int,
    ctx: Ctx,
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[int]], dict[str, list[float]], dict]:
    """Every variant once per round, in rotated order: per-round mean step times, pooled step times, reads, for
    tripwire's variants the reader thread's CPU time over the run's wall time (%), and every run's raw steps and
    tick spans (for the attribution)."""
    means: dict[str, list[float]] = {v: [] for v in VARIANTS}
    pooled: dict[str, list[float]] = {v: [] for v in VARIANTS}
    reads: dict[str, list[int]] = {v: [] for v in VARIANTS}
    cpu_share: dict[str, list[float]] = {v: [] for v in VARIANTS}
    raw: dict[str, list[Run]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for v in order:
            t0 = m.ticks
            trace.clear()
            trace.variant = v
            readers.start(v)
            trace.arm(m, readers.coord)
            try:
                cpu0, wall0 = _reader_cpu_s(m), time.perf_counter()
                mean_us, times, starts = _run_variant(dec, work, m, steps)
                cpu1, wall1 = _reader_cpu_s(m), time.perf_counter()
                trace.add_native(m, readers.coord)
            finally:
                readers.stop()
            if cpu0 is not None and cpu1 is not None:
                cpu_share[v].append((cpu1 - cpu0) / (wall1 - wall0) * 100)
            means[v].append(mean_us)
            pooled[v].extend(times)
            raw[v].append((starts, times, list(trace.spans)))
            reads[v].append(readers.reads if not v.startswith("tripwire") else m.ticks - t0)
            ctx.log(f"round {r} {v}: mean step {mean_us:.1f} us")
    return means, pooled, reads, cpu_share, raw


def _attribution(res: Result, raw: dict[str, list[Run]], unit: int) -> dict[str, tuple[float, float]]:
    """The attributed overheads (pooled %, SE) of ATTRIBUTED and of the no-reader null, recorded as figures."""
    half = ATTR_INTERVAL_S / 2
    spans50 = [b - a for _, _, spans in raw["tripwire_50ms"] for a, b in spans]
    width = statistics.median(spans50) if spans50 else 1e-4
    out: dict[str, tuple[float, float]] = {}
    for v in (*ATTRIBUTED, "null"):
        runs = []
        used = 0
        arms = ("none_a", "none_b") if v == "null" else (v,)
        for arm in arms:
            pieces = [piece for run in raw[arm] for piece in split_run(run, unit)]
            for i, (starts, durs, spans) in enumerate(pieces):
                if v == "null":
                    spans = virtual_spans(starts, durs, width, seed=i + 1000 * arms.index(arm))
                real, control, n = attribute(starts, durs, spans, half, ATTR_MARGIN_S)
                runs.append((real, control, float(sum(durs))))
                used += n
        out[v] = attributed_pct(runs)
        label = (
            "no reader: virtual ticks every 50 ms (the attribution's null; the long no-reader run included, in pieces)"
            if v == "null"
            else f"{v}: time of the steps its ticks touched minus the same half an interval either side, over all "
            f"time ({len(runs)} runs{' and pieces of the long one' if v == 'tripwire_50ms' else ''})"
        )
        res.fig(f"attributed_pct_{v}", single(out[v][0], unit="%", label=label))
        res.fig(f"attributed_se_pct_{v}", single(out[v][1], unit="%", label=f"{v}: standard error (per-run spread)"))
        res.fig(f"attributed_ticks_{v}", single(used, unit="ticks", label=f"{v}: ticks attributed"))
    res.fig(
        "tick_span_us_tripwire_50ms", stats(spans50, unit="us", label="tripwire at 50 ms: traced tick span", scale=1e6)
    )
    return out


def run(ctx: Ctx) -> dict:
    coordinated = bool(ctx.extra.get("coordinate"))
    title = "Reader cost on an engine-like step loop" + ("" if ctx.cuda else " (CPU variant: eager CPU decode step)")
    if coordinated:
        title += ", with tripwire.distributed.coordinate() on (one rank, a TCPStore on 127.0.0.1)"
    res = Result(label(__name__), title, ctx)
    dev = "cuda" if ctx.cuda else "cpu"
    if ctx.cuda:
        steps, rounds = (300, 4) if ctx.quick else (250, 42)  # 42: every variant in every position 6 times
    else:
        steps, rounds = (300, 3) if ctx.quick else (1000, 3)
    reg = SiteRegistry(capacity=N_ROWS)
    for i in range(N_ROWS):
        reg.register(f"bench.q3.layer{i}", description="q3 per-layer gather guard")
    m = Monitor(registry=reg, capacity=N_ROWS, mode="warn", interval=0.05, idle_tail=3600.0, report_every=3600.0)
    m.prealloc(dev)
    dec = _Decode(m, reg, ctx.cuda, ctx.quick)
    work = calibrate_spin(300.0)
    t_work = min(_timed(work) for _ in range(20)) * 1e6
    # Pinned on the GPU only: the CPU variant's eager decode step runs torch's intra-op threads, which would be
    # created on the engine's single core and serialise every step behind them.
    split = cpu_split() if ctx.cuda else None
    original_affinity = os.sched_getaffinity(0) if split is not None else None
    store = None
    if coordinated:
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    readers = CompetingReaders(m, dev, split, store)
    trace = _TickTrace(m)
    # As engines do after start-up (vLLM freezes the heap after capturing its graphs): move every object alive now
    # out of the collector's reach, so that a full collection does not walk torch's and Triton's start-up objects
    # (such a walk pauses every variant alike, for far longer than a step, and raises the noise floor). Garbage made
    # during the runs (the readers' included) is still collected, so a reader's allocations still show; the number
    # of full collections during the runs is recorded.
    gc.collect()
    gc.freeze()
    full_before = gc.get_stats()[2]["collections"]
    try:
        if split is not None:
            os.sched_setaffinity(0, split[0])
        # Bring the clocks up before the first measured round (a cold host's first rounds run fast or slow).
        _run_variant(dec, work, m, max(steps, 1000 if ctx.cuda else 100))
        means, pooled, reads, cpu_share, raw = _rounds(dec, work, m, readers, trace, steps, rounds, ctx)
        # The steady state of the reader alone: one long run at 50 ms, its clock read after a warm-up of several
        # ticks (each short run above starts a new reader thread, whose first CUDA work pays one-time per-thread
        # set-up), for the CPU-share bound.
        readers.start("tripwire_50ms")
        trace.arm(m, readers.coord)
        try:
            _run_variant(dec, work, m, 600 if ctx.cuda else 100)
            trace.clear()
            cpu0, wall0, k0 = _reader_cpu_s(m), time.perf_counter(), m.ticks
            _, steady_durs, steady_starts = _run_variant(dec, work, m, STEADY_STEPS if ctx.cuda else 300)
            cpu1, wall1, k1 = _reader_cpu_s(m), time.perf_counter(), m.ticks
            trace.add_native(m, readers.coord)
        finally:
            readers.stop()
        steady_spans = list(trace.spans)
        steady_attr = attribute(steady_starts, steady_durs, steady_spans, ATTR_INTERVAL_S / 2, ATTR_MARGIN_S)
        steady_share = steady_tick_us = None
        if cpu0 is not None and cpu1 is not None:
            steady_share = (cpu1 - cpu0) / (wall1 - wall0) * 100
            steady_tick_us = (cpu1 - cpu0) / max(k1 - k0, 1) * 1e6
        steady_s = wall1 - wall0
        # The null's long run: the same loop with no reader (virtual ticks placed on it in _attribution).
        _, null_durs, null_starts = _run_variant(dec, work, m, STEADY_STEPS if ctx.cuda else 300)
        raw["none_a"].append((null_starts, null_durs, []))
    finally:
        gc.unfreeze()
        if original_affinity is not None:
            os.sched_setaffinity(0, original_affinity)
    full_gcs = gc.get_stats()[2]["collections"] - full_before
    for v in VARIANTS:
        res.fig(f"step_us_{v}", stats(means[v], unit="us", label=f"mean step time, {v} (per round)"))
        res.fig(
            f"step_p99_us_{v}", stats(pooled[v], unit="us", label=f"step time distribution, {v}", dist=True, scale=1e6)
        )
    base = [(a + b) / 2 for a, b in zip(means["none_a"], means["none_b"], strict=True)]
    # Every run has the same number of steps, so the pooled mean of a variant is the mean of its run means.
    pool = {v: statistics.fmean(means[v]) for v in VARIANTS}
    pool_base = (pool["none_a"] + pool["none_b"]) / 2
    aa = [(a / b - 1) * 100 for a, b in zip(means["none_a"], means["none_b"], strict=True)]
    aa_median, aa_se = median_and_se(aa)
    aa_pooled = (pool["none_a"] / pool["none_b"] - 1) * 100
    floor = max(abs(aa_median), abs(aa_pooled), 2 * aa_se)
    res.fig("run_noise_pct", stats([abs(x) for x in aa], unit="%", label="|none_a / none_b - 1| per round (one pair)"))
    res.fig("aa_median_pct", single(aa_median, unit="%", label="none_a / none_b - 1, median over rounds"))
    res.fig("aa_se_pct", single(aa_se, unit="%", label="robust standard error of that median"))
    res.fig("aa_pooled_pct", single(aa_pooled, unit="%", label="pooled A/A"))
    res.fig(
        "noise_floor_pct",
        single(floor, unit="%", label="noise floor: max(|median A/A|, |pooled A/A|, 2 x the median's standard error)"),
    )
    for v in READERS:
        ov = [(x / b - 1) * 100 for x, b in zip(means[v], base, strict=True)]
        med, se = median_and_se(ov)
        pooled_ov = (pool[v] / pool_base - 1) * 100
        res.fig(f"overhead_round_pct_{v}", stats(ov, unit="%", label=f"{v} vs no reader (paired per round)"))
        res.fig(f"overhead_median_pct_{v}", single(med, unit="%", label=f"{v} vs no reader (median of paired rounds)"))
        res.fig(f"overhead_se_pct_{v}", single(se, unit="%", label=f"{v}: robust standard error of that median"))
        res.fig(f"overhead_pooled_pct_{v}", single(pooled_ov, unit="%", label=f"{v} vs no reader (pooled means)"))
        # The judged figure: the larger of the two. A median alone hides a reader that costs a lot in a few rounds
        # (sync_50ms: compare its median and pooled figures); pooled means alone move with the host's phases.
        res.fig(
            f"overhead_pct_{v}",
            single(max(med, pooled_ov), unit="%", label=f"{v} vs no reader (max of median and pooled)"),
        )
    for v in VARIANTS:
        if cpu_share[v]:
            # What the reader can take from the engine thread through the GIL (or the driver's lock) is about the
            # CPU time it runs: a bound that does not depend on the host's step-time noise, approximate (it leaves
            # out the engine's own wake-up after a GIL hand-off). It applies to a reader that never waits on the
            # compute stream, q2's subject; a synchronous reader's cost is its wait.
            res.fig(
                f"reader_cpu_share_pct_{v}",
                stats(cpu_share[v], unit="%", label=f"{v}: reader CPU time / wall time (per short run, incl. start)"),
            )
    res.fig(
        "reader_cpu_share_steady_pct",
        single(
            steady_share,
            unit="%",
            label="tripwire at 50 ms, one long run: reader CPU time (Python + native threads) / wall time",
        ),
    )
    res.fig(
        "reader_cpu_per_tick_steady_us",
        single(
            steady_tick_us,
            unit="us",
            label="tripwire at 50 ms, one long run: reader CPU time (Python + native threads) per tick",
        ),
    )
    for v in TRIPWIRE:
        py, nat = trace.kinds.get(v, [0, 0])
        res.fig(f"python_ticks_{v}", single(py, unit="ticks", label=f"{v}: reader ticks run in Python (all runs)"))
        res.fig(f"native_ticks_{v}", single(nat, unit="ticks", label=f"{v}: quiet ticks run natively (all runs)"))
    res.fig("full_gcs", single(full_gcs, unit="collections", label="full (gen-2) collections during the runs"))
    res.fig("scheduler_work_us", single(t_work, unit="us", label="scheduler-like Python work per step (min)"))
    res.fig("graph_launches_per_step", single(dec.layers * 5 + 2, unit="launches", label="kernel launches per step"))
    # The long run is a run of tripwire_50ms too: its ticks join the short runs' in the judged attribution (its own
    # figure, attributed_pct_steady, is also reported alone); the long no-reader run joins the null's (above).
    raw["tripwire_50ms"].append((steady_starts, steady_durs, steady_spans))
    attr = _attribution(res, raw, steps)
    res.fig(
        "attributed_pct_steady",
        single(
            attributed_pct([(steady_attr[0], steady_attr[1], sum(steady_durs))])[0] if steady_durs else None,
            unit="%",
            label=f"tripwire at 50 ms, the long run alone ({steady_attr[2]} ticks): attributed overhead",
        ),
    )
    heavy_rounds = [(x / b - 1) * 100 for x, b in zip(means[HEAVY], base, strict=True)]
    heavy_direct_se = statistics.stdev(heavy_rounds) / len(heavy_rounds) ** 0.5 if len(heavy_rounds) > 1 else inf
    ov50 = res.figures["overhead_pct_tripwire_50ms"]["median"]
    verdict = judge_attributed(
        attr["tripwire_50ms"],
        attr["null"],
        attr[HEAVY],
        (res.figures[f"overhead_pooled_pct_{HEAVY}"]["median"], heavy_direct_se),
        judge(ov50, floor),
        control=f"the {HEAVY_HOLD_S * 1e3:.0f} ms GIL-holding control",
    )
    res.fig("attribution_floor_pct", single(verdict.floor, unit="%", label="attribution floor: max(|null|, 2 SE)"))
    why = verdict.why + f"; run means: {ov50:.3f} % against a noise floor of {floor:.3f} %"
    if steady_share is not None:
        why += f"; reader CPU (Python + native) {steady_share:.3f} % of a core over a {steady_s:.1f} s run"
    res.target(
        "tripwire at 50 ms vs no reader",
        "attributed_pct_tripwire_50ms",
        "step time within 0.1 %",
        attr["tripwire_50ms"][0],
        verdict.passed,
        why,
    )
    counts = m.read_rows(dev)[: dec.layers, 0]
    if int(counts.sum()) != 0:
        res.note(f"unexpected guard hits in the step loop: {int(counts.sum())}")
    res.note(
        f"{steps} steps x {rounds} rounds per variant, rotated order, pooled; "
        + (f"engine thread on CPU {min(split[0])}, readers on {len(split[1])} other CPUs; " if split else "unpinned; ")
        + "reads per run: "
        + ", ".join(f"{v}={sum(reads[v]) // max(len(reads[v]), 1)}" for v in READERS)
    )
    if not ctx.cuda:
        res.note("CPU figures: eager CPU decode step; the readers cost the engine thread only through the GIL here")
    if coordinated:
        res.fig("store_poll_s", single(m.settings.store_poll, unit="s", label="coordinate(): seconds between polls"))
        res.note(
            f"coordinate() on during tripwire's variants (one rank, TCPStore on 127.0.0.1, store_poll "
            f"{m.settings.store_poll} s): its store rounds are traced and attributed with the reader's ticks"
        )
    return res.to_dict()


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
