"""The same-step verdict on the GPU: its GPU time per step inside a captured graph, and its host time per step.

The ring covers three sites (the transformers integration's), K = 8 offenders per row.

* ``verdict_gpu_us``: per verdict, a graph of ``PER_GRAPH`` captured enqueues (gather-and-consume kernel + the
  copy to pinned memory, each into its own slot) replayed back to back, ``do_bench`` median / ``PER_GRAPH``;
* ``empty_gpu_us``: the same for an empty Triton kernel (the floor of any launch in a graph);
* ``verdict_beside_empty_us``: a graph alternating [empty, verdict] minus the empty-only graph: what the verdict adds
  next to other kernels of a step;
* ``host_enqueue_us`` / ``host_take_us`` / ``host_step_us``: the host time of an eager ``enqueue`` (one slot graph's
  replay and an event record) and of a clean ``take`` (an event query and one comparison), medians over 2000 steps
  (the device drained between steps, outside the timed regions);
* ``host_take_dirty_us``: ``take`` of a step with one attributed hit (decode and taints).

``python benchmarks/bench_verdict.py [--json PATH]`` prints a table and writes the JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from lab.common import env_info, write_json
from tripwire import Monitor, SiteRegistry
from tripwire.validate import Validator

PER_GRAPH = 16


@triton.jit
def _empty(x_ptr):
    pass


def run() -> dict:
    dev = "cuda"
    mon = Monitor(registry=SiteRegistry(capacity=64), capacity=64, mode="warn", contain=True)
    sites = [mon.registry.register(f"bench.site{i}") for i in range(3)]
    mon.prealloc(dev)
    eager = mon.verdicts(dev, sites, depth=4)
    captured = mon.verdicts(dev, [mon.registry.register(f"bench.cap{i}") for i in range(3)], depth=PER_GRAPH)
    x = torch.zeros(1, device=dev)
    _empty[(1,)](x)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    g_verdict, g_empty, g_mixed = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_verdict, stream=s):
        for _ in range(PER_GRAPH):
            captured.enqueue()
    with torch.cuda.graph(g_empty, stream=s):
        for _ in range(PER_GRAPH):
            _empty[(1,)](x)
    mixed = mon.verdicts(dev, [mon.registry.register(f"bench.mix{i}") for i in range(3)], depth=PER_GRAPH)
    with torch.cuda.graph(g_mixed, stream=s):
        for _ in range(PER_GRAPH):
            _empty[(1,)](x)
            mixed.enqueue()
    rounds = {"verdict": [], "empty": [], "mixed": []}
    for _ in range(7):
        rounds["verdict"].append(do_bench(g_verdict.replay, rep=200, return_mode="median") * 1e3 / PER_GRAPH)
        rounds["empty"].append(do_bench(g_empty.replay, rep=200, return_mode="median") * 1e3 / PER_GRAPH)
        rounds["mixed"].append(do_bench(g_mixed.replay, rep=200, return_mode="median") * 1e3 / PER_GRAPH)
    med = {k: statistics.median(v) for k, v in rounds.items()}

    # Host time of the eager step path.
    v = Validator("hostbench", dev, policy="mask", monitor=mon)
    v.index("slots", hi=100, padding=-1, requests="req", segments="cu")
    ring = mon.verdicts(dev, [v.rules["slots"].site], depth=4)
    slots = torch.arange(8, device=dev)
    req = torch.tensor([mon.requests.number(i) for i in ("a", "b", "c")], device=dev)
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32, device=dev)
    enq, take, dirty = [], [], []
    # The engine's own stream object, as an engine passes it (the transformers integration: io.compute_stream).
    stream = torch.cuda.current_stream()
    for i in range(2200):
        bad = i % 10 == 9
        if bad:
            slots[4] = 1000
        v(slots=slots, req=req, cu=cu)
        t0 = time.perf_counter()
        t = ring.enqueue(stream)
        t1 = time.perf_counter()
        torch.cuda.synchronize()  # stands in for the engine's own wait (outside the timed regions)
        t2 = time.perf_counter()
        verdict = ring.take(t)
        t3 = time.perf_counter()
        if bad:
            assert verdict.tainted == {"b"}, verdict
            slots[4] = 4
        else:
            assert verdict.clean
        if i >= 200:
            (dirty if bad else take).append((t3 - t2) * 1e6)
            if not bad:
                enq.append((t1 - t0) * 1e6)
    return {
        "env": env_info(),
        "per_graph": PER_GRAPH,
        "verdict_gpu_us": med["verdict"],
        "empty_gpu_us": med["empty"],
        "verdict_beside_empty_us": med["mixed"] - med["empty"],
        "rounds_us": rounds,
        "host_enqueue_us": statistics.median(enq),
        "host_take_us": statistics.median(take),
        "host_step_us": statistics.median(enq) + statistics.median(take),
        "host_take_dirty_us": statistics.median(dirty),
        "targets": {"verdict_gpu_us": 3.0, "host_step_us": 20.0},
        "eager_ring": eager.depth,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_verdict: needs CUDA", file=sys.stderr)
        return 2
    res = run()
    for k in ("verdict_gpu_us", "empty_gpu_us", "verdict_beside_empty_us", "host_enqueue_us", "host_take_us"):
        print(f"{k:28s} {res[k]:8.2f}")
    print(f"{'host_step_us':28s} {res['host_step_us']:8.2f}  (target 20)")
    print(f"{'host_take_dirty_us':28s} {res['host_take_dirty_us']:8.2f}")
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
