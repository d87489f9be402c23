"""The metadata validator on the GPU: what one call costs, graph-replayed, at decode batch 256.

The call validates, in one launch, a slot mapping ``[256]`` (int64, padding -1), a block table ``[256, 128]`` (int32)
with per-row lengths, and a CSR layout over 32768 page ids (int32 indices, an indptr of 257 entries): the metadata of
one decode step of a large batch. Clean metadata (the hot path: no atomics).

Figures (``triton.testing.do_bench`` medians of CUDA graphs that replay the call ``PER_GRAPH`` times back to back,
measured alternately over ``--repeats`` rounds):

* ``validator``: per call, a graph of validator calls only;
* ``empty``: per call, a graph of an empty Triton kernel with one pointer argument (the floor of any launch in a
  graph);
* ``validator_beside_empty``: per call, a graph alternating [empty, validator], minus the empty-only graph: what the
  validator adds next to other kernels of a step;
* ``eager_host_us``: the host time of an eager call (Python checks and the launch), per call over 2000 calls
  (target: at most 20 us); beside it ``host_breakdown_us``: the bound launch alone, the same launch through the
  JITFunction (what every call paid before the launch was bound), and an empty Triton kernel's launch (the floor
  of any Triton launch).

``python benchmarks/bench_validate.py [--repeats N] [--host-only] [--json PATH]`` prints a table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from lab.common import capture, env_info, write_json
from tripwire import Monitor, SiteRegistry
from tripwire.cli.bench.validator import decode_metadata, decode_validator
from tripwire.validate import Validator

PER_GRAPH = 20
HOST_TARGET_US = 20.0


@triton.jit
def _empty(x_ptr):
    pass


def _host_us(fn, n: int = 2000) -> float:  # type: ignore[no-untyped-def]
    """Host microseconds per call of ``fn`` (the GPU runs behind; one sync at the end, not timed)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def host_costs(v: Validator, md: dict[str, torch.Tensor]) -> dict[str, float]:
    """The eager call's host cost and its parts (see the module docstring)."""
    from tripwire.validate import _triton as k

    plan = v._plan if v._plan is not None else v._build_plan()
    ordered = [md[n] for n in plan.names]
    x = torch.zeros(1, device="cuda")
    return {
        "call": _host_us(lambda: v(**md)),
        "bound_launch": _host_us(lambda: plan.launch(ordered)),
        "jit_launch": _host_us(lambda: k.launch(v._arena, plan.rules, ordered, mask=v.policy == "mask")),
        "empty_triton_launch": _host_us(lambda: _empty[(1,)](x)),
    }


def run(repeats: int = 7, rep_ms: int = 200, host_only: bool = False) -> dict:
    dev = "cuda"
    mon = Monitor(registry=SiteRegistry(capacity=64), capacity=64)
    v = decode_validator("bench", dev, mon)
    md = decode_metadata(dev)
    x = torch.zeros(1, device=dev)

    def call() -> None:
        v(**md)

    def empty() -> None:
        _empty[(1,)](x)

    def both() -> None:
        _empty[(1,)](x)
        v(**md)

    host = host_costs(v, md)
    if host_only:
        assert mon.snapshot() == {}, "clean metadata must count nothing"
        return {"env": env_info(), "eager_host_us": host["call"], "host_breakdown_us": host,
                "host_target_us": HOST_TARGET_US, "host_pass": host["call"] <= HOST_TARGET_US}  # fmt: skip
    graphs = {
        "validator": capture(call, warm=3, repeat=PER_GRAPH).replay,
        "empty": capture(empty, warm=3, repeat=PER_GRAPH).replay,
        "both": capture(both, warm=3, repeat=PER_GRAPH).replay,
    }
    samples: dict[str, list[float]] = {k: [] for k in graphs}
    for _ in range(repeats):
        for k, fn in graphs.items():
            samples[k].append(float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")) * 1e3 / PER_GRAPH)
    med = {k: statistics.median(s) for k, s in samples.items()}
    host_us = host["call"]
    assert mon.snapshot() == {}, "clean metadata must count nothing"
    return {
        "env": env_info(),
        "shapes": {k: list(t.shape) for k, t in md.items()},
        "per_graph": PER_GRAPH,
        "repeats": repeats,
        "validator_us": {
            "median": med["validator"],
            "min": min(samples["validator"]),
            "max": max(samples["validator"]),
        },
        "empty_us": {"median": med["empty"], "min": min(samples["empty"]), "max": max(samples["empty"])},
        "validator_beside_empty_us": med["both"] - med["empty"],
        "eager_host_us": host_us,
        "host_breakdown_us": host,
        "host_target_us": HOST_TARGET_US,
        "host_pass": host_us <= HOST_TARGET_US,
        "samples_us": samples,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--host-only", action="store_true", help="only the eager host cost and its parts")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_validate: needs a CUDA GPU", file=sys.stderr)
        return 2
    r = run(a.repeats, host_only=a.host_only)
    parts = ", ".join(f"{k} {v:.2f}" for k, v in r["host_breakdown_us"].items())
    print(f"eager host cost of a call:        {r['eager_host_us']:7.2f} us (target <= {HOST_TARGET_US} us; {parts})")
    if a.host_only:
        if a.json:
            write_json(a.json, r)
        return 0
    print(
        f"validator, graph-replayed:        {r['validator_us']['median']:7.2f} us per call "
        f"(min {r['validator_us']['min']:.2f}, max {r['validator_us']['max']:.2f})"
    )
    print(f"empty Triton kernel, same graphs: {r['empty_us']['median']:7.2f} us per call")
    print(f"validator beside an empty kernel: {r['validator_beside_empty_us']:7.2f} us per call")
    if a.json:
        write_json(a.json, r)
    else:
        print(json.dumps({k: v for k, v in r.items() if k != "samples_us"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
