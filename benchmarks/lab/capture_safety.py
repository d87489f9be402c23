"""q7. Capture safety under load: CUDA-graph captures per second, and failed captures, while a reader polls at 1 ms.

Three variants in one child process (the plain reader can leave the CUDA context in a bad way; the child keeps that
away from the rest of the suite), each making the same captures in the default ``global`` capture mode, the mode
``torch.cuda.graph`` uses:

* ``none``: no reader (the capture rate ceiling),
* ``tripwire``: tripwire's reader thread at 1 ms (it relaxes its own thread's capture mode before its first CUDA
  call),
* ``plain``: a plain reader thread at 1 ms doing what tripwire's tick does (``event.query()``, a non-blocking
  copy of the arena on its own side stream, ``event.record``), without relaxing its capture mode.

Each capture records ~60 small launches plus a guarded gather, then is replayed once and its result checked.
Failures (capture_begin/end or replay raising, or a wrong result) are counted, as are the reader's own errors.

Target: 0 failures for tripwire.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .common import Ctx, Result, python, run_child, single, subprocess_env, warm_up
from .questions import label

N_OPS = 60


def run(ctx: Ctx) -> dict:
    res = Result(label(__name__), "Capture safety under load: reader at 1 ms during captures", ctx)
    if not ctx.cuda:
        return res.skip("needs a CUDA GPU")
    n = 100 if ctx.quick else 300
    out = ctx.out / "q7_child.json"
    out.unlink(missing_ok=True)
    cmd = [python(), "-m", __name__, "--child", str(out), str(n)]
    rc, tail = run_child(cmd, subprocess_env(), 240)
    if rc is None:
        res.status, res.reason = "error", "the capture child did not finish within 240 s (a hang)"
        return res.to_dict()
    if not out.is_file():
        res.status = "error"
        res.reason = f"the capture child wrote nothing (exit {rc}): {tail[-800:]}"
        return res.to_dict()
    data = json.loads(out.read_text())
    for v, d in data["variants"].items():
        res.fig(f"captures_per_s_{v}", single(d["captures_per_s"], unit="1/s", label=f"captures/s, {v}"))
        res.fig(f"failures_{v}", single(d["failures"], unit="captures", label=f"failed captures of {n}, {v}"))
        res.fig(f"wrong_{v}", single(d["wrong"], unit="captures", label=f"captures replaying a wrong result, {v}"))
        if v != "none":
            res.fig(f"reader_reads_{v}", single(d["reader_reads"], unit="reads", label=f"reader reads, {v}"))
            res.fig(f"reader_errors_{v}", single(d["reader_errors"], unit="errors", label=f"reader errors, {v}"))
        for msg in d.get("messages", [])[:3]:
            res.note(f"{v}: {msg}")
    tw = data["variants"].get("tripwire", {})
    bad = tw.get("failures", -1) + tw.get("wrong", 0)
    res.target(
        "failed captures, tripwire reader at 1 ms", "failures_tripwire", "0 failures", tw.get("failures"), bad == 0
    )
    res.note(f"tripwire relaxed its reader's capture mode via: {data.get('relaxed')}")
    if rc != 0:
        res.note(f"the child exited with {rc}: {tail[-400:]}")
    return res.to_dict()


# ------------------------------------------------------------------------------------------------ the child
def _child(out: Path, n: int) -> None:
    import torch

    from tripwire import Monitor, SiteRegistry
    from tripwire.testing import gather_rows

    reg = SiteRegistry(capacity=64)
    for i in range(64):
        reg.register(f"bench.q7.site{i}")
    m = Monitor(registry=reg, capacity=64, mode="warn", interval=0.001, idle_tail=3600.0, report_every=3600.0)
    arena = m.prealloc("cuda")
    ctr = m.counter(reg.by_id(0), "cuda")
    x = torch.zeros(256, 256, device="cuda")
    y = torch.empty_like(x)
    table = torch.randn(1024, 64, device="cuda")
    idx = torch.arange(128, device="cuda", dtype=torch.int64)
    g_out = torch.empty(128, 64, device="cuda")

    def body() -> None:  # no allocation: every op writes a preallocated tensor
        y.copy_(x)
        for _ in range(N_OPS):
            torch.add(y, 1.0, out=y)
        gather_rows(table, idx, g_out, ctr=ctr)

    warm_up(body)
    side = torch.cuda.Stream()  # the captures below run on a side stream, as torch.cuda.graph does
    expected = float(N_OPS)
    ref = table[:128].clone()

    class Plain:
        """The plain reader: tripwire's tick without the relaxed capture mode."""

        def __init__(self) -> None:
            self.mirror = torch.zeros(arena.shape, dtype=arena.dtype, pin_memory=True)
            self.stream = torch.cuda.Stream()
            self.event = torch.cuda.Event()
            self.stop = threading.Event()
            self.reads = 0
            self.errors = 0
            self.messages: list[str] = []
            self.thread = threading.Thread(target=self.loop, daemon=True)

        def loop(self) -> None:
            pending = False
            while not self.stop.wait(0.001):
                try:
                    if pending and not self.event.query():
                        continue
                    with torch.cuda.stream(self.stream):
                        self.mirror.copy_(arena, non_blocking=True)
                        self.event.record(self.stream)
                    pending = True
                    self.reads += 1
                except Exception as e:
                    self.errors += 1
                    pending = False
                    if len(self.messages) < 3:
                        self.messages.append(f"reader: {type(e).__name__}: {str(e).splitlines()[0][:200]}")

    result: dict = {"variants": {}, "relaxed": None}
    for variant in ("none", "tripwire", "plain"):
        plain = None
        if variant == "tripwire":
            m.start()
        elif variant == "plain":
            plain = Plain()
            plain.thread.start()
        ticks0 = m.ticks
        time.sleep(0.02)  # let the reader get going
        failures = wrong = 0
        messages: list[str] = []
        t0 = time.perf_counter()
        for _ in range(n):
            m.check()
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.stream(side):
                    g.capture_begin()
                    try:
                        body()
                    finally:
                        g.capture_end()
                g.replay()
                torch.cuda.synchronize()
                if not (bool((y == expected).all()) and torch.equal(g_out, ref)):
                    wrong += 1
            except Exception as e:
                failures += 1
                if len(messages) < 3:
                    messages.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                try:
                    torch.cuda.synchronize()
                except Exception as e2:
                    messages.append(f"after a failure, synchronize raised {type(e2).__name__}: {e2}"[:200])
            del g
        elapsed = time.perf_counter() - t0
        d: dict[str, Any] = {"captures_per_s": n / elapsed, "failures": failures, "wrong": wrong, "messages": messages}
        if variant == "tripwire":
            m.stop()
            d["reader_reads"] = sum(r.copies for r in m.readers().values())
            d["reader_errors"] = m.loop_errors
            d["reader_ticks"] = m.ticks - ticks0
            result["relaxed"] = m.devices.relaxed
        elif plain is not None:
            plain.stop.set()
            plain.thread.join()
            d["reader_reads"] = plain.reads
            d["reader_errors"] = plain.errors
            d["messages"] += plain.messages
        result["variants"][variant] = d
        out.write_text(json.dumps(result))  # after each variant: a later crash keeps what was measured


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        print("usage: tripwire bench --only q7", file=sys.stderr)
        raise SystemExit(2)
