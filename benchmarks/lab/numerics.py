"""Numeric instruments on the GPU: what counting costs.

1. Fused FP8 KV-cache write (``tripwire.numerics.fused``): the kernel with clip counting and the slot guard
   (``COUNT=True, GUARD=True``, what ``quantize_kv_to_fp8_cache`` runs) vs the same kernel -- same launch shape --
   with both compiled out (``COUNT=False, GUARD=False``), and vs the guard alone, which is exactly what
   ``count=False`` runs (the launcher picks one shape for both). Target: counted within 5 % of bare. Also vs the torch-ops
   path (``ClipCounter.count``: several passes over K/V) alone and with a torch quantise-and-scatter, as ratios.
   Two regimes: healthy (no element clips: the hot path, no atomics once the maxima settle) and clipping (every
   token clips: one atomic add per program and tensor, the worst case).
2. Non-finite counter on ``[256, 152064]`` bf16 logits: achieved bandwidth against a device-to-device copy of the
   same tensor (read + write bytes). Target: at least 80 %. Launch shapes around the default are swept, each beside
   its twin (the same loads and vote, nothing recorded: what the shape itself reads at), against the sweep's target:
   every shape at 90 % or more. A full run measures the same at ``[1024, 152064]`` too (311 MB, six times the L2).

Timings are ``triton.testing.do_bench`` medians of a CUDA graph replaying the call 10-20 times (so Python launch
overhead is not measured; do_bench flushes L2 between replays, and at the smallest fused shape the data fits in
L2, so its GB/s is an L2 figure), each comparison measured alternately in one process, the median over ``repeats``
rounds. ``run(quick)`` returns a dict; ``python -m
lab.numerics [--quick]`` prints a table and the JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from tripwire import Monitor, SiteRegistry
from tripwire.numerics import (
    ClipCounter,
    count_nonfinite,
    fp8_cache_launch,
    reference_quantize,
    register_nonfinite_site,
)
from tripwire.numerics import fused as fused_mod
from tripwire.numerics import nonfinite as nonfinite_mod

from .common import (
    Ctx,
    Result,
    capture,
    copy_spread_pct,
    jit_copy,
    one_load_pct,
    pooled_cost_pct,
    pooled_ms,
    pooled_replay_ms,
    single,
)
from .questions import label

FUSED_TARGET_PCT = 5.0
# Counting against count=False at the smallest batch, where a kernel of a few microseconds shows every added
# instruction: issue 27's bar. Larger batches keep q1's.
COUNT_ONLY_SMALL = (2048, 2.0)


# The non-finite counter's sweep: (elements per load step, steps per program, warps) around the default
# (benchmarks/sweep_nonfinite.py times other layouts at the same shapes).
SWEEP_SHAPES = ((1024, 8, 8), (2048, 2, 8), (2048, 4, 4), (2048, 4, 8), (2048, 8, 8), (4096, 4, 8), (8192, 1, 8))


def _count_only_target(tokens: int) -> float:
    return COUNT_ONLY_SMALL[1] if tokens <= COUNT_ONLY_SMALL[0] else FUSED_TARGET_PCT


NONFINITE_TARGET = 0.80
SWEEP_TARGET = 0.90


def _graphed(fn: Callable[[], object], n: int) -> Callable[[], object]:
    """``fn`` called ``n`` times back to back, captured in one CUDA graph: timing its replay measures the kernels,
    not Python's launch overhead (tens of microseconds per Triton launch, as long as a small kernel itself)."""
    return capture(fn, warm=1, repeat=n).replay


def _time(fns: dict[str, Callable[[], object]], repeats: int, rep_ms: int, per_graph: int) -> dict[str, float]:
    """Median ms per call of each function (graphed ``per_graph`` calls at a time), measured alternately
    ``repeats`` times so that drift hits every variant alike."""
    replays = {k: _graphed(fn, per_graph) for k, fn in fns.items()}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, replay in replays.items():
            samples[name].append(float(do_bench(replay, warmup=25, rep=rep_ms, return_mode="median")) / per_graph)
    return {k: statistics.median(v) for k, v in samples.items()}


def _fused_case(
    tokens: int, heads: int, dim: int, regime: str, repeats: int, rep_ms: int, copies: int = 1, dev: str = "cuda"
) -> dict:
    reg = SiteRegistry(capacity=16)
    mon = Monitor(registry=reg, capacity=16)
    c = ClipCounter("bench.layer", dev, "e4m3", monitor=mon)
    g = torch.Generator(device=dev).manual_seed(0)
    spread = 40.0 if regime == "healthy" else 200.0  # healthy: |x| << 448; clipping: tails past 448 in every token
    key = (torch.randn(tokens, heads, dim, device=dev, generator=g) * spread).to(torch.bfloat16)
    value = (torch.randn(tokens, heads, dim, device=dev, generator=g) * spread).to(torch.bfloat16)
    if regime == "healthy":
        key.clamp_(-400, 400)
        value.clamp_(-400, 400)
    block_size = 16
    num_blocks = triton.cdiv(tokens, block_size) * 2
    slots = torch.randperm(num_blocks * block_size, device=dev, generator=g)[:tokens]
    kc = torch.zeros(num_blocks, block_size, heads, dim, dtype=torch.float8_e4m3fn, device=dev)
    vc = torch.zeros_like(kc)
    ks = torch.tensor([1.0], device=dev)
    vs = torch.tensor([1.0], device=dev)

    # What quantize_kv_to_fp8_cache launches, with or without counting (one shape for both), recorded.
    shape = fp8_cache_launch(tokens, heads, dim, dev)[:2]

    # Each kernel variant over ``copies`` loads of its code (jit_copy: the same binary at other addresses), pooled:
    # one load of each measures the counting plus where the two codes happen to land (pooled_replay_ms says why).
    kernels = [fused_mod._fp8_kv_cache_kernel] + [jit_copy(fused_mod._fp8_kv_cache_kernel) for _ in range(copies - 1)]

    def launch(count: bool, guard: bool) -> list[Callable[[], object]]:
        return [
            functools.partial(fused_mod._launch, key, value, kc, vc, slots, ks, vs, c, count=count, guard=guard,
                              kernel=k)
            for k in kernels
        ]  # fmt: skip

    flat_k = kc.view(-1, heads, dim)
    flat_v = vc.view(-1, heads, dim)

    def torch_full() -> None:
        # The same work in torch ops: quantise (one pass each), scatter into the cache, count (several passes).
        flat_k.view(torch.uint8).index_copy_(0, slots, reference_quantize(key, ks, "e4m3").view(torch.uint8))
        flat_v.view(torch.uint8).index_copy_(0, slots, reference_quantize(value, vs, "e4m3").view(torch.uint8))
        c.count(key, value, ks, vs, slots)

    fns: dict[str, list[Callable[[], object]]] = {
        "counted": launch(True, True),
        "bare": launch(False, False),
        "guard_only": launch(False, True),  # quantize_kv_to_fp8_cache(count=False) exactly
        "torch_count": [lambda: c.count(key, value, ks, vs, slots)],
        "torch_full": [torch_full],
    }
    for copies_of in fns.values():
        for fn in copies_of:
            fn()  # compile, and let the max slots settle
    clipped = c.totals()  # a synchronous read
    rounds = pooled_replay_ms(fns, per_graph=20, repeats=repeats, rep_ms=rep_ms)
    t = {k: pooled_ms(v) for k, v in rounds.items()}

    def pct(num: str, den: str) -> float:
        return statistics.median(pooled_cost_pct(rounds, num, den))

    count_only = pct("counted", "guard_only")
    nbytes = 2 * tokens * heads * dim * (key.element_size() + 1) + slots.numel() * slots.element_size()
    overhead = pct("counted", "bare")
    return {
        "tokens": tokens,
        "heads": heads,
        "head_dim": dim,
        "dtype": "bfloat16",
        "fmt": "e4m3",
        "regime": regime,
        "clipped_in_warmup": clipped["k"] + clipped["v"],
        "us": {k: 1e3 * v for k, v in t.items()},
        "gbps_counted": nbytes / (t["counted"] * 1e-3) / 1e9,
        "gbps_bare": nbytes / (t["bare"] * 1e-3) / 1e9,
        "overhead_pct": overhead,
        "config": list(shape),
        "guard_only_overhead_pct": pct("guard_only", "bare"),
        # The counting alone: the counted kernel against the same kernel with its slot guard but no counting, which
        # is what count=False runs: what counting costs a caller who could turn it off.
        "count_only_overhead_pct": count_only,
        "count_only_target_pct": _count_only_target(tokens),
        "copies": copies,
        # Each variant's loads: how far apart the same code times where it lands (the spread a single load carries).
        "copy_spread_pct": {k: copy_spread_pct(v) for k, v in rounds.items() if len(v[0]) > 1},
        # What one load of each side gives (a comparison of one build each): per round, the median.
        "count_only_one_load_pct": statistics.median(one_load_pct(rounds, "counted", "guard_only")),
        "torch_count_over_fused": t["torch_count"] / t["counted"],
        "torch_full_over_fused": t["torch_full"] / t["counted"],
        "target_pct": FUSED_TARGET_PCT,
        "pass": overhead <= FUSED_TARGET_PCT if regime == "healthy" else None,
        "count_only_pass": count_only <= _count_only_target(tokens) if regime == "healthy" else None,
    }


def _nonfinite(
    quick: bool, repeats: int, rep_ms: int, dev: str = "cuda", shape: tuple[int, int] = (256, 152064)
) -> dict:
    reg = SiteRegistry(capacity=16)
    mon = Monitor(registry=reg, capacity=16)
    site = register_nonfinite_site("bench.logits", monitor=mon)
    x = torch.randn(shape, device=dev).to(torch.bfloat16)
    dst = torch.empty_like(x)
    ctr = mon.counter(site, dev)
    nbytes = x.numel() * x.element_size()
    fns: dict[str, Callable[[], object]] = {
        "nonfinite": lambda: count_nonfinite(x, site, ctr=ctr),
        "copy": lambda: dst.copy_(x),
    }
    sweep_cfgs = list(SWEEP_SHAPES)
    if quick:
        sweep_cfgs = sweep_cfgs[2:5]
    for b, it, w in sweep_cfgs:
        fns[f"block{b}_i{it}_w{w}"] = functools.partial(nonfinite_mod._launch, x, ctr, b, w, it)
        # The twin at the same shape (the same loads and vote, the fault path reduced to one atomic): whether a
        # shape short of the target is the guard's doing or the shape's.
        fns[f"twin{b}_i{it}_w{w}"] = functools.partial(nonfinite_mod._launch, x, ctr, b, w, it, guard=False)
    for fn in fns.values():
        fn()
    assert int(mon.read_rows(dev)[site.id][0]) == 0  # clean data: nothing counted (hot path measured)
    t = _time(fns, repeats, rep_ms, per_graph=10)
    gbps = nbytes / (t["nonfinite"] * 1e-3) / 1e9
    copy_gbps = 2 * nbytes / (t["copy"] * 1e-3) / 1e9  # a copy reads and writes
    ratio = gbps / copy_gbps
    sweep = [
        {
            "block": b,
            "iters": it,
            "num_warps": w,
            "us": 1e3 * t[f"block{b}_i{it}_w{w}"],
            "ratio_to_copy": (nbytes / (t[f"block{b}_i{it}_w{w}"] * 1e-3) / 1e9) / copy_gbps,
            "twin_ratio_to_copy": (nbytes / (t[f"twin{b}_i{it}_w{w}"] * 1e-3) / 1e9) / copy_gbps,
        }
        for b, it, w in sweep_cfgs
    ]
    sweep_min = min(s["ratio_to_copy"] for s in sweep)
    # The rare path: a few NaNs (one set of atomics in the programs that hold them).
    x.view(-1)[:: x.numel() // 7] = float("nan")
    t_nan = _time({"with_nan": fns["nonfinite"]}, 1, rep_ms, per_graph=10)["with_nan"]
    default_block = nonfinite_mod.default_block(x.dtype)
    return {
        "shape": list(shape),
        "dtype": "bfloat16",
        "default_block": default_block,
        "default_num_warps": nonfinite_mod._NUM_WARPS,
        "default_iters": nonfinite_mod._ITERS,
        "us": 1e3 * t["nonfinite"],
        "us_with_7_nans": 1e3 * t_nan,
        "copy_us": 1e3 * t["copy"],
        "gbps": gbps,
        "copy_gbps": copy_gbps,
        "ratio_to_copy": ratio,
        "target": NONFINITE_TARGET,
        "pass": ratio >= NONFINITE_TARGET,
        "sweep_target": SWEEP_TARGET,
        "sweep_min": sweep_min,
        "sweep_pass": sweep_min >= SWEEP_TARGET,
        "sweep": sweep,
    }


def run(
    quick: bool = False, copies: int | None = None, fused_tokens: tuple[int, ...] | None = None, nonfinite: bool = True
) -> dict:
    """Measure everything above on the current CUDA device; ``{"skipped": reason}`` without one. ``copies``: loads
    of each fused kernel variant's code, pooled (default 2 quick, 6 full); ``fused_tokens``: the fused kernel's
    batches (default: 4096 quick; 2048, 16384 and 32768); ``nonfinite=False`` leaves the non-finite counter out."""
    if not torch.cuda.is_available():
        return {"name": "numerics", "skipped": "needs a CUDA GPU (Triton kernels are timed compiled)"}
    repeats, rep_ms = (1, 50) if quick else (5, 200)
    copies = copies if copies is not None else (2 if quick else 6)
    if copies < 1:
        raise ValueError(f"copies must be at least 1, got {copies}")
    whole = (4096,) if quick else (2048, 16384, 32768)
    fused_tokens = tuple(fused_tokens) if fused_tokens is not None else whole
    if not fused_tokens or min(fused_tokens) < 1:
        raise ValueError(f"fused_tokens must be batches of at least one token, got {fused_tokens}")
    shapes = [(t, 8, 128) for t in fused_tokens]
    fused = []
    for tokens, heads, dim in shapes:
        for regime in ("healthy", "clipping"):
            fused.append(_fused_case(tokens, heads, dim, regime, repeats, rep_ms, copies))
    return {
        "name": "numerics",
        "quick": quick,
        # A part of the measure (some batches, or no non-finite counter): merge() refuses it (it replaces them all).
        "partial": fused_tokens != whole or not nonfinite,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "repeats": repeats,
        "fused_fp8": fused,
        **({"nonfinite": _nonfinite(quick, repeats, rep_ms)} if nonfinite else {}),
        # Beyond the L2 many times over: what the shapes read at when nothing of the tensor can stay cached.
        **(
            {"nonfinite_large": _nonfinite(quick, repeats, rep_ms, shape=(1024, 152064))}
            if nonfinite and not quick
            else {}
        ),
    }


def _table(res: dict) -> str:
    if "skipped" in res:
        return f"numerics: skipped ({res['skipped']})"
    lines = [
        f"numerics on {res['device']} (torch {res['torch']}, triton {res['triton']}, quick={res['quick']})",
        "",
        "fused FP8 KV write          counted   bare  guard  torch_cnt  torch_full  overhead  target  pass  "
        "vs_count=False (target)  torch_cnt/fused  torch_full/fused  GB/s",
    ]
    for f in res["fused_fp8"]:
        us = f["us"]
        shape = f"{f['tokens']}x{f['heads']}x{f['head_dim']} {f['regime']}"
        mark = "-" if f["pass"] is None else ("PASS" if f["pass"] else "SHORT")
        lines.append(
            f"{shape:<26} {us['counted']:8.1f} {us['bare']:6.1f} {us['guard_only']:6.1f} {us['torch_count']:10.1f} "
            f"{us['torch_full']:11.1f} {f['overhead_pct']:8.2f}% {f['target_pct']:6.1f}% {mark:>5} "
            f"{f['count_only_overhead_pct']:13.2f}% ({f.get('count_only_target_pct', f['target_pct']):g} %) "
            f"{f['torch_count_over_fused']:16.2f}x {f['torch_full_over_fused']:16.2f}x {f['gbps_counted']:6.0f}"
        )
    for n in (res[k] for k in ("nonfinite", "nonfinite_large") if k in res):
        lines += [
            "",
            f"non-finite counter {n['shape']} {n['dtype']}: {n['us']:.1f} us, {n['gbps']:.0f} GB/s; copy "
            f"{n['copy_us']:.1f} us, {n['copy_gbps']:.0f} GB/s; ratio {n['ratio_to_copy']:.3f} (target >= "
            f"{n['target']}) {'PASS' if n['pass'] else 'SHORT'}; with 7 NaNs {n['us_with_7_nans']:.1f} us",
            f"  sweep (target >= {n['sweep_target']} at every shape: {'PASS' if n['sweep_pass'] else 'SHORT'}): "
            + ", ".join(
                f"block {s['block']} x{s['iters']}/w{s['num_warps']}: {s['ratio_to_copy']:.3f}"
                + (f" (twin {s['twin_ratio_to_copy']:.3f})" if "twin_ratio_to_copy" in s else "")
                for s in n["sweep"]
            ),
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- into q1's record
# What fold adds to q1 (guard_cost.py folds a fresh run in; --merge replaces exactly these in an earlier run's record).
NUMERICS_FIGURE_PREFIXES = ("overhead_pct_fp8_", "fused_", "torch_count_over_fused_", "nonfinite_")
NUMERICS_TARGET_PREFIXES = ("fused FP8 counter", "non-finite counter")
NUMERICS_NOTE_PREFIXES = ("fused FP8 and non-finite figures", "bench_numerics")


def fold(res: Result, out: dict) -> None:
    """Add the figures and targets of one :func:`run` result to ``res`` (q1's)."""
    if "skipped" in out:
        res.note(f"bench_numerics skipped: {out['skipped']}")
        return
    for f in out.get("fused_fp8", []):
        key = f"fp8_{f['tokens']}x{f['heads']}x{f['head_dim']}_{f['regime']}"
        res.fig(
            f"overhead_pct_{key}", single(f["overhead_pct"], unit="%", label=f"fused FP8 {key}: counted / bare - 1")
        )
        res.fig(f"fused_us_counted_{key}", single(f["us"]["counted"], unit="us", label=f"fused FP8 {key}, counted"))
        res.fig(f"fused_us_bare_{key}", single(f["us"]["bare"], unit="us", label=f"fused FP8 {key}, bare"))
        res.fig(
            f"fused_guard_only_pct_{key}",
            single(f["guard_only_overhead_pct"], unit="%", label=f"fused FP8 {key}: slot guard alone / bare - 1"),
        )
        res.fig(
            f"fused_count_only_pct_{key}",
            single(
                f["count_only_overhead_pct"],
                unit="%",
                label=f"fused FP8 {key}: counted / guard alone (= count=False) - 1, shape {f['config']}",
            ),
        )
        res.fig(f"fused_gbs_{key}", single(f["gbps_counted"], unit="GB/s", label=f"fused FP8 {key}, counted"))
        res.fig(
            f"torch_count_over_fused_{key}",
            single(f["torch_count_over_fused"], unit="x", label=f"{key}: torch-ops counting / fused kernel"),
        )
        if f["regime"] == "healthy":
            res.target(
                f"fused FP8 counter {key}",
                f"overhead_pct_{key}",
                f"within {f['target_pct']:g} %",
                f["overhead_pct"],
                f["pass"],
            )
            # The same question asked of the shipped calls: counted vs count=False (the guard-alone kernel).
            bar = f.get("count_only_target_pct", f["target_pct"])
            res.target(
                f"fused FP8 counter {key}, vs count=False",
                f"fused_count_only_pct_{key}",
                f"within {bar:g} %",
                f["count_only_overhead_pct"],
                f["count_only_overhead_pct"] <= bar,
            )
    nf = out.get("nonfinite")
    if nf:
        res.fig("nonfinite_us", single(nf["us"], unit="us", label=f"non-finite counter {nf['shape']} {nf['dtype']}"))
        res.fig("nonfinite_pct_of_copy", single(nf["ratio_to_copy"] * 100, unit="%", label="non-finite vs D2D copy"))
        for sw in nf.get("sweep", []):
            shape = f"{sw['block']} x{sw['iters']} w{sw['num_warps']}"
            res.fig(
                f"nonfinite_sweep_pct_{sw['block']}_{sw['iters']}_{sw['num_warps']}",
                single(sw["ratio_to_copy"] * 100, unit="%", label=f"non-finite sweep: block {shape}, vs copy"),
            )
        res.target(
            "non-finite counter bandwidth",
            "nonfinite_pct_of_copy",
            f">= {nf['target'] * 100:g} % of a D2D copy",
            nf["ratio_to_copy"] * 100,
            nf["pass"],
        )
    for key in ("nonfinite", "nonfinite_large"):
        nf = out.get(key)
        if not nf or "sweep_min" not in nf:
            continue
        fig = f"{key}_sweep_min_pct"
        res.fig(
            fig, single(nf["sweep_min"] * 100, unit="%", label=f"non-finite sweep {nf['shape']}: its slowest shape")
        )
        res.target(
            f"non-finite counter sweep {nf['shape']}: every shape",
            fig,
            f">= {nf['sweep_target'] * 100:g} % of a D2D copy",
            nf["sweep_min"] * 100,
            nf["sweep_pass"],
        )
    res.note(f"fused FP8 and non-finite figures from lab.numerics (repeats={out.get('repeats')})")


def merge(res: dict, bench_json: Path) -> None:
    """Replace the numerics figures, targets and notes of q1 in an earlier ``tripwire bench`` record with this run's
    (:func:`fold`, as a full run would), and say so in q1's notes. The guard figures stay as they
    were: only the numerics kernels are re-measured. Then ``results_md.py --update`` renders the record."""
    import time

    if res.get("partial"):
        raise ValueError("merge() takes a whole numerics run: this one measured a part (fused_tokens or nonfinite)")
    data = json.loads(bench_json.read_text())
    q1 = data["questions"][label("guard_cost")]
    fresh = Result(
        label("guard_cost"), q1["title"], Ctx(quick=res["quick"], device="cuda", out=bench_json.parent, verbose=False)
    )
    fold(fresh, res)
    q1["figures"] = {
        k: v for k, v in q1["figures"].items() if not k.startswith(NUMERICS_FIGURE_PREFIXES)
    } | fresh.figures
    q1["targets"] = [t for t in q1["targets"] if not t["name"].startswith(NUMERICS_TARGET_PREFIXES)] + fresh.targets
    q1["notes"] = [n for n in q1["notes"] if not n.startswith(NUMERICS_NOTE_PREFIXES)] + [
        *fresh.notes,
        f"bench_numerics --merge: the fused FP8 and non-finite figures re-measured on {time.strftime('%Y-%m-%d')} "
        f"({res['device']}, torch {res['torch']}, triton {res['triton']}); the guard figures are from the run above",
    ]
    bench_json.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="one shape, one round")
    p.add_argument("--out", type=Path, help="write the result JSON here")
    p.add_argument("--merge", type=Path, help="fold the result into this tripwire bench JSON's q1 (see merge())")
    p.add_argument("--copies", type=int, default=None, help="loads of each fused kernel's code (default 2 quick, 6)")
    p.add_argument("--fused-tokens", default="", help="comma-separated batches of the fused kernel (default: all)")
    p.add_argument("--fused-only", action="store_true", help="leave the non-finite counter out")
    args = p.parse_args(argv)
    tokens = tuple(int(t) for t in args.fused_tokens.split(",") if t) or None
    if args.merge and (tokens or args.fused_only):
        # merge() replaces every numerics figure of q1: a partial run would drop the ones it did not measure (merge
        # refuses one too; here before anything is measured).
        p.error("--merge takes a whole run: not with --fused-tokens or --fused-only")
    res = run(args.quick, args.copies, tokens, nonfinite=not args.fused_only)
    print(_table(res))
    print(json.dumps(res, indent=2))
    if args.out:
        args.out.write_text(json.dumps(res, indent=2) + "\n")
    if args.merge:
        merge(res, args.merge)
    return 0


if __name__ == "__main__":
    sys.exit(main())
