"""Fused FP8 quantize-and-count: counted vs bare over launch shapes (warps x tokens per program).

Each pair is the same kernel on both sides; a third column times the counted kernel with its per-thread tail after
the token's stores (``tail_last=True``; the counted column runs it before them). The data is healthy bf16, 8 heads x
128, e4m3, at 2048/16384/32768 tokens. It is the sweep behind the fused kernel's launch shape (``_launch_config`` in
``tripwire/numerics/fused.py``), not a question of the suite. Run ``python benchmarks/sweep_fused.py
[OUT_JSON [TOKENS,...]]`` on a GPU: it prints one line per configuration.

Timings are as in lab.numerics: CUDA-graph replays of 20 calls, do_bench medians, alternated over 7 rounds.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable

import torch
import triton
from triton.testing import do_bench

from lab.common import capture
from tripwire import Monitor, SiteRegistry
from tripwire.numerics import ClipCounter
from tripwire.numerics import fused as F


def _launcher(tokens: int, nw: int, tpp: int, count: bool, last: bool = False) -> Callable[[], None]:
    """A launch of the fused kernel on fresh data, with ``nw`` warps, ``tpp`` tokens per program, counting and the slot
    guard compiled in or out together (``count``), the per-thread tail after the stores (``last``)."""
    heads, dim = 8, 128
    reg = SiteRegistry(capacity=16)
    c = ClipCounter("sw", "cuda", "e4m3", monitor=Monitor(registry=reg, capacity=16))
    g = torch.Generator(device="cuda").manual_seed(0)
    key = (torch.randn(tokens, heads, dim, device="cuda", generator=g) * 40).clamp_(-400, 400).to(torch.bfloat16)
    value = (torch.randn(tokens, heads, dim, device="cuda", generator=g) * 40).clamp_(-400, 400).to(torch.bfloat16)
    nb = triton.cdiv(tokens, 16) * 2
    slots = torch.randperm(nb * 16, device="cuda", generator=g)[:tokens]
    kc = torch.zeros(nb, 16, heads, dim, dtype=torch.float8_e4m3fn, device="cuda")
    vc = torch.zeros_like(kc)
    ks = torch.tensor([1.0], device="cuda")
    vs = torch.tensor([1.0], device="cuda")
    return lambda: F._launch(
        key, value, kc, vc, slots, ks, vs, c, count=count, guard=count, config=(nw, tpp), tail_last=last
    )


def main(out: str, tokens_list: tuple[int, ...] = (2048, 16384, 32768)) -> None:
    results: dict[str, list[float]] = {}
    configs = [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (2, 4), (4, 4), (8, 4), (4, 8)]
    for tokens in tokens_list:
        fns = {(nw, tpp, count): _launcher(tokens, nw, tpp, count) for nw, tpp in configs for count in (False, True)}
        fns.update({(nw, tpp, "last"): _launcher(tokens, nw, tpp, True, last=True) for nw, tpp in configs})
        for f in fns.values():
            f()  # compile
        torch.cuda.synchronize()
        replays = {k: capture(f, warm=1, repeat=20).replay for k, f in fns.items()}
        samples: dict[tuple[int, int, bool], list[float]] = {k: [] for k in fns}
        for _ in range(7):
            for k, replay in replays.items():
                samples[k].append(float(do_bench(replay, warmup=25, rep=60, return_mode="median")) / 20)
        t = {k: statistics.median(v) for k, v in samples.items()}
        best_bare = min(v for k, v in t.items() if k[2] is False)
        for nw, tpp in configs:
            bare, counted, last = t[(nw, tpp, False)], t[(nw, tpp, True)], t[(nw, tpp, "last")]
            print(
                f"tokens {tokens} nw {nw} tpp {tpp}: bare {bare * 1e3:.2f} us counted {counted * 1e3:.2f} us "
                f"ratio +{(counted / bare - 1) * 100:.2f} % ; counted vs best bare +{(counted / best_bare - 1) * 100:.2f} %"
                f" ; tail after the stores {last * 1e3:.2f} us +{(last / bare - 1) * 100:.2f} %",
                flush=True,
            )
            results[f"{tokens}/{nw}/{tpp}"] = [bare, counted, last]
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    # python benchmarks/sweep_fused.py [OUT_JSON [TOKENS,...]]
    main(
        sys.argv[1] if len(sys.argv) > 1 else "sweep_fused.json",
        tuple(int(t) for t in sys.argv[2].split(",")) if len(sys.argv) > 2 else (2048, 16384, 32768),
    )
