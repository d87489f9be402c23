"""Fuzz tripwire's vLLM containment on vLLM's CPU engine: random faults, every outcome checked against a clean run.

Each fuzz run is one ``generate`` of four requests with one host-side fault (tripwire.cli._vllm_faults) of a random kind
(a read: block-table column 0; a write: the newest token's block, before vLLM computes its slot; a bad slot), at a
random step (0, the prefill, to 15, the last), in a random request, with a random value (exactly the first id past
the end; far past it; negative). Runs are batched into a few engine processes under ``TRIPWIRE_VLLM=contain``, half
with the engine core in-process and half in its own process; one process without faults is the clean reference.

Counted (the targets are all 0):

* deaths: a guarded engine process that died, or failed a round instead of a request (each run it lost counts);
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

from tripwire.cli import _vllm_proc

KINDS = ("read", "write", "slot")
VALUES = ("end", "far", "negative")
TOKENS = 16
# Block ids are int32 in vLLM's table; slots are int64.
I32_MAX = (1 << 31) - 1


def prompts(run: int) -> list[list[int]]:
    """Four prompts of 10 to 40 tokens; the first three tokens name the run and the request (the fault's marker)."""
    out = []
    for i, n in enumerate((10, 25, 40, 31)):
        head = [500 + i, run % 400 + 1, run // 400 + 1]
        out.append(head + [(13 * run + 5 * i + k) % 400 + 1 for k in range(n - len(head))])
    return out


def draw(rng: random.Random, run: int) -> dict[str, Any]:
    kind, vk = rng.choice(KINDS), rng.choice(VALUES)
    i = rng.randrange(4)
    if vk == "end":
        value: int | str = "end"
    elif vk == "far":
        # Far past any cache here (it holds about a thousand blocks of 32 slots).
        value = rng.randint(1 << 20, I32_MAX if kind != "slot" else 1 << 40)
    else:
        value = rng.randint(-I32_MAX - 1, -2)  # -1 is the slot mapping's padding: not a fault
    return {"marker": prompts(run)[i][:3], "step": rng.randrange(TOKENS), "kind": kind, "value": value, "req": i}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--processes", type=int, default=4, help="guarded engine processes the runs are split over")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="write the figures here too")
    ap.add_argument("--offenders", type=int, default=64, help="TRIPWIRE_OFFENDERS of the guarded engines")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    faults = [draw(rng, r) for r in range(args.runs)]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tripwire-vllm-fuzz-"))
    rounds = [prompts(r) for r in range(args.runs)]
    chunks = [list(range(args.runs))[k :: args.processes] for k in range(args.processes)]
    # A process runs up to all the rounds: more than a test run's default limit on a busy machine.
    specs: dict[str, dict[str, Any]] = {"clean": {"config": {"rounds": rounds}, "timeout": 1800}}
    for k, runs in enumerate(chunks):
        specs[f"contain{k}"] = {
            "config": {"rounds": [rounds[r] for r in runs]},
            "mode": "contain",
            "multiprocess": k % 2 == 1,
            "timeout": 1800,
            "faults": [{x: f[x] for x in ("marker", "step", "kind", "value")} for f in (faults[r] for r in runs)],
            # A KV write at a prefill makes every prompt token of that block a distinct bad slot (up to 40 here):
            # past the default 8 offenders a step's rise is not attributed in full and fails the whole step closed,
            # by design. Room for 64 keeps those runs attributable, so they test containment, not the fallback.
            "env": {"TRIPWIRE_OFFENDERS": str(args.offenders)},
        }
    t0 = time.time()
    pool = _vllm_proc.EnginePool(work, specs)
    done = {name: pool.get(name) for name in specs}
    pool.close()
    clean = done["clean"].rounds()
    figures = {"runs": args.runs, "deaths": 0, "escapes": 0, "unaffected_changed": 0, "not_injected": 0, "contained": 0}
    by_kind: dict[str, int] = {}
    for k, runs in enumerate(chunks):
        run = done[f"contain{k}"]
        if run.result is None:
            figures["deaths"] += len(runs)
            print(f"contain{k}: the engine died (rc {run.rc}): {run.stderr[-2000:]}", file=sys.stderr)
            continue
        injected = {tuple(e["marker"]) for e in run.injected}
        got_rounds = run.rounds()
        for j, r in enumerate(runs):
            if j >= len(got_rounds) or isinstance(got_rounds[j], dict):
                # The engine failed this round (it raised) and ran no more: each lost run counts as a death.
                figures["deaths"] += len(runs) - j
                print(f"contain{k}: the engine failed at run {r}: {got_rounds[-1]}", file=sys.stderr)
                break
            f, out, ref = faults[r], got_rounds[j], clean[r]
            if tuple(f["marker"]) not in injected:
                figures["not_injected"] += 1
                continue
            # Request ids count each process's requests, so the comparison is of what each request returned.
            for i, (got, want) in enumerate(zip(out, ref, strict=True)):
                if i == f["req"]:
                    if got["finish_reason"] != "error" or got["tokens"] != want["tokens"][: f["step"]]:
                        figures["escapes"] += 1
                        print(f"escape: run {r} fault {f}: {got} (clean {want})", file=sys.stderr)
                    else:
                        figures["contained"] += 1
                        key = f"{f['kind']}/{'end' if f['value'] == 'end' else ('neg' if f['value'] < 0 else 'far')}"
                        by_kind[key] = by_kind.get(key, 0) + 1
                elif (got["tokens"], got["finish_reason"]) != (want["tokens"], want["finish_reason"]):
                    figures["unaffected_changed"] += 1
                    print(f"bystander changed: run {r} request {i} fault {f}: {got} (clean {want})", file=sys.stderr)
    figures["seconds"] = round(time.time() - t0, 1)
    figures["by_kind"] = dict(sorted(by_kind.items()))
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    bad = figures["deaths"] + figures["escapes"] + figures["unaffected_changed"] + figures["not_injected"]
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
