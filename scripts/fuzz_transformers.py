#!/usr/bin/env python
"""Fuzz the transformers integration on the real engine: random fault kind, step, request, value and entry per run.

    python scripts/fuzz_transformers.py --runs 200 [--cuda-graphs] [--json PATH] [--seed N]

Each run serves the prompts through one persistent continuous-batching manager (a new one after a run the engine
failed) with exactly one corrupted metadata entry, and checks: the entry was injected; it was counted exactly once at
its site; no request failed with anything but tripwire's stop (a write fault, the FATAL site) and no masked read
failed any request; the requests a read fault did not touch produced the clean run's tokens; the device still works
(no poisoned context). Prints a summary line per failure and a total; exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-share", type=float, default=0.3, help="the share of runs with a write fault")
    p.add_argument("--contain", action="store_true", help="install with contain=True: a read fault fails its request")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    logging.getLogger("tripwire").setLevel(logging.ERROR)

    import tripwire
    from tripwire.demo_transformers import PROMPTS, FaultInjector, Injection, PersistentEngine, cb_config, tiny_llama
    from tripwire.integrations import transformers as tw

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_llama(device)
    ref_eng = PersistentEngine(model, a.tokens, cb_config(cuda_graphs=a.cuda_graphs))
    ref = ref_eng.run(PROMPTS, tag="ref")
    ref_eng.close()
    mon = tripwire.Monitor(interval=0.005, report_every=60.0)
    handle = tw.install(model, monitor=mon, contain=a.contain)
    eng = PersistentEngine(model, a.tokens, cb_config(cuda_graphs=a.cuda_graphs))
    rng = random.Random(a.seed)
    failures: list[str] = []
    tally = {
        "read": 0,
        "write": 0,
        "late_stops": 0,
        "contained": 0,
        "finished_first": 0,
        "deaths": 0,
        "poisoned": 0,
        "uncounted": 0,
        "changed_others": 0,
    }
    t0 = time.time()
    for run in range(a.runs):
        kind = "write" if rng.random() < a.write_share else "read"
        victim = rng.randrange(len(PROMPTS))
        tag = f"f{run}"
        inj = Injection(
            kind,
            rng.randrange(2, a.tokens - 1),
            f"{tag}-{victim}",
            rng.choice(["end", "far", "negative"]),
            rng.randrange(1 << 16),
        )
        mon.reset()
        fi = FaultInjector([inj])
        with fi.active():
            out = eng.run(PROMPTS, tag=tag)
        mon.drain()
        site = tw.SITE_READ_INDEX if kind == "read" else tw.SITE_WRITE_INDEX
        count = sum(h.count for (_, s), h in mon.snapshot().items() if s == site)
        tally[kind] += 1
        problems = []
        if len(fi.injected) != 1:
            problems.append("not injected")
        if count != 1:
            tally["uncounted"] += 1
            problems.append(f"count {count}")
        try:
            x = torch.ones(8, device=device) * 3
            if device == "cuda":
                torch.cuda.synchronize()
            healthy = float(x.sum()) == 24.0
        except Exception as e:  # a poisoned context
            healthy = False
            problems.append(f"device: {type(e).__name__}: {e}")
        if not healthy:
            tally["poisoned"] += 1
        errors = [o.error if o is not None else "missing" for o in out]
        if kind == "read":
            failed = [i for i, e in enumerate(errors) if e]
            if a.contain:
                # Exactly the victim may fail, with containment's error (it may also have finished first).
                if any(i != victim for i in failed) or (failed and "contained" not in str(errors[victim])):
                    tally["deaths"] += 1
                    problems.append(f"containment failed other requests: {failed}")
                elif failed:
                    tally["contained"] += 1
                else:
                    tally["finished_first"] += 1
            elif failed:
                tally["deaths"] += 1
                problems.append(f"a masked read failed requests: {[e for e in errors if e][:1]}")
            changed = [
                i
                for i, (o, r) in enumerate(zip(out, ref, strict=True))
                if i != victim and o is not None and o.generated_tokens != r.generated_tokens
            ]
            if changed:
                tally["changed_others"] += 1
                problems.append(f"requests {changed} changed")
        else:
            # The stop is late by up to about two reader intervals: a fast engine may finish the batch first, and
            # then the next batch is refused. Either way the only failures are the stop's, and it is armed.
            armed = mon.armed
            failed = [e for e in errors if e]
            if armed is None or armed.site != site or not all(site in e for e in failed):
                tally["deaths"] += 1
                problems.append(f"a write fault did not stop cleanly: armed={armed is not None} {failed[:1]}")
            elif not failed:
                tally["late_stops"] += 1
                refused = eng.run(PROMPTS[:1], tag=f"{tag}-refused")
                if not (refused[0] is not None and refused[0].error and site in refused[0].error):
                    problems.append("the stop armed after the batch but did not refuse the next one")
        if problems:
            failures.append(f"run {run} {inj}: {'; '.join(problems)}")
            print(failures[-1], flush=True)
    handle.uninstall()
    eng.close()
    mon.stop()
    summary = {
        "runs": a.runs,
        "device": device,
        "cuda_graphs": a.cuda_graphs,
        "contain": a.contain,
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "seconds": round(time.time() - t0, 1),
        "engine_rebuilds": eng.rebuilds,
        **tally,
        "failures": failures,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}))
    print(
        f"fuzz: {a.runs} runs ({tally['read']} read, {tally['write']} write faults): {len(failures)} failures, "
        f"{tally['deaths']} engine deaths, {tally['poisoned']} poisoned contexts, {tally['uncounted']} miscounted"
    )
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
