"""The metadata validator's cost: one call over a decode step's metadata at batch 256 (a slot mapping ``[256]`` with
padding -1, a block table ``[256, 128]`` with per-row lengths, and a CSR layout over 32768 page ids), clean (the hot
path: nothing to count).

* ``eager_host_us``: the host time of an eager call (the Python checks and the launch), per call over many calls; on
  a GPU the device runs behind (one sync at the end, not timed). Target on a GPU: at most 20 us. Without a GPU the
  call runs its whole check on the host (the validator's torch backend for CPU tensors), so the figure is that
  check's time, and no target applies.
* ``graph_us`` (GPU): per call, a CUDA graph of back-to-back calls replayed (no Python in the figure).
"""

from __future__ import annotations

import time

import torch

from tripwire import Monitor, SiteRegistry
from tripwire.validate import Validator

from .common import Ctx, Result, stats
from .questions import label

HOST_TARGET_US = 20.0
PER_GRAPH = 20


def decode_metadata(device: str) -> dict[str, torch.Tensor]:
    """A decode step's clean metadata at batch 256 (a slot mapping, a block table with per-row counts, a CSR page
    list), seeded: what this check and ``benchmarks/bench_validate.py`` time one validator call over."""
    g = torch.Generator(device="cpu").manual_seed(0)
    lengths = torch.randint(1, 129, (256,), generator=g, dtype=torch.int32)
    table = torch.randint(0, 4096, (256, 128), generator=g, dtype=torch.int32)
    indptr = torch.arange(0, 32769, 128, dtype=torch.int32)
    return {
        "slot_mapping": torch.randint(0, 65536, (256,), generator=g).to(device),
        "block_table": table.to(device),
        "blocks_per_req": lengths.to(device),
        "kv_indices": torch.randint(0, 4096, (32768,), generator=g, dtype=torch.int32).to(device),
        "kv_indptr": indptr.to(device),
    }


def decode_validator(name: str, device: str, monitor: Monitor) -> Validator:
    """The validator of :func:`decode_metadata`'s tensors (mask policy), with their bounds."""
    v = Validator(name, device, policy="mask", monitor=monitor)
    v.index("slot_mapping", hi=65536, padding=-1, fatal=True)
    v.index("block_table", hi=4096, safe=0, lengths="blocks_per_req")
    v.csr("kv_indices", indptr="kv_indptr", hi=4096, safe=0)
    return v


def _host_us(fn, n: int, cuda: bool) -> float:  # type: ignore[no-untyped-def]
    """Host microseconds per call of ``fn`` over ``n`` calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    if cuda:
        torch.cuda.synchronize()
    return us


def run(ctx: Ctx) -> dict:
    res = Result(label(__name__), "Validator: one call over a decode step's metadata (batch 256), clean", ctx)
    dev = "cuda" if ctx.cuda else "cpu"
    mon = Monitor(registry=SiteRegistry(capacity=16), capacity=16)
    v = decode_validator("bench.validator", dev, mon)
    md = decode_metadata(dev)

    def call() -> None:
        v(**md)

    for _ in range(3):  # the kernel compiled (on a GPU) and the plan built outside the figure
        call()
    if ctx.cuda:
        torch.cuda.synchronize()
    calls = 200 if ctx.quick else 2000
    rounds = 3 if ctx.quick else 5
    host = [_host_us(call, calls, ctx.cuda) for _ in range(rounds)]
    res.fig("eager_host_us", stats(host, unit="us", label="host time of an eager call"))
    med = res.figures["eager_host_us"]["median"]
    if ctx.cuda:
        from tripwire.testing.timing import capture, do_bench_ms

        graph = capture(call, warm=3, repeat=PER_GRAPH)
        per_call = [do_bench_ms(graph.replay, rep_ms=40 if ctx.quick else 100) * 1e3 / PER_GRAPH for _ in range(rounds)]
        res.fig("graph_us", stats(per_call, unit="us", label="per call, graph-replayed"))
        res.target("validator host cost", "eager_host_us", f"eager call <= {HOST_TARGET_US:g} us", med,
                   med <= HOST_TARGET_US)  # fmt: skip
        ctx.log(f"eager {med:.2f} us, graph-replayed {res.figures['graph_us']['median']:.2f} us per call")
    else:
        res.note("no GPU: the call runs its whole check on the host (the torch backend); no target applies")
        ctx.log(f"eager {med:.0f} us per call (the check itself, on the host)")
    counted = mon.snapshot()
    if counted:
        res.note(f"clean metadata counted hits: {counted} (the validator or the metadata is wrong)")
    return res.to_dict()
