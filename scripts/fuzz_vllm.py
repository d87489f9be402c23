"""Fuzz tripwire's vLLM containment on vLLM's CPU engine: random faults, every outcome checked against a clean run.

Each fuzz run is one ``generate`` of four requests with host-side faults (tripwire.testing.vllm_faults) in 1 to
``--victims`` of them, all at one random step (0, the prefill, to 15, the last), each of a random kind (a read:
block-table column 0; a write: the newest token's block, before vLLM computes its slot; a bad slot; a bad position;
a bad block count; on V2 a bad idx_mapping row) and value (exactly the first id past the end; far past it;
negative). Runs are batched into a few engine processes under ``TRIPWIRE_VLLM=contain``, half with the engine core
in-process and half in its own process; one process without faults is the clean reference. ``--gpu`` runs vLLM's
GPU engine (CUDA graphs, torch.compile and async scheduling at vLLM's defaults, unless the settings say otherwise).

Counted (the targets are all 0):

* deaths: a guarded engine process that died (each run it lost counts);
* stops: a round the engine failed instead of a request (each run it lost counts);
* escapes: a victim returned as a success (any finish reason but ``error``), or with tokens other than the clean
  run's before the faulted step; or a returned request whose tokens differ from the clean run's without an error;
* unaffected requests changed: a request the fault did not name that failed or whose tokens changed;
* not injected: a run whose fault never fired (its victim finished first), which would prove nothing.

Usage (the vLLM environment's python from ``TRIPWIRE_VLLM_PYTHON``, default ``/opt/venv-vllm/bin/python``)::

    python scripts/fuzz_vllm.py --runs 200 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tripwire.testing import vllm_proc

# The fault kinds each runner has (tripwire.testing.vllm_faults): idx_mapping is V2's alone.
KINDS = {
    "V1": ("read", "write", "slot", "position", "num_blocks", "nan"),
    "V2": ("read", "write", "slot", "position", "idx", "num_blocks", "nan"),
}
VALUES = ("end", "far", "negative")
TOKENS = 16
# Block ids, request-state rows and block counts are int32 in vLLM; slots and positions int64.
I32_MAX = (1 << 31) - 1


def prompts(run: int) -> list[list[int]]:
    """Four prompts of 10 to 40 tokens; the first three tokens name the run and the request (the fault's marker)."""
    out = []
    for i, n in enumerate((10, 25, 40, 31)):
        head = [500 + i, run % 400 + 1, run // 400 + 1]
        out.append(head + [(13 * run + 5 * i + k) % 400 + 1 for k in range(n - len(head))])
    return out


def draw(rng: random.Random, run: int, kinds: tuple[str, ...], most: int = 1) -> list[dict[str, Any]]:
    """One run's faults: 1 to ``most`` victims (distinct requests), all at one random step, each of a random kind
    and value."""
    step = rng.randrange(TOKENS)
    out = []
    for i in rng.sample(range(4), rng.randint(1, most)):
        kind, vk = rng.choice(kinds), rng.choice(VALUES)
        wide = kind in ("slot", "position")
        if kind == "nan":
            value: int | str = "nan" if vk != "far" else "inf"  # a numeric fault: NaN or Inf in its logits row
        elif vk == "end":
            value = "end"
        elif vk == "far":
            # Far past any cache, table or request-state row here.
            value = rng.randint(1 << 20, (1 << 40) if wide else I32_MAX)
        else:
            value = rng.randint(-I32_MAX - 1, -2)  # -1 is the slot mapping's padding: not a fault
        out.append({"marker": prompts(run)[i][:3], "step": step, "kind": kind, "value": value, "req": i})
    return out


def fuzz(
    runs: int,
    seed: int,
    *,
    processes: int = 4,
    workdir: str | None = None,
    offenders: int = 64,
    runner: str = "V1",
    most: int = 1,
    gpu: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    workers: int = 2,
) -> dict[str, Any]:
    """Run the fuzz (see the module docstring) and return its figures. ``runner``: which fault kinds (and, on a GPU,
    which model runner: ``env`` should set ``VLLM_USE_V2_MODEL_RUNNER`` to match); ``gpu``: the engine's GPU
    settings (tripwire.testing.vllm_run.engine); ``workers``: engine processes at once."""
    rng = random.Random(seed)
    faults = [draw(rng, r, KINDS[runner], most) for r in range(runs)]
    work = Path(workdir or tempfile.mkdtemp(prefix="tripwire-vllm-fuzz-"))
    rounds = [prompts(r) for r in range(runs)]
    chunks = [list(range(runs))[k::processes] for k in range(processes)]
    base: dict[str, Any] = {} if gpu is None else {"gpu": gpu}
    # A process runs up to all the rounds: more than a test run's default limit on a busy machine.
    specs: dict[str, dict[str, Any]] = {
        "clean": {"config": {**base, "rounds": rounds}, "timeout": 1800, "mode": "contain", "env": dict(env or {})}
    }
    for k, chunk in enumerate(chunks):
        specs[f"contain{k}"] = {
            "config": {**base, "rounds": [rounds[r] for r in chunk]},
            "mode": "contain",
            "multiprocess": k % 2 == 1,
            "timeout": 1800,
            "faults": [{x: f[x] for x in ("marker", "step", "kind", "value")} for r in chunk for f in faults[r]],
            # A KV write at a prefill makes every prompt token of that block a distinct bad slot (up to 40 here):
            # past the default 8 offenders a step's rise is not attributed in full and fails the whole step closed,
            # by design. Room for 64 keeps those runs attributable, so they test containment, not the fallback.
            "env": {"TRIPWIRE_OFFENDERS": str(offenders), **(env or {})},
        }
    t0 = time.time()
    pool = vllm_proc.EnginePool(work, specs, workers=workers)
    done = {name: pool.get(name) for name in specs}
    pool.close()
    figures: dict[str, Any] = {
        "runs": runs,
        "runner": runner,
        "gpu": gpu,
        "deaths": 0,
        "escapes": 0,
        "unaffected_changed": 0,
        "not_injected": 0,
        "contained": 0,
        "stops": 0,
    }
    if done["clean"].result is None:
        figures["error"] = f"the clean reference died: {done['clean'].stderr[-2000:]}"
        return figures
    clean = done["clean"].rounds()
    by_kind: dict[str, int] = {}
    for k, chunk in enumerate(chunks):
        run = done[f"contain{k}"]
        if run.result is None:
            figures["deaths"] += len(chunk)
            print(f"contain{k}: the engine died (rc {run.rc}): {run.stderr[-2000:]}", file=sys.stderr)
            continue
        injected = {tuple(e["marker"]) for e in run.injected}
        got_rounds = run.rounds()
        for j, r in enumerate(chunk):
            if j >= len(got_rounds) or isinstance(got_rounds[j], dict):
                # The engine failed this round (it raised: a stop) and ran no more: each lost run counts as one.
                figures["stops"] += len(chunk) - j
                print(f"contain{k}: the engine failed at run {r}: {got_rounds[-1]}", file=sys.stderr)
                break
            fs, out, ref = faults[r], got_rounds[j], clean[r]
            if not all(tuple(f["marker"]) in injected for f in fs):
                figures["not_injected"] += 1
                continue
            victims = {f["req"]: f for f in fs}
            # Request ids count each process's requests, so the comparison is of what each request returned.
            for i, (got, want) in enumerate(zip(out, ref, strict=True)):
                f = victims.get(i)
                if f is not None:
                    if got["finish_reason"] != "error" or got["tokens"] != want["tokens"][: f["step"]]:
                        figures["escapes"] += 1
                        print(f"escape: run {r} fault {f}: {got} (clean {want})", file=sys.stderr)
                    else:
                        figures["contained"] += 1
                        v = f["value"]
                        key = f"{f['kind']}/{v if isinstance(v, str) else ('neg' if v < 0 else 'far')}"
                        by_kind[key] = by_kind.get(key, 0) + 1
                elif (got["tokens"], got["finish_reason"]) != (want["tokens"], want["finish_reason"]):
                    figures["unaffected_changed"] += 1
                    print(f"bystander changed: run {r} request {i} faults {fs}: {got} (clean {want})", file=sys.stderr)
    figures["seconds"] = round(time.time() - t0, 1)
    figures["by_kind"] = dict(sorted(by_kind.items()))
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--processes", type=int, default=4, help="guarded engine processes the runs are split over")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="write the figures here too")
    ap.add_argument("--offenders", type=int, default=64, help="TRIPWIRE_OFFENDERS of the guarded engines")
    ap.add_argument("--runner", choices=sorted(KINDS), default="V1", help="the fault kinds (and the runner, on a GPU)")
    ap.add_argument("--victims", type=int, default=1, help="at most this many victims in one step")
    ap.add_argument(
        "--gpu", default=None, help="run on a GPU with these engine settings (JSON; {} for vLLM's defaults)"
    )
    args = ap.parse_args(argv)
    gpu = None if args.gpu is None else json.loads(args.gpu)
    env = {} if gpu is None else {"VLLM_USE_V2_MODEL_RUNNER": "1" if args.runner == "V2" else "0"}
    figures = fuzz(
        args.runs,
        args.seed,
        processes=args.processes,
        workdir=args.workdir,
        offenders=args.offenders,
        runner=args.runner,
        most=args.victims,
        gpu=gpu,
        env=env,
    )
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    bad = figures["deaths"] + figures["escapes"] + figures["unaffected_changed"] + figures["not_injected"]
    return 0 if bad == 0 and figures["stops"] == 0 and "error" not in figures else 1


if __name__ == "__main__":
    sys.exit(main())
