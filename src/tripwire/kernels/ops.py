"""The reference kernels as PyTorch custom ops (``torch.ops.tripwire.*``), for ``torch.compile``. Each kernel module
registers its own op beside its launcher (``tripwire.kernels.rope.rope_op``, ...); this module names them by their
kernels (``tripwire.kernels.ops.rope``) and adds :func:`static_counters`.

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
from ._common import counters
from .block_table import block_table_gather_op as block_table_gather
from .decode_attention import decode_attention_op as decode_attention
from .kv_zero import kv_zero_op as kv_zero
from .paged_gather import paged_gather_op as paged_gather
from .rope import rope_op as rope
from .slot_mapping import slot_mapping_op as slot_mapping
from .state_copy import state_copy_op as state_copy

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
