"""``tripwire demo --engine transformers``: the demo's story inside a real engine, transformers' continuous batching.

A small random-initialised Llama (no download) serves a batch of prompts through ``model.generate_batch``: a clean
run without tripwire (the reference), then with :func:`tripwire.integrations.transformers.install`: a clean run
(identical tokens), a read index corrupted at one step (masked, counted once, the other requests' tokens identical),
a write index corrupted at one step (the FATAL site: the stop arms and the engine fails the batch through its own
error path, the process and the device stay healthy), a clean run after ``reset()`` (identical again), and, installed
with ``contain=True``, a read fault in the step of the last token and a write fault, each failing only the request it
hit, in its step. A summary
table closes the run; the exit status is 0 when every expectation held. CPU by default (the validator runs in the
Triton interpreter); on a GPU the engine runs with CUDA graphs.

The engine and its fault injector are :mod:`tripwire.testing.transformers_engine`'s (shared with the tests and the GPU
scripts).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..testing.transformers_engine import (
    PROMPTS,
    FaultInjector,
    Injection,
    cb_config,
    run,
    tiny_llama,
)

log = logging.getLogger("tripwire.demo")


# "page": a bad page id in the engine's own block table (the allocator's, on the host), from which the step's read and
# write indices are built: every index of that page is then out of range. "block_table": the decode fast path's device
# block table (flash-attn only).
# ---------------------------------------------------------------------------------------------- the demo
@dataclass
class Scenario:
    name: str
    injected: str
    site: str
    count: int
    expected: int
    engine: str
    ok_requests: int
    failed: int
    changed: int
    passed: bool


def _compare(out: dict[str, Any], ref: dict[str, Any]) -> tuple[int, int, int]:
    ok = sum(1 for k in ref if out.get(k) is not None and out[k].error is None)
    failed = sum(1 for k in ref if out.get(k) is None or out[k].error is not None)
    changed = sum(
        1
        for k in ref
        if out.get(k) is not None and out[k].error is None and out[k].generated_tokens != ref[k].generated_tokens
    )
    return ok, failed, changed


def _device_healthy(device: torch.device) -> bool:
    try:
        x = torch.arange(8, device=device) * 2
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return int(x.sum()) == 56
    except Exception:
        return False


def main(argv: list[str] | None = None) -> int:
    from .text import help_text

    parser = argparse.ArgumentParser(prog="tripwire demo --engine transformers", description=help_text(__doc__))
    parser.add_argument("--engine", choices=["transformers"], default="transformers")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="on a GPU, run the engine without CUDA graphs")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per request")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with quiet_engine_logs():
        return _demo(args)


class _EngineLogFilter(logging.Filter):
    """The demo's filter on transformers' continuous-batching logger: a repeated psutil complaint (logged at every
    manager's start) passes once, and the engine's error for a stop the demo provokes on purpose (a GuardTripped out
    of its generation loop) keeps its one line and drops the traceback. Every other record, and every other
    exception's traceback, passes unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "psutil" in msg:
            if msg in self.seen:
                return False
            self.seen.add(msg)
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            from ..errors import GuardTripped

            if isinstance(exc, GuardTripped):
                record.exc_info, record.exc_text = None, None
        return True


@contextmanager
def quiet_engine_logs() -> Iterator[_EngineLogFilter]:
    """For the demo's run only: transformers' continuous-batching logger at ERROR (its INFO/WARNING lines per
    request), through :class:`_EngineLogFilter`; both undone on exit."""
    engine_log = logging.getLogger("ContinuousBatchingLogger")
    level, flt = engine_log.level, _EngineLogFilter()
    engine_log.setLevel(logging.ERROR)
    engine_log.addFilter(flt)
    try:
        yield flt
    finally:
        engine_log.removeFilter(flt)
        engine_log.setLevel(level)


def _demo(args: argparse.Namespace) -> int:
    import tripwire
    from tripwire.integrations import transformers as tw

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    graphs = device.type == "cuda" and not args.no_cuda_graphs
    model = tiny_llama(device, seed=args.seed)
    cb = cb_config(cuda_graphs=graphs)
    prompts = PROMPTS
    print(
        f"tripwire demo --engine transformers: a random-initialised Llama on {device}"
        f"{' with CUDA graphs' if graphs else ''}, {len(prompts)} requests x {args.tokens} new tokens"
    )
    t0 = time.time()
    ref = run(model, prompts, args.tokens, cb)
    print(f"  reference run without tripwire: {len(ref)} requests in {time.time() - t0:.1f} s")

    monitor = tripwire.Monitor(interval=0.005, report_every=1.0)
    handle = tw.install(model, policy="mask", monitor=monitor)
    rows: list[Scenario] = []
    ids = sorted(ref)
    rng = random.Random(args.seed)

    def scenario(
        name: str, inj: Injection | None, site: str, expected: int, *, expect_stop: bool, contained: bool = False
    ) -> None:
        monitor.reset()
        injector = FaultInjector([inj] if inj else [])
        with injector.active():
            out = run(model, prompts, args.tokens, cb)
        snap = monitor.drain()
        count = sum(h.count for (_, s), h in snap.items() if s == site) if site else sum(h.count for h in snap.values())
        ok, failed, changed = _compare(out, ref)
        healthy = _device_healthy(device)
        stopped = failed == len(ref) and all(
            "GuardTripped" in (out[k].error or "") or "MASKED FAULT" in (out[k].error or "") for k in ref
        )
        engine = ("stopped by tripwire" if stopped else "served") + ("" if healthy else ", DEVICE BROKEN")
        if expect_stop:
            passed = healthy and count == expected and stopped
        elif contained:
            # Exactly the victim fails, with containment's error, in the step of the fault (the same-step verdict:
            # the last step's included); every other request is the clean run's.
            assert inj is not None
            victim_ok = failed == 1 and "contained" in (out[inj.request].error or "")
            engine = "served, 1 request failed" if failed == 1 else engine
            passed = healthy and count == expected and victim_ok and changed == 0
        else:
            passed = healthy and count == expected and failed == 0 and changed <= (1 if inj else 0)
        what = f"{inj.kind} of {inj.request} at step {inj.step}" if inj else "-"
        if inj and not injector.injected:
            what, passed = f"{what} (NOT INJECTED)", False
        rows.append(Scenario(name, what, site or "-", count, expected, engine, ok, failed, changed, passed))

    scenario("clean, installed", None, "", 0, expect_stop=False)
    scenario(
        "read fault",
        Injection("read", 3, ids[rng.randrange(len(ids))], "far"),
        tw.SITE_READ_INDEX,
        1,
        expect_stop=False,
    )
    scenario(
        "write fault",
        Injection("write", 2, ids[rng.randrange(len(ids))], "end"),
        tw.SITE_WRITE_INDEX,
        1,
        expect_stop=True,
    )
    scenario("clean after reset", None, "", 0, expect_stop=False)
    handle.uninstall()
    # Containment: a fault fails only the request it hit, in its own step; the batch goes on. A read in the step that
    # produces the last token (the reader alone would be too late for it), and a masked write (its damage is the
    # writer's own token: under containment it fails that request instead of stopping the engine).
    handle = tw.install(model, policy="mask", monitor=monitor, contain=True)
    scenario(
        "contained read",
        Injection("read", args.tokens, ids[rng.randrange(len(ids))], "far", offset=1),
        tw.SITE_READ_INDEX,
        1,
        expect_stop=False,
        contained=True,
    )
    scenario(
        "contained write",
        Injection("write", 5, ids[rng.randrange(len(ids))], "end"),
        tw.SITE_WRITE_INDEX,
        1,
        expect_stop=False,
        contained=True,
    )
    handle.uninstall()
    monitor.stop()

    from .text import format_table

    table = [("scenario", "injected", "site", "count", "engine", "ok", "failed", "changed", "result")]
    for r in rows:
        result = "PASS" if r.passed else f"FAIL (expected count {r.expected})"
        table.append(
            (
                r.name,
                r.injected,
                r.site,
                str(r.count),
                r.engine,
                str(r.ok_requests),
                str(r.failed),
                str(r.changed),
                result,
            )
        )
    lines = format_table(table, right=(3, 5, 6, 7)).splitlines()
    print()
    print(lines[0])
    print("-" * max(map(len, lines)))
    print("\n".join(lines[1:]))
    ok = all(r.passed for r in rows)
    print()
    print(
        "Every fault was masked, counted once at its site, and the engine and device stayed healthy."
        if ok
        else "Some expectation did not hold (see the table)."
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
