"""Timing a guarded kernel against its twin on a GPU, as tripwire's own measurements do (docs/guarding.md, "Guard cost
for adopters"): each side captured in a CUDA graph of back-to-back calls (no Python launch cost), the graphs timed
with ``triton.testing.do_bench`` in an order that alternates between rounds, and each side's code loaded several
times (:func:`jit_copy`), since where a kernel's code lands moves its time by as much as a 1 % target.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "capture",
    "d2d_copy_ms",
    "do_bench_ms",
    "jit_copy",
    "paired_replay_ms",
    "pooled_cost_pct",
    "pooled_ms",
    "pooled_replay_ms",
    "warm_up",
]


def warm_up(body: Callable[[], Any], calls: int = 3) -> None:
    """Run ``body`` ``calls`` times on a side stream and wait for it: Triton compiles, cuBLAS handles and the
    caching allocator's first blocks are made here, outside any capture (PyTorch's own warm-up recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(calls):
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture(body: Callable[[], Any], *, warm: int = 3, repeat: int = 1) -> torch.cuda.CUDAGraph:
    """``body`` warmed up (:func:`warm_up`), then captured ``repeat`` times back to back in one CUDA graph."""
    warm_up(body, warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            body()
    torch.cuda.synchronize()
    return graph


def do_bench_ms(fn: Callable[[], Any], *, rep_ms: int = 100, warmup_ms: int = 25) -> float:
    """``triton.testing.do_bench`` median (ms): it flushes L2 between calls and warms up first."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def d2d_copy_ms(n: int, repeats: int, rep_ms: int) -> list[float]:
    """``repeats`` do_bench medians (ms) of a device-to-device copy of ``n`` bytes: the bandwidth reference (read
    + write bytes per second) of the guard-cost benchmarks. Frees its buffers before returning."""
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = [do_bench_ms(lambda: dst.copy_(src), rep_ms=rep_ms) for _ in range(repeats)]
    src = dst = None  # type: ignore[assignment]  # free the buffers before the kernels' cases
    torch.cuda.empty_cache()
    return times


def paired_replay_ms(
    bodies: dict[str, Callable[[], Any]], *, per_graph: int, repeats: int, rep_ms: int
) -> dict[str, list[float]]:
    """Per-call GPU time (ms) of each body, graph-replayed: each is captured ``per_graph`` times back to back in one
    CUDA graph (so Python's launch overhead is not measured), then every repeat times every graph with do_bench,
    in an order that alternates between repeats (drift -- clocks, temperature -- hits every body alike). Returns
    ``repeats`` samples per body, each a median over do_bench's runs divided by ``per_graph``."""
    rounds = pooled_replay_ms({n: [b] for n, b in bodies.items()}, per_graph=per_graph, repeats=repeats,
                              rep_ms=rep_ms)  # fmt: skip
    return {n: [copies[0] for copies in r] for n, r in rounds.items()}


# Where a kernel's code lands in device memory moves its time: the same binary, loaded as K separate modules (each
# one graph), times as K persistent levels a few tenths of a percent apart (benchmarks/RESULTS.md, "Where the code
# lands"), as large as the costs a 1 % target judges. A comparison of one load of each side measures the guard plus
# one draw of that offset; the pooled comparison below measures each side over K loads.
def jit_copy(fn: Any) -> Any:
    """A new ``triton.JITFunction`` of ``fn``'s Python function with ``fn``'s options: it compiles to the same binary
    (from Triton's cache) but keeps its own compiled kernels, each loaded as a module of its own, so its code sits at
    another address than ``fn``'s. Under the interpreter (nothing is compiled or loaded) a new interpreted function
    of the same Python function and options."""
    import triton
    import triton.runtime.jit as triton_jit

    given = getattr(fn, "kwargs", None)
    if isinstance(given, dict):
        copy = triton.jit(fn.fn, **given)  # the interpreter's function keeps its options as they were given
    else:
        copy = triton.jit(
            fn.fn,
            version=fn.version,
            repr=fn._repr,
            launch_metadata=fn.launch_metadata,
            do_not_specialize=list(fn.do_not_specialize),
            do_not_specialize_on_alignment=list(fn.do_not_specialize_on_alignment),
            debug=fn.debug,
            noinline=fn.noinline,
        )
    # Triton 3.9 registers every JITFunction under its module and name, the last one made winning: the copy must not
    # take the original's entry.
    registry = getattr(triton_jit, "_triton_jit_function_registry", None)
    key = f"{fn.fn.__module__}:{fn.fn.__qualname__}"
    if isinstance(registry, dict) and registry.get(key) is copy:
        registry[key] = fn
    return copy


def pooled_replay_ms(
    bodies: Mapping[str, Sequence[Callable[[], Any]]], *, per_graph: int, repeats: int, rep_ms: int
) -> dict[str, list[list[float]]]:
    """:func:`paired_replay_ms` over copies of the code: each variant is a list of bodies that run the same code
    loaded again (:func:`jit_copy`, a module imported again), each captured in a graph of its own. Every round times
    every graph, the variants' copies interleaved (each variant's copy 0, then each one's copy 1, ...), in an order
    that alternates between rounds. Returns, per variant, ``repeats`` rounds of one per-call time (ms) per copy."""
    width = {len(v) for v in bodies.values()}
    if not bodies or 0 in width:
        raise ValueError("pooled_replay_ms: every variant needs at least one body")
    order = [(n, i) for i in range(max(width)) for n in bodies if i < len(bodies[n])]
    graphs = {key: capture(bodies[key[0]][key[1]], warm=2, repeat=per_graph) for key in order}
    out: dict[str, list[list[float]]] = {n: [[0.0] * len(v) for _ in range(repeats)] for n, v in bodies.items()}
    for r in range(repeats):
        for n, i in order if r % 2 == 0 else order[::-1]:
            out[n][r][i] = do_bench_ms(graphs[(n, i)].replay, rep_ms=rep_ms) / per_graph
    return out


def pooled_cost_pct(times: dict[str, list[list[float]]], num: str, den: str) -> list[float]:
    """Per round, ``num`` over ``den`` in percent, each side the median of its copies' times (``times`` from
    :func:`pooled_replay_ms`). The figure is the median of these rounds; their spread is the round-to-round noise."""
    if len(times[num]) != len(times[den]):
        raise ValueError(f"{num} and {den} were timed over different rounds")
    return [100.0 * (statistics.median(a) / statistics.median(b) - 1.0) for a, b in zip(times[num], times[den],
                                                                                     strict=True)]  # fmt: skip


def pooled_ms(times: list[list[float]]) -> float:
    """One variant's time (ms): the median over rounds of its copies' median (``times``: its rounds from
    :func:`pooled_replay_ms`)."""
    return statistics.median(statistics.median(r) for r in times)
