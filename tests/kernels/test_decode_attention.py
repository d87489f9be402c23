"""The split-K paged decode attention (``tripwire.kernels.decode_attention``) against a float32 torch reference:
valid metadata (GQA and MHA, bfloat16 and float16, block sizes 16 and 32, head sizes 64 and 128, one split and
several; the unguarded twin identical), masked pages (bad ids in used columns counted once per entry across head and
split programs, bad ids past a sequence's length ignored), bad lengths, an all-bad sequence (finite zeros), launcher
errors, and the control: the unguarded twin on an id that lands inside a neighbouring allocation silently attends
over someone else's keys and counts nothing.

On the GPU (``gpu`` marks): the compiled kernel at a larger shape with exact counts, and graph replay N x counting
N x. The CI build check compiles the guarded kernel and its twin for sm_90 (no GPU needed) and compares their
registers and shared memory: the guard must not cost occupancy.
"""

from __future__ import annotations

import math

import pytest
import torch

from tripwire.kernels import counters
from tripwire.kernels import decode_attention as da

I32, I64 = torch.int32, torch.int64
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def make_case(dev, *, B=4, Hq=8, Hkv=2, D=64, BS=16, N=20, W=5, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(dtype).to(dev)
    k = torch.randn(N, BS, Hkv, D, generator=g).to(dtype).to(dev)
    v = torch.randn(N, BS, Hkv, D, generator=g).to(dtype).to(dev)
    table = torch.randperm(N, generator=g)[: B * W].reshape(B, W).to(I32) if B * W <= N else None
    if table is None:
        table = torch.randint(0, N, (B, W), generator=g, dtype=I32)
    lens = torch.randint(0, W * BS + 1, (B,), generator=g, dtype=I32)
    lens[0] = W * BS  # one full sequence, one empty, one ending inside a page
    if B > 1:
        lens[1] = 0
    if B > 2:
        lens[2] = BS + 3
    return q, k, v, table.to(dev), lens.to(dev)


def run(q, k, v, table, lens, ctr, *, splits=1, guard=True, config=None, requests=None):
    out = torch.full_like(q, 7.0)
    ws = da.alloc_workspace(q, table, k.shape[1], k.shape[2], num_splits=splits)
    da.decode_attention(q, k, v, table, lens, out, workspace=ws, ctr=ctr, guard=guard, config=config, requests=requests)
    return out


# ---------------------------------------------------------------------------------------------- valid metadata
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("BS", [16, 32])
@pytest.mark.parametrize("D", [64, 128])
def test_matches_reference(kernel_device, monitor, dtype, heads, BS, D):
    Hq, Hkv = heads
    q, k, v, table, lens = make_case(kernel_device, Hq=Hq, Hkv=Hkv, D=D, BS=BS, dtype=dtype, W=4)
    ref, ph, lh = da.decode_attention_reference(q, k, v, table, lens)
    assert ph == [] and lh == []
    ctr = counters(da.SITES, kernel_device, monitor)
    # Two splits over 4 pages (the reduce kernel), and one split written straight into out.
    for splits in (2, 1):
        out = run(q, k, v, table, lens, ctr, splits=splits, config=da.Config(block_n=16))
        torch.testing.assert_close(out.cpu(), ref, **TOL[dtype])
        twin = run(q, k, v, table, lens, ctr, splits=splits, guard=False, config=da.Config(block_n=16))
        assert torch.equal(out, twin)
    assert out[1].abs().sum() == 0  # the empty sequence
    assert ctr[..., :7].cpu().abs().sum() == 0  # slot 7 is layout (the offender block)


def test_scale_and_default_splits(kernel_device, monitor):
    q, k, v, table, lens = make_case(kernel_device, B=2, W=32, N=70, D=64)
    ctr = counters(da.SITES, kernel_device, monitor)
    ref, _, _ = da.decode_attention_reference(q, k, v, table, lens, scale=0.3)
    out = torch.empty_like(q)
    ws = da.alloc_workspace(q, table, 16, 2)  # the heuristic's split count: 512 tokens, 2 splits of 256
    assert ws is not None and ws.out.shape[2] == da.default_splits(2, 2, 8, 32, 16, kernel_device) == 2
    da.decode_attention(q, k, v, table, lens, out, workspace=ws, scale=0.3, ctr=ctr)
    torch.testing.assert_close(out.cpu(), ref, **TOL[q.dtype])
    assert da.default_splits(256, 8, 32, 128, 16, "cpu") == 1  # the batch alone fills the device: no reduce
    assert da.default_splits(1, 1, 1, 4, 16, "cpu") == 1  # 64 tokens: not worth splitting
    assert da.default_splits(1, 1, 1, 1024, 16, "cpu") == 64


# ---------------------------------------------------------------------------------------------- masked pages
def _corrupt(table, lens, N, BS):
    W = table.shape[1]
    table[0, 1] = N  # == the pool size
    table[0, 4] = -1
    table[2, 0] = INT32_MAX
    table[2, 1] = INT32_MIN  # sequence 2 has BS + 3 tokens: columns 0 and 1 are both used
    table[2, 3] = N + 5  # past sequence 2's length: padding, neither read nor counted
    table[3, 2] = 10**6
    lens[3] = W * BS - 1
    return table, lens


@pytest.mark.parametrize("splits", [1, 3])
def test_masked_pages_count_once_per_entry(kernel_device, monitor, splits, guard_row):
    """Bad ids in used columns: each counted once although 2 KV-head programs (and, with 3 splits, several split
    programs of the sequence) run; the output attends over the remaining tokens exactly like the reference."""
    N, BS = 20, 16
    q, k, v, table, lens = make_case(kernel_device, N=N, BS=BS, W=5)
    table, lens = _corrupt(table, lens, N, BS)
    ref, ph, lh = da.decode_attention_reference(q, k, v, table, lens)
    assert ph == [(0, N), (0, -1), (2, INT32_MAX), (2, INT32_MIN), (3, 10**6)] and lh == []
    ctr = counters(da.SITES, kernel_device, monitor)
    out = run(q, k, v, table, lens, ctr, splits=splits, config=da.Config(block_n=16))
    torch.testing.assert_close(out.cpu(), ref, **TOL[q.dtype])
    guard_row(ctr[0], ph)
    guard_row(ctr[1], lh)
    assert torch.isfinite(out).all()


def test_bad_lengths_mask_the_sequence(kernel_device, monitor, guard_row):
    N, BS, W = 20, 16, 5
    q, k, v, table, lens = make_case(kernel_device, N=N, BS=BS, W=W)
    table[1, 0] = -7  # sequence 1's length is bad: its pages are not checked either
    lens[1] = W * BS + 1
    lens[3] = -1
    ref, ph, lh = da.decode_attention_reference(q, k, v, table, lens)
    assert ph == [] and lh == [(1, W * BS + 1), (3, -1)]
    ctr = counters(da.SITES, kernel_device, monitor)
    out = run(q, k, v, table, lens, ctr, splits=2, config=da.Config(block_n=16))
    torch.testing.assert_close(out.cpu(), ref, **TOL[q.dtype])
    assert out[[1, 3]].abs().sum() == 0
    guard_row(ctr[0], [])
    guard_row(ctr[1], lh)


@pytest.mark.parametrize("splits", [1, 4])
def test_all_bad_sequence_is_finite(kernel_device, monitor, splits, guard_row):
    """Every page of sequence 0 bad: every split of it is fully masked; the output is zeros, not NaN. The other
    sequences are untouched (identical to a run where sequence 0 is valid)."""
    N, BS, W = 20, 16, 4
    q, k, v, table, lens = make_case(kernel_device, N=N, BS=BS, W=W)
    ctr = counters(da.SITES, kernel_device, monitor)
    clean = run(q, k, v, table, lens, ctr, splits=splits, config=da.Config(block_n=16))
    table[0] = torch.tensor([N, -1, N + 1, INT32_MAX], dtype=I32)
    out = run(q, k, v, table, lens, ctr, splits=splits, config=da.Config(block_n=16))
    assert torch.isfinite(out).all()
    assert out[0].abs().sum() == 0
    assert torch.equal(out[1:], clean[1:])
    guard_row(ctr[0], [(0, N), (0, -1), (0, N + 1), (0, INT32_MAX)])


def test_control_plain_masked_softmax_is_nan():
    """Control for the finiteness checks: masking with -inf and a plain softmax (what a kernel without the running
    max's guard computes for a fully masked split) gives NaN, so ``isfinite`` can fail."""
    s = torch.full((4,), float("-inf"))
    assert torch.isnan(torch.softmax(s, dim=0)).all()
    m = s.max()
    assert torch.isnan(torch.exp2(s - m)).all()  # exp2(-inf - -inf)


def test_control_unguarded_twin_reads_a_neighbour(kernel_device, monitor, guard_row):
    """The bug class: page id N lands in the allocation after the cache (here: the next page of a larger buffer).
    The twin attends over it silently and counts nothing; the guard leaves it out and counts it."""
    N, BS, W = 6, 16, 2
    q, k, v, table, lens = make_case(kernel_device, B=1, N=N + 1, BS=BS, W=W)
    kc, vc = k[:N], v[:N]  # the cache is the first N pages; page N is someone else's
    table = torch.tensor([[2, N]], dtype=I32, device=kernel_device)
    lens = torch.tensor([W * BS], dtype=I32, device=kernel_device)
    ctr = counters(da.SITES, kernel_device, monitor)
    ref, ph, _ = da.decode_attention_reference(q, kc, vc, table, lens)
    assert ph == [(0, N)]
    twin = run(q, kc, vc, table, lens, ctr, guard=False, config=da.Config(block_n=16))
    assert ctr[..., :7].cpu().abs().sum() == 0  # slot 7 is layout (the offender block)  # nobody was told
    with_neighbour, _, _ = da.decode_attention_reference(q, k, v, table, lens)
    torch.testing.assert_close(twin.cpu(), with_neighbour, **TOL[q.dtype])  # it read the neighbour's keys
    assert (twin.cpu().float() - ref.float()).abs().max() > 0.1
    out = run(q, kc, vc, table, lens, ctr, config=da.Config(block_n=16))
    torch.testing.assert_close(out.cpu(), ref, **TOL[q.dtype])
    guard_row(ctr[0], [(0, N)])


# ---------------------------------------------------------------------------------------------- request maps
@pytest.mark.parametrize("req_dtype", [I32, I64, None], ids=["req32", "req64", "no-map"])
@pytest.mark.parametrize("splits", [1, 3])
def test_request_map_names_the_sequences(kernel_device, monitor, hit_of, splits, req_dtype):
    """Bad pages in sequences 0, 2 and 3 and a bad length in sequence 1, read by 2 KV-head programs and (3 splits)
    several split programs: each offender once, with its sequence's request from the map (None without a map: the
    control), counts exact, the output unchanged by the map."""
    N, BS = 20, 16
    q, k, v, table, lens = make_case(kernel_device, N=N, BS=BS, W=5)
    table, lens = _corrupt(table, lens, N, BS)
    lens[1] = 5 * BS + 1
    ref, ph, lh = da.decode_attention_reference(q, k, v, table, lens)
    assert len(ph) == 5 and lh == [(1, 5 * BS + 1)]
    requests = None if req_dtype is None else torch.tensor([70, -71, 72, 2**31 - 1], dtype=req_dtype).to(q.device)
    # A negative id means "no request" (tripwire.triton): kept as None.
    want = [None] * 4 if requests is None else [q if q >= 0 else None for q in requests.cpu().tolist()]
    ctr = counters(da.SITES, kernel_device, monitor)
    out = run(q, k, v, table, lens, ctr, splits=splits, config=da.Config(block_n=16), requests=requests)
    torch.testing.assert_close(out.cpu(), ref, **TOL[q.dtype])
    for site, hits in ((da.SITE_PAGE, ph), (da.SITE_SEQ_LEN, lh)):
        hit = hit_of(monitor, site.name)
        assert hit.count == len(hits)
        assert sorted(map(tuple, hit.offenders), key=str) == sorted(((b, x, want[b]) for b, x in hits), key=str)


def test_bad_request_map_is_refused(kernel_device, monitor):
    q, k, v, table, lens = make_case(kernel_device, B=2, W=2)
    ctr = counters(da.SITES, kernel_device, monitor)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match=r"one request id per sequence\) must have shape \[2\], got \[3\]"):
        da.decode_attention(q, k, v, table, lens, out, ctr=ctr, requests=torch.zeros(3, dtype=I32))
    with pytest.raises(TypeError, match=r"one request id per sequence\) must have dtype int32 or int64"):
        da.decode_attention(q, k, v, table, lens, out, ctr=ctr, requests=torch.zeros(2))


def test_op_takes_the_request_map(kernel_device, monitor, hit_of):
    from tripwire.kernels import ops  # noqa: F401  (registers torch.ops.tripwire)

    q, k, v, table, lens = make_case(kernel_device, B=2, W=2, N=8)
    table[1, 0] = 8
    lens[1] = 20
    ctr = counters(da.SITES, kernel_device, monitor)
    out = torch.empty_like(q)
    requests = torch.tensor([5, 6], dtype=I64, device=kernel_device)
    torch.ops.tripwire.decode_attention(q, k, v, table, lens, out, None, None, ctr, -1.0, True, requests)
    assert [tuple(o) for o in hit_of(monitor, da.SITE_PAGE.name).offenders] == [(1, 8, 6)]


# ---------------------------------------------------------------------------------------------- launcher errors
def test_launcher_errors(kernel_device, monitor):
    dev = kernel_device
    q, k, v, table, lens = make_case(dev, B=2, W=2)
    out = torch.empty_like(q)
    ctr = counters(da.SITES, dev, monitor)

    def call(**kw):
        args = dict(q=q, k_cache=k, v_cache=v, block_table=table, seq_lens=lens, out=out)
        opts = {key: kw.pop(key) for key in list(kw) if key in ("workspace", "scale", "config", "ctr")}
        args.update(kw)
        return da.decode_attention(**args, ctr=opts.pop("ctr", ctr), **opts)

    with pytest.raises(TypeError, match="q must have dtype bfloat16 or float16"):
        call(q=q.float(), out=out.float())
    with pytest.raises(TypeError, match="v_cache must have dtype bfloat16"):
        call(v_cache=v.half())
    with pytest.raises(ValueError, match="multiple of the caches' 3 KV heads"):
        call(
            k_cache=k[:, :, :1].expand(-1, -1, 3, -1).contiguous(),
            v_cache=v[:, :, :1].expand(-1, -1, 3, -1).contiguous(),
        )
    with pytest.raises(ValueError, match="head size must be a power of two"):
        call(
            q=q[..., :48].contiguous(),
            out=out[..., :48].contiguous(),
            k_cache=k[..., :48].contiguous(),
            v_cache=v[..., :48].contiguous(),
        )
    with pytest.raises(ValueError, match=r"block size .* must be a power of two"):
        call(k_cache=k[:, :12].contiguous(), v_cache=v[:, :12].contiguous())
    with pytest.raises(ValueError, match="block_table must have one row per sequence"):
        call(block_table=table[:1].contiguous())
    with pytest.raises(ValueError, match=r"seq_lens must have shape \[2\]"):
        call(seq_lens=lens[:1].contiguous())
    with pytest.raises(TypeError, match="seq_lens must have dtype int32 or int64"):
        call(seq_lens=lens.float())
    with pytest.raises(ValueError, match="block_table must be contiguous"):
        call(block_table=table.t().contiguous().t())
    with pytest.raises(ValueError, match="scale must be a finite float"):
        call(scale=float("nan"))
    with pytest.raises(ValueError, match=r"workspace.lse must have shape \[2, 8, 3\]"):
        ws = da.alloc_workspace(q, table, 16, 2, num_splits=3)
        call(workspace=da.Workspace(ws.out, ws.lse[:, :, :2].contiguous()))
    with pytest.raises(TypeError, match=r"workspace must be a decode_attention\.Workspace"):
        call(workspace=torch.zeros(1))
    with pytest.raises(ValueError, match=r"ctr must have shape \[2, 8\]"):
        call(ctr=ctr[0])
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        da.alloc_workspace(q, table, 16, 2, num_splits=0)
    with pytest.raises(ValueError, match=r"Config\.block_n must be a power of two >= 16"):
        da.Config(block_n=24)
    with pytest.raises(ValueError, match=r"Config\.num_stages must be a positive int"):
        da.Config(num_stages=0)
    with pytest.raises(TypeError, match=r"config must be a decode_attention\.Config"):
        call(config={"block_n": 16})
    assert da.alloc_workspace(q, table, 16, 2, num_splits=1) is None


def test_empty_batch(kernel_device, monitor):
    q = torch.empty(0, 4, 64, dtype=torch.bfloat16, device=kernel_device)
    k = torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16, device=kernel_device)
    table = torch.zeros(0, 2, dtype=I32, device=kernel_device)
    lens = torch.zeros(0, dtype=I32, device=kernel_device)
    out = torch.empty_like(q)
    da.decode_attention(q, k, k, table, lens, out, ctr=counters(da.SITES, kernel_device, monitor))


def test_sites():
    assert [s.name for s in da.SITES] == ["kernels.decode_attention.page", "kernels.decode_attention.seq_len"]
    assert not any(s.fatal for s in da.SITES)
    assert da.SITES[1].id == da.SITES[0].id + 1


# ---------------------------------------------------------------------------------------------- sm_90 build
_BUILD_PROBE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tripwire.kernels import decode_attention as da

import torch
from tripwire import Monitor, SiteRegistry
from tripwire import resources as rs
from tripwire.kernels import counters

CFG = da.Config()  # the launcher's default shape


def launched():
    # decode_attention's split kernel as the launcher launches it (recorded, not run: CPU tensors of the shape
    # below): the JITFunction and the launch's own fault-path tile.
    mon = Monitor(registry=SiteRegistry(capacity=8), capacity=8, mode="off")
    q = torch.zeros(2, 16, 128, dtype=torch.bfloat16)
    kv = torch.zeros(8, 16, 4, 128, dtype=torch.bfloat16)
    table, lens = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    ctr = counters(da.SITES, "cpu", mon)
    (launch,) = rs.capture_launches(lambda: da.decode_attention(q, kv, kv, table, lens, torch.empty_like(q), ctr=ctr))
    return launch.fn, launch.kwargs["FAULT_BLOCK_N"]


KERNEL, FAULT_BLOCK_N = launched()


def build(guard, fault_block_n, block_n=CFG.block_n, stages=CFG.num_stages, warps=CFG.num_warps, has_req=False):
    k = KERNEL
    names = k.arg_names
    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "table_ptr": "*i32", "lens_ptr": "*i32",
             "out_ptr": "*bf16", "pout_ptr": "*fp32", "plse_ptr": "*fp32", "ctr_ptr": "*i64", "req_ptr": "*i64",
             "W": "i32",
             "N": "i32", "Hq": "i32", "S": "i32", "pages_per_split": "i32", "qk_scale": "fp32", "Hkv": "i32"}
    consts = dict(G=4, BLOCK_H=16, HEAD_TILES=1, BS=16, BLOCK_N=block_n, BLOCK_P=128, D=128, STAGES=stages,
                  SPLIT=False, GUARD=guard, DOT_F32=False, FAULT_BLOCK_N=fault_block_n, HAS_REQ=has_req)
    sig = {n: types.get(n, "constexpr") for n in names}
    # What a launch with torch's (256-byte aligned) tensors specialises: pointers divisible by 16.
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if types.get(n, "").startswith("*")}
    src = ASTSource(k, sig, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    use = sm90_usage(c, warps)
    return {"regs": use["regs"], "smem": use["smem"], "occupancy": use["programs_per_sm"],
            "cp_async": c.asm["ptx"].count("cp.async.cg.shared.global")}

from triton.compiler.errors import CompilationError

try:
    out = {"twin": build(False, 16), "guarded": build(True, FAULT_BLOCK_N), "control": build(True, 64),
           "guarded_req": build(True, FAULT_BLOCK_N, has_req=True)}
except CompilationError:
    raise  # the kernel does not compile: a failure, never a skip
except Exception as e:
    out = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
print(json.dumps(out))
"""


def test_sm90_build_guard_costs_no_occupancy(build_probe):
    """Compiled ahead of time for an H100/H200 (sm_90; no GPU needed), at the launcher's default shape: the guarded
    kernel, with and without a request map, fits as many programs per SM as the twin (registers and shared memory),
    and its hot loop is pipelined like the twin's (16-byte async copies of K and V). Registers are allocated for a
    kernel's worst path, so the fault path must not be the hungrier one. Control: a fault loop shaped like the hot
    one (64-token tiles) needs so many more registers that fewer programs fit, so the comparison can fail."""
    r = build_probe(_BUILD_PROBE)
    twin, control = r["twin"], r["control"]
    for guarded in (r["guarded"], r["guarded_req"]):  # without and with a request map
        assert guarded["occupancy"] == twin["occupancy"] and guarded["smem"] == twin["smem"], r
        assert twin["cp_async"] > 0 and guarded["cp_async"] == twin["cp_async"], r
    assert control["occupancy"] < twin["occupancy"], r


# ---------------------------------------------------------------------------------------------- GPU only
def _gpu_case(B=64, Hq=32, Hkv=8, D=128, BS=16, W=64, N=None):
    dev = "cuda"
    N = N or B * W + 16
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, Hq, D, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(N, BS, Hkv, D, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn(N, BS, Hkv, D, device=dev, generator=g, dtype=torch.bfloat16)
    table = torch.randperm(N, device=dev, generator=g)[: B * W].reshape(B, W).to(I32)
    lens = torch.randint(1, W * BS + 1, (B,), device=dev, generator=g, dtype=I32)
    return q, k, v, table, lens, N


def _gpu_corrupt(table, lens, N, BS):
    """Bad ids in used columns of several sequences (several bad entries in one split), a bad length, and a bad
    id past a sequence's length (in place; the reference gives the expected hits)."""
    W = table.shape[1]
    lens[3] = W * BS
    lens[5] = W * BS
    table[3, 0] = N
    table[3, 1] = -1
    table[3, 2] = INT32_MAX
    table[5, W - 1] = INT32_MIN
    table[7, 0] = N + 100
    lens[7] = 1
    table[7, 5] = -5  # past sequence 7's one token: padding
    lens[9] = W * BS + 1


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("heads", [(32, 8), (16, 16)], ids=["gqa", "mha"])
def test_gpu_compiled_exact_counts(monitor, splits, heads, guard_row):
    Hq, Hkv = heads
    q, k, v, table, lens, N = _gpu_case(Hq=Hq, Hkv=Hkv)
    _gpu_corrupt(table, lens, N, 16)
    monitor.prealloc("cuda")
    ctr = counters(da.SITES, "cuda", monitor)
    ref, ph, lh = da.decode_attention_reference(q, k, v, table, lens)
    assert len(ph) == 5 and lh == [(9, table.shape[1] * 16 + 1)]
    out = run(q, k, v, table, lens, ctr, splits=splits)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu(), ref, atol=2e-2, rtol=2e-2)
    guard_row(ctr[0], ph)
    guard_row(ctr[1], lh)
    # The twin on the valid rows only is identical to the guarded kernel there.
    ok_rows = [b for b in range(q.shape[0]) if b not in (3, 5, 7, 9)]
    qv, tv, lv = q[ok_rows].contiguous(), table[ok_rows].contiguous(), lens[ok_rows].contiguous()
    twin = run(qv, k, v, tv, lv, ctr, splits=splits, guard=False)
    assert torch.equal(twin, out[ok_rows])


@pytest.mark.gpu
def test_gpu_graph_replay_counts_n_times(monitor, captured):
    q, k, v, table, lens, N = _gpu_case()
    _gpu_corrupt(table, lens, N, 16)
    monitor.prealloc("cuda")
    ctr = counters(da.SITES, "cuda", monitor)
    _, ph, lh = da.decode_attention_reference(q, k, v, table, lens)
    out = torch.empty_like(q)
    ws = da.alloc_workspace(q, table, 16, 8, num_splits=4)
    graph = captured(lambda: da.decode_attention(q, k, v, table, lens, out, workspace=ws, ctr=ctr), monitor)
    ref = out.clone()
    n = 25
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    assert ctr[:, 0].tolist() == [n * len(ph), n * len(lh)]
    assert torch.equal(out, ref)
    assert math.isfinite(float(out.float().abs().max()))
