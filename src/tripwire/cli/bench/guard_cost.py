"""q1. Guard cost: each reference kernel (``tripwire.kernels``), guarded vs its unguarded twin (``guard=False``), at
sizes that fill the chip, and achieved bandwidth against a device-to-device copy of the same order of bytes.

Timing: ``triton.testing.do_bench`` medians (it warms up and flushes L2 between calls). Each repeat times the
guarded and the unguarded launch back to back (alternating which goes first), so the comparison is paired; the
overhead figure is the median over repeats of the per-repeat ratio. All metadata is valid, so the guarded kernels
count nothing (checked) and do the same memory traffic as the twins: the overhead is the checks themselves.

Target: within 1 %. The measurement lab (the repository's ``benchmarks/lab``) adds the fused FP8 quantise-and-count
kernel and the non-finite counter to this question.

Without a GPU the kernels run in Triton's interpreter at small sizes, timed on the host: the figures are the
interpreter's (what a CPU test of a guarded kernel pays), not a GPU's, and no target applies.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tripwire import Monitor, SiteRegistry
from tripwire.testing.timing import d2d_copy_ms, do_bench_ms

from .common import Ctx, Result, single, stats
from .questions import label


@dataclass
class Case:
    name: str
    guarded: Callable[[], object]
    unguarded: Callable[[], object]
    nbytes: int  # bytes the kernel must move (reads + writes of the payload and its metadata)
    check: Callable[[], bool] | None = None  # outputs of the two variants agree (run after timing)


def build_cases(m: Monitor, device: str = "cuda", shrink: int = 1) -> dict[str, Callable[[], Case]]:
    """Case builders (each allocates when called, so only one case's tensors are alive at a time). ``shrink``
    divides the large dimensions: 1 fills an H200 (hundreds of MB per launch), 2 for --quick, ~1024 for a CPU test
    of the harness under the Triton interpreter."""
    from tripwire import kernels as K

    s = shrink
    dev = device

    def ctr(mod) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return K.counters(mod.SITES, dev, m)

    def _perm(n: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.randperm(n, device=dev).to(dtype)

    def block_table() -> Case:
        r, w = 65536 // s, 512
        table = torch.randint(0, 1 << 20, (r, w), device=dev, dtype=torch.int32)
        rows = _perm(r)
        counts = torch.full((r,), w, device=dev, dtype=torch.int32)
        og, ou = torch.empty_like(table), torch.empty_like(table)
        c = ctr(K.block_table)
        return Case(
            "block_table",
            lambda: K.block_table.block_table_gather(table, rows, counts, og, ctr=c),
            lambda: K.block_table.block_table_gather(table, rows, counts, ou, guard=False),
            2 * table.numel() * 4 + rows.numel() * 8,
            lambda: torch.equal(og, ou),
        )

    def slot_mapping() -> Case:
        r, w, bs = 65536 // s, 512, 16
        t = (16 << 20) // s
        table = _perm(r * w).view(r, w)
        token_rows = torch.randint(0, r, (t,), device=dev, dtype=torch.int32)
        positions = torch.randint(0, w * bs, (t,), device=dev, dtype=torch.int32)
        sg, su = torch.empty(t, device=dev, dtype=torch.int64), torch.empty(t, device=dev, dtype=torch.int64)
        c = ctr(K.slot_mapping)
        return Case(
            "slot_mapping",
            lambda: K.slot_mapping.slot_mapping(positions, token_rows, table, sg, bs, num_kv_blocks=r * w, ctr=c),
            lambda: K.slot_mapping.slot_mapping(positions, token_rows, table, su, bs, num_kv_blocks=r * w, guard=False),
            t * (4 + 4 + 4 + 8),
            lambda: torch.equal(sg, su),
        )

    def kv_zero() -> Case:
        n = 8192 // s
        pool = torch.ones(n, 2, 16, 8, 128, device=dev, dtype=torch.bfloat16)  # 64 KiB per block
        ids = _perm(n)
        c = ctr(K.kv_zero)
        return Case(
            "kv_zero",
            lambda: K.kv_zero.kv_zero(pool, ids, ctr=c),
            lambda: K.kv_zero.kv_zero(pool, ids, guard=False),
            pool.numel() * 2 + ids.numel() * 4,
            lambda: not bool(pool.any()),
        )

    def paged_gather() -> Case:
        n = 8192 // s
        b = min(64, n)
        p = n // b
        cache = torch.randn(n, 16, 8, 128, device=dev, dtype=torch.bfloat16)  # 32 KiB per page
        table = _perm(n)[: b * p].view(b, p).contiguous()
        og = torch.empty(b, p, 16, 8, 128, device=dev, dtype=torch.bfloat16)
        ou = torch.empty_like(og)
        c = ctr(K.paged_gather)
        return Case(
            "paged_gather",
            lambda: K.paged_gather.paged_gather(cache, table, og, ctr=c),
            lambda: K.paged_gather.paged_gather(cache, table, ou, guard=False),
            2 * og.numel() * 2 + table.numel() * 4,
            lambda: torch.equal(og, ou),
        )

    def state_copy() -> Case:
        r, w, slot = 4096 // s, 16, 4096
        state = torch.randn(r * w, slot, device=dev, dtype=torch.bfloat16)  # 8 KiB per slot
        table = _perm(r * w).view(r, w)
        mcount = r * 8
        i = torch.arange(mcount, device=dev)
        rows = (i // 8).to(torch.int32)
        src = (i % 8).to(torch.int32)
        dst = (8 + i % 8).to(torch.int32)  # distinct destinations, disjoint from the sources
        c = ctr(K.state_copy)
        return Case(
            "state_copy",
            lambda: K.state_copy.state_copy(state, table, rows, src, dst, ctr=c),
            lambda: K.state_copy.state_copy(state, table, rows, src, dst, guard=False),
            2 * mcount * slot * 2 + 3 * mcount * 4,
            None,
        )

    def rope() -> Case:
        t, hq, hk, d = 32768 // s, 32, 8, 128
        q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(t, hk, d, device=dev, dtype=torch.bfloat16)
        max_pos = max(131072 // s, 256)
        cos_sin = torch.randn(max_pos, d, device=dev, dtype=torch.float32)
        pos = torch.randint(0, max_pos, (t,), device=dev, dtype=torch.int32)
        qg, kg, qu, ku = (torch.empty_like(x) for x in (q, k, q, k))
        c = ctr(K.rope)
        return Case(
            "rope",
            lambda: K.rope.rope(pos, q, k, cos_sin, qg, kg, ctr=c),
            lambda: K.rope.rope(pos, q, k, cos_sin, qu, ku, guard=False),
            2 * (q.numel() + k.numel()) * 2 + t * d * 4 + t * 4,
            lambda: torch.equal(qg, qu) and torch.equal(kg, ku),
        )

    return {
        "block_table": block_table,
        "slot_mapping": slot_mapping,
        "kv_zero": kv_zero,
        "paged_gather": paged_gather,
        "state_copy": state_copy,
        "rope": rope,
    }


def run(ctx: Ctx) -> dict:
    res = Result(label(__name__), "Guard cost: guarded vs unguarded twin, bandwidth vs a D2D copy", ctx)
    if not ctx.cuda:
        return _interpreted(res, ctx)
    repeats = 3 if ctx.quick else 5
    rep_ms = 40 if ctx.quick else 100
    reg = SiteRegistry(capacity=64)
    m = Monitor(registry=reg, capacity=64, mode="warn")
    m.prealloc("cuda")

    # The reference: a device-to-device copy of 1 GiB (0.5 with --quick): read + write bytes per second.
    n = (1 << 30) // (2 if ctx.quick else 1)
    copy_ms = d2d_copy_ms(n, repeats, rep_ms)
    copy_gbs = [2 * n / (t * 1e-3) / 1e9 for t in copy_ms]
    res.fig("d2d_copy_gbs", stats(copy_gbs, unit="GB/s", label="device-to-device copy (read+write)"))
    copy_bw = res.figures["d2d_copy_gbs"]["median"]

    try:
        builders = build_cases(m, "cuda", 2 if ctx.quick else 1)
    except ImportError as e:
        res.note(f"tripwire.kernels is not importable ({e}): reference kernels not measured")
        builders = {}
    for name, build in builders.items():
        try:
            case = build()
            case.guarded()  # compile both before timing
            case.unguarded()
            torch.cuda.synchronize()
            ratios: list[float] = []
            g_ms: list[float] = []
            u_ms: list[float] = []
            for r in range(repeats):
                # Paired, alternating which goes first, so drift (clocks, temperature) cancels over repeats.
                first, second = (case.guarded, case.unguarded) if r % 2 == 0 else (case.unguarded, case.guarded)
                a = do_bench_ms(first, rep_ms=rep_ms)
                b = do_bench_ms(second, rep_ms=rep_ms)
                g, u = (a, b) if r % 2 == 0 else (b, a)
                g_ms.append(g)
                u_ms.append(u)
                ratios.append((g / u - 1) * 100)
            torch.cuda.synchronize()
            agree = None if case.check is None else bool(case.check())
            nbytes = case.nbytes
            del case
        except Exception as e:  # one kernel's failure must not hide the others' figures
            res.note(f"{name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        finally:
            torch.cuda.empty_cache()
        res.fig(f"guarded_ms_{name}", stats(g_ms, unit="ms", label=f"{name}, guarded"))
        res.fig(f"unguarded_ms_{name}", stats(u_ms, unit="ms", label=f"{name}, unguarded twin"))
        res.fig(f"overhead_pct_{name}", stats(ratios, unit="%", label=f"{name}: guarded / unguarded - 1"))
        gbs = [nbytes / (t * 1e-3) / 1e9 for t in g_ms]
        res.fig(f"bandwidth_gbs_{name}", stats(gbs, unit="GB/s", label=f"{name}, guarded, achieved"))
        res.fig(
            f"bandwidth_pct_of_copy_{name}",
            single(statistics.median(gbs) / copy_bw * 100, unit="%", label=f"{name}, guarded, vs the D2D copy"),
        )
        if agree is False:
            res.note(f"{name}: guarded and unguarded outputs DIFFER on valid metadata")
        ov = res.figures[f"overhead_pct_{name}"]["median"]
        res.target(f"{name} guard cost", f"overhead_pct_{name}", "within 1 %", ov, ov <= 1.0)
        ctx.log(f"{name}: guarded {statistics.median(g_ms):.3f} ms, overhead {ov:+.2f} %")
    hits = m.read_rows("cuda")[:, 0]
    if int(hits.sum()) != 0:
        res.note(f"guard hits on valid metadata: {int(hits.sum())} (a kernel or a case is wrong)")
    return res.to_dict()


def _interpreted(res: Result, ctx: Ctx) -> dict:
    """Each reference kernel, guarded and its twin, under Triton's interpreter at a small size: host time per call,
    the median of rounds that alternate which side goes first."""
    import time

    rounds = 3 if ctx.quick else 5
    reg = SiteRegistry(capacity=64)
    m = Monitor(registry=reg, capacity=64, mode="warn")
    m.prealloc("cpu")

    def once(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    for name, build in build_cases(m, "cpu", 4096 if ctx.quick else 1024).items():
        case = build()
        case.guarded()
        case.unguarded()
        g_ms: list[float] = []
        u_ms: list[float] = []
        for r in range(rounds):
            if r % 2 == 0:
                g_ms.append(once(case.guarded))
                u_ms.append(once(case.unguarded))
            else:
                u_ms.append(once(case.unguarded))
                g_ms.append(once(case.guarded))
        res.fig(f"guarded_ms_{name}", stats(g_ms, unit="ms", label=f"{name}, guarded, interpreted"))
        res.fig(f"unguarded_ms_{name}", stats(u_ms, unit="ms", label=f"{name}, unguarded twin, interpreted"))
        ratios = [(g / u - 1) * 100 for g, u in zip(g_ms, u_ms, strict=True)]
        res.fig(f"overhead_pct_{name}", stats(ratios, unit="%", label=f"{name}: guarded / unguarded - 1, interpreted"))
        if case.check is not None and not case.check():
            res.note(f"{name}: guarded and unguarded outputs DIFFER on valid metadata")
        ctx.log(f"{name}: guarded {statistics.median(g_ms):.1f} ms interpreted")
    hits = m.read_rows("cpu")[:, 0]
    if int(hits.sum()) != 0:
        res.note(f"guard hits on valid metadata: {int(hits.sum())} (a kernel or a case is wrong)")
    res.note("no GPU: Triton's interpreter on the host; the figures are the interpreter's, no target applies")
    return res.to_dict()
