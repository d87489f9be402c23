"""tripwire's share of a captured Llama-3-8B-shaped decode step, measured inside the graph.

One decode step at the Llama-3-8B shape (32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocabulary
128256; bf16, random weights, a KV context of ``--ctx`` tokens per sequence), batch 32 and 64, captured into one CUDA
graph twice: the bare step, and the step with tripwire's per-step work inside it, i.e. the validator over the step's
metadata (slot mapping, block table with lengths, positions, with request attribution) before the model, and the
same-step verdict copy of those sites after it. The model is plain torch ops (matmuls, RMSNorm, SDPA over a dense KV
cache); the figure it serves is the denominator: what a step of that shape costs on this GPU.

* ``profiler``: the GPU kernel time of tripwire's kernels inside the replayed graph over the step's total kernel time
  (torch.profiler / CUPTI reports a replayed graph's kernels one by one): the in-graph share;
* ``alone``: tripwire's nodes captured alone, replayed back to back, GPU time per step (an upper bound of the same);
* ``end_to_end``: replays of the two graphs interleaved (CUDA events, medians), the difference over the bare step,
  beside the noise floor (bare against bare).

``python benchmarks/bench_step_share.py [--ctx 2048] [--json PATH]``; target: at most 0.1 % of the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from lab.common import env_info, write_json
from tripwire import Monitor
from tripwire.validate import Validator

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 32, 4096, 32, 8, 128, 14336, 128256
PAGE = 16
OUR_KERNELS = ("_validate", "_gather_consume")  # the validator kernel, the verdict's gather-and-consume


class Step:
    """The bare decode step: x [B, HIDDEN] through the layers and the LM head (weights and caches made once)."""

    def __init__(self, batch: int, ctx: int) -> None:
        dev, dt = "cuda", torch.bfloat16

        def w(*shape: int) -> torch.Tensor:
            return torch.empty(shape, device=dev, dtype=dt).normal_(0, 0.02)

        self.layers = [
            (
                w(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
                w(HEADS * HEAD_DIM, HIDDEN),
                w(HIDDEN, 2 * MLP),
                w(MLP, HIDDEN),
            )
            for _ in range(LAYERS)
        ]
        self.k = [w(batch, KV_HEADS, ctx, HEAD_DIM) for _ in range(LAYERS)]
        self.v = [w(batch, KV_HEADS, ctx, HEAD_DIM) for _ in range(LAYERS)]
        self.lm = w(HIDDEN, VOCAB)
        self.x = w(batch, HIDDEN)
        self.batch = batch
        self.out = torch.empty(batch, dtype=torch.long, device=dev)

    def __call__(self) -> None:
        b, x = self.batch, self.x
        for (wqkv, wo, wgu, wd), kc, vc in zip(self.layers, self.k, self.v, strict=True):
            h = F.rms_norm(x, (HIDDEN,))
            qkv = h @ wqkv
            q = qkv[:, : HEADS * HEAD_DIM].view(b, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)  # GQA: 4 queries per KV head
            a = F.scaled_dot_product_attention(q, kc, vc)
            x = x + a.reshape(b, HEADS * HEAD_DIM) @ wo
            gu = F.rms_norm(x, (HIDDEN,)) @ wgu
            x = x + (F.silu(gu[:, :MLP]) * gu[:, MLP:]) @ wd
        self.out.copy_((F.rms_norm(x, (HIDDEN,)) @ self.lm).argmax(-1))


def _tripwire(mon: Monitor, batch: int, ctx: int):
    """The validator over the step's metadata and the verdict ring of its sites: (validate, enqueue)."""
    pages = batch * (ctx // PAGE) + 1
    v = Validator(f"step{batch}", "cuda", policy="mask", monitor=mon)  # one ring per site: sites per batch
    v.index("slot_mapping", hi=pages * PAGE, padding=-1, fatal=True, requests="requests")
    v.index("block_table", hi=pages, safe=0, lengths="block_counts", requests="requests")
    v.index("positions", hi=ctx + 1, safe=0, requests="requests")
    sites = [r.site for r in v.rules.values()]
    ring = mon.verdicts("cuda", sites, depth=4)
    table = torch.arange(batch * (ctx // PAGE), device="cuda", dtype=torch.int32).view(batch, ctx // PAGE)
    md = dict(
        slot_mapping=(table[:, -1].long() * PAGE + PAGE - 1).contiguous(),
        block_table=table,
        block_counts=torch.full((batch,), ctx // PAGE, device="cuda", dtype=torch.int32),
        positions=torch.full((batch,), ctx, device="cuda", dtype=torch.long),
        requests=torch.tensor([mon.requests.number(f"r{i}") for i in range(batch)], device="cuda"),
    )
    return (lambda: v(**md)), ring


def _capture(fn, stream) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    return g


def _interleaved(a, b, rounds: int = 41, reps: int = 20) -> tuple[float, float, float]:
    """Median per-replay ms of graph a and of b, interleaved, and the a-vs-a noise (%, two halves of a's rounds)."""
    ta, tb = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for g, acc in ((a, ta), (b, tb)):
            start.record()
            for _ in range(reps):
                g.replay()
            end.record()
            end.synchronize()
            acc.append(start.elapsed_time(end) / reps)
    ma, mb = statistics.median(ta), statistics.median(tb)
    noise = abs(statistics.median(ta[0::2]) - statistics.median(ta[1::2])) / ma * 100
    return ma, mb, noise


def _profiled_share(g: torch.cuda.CUDAGraph, reps: int = 10) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    total = ours = 0.0
    names: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        t = e.device_time if hasattr(e, "device_time") else e.cuda_time
        total += t
        if any(k in e.name for k in OUR_KERNELS):
            ours += t
            names[e.name] = names.get(e.name, 0.0) + t
    return {
        "tripwire_us_per_step": ours / reps,
        "step_kernels_us": total / reps,
        "share_pct": 100 * ours / total if total else None,
        "kernels": {k: v / reps for k, v in names.items()},
    }


def run(batches: list[int], ctx: int) -> dict:
    mon = Monitor(mode="warn", contain=True)
    mon.prealloc("cuda")
    stream = torch.cuda.Stream()
    res: dict = {"env": env_info(), "ctx": ctx, "target_pct": 0.1, "batches": {}}
    for batch in batches:
        step = Step(batch, ctx)
        validate, ring = _tripwire(mon, batch, ctx)
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: compile the validator, pick the kernels
                validate()
                step()
                ring.take(ring.enqueue(stream), wait=True, stream=stream)
        torch.cuda.synchronize()
        bare = _capture(step, stream)
        holder: list = []
        # Each lambda runs once, inside its capture in this iteration: late binding cannot bite.
        full = _capture(lambda: (validate(), step(), holder.append(ring.enqueue(stream))), stream)  # noqa: B023
        alone_ring_holder: list = []
        alone = _capture(lambda: (validate(), alone_ring_holder.append(ring.enqueue(stream))), stream)  # noqa: B023
        torch.cuda.synchronize()
        full.replay()
        torch.cuda.synchronize()
        assert ring.take(holder[0]).clean, "the clean step's verdict must be clean"
        bare_ms, full_ms, noise = _interleaved(bare, full)
        alone_us = do_bench(alone.replay, rep=200, return_mode="median") * 1e3
        prof = _profiled_share(full)
        res["batches"][batch] = {
            "step_ms": bare_ms,
            "profiler": prof,
            "alone_us": alone_us,
            "alone_share_pct": alone_us / (bare_ms * 1e3) * 100,
            "end_to_end": {
                "bare_ms": bare_ms,
                "with_ms": full_ms,
                "delta_pct": (full_ms / bare_ms - 1) * 100,
                "noise_pct": noise,
            },
        }
        del bare, full, alone
        step = None  # the weights and caches of this batch go before the next batch's
        torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_step_share: needs CUDA", file=sys.stderr)
        return 2
    res = run(a.batches, a.ctx)
    for b, r in res["batches"].items():
        pr, e = r["profiler"], r["end_to_end"]
        print(
            f"batch {b}: step {r['step_ms']:.3f} ms; in-graph tripwire {pr['tripwire_us_per_step']:.2f} us of "
            f"{pr['step_kernels_us']:.0f} us kernels = {pr['share_pct']}% (target 0.1); alone {r['alone_us']:.2f} us "
            f"= {r['alone_share_pct']:.4f}%; end to end {e['delta_pct']:+.3f}% (noise {e['noise_pct']:.3f}%); "
            f"kernels {pr['kernels']}"
        )
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
