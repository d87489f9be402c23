"""The transformers continuous-batching cache as the integration reads it: per attention group, the bounds of its
write/read indices and block table, its trash slots, and the validators built from them (two layouts: 5.17's
per-layer tensors, 5.18-5.25's one tensor carved by per-group allocators, 5.25's MLA allocator included)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ...monitor import Monitor
from ...validate import Validator
from ._engine import zeroed

# [lowest, first unsupported): the versions whose cache layout this module reads (see cache_groups).
SUPPORTED = ("5.17", "5.26")
SITE_WRITE_INDEX = "transformers.write_index"
SITE_READ_INDEX = "transformers.read_index"
SITE_BLOCK_TABLE = "transformers.block_table"
# One description per site for every attention group (a site's attributes are fixed at its first registration).
_DESC_WRITE = (
    "transformers continuous batching: a KV-cache write index vs the cache's rows (row = the token in the step); "
    "masked to the write-trash slot, so that token's K/V are missing from the cache"
)
_DESC_READ = (
    "transformers continuous batching: a KV-cache read index vs the cache's rows (row = the position in the step's "
    "read index); masked to the zeroed read-trash slot"
)
_DESC_TABLE = (
    "transformers continuous batching: a block-table page vs the cache's pages (row = the request's batch row); "
    "masked to the write-trash page"
)


# ---------------------------------------------------------------------------------------------- the cache's bounds
@dataclass(frozen=True)
class _Group:
    """One attention group's cache bounds: ``rows`` bounds its write/read indices (the shortest per-layer view the
    engine indexes), the trash slots are the mask targets; ``pages``/``page_safe`` bound its block table."""

    rows: int
    write_trash: int
    read_trash: int
    pages: int | None
    page_safe: int | None
    layer_type: str = "full_attention"


def _layer_type(allocator: Any) -> str:
    # 5.18+ allocators name their layer type; 5.17's cache managers are told apart by class.
    named = getattr(allocator, "layer_type", None)
    if isinstance(named, str):
        return named
    return "sliding_attention" if "Sliding" in type(allocator).__name__ else "full_attention"


def _token_views(allocator: Any) -> dict[int, tuple[torch.Tensor, ...]]:
    """An allocator's per-layer views that its write/read indices index (one row per token): K and V for full and
    sliding attention, the two latents for 5.25's MLA allocator (the same shifted rows, split by column)."""
    for name in ("_kv_token_views", "_latent_token_views"):
        views = getattr(allocator, name, None)
        if isinstance(views, dict) and views:
            return views
    raise RuntimeError(
        f"tripwire.integrations.transformers: the cache allocator {type(allocator).__name__} has neither "
        f"_kv_token_views nor _latent_token_views; its cache rows are not a layout this module knows, so its indices "
        f"cannot be bounded"
    )


def cache_groups(cache: Any) -> list[_Group]:
    allocators = getattr(cache, "cache_allocators", None)
    if allocators is not None:
        # 5.18+: one flat tensor; each group's allocator indexes per-layer shifted views of it.
        groups = []
        for a in allocators.values():
            rows = min(int(t.shape[0]) for kv in _token_views(a).values() for t in kv)
            pages_views = getattr(a, "_kv_page_views", None) or {}
            pages = min((int(t.shape[0]) for kv in pages_views.values() for t in kv), default=None)
            page_safe = a.write_trash_index // a.tokens_per_page if pages is not None else None
            groups.append(
                _Group(rows, int(a.write_trash_index), int(a.read_trash_index), pages, page_safe, _layer_type(a))
            )
        return groups
    key_cache = getattr(cache, "key_cache", None)
    if key_cache is not None:
        # 5.17: per-layer-in-group tensors [(num_blocks + 2) * block_size, heads, dim], trash slots shared.
        rows = min(int(t.shape[0]) for t in (*key_cache, *cache.value_cache))
        bs = int(cache.block_size)
        return [
            _Group(
                rows,
                int(cache.write_trash_index),
                int(cache.read_trash_index),
                rows // bs,
                int(cache.write_trash_index) // bs,
                _layer_type(cm),
            )
            for cm in cache.group_cache_managers
        ]
    raise RuntimeError(
        f"tripwire.integrations.transformers: {type(cache).__name__} has neither cache_allocators nor key_cache; "
        f"this transformers version's cache layout is not one this module knows"
    )


def _suffix(g: int) -> str:
    return "" if g == 0 else f"_{g}"


class CacheValidators:
    """The validators of one engine cache: write/read indices per group, and the block table where the engine has
    one. Built at the engine's first forward with that cache (its bounds are only known then); Python only.

    With ``requests`` (the handle's device table of the step's request numbers, in batch order), each rule's
    offenders carry their request: a write index's token and a read index's position map to their request through
    the step's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (segments), a block-table row is its request's batch row."""

    def __init__(
        self, cache: Any, device: torch.device, policy: str, monitor: Monitor, requests: torch.Tensor | None
    ) -> None:
        self.cache_ref = weakref.ref(cache)
        self.groups = cache_groups(cache)
        # Whether a masked write can be contained (fail its request only): only where no slot a read can reach holds
        # a NaN, since the masked write's own slot stays unwritten and its request reads it into the step's packed
        # attention (see _engine: 5.18+'s cache is zeros by construction, 5.17's is zeroed when built
        # while tripwire is installed). A 5.17 cache built before install may hold uninitialised memory: there the
        # write site stays a stop under containment.
        self.writes_contained = getattr(cache, "cache_allocators", None) is not None or cache in zeroed
        self.requests = requests
        attr = requests is not None
        self.indices = Validator("transformers", device, policy=policy, monitor=monitor)
        self.table: Validator | None = None
        for g, grp in enumerate(self.groups):
            sfx = _suffix(g)
            self.indices.index(
                f"write_index{sfx}",
                hi=grp.rows,
                safe=grp.write_trash,
                fatal=True,
                site=SITE_WRITE_INDEX,
                description=_DESC_WRITE,
                requests="requests" if attr else None,
                segments="cu_q" if attr else None,
            )
            self.indices.index(
                f"read_index{sfx}",
                hi=grp.rows,
                safe=grp.read_trash,
                site=SITE_READ_INDEX,
                description=_DESC_READ,
                requests="requests" if attr else None,
                segments=f"cu_k_{grp.layer_type}" if attr else None,
            )
        if self.groups and all(grp.pages is not None for grp in self.groups):
            self.table = Validator("transformers", device, policy=policy, monitor=monitor)
            for g, grp in enumerate(self.groups):
                assert grp.pages is not None and grp.page_safe is not None
                self.table.index(
                    f"block_table{_suffix(g)}",
                    hi=grp.pages,
                    padding=-1,
                    safe=grp.page_safe,
                    site=SITE_BLOCK_TABLE,
                    description=_DESC_TABLE,
                    requests="requests" if attr else None,
                )

    def __call__(self, kwargs: dict[str, Any]) -> None:
        extra: dict[str, torch.Tensor] = {} if self.requests is None else {"requests": self.requests}
        table = kwargs.get("block_table")
        if table is not None:
            # Decode fast path: the attention kernel reads and writes through the table; the index lists are stale.
            if self.table is None:
                raise RuntimeError("tripwire: the engine passed a block table but its cache has no page views")
            self.table(**{f"block_table{_suffix(g)}": table[g] for g in range(len(self.groups))}, **extra)
            return
        writes, reads = kwargs["write_index"], kwargs["read_index"]
        if len(writes) != len(self.groups) or len(reads) != len(self.groups):
            raise RuntimeError(
                f"tripwire: the engine passed {len(writes)} write and {len(reads)} read index tensors for a cache of "
                f"{len(self.groups)} attention groups"
            )
        args = {}
        for g in range(len(self.groups)):
            args[f"write_index{_suffix(g)}"] = writes[g]
            args[f"read_index{_suffix(g)}"] = reads[g]
        if self.requests is not None:
            cu_k = kwargs["cu_seq_lens_k"]
            args["cu_q"] = kwargs["cu_seq_lens_q"]
            for grp in self.groups:
                args[f"cu_k_{grp.layer_type}"] = cu_k[grp.layer_type] if isinstance(cu_k, dict) else cu_k
        self.indices(**args, **extra)
