"""The reference guarded kernels together (each kernel's own tests are in tests/kernels/test_<name>.py): random
corruptions (hypothesis), the control that the unguarded twin on an id inside a neighbouring live allocation silently
reads / clobbers it and counts nothing (the bug class the guard exists for), launch-time argument errors, the
default counter path, graph replays, request maps and the sm_90 builds.

Under the interpreter (CPU) programs run in order, so the first offender is exactly the lowest (row, value); on the
GPU programs race for it, so there it must be one of the real hits.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernel_helpers import HYP, I32, I64, INT32_MAX, INT32_MIN, assert_hits, bt_inputs, ids, rope_inputs, sc_inputs
from tripwire.kernels import block_table as bt
from tripwire.kernels import counters
from tripwire.kernels import kv_zero as kz
from tripwire.kernels import paged_gather as pg
from tripwire.kernels import rope as rp
from tripwire.kernels import slot_mapping as sm
from tripwire.kernels import state_copy as sc

# ---------------------------------------------------------------------------------------------- random corruptions
_bad = st.one_of(
    st.sampled_from([-1, INT32_MIN, INT32_MAX]),
    st.integers(-(2**31), -1),
    st.integers(0, 2**31 - 1),
)


@HYP
@given(data=st.data())
def test_random_corruptions(kernel_device, monitor, data):
    """Random in-range and out-of-range ids into every kernel: outputs equal the reference, counts exact."""
    dev = kernel_device
    monitor.reset()
    n_pages = data.draw(st.integers(1, 6))
    page_ids = data.draw(st.lists(st.one_of(st.integers(0, n_pages - 1), _bad), min_size=1, max_size=8))
    # paged gather
    cache = torch.randn(n_pages, 2, 3, device=dev)
    table = ids(page_ids, dev).reshape(1, -1)
    out = torch.empty(1, len(page_ids), 2, 3, device=dev)
    ctr = counters(pg.SITES, dev, monitor)
    pg.paged_gather(cache, table, out, ctr=ctr)
    ref, hits = pg.paged_gather_reference(cache, table)
    assert torch.equal(out.cpu(), ref)
    assert_hits(ctr, hits)
    # kv zero, same ids
    pool = torch.randn(n_pages, 4, device=dev) + 3
    ref, hits = kz.kv_zero_reference(pool, table[0])
    ctr = counters(kz.SITES, dev, monitor)
    kz.kv_zero(pool, table[0], ctr=ctr)
    assert torch.equal(pool.cpu(), ref)
    assert_hits(ctr, hits)
    # slot mapping: rows and positions (positions as int64, extremes of int32 and beyond); both division paths
    R, W = 3, 4
    bs = data.draw(st.sampled_from([4, 3]))
    n = data.draw(st.integers(1, 8))
    rows = data.draw(st.lists(st.one_of(st.integers(0, R - 1), _bad), min_size=n, max_size=n))
    pos = data.draw(
        st.lists(st.one_of(st.integers(0, W * bs - 1), _bad, st.integers(-(2**40), 2**40)), min_size=n, max_size=n)
    )
    btab = data.draw(st.lists(st.one_of(st.integers(0, 9), _bad), min_size=R * W, max_size=R * W))
    btab_t = ids(btab, dev).reshape(R, W)
    pos_t, rows_t = ids(pos, dev, I64), ids(rows, dev)
    slots = torch.empty(n, dtype=I64, device=dev)
    ctr = counters(sm.SITES, dev, monitor)
    sm.slot_mapping(pos_t, rows_t, btab_t, slots, bs, num_kv_blocks=10, ctr=ctr)
    ref, hits = sm.slot_mapping_reference(pos_t, rows_t, btab_t, bs, 10)
    assert torch.equal(slots.cpu(), ref)
    assert_hits(ctr[0], hits["row"])
    assert_hits(ctr[1], hits["column"])
    assert_hits(ctr[2], hits["block"])
    # block table gather over the same rows
    counts = ids(data.draw(st.lists(st.one_of(st.integers(0, W), _bad), min_size=R, max_size=R)), dev)
    bout = torch.empty(n, W, dtype=I32, device=dev)
    ctr = counters(bt.SITES, dev, monitor)
    bt.block_table_gather(btab_t, rows_t, counts, bout, ctr=ctr)
    ref, rh, ch = bt.block_table_gather_reference(btab_t, rows_t, counts)
    assert torch.equal(bout.cpu(), ref)
    assert_hits(ctr[0], rh)
    assert_hits(ctr[1], ch)


# ---------------------------------------------------------------------------------------------- controls
def test_control_unguarded_twin_reads_and_clobbers_a_neighbour(kernel_device, monitor):
    """The bug class: an id one past the end lands in the NEXT live allocation (here: the row after a view of a
    larger buffer). The twin silently reads it and zeroes it, counting nothing; the guard masks both and counts."""
    buf = torch.randn(5, 2, 3, device=kernel_device) + 10  # rows 0..3 are "the pool", row 4 is someone else's
    pool = buf[:4]
    table = ids([[1, 4]], kernel_device)
    out = torch.empty(1, 2, 2, 3, device=kernel_device)
    ctr = counters(pg.SITES, kernel_device, monitor)

    pg.paged_gather(pool, table, out, guard=False, ctr=ctr)
    assert torch.equal(out[0, 1], buf[4])  # silently read the neighbour
    assert ctr[..., :7].cpu().abs().sum() == 0  # slot 7 is layout (the offender block)  # and nobody was told
    pg.paged_gather(pool, table, out, guard=True, ctr=ctr)
    assert out[0, 1].abs().sum() == 0
    assert_hits(ctr, [(1, 4)])

    neighbour = buf[4].clone()
    zctr = counters(kz.SITES, kernel_device, monitor)
    kz.kv_zero(pool, ids([4], kernel_device), guard=True, ctr=zctr)
    assert torch.equal(buf[4], neighbour)
    assert_hits(zctr, [(0, 4)])
    kz.kv_zero(pool, ids([4], kernel_device), guard=False, ctr=zctr)
    assert buf[4].abs().sum() == 0  # the twin clobbered a live neighbour
    assert_hits(zctr, [(0, 4)])  # and counted nothing more


# ---------------------------------------------------------------------------------------------- launcher errors
def test_launcher_errors(kernel_device, monitor):
    dev = kernel_device
    table = torch.zeros(3, 4, dtype=I32, device=dev)
    counts = torch.zeros(3, dtype=I32, device=dev)
    rows = torch.zeros(2, dtype=I32, device=dev)
    out = torch.zeros(2, 4, dtype=I32, device=dev)
    ctr = counters(bt.SITES, dev, monitor)
    with pytest.raises(TypeError, match="req_rows must have dtype int32 or int64"):
        bt.block_table_gather(table, rows.float(), counts, out, ctr=ctr)
    with pytest.raises(ValueError, match=r"out must have shape \[2, 4\]"):
        bt.block_table_gather(table, rows, counts, out[:, :3].contiguous(), ctr=ctr)
    with pytest.raises(ValueError, match="block_table must be contiguous"):
        bt.block_table_gather(torch.zeros(4, 3, dtype=I32, device=dev).t(), rows, counts, out, ctr=ctr)
    with pytest.raises(TypeError, match="out must have dtype int32"):
        bt.block_table_gather(table, rows, counts, out.long(), ctr=ctr)
    with pytest.raises(ValueError, match=r"ctr must have shape \[2, 8\]"):
        bt.block_table_gather(table, rows, counts, out, ctr=ctr[0])
    with pytest.raises(TypeError, match="ctr must have dtype int64"):
        bt.block_table_gather(table, rows, counts, out, ctr=ctr.int())
    with pytest.raises(TypeError, match=r"block_table must be a torch\.Tensor"):
        bt.block_table_gather([[0]], rows, counts, out, ctr=ctr)
    slots = torch.zeros(2, dtype=I64, device=dev)
    sctr = counters(sm.SITES, dev, monitor)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        sm.slot_mapping(rows, rows, table, slots, 0, ctr=sctr)
    with pytest.raises(TypeError, match="block_size must be an int"):
        sm.slot_mapping(rows, rows, table, slots, 4.0, ctr=sctr)
    with pytest.raises(TypeError, match="slots must have dtype int64"):
        sm.slot_mapping(rows, rows, table, slots.int(), 4, ctr=sctr)
    q = torch.zeros(2, 1, 5, device=dev)
    with pytest.raises(ValueError, match="head size of q must be even"):
        rp.rope(rows, q, q, torch.zeros(3, 5, device=dev), q, q, ctr=counters(rp.SITES, dev, monitor))
    with pytest.raises(ValueError, match="k_out must have shape"):
        q = torch.zeros(2, 1, 4, device=dev)
        rp.rope(
            rows,
            q,
            q,
            torch.zeros(3, 4, device=dev),
            q,
            torch.zeros(2, 2, 4, device=dev),
            ctr=counters(rp.SITES, dev, monitor),
        )
    with pytest.raises(ValueError, match=r"out must have shape \[1, 2, 3\]"):
        pg.paged_gather(
            torch.zeros(4, 3, device=dev),
            rows.reshape(1, 2),
            torch.zeros(1, 2, 4, device=dev),
            ctr=counters(pg.SITES, dev, monitor),
        )
    with pytest.raises(ValueError, match="dst_cols must have shape"):
        sc.state_copy(torch.zeros(4, 3, device=dev), table, rows, rows, rows[:1], ctr=counters(sc.SITES, dev, monitor))


def test_launcher_refuses_counter_on_another_device(kernel_device, monitor):
    if kernel_device == "cpu":
        # meta tensors stand in for "another device" without a GPU
        ctr = torch.zeros(8, dtype=I64, device="meta")
    else:
        ctr = torch.zeros(8, dtype=I64)
    pool = torch.zeros(4, 3, device=kernel_device)
    with pytest.raises(ValueError, match="ctr \\(the counter rows\\) is on"):
        kz.kv_zero(pool, ids([0], kernel_device), ctr=ctr)
    with pytest.raises(ValueError, match="block_ids is on"):
        kz.kv_zero(pool, torch.zeros(1, dtype=I32, device="meta"), ctr=counters(kz.SITES, kernel_device, monitor))


def test_counters_need_adjacent_rows(registry, monitor):
    registry.register("something.else")
    registry.register(sm.SITE_ROW.name, description=sm.SITE_ROW.description)
    registry.register("in.between")
    with pytest.raises(ValueError, match="adjacent"):
        counters(sm.SITES, "cpu", monitor)


def test_default_counter_path(kernel_device):
    """ctr=None records into the default monitor's rows of the module's sites."""
    import tripwire

    tripwire.reset()
    pool = torch.zeros(3, 2, device=kernel_device)
    kz.kv_zero(pool, ids([0, 3, -2], kernel_device))
    snap = tripwire.snapshot()
    hit = snap[
        (
            str(torch.device(kernel_device) if kernel_device == "cpu" else torch.device("cuda", 0)),
            "kernels.kv_zero.block",
        )
    ]
    assert (hit.count, hit.min_value, hit.max_value) == (2, -2, 3)
    tripwire.reset()


def test_sites_registered_at_import():
    import tripwire
    from tripwire import kernels

    names = {s.name for s in tripwire.sites()}
    for s in kernels.ALL_SITES:
        assert s.name in names
    assert [s.name for s in kernels.ALL_SITES if s.fatal] == ["kernels.rope.position"]
    assert len(kernels.ALL_SITES) == 13


# ---------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
def test_graph_replay_counts_exactly_n_times(monitor):
    """A captured guarded kernel replayed N times counts exactly N x the bad entries."""
    dev = "cuda"
    cache = torch.randn(8, 2, 16, device=dev)
    table = ids([[0, 8, -1, 3], [INT32_MAX, 2, 1, 9]], dev)
    out = torch.empty(2, 4, 2, 16, device=dev)
    monitor.prealloc(dev)
    ctr = counters(pg.SITES, dev, monitor)
    pg.paged_gather(cache, table, out, ctr=ctr)  # compile outside the capture
    torch.cuda.synchronize()
    monitor.reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pg.paged_gather(cache, table, out, ctr=ctr)
    torch.cuda.synchronize()
    assert ctr.cpu()[0] == 0  # capture does not execute
    n = 50
    for _ in range(n):
        g.replay()
    torch.cuda.synchronize()
    assert ctr.cpu()[0] == n * 4
    ref, _ = pg.paged_gather_reference(cache, table)
    assert torch.equal(out.cpu(), ref)


# ---------------------------------------------------------------------------------------------- request maps
def _request_cases(dev: str, monitor) -> dict:
    """Per kernel: ``launch(requests)``, the map's length and unit, and the faults planted in chosen rows as
    ``{site name: [(row, value, index into the map)]}``."""
    i32 = I32
    cases = {}

    table, counts = bt_inputs(dev)
    counts[3] = 9  # > W: request row 3's count
    rows = ids([0, 1, 5, 3], dev)  # batch entry 2: a bad row; entry 3 reads the bad count
    out = torch.empty(4, 6, dtype=i32, device=dev)
    bt_ctr = counters(bt.SITES, dev, monitor)
    cases["block_table"] = (
        lambda r: bt.block_table_gather(table, rows, counts, out, ctr=bt_ctr, requests=r),
        4,
        "batch entry",
        {bt.SITE_ROW.name: [(2, 5, 2)], bt.SITE_COUNT.name: [(3, 9, 3)]},
    )

    sm_table = (torch.arange(12, dtype=i32).reshape(3, 4) * 2).to(dev)
    sm_table[1, 2] = 99  # >= num_kv_blocks
    pos = ids([0, 1, 40, 3, 4, 9, 6, 7], dev)  # token 2: column 10
    tok_rows = ids([0, 0, 0, 0, 0, 7, 0, 0], dev)  # token 5: row 7
    tok_rows[6] = 1
    pos[6] = 9  # token 6: row 1, column 2 -> block 99
    slots = torch.empty(8, dtype=I64, device=dev)
    sm_ctr = counters(sm.SITES, dev, monitor)
    cases["slot_mapping"] = (
        lambda r: sm.slot_mapping(pos, tok_rows, sm_table, slots, 4, num_kv_blocks=24, ctr=sm_ctr, requests=r),
        8,
        "token",
        {sm.SITE_ROW.name: [(5, 7, 5)], sm.SITE_COLUMN.name: [(2, 10, 2)], sm.SITE_BLOCK.name: [(6, 99, 6)]},
    )

    pool = torch.zeros(5, 2, 3, device=dev)
    block_ids = ids([0, 1, 2, -4, 4], dev)
    kz_ctr = counters(kz.SITES, dev, monitor)
    cases["kv_zero"] = (
        lambda r: kz.kv_zero(pool, block_ids, ctr=kz_ctr, requests=r),
        5,
        "list entry",
        {kz.SITE.name: [(3, -4, 3)]},
    )

    cache = torch.randn(6, 2, 3, device=dev)
    page_table = ids([[0, 1, 2, 3], [4, 5, 0, 1], [2, 60, 3, 4]], dev)  # entry (2, 1): flat row 9
    pg_out = torch.empty(3, 4, 2, 3, device=dev)
    pg_ctr = counters(pg.SITES, dev, monitor)
    cases["paged_gather"] = (
        lambda r: pg.paged_gather(cache, page_table, pg_out, ctr=pg_ctr, requests=r),
        3,
        "batch entry, a row of page_table",
        {pg.SITE.name: [(9, 60, 2)]},  # the request of batch entry 2, not of flat entry 9
    )

    state, sc_table = sc_inputs(dev)
    sc_table[3, 1] = 8  # == S
    sc_rows = ids([0, 4, 2, 1, 3], dev)  # copy 1: bad row
    src = ids([0, 0, 0, 0, 0], dev)
    dst = ids([1, 1, 1, 5, 1], dev)  # copy 3: bad column; copy 4 reads slot 8
    sc_ctr = counters(sc.SITES, dev, monitor)
    cases["state_copy"] = (
        lambda r: sc.state_copy(state, sc_table, sc_rows, src, dst, ctr=sc_ctr, requests=r),
        5,
        "copy",
        {sc.SITE_ROW.name: [(1, 4, 1)], sc.SITE_COLUMN.name: [(3, 5, 3)], sc.SITE_SLOT.name: [(4, 8, 4)]},
    )

    q, k, cs = rope_inputs(dev, torch.float32)
    rope_pos = ids([0, 1, 2, 3, 11, 5], dev)  # token 4: position 11 >= 10
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    rp_ctr = counters(rp.SITES, dev, monitor)
    cases["rope"] = (
        lambda r: rp.rope(rope_pos, q, k, cs, qo, ko, ctr=rp_ctr, requests=r),
        6,
        "token",
        {rp.SITE.name: [(4, 11, 4)]},
    )
    return cases


KERNEL_NAMES = ["block_table", "slot_mapping", "kv_zero", "paged_gather", "state_copy", "rope"]


def _requests(n: int, dtype: torch.dtype, dev: str) -> torch.Tensor:
    return torch.tensor([(-1) ** i * (1000 + 7 * i) for i in range(n)], dtype=dtype, device=dev)


@pytest.mark.parametrize("req_dtype", [I32, I64, None], ids=["req32", "req64", "no-map"])
@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_request_map_names_the_faulting_rows_request(kernel_device, monitor, hit_of, name, req_dtype):
    """A fault planted in a chosen row of each site: its offender carries exactly that row's request from the map
    (the map is indexed by the kernel's unit: paged_gather's by batch entry, not by flat entry); without a map the
    request is None (the control: the request comes from the map, nothing else). Counts are exact either way."""
    launch, n, _, expect = _request_cases(kernel_device, monitor)[name]
    requests = None if req_dtype is None else _requests(n, req_dtype, kernel_device)
    launch(requests)
    want_map = None if requests is None else requests.cpu().tolist()
    for site, faults in expect.items():
        hit = hit_of(monitor, site)
        # A negative id means "no request" (tripwire.triton): kept as None, like a kernel without a map.
        want = [(row, value, None if want_map is None or want_map[j] < 0 else want_map[j]) for row, value, j in faults]
        assert hit is not None and hit.count == len(faults), (site, hit)
        assert [tuple(o) for o in hit.offenders] == want, site


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_bad_request_maps_are_refused(kernel_device, monitor, name):
    """Wrong dtype, length, layout or device: refused at launch with an error naming the map and its unit; nothing
    is launched (no count)."""
    launch, n, unit, _ = _request_cases(kernel_device, monitor)[name]
    dev = kernel_device
    good = _requests(n, I64, dev)
    u = re.escape(unit)
    with pytest.raises(TypeError, match=rf"requests \(the request map: one request id per {u}\) must have dtype"):
        launch(good.float())
    with pytest.raises(ValueError, match=rf"one request id per {u}\) must have shape \[{n}\], got \[{n + 1}\]"):
        launch(_requests(n + 1, I64, dev))
    with pytest.raises(ValueError, match=r"must have shape"):
        launch(good.reshape(1, n))
    with pytest.raises(ValueError, match="must be contiguous"):
        launch(_requests(2 * n, I64, dev)[::2])
    with pytest.raises(ValueError, match=r"requests .* is on meta but the kernel's tensors are on"):
        launch(torch.zeros(n, dtype=I64, device="meta"))
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor or None"):
        launch(list(range(n)))
    assert all(h.count == 0 for h in monitor.snapshot().values())
    launch(good)  # control: the same launch with a good map runs and counts
    assert sum(h.count for h in monitor.snapshot().values()) > 0


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_ops_take_the_request_map(kernel_device, monitor, hit_of, name):
    """The custom ops accept the optional request map as their last argument (their schemas keep every other
    argument where it was): the offenders carry the requests as with the launchers."""
    cases = _cases_for_ops(kernel_device, monitor)
    op, args, n, site, want = cases[name]
    requests = _requests(n, I32, kernel_device)
    op(*args, requests)
    hit = hit_of(monitor, site)
    ids = [requests[j].item() for _, _, j in want]
    assert [tuple(o) for o in hit.offenders] == [
        (r, v, q if q >= 0 else None) for (r, v, _), q in zip(want, ids, strict=True)
    ]


def _cases_for_ops(dev: str, monitor) -> dict:
    from tripwire.kernels import ops  # noqa: F401  (registers torch.ops.tripwire)

    T = torch.ops.tripwire
    table = (torch.arange(12, dtype=I32).reshape(3, 4)).to(dev)
    return {
        "block_table": (
            T.block_table_gather,
            (table, ids([0, 5], dev), ids([4, 2, 1], dev), torch.zeros(2, 4, dtype=I32, device=dev),
             counters(bt.SITES, dev, monitor), True),
            2, bt.SITE_ROW.name, [(1, 5, 1)],
        ),
        "slot_mapping": (
            T.slot_mapping,
            (ids([0, 5, 1], dev, I64), ids([0, 1, 9], dev), table, torch.zeros(3, dtype=I64, device=dev),
             counters(sm.SITES, dev, monitor), 4, -1, True),
            3, sm.SITE_ROW.name, [(2, 9, 2)],
        ),
        "kv_zero": (
            T.kv_zero,
            (torch.zeros(4, 2, device=dev), ids([1, 7], dev), counters(kz.SITES, dev, monitor), True),
            2, kz.SITE.name, [(1, 7, 1)],
        ),
        "paged_gather": (
            T.paged_gather,
            (torch.zeros(4, 2, device=dev), ids([[0, 1], [-1, 2]], dev), torch.zeros(2, 2, 2, device=dev),
             counters(pg.SITES, dev, monitor), True),
            2, pg.SITE.name, [(2, -1, 1)],
        ),
        "state_copy": (
            T.state_copy,
            (torch.zeros(6, 2, device=dev), ids([[0, 1], [2, 3]], dev), ids([0, 3], dev), ids([0, 0], dev),
             ids([1, 1], dev), counters(sc.SITES, dev, monitor), True),
            2, sc.SITE_ROW.name, [(1, 3, 1)],
        ),
        "rope": (
            T.rope,
            (ids([0, 12], dev), torch.zeros(2, 1, 4, device=dev), torch.zeros(2, 1, 4, device=dev),
             torch.zeros(5, 4, device=dev), torch.zeros(2, 1, 4, device=dev), torch.zeros(2, 1, 4, device=dev),
             counters(rp.SITES, dev, monitor), True),
            2, rp.SITE.name, [(1, 12, 1)],
        ),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- sm_90 builds
_KERNELS_PROBE = r"""
import json
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.errors import CompilationError

import tests_kernels_cases as cases  # written next to this probe
from tripwire.resources import capture_launches

TYPES = {torch.int32: "i32", torch.int64: "i64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

def signature(fn, args, kw):
    sig, consts = {}, {}
    for i, p in enumerate(fn.params):
        v = args[i] if i < len(args) else kw[p.name]
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            consts[(i,)] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
        else:
            sig[p.name] = "fp32"
    return sig, consts

try:
    out = {}
    # Each launch recorded instead of run (there is no GPU here): the launchers run as in an engine, with CPU
    # tensors, and every argument they pass is captured with its type.
    for name, has_req, call in cases.run_all():
        for launch in capture_launches(call):
            fn, args, kw = launch.fn, launch.args, launch.kwargs
            sig, consts = signature(fn, args, kw)
            opts = {k: kw[k] for k in ("num_warps", "num_stages") if k in kw}
            c = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=opts)
            key = f"{name}/{fn.__name__}/{'req' if has_req else 'noreq'}"
            out[key] = {"cas": c.asm["ptx"].count(".cas.b64")}
except CompilationError:
    raise  # a kernel that does not compile is a failure, never a skip
except Exception as e:
    out = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
print(json.dumps(out))
"""

_KERNELS_CASES = r"""
import torch
import tripwire
from tripwire.kernels import block_table as bt, counters, decode_attention as da, kv_zero as kz
from tripwire.kernels import paged_gather as pg, rope as rp, slot_mapping as sm, state_copy as sc

mon = tripwire.Monitor(registry=tripwire.SiteRegistry(capacity=64), capacity=64, mode="off")
i32 = torch.int32

def z(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)

def launchers(req):
    yield "block_table", lambda r: bt.block_table_gather(
        z(3, 4, dtype=i32), z(2, dtype=i32), z(3, dtype=i32), z(2, 4, dtype=i32), ctr=counters(bt.SITES, "cpu", mon),
        requests=r(2))
    yield "slot_mapping", lambda r: sm.slot_mapping(
        z(5, dtype=i32), z(5, dtype=i32), z(3, 4, dtype=i32), z(5, dtype=torch.int64), 16, num_kv_blocks=8,
        ctr=counters(sm.SITES, "cpu", mon), requests=r(5))
    yield "kv_zero", lambda r: kz.kv_zero(z(4, 2, 16), z(3, dtype=i32), ctr=counters(kz.SITES, "cpu", mon),
                                          requests=r(3))
    yield "paged_gather", lambda r: pg.paged_gather(
        z(4, 2, 16, dtype=torch.bfloat16), z(2, 3, dtype=i32), z(2, 3, 2, 16, dtype=torch.bfloat16),
        ctr=counters(pg.SITES, "cpu", mon), requests=r(2))
    yield "state_copy", lambda r: sc.state_copy(
        z(6, 64), z(3, 2, dtype=i32), z(2, dtype=i32), z(2, dtype=i32), z(2, dtype=i32),
        ctr=counters(sc.SITES, "cpu", mon), requests=r(2))
    yield "rope", lambda r: rp.rope(
        z(3, dtype=torch.int64), z(3, 4, 64, dtype=torch.bfloat16), z(3, 2, 64, dtype=torch.bfloat16), z(8, 64),
        z(3, 4, 64, dtype=torch.bfloat16), z(3, 2, 64, dtype=torch.bfloat16), ctr=counters(rp.SITES, "cpu", mon),
        requests=r(3))
    q = z(2, 8, 64, dtype=torch.bfloat16)
    kv = z(6, 16, 2, 64, dtype=torch.bfloat16)
    table = z(2, 3, dtype=i32)
    ws = da.alloc_workspace(q, table, 16, 2, num_splits=2)
    yield "decode_attention", lambda r: da.decode_attention(
        q, kv, kv, table, z(2, dtype=i32), torch.empty_like(q), workspace=ws, ctr=counters(da.SITES, "cpu", mon),
        requests=r(2))

def run_all():
    for has_req in (False, True):
        def r(n):
            return torch.arange(n, dtype=torch.int64) if has_req else None
        for name, launch in launchers(has_req):
            yield name, has_req, lambda launch=launch, r=r: launch(r)
"""


def test_every_kernel_compiles_for_sm90_with_and_without_requests(build_probe, tmp_path):
    """Each reference kernel, launched by its own launcher (the launch captured, not run) and compiled for sm_90
    (no GPU needed), with and without a request map: all compile, the guarded ones with their fault path's
    compare-and-swaps. The interpreter runs code the compiler refuses (tests/triton/test_triton.py has the control), so the
    CPU tests alone cannot show this."""
    (tmp_path / "tests_kernels_cases.py").write_text(_KERNELS_CASES)
    r = build_probe(f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n" + _KERNELS_PROBE)
    names = {"block_table", "slot_mapping", "kv_zero", "paged_gather", "state_copy", "rope", "decode_attention"}
    for req in ("req", "noreq"):
        built = {k.split("/")[0] for k in r if k.endswith("/" + req)}
        assert built == names, (req, sorted(r))
    guarded = {k: v for k, v in r.items() if "_decode_reduce" not in k}
    assert all(v["cas"] >= 2 for v in guarded.values()), guarded
