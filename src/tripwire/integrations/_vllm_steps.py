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
every tensor is a host tensor: a step is first read through numpy views of those buffers with the validator's own
clean test (:class:`_HostCheck`), and only a step that fails it calls the validator (which then counts, attributes
and repairs exactly as always).
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
    "declare",
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


def declare(v: Validator, groups: list[tuple[int, int]], max_model_len: int) -> list[tuple[str, str, str]]:
    """Declare the step's rules on ``v``: per KV-cache group ``(blocks, block size)`` (in the block table's units)
    a slot-mapping and a block-table rule, then positions (through query_start_loc) and seq_lens. Returns each
    group's (slot mapping, block table, block counts) tensor names. The V1 and V2 runners' validators share it."""
    names = []
    for g, (num_blocks, block_size) in enumerate(groups):
        sfx = "" if g == 0 else f"_g{g}"
        sm, bt, n = f"slot_mapping{sfx}", f"block_table{sfx}", f"block_counts{sfx}"
        v.index(
            sm,
            hi=num_blocks * block_size,
            padding=PAD_SLOT,
            fatal=True,
            site=SITE_SLOT_MAPPING,
            requests="req",
            segments="cu",
            description="vLLM's slot mapping: the KV-cache write of each scheduled token (a masked write "
            "went to no slot: that token's K/V is missing from the cache)",
        )
        v.index(
            bt,
            hi=num_blocks,
            safe=NULL_BLOCK,
            lengths=n,
            site=SITE_BLOCK_TABLE,
            requests="req",
            description="vLLM's block table: the KV-cache blocks attention reads, each request's used columns",
        )
        names.append((sm, bt, n))
    v.csr(
        "positions",
        indptr="query_start_loc",
        hi=max_model_len,
        safe=0,
        site=SITE_POSITIONS,
        requests="req",
        description="vLLM's positions of the scheduled tokens (rope, and the block-table column of the "
        "slot mapping), per request through query_start_loc",
    )
    v.index(
        "seq_lens",
        lo=1,
        hi=max_model_len + 1,
        safe=1,
        site=SITE_SEQ_LENS,
        requests="req",
        description="vLLM's sequence lengths: how far attention reads each request's blocks",
    )
    return names


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
        specs = []
        for g, (table, group) in enumerate(zip(tables, groups, strict=True)):
            # Block ids in the table count in the table's (kernel) block size, which may split a manager block.
            manager_bs = int(group.kv_cache_spec.block_size)
            kernel_bs = int(table.block_size)
            if manager_bs % kernel_bs:
                raise RuntimeError(
                    f"tripwire: KV-cache group {g} has block size {manager_bs} and a block table of block size "
                    f"{kernel_bs}, which does not divide it"
                )
            specs.append((int(config.num_blocks) * (manager_bs // kernel_bs), kernel_bs))
        self.v = Validator("vllm", self.device, policy=policy, monitor=monitor)
        names = declare(self.v, specs, self.max_model_len)
        self.groups: list[tuple[str, str, str, Any]] = [(*n, t) for n, t in zip(names, tables, strict=True)]
        self._counts = [_Staged(max_reqs, self.device, t.num_blocks_per_row) for t in tables]
        self._requests = _Staged(max_reqs, self.device)
        self.sites: tuple[Site, ...] = tuple(dict.fromkeys(self.v.sites().values()))
        self._host = _HostCheck(self) if self.device.type == "cpu" else None

    def __call__(self, runner: Any, num_reqs: int, num_tokens: int, slot_mappings: dict[int, torch.Tensor]) -> bool:
        """Validate one step: ``num_reqs`` requests and ``num_tokens`` scheduled (unpadded) tokens, with the slot
        mappings the runner built for the step (``{group: tensor}``, padded entries included). Returns whether the
        arena may have risen: always on CUDA (the launch is asynchronous); on the CPU only when the validator's exact
        path ran (see :class:`_HostCheck`)."""
        if self._host is not None and self._host(runner, num_reqs, num_tokens, slot_mappings):
            return False
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
        return True


class _View:
    """A flat numpy view of one of the runner's persistent CPU tensors, built once per tensor object."""

    __slots__ = ("flat", "ptr", "src", "width")

    def __init__(self) -> None:
        self.src: torch.Tensor | None = None
        self.flat: np.ndarray | None = None
        self.ptr = 0
        self.width = 1

    def of(self, t: torch.Tensor) -> np.ndarray | None:
        """The view of ``t``; None when ``t`` is not the tensor of the last call (the runner's first step, or a
        buffer it replaced): that step then takes the validator's exact path, whose argument checks see ``t``."""
        if t is self.src:
            return self.flat
        self.src, self.ptr = t, t.data_ptr()
        self.width = int(t.shape[1]) if t.dim() == 2 else 1
        # A strided or non-integer buffer keeps None: every step takes the exact path, which refuses it clearly.
        ok = t.is_contiguous() and t.dtype in (torch.int32, torch.int64)
        self.flat = t.detach().view(-1).numpy() if ok else None
        return None


def _within(vals: list[int], lo: int, hi: int, pad: int | None = None) -> bool:
    """Every entry in ``[lo, hi)`` or equal to ``pad`` (an empty list: yes)."""
    if not vals or (lo <= min(vals) and max(vals) < hi):
        return True
    return pad is not None and all(v == pad or lo <= v < hi for v in vals)


class _HostCheck:
    """The validator's clean test for one CPU step, on numpy views of the runner's persistent buffers.

    A decode step's metadata is a few dozen integers; on the CPU each torch op on them (a slice, a reduction, a
    ``tolist``) costs microseconds of dispatch, far more than reading them. This reads exactly the entries the
    validator would be given, through views built once per buffer, as Python lists, and applies the CPU path's own
    clean test (:mod:`tripwire._validate_torch`): every entry of a rule tensor within the rule's range (or its
    padding), used columns or not; the per-row block counts within ``[0, width]``; ``query_start_loc``
    non-decreasing from 0 up to the step's tokens. When it holds, the validator would count nothing and change
    nothing, so its call (and the host work of building its arguments and request numbers) is skipped; otherwise
    the validator runs in full. Bounds come from the validator's declared rules, so the two never differ.
    """

    def __init__(self, sv: StepValidator) -> None:
        rules = sv.v.rules
        pos, sl = rules["positions"], rules["seq_lens"]
        self.pos = (pos.lo, pos.hi)
        self.sl = (sl.lo, sl.hi)
        self.groups = [
            (rules[sm].lo, rules[sm].hi, rules[sm].padding, rules[bt].lo, rules[bt].hi, counts._source, table)
            for (sm, bt, _n, table), counts in zip(sv.groups, sv._counts, strict=True)
        ]
        self._pos, self._sl, self._qsl = _View(), _View(), _View()
        self._slots = [_View() for _ in self.groups]
        self._tables = [_View() for _ in self.groups]

    def __call__(self, runner: Any, num_reqs: int, num_tokens: int, slot_mappings: dict[int, torch.Tensor]) -> bool:
        """True when the step's metadata is clean by the validator's own test (see the class docstring)."""
        # numpy slices and tolist() of a few entries: no torch op, no tensor allocated on the step path. Every view
        # is looked up before any test, so a first step registers them all (and the next one can skip).
        pos, sl, qsl = (
            self._pos.of(runner.positions),
            self._sl.of(runner.seq_lens),
            self._qsl.of(runner.query_start_loc.gpu),
        )
        views = [
            (sv.of(g[6].slot_mapping.gpu), tv.of(g[6].block_table.gpu))
            for g, sv, tv in zip(self.groups, self._slots, self._tables, strict=True)
        ]
        if pos is None or sl is None or qsl is None:
            return False
        if not _within(pos[:num_tokens].tolist(), *self.pos) or not _within(sl[:num_reqs].tolist(), *self.sl):
            return False
        q = qsl[: num_reqs + 1].tolist()
        if q[0] != 0 or q[-1] > num_tokens or q != sorted(q):
            return False
        for g, (s_lo, s_hi, pad, b_lo, b_hi, counts, _table) in enumerate(self.groups):
            slots, blocks = views[g]
            sm = slot_mappings[g]
            if slots is None or blocks is None or sm.data_ptr() != self._slots[g].ptr:
                return False  # a new buffer, or a slot mapping that is not a view of the runner's: validated
            if not _within(slots[: sm.shape[0]].tolist(), s_lo, s_hi, pad):
                return False
            width = self._tables[g].width
            if not _within(blocks[: num_reqs * width].tolist(), b_lo, b_hi):
                return False
            if counts is None or not _within(counts[:num_reqs].tolist(), 0, width + 1):
                return False
        return True
