#!/usr/bin/env python
"""compute-sanitizer memcheck over every guarded reference kernel on corrupted metadata, with its unguarded twin as
the control.

    python scripts/memcheck.py                 # drives the sanitizer runs itself; prints a table
    python scripts/memcheck.py --child rope --guard 1   # one run (what the driver launches under the sanitizer)

Each kernel runs in its own process under ``compute-sanitizer --tool memcheck`` with
``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` (without it, an out-of-range access that lands inside one of the caching
allocator's larger slabs is invisible to the checker). The metadata holds ids equal to the size, negative ids, ids far
past the end and the INT32 extremes, so the unguarded twin leaves its allocation for sure.

Pass: every guarded run reports 0 errors, counts exactly the bad entries and keeps their offenders with the
requests of the request map it is given (so the fault path's reads of the map are checked too); every twin run
reports errors (the control: the same input is really out of range). Exit status 1 otherwise; 3 when every guarded
run passed but an adopted kernel's control (vLLM's original, from an installed vLLM) could not run.

``cuda_gather`` is the CUDA C++ header's worked example (examples/cuda_gather): the driver builds it once, before
the sanitizer runs, so its children load the cached build instead of running nvcc under the checker.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

KERNELS = (
    "block_table",
    "slot_mapping",
    "kv_zero",
    "paged_gather",
    "state_copy",
    "rope",
    "decode_attention",
    "cuda_gather",
)
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "cuda_gather")
# The metadata validator in front of kernels it cannot edit: torch's index_select / index_copy_ and an unguarded
# gather (paged_gather's twin). "--guard 1" validates (mask) first, "--guard 0" is the consumer on the raw metadata.
VALIDATED = ("validate.index_select", "validate.index_copy", "validate.gather")
# vLLM's own kernels (benchmarks/adopted_vllm): "--guard 1" runs the copy guarded from the docs, "--guard 0" vLLM's,
# from the vLLM installed where this runs (on the device: the GPU bundle on PYTHONPATH, ../shared/vllm-gpu). Without
# vLLM the control is not run, said so, and the run ends INCOMPLETE (exit 3), never PASS.
ADOPTED = ("adopted.decode_gqa", "adopted.decode_mha", "adopted.reshape_triton", "adopted.reshape_cuda")
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FAR = 1 << 24


def _validated_child(consumer: str, validate: bool, dev: str = "cuda") -> int:
    import torch

    import tripwire
    from tripwire.validate import Validator

    mon = tripwire.Monitor(registry=tripwire.SiteRegistry(capacity=64), capacity=64, mode="warn")
    N = 64
    bad = [N, -1, N + FAR, INT32_MAX, INT32_MIN]
    idx = torch.tensor([0, *bad, 5, 7], dtype=torch.int64 if consumer != "validate.gather" else torch.int32, device=dev)
    v = Validator("memcheck", dev, monitor=mon)
    v.index("idx", hi=N, safe=0)
    if validate:
        v(idx=idx)
    if consumer == "validate.index_select":
        src = torch.randn(N, 8, 64, device=dev)
        torch.index_select(src, 0, idx)
    elif consumer == "validate.index_copy":
        dst = torch.zeros(N, 8, 64, device=dev)
        dst.index_copy_(0, idx, torch.ones(idx.shape[0], 8, 64, device=dev))
    else:
        from tripwire.kernels import counters
        from tripwire.kernels import paged_gather as pg

        cache = torch.ones(N, 2, 16, 8, 64, dtype=torch.bfloat16, device=dev)
        out = torch.empty(1, idx.shape[0], 2, 16, 8, 64, dtype=torch.bfloat16, device=dev)
        pg.paged_gather(cache, idx.reshape(1, -1), out, guard=False, ctr=counters(pg.SITES, dev, mon))
    if dev != "cpu":
        torch.cuda.synchronize()
    got = [mon.snapshot().get((str(v.device), "memcheck.idx")).count if validate else 0]
    expect = [len(bad)] if validate else [0]
    print(f"COUNTS {consumer} guard={int(validate)} got={got} expect={expect}")
    if got != expect:
        print(f"MISCOUNT: {consumer} counted {got}, expected {expect}", file=sys.stderr)
        return 3
    return 0


def _adopted_child(case: str, guard: bool, dev: str = "cuda") -> int:
    import torch

    import tripwire
    from tripwire.kernels import counters

    sys.path.insert(0, BENCH)
    from adopted_vllm import load

    tripwire.prealloc(dev)
    req = torch.arange(100, 164, dtype=torch.int64, device=dev) if guard else None
    if case.startswith("adopted.decode"):
        mod = load("guarded" if guard else "original", "triton_decode_attention")
        B, Hq, Hkv, D, PS, W, S = 8, 32, 8 if case.endswith("gqa") else 32, 128, 16, 16, 8
        N = B * W
        q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
        kb, vb = (torch.randn(N, PS, Hkv, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        table = torch.arange(N, dtype=torch.int32, device=dev).reshape(B, W)
        lens = torch.full((B,), 200, dtype=torch.int32, device=dev)  # 25 tokens per split: pages straddle splits
        for b, col, v in ((1, 3, N + 5), (2, 1, -9), (5, 12, INT32_MAX), (6, 0, INT32_MIN)):  # used columns (< 13)
            table[b, col] = v
        lens[B - 1] = 100_000  # past the table's width: the original reads past the table
        o, lse = torch.empty_like(q), torch.empty(B, Hq, device=dev)
        logits = torch.empty(B, Hq, S, D + 1, device=dev)
        kw = dict(ctr=counters(mod.SITES, dev), requests=req[:B]) if guard else {}
        mod.decode_attention_fwd(q, kb, vb, o, lse, table, lens, logits, S, D**-0.5, PS, **kw)
        ctr, expect = kw.get("ctr"), [4, 1]
    else:
        T, H, D, PS, NB = 64, 8, 128, 16, 8
        k, v = (torch.randn(T, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        kc, vc = (torch.zeros(NB, PS, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        slots = torch.randperm(NB * PS, device=dev)[:T]
        slots[3], slots[10], slots[20], slots[40] = -1, NB * PS + 3, -7, FAR  # padding, then three bad slots
        one = torch.ones(1, device=dev)
        if case.endswith("cuda"):
            from adopted_vllm import cuda_ext

            ctr = tripwire.counter(cuda_ext.SITE, dev) if guard else None
            # The guarded copy at both of its test placements (the launch picks one by the grid: 64 tokens are
            # one wave), each counting the three bad slots.
            for g in ("first", "late") if guard else (False,):
                cuda_ext.reshape_and_cache_flash(k, v, kc, vc, slots, one, one, guard=g, ctr=ctr, requests=req)
            expect = [6]
        else:
            mod = load("guarded" if guard else "original", "triton_reshape_and_cache_flash")
            ctr = tripwire.counter(mod.SITE_SLOT, dev) if guard else None
            kw = dict(ctr=ctr, requests=req) if guard else {}
            mod.triton_reshape_and_cache_flash(k, v, kc, vc, slots, "auto", one, one, **kw)
            expect = [3]
    if dev != "cpu":
        torch.cuda.synchronize()
    got = ctr.reshape(-1, 8)[:, 0].tolist() if ctr is not None else [0] * len(expect)
    print(f"COUNTS {case} guard={int(guard)} got={got} expect={expect if guard else [0] * len(expect)}")
    if guard and got != expect:
        print(f"MISCOUNT: {case} counted {got}, expected {expect}", file=sys.stderr)
        return 3
    if guard:
        offenders = [o for h in tripwire.snapshot().values() for o in h.offenders]
        if not offenders or any(o.request is None for o in offenders):
            print(f"OFFENDERS: {case} kept {offenders}, each with a request expected", file=sys.stderr)
            return 4
    return 0


def _child(kernel: str, guard: bool, dev: str = "cuda") -> int:
    if kernel in VALIDATED:
        return _validated_child(kernel, guard, dev)
    if kernel in ADOPTED:
        return _adopted_child(kernel, guard, dev)
    import torch

    import tripwire
    from tripwire.kernels import counters

    i32 = torch.int32
    mon = tripwire.Monitor(registry=tripwire.SiteRegistry(capacity=64), capacity=64, mode="warn")
    mon.prealloc(dev)

    def t(v, dtype=i32):
        return torch.tensor(v, dtype=dtype, device=dev)

    def req(n):
        # A request map on the guarded run, so the sanitizer also sees the fault path read it (in bounds).
        return torch.arange(100, 100 + n, dtype=torch.int64, device=dev) if guard else None

    if kernel == "block_table":
        from tripwire.kernels import block_table as m

        R, W = 64, 16
        table = torch.arange(R * W, dtype=i32, device=dev).reshape(R, W)
        counts = torch.full((R,), W, dtype=i32, device=dev)
        rows = t([0, R, -1, R + FAR, INT32_MAX, INT32_MIN, 3])
        out = torch.empty(rows.shape[0], W, dtype=i32, device=dev)
        ctr = counters(m.SITES, dev, mon)
        m.block_table_gather(table, rows, counts, out, guard=guard, ctr=ctr, requests=req(rows.shape[0]))
        expect = [5, 0]
    elif kernel == "slot_mapping":
        from tripwire.kernels import slot_mapping as m

        R, W, bs = 64, 16, 16
        table = torch.arange(R * W, dtype=i32, device=dev).reshape(R, W)
        pos = t([0, 5, -1, W * bs, FAR * bs, INT32_MAX, INT32_MIN, 7, 9, 3])
        rows = t([0, 1, 2, 3, 4, 5, 6, R, -1, INT32_MAX])
        slots = torch.empty(pos.shape[0], dtype=torch.int64, device=dev)
        ctr = counters(m.SITES, dev, mon)
        m.slot_mapping(pos, rows, table, slots, bs, num_kv_blocks=R * W, guard=guard, ctr=ctr, requests=req(10))
        expect = [3, 5, 0]
    elif kernel == "kv_zero":
        from tripwire.kernels import kv_zero as m

        N = 64
        pool = torch.ones(N, 2, 16, 8, 64, dtype=torch.bfloat16, device=dev)
        ids = t([0, N, -1, N + FAR, INT32_MAX, INT32_MIN, 5])
        ctr = counters(m.SITES, dev, mon)
        m.kv_zero(pool, ids, guard=guard, ctr=ctr, requests=req(ids.shape[0]))
        expect = [5]
    elif kernel == "paged_gather":
        from tripwire.kernels import paged_gather as m

        N = 64
        cache = torch.ones(N, 2, 16, 8, 64, dtype=torch.bfloat16, device=dev)
        table = t([[0, N, -1, 3], [N + FAR, INT32_MAX, INT32_MIN, 1]])
        out = torch.empty(2, 4, 2, 16, 8, 64, dtype=torch.bfloat16, device=dev)
        ctr = counters(m.SITES, dev, mon)
        m.paged_gather(cache, table, out, guard=guard, ctr=ctr, requests=req(2))
        expect = [5]
    elif kernel == "state_copy":
        from tripwire.kernels import state_copy as m

        R, S = 16, 32
        state = torch.randn(S, 4096, device=dev)
        table = torch.arange(R * 2, dtype=i32, device=dev).reshape(R, 2)
        table[5, 1] = S + FAR
        table[6, 0] = -1
        rows = t([0, R, -1, INT32_MAX, 1, 2, 5, 6, 7])
        src = t([0, 0, 0, 0, INT32_MIN, 0, 0, 0, 0])
        dst = t([1, 1, 1, 1, 1, -1, 1, 1, 1])
        ctr = counters(m.SITES, dev, mon)
        m.state_copy(state, table, rows, src, dst, guard=guard, ctr=ctr, requests=req(rows.shape[0]))
        expect = [3, 2, 2]
    elif kernel == "rope":
        from tripwire.kernels import rope as m

        T, max_pos = 8, 64
        pos = t([0, max_pos, -1, max_pos + FAR, INT32_MAX, INT32_MIN, 5, 6], torch.int64)
        q = torch.randn(T, 8, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(T, 2, 128, device=dev, dtype=torch.bfloat16)
        cs = torch.randn(max_pos, 128, device=dev)
        ctr = counters(m.SITES, dev, mon)
        m.rope(pos, q, k, cs, torch.empty_like(q), torch.empty_like(k), guard=guard, ctr=ctr, requests=req(T))
        expect = [5]
    elif kernel == "decode_attention":
        from tripwire.kernels import decode_attention as m

        B, Hq, Hkv, D, BS, W, N = 8, 8, 2, 128, 16, 8, 64
        q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
        kc = torch.randn(N, BS, Hkv, D, device=dev, dtype=torch.bfloat16)
        vc = torch.randn(N, BS, Hkv, D, device=dev, dtype=torch.bfloat16)
        table = (torch.arange(B * W, dtype=i32, device=dev) % N).reshape(B, W)
        lens = torch.full((B,), W * BS, dtype=i32, device=dev)
        bad = {(0, 1): N, (1, 0): -1, (2, 3): N + FAR, (3, 7): INT32_MAX, (4, 2): INT32_MIN}
        for (b, col), page in bad.items():
            table[b, col] = page
        lens[5] = W * BS + 1  # a bad length: the guard masks sequence 5 (its pages are fine)
        ws = m.alloc_workspace(q, table, BS, Hkv, num_splits=2)
        ctr = counters(m.SITES, dev, mon)
        out = torch.empty_like(q)
        m.decode_attention(q, kc, vc, table, lens, out, workspace=ws, guard=guard, ctr=ctr, requests=req(B))
        expect = [5, 1]
    elif kernel == "cuda_gather":
        if dev == "cpu":
            print("cuda_gather is a CUDA extension: it has no CPU run", file=sys.stderr)
            return 2
        sys.path.insert(0, EXAMPLE)
        import cuda_gather as m

        src = torch.randn(1024, 256, device=dev, dtype=torch.bfloat16)
        idx = torch.randint(0, 1024, (512,), dtype=i32, device=dev)
        # several bad lanes in the first warp, one in a later block
        for i, v in {0: 1024, 3: -1, 4: 1024 + FAR, 30: INT32_MAX, 100: INT32_MIN}.items():
            idx[i] = v
        ctr = mon.counter(mon.registry.register(m.SITE.name, description=m.SITE.description), dev)
        out = torch.empty(512, 256, device=dev, dtype=src.dtype)
        m.gather(src, idx, out, ctr=ctr, guard=guard, requests=req(512))
        expect = [5]
    else:
        print(f"unknown kernel {kernel!r}", file=sys.stderr)
        return 2
    if dev != "cpu":
        torch.cuda.synchronize()
    got = ctr.reshape(-1, 8)[:, 0].tolist()
    print(f"COUNTS {kernel} guard={int(guard)} got={got} expect={expect if guard else [0] * len(expect)}")
    if guard and got != expect:
        print(f"MISCOUNT: {kernel} counted {got}, expected {expect}", file=sys.stderr)
        return 3
    if guard:
        # Every hit's offenders were kept, each with the request the map gives its row's unit.
        offenders = [o for h in mon.snapshot().values() for o in h.offenders]
        print(f"OFFENDERS {kernel} kept={len(offenders)} requests={sorted({o.request for o in offenders}, key=str)}")
        if not offenders or any(o.request is None for o in offenders):
            print(f"OFFENDERS: {kernel} kept {offenders}, each with a request expected", file=sys.stderr)
            return 4
    return 0


_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")


def _prebuild_example() -> str | None:
    """Build the CUDA extension example outside the sanitizer (nvcc under it would be slow and checked too)."""
    try:
        sys.path.insert(0, EXAMPLE)
        import cuda_gather

        cuda_gather.build()
    except Exception as e:  # reported in the table as this kernel's failure; the others still run
        return f"{type(e).__name__}: {str(e).splitlines()[-1][:300] if str(e) else ''}"
    return None


def _drive(sanitizer: str, kernels: list[str]) -> int:
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    rows = []
    ok = True
    if "adopted.reshape_cuda" in kernels:
        try:
            sys.path.insert(0, BENCH)
            from adopted_vllm import cuda_ext

            cuda_ext.build()
        except Exception as e:
            print(f"--- adopted.reshape_cuda: the extension did not build: {type(e).__name__}: {e}", file=sys.stderr)
            ok = False
            kernels = [k for k in kernels if k != "adopted.reshape_cuda"]
    if "cuda_gather" in kernels:
        err = _prebuild_example()
        if err is not None:
            print(f"--- cuda_gather: the example extension did not build: {err}", file=sys.stderr)
            ok = False
            kernels = [k for k in kernels if k != "cuda_gather"]
    no_control = _without_vllm([k for k in kernels if k in ADOPTED])
    for kernel in kernels:
        res = {}
        for guard in (1, 0):
            if not guard and kernel in no_control:
                res[0] = (None, None, "(not run)")
                print(f"--- {kernel}: vLLM's original (the control) not run: {no_control[kernel]}", file=sys.stderr)
                continue
            cmd = [
                sanitizer,
                "--tool",
                "memcheck",
                "--print-limit",
                "5",
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                kernel,
                "--guard",
                str(guard),
            ]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            text = p.stdout + p.stderr
            m = _SUMMARY.search(text)
            errors = int(m.group(1)) if m else None
            counts = re.search(r"COUNTS .*", text)
            res[guard] = (errors, p.returncode, counts.group(0) if counts else "(no counts: the run died)")
            if guard and (errors is None or errors != 0 or p.returncode != 0):
                ok = False
                print(f"--- guarded {kernel} failed (rc {p.returncode}):\n{text[-4000:]}", file=sys.stderr)
            # A torch index op's control dies on its own device-side assert (no memcheck error): a fault too.
            died = p.returncode != 0 and ("device-side assert" in text or "CUDA error" in text)
            if not guard and not errors and not died:
                ok = False
                print(f"--- twin {kernel} reported no errors (rc {p.returncode}):\n{text[-2000:]}", file=sys.stderr)
        rows.append((kernel, res))
    print(f"{'kernel':22s} {'guarded errors':>15s} {'twin errors':>12s}  verdict   guarded counts")
    for kernel, res in rows:
        g, u = res[1], res[0]
        verdict = "PASS" if g[0] == 0 and g[1] == 0 and (u[0] or u[1] != 0) else "FAIL"
        if kernel in no_control:
            verdict = "NO CTRL" if g[0] == 0 and g[1] == 0 else "FAIL"
        print(f"{kernel:22s} {g[0]!s:>15s} {u[0]!s:>12s}  {verdict:8s}  {g[2]}")
    if ok and no_control:
        print(f"memcheck: INCOMPLETE (guarded: 0 errors; no control for {', '.join(no_control)}: no vLLM installed)")
        return 3
    print(
        "memcheck:",
        "PASS (guarded: 0 errors everywhere; twins: errors, so the inputs really were out of range)" if ok else "FAIL",
    )
    return 0 if ok else 1


def _without_vllm(adopted: list[str]) -> dict[str, str]:
    """The adopted kernels whose control, vLLM's original, cannot run here, with why (adopted_vllm.NoVllm names
    what to install)."""
    if not adopted:
        return {}
    sys.path.insert(0, BENCH)
    from adopted_vllm import NoVllm, cuda_ext, vllm_version

    out = {}
    for kernel in adopted:
        try:
            vllm_version()
            if kernel == "adopted.reshape_cuda":
                cuda_ext.vllm_op()
        except NoVllm as e:
            out[kernel] = str(e)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=KERNELS + VALIDATED + ADOPTED, help="run one kernel (inside the sanitizer)")
    p.add_argument("--guard", type=int, choices=(0, 1), default=1)
    p.add_argument(
        "--device",
        default="cuda",
        help="child only: cpu checks the expected counts under "
        "TRITON_INTERPRET=1 (guarded runs only; the twin would read out of bounds)",
    )
    p.add_argument(
        "--kernels", default=",".join(KERNELS + VALIDATED), help=f"comma list (driver); also: {','.join(ADOPTED)}"
    )
    p.add_argument("--sanitizer", default=None, help="path to compute-sanitizer (default: PATH, then CUDA_HOME/bin)")
    args = p.parse_args(argv)
    if args.child:
        if args.device == "cpu" and not args.guard:
            p.error("the unguarded twin reads out of bounds: never run it on the CPU")
        return _child(args.child, bool(args.guard), args.device)
    sanitizer = args.sanitizer or shutil.which("compute-sanitizer")
    if sanitizer is None:
        for base in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
            cand = os.path.join(base, "bin", "compute-sanitizer") if base else None
            if cand and os.path.exists(cand):
                sanitizer = cand
                break
    if sanitizer is None:
        print("memcheck: compute-sanitizer not found (install the CUDA toolkit or pass --sanitizer)", file=sys.stderr)
        return 2
    return _drive(sanitizer, [k for k in args.kernels.split(",") if k])


if __name__ == "__main__":
    raise SystemExit(main())
