"""q8. Versus the debugging tools users reach for today.

(a) compute-sanitizer memcheck: the same gather workload (tripwire.testing.gather), guarded and unguarded, timed in a
    child process natively and under ``compute-sanitizer --tool memcheck``. The slowdown factor is memcheck time over
    native time of the same kernel; the guard cost is guarded over unguarded, natively.
(b) ``tl.device_assert``: a child launches a gather whose ``device_assert`` fires on a bad index (TRITON_DEBUG=1),
    then tries ordinary CUDA work; we record what the launch, the later calls and the exit code did. The same bad
    index through tripwire's guarded gather, in a second child, for comparison.

Each child appends one JSON line per step, so a child that dies mid-way still leaves what happened before.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import triton
import triton.language as tl

from .common import Ctx, Result, python, run_child, single, subprocess_env
from .questions import label


def find_sanitizer() -> str | None:
    """compute-sanitizer from PATH, CUDA_HOME, /usr/local/cuda*, or the nvidia-cuda-sanitizer-api wheel."""
    exe = shutil.which("compute-sanitizer")
    if exe:
        return exe
    roots = [
        os.environ.get("CUDA_HOME"),
        os.environ.get("CUDA_PATH"),
        "/usr/local/cuda",
        *glob.glob("/usr/local/cuda-*"),
    ]
    pats = [f"{r}/bin/compute-sanitizer" for r in roots if r] + [
        f"{r}/compute-sanitizer/compute-sanitizer" for r in roots if r
    ]
    pats.append(f"{sysconfig.get_paths()['purelib']}/nvidia/cuda_sanitizer_api/compute-sanitizer/compute-sanitizer")
    for pat in pats:
        for p in glob.glob(pat):
            if os.access(p, os.X_OK):
                return p
    return None


def _read_lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _child_run(
    args: list[str], out: Path, timeout: float, prefix: list[str] | None = None, env_extra: dict[str, str] | None = None
) -> tuple[int | None, list[dict], str, float]:
    out.unlink(missing_ok=True)
    env = subprocess_env()
    env.update(env_extra or {})
    t0 = time.perf_counter()
    rc, tail = run_child([*(prefix or []), python(), "-m", __name__, *args, str(out)], env, timeout)
    return rc, _read_lines(out), tail, time.perf_counter() - t0


def run(ctx: Ctx) -> dict:
    res = Result(label(__name__), "Versus compute-sanitizer memcheck and tl.device_assert", ctx)
    if not ctx.cuda:
        return res.skip("needs a CUDA GPU")
    reps = "10" if ctx.quick else "30"

    # (a) native, then under memcheck (the native run also warms the Triton cache for the sanitizer run).
    rc, lines, tail, _ = _child_run(["--child-timing", reps], ctx.out / "q8_native.jsonl", 180)
    native = next((ln for ln in lines if ln.get("step") == "timing"), None)
    if native is None:
        res.note(f"native timing child failed (exit {rc}): {tail[-300:]}")
    else:
        res.fig("native_guarded_ms", single(native["guarded_ms"], unit="ms", label="gather, guarded, native"))
        res.fig("native_unguarded_ms", single(native["unguarded_ms"], unit="ms", label="gather, unguarded, native"))
        res.fig(
            "native_guard_overhead_pct",
            single((native["guarded_ms"] / native["unguarded_ms"] - 1) * 100, unit="%", label="guard cost, native"),
        )
    san = find_sanitizer()
    # Leave ~45 s for the device_assert children after the sanitizer run, within the suite's deadline.
    left = ctx.extra.get("deadline", time.perf_counter() + 600) - time.perf_counter() - 45
    mc_timeout = min(200.0 if not ctx.quick else 150.0, left)
    if san is not None and mc_timeout < 30:
        res.note(f"memcheck not run: only {max(left, 0):.0f} s left in the suite's time budget")
        san = None
    elif san is None:
        res.note("compute-sanitizer not found (PATH, CUDA_HOME, /usr/local/cuda*, nvidia wheel): memcheck not measured")
    else:
        prefix = [san, "--tool", "memcheck", "--target-processes", "application-only", "--print-limit", "5"]
        rc, lines, tail, wall = _child_run(
            ["--child-timing", "5"], ctx.out / "q8_memcheck.jsonl", mc_timeout, prefix=prefix
        )
        mc = next((ln for ln in lines if ln.get("step") == "timing"), None)
        res.fig("memcheck_process_wall_s", single(wall, unit="s", label="whole child under memcheck (wall)"))
        if mc is None or native is None:
            res.note(f"memcheck timing child failed (exit {rc}): {tail[-400:]}")
        else:
            res.fig("memcheck_guarded_ms", single(mc["guarded_ms"], unit="ms", label="gather, guarded, memcheck"))
            res.fig("memcheck_unguarded_ms", single(mc["unguarded_ms"], unit="ms", label="gather, unguarded, memcheck"))
            res.fig(
                "memcheck_slowdown_x",
                single(mc["unguarded_ms"] / native["unguarded_ms"], unit="x", label="memcheck slowdown (unguarded)"),
            )
            res.fig(
                "memcheck_vs_guard_x",
                single(mc["unguarded_ms"] / native["guarded_ms"], unit="x", label="memcheck vs tripwire guard"),
            )
        summary = [ln for ln in tail.splitlines() if "ERROR SUMMARY" in ln]
        if summary:
            res.note(f"memcheck: {summary[-1].strip()}")

    # (b) device_assert vs the guard on the same bad index.
    rc_a, lines_a, tail_a, _ = _child_run(
        ["--child-assert"], ctx.out / "q8_assert.jsonl", 120, env_extra={"TRITON_DEBUG": "1"}
    )
    rc_g, lines_g, tail_g, _ = _child_run(["--child-guard"], ctx.out / "q8_guard.jsonl", 120)
    for name, rc_x, lines_x, tail_x in (("device_assert", rc_a, lines_a, tail_a), ("tripwire", rc_g, lines_g, tail_g)):
        res.fig(f"{name}_exit_code", single(rc_x, unit="code", label=f"{name} child exit code"))
        later = [ln for ln in lines_x if ln.get("step", "").startswith("later")]
        ok_later = bool(later) and all(ln.get("ok") for ln in later)
        res.fig(f"{name}_later_cuda_ok", single(int(ok_later), unit="bool", label=f"{name}: later CUDA calls work"))
        for ln in lines_x:
            res.note(f"{name}: {ln.get('step')}: {'ok' if ln.get('ok') else 'FAILED'} {ln.get('detail', '')}"[:300])
        if not lines_x:
            res.note(f"{name}: child left no record (exit {rc_x}): {tail_x[-300:]}")
    hit = next((ln for ln in lines_g if ln.get("step") == "bad_launch"), {})
    res.fig("tripwire_count", single(hit.get("count"), unit="hits", label="tripwire count after one bad index"))
    alive = rc_g == 0 and res.figures["tripwire_later_cuda_ok"]["median"] == 1 and hit.get("count") == 1
    res.target(
        "tripwire keeps the process usable",
        "tripwire_later_cuda_ok",
        "exit 0, later CUDA works, count == 1",
        res.figures["tripwire_later_cuda_ok"]["median"],
        alive,
    )
    return res.to_dict()


# ------------------------------------------------------------------------------------------------ children
@triton.jit
def _assert_gather(table_ptr, idx_ptr, out_ptr, n_rows, D: tl.constexpr):
    # The device_assert alternative to a guard: active only when Triton compiles with debug (TRITON_DEBUG=1).
    pid = tl.program_id(0)
    idx = tl.load(idx_ptr + pid)
    tl.device_assert((idx >= 0) & (idx < n_rows), "tripwire bench q8: index out of range")
    cols = tl.arange(0, D)
    tl.store(out_ptr + pid * D + cols, tl.load(table_ptr + idx * D + cols))


def _emit(out: Path, **kw) -> None:  # type: ignore[no-untyped-def]
    with out.open("a") as f:
        f.write(json.dumps(kw) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _child_timing(reps: int, out: Path) -> None:
    import torch

    from tripwire import Monitor, SiteRegistry
    from tripwire.testing import gather_rows

    from .common import cuda_event_times_ms

    reg = SiteRegistry(capacity=8)
    site = reg.register("bench.q8.gather")
    m = Monitor(registry=reg, capacity=8, mode="warn")
    ctr = m.counter(site, "cuda")
    table = torch.randn(65536, 64, device="cuda")
    idx = torch.randint(0, 65536, (262144,), device="cuda", dtype=torch.int64)
    o = torch.empty(262144, 64, device="cuda")
    g = cuda_event_times_ms(lambda: gather_rows(table, idx, o, ctr=ctr), reps, warmup=2)
    u = cuda_event_times_ms(lambda: gather_rows(table, idx, o, guard=False), reps, warmup=2)
    g2 = cuda_event_times_ms(lambda: gather_rows(table, idx, o, ctr=ctr), reps, warmup=0)  # paired: g, u, g
    gs = sorted(g + g2)
    _emit(out, step="timing", ok=True, guarded_ms=gs[len(gs) // 2], unguarded_ms=sorted(u)[len(u) // 2], reps=reps)


def _later(out: Path) -> None:
    import torch

    for name, fn in (
        ("later_alloc_and_sum", lambda: torch.ones(1024, device="cuda").sum().item()),
        ("later_synchronize", torch.cuda.synchronize),
        (
            "later_matmul",
            lambda: (torch.randn(64, 64, device="cuda") @ torch.randn(64, 64, device="cuda")).sum().item(),
        ),
    ):
        try:
            v = fn()
            _emit(out, step=name, ok=True, detail=f"-> {v}" if v is not None else "")
        except Exception as e:
            _emit(out, step=name, ok=False, detail=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


def _child_assert(out: Path) -> None:
    import torch

    table = torch.randn(1024, 64, device="cuda")
    o = torch.empty(4, 64, device="cuda")
    good = torch.arange(4, device="cuda", dtype=torch.int64)
    bad = good.clone()
    bad[2] = 1024 + 3  # just past the end: a bad block id
    try:
        _assert_gather[(4,)](table, good, o, 1024, D=64)
        torch.cuda.synchronize()
        _emit(out, step="good_launch", ok=True, detail=f"TRITON_DEBUG={os.environ.get('TRITON_DEBUG')}")
    except Exception as e:
        _emit(out, step="good_launch", ok=False, detail=f"{type(e).__name__}: {e}"[:300])
    try:
        _assert_gather[(4,)](table, bad, o, 1024, D=64)
        torch.cuda.synchronize()
        _emit(out, step="bad_launch", ok=True, detail="no error surfaced (assert compiled out?)")
    except Exception as e:
        _emit(out, step="bad_launch", ok=False, detail=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    _later(out)


def _child_guard(out: Path) -> None:
    import torch

    from tripwire import Monitor, SiteRegistry
    from tripwire.testing import gather_rows

    reg = SiteRegistry(capacity=8)
    site = reg.register("bench.q8.gather")
    m = Monitor(registry=reg, capacity=8, mode="warn")
    ctr = m.counter(site, "cuda")
    table = torch.randn(1024, 64, device="cuda")
    o = torch.empty(4, 64, device="cuda")
    bad = torch.arange(4, device="cuda", dtype=torch.int64)
    bad[2] = 1024 + 3
    try:
        gather_rows(table, bad, o, ctr=ctr)
        torch.cuda.synchronize()
        count = int(m.read_rows("cuda")[site.id, 0])
        masked = bool((o[2] == 0).all())
        _emit(out, step="bad_launch", ok=True, count=count, detail=f"count={count}, masked row zero={masked}")
    except Exception as e:
        _emit(out, step="bad_launch", ok=False, detail=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    _later(out)


if __name__ == "__main__":
    a = sys.argv[1:]
    if len(a) == 3 and a[0] == "--child-timing":
        _child_timing(int(a[1]), Path(a[2]))
    elif len(a) == 2 and a[0] == "--child-assert":
        _child_assert(Path(a[1]))
    elif len(a) == 2 and a[0] == "--child-guard":
        _child_guard(Path(a[1]))
    else:
        print("usage: tripwire bench --only q8", file=sys.stderr)
        raise SystemExit(2)
