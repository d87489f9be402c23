"""The CUDA C++ header's cost: the worked example's guarded gather (``examples/cuda_gather``,
``tripwire::guard_index`` with one warp vote per 32 rows) vs its unguarded twin (the same template, ``GUARD =
false``), graph-replayed, with the bandwidth against a device-to-device copy.

Shapes: wide rows (32768 of 65536 rows of 8 KiB, bfloat16 x 4096: the copy dominates) and narrow rows (2M of 4M rows
of 256 B, bfloat16 x 128: one guarded index per 256 bytes moved, the guard's worst case here). Indices are a random
permutation (valid: nothing counts, checked; outputs equal, checked). Timing as in bench_decode_attention
(``_common.paired_replay_ms``). Target: guarded within 1 % of the twin at each shape.

The first run builds the extension with nvcc (cached after).

    python benchmarks/bench_cuda_gather.py --out $OUT/cuda_gather.json [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from lab.common import d2d_copy_ms, env_info, finish, paired_replay_ms
from tripwire import Monitor, SiteRegistry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cuda_gather"
TARGET_PCT = 1.0
PER_GRAPH = 10
SHAPES = {"wide": (65536, 4096, 32768), "narrow": (4 << 20, 128, 2 << 20)}  # (source rows, width, gathered rows)


def _load_example():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(EXAMPLE))
    import cuda_gather

    return cuda_gather


def _shape(ext, ctr, name, n_src, width, n, *, device, repeats, rep_ms, copy_gbs) -> dict:  # type: ignore[no-untyped-def]
    g = torch.Generator(device=device).manual_seed(0)
    src = torch.randn(n_src, width, device=device, generator=g).to(torch.bfloat16)
    idx = torch.randperm(n_src, device=device, generator=g)[:n].to(torch.int32)
    outs = {k: torch.empty(n, width, device=device, dtype=src.dtype) for k in ("guarded", "twin")}
    bodies = {
        "guarded": lambda: ext.gather(src, idx, outs["guarded"], ctr=ctr),
        "twin": lambda: ext.gather(src, idx, outs["twin"], guard=False),
    }
    ms = paired_replay_ms(bodies, per_graph=PER_GRAPH, repeats=repeats, rep_ms=rep_ms)
    if src.is_cuda:
        torch.cuda.synchronize()
    ratios = [(a / b - 1) * 100 for a, b in zip(ms["guarded"], ms["twin"], strict=True)]
    moved = 2 * n * width * src.element_size() + n * idx.element_size()
    gms, ums = statistics.median(ms["guarded"]), statistics.median(ms["twin"])
    r = {
        "source_rows": n_src,
        "row_bytes": width * src.element_size(),
        "gathered_rows": n,
        "ms": {"guarded": gms, "twin": ums},
        "overhead_pct": statistics.median(ratios),
        "overhead_pct_range": [min(ratios), max(ratios)],
        "gbs_guarded": moved / (gms * 1e-3) / 1e9,
        "pct_of_copy_guarded": moved / (gms * 1e-3) / 1e9 / copy_gbs * 100,
        "outputs_equal": bool(torch.equal(outs["guarded"], outs["twin"])),
    }
    print(
        f"  {name}: guarded {gms:.4f} ms, twin {ums:.4f} ms, overhead {r['overhead_pct']:+.2f} %, "
        f"{r['gbs_guarded']:.0f} GB/s = {r['pct_of_copy_guarded']:.1f} % of the copy",
        flush=True,
    )
    return r


def run(quick: bool = False, *, device: str = "cuda", shapes: dict | None = None, ext=None) -> dict:  # type: ignore[no-untyped-def]
    """The measurements as a dict (JSON-ready). ``device``, ``shapes`` and ``ext`` (a stand-in for the extension)
    exist for the harness's CPU test, with its timers replaced; the figures come from the GPU."""
    if device == "cuda" and not torch.cuda.is_available():
        return {"skipped": "needs a CUDA GPU"}
    t0 = time.perf_counter()
    ext = _load_example() if ext is None else ext
    ext.build()
    build_s = time.perf_counter() - t0
    repeats, rep_ms = (3, 50) if quick else (7, 100)
    mon = Monitor(registry=SiteRegistry(capacity=16), capacity=16, mode="warn")
    mon.prealloc(device)
    ctr = mon.counter(mon.registry.register(ext.SITE.name, description=ext.SITE.description), device)
    n_copy = (1 << 30) // (2 if quick else 1)
    copy = [2 * n_copy / (t * 1e-3) / 1e9 for t in d2d_copy_ms(n_copy, repeats, rep_ms)]
    copy_gbs = statistics.median(copy)
    out: dict = {
        "env": env_info(),
        "quick": quick,
        "per_graph": PER_GRAPH,
        "repeats": repeats,
        "build_s": round(build_s, 1),
        "d2d_copy_gbs": {"median": copy_gbs, "min": min(copy), "max": max(copy)},
        "shapes": {},
        "targets": [],
    }
    for name, (n_src, width, n) in (SHAPES if shapes is None else shapes).items():
        r = _shape(ext, ctr, name, n_src, width, n, device=device, repeats=repeats, rep_ms=rep_ms, copy_gbs=copy_gbs)
        out["shapes"][name] = r
        out["targets"].append(
            {
                "name": f"CUDA header gather guard cost ({name} rows, {r['row_bytes']} B)",
                "target": f"within {TARGET_PCT:g} %",
                "value": r["overhead_pct"],
                "pass": r["overhead_pct"] <= TARGET_PCT and r["outputs_equal"],
            }
        )
        if device == "cuda":
            torch.cuda.empty_cache()
    hits = int(mon.read_rows(device)[:, 0].sum())
    out["hits_on_valid_metadata"] = hits
    out["targets"].append(
        {"name": "CUDA header gather: no hits on valid indices", "target": "0 hits", "value": hits, "pass": hits == 0}
    )
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="fewer repeats, a 0.5 GiB copy")
    p.add_argument("--out", type=Path, help="write the result JSON here")
    args = p.parse_args(argv)
    res = run(args.quick)
    return finish(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
