"""``tripwire demo --engine vllm``: one bad metadata entry inside vLLM's own engine, without and with tripwire.

vLLM's CPU build serves a tiny random-initialised Llama (2 layers, hidden 128; no download) four requests of 16 new
tokens, greedy, each run in a process of its own with the vLLM environment's python (``TRIPWIRE_VLLM_PYTHON``,
default ``/opt/venv-vllm/bin/python``; tripwire.testing.vllm_proc). The faults are host-side bugs written into the
engine's own block table or slot mapping for one step (tripwire.testing.vllm_faults):

1. the reference: ``TRIPWIRE_VLLM`` unset (the plugin is installed and inert);
2. without tripwire, a bad block id in a request's block table (a read): the engine process dies (a segfault);
3. without tripwire, a bad slot id: a request's tokens silently change, reported as a success;
4. ``TRIPWIRE_VLLM=contain``, a read, a write and a bad slot in three requests at three steps (the last included):
   the engine serves on, each victim ends with vLLM's error finish reason, the fourth request is token-identical;
5. the same with the engine core in its own process (vLLM's default), unless ``--quick``.

A table closes the run; the exit status is 0 when every expectation held.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..testing import vllm_proc

PROMPTS = [[460 + i] + [(5 * i + k) % 400 + 1 for k in range(n - 1)] for i, n in enumerate((10, 25, 40, 31))]
READ = {"marker": 461, "step": 7, "kind": "read", "value": 10_000_000}
# A negative slot other than the padding -1: the unguarded CPU cache write skips it, so the request's K/V for that
# token never lands and its later tokens change, reported as a success.
SLOT = {"marker": 461, "step": 6, "kind": "slot", "value": -7}
CONTAINED = [READ, {"marker": 460, "step": 15, "kind": "write", "value": "end"}, {**SLOT, "marker": 462}]


def _describe(f: dict[str, Any]) -> str:
    return f"{f['kind']} {f['value']} @ req {f['marker'] - 460} step {f['step']}"


def main(argv: list[str] | None = None) -> int:
    from .text import help_text

    parser = argparse.ArgumentParser(prog="tripwire demo --engine vllm", description=help_text(__doc__))
    parser.add_argument("--engine", choices=["vllm"], default="vllm")
    parser.add_argument("--quick", action="store_true", help="skip the multiprocess engine-core run")
    parser.add_argument("--workdir", default=None, help="where the model and the runs' logs go (default: a temp dir)")
    args = parser.parse_args(argv)
    try:
        py = vllm_proc.vllm_python()
    except vllm_proc.NoVllm as e:
        print(f"tripwire demo --engine vllm: {e}", file=sys.stderr)
        return 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tripwire-vllm-demo-"))
    cfg = {"rounds": [PROMPTS]}
    specs: dict[str, dict[str, Any]] = {
        "reference": {"config": cfg},
        "unguarded read": {"config": cfg, "faults": [READ]},
        "unguarded slot": {"config": cfg, "faults": [SLOT]},
        "contain": {"config": cfg, "mode": "contain", "faults": CONTAINED},
    }
    if not args.quick:
        specs["contain, engine core process"] = {**specs["contain"], "multiprocess": True}
    print(
        f"tripwire demo --engine vllm: vLLM's CPU engine ({py}), a random tiny Llama, 4 requests x 16 tokens, "
        f"{len(specs)} engine processes (work dir {work})"
    )
    t0 = time.time()
    pool = vllm_proc.EnginePool(work, specs)
    runs = {name: pool.get(name) for name in specs}
    pool.close()
    print(f"  ran in {time.time() - t0:.0f} s")
    ref_run = runs["reference"]
    if ref_run.result is None:
        print(f"the reference run failed (rc {ref_run.rc}):\n{ref_run.stderr[-3000:]}", file=sys.stderr)
        return 1
    ref = {r["marker"]: r for r in ref_run.rounds()[0]}
    rows = []

    def row(name: str, faults: list[dict[str, Any]], expect: str) -> None:
        run = runs[name]
        if run.result is None:
            engine, errors, changed = f"DIED (rc {run.rc})", "-", "-"
            passed = expect == "dies" and bool(run.injected)
        else:
            out = {r["marker"]: r for r in run.rounds()[0]}
            victims = {f["marker"] for f in faults}
            err = sorted(m - 460 for m, r in out.items() if r["finish_reason"] == "error")
            chg = sorted(m - 460 for m, r in out.items() if r["finish_reason"] != "error" and r != ref[m])
            engine, errors, changed = "served", ",".join(map(str, err)) or "-", ",".join(map(str, chg)) or "-"
            if expect == "clean":
                passed = not err and not chg
            elif expect == "corrupts":
                passed = not err and bool(chg)
            else:  # contained: exactly the victims failed, nobody else changed
                passed = set(err) == {m - 460 for m in victims} and not chg
        sites = sorted({e["site"] for e in run.events if e["kind"] == "guard"})
        what = "; ".join(_describe(f) for f in faults) or "-"
        rows.append((name, what, engine, errors, changed, ",".join(sites) or "-", passed))

    row("reference", [], "clean")
    row("unguarded read", [READ], "dies")
    row("unguarded slot", [SLOT], "corrupts")
    for name in specs:
        if name.startswith("contain"):
            row(name, CONTAINED, "contained")
    head = f"{'run':30s} {'faults':72s} {'engine':14s} {'error':6s} {'changed':8s} {'sites':36s} result"
    print()
    print(head)
    print("-" * len(head))
    for name, what, engine, errors, changed, sites, passed in rows:
        print(f"{name:30s} {what:72s} {engine:14s} {errors:6s} {changed:8s} {sites:36s} {'PASS' if passed else 'FAIL'}")
    ok = all(r[-1] for r in rows)
    print()
    print(
        "Without tripwire one bad entry killed the engine or silently changed a request; with TRIPWIRE_VLLM=contain "
        "each victim ended with vLLM's error finish reason and every other request was token-identical."
        if ok
        else "Some expectation did not hold (see the table; the runs' logs are in the work dir)."
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
