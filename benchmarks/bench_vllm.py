"""tripwire's vLLM plugin on vLLM's CPU engine: what it adds to a decode step, and what one validator call costs.

Two figures:

* ``engine``: the CPU engine's decode step (a tiny random Llama, 2 layers, hidden 128: the test model) at batch 4
  and 8, with the plugin on and off, INTERLEAVED STEP BY STEP in one engine process (``TRIPWIRE_VLLM=mask``, or
  ``--mode``, at start-up builds the validator; before each decode step every method the plugin wraps is set to its
  wrapper, "on", or to vLLM's original, "off", as ``uninstall`` leaves it), in cycles of three steps (on, off,
  off2, then mirrored): a shared machine's drift, which is slower than a step, and the requests' growing lengths
  hit every kind alike. A repeat is one round of ``--steps`` decode steps (``llm_engine.step()``: scheduler, model
  runner, outputs; the prefill step left out); its figure per kind is the median of its steps of that kind. The
  overhead is the median over repeats of on against the mean of off and off2; the noise floor, the median over
  repeats of |off against off2|: the same estimator between two identical kinds. Target: the overhead at most 2 %
  of the step. The same figures from the process's CPU time per step (``time.process_time``, all its threads)
  beside the wall time: on a machine whose cores other jobs share, the wall time also holds the waits for a core,
  which the CPU time leaves out. Beside them, ``hook_us``: the plugin's own per-step work (the clean test or the
  validator call, and the verdict and scheduler's side when a step has any) timed inside the engine in three rounds
  of their own after the interleaved ones (so the timers' cost stays out of those), and its share of the "off"
  step (the wrappers' own few microseconds are outside it). The reader
  thread (a native tick every ``TRIPWIRE_INTERVAL``) runs through every kind.

  On a machine whose cores other jobs share, a whole round can run several times slower than the next, and the
  per-round figures above then carry that noise. So beside them: the QUIET-STEP figures, every step of a kind
  pooled over all repeats and compared at its lower quartile (``--quantile``, 0.25), the steps the machine's other
  work left alone: ``q_overhead_pct`` = on against the mean of off and off2 at that quantile, ``q_noise_floor_pct``
  = |off against off2| at the same quantile. The kinds are interleaved step by step, so each kind's quiet steps
  come from the same moments and the same request lengths.
* ``validator_us``: the validator's CPU path per call (plain torch, no Triton), with the plugin's own rules (slot
  mapping, block table with per-row counts, positions through query_start_loc, seq_lens, request attribution) on
  decode-shaped clean metadata at batch 4 and 8, in this process: the median of ``--calls`` calls.

``python benchmarks/bench_vllm.py [--repeats N] [--steps N] [--json PATH]`` (the vLLM environment's python from
``TRIPWIRE_VLLM_PYTHON``, default ``/opt/venv-vllm/bin/python``) prints a table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tripwire import Monitor, SiteRegistry
from tripwire.testing.vllm_proc import run_engine
from tripwire.validate import Validator

BATCHES = (4, 8)
BLOCK, BLOCKS, WIDTH, MAX_LEN = 32, 1024, 4, 128


def validator_us(batch: int, calls: int) -> float:
    """Median microseconds per call of the plugin's rule set on clean decode metadata (one token per request)."""
    m = Monitor(registry=SiteRegistry(capacity=64), capacity=64)
    v = Validator("vllm", "cpu", policy="mask", monitor=m)
    v.index("slot_mapping", hi=BLOCKS * BLOCK, padding=-1, fatal=True, requests="req", segments="cu")
    v.index("block_table", hi=BLOCKS, safe=0, lengths="block_counts", requests="req")
    v.csr("positions", indptr="query_start_loc", hi=MAX_LEN, safe=0, requests="req")
    v.index("seq_lens", lo=1, hi=MAX_LEN + 1, safe=1, requests="req")
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    args = {
        "slot_mapping": torch.arange(batch, dtype=torch.int64) * BLOCK + 40,
        "req": torch.arange(batch, dtype=torch.int64),
        "cu": qsl,
        "block_table": torch.randint(1, BLOCKS, (batch, WIDTH), dtype=torch.int32),
        "block_counts": torch.full((batch,), 2, dtype=torch.int32),
        "positions": torch.full((batch,), 40, dtype=torch.int64),
        "query_start_loc": qsl,
        "seq_lens": torch.full((batch,), 41, dtype=torch.int32),
    }
    for _ in range(200):
        v(**args)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        v(**args)
        times.append(time.perf_counter_ns() - t0)
    m.stop()
    assert m.snapshot() == {}, "clean metadata counted"
    return statistics.median(times) / 1000


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _paired(on: list[float], off: list[float], off2: list[float]) -> tuple[list[float], list[float]]:
    """Per repeat: on against the mean of its two offs, and |off against off| (the noise floor)."""
    over = [x / ((a + c) / 2) - 1 for x, a, c in zip(on, off, off2, strict=True)]
    noise = [abs(a / c - 1) for a, c in zip(off, off2, strict=True)]
    return over, noise


def _quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=1000, method="inclusive")[max(0, min(998, round(q * 1000) - 1))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quantile", type=float, default=0.25, help="the quiet-step figures' quantile")
    ap.add_argument("--mode", default="mask", choices=["flag", "mask", "contain"], help="TRIPWIRE_VLLM of the run")
    ap.add_argument("--logits", default="1", choices=["0", "1"], help="TRIPWIRE_VLLM_LOGITS: the logits check on/off")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {"validator_us": {str(b): round(validator_us(b, args.calls), 1) for b in BATCHES}}
    work = Path(tempfile.mkdtemp(prefix="tripwire-vllm-bench-"))
    run = run_engine(
        work,
        "bench",
        {"bench": {"batches": list(BATCHES), "steps": args.steps, "repeats": args.repeats}},
        mode=args.mode,
        env={"TRIPWIRE_VLLM_LOGITS": args.logits},
    )
    if run.result is None:
        print(f"the engine run failed (rc {run.rc}): {run.stderr[-3000:]}", file=sys.stderr)
        return 1
    bench = run.result["bench"]
    out["vllm"] = run.result["vllm"]
    out["engine"] = {}
    print(f"vLLM {run.result['vllm']} CPU engine, decode step, plugin mode {bench['mode']}, logits check "
          f"{'on' if args.logits == '1' else 'off'}, {args.repeats} repeats")  # fmt: skip
    print(
        f"{'batch':>5s} {'off ms':>8s} {'on ms':>8s} {'overhead':>9s} {'noise (off/off)':>16s} {'in hooks':>16s}"
        f"   CPU time: {'off ms':>7s} {'on ms':>7s} {'overhead':>9s} {'noise':>7s}"
    )
    for b in BATCHES:
        r = bench[str(b)]
        over, noise = _paired(r["on"], r["off"], r["off2"])
        c = r["cpu"]
        c_over, c_noise = _paired(c["on"], c["off"], c["off2"])
        fig = {
            "off_ms": round(_med(r["off"] + r["off2"]) * 1e3, 3),
            "on_ms": round(_med(r["on"]) * 1e3, 3),
            "overhead_pct": round(_med(over) * 100, 2),
            "noise_floor_pct": round(_med(noise) * 100, 2),
            # The same from the process's CPU time per step (all its threads): what waiting for the cores of a
            # shared machine adds to the wall time is not in it.
            "cpu_off_ms": round(_med(c["off"] + c["off2"]) * 1e3, 3),
            "cpu_on_ms": round(_med(c["on"]) * 1e3, 3),
            "cpu_overhead_pct": round(_med(c_over) * 100, 2),
            "cpu_noise_floor_pct": round(_med(c_noise) * 100, 2),
            # The plugin's own work per step (validator, verdict, scheduler side), timed inside the engine.
            "hook_us": round(_med(r["hook_s_per_step"]) * 1e6, 1),
            "hook_pct": round(_med(r["hook_s_per_step"]) / _med(r["off"] + r["off2"]) * 100, 2),
            "raw": r,
        }
        qs = {k: _quantile(r["steps"][k], args.quantile) for k in ("on", "off", "off2")}
        fig["quantile"] = args.quantile
        fig["q_off_ms"] = round((qs["off"] + qs["off2"]) / 2 * 1e3, 3)
        fig["q_on_ms"] = round(qs["on"] * 1e3, 3)
        fig["q_overhead_pct"] = round((qs["on"] / ((qs["off"] + qs["off2"]) / 2) - 1) * 100, 2)
        fig["q_noise_floor_pct"] = round(abs(qs["off"] / qs["off2"] - 1) * 100, 2)
        fig["steps_per_kind"] = len(r["steps"]["on"])
        out["engine"][str(b)] = fig
        print(
            f"{b:>5d} {fig['off_ms']:>8.3f} {fig['on_ms']:>8.3f} {fig['overhead_pct']:>8.2f}% "
            f"{fig['noise_floor_pct']:>15.2f}% {fig['hook_us']:>8.1f} us {fig['hook_pct']:>4.2f}%"
            f"             {fig['cpu_off_ms']:>7.3f} {fig['cpu_on_ms']:>7.3f} {fig['cpu_overhead_pct']:>8.2f}% "
            f"{fig['cpu_noise_floor_pct']:>6.2f}%"
        )
    print(f"quiet steps (each kind's steps pooled over the repeats, at quantile {args.quantile}):")
    for b in BATCHES:
        f = out["engine"][str(b)]
        print(
            f"{b:>5d} {f['q_off_ms']:>8.3f} {f['q_on_ms']:>8.3f} {f['q_overhead_pct']:>8.2f}% "
            f"{f['q_noise_floor_pct']:>15.2f}%   ({f['steps_per_kind']} steps per kind)"
        )
    print("validator CPU path per call: " + ", ".join(f"batch {b}: {us} us" for b, us in out["validator_us"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
