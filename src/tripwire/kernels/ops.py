"""The reference kernels as PyTorch custom ops (``torch.ops.tripwire.*``), for ``torch.compile``.

Each op wraps a launcher and declares what it writes in ``mutates_args``: its outputs AND the counter rows. That is
what keeps counts exact under ``torch.compile``: an op that mutated the arena behind the compiler's back could be
reordered, deduplicated or (having no declared effect) dropped; a declared mutation is kept and ordered. The fake
(meta) implementations check shapes and dtypes and return nothing, so ``fullgraph=True`` traces without running a
kernel, and ``mode="reduce-overhead"`` records the ops into its CUDA graphs like any other kernel.

The counter rows are explicit arguments here (``tripwire.kernels.counters(module.SITES, device)``): fetch them
once, outside the compiled function, after ``tripwire.prealloc``. The arena never moves, so for
``mode="reduce-overhead"`` call :func:`static_counters`, which also marks the rows as static addresses: a mutated
graph input that is not static would make the CUDA-graph trees copy it in and out (or skip graphing altogether),
whereas the arena's rows must be written in place for the reader to see them.

Ops (``ctr`` is the ``[8]`` or ``[n, 8]`` counter block of the module's SITES, in that order; every op also takes
a last, optional ``requests`` (``Tensor?``, default None): the launcher's request map, so callers that do not pass
it are unchanged):

* ``tripwire::block_table_gather(block_table, req_rows, block_counts, out!, ctr!, guard)``
* ``tripwire::slot_mapping(positions, token_rows, block_table, slots!, ctr!, block_size, num_kv_blocks, guard)``
  (``num_kv_blocks < 0`` = no block-id guard)
* ``tripwire::kv_zero(pool!, block_ids, ctr!, guard)``
* ``tripwire::paged_gather(cache, page_table, out!, ctr!, guard)``
* ``tripwire::state_copy(state!, block_table, rows, src_cols, dst_cols, ctr!, guard)``
* ``tripwire::rope(positions, q, k, cos_sin, q_out!, k_out!, ctr!, guard)`` (outputs must not alias inputs here)
* ``tripwire::decode_attention(q, k_cache, v_cache, block_table, seq_lens, out!, partial_out!?, partial_lse!?, ctr!,
  scale, guard)`` (the workspace's two tensors, both or neither; ``scale < 0`` = ``1 / sqrt(D)``)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..monitor import Monitor
from ..sites import Site
from . import block_table as _bt
from . import decode_attention as _da
from . import kv_zero as _kz
from . import paged_gather as _pg
from . import rope as _rope
from . import slot_mapping as _sm
from . import state_copy as _sc
from ._common import counters

__all__ = [
    "block_table_gather",
    "decode_attention",
    "kv_zero",
    "paged_gather",
    "rope",
    "slot_mapping",
    "state_copy",
    "static_counters",
]


def static_counters(
    sites: Sequence[Site], device: torch.device | str | int, monitor: Monitor | None = None
) -> torch.Tensor:
    """:func:`tripwire.kernels.counters`, marked as a static address for ``torch.compile(mode="reduce-overhead")``
    (the arena is allocated once and never moves, which is exactly what a static input promises). Call it outside
    the compiled function, after ``prealloc`` and before the first compiled call."""
    ctr = counters(sites, device, monitor)
    torch._dynamo.mark_static_address(ctr)
    return ctr


def _check_fake_ctr(ctr: torch.Tensor, n_sites: int) -> None:
    ok = ctr.dtype == torch.int64 and (tuple(ctr.shape) == (n_sites, 8) or (n_sites == 1 and tuple(ctr.shape) == (8,)))
    if not ok:
        raise ValueError(f"ctr must be int64 [{n_sites}, 8] (or [8] for one site), got {ctr.dtype} {list(ctr.shape)}")


# ---------------------------------------------------------------------------------------------- block table gather
@torch.library.custom_op("tripwire::block_table_gather", mutates_args=("out", "ctr"))
def block_table_gather(
    block_table: torch.Tensor,
    req_rows: torch.Tensor,
    block_counts: torch.Tensor,
    out: torch.Tensor,
    ctr: torch.Tensor,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    _bt.block_table_gather(block_table, req_rows, block_counts, out, guard=guard, ctr=ctr, requests=requests)


@block_table_gather.register_fake
def _(block_table, req_rows, block_counts, out, ctr, guard=True, requests=None):  # type: ignore[no-untyped-def]
    if tuple(out.shape) != (req_rows.shape[0], block_table.shape[1]) or out.dtype != block_table.dtype:
        raise ValueError(f"out must be {block_table.dtype} [{req_rows.shape[0]}, {block_table.shape[1]}]")
    _check_fake_ctr(ctr, len(_bt.SITES))


# ---------------------------------------------------------------------------------------------- slot mapping
@torch.library.custom_op("tripwire::slot_mapping", mutates_args=("slots", "ctr"))
def slot_mapping(
    positions: torch.Tensor,
    token_rows: torch.Tensor,
    block_table: torch.Tensor,
    slots: torch.Tensor,
    ctr: torch.Tensor,
    block_size: int,
    num_kv_blocks: int = -1,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    _sm.slot_mapping(
        positions,
        token_rows,
        block_table,
        slots,
        block_size,
        num_kv_blocks=None if num_kv_blocks < 0 else num_kv_blocks,
        guard=guard,
        ctr=ctr,
        requests=requests,
    )


@slot_mapping.register_fake
def _(positions, token_rows, block_table, slots, ctr, block_size, num_kv_blocks=-1, guard=True, requests=None):  # type: ignore[no-untyped-def]
    if tuple(slots.shape) != tuple(positions.shape) or slots.dtype != torch.int64:
        raise ValueError(f"slots must be int64 {list(positions.shape)}")
    _check_fake_ctr(ctr, len(_sm.SITES))


# ---------------------------------------------------------------------------------------------- KV block zeroer
@torch.library.custom_op("tripwire::kv_zero", mutates_args=("pool", "ctr"))
def kv_zero(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    ctr: torch.Tensor,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    _kz.kv_zero(pool, block_ids, guard=guard, ctr=ctr, requests=requests)


@kv_zero.register_fake
def _(pool, block_ids, ctr, guard=True, requests=None):  # type: ignore[no-untyped-def]
    _check_fake_ctr(ctr, len(_kz.SITES))


# ---------------------------------------------------------------------------------------------- paged KV gather
@torch.library.custom_op("tripwire::paged_gather", mutates_args=("out", "ctr"))
def paged_gather(
    cache: torch.Tensor,
    page_table: torch.Tensor,
    out: torch.Tensor,
    ctr: torch.Tensor,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    _pg.paged_gather(cache, page_table, out, guard=guard, ctr=ctr, requests=requests)


@paged_gather.register_fake
def _(cache, page_table, out, ctr, guard=True, requests=None):  # type: ignore[no-untyped-def]
    want = (*page_table.shape, *cache.shape[1:])
    if tuple(out.shape) != want or out.dtype != cache.dtype:
        raise ValueError(f"out must be {cache.dtype} {list(want)}")
    _check_fake_ctr(ctr, len(_pg.SITES))


# ---------------------------------------------------------------------------------------------- state copy
@torch.library.custom_op("tripwire::state_copy", mutates_args=("state", "ctr"))
def state_copy(
    state: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    src_cols: torch.Tensor,
    dst_cols: torch.Tensor,
    ctr: torch.Tensor,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    _sc.state_copy(state, block_table, rows, src_cols, dst_cols, guard=guard, ctr=ctr, requests=requests)


@state_copy.register_fake
def _(state, block_table, rows, src_cols, dst_cols, ctr, guard=True, requests=None):  # type: ignore[no-untyped-def]
    _check_fake_ctr(ctr, len(_sc.SITES))


# ---------------------------------------------------------------------------------------------- rope
@torch.library.custom_op("tripwire::rope", mutates_args=("q_out", "k_out", "ctr"))
def rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    ctr: torch.Tensor,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    _rope.rope(positions, q, k, cos_sin, q_out, k_out, guard=guard, ctr=ctr, requests=requests)


@rope.register_fake
def _(positions, q, k, cos_sin, q_out, k_out, ctr, guard=True, requests=None):  # type: ignore[no-untyped-def]
    if q_out.shape != q.shape or k_out.shape != k.shape:
        raise ValueError("q_out/k_out must have the shapes of q/k")
    _check_fake_ctr(ctr, len(_rope.SITES))


# ---------------------------------------------------------------------------------------------- decode attention
@torch.library.custom_op("tripwire::decode_attention", mutates_args=("out", "partial_out", "partial_lse", "ctr"))
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    partial_out: torch.Tensor | None,
    partial_lse: torch.Tensor | None,
    ctr: torch.Tensor,
    scale: float = -1.0,
    guard: bool = True,
    requests: torch.Tensor | None = None,
) -> None:
    _da.decode_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        out,
        workspace=_workspace(partial_out, partial_lse),
        scale=None if scale < 0 else scale,
        guard=guard,
        ctr=ctr,
        requests=requests,
    )


def _workspace(partial_out: torch.Tensor | None, partial_lse: torch.Tensor | None) -> _da.Workspace | None:
    if (partial_out is None) != (partial_lse is None):
        raise ValueError("partial_out and partial_lse are the workspace's two tensors: pass both or neither")
    return None if partial_out is None else _da.Workspace(partial_out, partial_lse)  # type: ignore[arg-type]


@decode_attention.register_fake
def _(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    out,
    partial_out,
    partial_lse,
    ctr,
    scale=-1.0,
    guard=True,
    requests=None,
):  # type: ignore[no-untyped-def]
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
        raise ValueError(f"out must be {q.dtype} {list(q.shape)}")
    ws = _workspace(partial_out, partial_lse)
    if ws is not None and (tuple(ws.out.shape[:2]) != tuple(q.shape[:2]) or ws.out.dtype != torch.float32):
        raise ValueError(f"partial_out must be float32 [{q.shape[0]}, {q.shape[1]}, splits, {q.shape[2]}]")
    _check_fake_ctr(ctr, len(_da.SITES))
