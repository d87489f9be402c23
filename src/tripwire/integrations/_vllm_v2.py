"""The step validator of vLLM's V2 model runner (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``).

V2 (vLLM's GPU default from 0.33, shipped in 0.32 behind ``VLLM_USE_V2_MODEL_RUNNER=1``) prepares a step in
``execute_model`` as: ``prepare_inputs`` (the input batch: positions, ``query_start_loc``, ``seq_lens``, the batch
order ``idx_mapping``), then ``prepare_attn``, which gathers each KV-cache group's block table rows into the batch
order (``block_tables.input_block_tables``) and computes the slot mappings (``[groups, padded tokens]``), then the
attention metadata from those. The hook is right after ``prepare_attn`` returns: the same rules and sites as the V1
runner's (:func:`tripwire.integrations._vllm_steps.declare`), one validator call per step, before any attention
metadata is built or any kernel reads the step's tables.

V2 keeps a request's used block count per request state (``block_tables.num_blocks``, ``[groups, max_reqs]``), not
per batch row; the per-row counts are gathered into a preallocated buffer through ``idx_mapping`` with an
``index_select(..., out=)``: no allocation, no sync. V2's block tables are in the KV-cache manager's block size (its
slot-mapping kernel multiplies by ``spec.block_size``). Context parallelism (DCP/PCP: local slot mappings and
partitioned batches) is refused at build.

V2 needs a GPU (Triton with a GPU backend, pinned memory); vLLM's CPU build cannot build it. What was exercised of
this module is said in docs/vllm.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..monitor import Monitor
from ..sites import Site
from ..validate import Validator
from ._vllm_steps import _Staged, declare

__all__ = ["HOOKS", "INPUT_BATCH_FIELDS", "V2StepValidator", "check_input_batch"]

# The V2 runner's methods the integration wraps; prepare_attn is the step hook.
HOOKS = ("initialize_kv_cache", "execute_model", "prepare_attn", "sample_tokens", "capture_model")
# The fields of V2's InputBatch (a dataclass) the validator reads.
INPUT_BATCH_FIELDS = ("req_ids", "num_reqs", "num_tokens", "idx_mapping", "positions", "query_start_loc", "seq_lens")


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
        self.monitor = monitor
        self.device = torch.device(runner.device)
        tables = runner.block_tables
        config = runner.kv_cache_config
        groups = config.kv_cache_groups
        sizes = [int(b) for b in tables.block_sizes]
        if len(sizes) != len(groups) or len(tables.input_block_tables) != len(groups):
            raise RuntimeError(
                f"tripwire: the V2 runner has {len(sizes)} block tables for {len(groups)} KV-cache groups; this vLLM "
                f"lays its KV cache out in a way tripwire does not know"
            )
        self.max_model_len = int(runner.max_model_len)
        max_reqs = int(runner.max_num_reqs)
        self.v = Validator("vllm", self.device, policy=policy, monitor=monitor)
        self.groups = declare(self.v, [(int(config.num_blocks), bs) for bs in sizes], self.max_model_len)
        # Per-row block counts in batch order, gathered into these each step (index_select's out=).
        self._counts = [torch.zeros(max_reqs, dtype=torch.int32, device=self.device) for _ in sizes]
        self._requests = _Staged(max_reqs, self.device)
        self.sites: tuple[Site, ...] = tuple(dict.fromkeys(self.v.sites().values()))

    def __call__(
        self, runner: Any, input_batch: Any, block_tables: tuple[torch.Tensor, ...], slot_mappings: torch.Tensor
    ) -> bool:
        """Validate one step from ``prepare_attn``'s result: the batch-order block tables (one per group, padded
        rows included) and the slot mappings (``[groups, padded tokens]``). Returns True: the arena may have risen
        (V2 runs on a GPU, where the launch is asynchronous)."""
        num_reqs, num_tokens = int(input_batch.num_reqs), int(input_batch.num_tokens)
        number = self.monitor.requests.number
        req = self._requests.fill(num_reqs, [number(r) for r in input_batch.req_ids[:num_reqs]])
        qsl = input_batch.query_start_loc[: num_reqs + 1]
        args: dict[str, torch.Tensor] = {
            "req": req,
            "cu": qsl,
            "positions": input_batch.positions[:num_tokens],
            "query_start_loc": qsl,
            "seq_lens": input_batch.seq_lens[:num_reqs],
        }
        idx = input_batch.idx_mapping[:num_reqs]
        per_req = runner.block_tables.num_blocks.gpu
        for g, (sm, bt, n) in enumerate(self.groups):
            counts = self._counts[g][:num_reqs]
            torch.index_select(per_req[g], 0, idx, out=counts)  # into the preallocated buffer: no allocation
            args[sm] = slot_mappings[g]
            args[bt] = block_tables[g][:num_reqs]
            args[n] = counts
        self.v(**args)
        return True
