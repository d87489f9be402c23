"""Reference guarded kernels for the metadata paths of paged-KV inference engines.

Each kernel is a ``_private`` ``@triton.jit`` function with a ``GUARD: tl.constexpr`` switch (off = the same kernel
without the guard: the "twin" that benchmarks and the memory-checker control compare against) and a typed launcher
that checks dtype, device, contiguity and shapes, takes preallocated outputs and never syncs or allocates.

Every launcher takes ``guard: bool = True`` and ``ctr: torch.Tensor | None = None``: the counter rows of the
module's ``SITES`` (``[8]`` for a one-site kernel, ``[n, 8]`` for ``n`` sites; build them with
:func:`counters`), defaulting to the default monitor's rows; and ``requests: torch.Tensor | None = None``, an
int32/int64 request map with one request id per unit of the kernel's rows (batch entry, token, list entry, copy,
sequence: each launcher's docstring says which), read on the fault path only (a ``HAS_REQ`` constexpr) so that the
offenders kept on the device name their requests. Each module registers its sites at import.

:mod:`tripwire.kernels.request_rows` is the exception: the guard an engine adapter runs around the engine's own
metadata kernels (a batch-row -> request-state-row map masked to a scratch row, and the fence after them). It counts
at the caller's site (``ctr`` and ``requests`` required, no site of its own, not in :data:`ALL_SITES`) and has a
``mask`` switch (rewrite or only count) instead of an unguarded twin.

torch.compile: the same launchers as ``torch.ops.tripwire.*`` custom ops live in :mod:`tripwire.kernels.ops`
(imported on demand: it registers the ops with torch.library).
"""

from __future__ import annotations

from . import block_table, decode_attention, kv_zero, paged_gather, request_rows, rope, slot_mapping, state_copy
from ._common import counters

# Every site of the reference kernels, in registration order.
ALL_SITES = (
    *block_table.SITES,
    *slot_mapping.SITES,
    *kv_zero.SITES,
    *paged_gather.SITES,
    *state_copy.SITES,
    *rope.SITES,
    *decode_attention.SITES,
)

# The launchers live in their modules, named like them (``tripwire.kernels.rope.rope``); the package keeps the
# module names bound to the modules so ``tripwire.kernels.rope.SITE`` always works.
__all__ = [
    # kernel modules: each exposes its launcher, SITE/SITES and a torch *_reference
    "block_table",  # block_table_gather
    "slot_mapping",  # slot_mapping
    "kv_zero",  # kv_zero
    "paged_gather",  # paged_gather
    "state_copy",  # state_copy
    "rope",  # rope (fatal site)
    "decode_attention",  # decode_attention (split-K paged attention; alloc_workspace, Config)
    # an engine's request-row map: guard_rows, fence_rows (the caller's site; no twin, no reference)
    "request_rows",
    # counters
    "ALL_SITES",
    "counters",
]
