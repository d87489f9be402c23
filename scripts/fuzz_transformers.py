#!/usr/bin/env python
"""Fuzz the transformers integration on the real engine, with containment: an ESCAPE is a failure.

    python scripts/fuzz_transformers.py --runs 250 [--cuda-graphs] [--interval S] [--seed N] [--json PATH]

Each run serves the same prompts through one persistent continuous-batching manager (so a later run serves the same
prompts again on an engine whose cache saw the earlier victims), with 1 to 10 corrupted metadata entries written into
the engine's own prepared step (a read index, a write index, a block-table page; one step, one or several victims; just past the end,
far past, negative), at any step from the prefill to the last token's. It checks:

* every injected entry was counted exactly once at its site;
* ESCAPES (failures): a request a masked access touched handed back as a success, or a request handed back as a
  success whose tokens differ from the clean run;
* engine stops (failures): the stop armed or the generation loop ended, for faults that name their requests;
* deaths (a request missing or failed with anything but containment's error) and poisoned contexts;
* ``shape_only``: untouched requests whose tokens differ from the clean run AND equally in a control serving without
  a fault where the victims are failed at the same step (:func:`dropping`): the batch's shape, not a masked result;
* ``failed_closed``: runs with more than K distinct offenders in one step, where every request of that step fails
  (allowed: fail closed, the engine goes on).

A page fault (``--page-share``) is a bad page id in the request's own block table (the engine's allocator), from which
the engine builds the step's read and write indices: every index of that page is out of range, each counted once. The
decode fast path's device block table is not fuzzed: the engine takes that path only with flash-attn.
Prints one line per failing run and a JSON summary; exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


def _plan(
    rng: random.Random, n_prompts: int, tokens: int, multi_share: float, write_share: float, page_share: float, tag: str
) -> list:
    from tripwire.testing.transformers_engine import Injection

    step = rng.randrange(1, tokens + 1)
    if rng.random() < page_share:
        # One bad page id in one request's block table (from step 2: a request has a table after its prefill).
        victim = rng.randrange(n_prompts)
        kind = rng.choice(["end", "far", "negative"])
        return [Injection("page", max(step, 2), f"{tag}-{victim}", kind, rng.randrange(4))]
    n = rng.randrange(2, 11) if rng.random() < multi_share else 1
    victims = rng.sample(range(n_prompts), min(n, n_prompts))
    kinds = ["write" if rng.random() < write_share else "read" for _ in range(n)]
    out, used = [], set()
    for i in range(n):
        victim = victims[i % len(victims)]
        # A distinct offset per entry of a request: two injections never land on one entry (counted once).
        offset = rng.randrange(1 << 16)
        while (victim, kinds[i], offset) in used:
            offset += 1
        used.add((victim, kinds[i], offset))
        out.append(Injection(kinds[i], step, f"{tag}-{victim}", rng.choice(["end", "far", "negative"]), offset))
    return out


@contextmanager
def dropping(request_ids: list[str], after_step: int) -> Iterator[None]:
    """The control for an untouched request whose tokens changed: the same serving with NO fault, the victims failed
    through the engine's error path right after step ``after_step`` (where containment failed them). Failing a
    request changes the batch's shape for the steps after, and on a GPU a batch of another shape may take other
    kernels (other rounding), which can flip a near-tie greedy token of the tiny random model: a change the control
    shows too is the batch's shape, not a masked result."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

    original = ContinuousBatchProcessor.__dict__["prepare_next_batch"]
    prepared = [0]

    def prepare_next_batch(processor: Any, *args: Any, **kwargs: Any) -> Any:
        if prepared[0] == after_step:
            for rid in request_ids:
                state = processor.scheduler.active_requests.get(rid)
                if state is not None:
                    processor._handle_request_error(RuntimeError("fuzz control: dropped"), state)
                    processor.scheduler.finish_request(rid)
        ready = original(processor, *args, **kwargs)
        prepared[0] += bool(ready)
        return ready

    ContinuousBatchProcessor.prepare_next_batch = prepare_next_batch  # type: ignore[method-assign]
    try:
        yield
    finally:
        ContinuousBatchProcessor.prepare_next_batch = original  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=250)
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interval", type=float, default=None, help="the reader's interval (default: TRIPWIRE_INTERVAL's)")
    p.add_argument("--write-share", type=float, default=0.35, help="the share of bad entries that are writes")
    p.add_argument("--multi-share", type=float, default=0.3, help="the share of runs with 2 to 10 bad entries")
    p.add_argument("--page-share", type=float, default=0.2, help="the share of runs with one bad block-table page")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    logging.getLogger("tripwire").setLevel(logging.ERROR)

    import tripwire
    from tripwire.integrations import transformers as tw
    from tripwire.testing.transformers_engine import PROMPTS, FaultInjector, PersistentEngine, cb_config, tiny_llama

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_llama(device)
    ref_eng = PersistentEngine(model, a.tokens, cb_config(cuda_graphs=a.cuda_graphs))
    ref = ref_eng.run(PROMPTS, tag="ref")
    ref_eng.close()
    mon = tripwire.Monitor(interval=a.interval, report_every=60.0, mode="raise", contain=True)
    handle = tw.install(model, monitor=mon, contain=True)
    eng = PersistentEngine(model, a.tokens, cb_config(cuda_graphs=a.cuda_graphs))
    k = mon.settings.offenders
    rng = random.Random(a.seed)
    failures: list[str] = []
    tally = dict.fromkeys(
        (
            "entries",
            "read",
            "write",
            "multi",
            "page",
            "victims",
            "contained",
            "escapes",
            "stops",
            "deaths",
            "poisoned",
            "miscounted",
            "changed_others",
            "failed_closed",
            "shape_only",
            "steps_first",
            "steps_last",
        ),
        0,
    )
    t0 = time.time()
    for run in range(a.runs):
        tag = f"f{run}"
        plan = _plan(rng, len(PROMPTS), a.tokens, a.multi_share, a.write_share, a.page_share, tag)
        tally["multi"] += len(plan) > 1
        tally["page"] += plan[0].kind == "page"
        tally["steps_first"] += plan[0].step == 1
        tally["steps_last"] += plan[0].step == a.tokens
        mon.reset()
        rebuilds = eng.rebuilds
        fi = FaultInjector(plan)
        with fi.active():
            out = eng.run(PROMPTS, tag=tag)
        mon.drain()
        problems: list[str] = []
        if len(fi.injected) != len(plan):
            problems.append(f"injected {len(fi.injected)} of {len(plan)}")
        snap = mon.snapshot()
        for kind, site in (("read", tw.SITE_READ_INDEX), ("write", tw.SITE_WRITE_INDEX)):
            # Distinct entries: two injections may land on one entry (a request's span is short), counted once.
            want = len({i.position for i in fi.injected if i.injection.kind == kind})
            want += sum(i.entries.get(kind, 0) for i in fi.injected if i.injection.kind == "page")
            tally[kind] += want
            got = sum(h.count for (_, s), h in snap.items() if s == site)
            if got != want:
                tally["miscounted"] += 1
                problems.append(f"{site}: counted {got}, injected {want}")
        tally["entries"] += len(fi.injected)
        try:
            x = torch.ones(8, device=device) * 3
            if device == "cuda":
                torch.cuda.synchronize()
            healthy = float(x.sum()) == 24.0
        except Exception as e:  # a poisoned context
            healthy = False
            problems.append(f"device: {type(e).__name__}: {e}")
        tally["poisoned"] += not healthy
        if mon.armed is not None or eng.rebuilds != rebuilds:
            tally["stops"] += 1
            problems.append(f"engine stopped: {mon.armed}")
        victims = {int(i.injection.request.rsplit("-", 1)[1]) for i in fi.injected}
        tally["victims"] += len(victims)
        # More than K distinct offenders at one site in the step: the step fails whole (fail closed).
        per_site = [
            len({(i.position, i.injection.request) for i in fi.injected if i.injection.kind == kd})
            + sum(i.entries.get(kd, 0) for i in fi.injected if i.injection.kind == "page")
            for kd in ("read", "write")
        ]
        closed = max(per_site) > k
        tally["failed_closed"] += closed
        changed: list[int] = []
        for i, (o, r) in enumerate(zip(out, ref, strict=True)):
            if o is None:
                tally["deaths"] += 1
                problems.append(f"request {i} missing")
                continue
            contained_error = o.error is not None and "tripwire contained a masked fault" in o.error
            if o.error is not None and not contained_error:
                tally["deaths"] += 1
                problems.append(f"request {i} failed otherwise: {o.error[:120]}")
            elif i in victims:
                if o.error is None:
                    tally["escapes"] += 1
                    problems.append(f"ESCAPE: victim {i} handed back as a success")
                else:
                    tally["contained"] += 1
            elif o.error is None and o.generated_tokens != r.generated_tokens:
                changed.append(i)
            elif o.error is not None and not closed:
                tally["deaths"] += 1
                problems.append(f"untouched request {i} failed: {o.error[:120]}")
        if changed:
            # Untouched requests differ from the clean run: serve again without a fault, the victims failed after the
            # fault's step, and compare (see dropping()).
            step = fi.injected[0].step if fi.injected else plan[0].step
            with dropping([f"c{tag}-{v}" for v in victims], step):
                control = eng.run(PROMPTS, tag=f"c{tag}")
            for i in changed:
                if control[i] is not None and control[i].generated_tokens == out[i].generated_tokens:
                    tally["shape_only"] += 1
                else:
                    tally["escapes"] += 1
                    tally["changed_others"] += 1
                    problems.append(f"ESCAPE: request {i}, untouched, changed (the shape control differs too)")
        if problems:
            failures.append(f"run {run} {plan}: {'; '.join(problems)}")
            print(failures[-1], flush=True)
    handle.uninstall()
    eng.close()
    mon.stop()
    summary = {
        "runs": a.runs,
        "device": device,
        "cuda_graphs": a.cuda_graphs,
        "interval": mon.settings.interval,
        "seed": a.seed,
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "seconds": round(time.time() - t0, 1),
        "verdicts": handle.verdicts,
        "verdicts_dirty": handle.verdicts_dirty,
        **tally,
        "failures": len(failures),
        "failure_lines": failures[:20],
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "failure_lines"}))
    print(
        f"fuzz: {a.runs} runs, {tally['entries']} bad entries ({tally['read']} read, {tally['write']} write), "
        f"{tally['victims']} victims: {len(failures)} failures, {tally['escapes']} escapes, {tally['stops']} engine "
        f"stops, {tally['deaths']} deaths, {tally['poisoned']} poisoned, {tally['miscounted']} miscounted"
    )
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
