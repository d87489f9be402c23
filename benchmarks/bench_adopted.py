"""vLLM's own kernels against the copies guarded by following docs/guarding.md (``adopted_vllm/``), on the GPU.

Cases (bf16, all metadata valid, so the guarded copy counts nothing and writes/returns what the original does:
both checked before timing):

* ``decode_gqa``: vLLM's split-K Triton decode attention, batch 64, 32 query / 8 KV heads, head dim 128, context
  2048, page 16, 8 KV splits (stage 1 and the stage-2 reduce, one call).
* ``decode_mha``: the same with 32 / 32 heads (vLLM's non-grouped stage 1).
* ``reshape_triton_{256,4096}``: vLLM's Triton reshape_and_cache_flash, 8 KV heads x 128, page 16, slots a random
  permutation of a cache 4x the tokens.
* ``reshape_cuda_{256,4096}``: vLLM's CUDA reshape_and_cache_flash_kernel (and its guarded copy), same shapes.

Timing (``_common.paired_replay_ms``): each variant captured ``per_graph`` calls to a CUDA graph; each round times
every graph (do_bench median), in an order alternating between rounds; the cost is the median over rounds of the
per-round ratio guarded / original - 1. The noise floor is an A/A: a second graph of the original timed the same
way (``aa_pct``). Target: ``cost_pct`` <= 1 % each. Resources: registers, spills, shared memory and programs per SM
of every kernel, guarded and original (``tripwire.resources``: Triton kernels compiled for sm_90, the CUDA
extension read with cuobjdump).

    python benchmarks/bench_adopted.py --out $OUT/adopted.json [--rounds 41] [--only decode_gqa,reshape_cuda_4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tripwire.cli.bench.common import env_info, finish, paired_replay_ms

TARGET_PCT = 1.0
DECODE = dict(batch=64, head_dim=128, context=2048, page=16, splits=8)
CACHE = dict(kv_heads=8, head_dim=128, page=16)


def _decode_case(q_heads: int, kv_heads: int) -> tuple[dict[str, Callable[[], Any]], Callable[[], list[tuple]]]:
    from adopted_vllm import load

    orig = load("original", "triton_decode_attention")
    guard = load("guarded", "triton_decode_attention")
    B, D, ctx, PS, S = (DECODE[k] for k in ("batch", "head_dim", "context", "page", "splits"))
    W = ctx // PS
    N = B * W + 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, q_heads, D, device="cuda", generator=g, dtype=torch.bfloat16)
    kb = torch.randn(N, PS, kv_heads, D, device="cuda", generator=g, dtype=torch.bfloat16)
    vb = torch.randn(N, PS, kv_heads, D, device="cuda", generator=g, dtype=torch.bfloat16)
    table = torch.randperm(N, device="cuda", generator=g)[: B * W].reshape(B, W).to(torch.int32)
    lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    scale = D**-0.5
    outs = {n: torch.empty_like(q) for n in ("original", "guarded", "original_b")}
    lse = {n: torch.empty(B, q_heads, device="cuda", dtype=torch.float32) for n in outs}
    logits = {n: torch.empty(B, q_heads, S, D + 1, device="cuda", dtype=torch.float32) for n in outs}
    one = torch.ones((), device="cuda", dtype=torch.float32)
    ctr = _counters(guard.SITES)

    def body(mod: Any, name: str, **kw: Any) -> Callable[[], None]:
        def run() -> None:
            mod.decode_attention_fwd(
                q, kb, vb, outs[name], lse[name], table, lens, logits[name], S, scale, PS,
                k_scale=one, v_scale=one, **kw,
            )  # fmt: skip

        return run

    bodies = {
        "original": body(orig, "original"),
        "guarded": body(guard, "guarded", ctr=ctr),
        "original_b": body(orig, "original_b"),
    }

    def check() -> list[tuple]:
        for b in bodies.values():
            b()
        torch.cuda.synchronize()
        # Not bitwise: the guarded kernel's -inf-safe softmax may be scheduled (contracted) differently.
        torch.testing.assert_close(outs["guarded"], outs["original"], rtol=2e-2, atol=2e-3, equal_nan=True)
        assert int(ctr[:, 0].sum()) == 0, ctr
        from tripwire import resources as rs

        usage = []
        for name in ("original", "guarded"):
            launches = rs.capture_launches(bodies[name])
            usage += [(name, rs.triton_usage(launch)) for launch in launches]
        return usage

    return bodies, check


def _cache_inputs(tokens: int) -> dict[str, torch.Tensor]:
    H, D, PS = CACHE["kv_heads"], CACHE["head_dim"], CACHE["page"]
    blocks = 4 * tokens // PS
    g = torch.Generator(device="cuda").manual_seed(1)
    return dict(
        key=torch.randn(tokens, H, D, device="cuda", generator=g, dtype=torch.bfloat16),
        value=torch.randn(tokens, H, D, device="cuda", generator=g, dtype=torch.bfloat16),
        slots=torch.randperm(blocks * PS, device="cuda", generator=g)[:tokens].to(torch.int64),
        blocks=torch.tensor(blocks),
    )


def _caches(c: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = int(c["blocks"])
    shape = (blocks, CACHE["page"], CACHE["kv_heads"], CACHE["head_dim"])
    return (
        torch.zeros(shape, device="cuda", dtype=torch.bfloat16),
        torch.zeros(shape, device="cuda", dtype=torch.bfloat16),
    )


def _reshape_case(tokens: int, cuda: bool) -> tuple[dict[str, Callable[[], Any]], Callable[[], list[tuple]]]:
    c = _cache_inputs(tokens)
    one = torch.ones(1, device="cuda", dtype=torch.float32)
    make: Callable[[tuple[torch.Tensor, torch.Tensor], Any], Callable[[], None]]
    if cuda:
        from adopted_vllm import cuda_ext

        cuda_ext.build()
        ctr = _counters((cuda_ext.SITE,))

        def make(cache: tuple[torch.Tensor, torch.Tensor], guard: Any) -> Callable[[], None]:
            kc, vc = cache
            return lambda: cuda_ext.reshape_and_cache_flash(
                c["key"], c["value"], kc, vc, c["slots"], one, one, guard=guard, ctr=ctr
            )

        # vote: the profiler's control (adopted_vllm/vote_variant.cuh)
        specs: dict[str, Any] = {"original": False, "guarded": True, "original_b": False, "vote": "vote"}
    else:
        from adopted_vllm import load

        orig = load("original", "triton_reshape_and_cache_flash")
        guard = load("guarded", "triton_reshape_and_cache_flash")
        ctr = _counters((guard.SITE_SLOT,))

        def make(cache: tuple[torch.Tensor, torch.Tensor], spec: Any) -> Callable[[], None]:
            (kc, vc), (mod, kw) = cache, spec
            return lambda: mod.triton_reshape_and_cache_flash(
                c["key"], c["value"], kc, vc, c["slots"], "auto", one, one, **kw
            )

        specs = {"original": (orig, {}), "guarded": (guard, {"ctr": ctr}), "original_b": (orig, {})}
    # The check writes each variant's own caches (and compares them); the timed bodies all write one pair: the
    # variants write the same bytes to the same slots, and caches of their own would time each variant against
    # its own pages (where a 32 MiB cache lands in memory moved an A/A pair by over 1 %).
    caches = {n: _caches(c) for n in specs}
    timed = _caches(c)
    own = {n: make(caches[n], spec) for n, spec in specs.items()}
    bodies = {n: make(timed, spec) for n, spec in specs.items()}

    def check() -> list[tuple]:
        for b in own.values():
            b()
        torch.cuda.synchronize()
        for a, b in zip(caches["original"], caches["guarded"], strict=True):
            assert torch.equal(a, b), "guarded reshape_and_cache differs on clean input"
        assert int(ctr.reshape(-1, 8)[:, 0].sum()) == 0, ctr
        from tripwire import resources as rs

        if cuda:
            from adopted_vllm import cuda_ext

            threads = min(CACHE["kv_heads"] * CACHE["head_dim"], 512)
            found = rs.cuda_usage(cuda_ext.library_path(), block_threads=threads, match="reshape_and_cache_flash")
            return [(cuda_ext.variant_of(u.kernel), u) for u in found]
        usage = []
        for name in ("original", "guarded"):
            usage += [(name, rs.triton_usage(launch)) for launch in rs.capture_launches(bodies[name])]
        return usage

    return bodies, check


def _counters(sites: tuple) -> torch.Tensor:
    from tripwire.kernels import counters

    return counters(sites, "cuda")


CASES: dict[str, Callable[[], tuple[dict[str, Callable[[], Any]], Callable[[], list[tuple]]]]] = {
    "decode_gqa": lambda: _decode_case(32, 8),
    "decode_mha": lambda: _decode_case(32, 32),
    "reshape_triton_256": lambda: _reshape_case(256, cuda=False),
    "reshape_triton_4096": lambda: _reshape_case(4096, cuda=False),
    "reshape_cuda_256": lambda: _reshape_case(256, cuda=True),
    "reshape_cuda_4096": lambda: _reshape_case(4096, cuda=True),
}
PER_GRAPH = {"decode_gqa": 5, "decode_mha": 5}  # the reshape cases: 20 (a few microseconds each)


def _pct(num: list[float], den: list[float]) -> list[float]:
    return [100.0 * (a / b - 1.0) for a, b in zip(num, den, strict=True)]


def run_case(name: str, rounds: int, rep_ms: int) -> dict:
    bodies, check = CASES[name]()
    usage = check()
    times = paired_replay_ms(bodies, per_graph=PER_GRAPH.get(name, 20), repeats=rounds, rep_ms=rep_ms)
    cost = _pct(times["guarded"], times["original"])
    aa = _pct(times["original_b"], times["original"])
    vote = _pct(times["vote"], times["original"]) if "vote" in times else None
    res = {
        "original_us": statistics.median(times["original"]) * 1e3,
        "guarded_us": statistics.median(times["guarded"]) * 1e3,
        "cost_pct": statistics.median(cost),
        "aa_pct": statistics.median(aa),
        "aa_spread_pct": [min(aa), max(aa)],
        "rounds": rounds,
        "target_pct": TARGET_PCT,
        "pass": statistics.median(cost) <= TARGET_PCT,
        "resources": [dict(variant=v, **dataclasses.asdict(u)) for v, u in usage],
    }
    if vote is not None:
        res["vote_us"] = statistics.median(times["vote"]) * 1e3
        res["vote_cost_pct"] = statistics.median(vote)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--only", default="", help="comma-separated case names")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_adopted: needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tripwire

    tripwire.prealloc("cuda")
    names = [n for n in args.only.split(",") if n] or list(CASES)
    out: dict[str, Any] = {"env": env_info(), "cases": {}}
    for name in names:
        t = time.time()
        try:
            out["cases"][name] = r = run_case(name, args.rounds, args.rep_ms)
            regs = ", ".join(
                f"{x['variant']}:{x['kernel'][-24:]}={x['regs']}r/{x['programs_per_sm']}p" for x in r["resources"]
            )
            print(
                f"{name:22s} original {r['original_us']:8.2f} us  guarded {r['guarded_us']:8.2f} us  "
                f"cost {r['cost_pct']:+6.2f} %  A/A {r['aa_pct']:+6.2f} %"
                + (f"  vote control {r['vote_cost_pct']:+6.2f} %" if "vote_cost_pct" in r else "")
                + f"  [{regs}]  ({time.time() - t:.0f} s)",
                flush=True,
            )
        except Exception as e:  # one case failing must not lose the others' figures
            out["cases"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name:22s} ERROR {type(e).__name__}: {e}", flush=True)
    out["targets"] = [
        {"name": f"{n}.cost_pct", "target": f"<= {TARGET_PCT} %", "value": c.get("cost_pct", float("nan")),
         "pass": bool(c.get("pass")) and bool(c.get("resources_equal"))}
        for n, c in out["cases"].items()
    ]  # fmt: skip
    return finish(out, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
