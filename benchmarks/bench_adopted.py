"""vLLM's own kernels against the copies guarded by following docs/guarding.md (``adopted_vllm/``), on the GPU.

vLLM's side is the vLLM installed where this runs (on the device: the GPU bundle, ../shared/vllm-gpu, put on
PYTHONPATH): its Triton modules (``adopted_vllm.load("original", ...)``) and its compiled CUDA op
(``cuda_ext.vllm_op``). The output's ``vllm`` says which release and files were compared against (the guarded copies
come from 0.32.0: adopted_vllm/NOTICE). Without vLLM each case is skipped with the reason, naming what to install.

Cases (bf16, all metadata valid, so the guarded copy counts nothing and writes/returns what the original does:
both checked before timing):

* ``decode_gqa``: vLLM's split-K Triton decode attention, batch 64, 32 query / 8 KV heads, head dim 128, context
  2048, page 16, 8 KV splits (stage 1 and the stage-2 reduce, one call).
* ``decode_mha``: the same with 32 / 32 heads (vLLM's non-grouped stage 1).
* ``reshape_triton_{256,4096}``: vLLM's Triton reshape_and_cache_flash, 8 KV heads x 128, page 16, slots a random
  permutation of a cache 4x the tokens.
* ``reshape_cuda_{256,4096}``: vLLM's CUDA reshape_and_cache_flash_kernel (vLLM's compiled op) and its guarded
  copy (and the vote control), same shapes. vLLM's library loads once per process (it registers its ops once), so
  vLLM's side here is one load of its code, timed as each of its "copies", and its A/A is the timer's floor only.

Timing (``_common.pooled_replay_ms``): each variant is its code loaded ``--copies`` times (modules of their own,
so the code sits at as many addresses: where it lands moves a kernel's time by a few tenths of a percent, persistently,
see benchmarks/RESULTS.md), each load captured ``per_graph`` calls to a CUDA graph; each round times every graph
(do_bench median), the copies interleaved, in an order alternating between rounds; the cost is the median over
rounds of the per-round ratio median(guarded copies) / median(original copies) - 1. The noise floor is an A/A: as
many more loads of the original timed the same way (``aa_pct``). Beside them: ``one_load_cost_pct``, the same
ratio between the first load of each side alone (what a comparison of one build each measures), and each side's
``copy_spread_pct``. Target: ``cost_pct`` <= 1 % each. Resources: registers, spills, shared memory and programs per SM
of every kernel, guarded and original (``tripwire.resources``: Triton kernels compiled for sm_90, the CUDA
extension read with cuobjdump).

    python benchmarks/bench_adopted.py --out $OUT/adopted.json [--rounds 41] [--copies 6] [--only decode_gqa,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lab.common import (
    copy_levels_ms,
    copy_spread_pct,
    env_info,
    finish,
    one_load_pct,
    pooled_cost_pct,
    pooled_ms,
    pooled_replay_ms,
)

TARGET_PCT = 1.0
DECODE = dict(batch=64, head_dim=128, context=2048, page=16, splits=8)
CACHE = dict(kv_heads=8, head_dim=128, page=16)


Bodies = dict[str, list[Callable[[], Any]]]  # per variant, one body per load of its code
Case = tuple[Bodies, Callable[[], list[tuple]]]


def _variants(copies: int) -> dict[str, tuple[str, range]]:
    """Each timed variant: the code it runs (original or guarded) and which of that code's loads (copies)."""
    return {
        "original": ("original", range(copies)),
        "guarded": ("guarded", range(copies)),
        "original_b": ("original", range(copies, 2 * copies)),  # the A/A: as many further loads of the original
    }


def _decode_case(q_heads: int, kv_heads: int, copies: int, device: str = "cuda") -> Case:
    from adopted_vllm import load

    B, D, ctx, PS, S = (DECODE[k] for k in ("batch", "head_dim", "context", "page", "splits"))
    W = ctx // PS
    N = B * W + 64
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, q_heads, D, device=device, generator=g, dtype=torch.bfloat16)
    kb = torch.randn(N, PS, kv_heads, D, device=device, generator=g, dtype=torch.bfloat16)
    vb = torch.randn(N, PS, kv_heads, D, device=device, generator=g, dtype=torch.bfloat16)
    table = torch.randperm(N, device=device, generator=g)[: B * W].reshape(B, W).to(torch.int32)
    lens = torch.full((B,), ctx, device=device, dtype=torch.int32)
    scale = D**-0.5
    variants = _variants(copies)
    outs = {n: torch.empty_like(q) for n in variants}
    lse = {n: torch.empty(B, q_heads, device=device, dtype=torch.float32) for n in variants}
    logits = {n: torch.empty(B, q_heads, S, D + 1, device=device, dtype=torch.float32) for n in variants}
    one = torch.ones((), device=device, dtype=torch.float32)
    ctr = _counters(load("guarded", "triton_decode_attention").SITES, device)

    def body(code: str, i: int, name: str) -> Callable[[], None]:
        mod = load(code, "triton_decode_attention", copy=i)
        kw = {"ctr": ctr} if code == "guarded" else {}

        def run() -> None:
            # Each variant writes its own outputs (its copies the same values): the check compares them.
            mod.decode_attention_fwd(
                q, kb, vb, outs[name], lse[name], table, lens, logits[name], S, scale, PS,
                k_scale=one, v_scale=one, **kw,
            )  # fmt: skip

        return run

    bodies = {n: [body(code, i, n) for i in loads] for n, (code, loads) in variants.items()}

    def check() -> list[tuple]:
        # Every load of every variant against the original's first, each into outputs filled with NaN first: a load
        # that wrote nothing (or launched another load's kernel wrongly) fails here instead of timing as a fast one.
        ref = None
        for name, runs in bodies.items():
            for i, b in enumerate(runs):
                outs[name].fill_(float("nan"))
                b()
                _sync(device)
                if ref is None:
                    ref = outs[name].clone()
                    assert not ref.isnan().any(), "the original wrote NaN on clean input"
                # Not bitwise: the guarded kernel's -inf-safe softmax may be scheduled (contracted) differently.
                torch.testing.assert_close(outs[name], ref, rtol=2e-2, atol=2e-3, msg=f"{name} load {i}")
        assert int(ctr[:, 0].sum()) == 0, ctr
        from tripwire import resources as rs

        usage = []
        for name in ("original", "guarded"):
            launches = rs.capture_launches(bodies[name][0])
            usage += [(name, rs.triton_usage(launch)) for launch in launches]
        return usage

    return bodies, check


def _cache_inputs(tokens: int, device: str = "cuda") -> dict[str, torch.Tensor]:
    H, D, PS = CACHE["kv_heads"], CACHE["head_dim"], CACHE["page"]
    blocks = 4 * tokens // PS
    g = torch.Generator(device=device).manual_seed(1)
    return dict(
        key=torch.randn(tokens, H, D, device=device, generator=g, dtype=torch.bfloat16),
        value=torch.randn(tokens, H, D, device=device, generator=g, dtype=torch.bfloat16),
        slots=torch.randperm(blocks * PS, device=device, generator=g)[:tokens].to(torch.int64),
        blocks=torch.tensor(blocks),
    )


def _caches(c: dict[str, torch.Tensor], device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    blocks = int(c["blocks"])
    shape = (blocks, CACHE["page"], CACHE["kv_heads"], CACHE["head_dim"])
    return (
        torch.zeros(shape, device=device, dtype=torch.bfloat16),
        torch.zeros(shape, device=device, dtype=torch.bfloat16),
    )


def _reshape_case(tokens: int, cuda: bool, copies: int, device: str = "cuda") -> Case:
    c = _cache_inputs(tokens, device)
    one = torch.ones(1, device=device, dtype=torch.float32)
    variants = _variants(copies)
    make: Callable[[tuple[torch.Tensor, torch.Tensor], str, int], Callable[[], None]]
    if cuda:
        from adopted_vllm import cuda_ext

        cuda_ext.vllm_op()  # NoVllm, naming what to install, before anything is built
        for i in range(copies):
            cuda_ext.build(copy=i)
        ctr = _counters((cuda_ext.SITE,))
        # The extension's copy i runs guarded copy i (and the vote control's); guard=False is vLLM's op, whatever i.
        guards: dict[str, bool | str] = {"original": False, "guarded": True, "vote": "vote"}
        variants["vote"] = ("vote", range(copies))  # the profiler's control (adopted_vllm/vote_variant.cuh)

        def make(cache: tuple[torch.Tensor, torch.Tensor], code: str, i: int) -> Callable[[], None]:
            kc, vc = cache
            return lambda: cuda_ext.reshape_and_cache_flash(
                c["key"], c["value"], kc, vc, c["slots"], one, one, guard=guards[code], ctr=ctr, copy=i
            )

    else:
        from adopted_vllm import load

        ctr = _counters((load("guarded", "triton_reshape_and_cache_flash").SITE_SLOT,), device)

        def make(cache: tuple[torch.Tensor, torch.Tensor], code: str, i: int) -> Callable[[], None]:
            kc, vc = cache
            mod = load(code, "triton_reshape_and_cache_flash", copy=i)
            kw = {"ctr": ctr} if code == "guarded" else {}
            return lambda: mod.triton_reshape_and_cache_flash(
                c["key"], c["value"], kc, vc, c["slots"], "auto", one, one, **kw
            )

    # The check writes each variant's own caches (and compares them); the timed bodies all write one pair: the
    # variants write the same bytes to the same slots, and caches of their own would time each variant against
    # its own pages (where a 32 MiB cache lands in memory moved an A/A pair by over 1 %).
    caches = {n: _caches(c, device) for n in variants}
    timed = _caches(c, device)
    own = {n: [make(caches[n], code, i) for i in loads] for n, (code, loads) in variants.items()}
    bodies = {n: [make(timed, code, i) for i in loads] for n, (code, loads) in variants.items()}

    def check() -> list[tuple]:
        # Every load of every variant into zeroed caches, against the original's first load, bit for bit: a load
        # that wrote nothing (or another load's kernel) fails here instead of timing as a fast one.
        ref = None
        for name, runs in own.items():
            for i, b in enumerate(runs):
                for t in caches[name]:
                    t.zero_()
                b()
                _sync(device)
                if ref is None:
                    ref = tuple(t.clone() for t in caches[name])
                    assert all(t.any() for t in ref), "the original wrote nothing"
                for a, r in zip(caches[name], ref, strict=True):
                    assert torch.equal(a, r), f"{name} load {i} differs from the original on clean input"
        assert int(ctr.reshape(-1, 8)[:, 0].sum()) == 0, ctr
        from tripwire import resources as rs

        if cuda:
            from adopted_vllm import cuda_ext

            threads = min(CACHE["kv_heads"] * CACHE["head_dim"], 512)
            found = rs.cuda_usage(cuda_ext.vllm_library_path(), block_threads=threads, match=cuda_ext.VLLM_KERNEL_MATCH)
            found += rs.cuda_usage(cuda_ext.library_path(), block_threads=threads, match="reshape_and_cache_flash")
            return [(cuda_ext.variant_of(u.kernel), u) for u in found]
        usage = []
        for name in ("original", "guarded"):
            usage += [(name, rs.triton_usage(launch)) for launch in rs.capture_launches(bodies[name][0])]
        return usage

    return bodies, check


def _sync(device: str) -> None:
    if device != "cpu":  # the kernels' device in the CPU harness test (the interpreter) runs synchronously
        torch.cuda.synchronize()


def _counters(sites: tuple, device: str = "cuda") -> torch.Tensor:
    from tripwire.kernels import counters

    return counters(sites, device)


# name -> (copies, device) -> the case
CASES: dict[str, Callable[[int, str], Case]] = {
    "decode_gqa": lambda k, d: _decode_case(32, 8, k, d),
    "decode_mha": lambda k, d: _decode_case(32, 32, k, d),
    "reshape_triton_256": lambda k, d: _reshape_case(256, cuda=False, copies=k, device=d),
    "reshape_triton_4096": lambda k, d: _reshape_case(4096, cuda=False, copies=k, device=d),
    "reshape_cuda_256": lambda k, d: _reshape_case(256, cuda=True, copies=k, device=d),
    "reshape_cuda_4096": lambda k, d: _reshape_case(4096, cuda=True, copies=k, device=d),
}
PER_GRAPH = {"decode_gqa": 5, "decode_mha": 5}  # the reshape cases: 20 (a few microseconds each)


def run_case(name: str, rounds: int, rep_ms: int, copies: int, device: str = "cuda") -> dict:
    """One case: its check (every load against the original's first), then the pooled timing. ``device``: where
    the case's tensors live (the harness test runs the Triton cases on the CPU, under the interpreter, its timers
    replaced)."""
    bodies, check = CASES[name](copies, device)
    usage = check()
    times = pooled_replay_ms(bodies, per_graph=PER_GRAPH.get(name, 20), repeats=rounds, rep_ms=rep_ms)
    cost = pooled_cost_pct(times, "guarded", "original")
    aa = pooled_cost_pct(times, "original_b", "original")
    med = {n: pooled_ms(t) for n, t in times.items()}
    res = {
        "original_us": med["original"] * 1e3,
        "guarded_us": med["guarded"] * 1e3,
        "cost_pct": statistics.median(cost),
        "cost_spread_pct": [min(cost), max(cost)],
        "aa_pct": statistics.median(aa),
        "aa_spread_pct": [min(aa), max(aa)],
        "one_load_cost_pct": statistics.median(one_load_pct(times, "guarded", "original")),
        "one_load_aa_pct": statistics.median(one_load_pct(times, "original_b", "original")),
        "copies": copies,
        "copy_levels_us": {n: [x * 1e3 for x in copy_levels_ms(t)] for n, t in times.items()},
        "copy_spread_pct": {n: copy_spread_pct(t) for n, t in times.items()},
        "rounds": rounds,
        "target_pct": TARGET_PCT,
        "pass": statistics.median(cost) <= TARGET_PCT,
        "resources": [dict(variant=v, **dataclasses.asdict(u)) for v, u in usage],
    }
    if "vote" in times:
        res["vote_us"] = med["vote"] * 1e3
        res["vote_cost_pct"] = statistics.median(pooled_cost_pct(times, "vote", "original"))
    by: dict[str, list] = {}
    for v, u in usage:
        by.setdefault(v, []).append(u)
    # Each guarded build (the CUDA copy has two, one per test placement) against the original's kernels in order.
    orig = by.get("original", [])
    builds = [us for v, us in by.items() if v.startswith("guarded")]
    res["resources_equal"] = bool(builds) and all(
        len(us) == len(orig)
        and all(
            g.reg_units <= o.reg_units + 1 and g.programs_per_sm >= o.programs_per_sm
            for g, o in zip(us, orig, strict=True)
        )
        for us in builds
    )
    return res


def vllm_sources() -> dict[str, Any]:
    """Which vLLM the originals are: the release and file of each Triton module, the library of the CUDA op (or why
    there is none)."""
    from adopted_vllm import MODULES, NoVllm, cuda_ext, original_source, vllm_version

    out: dict[str, Any] = {}
    try:
        out["version"] = vllm_version()
        out["triton"] = {m: original_source(m) for m in MODULES}
    except NoVllm as e:
        return {"error": str(e)}
    try:
        out["cuda"] = {"op": "torch.ops._C_cache_ops.reshape_and_cache_flash", "library": cuda_ext.vllm_library_path()}
    except NoVllm as e:
        out["cuda"] = {"error": str(e)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--copies", type=int, default=6, help="loads of each side's code (at least 1)")
    p.add_argument("--only", default="", help="comma-separated case names")
    args = p.parse_args(argv)
    if args.copies < 1:
        p.error(f"--copies must be at least 1, got {args.copies}")
    if not torch.cuda.is_available():
        print("bench_adopted: needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tripwire

    tripwire.prealloc("cuda")
    names = [n for n in args.only.split(",") if n] or list(CASES)
    out: dict[str, Any] = {"env": env_info(), "vllm": vllm_sources(), "cases": {}}
    print(f"vLLM compared against: {json.dumps(out['vllm'])}", flush=True)
    from adopted_vllm import NoVllm

    for name in names:
        t = time.time()
        try:
            out["cases"][name] = r = run_case(name, args.rounds, args.rep_ms, args.copies)
            regs = ", ".join(
                f"{x['variant']}:{x['kernel'][-24:]}={x['regs']}r/{x['programs_per_sm']}p" for x in r["resources"]
            )
            print(
                f"{name:22s} original {r['original_us']:8.2f} us  guarded {r['guarded_us']:8.2f} us  "
                f"cost {r['cost_pct']:+6.2f} %  A/A {r['aa_pct']:+6.2f} %"
                + (f"  vote control {r['vote_cost_pct']:+6.2f} %" if "vote_cost_pct" in r else "")
                + f"  one load {r['one_load_cost_pct']:+6.2f} % (A/A {r['one_load_aa_pct']:+6.2f} %)"
                + f"  copies {r['copies']}, original's spread {r['copy_spread_pct']['original']:.2f} %"
                + f"  [{regs}]  ({time.time() - t:.0f} s)",
                flush=True,
            )
        except NoVllm as e:
            out["cases"][name] = {"skipped": str(e)}
            print(f"{name:22s} SKIPPED: {e}", flush=True)
        except Exception as e:  # one case failing must not lose the others' figures
            out["cases"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name:22s} ERROR {type(e).__name__}: {e}", flush=True)
    out["targets"] = [
        {"name": f"{n}.cost_pct", "target": f"<= {TARGET_PCT} %", "value": c.get("cost_pct", float("nan")),
         "pass": bool(c.get("pass")) and bool(c.get("resources_equal"))}
        for n, c in out["cases"].items() if "skipped" not in c
    ]  # fmt: skip
    return finish(out, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
