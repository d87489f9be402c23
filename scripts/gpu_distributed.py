"""Two ranks, NCCL: a fatal hit on rank 0 while rank 1 sits in an all-reduce that rank 0 never joins.

Scenarios (each in two fresh processes spawned here, on their own process group):

* ``abort``:    both ranks ``tripwire.distributed.coordinate(abort=True)``. Rank 1's coordination learns of rank
                0's stop from the store, arms, and aborts its NCCL communicators; its blocked all-reduce returns and
                it raises GuardTripped naming rank 0. Expected: within 3 reader intervals of the hit.
* ``no_abort``: ``coordinate(abort=False)``. Rank 1 arms just as fast, but stays blocked in the collective until
                the process group's timeout (the NCCL watchdog), so the stop cannot reach the engine: the control
                showing that the abort is what unblocks it.
* ``baseline``: no coordination. Rank 0 stops locally; rank 1 is blocked until the process group's timeout.

Rank 0's hit is a real guarded Triton kernel (a gather through an index table with one out-of-range index) on a
site registered ``fatal=True``; its reader confirms it and arms. Rank 1 blocks the way an engine does: the NCCL
all-reduce is enqueued and the host waits in ``torch.cuda.synchronize()``.

Run on 2 GPUs (``nvidia-h200-x2``)::

    python scripts/gpu_distributed.py                 # all three scenarios, < 3 minutes
    python scripts/gpu_distributed.py --backend gloo  # CPU dry run of the plumbing (gloo cannot be aborted)

It prints a table and writes JSON to ``$OUT/gpu_distributed.json`` (``./gpu_distributed.json`` without ``$OUT``).
Every process runs under hard timeouts and is killed if it overstays; the script never waits past ``--budget``.
NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set for every process (NVLink multicast stays off).
"""

from __future__ import annotations

import os
import sys

# Before torch, triton or NCCL is loaded, here and (inherited) in every spawned rank.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
if "gloo" in sys.argv or "--backend=gloo" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the CPU dry run runs the kernel in Triton's interpreter

import argparse
import datetime
import json
import queue
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import triton

from tripwire.testing import gather_rows

SCENARIOS = ("abort", "no_abort", "baseline")
SETUP_LIMIT = 60.0  # seconds for two ranks to import, init CUDA/NCCL and compile the kernel


# ---------------------------------------------------------------------- one rank
def _rank_main(rank: int, cfg: dict[str, Any], results: Any, done: Any) -> None:
    """One rank of one scenario. Puts exactly one result dict on ``results`` (or dies trying)."""
    import torch.distributed as dist

    import tripwire
    from tripwire.distributed import coordinate

    out: dict[str, Any] = {"rank": rank}
    try:
        gpu = cfg["backend"] == "nccl"
        device = torch.device("cuda", rank) if gpu else torch.device("cpu")
        if gpu:
            torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group(
            cfg["backend"],
            store=dist.PrefixStore(cfg["scenario"], store),
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=cfg["pg_timeout"]),
        )
        # The store polled at the reader's interval (the "within 3 intervals" target assumes it; the default poll,
        # TRIPWIRE_STORE_POLL, is slower: its load at thousands of ranks).
        mon = tripwire.configure(mode="warn", interval=cfg["interval"], capacity=64, store_poll=cfg["interval"])
        site = tripwire.register_site("gpu_distributed.gather", description="a gather's index table", fatal=True)
        mon.prealloc(device)
        coord = coordinate(abort=cfg["scenario"] == "abort") if cfg["scenario"] != "baseline" else None
        armed_at: list[float] = []
        mon.add_arm_listener(lambda exc: armed_at.append(time.time()))
        x = torch.ones(1 << 20, device=device)
        if rank == 0:  # compile the kernel with good indices (no hit) before the clock starts
            src = torch.arange(1024, dtype=torch.float32, device=device)
            idx = torch.arange(256, dtype=torch.int64, device=device)
            res = torch.empty(256, dtype=torch.float32, device=device)
            ctr = tripwire.counter(site, device)
            gather_rows(src, idx, res, ctr=ctr)
            if gpu:
                torch.cuda.synchronize()
            assert int(ctr[0]) == 0
        tripwire.start()
        dist.all_reduce(x)  # warm-up: the communicator exists and both ranks are here
        if gpu:
            torch.cuda.synchronize()

        if rank == 1:
            # The engine's step: check, then a collective rank 0 never joins. The host blocks in synchronize.
            tripwire.check()
            out["t_enter"] = time.time()
            try:
                if coord is not None:
                    with coord.guarded():
                        dist.all_reduce(x)
                        if gpu:
                            torch.cuda.synchronize()
                else:
                    dist.all_reduce(x)
                    if gpu:
                        torch.cuda.synchronize()
                out["how"] = "returned"
            except Exception as e:  # guarded(): a GuardTripped chained to the collective's error
                out["how"] = f"raised {type(e).__name__}"
                cause = e.__cause__ if isinstance(e, tripwire.GuardTripped) else e
                if cause is not None:
                    out["collective_error"] = f"{type(cause).__name__}: {str(cause).splitlines()[0][:200]}"
            out["t_return"] = time.time()
            try:
                tripwire.check()  # the next step's check
            except tripwire.GuardTripped as e:
                out.update(t_raise=time.time(), exc_rank=e.rank, exc_site=e.site, exc_message=str(e)[:300])
        else:
            time.sleep(1.0)  # rank 1 is inside the all-reduce by now
            bad = torch.arange(256, dtype=torch.int64, device=device)
            bad[17] = 5000  # one index past the 1024-row table
            out["t_hit"] = time.time()
            gather_rows(src, bad, res, ctr=ctr)
            t_end = time.monotonic() + 5.0
            while time.monotonic() < t_end:
                try:
                    tripwire.check()
                except tripwire.GuardTripped as e:
                    out.update(t_raise=time.time(), exc_rank=e.rank, exc_site=e.site)
                    break
                time.sleep(0.0005)
            # Stay alive (an engine handling its stop) until the parent is done with rank 1.
            done.wait(cfg["pg_timeout"] + 10)
        out["t_armed"] = armed_at[0] if armed_at else None
        if coord is not None:
            coord.abort_done.wait(2.0)
            out.update(
                store_failures=coord.store_failures,
                published_won=coord.publish_won,
                aborted=coord.aborted,
                abort_errors=coord.abort_errors,
            )
    except BaseException as e:
        out["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    results.put(out)
    results.close()
    results.join_thread()
    # An aborted NCCL group must not be torn down again at interpreter exit (it can hang there).
    os._exit(0)


# ---------------------------------------------------------------------- one scenario
def _run_scenario(scenario: str, args: argparse.Namespace, limit: float) -> dict[str, Any]:
    from torch.distributed import TCPStore

    ctx = mp.get_context("spawn")
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = {
        "scenario": scenario,
        "backend": args.backend,
        "port": master.port,
        "interval": args.interval,
        "pg_timeout": args.pg_timeout,
    }
    results = ctx.Queue()
    done = ctx.Event()
    procs = [ctx.Process(target=_rank_main, args=(r, cfg, results, done), daemon=True) for r in range(2)]
    t_start = time.time()
    for p in procs:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    died_at: dict[int, float] = {}
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and not all(i in got or i in died_at for i in range(2)):
        try:
            r = results.get(timeout=0.01)
            got[r["rank"]] = r
            if r["rank"] == 1:
                done.set()  # rank 0 may leave now
        except queue.Empty:
            pass
        for i, p in enumerate(procs):
            if i not in got and i not in died_at and p.exitcode is not None:
                died_at[i] = time.time()  # died without a result (e.g. torn down by the NCCL watchdog)
                if i == 1:
                    done.set()
    done.set()
    timed_out = time.monotonic() >= deadline
    killed = []
    for i, p in enumerate(procs):
        p.join(5.0)
        if p.is_alive():
            killed.append(i)
            p.kill()
            p.join(5.0)
    # Drain a result that arrived during the joins.
    while True:
        try:
            r = results.get_nowait()
            got.setdefault(r["rank"], r)
        except (queue.Empty, OSError, ValueError):
            break
    r0, r1 = got.get(0, {}), got.get(1, {})
    t_hit = r0.get("t_hit")

    def rel(t: float | None) -> float | None:
        return None if t is None or t_hit is None else round(t - t_hit, 4)

    rank1_end = r1.get("t_return", died_at.get(1))
    return {
        "scenario": scenario,
        "hit_to_rank0_raise_s": rel(r0.get("t_raise")),
        "hit_to_rank1_armed_s": rel(r1.get("t_armed")),
        "hit_to_rank1_unblocked_s": rel(rank1_end),
        "hit_to_rank1_raise_s": rel(r1.get("t_raise")),
        "rank1_blocked_s": None if rank1_end is None or "t_enter" not in r1 else round(rank1_end - r1["t_enter"], 4),
        "rank1_how": r1.get("how", "process died" if 1 in died_at else "no result"),
        "rank1_exitcode": procs[1].exitcode,
        "rank1_exc_rank": r1.get("exc_rank"),
        "rank1_exc_site": r1.get("exc_site"),
        "rank1_collective_error": r1.get("collective_error"),
        "rank1_aborted": r1.get("aborted"),
        "rank1_abort_errors": r1.get("abort_errors"),
        "rank0_published_won": r0.get("published_won"),
        "errors": {k: v["error"] for k, v in got.items() if "error" in v},
        "killed_ranks": killed,
        "timed_out": timed_out,
        "wall_s": round(time.time() - t_start, 2),
        "rank0": r0,
        "rank1": r1,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--interval", type=float, default=0.05, help="tripwire reader interval (s)")
    ap.add_argument("--pg-timeout", type=float, default=10.0, help="process-group (watchdog) timeout (s)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--budget", type=float, default=170.0, help="hard limit for the whole script (s)")
    args = ap.parse_args(argv)
    if args.backend == "nccl" and torch.cuda.device_count() < 2:
        print(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()} (use --backend gloo for a CPU dry run)")
        return 2
    t0 = time.monotonic()
    rows = []
    for scenario in args.scenarios.split(","):
        if scenario not in SCENARIOS:
            raise SystemExit(f"unknown scenario {scenario!r}; expected {SCENARIOS}")
        left = args.budget - (time.monotonic() - t0)
        limit = min(left, SETUP_LIMIT + 1.0 + args.pg_timeout + 15.0)
        if limit < 20:
            rows.append({"scenario": scenario, "skipped": "out of time budget"})
            continue
        rows.append(_run_scenario(scenario, args, limit))
        print(f"[{scenario}] done in {rows[-1]['wall_s']} s", flush=True)

    bound = 3 * args.interval
    verdict = {}
    for r in rows:
        s = r["scenario"]
        if "skipped" in r:
            verdict[s] = "SKIPPED"
        elif s == "abort":
            t = r["hit_to_rank1_raise_s"]
            ok = t is not None and t <= bound and r["rank1_exc_rank"] == 0 and not r["killed_ranks"]
            verdict[s] = (
                f"{'PASS' if ok else 'FAIL'}: rank 1 raised GuardTripped(rank={r['rank1_exc_rank']}) {t} s after the hit (bound {bound:.3f} s)"
            )
        else:
            t = r["hit_to_rank1_unblocked_s"]
            verdict[s] = f"rank 1 blocked {t} s after the hit ({r['rank1_how']}, exit code {r['rank1_exitcode']})"

    print()
    print(f"backend {args.backend}, reader interval {args.interval} s, process-group timeout {args.pg_timeout} s")
    print(f"{'scenario':<10} {'r0 raise':>9} {'r1 armed':>9} {'r1 unblock':>11} {'r1 raise':>9}  rank 1")
    for r in rows:
        if "skipped" in r:
            print(f"{r['scenario']:<10} skipped: {r['skipped']}")
            continue

        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:.3f}"

        print(
            f"{r['scenario']:<10} {f(r['hit_to_rank0_raise_s']):>9} {f(r['hit_to_rank1_armed_s']):>9} "
            f"{f(r['hit_to_rank1_unblocked_s']):>11} {f(r['hit_to_rank1_raise_s']):>9}  {r['rank1_how']}"
            + (f"; errors {r['errors']}" if r["errors"] else "")
            + (f"; killed {r['killed_ranks']}" if r["killed_ranks"] else "")
        )
    print("(seconds after rank 0's hit)")
    for s, v in verdict.items():
        print(f"{s}: {v}")

    doc = {
        "backend": args.backend,
        "interval_s": args.interval,
        "bound_s": bound,
        "pg_timeout_s": args.pg_timeout,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.backend == "nccl" else None,
        "env": {
            k: os.environ.get(k)
            for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
        },
        "verdict": verdict,
        "scenarios": rows,
    }
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(".")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_distributed.json"
    path.write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {path}")
    return 0 if all(not v.startswith("FAIL") for v in verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
