"""The FP8 clip count's launch (``tripwire.numerics.clip_count``) at decode sizes, against the designs it was chosen
over and against an empty kernel of the same arguments (the launch floor).

An engine calls ``count_clipped`` once per layer per step on the layer's new K and V: at decode, a few KiB. There the
kernel's time is its chain of dependent memory round trips, not bandwidth, so what matters is how many round trips
the launch waits out. The designs, each on Llama-3-8B's K/V shape (8 KV heads x 128, bf16 slices of a fused QKV
output, as vLLM hands them over) at 1, 8, 32 and 64 tokens, healthy input (nothing clips):

* ``shipped``: the library's kernel at its launcher's configuration (one 8 x 128 token a program, 4 warps): every
  load issued first (the row's stored maxima with them), one packed reduction, an atomic only where a count or a
  maximum changes (none on a settled row);
* ``always``: the same loads and counts, but each program reduces both maxima and issues its ``atomic_max`` on every
  launch (the control: what skipping the settled maxima saves; at a prefill's thousands of programs it also keeps
  them from queueing on the row's two words);
* ``tok4``: the shipped kernel with four tokens a program (4096 elements a tensor);
* ``warps8``: the shipped kernel with 8 warps a program;
* ``empty``: a kernel taking the same arguments and doing nothing: the floor every launch pays in a graph.

Timing: each design captured ``LAYERS`` (32) times in one CUDA graph (a decode step's layers), the graphs timed with
``do_bench`` in alternating order per round (``tripwire.testing.timing.paired_replay_ms``); the figure per design is
the median per-launch time. The kernel's own duration (CUPTI, what ``bench_vllm_gpu.py`` sums as the count's share)
is taken from one profiled replay of each graph.

    python benchmarks/bench_clip_count.py --out $OUT/clip_count.json [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

from tripwire import Monitor
from tripwire.numerics import ClipCounter
from tripwire.numerics.clip import FP8_MAX, K_COUNT, K_MAX, V_COUNT, V_MAX
from tripwire.numerics.clip_count import _ELEMS, _clip_count_kernel, _threshold, count_clipped
from tripwire.testing.timing import paired_replay_ms

LAYERS = 32
HEADS, DIM, QKV = 8, 128, 6144  # Llama-3-8B: 32 query + 8 + 8 KV heads of 128 in one fused projection
TOKENS = (1, 8, 32, 64)
DESIGNS = ("shipped", "always", "tok4", "warps8", "empty")
_KC, _VC, _KM, _VM = (tl.constexpr(x) for x in (K_COUNT, V_COUNT, K_MAX, V_MAX))


@triton.jit(do_not_specialize=["n"])
def _clip_count_always_kernel(k_ptr, v_ptr, slot_ptr, ks_ptr, vs_ptr, ctr_ptr, n, k_stride, v_stride,
                              HD: tl.constexpr, HDP: tl.constexpr, TOK: tl.constexpr, FMAX: tl.constexpr):  # fmt: skip
    """The control design: the shipped kernel's loads and counts, both maxima reduced and raised every launch."""
    tok = tl.program_id(0) * TOK + tl.arange(0, TOK)[:, None]
    e = tl.arange(0, HDP)[None, :]
    live = tok < n
    inside = live & (e < HD)
    slot = tl.load(slot_ptr + tok, mask=live, other=-1)
    k = tl.load(k_ptr + tok.to(tl.int64) * k_stride + e, mask=inside, other=0).to(tl.float32)
    v = tl.load(v_ptr + tok.to(tl.int64) * v_stride + e, mask=inside, other=0).to(tl.float32)
    kt = _threshold(ks_ptr, FMAX)
    vt = _threshold(vs_ptr, FMAX)
    m = inside & (slot >= 0)
    ka, va = tl.abs(k), tl.abs(v)
    both = tl.sum(((ka > kt) & m).to(tl.int32) + (((va > vt) & m).to(tl.int32) << 16), axis=None)
    ktop = tl.max(tl.where(m & (ka == ka), ka, 0.0), axis=None)
    vtop = tl.max(tl.where(m & (va == va), va, 0.0), axis=None)
    if (both & 0xFFFF) > 0:
        tl.atomic_add(ctr_ptr + _KC, (both & 0xFFFF).to(tl.int64), sem="relaxed")
    if (both >> 16) > 0:
        tl.atomic_add(ctr_ptr + _VC, (both >> 16).to(tl.int64), sem="relaxed")
    if ktop > 0:
        tl.atomic_max(ctr_ptr + _KM, ktop.to(tl.int32, bitcast=True).to(tl.int64), sem="relaxed")
    if vtop > 0:
        tl.atomic_max(ctr_ptr + _VM, vtop.to(tl.int32, bitcast=True).to(tl.int64), sem="relaxed")


@triton.jit(do_not_specialize=["n"])
def _empty_kernel(k_ptr, v_ptr, slot_ptr, ks_ptr, vs_ptr, ctr_ptr, n, k_stride, v_stride, HD: tl.constexpr,
                  HDP: tl.constexpr, TOK: tl.constexpr, FMAX: tl.constexpr):  # fmt: skip
    pass


def bodies(tokens: int, mon: Monitor) -> tuple[dict[str, Callable[[], None]], dict[str, ClipCounter]]:
    g = torch.Generator(device="cuda").manual_seed(tokens)
    qkv = (torch.randn(tokens, QKV, device="cuda", generator=g) * 4).to(torch.bfloat16)
    key = qkv[:, 4096:5120].view(tokens, HEADS, DIM)
    value = qkv[:, 5120:6144].view(tokens, HEADS, DIM)
    slots = torch.arange(tokens, device="cuda", dtype=torch.int64) * 3
    ks = torch.ones(1, device="cuda")
    vs = torch.ones(1, device="cuda")
    hd = HEADS * DIM
    hdp = triton.next_power_of_2(hd)
    counters = {d: ClipCounter(f"bench.{d}.{tokens}", "cuda", monitor=mon) for d in DESIGNS}

    def direct(kernel: Callable, c: ClipCounter, tok: int, warps: int) -> Callable[[], None]:
        def call() -> None:
            kernel[(triton.cdiv(tokens, tok),)](key, value, slots, ks, vs, c.ctr, tokens, key.stride(0),
                                                 value.stride(0), HD=hd, HDP=hdp, TOK=tok, FMAX=FP8_MAX["e4m3"],
                                                 num_warps=warps)  # fmt: skip

        return call

    tok = max(1, _ELEMS // hdp)  # the launcher's
    out: dict[str, Callable[[], None]] = {
        "shipped": lambda: count_clipped(counters["shipped"], key, value, ks, vs, slots),
        "always": direct(_clip_count_always_kernel, counters["always"], tok, 4),
        "tok4": direct(_clip_count_kernel, counters["tok4"], max(1, 4096 // hdp), 4),
        "warps8": direct(_clip_count_kernel, counters["warps8"], tok, 8),
        "empty": direct(_empty_kernel, counters["empty"], tok, 4),
    }
    return out, counters


def kernel_us(body: Callable[[], None]) -> float:
    """The mean CUPTI duration (us) of the kernels one captured graph of ``LAYERS`` calls runs."""
    from torch.profiler import ProfilerActivity, profile

    from tripwire.testing.timing import capture

    graph = capture(body, warm=2, repeat=LAYERS)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    ds = [float(e.device_time) for e in prof.events() if e.device_type.name == "CUDA" and "kernel" in e.name]
    return statistics.mean(ds) if ds else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = ap.parse_args(argv)
    mon = Monitor(mode="off")  # never started: the counters are read once, synchronously, after the timing
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "layers": LAYERS, "sizes": {}}  # fmt: skip
    print(f"{res['device']}, torch {res['torch']}, triton {res['triton']}: us per launch (graph of {LAYERS})")
    print(f"{'tokens':>6} " + " ".join(f"{d:>16}" for d in DESIGNS))
    for n in (int(x) for x in args.tokens.split(",")):
        b, counters = bodies(n, mon)
        times = paired_replay_ms(b, per_graph=LAYERS, repeats=args.rounds, rep_ms=40)
        cupti = {d: kernel_us(fn) for d, fn in b.items()}
        med = {d: statistics.median(t) * 1e3 for d, t in times.items()}
        totals = {d: c.totals() for d, c in counters.items() if d != "empty"}
        for d, t in totals.items():  # healthy input: nothing clips; every design saw the same maximum
            if t["k"] or t["v"] or t["k_max"] != totals["shipped"]["k_max"]:
                raise SystemExit(f"{d} at {n} tokens counted {t}, shipped {totals['shipped']}")
        res["sizes"][str(n)] = {"replay_us": med, "cupti_us": cupti, "rounds_ms": times}
        print(f"{n:>6} " + " ".join(f"{med[d]:7.3f} ({cupti[d]:5.2f})" for d in med))
    print("each cell: median per-launch time in a graph replay, us (the kernel's CUPTI duration)")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
