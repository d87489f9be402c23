"""The load tripwire.distributed.coordinate() puts on the job's TCPStore, at 64, 512 and 4096 ranks.

Each coordinated rank sends one ``check([key])`` per ``store_poll`` to the one TCPStore master (plus, once, a
``compare_set`` from the rank that stops and a ``get`` from each peer). This script measures what one master serves:
the round trip of one ``check`` from one client, and the checks per second that ``--clients`` client processes
(each one connection in a tight loop, as many ranks polling at once) get through; then it states the request rate
of 64, 512 and 4096 ranks at a few ``store_poll`` values against that capacity.

    python benchmarks/store_load.py [--clients 1,2,4,8] [--seconds 2] [--json out.json]

It needs no GPU. The capacity depends on the host's cores (the master is one libuv thread; the clients compete
with it for the CPU here, so on a small machine it is a lower bound).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

from torch.distributed import TCPStore

KEY = "tripwire/stop"
RANKS = (64, 512, 4096)
POLLS = (0.05, 0.5, 2.0)


def _client(port: int, seconds: float, ready: mp.Queue, go: mp.Event, q: mp.Queue) -> None:  # type: ignore[valid-type]
    s = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    ready.put(1)
    go.wait()  # every client connected (torch imported) before any clock starts
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        s.check([KEY])
        n += 1
    q.put(n)


def measure(clients: list[int], seconds: float) -> dict:
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    one = TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False)
    rtt = []
    for _ in range(2000):
        t0 = time.perf_counter()
        one.check([KEY])
        rtt.append(time.perf_counter() - t0)
    out: dict = {"rtt_us_median": statistics.median(rtt) * 1e6, "rtt_us_p99": sorted(rtt)[int(0.99 * len(rtt))] * 1e6}
    ctx = mp.get_context("spawn")
    rates = {}
    for k in clients:
        q: mp.Queue = ctx.Queue()
        ready: mp.Queue = ctx.Queue()
        go = ctx.Event()
        procs = [ctx.Process(target=_client, args=(master.port, seconds, ready, go, q)) for _ in range(k)]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=120)
        go.set()
        total = sum(q.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(30)
        rates[k] = total / seconds
    out["checks_per_s"] = rates
    out["capacity_checks_per_s"] = max(rates.values())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = measure([int(c) for c in args.clients.split(",")], args.seconds)
    res["host_cpus"] = os.cpu_count()
    cap = res["capacity_checks_per_s"]
    print(f"one check, one client: median {res['rtt_us_median']:.1f} us, p99 {res['rtt_us_p99']:.1f} us")
    for k, r in res["checks_per_s"].items():
        print(f"{k} client process(es) in a tight loop: {r:,.0f} checks/s")
    print(f"\nload of coordinate() on one master (capacity measured here: {cap:,.0f} checks/s, {os.cpu_count()} CPUs)")
    print("ranks  " + "  ".join(f"store_poll {p:g} s".rjust(26) for p in POLLS))
    table = {}
    for n in RANKS:
        cells = []
        for p in POLLS:
            rate = n / p
            table[f"{n}@{p}"] = rate
            cells.append(f"{rate:9,.0f}/s ({rate / cap * 100:5.1f} %)".rjust(26))
        print(f"{n:5d}  " + "  ".join(cells))
    res["load_checks_per_s"] = table
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
