"""``tripwire.kernels.slot_mapping`` at engine batch sizes: the guarded launch against its ``guard=False`` twin,
graph-replayed, with an A/A floor.

q1 (``tripwire bench``) measures the kernel at 16 M tokens, where it is bandwidth. An engine calls it once per step
for the step's tokens: a decode batch (256), a prefill chunk (4096), a large chunk (32768). There the kernel is a few
programs' latency, and every instruction between the index loads and the store shows in it.

Inputs: a block table of 256 requests x 512 columns (int32, page 16), positions int64 (vLLM's), rows int32,
``num_kv_blocks`` given (all three sites checked); every entry valid (nothing counts, checked; slots equal, checked).
Timing: ``_common.paired_replay_ms`` (each body captured ``PER_GRAPH`` times in one CUDA graph; interleaved rounds;
the cost is the median of the per-round ratios). Target: within 1 % of the twin at each size.

    python benchmarks/bench_slot_mapping.py --out $OUT/slot_mapping.json [--rounds 21] [--tokens 256,4096]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lab.common import env_info, finish, paired_replay_ms
from tripwire import Monitor, SiteRegistry

TARGET_PCT = 1.0
PER_GRAPH = 50
TOKENS = (256, 4096, 32768)
ROWS, WIDTH, PAGE = 256, 512, 16


def inputs(tokens: int, device: str = "cuda") -> dict[str, torch.Tensor | int]:
    """A valid step of ``tokens`` tokens: each token a random request row and a position inside its table row."""
    g = torch.Generator(device=device).manual_seed(tokens)
    n_blocks = ROWS * WIDTH
    table = torch.randperm(n_blocks, device=device, generator=g).reshape(ROWS, WIDTH).to(torch.int32)
    rows = torch.randint(0, ROWS, (tokens,), device=device, generator=g, dtype=torch.int32)
    positions = torch.randint(0, WIDTH * PAGE, (tokens,), device=device, generator=g, dtype=torch.int64)
    return dict(positions=positions, token_rows=rows, block_table=table, num_kv_blocks=n_blocks)


def bodies(tokens: int, ctr: torch.Tensor) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
    """``guarded``, ``twin`` and ``twin_b`` (the A/A) launches, and a check that they agree and count nothing."""
    from tripwire.kernels.slot_mapping import slot_mapping

    x = inputs(tokens)
    outs = {n: torch.empty(tokens, device="cuda", dtype=torch.int64) for n in ("guarded", "twin", "twin_b")}

    def body(name: str, guard: bool) -> Callable[[], object]:
        return lambda: slot_mapping(
            x["positions"], x["token_rows"], x["block_table"], outs[name], PAGE,  # type: ignore[arg-type]
            num_kv_blocks=x["num_kv_blocks"], guard=guard, ctr=ctr,  # type: ignore[arg-type]
        )  # fmt: skip

    b = {"guarded": body("guarded", True), "twin": body("twin", False), "twin_b": body("twin_b", False)}

    def check() -> None:
        for f in b.values():
            f()
        torch.cuda.synchronize()
        if not (torch.equal(outs["guarded"], outs["twin"]) and torch.equal(outs["twin"], outs["twin_b"])):
            raise AssertionError("guarded and twin slots differ on valid metadata")
        if int(ctr[:, 0].sum()) != 0:
            raise AssertionError(f"valid metadata counted: {ctr[:, 0].tolist()}")

    return b, check


def run(tokens: int, rounds: int, rep_ms: int) -> dict:
    from tripwire.kernels import counters
    from tripwire.kernels.slot_mapping import SITES

    ctr = counters(SITES, "cuda", Monitor(registry=SiteRegistry(capacity=16), capacity=16, mode="off"))
    b, check = bodies(tokens, ctr)
    check()
    ms = paired_replay_ms(b, per_graph=PER_GRAPH, repeats=rounds, rep_ms=rep_ms)
    cost = [100 * (g / t - 1) for g, t in zip(ms["guarded"], ms["twin"], strict=True)]
    aa = [100 * (t2 / t - 1) for t2, t in zip(ms["twin_b"], ms["twin"], strict=True)]
    return {
        "tokens": tokens,
        "guarded_us": statistics.median(ms["guarded"]) * 1e3,
        "twin_us": statistics.median(ms["twin"]) * 1e3,
        "cost_pct": statistics.median(cost),
        "aa_pct": statistics.median(aa),
        "rounds": rounds,
        "pass": statistics.median(cost) <= TARGET_PCT,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_slot_mapping: needs a CUDA GPU", file=sys.stderr)
        return 2
    out: dict = {"env": env_info(), "sizes": {}}
    for t in (int(x) for x in args.tokens.split(",") if x):
        t0 = time.time()
        out["sizes"][str(t)] = r = run(t, args.rounds, args.rep_ms)
        print(
            f"slot_mapping {t:6d} tokens  twin {r['twin_us']:7.2f} us  guarded {r['guarded_us']:7.2f} us  "
            f"cost {r['cost_pct']:+6.2f} %  A/A {r['aa_pct']:+6.2f} %  ({time.time() - t0:.0f} s)",
            flush=True,
        )
    out["targets"] = [
        {"name": f"slot_mapping_{n}.cost_pct", "target": f"<= {TARGET_PCT} %", "value": r["cost_pct"],
         "pass": r["pass"]}
        for n, r in out["sizes"].items()
    ]  # fmt: skip
    return finish(out, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
