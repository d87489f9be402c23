"""transformers' continuous batching end to end, with the tripwire integration and without: what it costs an engine.

A Llama-3-8B-shaped model (32 layers, hidden 4096, 32/8 heads, vocab 128256) with random bf16 weights, CUDA graphs on,
greedy decoding, batches of 32 and 64 requests x 128 new tokens. Two models share nothing but their weights' values
(a deep copy), so each has its own manager, cache and captured graphs: ``plain`` (no tripwire) and ``tripwire``
(installed, policy mask). Every (batch, variant) pair is warmed up with one full untimed run (its graphs, including
the ones captured lazily as the KV length grows, exist before timing), then the variants alternate over ``--rounds``
rounds. Figures: wall time of a run, decode tokens/s, the overhead of the medians, and the noise floor (the spread of
the plain runs, and the median absolute difference between consecutive plain rounds).

``python benchmarks/bench_transformers.py [--rounds N] [--layers N] [--json PATH]``
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from lab.common import env_info, write_json

TARGET_PCT = 0.1


def _model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def run(
    rounds: int = 5, layers: int = 32, batches: tuple[int, ...] = (32, 64), tokens: int = 128, contain: bool = False
) -> dict:
    import transformers

    import tripwire
    from tripwire.integrations import transformers as tw
    from tripwire.testing.transformers_engine import PersistentEngine, cb_config

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    t0 = time.time()
    plain = _model(layers)
    guarded = copy.deepcopy(plain)
    contained = copy.deepcopy(plain) if contain else None
    init_s = time.time() - t0
    mon = tripwire.Monitor()  # defaults: warn, 50 ms
    handles = [tw.install(guarded, monitor=mon)]
    if contained is not None:
        handles.append(tw.install(contained, monitor=mon, contain=True))
    cb = {"num_blocks": 256, "max_batch_tokens": 2048, "max_requests": max(batches), "page": 256}
    engines = {
        "plain": PersistentEngine(plain, tokens, cb_config(cuda_graphs=True, **cb), warmup=False),
        "tripwire": PersistentEngine(guarded, tokens, cb_config(cuda_graphs=True, **cb), warmup=False),
    }
    if contained is not None:  # contain=True: attribution's per-step request table on top
        engines["contain"] = PersistentEngine(contained, tokens, cb_config(cuda_graphs=True, **cb), warmup=False)
    g = torch.Generator().manual_seed(1)
    out: dict = {
        "env": env_info(),
        "transformers": transformers.__version__,
        "layers": layers,
        "tokens": tokens,
        "rounds": rounds,
        "init_s": init_s,
        "batches": {},
    }
    for b in batches:
        prompts = [torch.randint(0, 128256, (32,), generator=g).tolist() for _ in range(b)]
        tok: dict[str, list[list[int]]] = {}
        warm: dict[str, float] = {}
        for name, eng in engines.items():  # untimed: captures every graph this batch will replay
            t = time.perf_counter()
            res = eng.run(prompts, tag=f"warm{b}{name}", timeout=900)
            warm[name] = time.perf_counter() - t
            tok[name] = [r.generated_tokens for r in res]
        same = all(t == tok["plain"] for t in tok.values())
        times: dict[str, list[float]] = {k: [] for k in engines}
        for r in range(rounds):
            names = list(engines)
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
            for name in order:
                torch.cuda.synchronize()
                t = time.perf_counter()
                res = engines[name].run(prompts, tag=f"b{b}r{r}{name}", timeout=900)
                times[name].append(time.perf_counter() - t)
                assert all(x is not None and x.error is None for x in res), (
                    name,
                    [x.error if x else None for x in res][:2],
                )
        med = {k: statistics.median(v) for k, v in times.items()}
        plain_t = times["plain"]
        consecutive = [abs(plain_t[i + 1] - plain_t[i]) / med["plain"] * 100 for i in range(len(plain_t) - 1)]
        out["batches"][str(b)] = {
            "run_s": {k: {"median": med[k], "min": min(v), "max": max(v), "all": v} for k, v in times.items()},
            "decode_tok_s": {k: b * tokens / med[k] for k in med},
            "step_ms": {k: med[k] / tokens * 1e3 for k in med},
            "overhead_pct": (med["tripwire"] / med["plain"] - 1) * 100,
            "overhead_contain_pct": (med["contain"] / med["plain"] - 1) * 100 if "contain" in med else None,
            "noise_spread_pct": (max(plain_t) - min(plain_t)) / med["plain"] * 100,
            "noise_consecutive_pct": statistics.median(consecutive) if consecutive else None,
            "tokens_identical": same,
            "warm_s": warm,
        }
    out["tripwire_counts"] = {f"{d}|{s}": h.count for (d, s), h in mon.snapshot().items()}
    for h in handles:
        h.uninstall()
    for eng in engines.values():
        eng.close()
    mon.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--contain", action="store_true", help="also time install(contain=True)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_transformers: needs a CUDA GPU", file=sys.stderr)
        return 2
    r = run(a.rounds, a.layers, tokens=a.tokens, contain=a.contain)
    for b, f in r["batches"].items():
        print(
            f"batch {b:>3}: plain {f['run_s']['plain']['median']:.3f} s, tripwire {f['run_s']['tripwire']['median']:.3f} s "
            f"per {r['tokens']}-token run; {f['decode_tok_s']['plain']:.0f} vs {f['decode_tok_s']['tripwire']:.0f} tok/s; "
            f"overhead {f['overhead_pct']:+.3f} % (target {TARGET_PCT} %), noise spread {f['noise_spread_pct']:.3f} %, "
            f"consecutive {f['noise_consecutive_pct']:.3f} %; identical tokens: {f['tokens_identical']}"
            + (f"; contain=True {f['overhead_contain_pct']:+.3f} %" if f["overhead_contain_pct"] is not None else "")
        )
    if a.json:
        write_json(a.json, r)
    else:
        print(json.dumps(r, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
