"""tripwire's vLLM plugin on vLLM's GPU engine: what ``contain`` adds to a decode step of an 8B-shaped Llama.

The engine: Llama-3-8B's shape with dummy weights (``load_format="dummy"``: random weights, no download), bf16,
CUDA graphs and torch.compile at vLLM's defaults, async scheduling on, the V2 model runner (vLLM's GPU default) or V1
(``--runner V1``), the engine core in-process (so one process can switch the plugin between steps). Decode at batch
1, 8, 32 and 64, with the plugin on and off INTERLEAVED in that one engine (``tripwire.testing.vllm_run``:
``TRIPWIRE_VLLM=contain`` at start-up builds the validator; before each decode step every method the plugin wraps is
set to its wrapper, "on", or to vLLM's original, "off"), in cycles of three kinds (on, off, off2, then mirrored), in
blocks of ``--block`` steps whose first is not timed: under async scheduling a step's sampled tokens, and the
verdict riding with them, are taken in the next step's call, so a step right after a switch carries the kind
before it.
Per batch: the overhead is the median over repeats of on against the mean of off and off2; the noise floor, the
median over repeats of |off against off2|. Beside them: the plugin's host time per step (its validator calls,
timed inside the engine in rounds of their own) and the GPU time of tripwire's kernels per step against the step's
whole device time (torch.profiler), and the device operations the plugin adds to a step (one profiled round with it
on and one with it off: each operation's count and time, and the device-busy time per step). Target: at most 0.5 %
of the decode step at every batch size.

``python benchmarks/bench_vllm_gpu.py OUTDIR [--repeats N] [--steps N] [--runner V2|V1]`` on a GPU machine with vLLM
on the path; writes ``OUTDIR/bench_vllm_gpu.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from tripwire.testing.vllm_proc import run_engine

BATCHES = (1, 8, 32, 64)


def llama3_8b(path: Path) -> str:
    """Llama-3-8B's config (its published shape), saved where vLLM reads it; the weights are vLLM's dummy ones."""
    from transformers import LlamaConfig

    if not (path / "config.json").exists():
        LlamaConfig(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            torch_dtype="bfloat16",
        ).save_pretrained(path)
    return str(path)


def figures(b: dict[str, Any]) -> dict[str, float]:
    ratios = [on / ((off + off2) / 2) - 1 for on, off, off2 in zip(b["on"], b["off"], b["off2"], strict=True)]
    noise = [abs(off / off2 - 1) for off, off2 in zip(b["off"], b["off2"], strict=True)]
    step = statistics.median((off + off2) / 2 for off, off2 in zip(b["off"], b["off2"], strict=True))
    out = {
        "step_ms": step * 1e3,
        "overhead_pct": statistics.median(ratios) * 100,
        "noise_pct": statistics.median(noise) * 100,
        "host_us": statistics.median(b["hook_s_per_step"]) * 1e6,
    }
    if "gpu_us_per_step" in b:
        g = b["gpu_us_per_step"]
        out["gpu_tripwire_us"] = g["tripwire_us"]
        out["gpu_step_us"] = g["all_us"]
        out["gpu_share_pct"] = 100 * g["tripwire_us"] / g["all_us"] if g["all_us"] else float("nan")
        for part in ("logits", "fp8", "guard"):
            if f"{part}_us" in g and g["all_us"]:
                out[f"{part}_us"] = g[f"{part}_us"]
                out[f"{part}_pct"] = 100 * g[f"{part}_us"] / g["all_us"]
    if "device_ops" in b:
        on, off = b["device_ops"]["on"], b["device_ops"]["off"]
        out["busy_added_us"] = on["busy_us"] - off["busy_us"]
    return out


def added_ops(b: dict[str, Any]) -> list[tuple[str, float, float]]:
    """The device operations the plugin adds to a step: (name, count, us) per step, on minus off, largest first."""
    on, off = b["device_ops"]["on"]["ops"], b["device_ops"]["off"]["ops"]
    diff = []
    for name in set(on) | set(off):
        c1, t1 = on.get(name, (0.0, 0.0))
        c0, t0 = off.get(name, (0.0, 0.0))
        if abs(c1 - c0) >= 0.5 or abs(t1 - t0) >= 0.5:
            diff.append((name, c1 - c0, t1 - t0))
    return sorted(diff, key=lambda d: -abs(d[2]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--runner", choices=("V2", "V1"), default="V2")
    ap.add_argument(
        "--block", type=int, default=8, help="steps of one kind in a row, the first not timed (async scheduling)"
    )
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--kv-cache-dtype", default=None, help="fp8: the FP8 clip counter's run (its GPU time per step)")
    args = ap.parse_args(argv)
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(x) for x in args.batches.split(",")]
    model = llama3_8b(out / "llama3-8b-config")
    config = {
        "model": model,
        "max_seqs": max(batches),
        "gpu": {
            "load_format": "dummy",
            "max_model_len": 2048,
            "kv_cache_bytes": 8 << 30,
            "capture_sizes": sorted(set(batches)),
            **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}),
        },
        "bench": {"batches": batches, "steps": args.steps, "repeats": args.repeats, "block": args.block},
    }
    env = {"VLLM_USE_V2_MODEL_RUNNER": "1" if args.runner == "V2" else "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    tag = f"bench-{args.runner}" + (f"-{args.kv_cache_dtype}" if args.kv_cache_dtype else "")
    run = run_engine(out / "work", tag, config, mode="contain", env=env, timeout=570)
    if run.result is None:
        print(f"the engine died (rc {run.rc}): {run.stderr[-4000:]}")
        return 1
    bench = run.result["bench"]
    table = {str(b): figures(bench[str(b)]) for b in batches}
    result = {"runner": args.runner, "v2": run.result.get("v2"), "vllm": run.result.get("vllm"), "batches": table}
    result["kv_cache_dtype"] = args.kv_cache_dtype or "auto"
    (out / f"{tag}.json").write_text(json.dumps({**result, "raw": bench}, indent=1))
    print(f"vLLM {result['vllm']} runner {args.runner} (v2={result['v2']}), contain, 8B dummy, graphs, async")
    print(f"kv cache {result['kv_cache_dtype']}; gpu us = tripwire's kernels per step (logits check, fp8 count)")
    print(f"{'batch':>5} {'step ms':>8} {'overhead %':>10} {'noise %':>8} {'host us':>8} {'gpu us':>7} {'gpu %':>6} "
          f"{'logits %':>8} {'fp8 %':>6}")  # fmt: skip
    nan = float("nan")
    for b, f in table.items():
        print(
            f"{b:>5} {f['step_ms']:8.3f} {f['overhead_pct']:10.3f} {f['noise_pct']:8.3f} {f['host_us']:8.1f} "
            f"{f.get('gpu_tripwire_us', nan):7.1f} {f.get('gpu_share_pct', nan):6.3f} "
            f"{f.get('logits_pct', nan):8.3f} {f.get('fp8_pct', nan):6.3f}"
        )
    for b in batches:
        raw = bench[str(b)]
        if "device_ops" not in raw:
            continue
        f = table[str(b)]
        print(f"batch {b}: device busy {f['busy_added_us']:+.1f} us per step; operations added (count, us per step):")
        for name, dc, dt in added_ops(raw)[:14]:
            print(f"  {dc:+6.2f} {dt:+8.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
