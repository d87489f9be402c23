"""The step validator of vLLM's V2 model runner (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``): vLLM's GPU
runner (the default for dense models from 0.26, for every model from 0.29, the only one from 0.34).

V2 prepares a step in ``execute_model`` as: ``prepare_inputs`` (the input batch: positions, ``query_start_loc``,
``seq_lens`` and the batch-row -> request-state-row map ``idx_mapping``), then ``prepare_attn``, whose Triton
kernels gather each KV-cache group's block-table rows into batch order (``block_table[idx_mapping[b]]``, up to
``num_blocks[idx_mapping[b]]`` columns) and compute the slot mappings (``block_table[row, position //
block_size]``), then the attention metadata from those. vLLM's own kernels there read through ``idx_mapping``,
``num_blocks`` and ``positions`` without a bound (vLLM #53982, #56380), so the step is checked in two phases around
``prepare_attn``. (``prepare_inputs`` builds ``idx_mapping`` on the host from V2's own request map and reads through
it already: a map wrong there is not covered; the guard covers the device copy from ``prepare_attn`` on, the sampler
and ``post_update`` included.)

* :meth:`V2StepValidator.inputs`, before it: ``idx_mapping`` within the request-state rows (site
  ``vllm.idx_mapping``: :func:`tripwire.kernels.request_rows.guard_rows`, which masks a bad entry to a scratch
  row), every request-state row's ``num_blocks`` within ``[0, width]`` (``vllm.num_blocks``; masked to 0),
  positions below ``max_model_len`` per request through ``query_start_loc`` (``vllm.positions``,
  ``vllm.query_start_loc``).
* :meth:`V2StepValidator.outputs`, after it: the fence of rows whose ``idx_mapping`` was bad
  (:func:`tripwire.kernels.request_rows.fence_rows`), then the slot mappings, the gathered tables' used columns and
  ``seq_lens`` (the same rules and sites as the V1 runner's:
  :func:`tripwire.integrations.vllm._steps.declare_outputs`).

Every offender carries its request: a batch row's through ``req`` (filled from ``input_batch.req_ids``), a
request-state row's (``num_blocks``) through ``req_state`` (filled through ``idx_mapping_np``, -1 for rows not in
the step: a bad count there fails the step closed). V2's block tables are in the kernel block size; a KV-cache
manager block may be several of them. Context parallelism (DCP/PCP: local slot mappings, partitioned batches) is
refused at build.

Hot path: views of V2's persistent buffers and of tripwire's preallocated ones, the request numbers (by batch row and
by request-state row) through one pinned ring in one copy, four launches (the row guard, two validators, the fence
per group), no sync and no allocation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...kernels import request_rows
from ...kernels._common import check_tensor
from ...monitor import Monitor
from ...sites import Site
from ...validate import Validator
from .._staging import Staged
from ._steps import SITE_IDX_MAPPING, SITE_NUM_BLOCKS, covers, declare_inputs, declare_outputs

__all__ = ["HOOKS", "INPUT_BATCH_FIELDS", "V2StepValidator", "check_input_batch"]

# The V2 runner's methods the integration wraps; prepare_attn is the step's hook (both phases around it), sample the
# logits check's (tripwire.integrations.vllm._numerics).
HOOKS = ("initialize_kv_cache", "execute_model", "prepare_attn", "sample_tokens", "capture_model", "sample")
# The fields of V2's InputBatch (a dataclass) the validator reads.
INPUT_BATCH_FIELDS = (
    "req_ids",
    "num_reqs",
    "num_tokens",
    "idx_mapping",
    "idx_mapping_np",
    "positions",
    "query_start_loc",
    "seq_lens",
)
# What the validator reads of V2's BlockTables (``runner.block_tables``) and RequestState (``runner.req_states``).
BLOCK_TABLES_ATTRS = ("block_tables", "input_block_tables", "num_blocks", "block_sizes", "gather_block_tables")
REQUEST_STATE_ATTRS = ("free_indices",)


def check_input_batch(cls: type, version: str) -> None:
    """RuntimeError unless V2's ``InputBatch`` dataclass has the fields the validator reads."""
    have = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    missing = [f for f in INPUT_BATCH_FIELDS if f not in have]
    if missing:
        raise RuntimeError(
            f"tripwire: vLLM {version}'s V2 {cls.__module__}.{cls.__qualname__} lacks {missing}, the step metadata "
            f"tripwire validates; refusing to run installed but not validating (unset TRIPWIRE_VLLM)"
        )


class V2StepValidator:
    """The validator of one V2 model runner, built after its KV cache is initialised (``runner.block_tables``)."""

    def __init__(self, runner: Any, policy: str, monitor: Monitor) -> None:
        if int(getattr(runner, "dcp_size", 1)) > 1 or getattr(runner, "pcp_manager", None) is not None:
            raise RuntimeError(
                "tripwire: this V2 runner uses context parallelism (local slot mappings, a partitioned batch), "
                "whose metadata tripwire does not validate; run without it or unset TRIPWIRE_VLLM"
            )
        missing = [a for a in BLOCK_TABLES_ATTRS if not hasattr(runner.block_tables, a)]
        missing += [f"req_states.{a}" for a in REQUEST_STATE_ATTRS if not hasattr(runner.req_states, a)]
        if missing:
            raise RuntimeError(
                f"tripwire: this vLLM's V2 runner lacks {missing}, which tripwire reads; refusing to run installed "
                f"but not validating (unset TRIPWIRE_VLLM)"
            )
        self.monitor = monitor
        self.mask = policy == "mask"
        self.device = torch.device(runner.device)
        tables = runner.block_tables
        config = runner.kv_cache_config
        groups = config.kv_cache_groups
        sizes = [int(b) for b in tables.block_sizes]
        # The tables' (kernel) block size: vLLM 0.26-0.33 may split a manager block (kernel_block_sizes); 0.34 does
        # not (block_sizes is both).
        kernel = [int(b) for b in getattr(tables, "kernel_block_sizes", sizes)]
        if len(sizes) != len(groups) or len(tables.input_block_tables) != len(groups):
            raise RuntimeError(
                f"tripwire: the V2 runner has {len(sizes)} block tables for {len(groups)} KV-cache groups; this vLLM "
                f"lays its KV cache out in a way tripwire does not know"
            )
        self.max_model_len = int(runner.max_model_len)
        self.max_reqs = max_reqs = int(runner.max_num_reqs)
        specs, self.widths = [], []
        for g, (bs, kbs) in enumerate(zip(sizes, kernel, strict=True)):
            if bs % kbs:
                raise RuntimeError(
                    f"tripwire: KV-cache group {g} has block size {bs} and a block table of block size {kbs}, "
                    f"which does not divide it"
                )
            width = int(tables.block_tables[g].gpu.shape[1])
            covers(g, width, kbs, self.max_model_len)
            self.widths.append(width)
            specs.append((int(config.num_blocks) * (bs // kbs), kbs))
        self.vin = Validator("vllm", self.device, policy=policy, monitor=monitor)
        declare_inputs(self.vin, self.max_model_len)
        self._num_blocks = []
        for g, width in enumerate(self.widths):
            name = "num_blocks" if g == 0 else f"num_blocks_g{g}"
            self.vin.index(
                name,
                hi=width + 1,
                safe=0,
                site=SITE_NUM_BLOCKS,
                requests="req_state",
                description="vLLM V2's per-request block count (num_blocks: how many block-table columns its gather "
                "copies) outside [0, the table's width] (row = the request-state row)",
            )
            self._num_blocks.append(name)
        self.v = Validator("vllm", self.device, policy=policy, monitor=monitor)
        self.groups = declare_outputs(self.v, specs, self.max_model_len)
        rows_site = monitor.registry.register(
            SITE_IDX_MAPPING,
            description="vLLM V2's idx_mapping: a batch row's request-state row outside [0, max_num_reqs) (masked to "
            "a row no live request holds; the row's tables and slots fenced after prepare_attn)",
        )
        self._rows_ctr = monitor.counter(rows_site, self.device)
        # Persistent buffers, allocated here (before any capture).
        self._flags = torch.zeros(max_reqs, dtype=torch.int32, device=self.device)
        self._counts = [torch.zeros(max_reqs, dtype=torch.int32, device=self.device) for _ in specs]
        # The engine's buffers the row guard and the fence write, in the layout they write them: refused otherwise.
        total = getattr(getattr(runner.req_states, "total_len", None), "gpu", None)
        self._total_len = total if isinstance(total, torch.Tensor) else None
        layout: dict[str, tuple[torch.Tensor, torch.dtype]] = {
            f"block_tables.input_block_tables[{g}][0]": (tables.input_block_tables[g][0], torch.int32)
            for g in range(len(specs))
        }
        layout["block_tables.num_blocks.gpu[0]"] = (tables.num_blocks.gpu[0], torch.int32)
        if hasattr(tables, "slot_mappings"):
            layout["block_tables.slot_mappings[0]"] = (tables.slot_mappings[0], torch.int64)
        if self._total_len is not None:
            layout["req_states.total_len.gpu"] = (self._total_len, torch.int32)
        _check_buffers(self.device, **layout)
        # The step's request numbers twice, in one copy: by request-state row, then in batch order.
        self._numbers = Staged(2 * max_reqs, self.device)
        self._req: torch.Tensor = self._numbers.tensor[max_reqs:]
        self.sites: tuple[Site, ...] = tuple(
            dict.fromkeys([rows_site, *self.vin.sites().values(), *self.v.sites().values()])
        )

    def begin(self) -> None:
        """A new step (the V1 validator's protocol; V2's inputs phase fills everything the step needs)."""

    def requests(self, runner: Any) -> torch.Tensor:
        """The step's request numbers in batch order (its logits rows' order), as the inputs phase filled them."""
        return self._req

    def inputs(self, runner: Any, input_batch: Any) -> bool:
        """Before ``prepare_attn``: the row guard, then the inputs' validator. Returns True (the launches are
        asynchronous: the arena may have risen)."""
        n, tokens = int(input_batch.num_reqs), int(input_batch.num_tokens)
        number = self.monitor.requests.number
        numbers = [number(r) for r in input_batch.req_ids[:n]]
        idx_np = input_batch.idx_mapping_np[:n]
        by_state, req = self._numbers.scatter_fill(idx_np, numbers, n)
        self._req = req
        # The scratch row: one no live request holds (V2's free list; its bottom is the row reused last). None free:
        # a row of this step, and the hit unattributed, so the whole step fails (see tripwire.kernels.request_rows).
        free = runner.req_states.free_indices
        scratch, attributed = (int(free[0]), True) if free else (int(idx_np[0]), False)
        idx = input_batch.idx_mapping[:n]
        # Both launchers are called through their module: a wrapper set on the public launcher (a profiler's, a
        # tool's) sees the adapter's launches too. Their argument check on this path is attribute reads only.
        request_rows.guard_rows(
            idx, self._flags, req, self._rows_ctr, self.max_reqs, scratch, scratch_free=attributed, mask=self.mask,
            total_len=self._total_len,
        )  # fmt: skip
        args: dict[str, torch.Tensor] = {
            "req": req,
            "req_state": by_state,
            "positions": input_batch.positions[:tokens],
            "query_start_loc": input_batch.query_start_loc[: n + 1],
        }
        per_state = runner.block_tables.num_blocks.gpu  # [groups, max_reqs]: its current (UVA) buffer
        for g, name in enumerate(self._num_blocks):
            args[name] = per_state[g]
        self.vin(**args)
        return True

    def outputs(
        self, runner: Any, input_batch: Any, block_tables: tuple[torch.Tensor, ...], slots: torch.Tensor
    ) -> bool:
        """After ``prepare_attn``, from its result: the batch-order block tables (one per group, padded rows
        included) and the slot mappings (``[groups, padded tokens]``). Returns True."""
        n = int(input_batch.num_reqs)
        idx = input_batch.idx_mapping[:n]
        qsl = input_batch.query_start_loc[: n + 1]
        per_state = runner.block_tables.num_blocks.gpu
        args: dict[str, torch.Tensor] = {"req": self._req, "cu": qsl, "seq_lens": input_batch.seq_lens[:n]}
        for g, (sm, bt, cn) in enumerate(self.groups):
            counts, table, slot = self._counts[g], block_tables[g], slots[g]
            request_rows.fence_rows(self._flags, idx, qsl, per_state[g], counts, table, slot, mask=self.mask)
            args[sm] = slot
            args[bt] = table[:n]
            args[cn] = counts[:n]
        self.v(**args)
        return True

    def __call__(self, runner: Any, input_batch: Any, block_tables: tuple[torch.Tensor, ...], slots: Any) -> bool:
        """Both phases at once, after ``prepare_attn`` (tools and tests: the integration runs the inputs phase
        before vLLM's kernels read them)."""
        self.inputs(runner, input_batch)
        return self.outputs(runner, input_batch, block_tables, slots)


def _check_buffers(device: torch.device, **tensors: tuple[torch.Tensor, torch.dtype]) -> None:
    """Build-time checks of the engine's persistent buffers the row guard and the fence write every step: each 1-D,
    contiguous, of its dtype, on ``device``. The first that is not is refused naming it (an engine that lays them out
    otherwise is refused when its runner is built, not at its first step)."""
    for name, (t, dtype) in tensors.items():
        check_tensor(name, t, dtypes=(dtype,), ndim=1)
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, not on {device}")
