"""The reference kernels as torch.library custom ops: registration and opcheck (schema, fake impls, declared
mutations) on every op; torch.compile(fullgraph=True) with exact counts on the CPU (interpreter); on the GPU,
fullgraph and mode="reduce-overhead" (lazily recorded CUDA graphs) with exact counts while the reader ticks at 1 ms."""

from __future__ import annotations

import pytest
import torch

from tripwire.kernels import block_table as bt
from tripwire.kernels import counters, ops
from tripwire.kernels import decode_attention as da
from tripwire.kernels import kv_zero as kz
from tripwire.kernels import paged_gather as pg
from tripwire.kernels import rope as rp
from tripwire.kernels import slot_mapping as sm
from tripwire.kernels import state_copy as sc

I32, I64 = torch.int32, torch.int64
T = torch.ops.tripwire


def _cases(dev: str, monitor):
    """(op, args) with corrupted metadata for every op."""
    t = torch.tensor
    table = (torch.arange(12, dtype=I32).reshape(3, 4)).to(dev)
    return {
        "block_table_gather": (
            T.block_table_gather.default,
            (
                table,
                t([0, 5, 2], dtype=I32, device=dev),
                t([4, 2, 9], dtype=I32, device=dev),
                torch.zeros(3, 4, dtype=I32, device=dev),
                counters(bt.SITES, dev, monitor),
                True,
            ),
        ),
        "slot_mapping": (
            T.slot_mapping.default,
            (
                t([0, 5, -1, 40], device=dev),
                t([0, 1, 2, 7], dtype=I32, device=dev),
                table,
                torch.zeros(4, dtype=I64, device=dev),
                counters(sm.SITES, dev, monitor),
                4,
                10,
                True,
            ),
        ),
        "kv_zero": (
            T.kv_zero.default,
            (
                torch.randn(4, 6, device=dev),
                t([1, 4, -2], dtype=I32, device=dev),
                counters(kz.SITES, dev, monitor),
                True,
            ),
        ),
        "paged_gather": (
            T.paged_gather.default,
            (
                torch.randn(4, 6, device=dev),
                t([[0, 4], [-1, 3]], dtype=I32, device=dev),
                torch.zeros(2, 2, 6, device=dev),
                counters(pg.SITES, dev, monitor),
                True,
            ),
        ),
        "state_copy": (
            T.state_copy.default,
            (
                torch.randn(6, 5, device=dev),
                t([[0, 1], [2, 3], [4, 5]], dtype=I32, device=dev),
                t([0, 7, 2], dtype=I32, device=dev),
                t([0, 0, 1], dtype=I32, device=dev),
                t([1, 1, 0], dtype=I32, device=dev),
                counters(sc.SITES, dev, monitor),
                True,
            ),
        ),
        "decode_attention": (
            T.decode_attention.default,
            (
                torch.randn(2, 4, 16, device=dev).to(torch.bfloat16),
                torch.randn(5, 16, 2, 16, device=dev).to(torch.bfloat16),
                torch.randn(5, 16, 2, 16, device=dev).to(torch.bfloat16),
                t([[0, 5, 1], [2, -1, 9]], dtype=I32, device=dev),  # 2 bad used ids; 9 is past sequence 1
                t([40, 20], dtype=I32, device=dev),
                torch.zeros(2, 4, 16, device=dev).to(torch.bfloat16),
                torch.zeros(2, 4, 2, 16, device=dev),
                torch.zeros(2, 4, 2, device=dev),
                counters(da.SITES, dev, monitor),
                -1.0,
                True,
            ),
        ),
        "rope": (
            T.rope.default,
            (
                t([0, 9, 2], device=dev),
                torch.randn(3, 2, 8, device=dev),
                torch.randn(3, 1, 8, device=dev),
                torch.randn(5, 8, device=dev),
                torch.zeros(3, 2, 8, device=dev),
                torch.zeros(3, 1, 8, device=dev),
                counters(rp.SITES, dev, monitor),
                True,
            ),
        ),
    }


@pytest.mark.parametrize(
    "name", ["block_table_gather", "slot_mapping", "kv_zero", "paged_gather", "state_copy", "rope", "decode_attention"]
)
def test_opcheck(kernel_device, monitor, name):
    op, args = _cases(kernel_device, monitor)[name]
    assert op is getattr(ops, name)._opoverload
    # schema (mutations declared), fake impl, autograd registration, AOT dispatch
    torch.library.opcheck(op, args)


def test_ops_count_like_the_launchers(kernel_device, monitor):
    expected = {
        "block_table_gather": [1, 1],
        "slot_mapping": [1, 2, 0],
        "kv_zero": [2],
        "paged_gather": [2],
        "state_copy": [1, 0, 0],
        "rope": [1],
        "decode_attention": [2, 0],
    }
    for name, (op, args) in _cases(kernel_device, monitor).items():
        ctr = next(a for a in args if isinstance(a, torch.Tensor) and a.dtype == I64 and a.shape[-1] == 8)
        op(*args)
        got = ctr.reshape(-1, 8)[:, 0].tolist()
        assert got == expected[name], name


def test_fake_impl_refuses_a_wrong_counter(kernel_device, monitor):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        pool = torch.empty(4, 6)
        with pytest.raises(ValueError, match=r"ctr must be int64 \[1, 8\]"):
            T.kv_zero(pool, torch.empty(2, dtype=I32), torch.empty(2, 8, dtype=I64), True)


def _compiled_step(ctr_sm, ctr_pg):
    def step(pos, rows, table, slots, cache, out):
        T.slot_mapping(pos, rows, table, slots, ctr_sm, 4, 10, True)
        T.paged_gather(cache, table, out, ctr_pg, True)
        return out.sum() + slots.sum()

    return step


def _step_inputs(dev: str):
    table = torch.tensor([[0, 1, 2], [3, 11, -4]], dtype=I32, device=dev)  # 2 bad page ids
    # columns 0, 1, 3 (bad), -1 (bad); token 1 reads block 11 (bad)
    pos = torch.tensor([0, 5, 13, -1], dtype=I64, device=dev)
    rows = torch.tensor([0, 1, 1, 2], dtype=I32, device=dev)  # row 2 bad
    slots = torch.zeros(4, dtype=I64, device=dev)
    cache = torch.randn(10, 2, 4, device=dev)
    out = torch.zeros(2, 3, 2, 4, device=dev)
    return pos, rows, table, slots, cache, out


def test_compile_fullgraph_counts_exactly(kernel_device, monitor):
    """torch.compile(fullgraph=True) keeps every guarded op and its counts: N calls -> N x the bad entries. On the CPU
    the ops fall back to the interpreter; the graph around them is compiled by inductor."""
    torch._dynamo.reset()
    ctr_sm = counters(sm.SITES, kernel_device, monitor)
    ctr_pg = counters(pg.SITES, kernel_device, monitor)
    args = _step_inputs(kernel_device)
    compiled = torch.compile(_compiled_step(ctr_sm, ctr_pg), fullgraph=True)
    n = 3
    for _ in range(n):
        compiled(*args)
    assert ctr_sm[:, 0].tolist() == [n * 1, n * 2, n * 1]
    assert ctr_pg[0].item() == n * 2
    ref_slots, _ = sm.slot_mapping_reference(args[0], args[1], args[2], 4, 10)
    assert torch.equal(args[3].cpu(), ref_slots)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compile_gpu_exact_counts_with_reader_at_1ms(mode):
    """fullgraph and reduce-overhead on the GPU: exact counts, and a reader ticking every 1 ms while the CUDA-graph
    trees record lazily breaks no capture (the reader relaxes its capture mode)."""
    import tripwire

    torch._dynamo.reset()
    reg = tripwire.SiteRegistry(capacity=64)
    mon = tripwire.Monitor(registry=reg, capacity=64, mode="warn", interval=0.001, idle_tail=60.0)
    dev = "cuda"
    mon.prealloc(dev)
    ctr_sm = ops.static_counters(sm.SITES, dev, mon)
    ctr_pg = ops.static_counters(pg.SITES, dev, mon)
    args = _step_inputs(dev)
    mon.start()  # the reader ticks during dynamo/inductor and the lazy CUDA-graph recording
    try:
        compiled = torch.compile(_compiled_step(ctr_sm, ctr_pg), fullgraph=True, mode=mode)
        n = 20
        for _ in range(n):
            mon.check()
            compiled(*args)
        torch.cuda.synchronize()
        assert ctr_sm[:, 0].tolist() == [n * 1, n * 2, n * 1]
        assert ctr_pg.reshape(-1, 8)[0, 0].item() == n * 2
        assert mon.loop_errors == 0
        assert all(r.lost is None for r in mon.readers().values())
        mon.drain()
        assert mon.armed is None  # warn mode, non-fatal sites: nothing arms, nothing broke
    finally:
        mon.stop()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compile_decode_attention_gpu_exact_counts(mode):
    """The decode attention op under torch.compile (fullgraph; reduce-overhead records it into CUDA graphs, with
    the workspace and the counters as static inputs): N calls count N x the bad entries, the output equals the
    eager launcher's."""
    import tripwire

    torch._dynamo.reset()
    reg = tripwire.SiteRegistry(capacity=64)
    mon = tripwire.Monitor(registry=reg, capacity=64, mode="warn")
    dev = "cuda"
    mon.prealloc(dev)
    ctr = ops.static_counters(da.SITES, dev, mon)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(8, 8, 64, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(40, 16, 2, 64, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(40, 16, 2, 64, device=dev, generator=g).to(torch.bfloat16)
    table = torch.randperm(40, device=dev, generator=g)[:32].reshape(8, 4).to(I32)
    table[2, 1] = 40
    table[6, 0] = -3
    lens = torch.full((8,), 64, dtype=I32, device=dev)
    lens[4] = 65  # past the table's 4 x 16 tokens
    ws = da.alloc_workspace(q, table, 16, 2, num_splits=2)
    torch._dynamo.mark_static_address(ws.out)
    torch._dynamo.mark_static_address(ws.lse)
    out = torch.zeros_like(q)

    def step(q, k, v, table, lens, out, pout, plse):
        T.decode_attention(q, k, v, table, lens, out, pout, plse, ctr, -1.0, True)
        return out.float().sum()

    compiled = torch.compile(step, fullgraph=True, mode=mode)
    n = 10
    for _ in range(n):
        compiled(q, k, v, table, lens, out, ws.out, ws.lse)
    torch.cuda.synchronize()
    assert ctr[:, 0].tolist() == [n * 2, n * 1]
    eager = torch.zeros_like(q)
    da.decode_attention(q, k, v, table, lens, eager, workspace=ws, ctr=counters(da.SITES, dev, mon))
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    mon.stop()
