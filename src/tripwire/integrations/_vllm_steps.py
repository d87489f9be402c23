"""The vLLM step validator: one :class:`tripwire.validate.Validator` over a model runner's step metadata.

Built once per model runner, when its KV cache is initialised (before any capture: the validator preallocates the
arena); called once per real step with the runner's own persistent tensors, after the step's inputs are prepared and
before its attention metadata is built. Rules (sites):

* ``slot_mapping`` (``vllm.slot_mapping``, FATAL: the KV write; padding -1 is vLLM's PAD_SLOT_ID, which the cache
  write skips): every entry, padded tokens included, in ``[0, num_blocks * block_size)``; masked to -1.
* ``block_table`` (``vllm.block_table``): each request's used columns (vLLM's own per-row block count) in
  ``[0, num_blocks)``; masked to 0, vLLM's null block (reserved, never allocated to a request).
  The per-row counts count at ``vllm.block_counts`` when outside ``[0, width]``.
* ``positions`` (``vllm.positions``): each scheduled token's position below ``max_model_len``, which the table's
  width covers (``width * block_size >= max_model_len``; vLLM's slot-mapping kernel reads the table at
  ``position // block_size`` with no width bound); masked to 0. Checked per request through ``query_start_loc``
  (``vllm.query_start_loc``: non-decreasing from 0, within the step's tokens).
* ``seq_lens`` (``vllm.seq_lens``): each request's length in ``[1, max_model_len]``; masked to 1.

Several KV-cache groups (hybrid models) get one slot-mapping and one block-table rule each, counting at the same
two sites. Every rule's offenders carry the batch row's request number (``monitor.requests``), so reports, events
and verdicts name vLLM's request id.

Hot path: the tensors passed are slices of the runner's persistent buffers (views: no device memory is allocated),
the request numbers go into a preallocated buffer, and the validator does no sync on CUDA tensors. On the CPU build
every tensor is a host tensor and the validator's CPU path reads them directly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..monitor import Monitor
from ..sites import Site
from ..validate import Validator

__all__ = [
    "SITE_BLOCK_COUNTS",
    "SITE_BLOCK_TABLE",
    "SITE_POSITIONS",
    "SITE_QUERY_START_LOC",
    "SITE_SEQ_LENS",
    "SITE_SLOT_MAPPING",
    "StepValidator",
]

SITE_SLOT_MAPPING = "vllm.slot_mapping"
SITE_BLOCK_TABLE = "vllm.block_table"
SITE_BLOCK_COUNTS = "vllm.block_counts"
SITE_POSITIONS = "vllm.positions"
SITE_QUERY_START_LOC = "vllm.query_start_loc"
SITE_SEQ_LENS = "vllm.seq_lens"
# vLLM's reserved null block (vllm.v1.core.block_pool: block 0 is never handed to a request) and its PAD_SLOT_ID.
NULL_BLOCK = 0
PAD_SLOT = -1


class _Staged:
    """A per-step vector as a tensor on the runner's device. On the CPU: a view of the runner's own numpy array
    (``source``), or a preallocated tensor written through its numpy view (no copy, no allocation). On CUDA: a
    persistent device buffer filled from a pinned ring with a non-blocking copy, so a step enqueued before the
    previous one's copy ran still reads its own values."""

    RING = 4

    def __init__(self, size: int, device: torch.device, source: np.ndarray | None = None) -> None:
        self._source = source
        self._view: torch.Tensor | None = None
        if device.type == "cpu" and source is not None:
            self._view = torch.from_numpy(source)
            return
        self.tensor = torch.zeros(size, dtype=torch.int64, device=device)
        if device.type == "cpu":
            self._np = [self.tensor.numpy()]
            self._host = [self.tensor]
        else:
            self._host = [torch.zeros(size, dtype=torch.int64, pin_memory=True) for _ in range(self.RING)]
            self._np = [h.numpy() for h in self._host]
        self._turn = 0

    def fill(self, n: int, values: Any = None) -> torch.Tensor:
        """The first ``n`` entries: of the source array, or ``values`` (a sequence of ints) when given."""
        if self._view is not None:
            return self._view[:n]
        buf, host = self._np[self._turn], self._host[self._turn]
        self._turn = (self._turn + 1) % len(self._np)
        if values is None:
            assert self._source is not None
            values = self._source[:n]
        buf[:n] = values  # numpy assignment: no torch allocation
        if host is not self.tensor:
            self.tensor[:n].copy_(host[:n], non_blocking=True)
        return self.tensor[:n]


class StepValidator:
    """The validator of one V1 model runner (``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` or a subclass such
    as the CPU build's ``CPUModelRunner``).

    Args:
        runner: the model runner, after its KV cache is initialised.
        policy: ``"mask"`` or ``"flag"`` (the validator's policies; containment is the integration's, not the
            validator's).
        monitor: whose arena, request numbers and sites are used.
    """

    def __init__(self, runner: Any, policy: str, monitor: Monitor) -> None:
        self.monitor = monitor
        self.device = torch.device(runner.device)
        batch = runner.input_batch
        tables = list(batch.block_table.block_tables)
        config = runner.kv_cache_config
        groups = config.kv_cache_groups
        if len(tables) != len(groups):
            raise RuntimeError(
                f"tripwire: the runner has {len(tables)} block tables for {len(groups)} KV-cache groups; this vLLM "
                f"lays its KV cache out in a way tripwire does not know"
            )
        self.max_model_len = int(runner.max_model_len)
        max_reqs = int(batch.max_num_reqs)
        self.v = Validator("vllm", self.device, policy=policy, monitor=monitor)
        self.groups: list[tuple[str, str, str, Any]] = []
        self._counts: list[_Staged] = []
        for g, (table, group) in enumerate(zip(tables, groups, strict=True)):
            # Block ids in the table count in the table's (kernel) block size, which may split a manager block.
            manager_bs = int(group.kv_cache_spec.block_size)
            kernel_bs = int(table.block_size)
            if manager_bs % kernel_bs:
                raise RuntimeError(
                    f"tripwire: KV-cache group {g} has block size {manager_bs} and a block table of block size "
                    f"{kernel_bs}, which does not divide it"
                )
            num_blocks = int(config.num_blocks) * (manager_bs // kernel_bs)
            sfx = "" if g == 0 else f"_g{g}"
            sm, bt, n = f"slot_mapping{sfx}", f"block_table{sfx}", f"block_counts{sfx}"
            self.v.index(
                sm,
                hi=num_blocks * kernel_bs,
                padding=PAD_SLOT,
                fatal=True,
                site=SITE_SLOT_MAPPING,
                requests="req",
                segments="cu",
                description="vLLM's slot mapping: the KV-cache write of each scheduled token (a masked write "
                "went to no slot: that token's K/V is missing from the cache)",
            )
            self.v.index(
                bt,
                hi=num_blocks,
                safe=NULL_BLOCK,
                lengths=n,
                site=SITE_BLOCK_TABLE,
                requests="req",
                description="vLLM's block table: the KV-cache blocks attention reads, each request's used columns",
            )
            self.groups.append((sm, bt, n, table))
            self._counts.append(_Staged(max_reqs, self.device, table.num_blocks_per_row))
        self.v.csr(
            "positions",
            indptr="query_start_loc",
            hi=self.max_model_len,
            safe=0,
            site=SITE_POSITIONS,
            requests="req",
            description="vLLM's positions of the scheduled tokens (rope, and the block-table column of the "
            "slot mapping), per request through query_start_loc",
        )
        self.v.index(
            "seq_lens",
            lo=1,
            hi=self.max_model_len + 1,
            safe=1,
            site=SITE_SEQ_LENS,
            requests="req",
            description="vLLM's sequence lengths: how far attention reads each request's blocks",
        )
        self._requests = _Staged(max_reqs, self.device)
        self.sites: tuple[Site, ...] = tuple(dict.fromkeys(self.v.sites().values()))

    def __call__(self, runner: Any, num_reqs: int, num_tokens: int, slot_mappings: dict[int, torch.Tensor]) -> None:
        """Validate one step: ``num_reqs`` requests and ``num_tokens`` scheduled (unpadded) tokens, with the slot
        mappings the runner built for the step (``{group: tensor}``, padded entries included)."""
        number = self.monitor.requests.number
        req = self._requests.fill(num_reqs, [number(r) for r in runner.input_batch.req_ids[:num_reqs]])
        qsl = runner.query_start_loc.gpu[: num_reqs + 1]
        args: dict[str, torch.Tensor] = {
            "req": req,
            "cu": qsl,
            "positions": runner.positions[:num_tokens],
            "query_start_loc": qsl,
            "seq_lens": runner.seq_lens[:num_reqs],
        }
        for g, (sm, bt, n, table) in enumerate(self.groups):
            args[sm] = slot_mappings[g]
            args[bt] = table.block_table.gpu[:num_reqs]
            args[n] = self._counts[g].fill(num_reqs)
        self.v(**args)
