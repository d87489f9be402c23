"""``tripwire demo``: a small paged-KV decode loop built from the reference kernels, with injected metadata faults.

Each step, for a batch of requests: block-table gather -> slot mapping -> q/k/v (torch) -> rope -> KV write
(torch) -> paged KV gather -> a toy attention and the next token (torch) -> a recurrent-state checkpoint copy ->
zeroing the blocks of finished requests. On a GPU the step is captured once in a CUDA graph (counters preallocated
before the capture, the reader started after it) and replayed; without one it runs eagerly on the CPU through the
Triton interpreter.

Faults are written into the metadata between steps (and restored after the step), like a host-side bug would:

* ``block@S``: a block id far past the pool in a request's block-table row (paged gather masks and counts it);
* ``row@S``: a batch entry's request row past the table (block-table gather, slot mapping, state copy);
* ``count@S``: a request's block count past the table's width (block-table gather);
* ``rope@S``: a position past the rope table (the FATAL site: the stop arms, the loop stops at the next check);
* ``last``: a bad block id in the free list on the very last step, which only the final drain can catch.

What it shows: the engine keeps running through masked faults; WARNING lines name the exact site and entry; the
fatal rope site stops the loop at the next ``tripwire.check()`` even in warn mode (the demo then restarts the engine
after ``tripwire.reset()``, as an operator would, unless ``--no-restart``); the last step's hit is reported by the
final ``tripwire.drain()``; a summary table closes the run. Exit status 0 when every injected fault was counted at
its site (1 otherwise; mode off reads nothing, so it checks nothing).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field

import torch

import tripwire

from .toy_engine import FAULT_KINDS, B, Fault, ToyEngine, inject, restore

log = logging.getLogger("tripwire.demo")


@dataclass
class SiteSummary:
    count: int = 0
    first: tuple[int | None, int | None] | None = None
    vmin: int | None = None
    vmax: int | None = None
    seen_by: set[str] = field(default_factory=set)


def _parse_faults(spec: str, steps: int) -> list[Fault]:
    if spec.strip().lower() in ("", "none"):
        return []
    out = []
    for item in spec.split(","):
        item = item.strip()
        kind, _, at = item.partition("@")
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r} in --faults; known: {', '.join(FAULT_KINDS)}")
        if kind == "last":
            if at:
                raise ValueError("the 'last' fault takes no step: it is injected on the last step")
            out.append(Fault(kind, steps - 1))
            continue
        try:
            step = int(at)
        except ValueError:
            raise ValueError(f"fault {item!r}: expected KIND@STEP with an integer step") from None
        if not 0 <= step < steps:
            raise ValueError(f"fault {item!r}: step must be in [0, {steps})")
        out.append(Fault(kind, step))
    return out


def _default_faults(steps: int) -> str:
    if steps < 8:
        return "last"
    return f"block@{steps // 5},row@{2 * steps // 5},count@{steps // 2},rope@{3 * steps // 5},last"


class _Progress:
    """A text progress bar on stderr: redrawn in place on a terminal, one line per 10 % otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.tty = sys.stderr.isatty()
        self.shown = -1
        self.drawn = False

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        tenth = 10 * done // self.total
        if self.tty:
            width = 30
            fill = width * done // self.total
            sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} steps")
            sys.stderr.flush()
            self.drawn = True
        elif tenth != self.shown:
            self.shown = tenth
            sys.stderr.write(f"progress: [{'#' * tenth}{'.' * (10 - tenth)}] {done}/{self.total} steps\n")

    def clear(self) -> None:
        if self.drawn:
            sys.stderr.write("\r\033[K")
            self.drawn = False


class _Observer(logging.Handler):
    """Notes which sites the monitor reported, and in which phase (reader during the run, or the final drain)."""

    _SITE = re.compile(r"at site '([^']+)'")

    def __init__(self, progress: _Progress) -> None:
        super().__init__(level=logging.WARNING)
        self.phase = "reader"
        self.seen: dict[str, set[str]] = {}
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        self.progress.clear()  # keep the bar from overwriting the line (the stream handler prints it next)
        m = self._SITE.search(record.getMessage())
        if m:
            self.seen.setdefault(m.group(1), set()).add(self.phase)


def _merge(acc: dict[str, SiteSummary], snap: dict) -> None:
    for (_dev, name), hit in snap.items():
        s = acc.setdefault(name, SiteSummary())
        s.count += hit.count
        if s.first is None:
            s.first = (hit.first_row, hit.first_value)
        for v in (hit.min_value, hit.max_value):
            if v is not None:
                s.vmin = v if s.vmin is None else min(s.vmin, v)
                s.vmax = v if s.vmax is None else max(s.vmax, v)


_MODE_MEANS = {
    "warn": "hits are reported and the loop goes on; a FATAL site's hit still stops it",
    "raise": "every hit stops the loop",
    "off": "nothing is read; the kernels still mask and count",
}


def _why_stopped(e: tripwire.GuardTripped, mode: str) -> str:
    """Why ``e`` stops the loop in ``mode``: the demo runs in warn and still stops, and must say why."""
    if e.fatal:
        return "a FATAL site (its masked write reached durable state) stops the loop in every mode, warn included"
    if e.count == 0:
        return "tripwire's own stop: " + str(e).removeprefix("tripwire: ")
    return f"mode {mode} stops the loop at every hit"


def _setup_logging() -> None:
    # The tripwire logger's own handler is only the last resort's stand-in (tripwire._runtime.logs): the root's
    # decides whether an application configured logging.
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    from .text import help_text

    p = argparse.ArgumentParser(prog="tripwire demo", description=help_text(__doc__))
    p.add_argument(
        "--engine",
        choices=["transformers", "vllm"],
        default=None,
        help="run the story inside a real engine instead of this toy loop: transformers (its continuous batching, "
        "in this process) or vllm (vLLM's own engine, in a vLLM environment); `--engine NAME --help` for its options",
    )
    p.add_argument("--steps", type=int, default=30, help="decode steps (default 30)")
    p.add_argument("--device", default=None, help="cpu (Triton interpreter) or cuda[:N]; default: cuda if available")
    p.add_argument("--mode", default="warn", choices=tripwire.MODES, help="tripwire mode (default warn)")
    p.add_argument(
        "--faults",
        default=None,
        help="comma list of KIND@STEP (kinds: block, row, count, rope) and "
        "'last'; 'none' for a clean run; default: one of each spread over the run",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the toy model and of which entries are corrupted")
    p.add_argument("--interval", type=float, default=None, help="reader interval in seconds (default 0.005)")
    p.add_argument(
        "--pace",
        type=float,
        default=0.01,
        help="least seconds per step, like a real engine's step (default 0.01; the CPU interpreter is slower anyway)",
    )
    p.add_argument(
        "--no-graph",
        action="store_true",
        help="on a GPU, run the step eagerly instead of replaying a captured CUDA graph",
    )
    p.add_argument("--no-restart", action="store_true", help="end the run when the stop arms instead of restarting")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    try:
        faults = _parse_faults(args.faults if args.faults is not None else _default_faults(args.steps), args.steps)
    except ValueError as e:
        p.error(str(e))
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    # Default: the GPU when there is one, unless the interpreter is on (its kernels cannot run on CUDA tensors
    # inside a capture), then the CPU.
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not interpreting else "cpu"))
    if device.type == "cuda" and interpreting:
        print(
            "tripwire demo: --device cuda with TRITON_INTERPRET=1 set: the interpreter cannot run the captured "
            "step on the GPU; unset TRITON_INTERPRET (or use --device cpu)",
            file=sys.stderr,
        )
        return 2
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print(
            "tripwire demo: the CPU needs the Triton interpreter; run it as `tripwire demo` or set "
            "TRITON_INTERPRET=1 before starting Python",
            file=sys.stderr,
        )
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("tripwire demo: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    _setup_logging()
    progress = _Progress(args.steps, enabled=args.steps >= 50)
    observer = _Observer(progress)
    tlog = logging.getLogger("tripwire")
    tlog.addHandler(observer)
    try:
        return _run(args, faults, device, progress, observer)
    finally:
        tlog.removeHandler(observer)
        tripwire.stop()


def _run(
    args: argparse.Namespace, faults: list[Fault], device: torch.device, progress: _Progress, observer: _Observer
) -> int:
    interval = args.interval if args.interval is not None else 0.005
    monitor = tripwire.configure(mode=args.mode, interval=interval, report_every=1.0, idle_tail=5.0)
    graph_mode = device.type == "cuda" and not args.no_graph
    t0 = time.monotonic()
    engine = ToyEngine(device, args.seed)
    tripwire.prealloc(device)  # before any capture: the arena and the reader's mirror
    if device.type == "cuda":
        engine.step()  # compile the kernels (and resolve the counter rows) outside any capture
        torch.cuda.synchronize(device)
    graph = None
    if graph_mode:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            engine.step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            engine.step()
    engine.restart()
    tripwire.reset()  # warm-up ran on clean metadata; start counting from zero
    tripwire.start()  # after capture: the reader
    where = f"{device} ({'CUDA graph replay' if graph else 'eager'}" + (
        ", Triton interpreter)" if device.type == "cpu" else ")"
    )
    print(
        f"tripwire demo: {args.steps} decode steps of {B} requests on {where}, mode {args.mode} "
        f"({_MODE_MEANS[args.mode]}), reader every {interval * 1e3:g} ms",
        file=sys.stderr,
    )
    for f in faults:
        print(f"  fault planned: {f.kind:5s} at step {f.step:3d}: {FAULT_KINDS[f.kind][0]}", file=sys.stderr)

    rng = torch.Generator().manual_seed(args.seed + 1)
    by_step: dict[int, list[Fault]] = {}
    for f in faults:
        by_step.setdefault(f.step, []).append(f)
    summary: dict[str, SiteSummary] = {}
    stops: list[tuple[int, tripwire.GuardTripped]] = []
    ran = 0
    for step in range(args.steps):
        tstep = time.monotonic()
        try:
            tripwire.check()
        except tripwire.GuardTripped as e:
            progress.clear()
            stops.append((step, e))
            print(
                f"\n>>> step {step}: tripwire.check() raised GuardTripped: site {e.site!r}, first offender row "
                f"{e.first_row} value {e.first_value}; the loop STOPS here: {_why_stopped(e, args.mode)}.",
                file=sys.stderr,
            )
            if args.no_restart:
                break
            print(
                ">>> restarting the engine (fresh requests, tripwire.reset()) to run the remaining steps\n",
                file=sys.stderr,
            )
            _merge(summary, monitor.snapshot())
            tripwire.reset()
            engine.restart()
        if step == args.steps - 1:
            # Shutdown begins: the reader gets no further tick (as when a process exits right after its last step),
            # so a hit in this final step can only be caught by the synchronous drain below.
            tripwire.stop()
        todo = by_step.get(step, [])
        for f in todo:
            inject(engine, f, rng)
            log.info("step %d: injected %s fault: %s = %d", step, f.kind, f.entry, f.value)
        if graph is not None:
            graph.replay()
        else:
            engine.step()
        for f in todo:
            restore(engine, f)
        ran += 1
        progress.update(step + 1)
        if step + 1 < args.steps:
            rest = args.pace - (time.monotonic() - tstep)
            if rest > 0:
                time.sleep(rest)
    progress.clear()
    print(
        f"\n>>> loop done after {ran} steps; final tripwire.drain() (synchronous: catches hits the reader has "
        f"not reported yet)",
        file=sys.stderr,
    )
    observer.phase = "drain"
    drained = tripwire.drain()
    tripwire.stop()
    if args.mode == "off":
        # off: nothing is read, so drain returned nothing; a tool's snapshot shows the kernels still counted.
        drained = monitor.snapshot()
    _merge(summary, drained)
    elapsed = time.monotonic() - t0
    return _report(args, faults, summary, stops, observer, ran, elapsed)


def _report(
    args: argparse.Namespace,
    faults: list[Fault],
    summary: dict[str, SiteSummary],
    stops: list[tuple[int, tripwire.GuardTripped]],
    observer: _Observer,
    ran: int,
    elapsed: float,
) -> int:
    from .. import kernels
    from .text import format_table

    out = sys.stdout
    print("\ntripwire demo summary", file=out)
    print(f"  steps run: {ran} of {args.steps}, mode {args.mode}, {elapsed:.1f} s", file=out)
    for step, e in stops:
        print(
            f"  stopped at step {step} by {e.site!r} (first offender row {e.first_row}, value {e.first_value}): "
            f"{_why_stopped(e, args.mode)}",
            file=out,
        )
    print("  faults injected:", file=out)
    for f in faults:
        print(f"    step {f.step:3d}  {f.kind:5s}  {f.entry} = {f.value}", file=out)
    rows = [("site", "fatal", "hits", "first (row, value)", "min..max value", "reported by")]
    for site in kernels.ALL_SITES:
        s = summary.get(site.name)
        fatal = "yes" if site.fatal else ""
        if s is None:
            rows.append((site.name, fatal, "0", "", "", ""))
            continue
        first = f"({s.first[0]}, {s.first[1]})" if s.first else "-"
        by = ", ".join(sorted(observer.seen.get(site.name, set()))) or (
            "not read (mode off)" if args.mode == "off" else "-"
        )
        rows.append((site.name, fatal, str(s.count), first, f"{s.vmin}..{s.vmax}", by))
    table = format_table(rows, right=(2, 4), indent="  ").splitlines()
    print(table[0], file=out)
    print("  " + "-" * (max(map(len, table)) - 2), file=out)
    print("\n".join(table[1:]), file=out)
    if args.mode == "off":
        print("  (mode off: no reader; the kernels still masked and counted, read here by a snapshot)", file=out)
    missing = []
    for f in faults:
        site_name = FAULT_KINDS[f.kind][1]
        if f.step < ran and summary.get(site_name, SiteSummary()).count == 0:
            missing.append(f"{f.kind}@{f.step} -> {site_name}")
    if missing:
        print(f"  NOT COUNTED: {', '.join(missing)}", file=out)
        return 1
    print(
        f"  every injected fault that ran ({sum(f.step < ran for f in faults)}) was masked and counted at its "
        f"site (masked: no out-of-range read or write)",
        file=out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
