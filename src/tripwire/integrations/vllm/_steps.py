"""The vLLM step's rules, engine-independent, and the V1 model runner's validator over them.

A step is validated in two phases, each one :class:`tripwire.validate.Validator` call (one launch on a GPU): its
INPUTS (:func:`declare_inputs`) before the engine's own metadata kernels read them, its OUTPUTS
(:func:`declare_outputs`) before the attention metadata is built from them. The V1 runner's validator
(:class:`StepValidator`) and the V2 runner's (:class:`tripwire.integrations.vllm._v2.V2StepValidator`) declare the
same rules and sites; V2 adds its request-state rows (``vllm.idx_mapping``, ``vllm.num_blocks``). Rules (sites):

* ``slot_mapping`` (``vllm.slot_mapping``, FATAL: the KV write; padding -1 is vLLM's PAD_SLOT_ID, which the cache
  write skips): every entry, padded tokens included, in ``[0, num_blocks * block_size)``; masked to -1.
* ``block_table`` (``vllm.block_table``): each request's used columns (vLLM's own per-row block count) in
  ``[0, num_blocks)``; masked to 0, vLLM's null block (reserved, never allocated to a request).
  The per-row counts count at ``vllm.block_counts`` when outside ``[0, width]``.
* ``positions`` (``vllm.positions``): each scheduled token's position below ``max_model_len``, which the table's
  width covers (``width * block_size >= max_model_len``, checked at build: vLLM's slot-mapping kernel reads the
  table at ``position // block_size`` with no width bound); masked to 0. Checked per request through
  ``query_start_loc`` (``vllm.query_start_loc``: non-decreasing from 0, within the step's tokens).
* ``seq_lens`` (``vllm.seq_lens``): each request's length in ``[1, max_model_len]``; masked to 1.

Several KV-cache groups (hybrid models) get one slot-mapping and one block-table rule each, counting at the same
two sites. Every rule's offenders carry the batch row's request number (``monitor.requests``), so reports, events
and verdicts name vLLM's request id.

Hot path: the tensors passed are slices of the runner's persistent buffers (views: no device memory is allocated),
the request numbers go into a preallocated buffer (once per step, by the first phase that needs them), and the
validators do no sync on CUDA tensors. On the CPU build every tensor is a host tensor: each phase is first read
through numpy views of those buffers with the validator's own clean test (:class:`_HostCheck`), and only a phase that
fails it calls its validator (which then counts, attributes and repairs exactly as always).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...monitor import Monitor
from ...sites import Site
from ...validate import Validator
from ...validate._rules import entries_clean, indptr_clean, lengths_clean
from .._staging import Staged

__all__ = [
    "SITE_BLOCK_COUNTS",
    "SITE_BLOCK_TABLE",
    "SITE_IDX_MAPPING",
    "SITE_NUM_BLOCKS",
    "SITE_POSITIONS",
    "SITE_QUERY_START_LOC",
    "SITE_SEQ_LENS",
    "SITE_SLOT_MAPPING",
    "StepValidator",
    "covers",
    "declare_inputs",
    "declare_outputs",
]

SITE_SLOT_MAPPING = "vllm.slot_mapping"
SITE_BLOCK_TABLE = "vllm.block_table"
SITE_BLOCK_COUNTS = "vllm.block_counts"
SITE_POSITIONS = "vllm.positions"
SITE_QUERY_START_LOC = "vllm.query_start_loc"
SITE_SEQ_LENS = "vllm.seq_lens"
# V2's request-state rows: idx_mapping (batch row -> request-state row) and num_blocks (per request-state row).
SITE_IDX_MAPPING = "vllm.idx_mapping"
SITE_NUM_BLOCKS = "vllm.num_blocks"
# vLLM's reserved null block (vllm.v1.core.block_pool: block 0 is never handed to a request) and its PAD_SLOT_ID.
NULL_BLOCK = 0
PAD_SLOT = -1


def declare_inputs(v: Validator, max_model_len: int) -> None:
    """Declare the rules of a step's INPUTS on ``v``: what the engine's own metadata kernels (vLLM's slot-mapping
    kernel: ``block_table[row, position // block_size]``) index through, checked before they run. Positions per
    request through ``query_start_loc`` (non-decreasing from 0, within the step's tokens); each scheduled token's
    position below ``max_model_len``, which the tables' width covers (the runners' adapters check that at build).
    Tensors: ``positions``, ``query_start_loc``, ``req`` (batch row -> request number)."""
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


def declare_outputs(v: Validator, groups: list[tuple[int, int]], max_model_len: int) -> list[tuple[str, str, str]]:
    """Declare the rules of a step's OUTPUTS on ``v``: what attention and the KV-cache write read, checked after
    the engine's metadata kernels made them and before any of those runs. Per KV-cache group ``(blocks, block
    size)`` (in the block table's units) a slot-mapping and a block-table rule (the table in batch order, its used
    columns by a per-row count), then ``seq_lens``. Returns each group's (slot mapping, block table, block counts)
    tensor names; the call also takes ``req`` (batch row -> request number) and ``cu`` (``query_start_loc``: a slot
    mapping's token -> batch row)."""
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
    as the CPU build's ``CPUModelRunner``), in two phases of one step:

    * :meth:`inputs`, before vLLM's slot-mapping kernel (``MultiGroupBlockTable.compute_slot_mapping``, which reads
      the block table at ``position // block_size`` with no bound): positions and ``query_start_loc``.
    * :meth:`outputs`, before the attention metadata is built: the slot mappings, the block tables' used columns,
      their per-row counts and ``seq_lens``.

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
            covers(g, int(table.block_table.gpu.shape[-1]), kernel_bs, self.max_model_len)
            specs.append((int(config.num_blocks) * (manager_bs // kernel_bs), kernel_bs))
        # Two validators, one per phase: each call is one launch over its phase's rules.
        self.vin = Validator("vllm", self.device, policy=policy, monitor=monitor)
        declare_inputs(self.vin, self.max_model_len)
        self.v = Validator("vllm", self.device, policy=policy, monitor=monitor)
        names = declare_outputs(self.v, specs, self.max_model_len)
        self.groups: list[tuple[str, str, str, Any]] = [(*n, t) for n, t in zip(names, tables, strict=True)]
        self._counts = [Staged(max_reqs, self.device, t.num_blocks_per_row) for t in tables]
        self._requests = Staged(max_reqs, self.device)
        self._req: torch.Tensor | None = None  # this step's request numbers, filled by the first exact phase
        self.sites: tuple[Site, ...] = tuple(dict.fromkeys([*self.vin.sites().values(), *self.v.sites().values()]))
        self._host = _HostCheck(self) if self.device.type == "cpu" else None

    def begin(self) -> None:
        """A new step: its request numbers are filled again by its first exact phase."""
        self._req = None

    def _numbers(self, runner: Any, num_reqs: int) -> torch.Tensor:
        req = self._req
        if req is None:
            number = self.monitor.requests.number
            req = self._req = self._requests.fill(num_reqs, [number(r) for r in runner.input_batch.req_ids[:num_reqs]])
        return req

    def requests(self, runner: Any) -> torch.Tensor:
        """The step's request numbers in batch order (its logits rows' order), filled once per step."""
        return self._numbers(runner, int(runner.input_batch.num_reqs))

    def __call__(self, runner: Any, num_reqs: int, num_tokens: int, slot_mappings: dict[int, torch.Tensor]) -> bool:
        """Both phases of one step at once (tools and tests; the integration calls them where vLLM computes each).
        Returns whether the arena may have risen."""
        self.begin()
        rose = self.inputs(runner, num_reqs, num_tokens)
        return self.outputs(runner, num_reqs, num_tokens, slot_mappings) or rose

    def inputs(self, runner: Any, num_reqs: int, num_tokens: int) -> bool:
        """The inputs phase (see the class docstring). Returns whether the arena may have risen: always on CUDA (the
        launch is asynchronous); on the CPU only when the validator's exact path ran (the host clean test failed)."""
        if self._host is not None and self._host.inputs(runner, num_reqs, num_tokens):
            return False
        qsl = runner.query_start_loc.gpu[: num_reqs + 1]
        self.vin(req=self._numbers(runner, num_reqs), positions=runner.positions[:num_tokens], query_start_loc=qsl)
        return True

    def outputs(self, runner: Any, num_reqs: int, num_tokens: int, slot_mappings: dict[int, torch.Tensor]) -> bool:
        """The outputs phase, with the slot mappings the runner built for the step (``{group: tensor}``, padded
        entries included). Returns as :meth:`inputs`."""
        if self._host is not None and self._host.outputs(runner, num_reqs, num_tokens, slot_mappings):
            return False
        return self.exact(runner, num_reqs, num_tokens, slot_mappings)

    def exact(self, runner: Any, num_reqs: int, num_tokens: int, slot_mappings: dict[int, torch.Tensor]) -> bool:
        """The outputs phase's validator call, without the host clean test. Returns True: the arena may have
        risen."""
        args: dict[str, torch.Tensor] = {
            "req": self._numbers(runner, num_reqs),
            "cu": runner.query_start_loc.gpu[: num_reqs + 1],
            "seq_lens": runner.seq_lens[:num_reqs],
        }
        for g, (sm, bt, n, table) in enumerate(self.groups):
            args[sm] = slot_mappings[g]
            args[bt] = table.block_table.gpu[:num_reqs]
            args[n] = self._counts[g].fill(num_reqs)
        self.v(**args)
        return True


def covers(group: int, width: int, block_size: int, max_model_len: int) -> None:
    """RuntimeError unless a table of ``width`` columns of ``block_size`` covers every position below
    ``max_model_len``: the positions rule's bound is what keeps the engine's slot-mapping kernel inside a row."""
    if width * block_size < max_model_len:
        raise RuntimeError(
            f"tripwire: KV-cache group {group}'s block table has {width} columns of {block_size} tokens, fewer than "
            f"max_model_len={max_model_len} positions; a position rule at max_model_len would not keep vLLM's "
            f"slot-mapping kernel inside a row"
        )


class _Prefixes(dict[int, memoryview]):
    """The prefixes of one bound buffer's flat ``memoryview`` by length (``p[n]`` is ``view[:n]``), each made at the
    first step that reads that many entries and kept: a step reads its entries through a dict lookup instead of
    making a slice object per rule. A view keeps the buffer it was made from, so a prefix always reads the buffer's
    current contents. One per length a step asks for: the engine's buffer sizes bound them."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view = view

    def __missing__(self, n: int) -> memoryview:
        prefix = self[n] = self.view[:n]
        return prefix


def _host_view(t: torch.Tensor | np.ndarray) -> _Prefixes | None:
    """The prefixes of a flat view of one of the runner's persistent CPU buffers (no copy), or None for a buffer the
    clean test cannot read as the validator would (strided, or not an integer type): every step then takes the
    validator's exact path, whose argument checks refuse such a buffer clearly. A ``memoryview`` of the buffer's
    numpy view: its slice and ``tolist`` run far less C code than numpy's (no index parsing, no array object), which
    is what a step pays for on a host whose caches the model's forward pass has just evicted."""
    if isinstance(t, np.ndarray):
        ok = t.ndim == 1 and t.flags.c_contiguous and t.dtype in (np.int32, np.int64)
        return _Prefixes(t.data) if ok else None
    if not (t.is_contiguous() and t.dtype in (torch.int32, torch.int64)):
        return None
    return _Prefixes(t.detach().view(-1).numpy().data)


class _Group:
    """One KV-cache group's buffers as the clean test reads them, bound once per buffer object: the runner's slot
    and block-table tensors (compared by identity each step: a replaced buffer rebinds), their numpy views, the
    slot buffer's address (the step's slot mapping must be a prefix view of it), the table's width, the per-row
    counts (the runner's own numpy array) and the rule bounds."""

    __slots__ = (
        "b_hi",
        "b_lo",
        "blocks",
        "counts",
        "pad",
        "ptr",
        "s_hi",
        "s_lo",
        "slot_t",
        "slots",
        "table",
        "table_t",
        "width",
    )

    def __init__(self, table: Any, counts: np.ndarray | None, bounds: tuple[int, int, int | None, int, int]) -> None:
        self.table = table
        # The runner's own per-row counts (a numpy array vLLM writes in place, never replaces), read as a view too.
        self.counts = _host_view(counts) if counts is not None else None
        self.s_lo, self.s_hi, self.pad, self.b_lo, self.b_hi = bounds
        self.slot_t: Any = None
        self.table_t: Any = None
        self.slots: _Prefixes | None = None
        self.blocks: _Prefixes | None = None
        self.ptr = 0
        self.width = 1

    def bind(self) -> bool:
        """(Re)build the views from the table's current buffers; False when one cannot be read here."""
        self.slot_t, self.table_t = self.table.slot_mapping.gpu, self.table.block_table.gpu
        self.ptr = self.slot_t.data_ptr()
        self.slots, self.blocks = _host_view(self.slot_t), _host_view(self.table_t)
        self.width = int(self.table_t.shape[1]) if self.table_t.dim() == 2 else 0
        return self.slots is not None and self.blocks is not None and self.counts is not None and self.width > 0


class _HostCheck:
    """The validator's clean test for one CPU step, on numpy views of the runner's persistent buffers, one method
    per phase (:meth:`inputs`, :meth:`outputs`).

    A decode step's metadata is a few dozen integers; on the CPU each torch op on them (a slice, a reduction, a
    ``tolist``) costs microseconds of dispatch, far more than reading them. This reads exactly the entries the
    validator would be given, through views bound once per buffer object, as Python lists, and applies the
    validator's host clean test to them (:mod:`tripwire.validate._rules`, which the CPU path runs too): every entry
    of a rule tensor within the rule's range (or its padding), used columns or not; the per-row block counts within
    ``[0, width]``; ``query_start_loc`` non-decreasing from 0 up to the step's tokens. When it holds, the phase's
    validator would count nothing and change nothing, so its call (and the host work of building its arguments and
    request numbers) is skipped; otherwise the validator runs in full. Bounds come from the validators' declared
    rules and the test is theirs, so the two never differ.

    It runs on every step of the engine, after the model's previous forward pass has evicted most of the host's
    caches, so what it touches is kept small: bounds and views are attributes bound once (no rule lookup, no view
    built per step), buffers are compared by identity (no torch op), and the only objects made per step are the
    short lists read (a buffer's prefix of each length is made once: :class:`_Prefixes`). Each rule costs one call
    of the shared test; timed on clean decode steps against the same tests written inline in these methods, this
    layout (kept prefixes, the bound check written out in each phase) is the faster of the two, and is kept for
    that. A phase that sees a buffer it has not bound yet (the first step, or one after vLLM replaced a buffer) binds
    it and takes the exact path, so the validator's argument checks see every new buffer once before any step is
    skipped on it.
    """

    def __init__(self, sv: StepValidator) -> None:
        rules = sv.v.rules
        pos, sl = sv.vin.rules["positions"], rules["seq_lens"]
        self.pos_lo, self.pos_hi = pos.lo, pos.hi
        self.sl_lo, self.sl_hi = sl.lo, sl.hi
        self.groups = tuple(
            _Group(table, counts._source, (rules[sm].lo, rules[sm].hi, rules[sm].padding, rules[bt].lo, rules[bt].hi))
            for (sm, bt, _n, table), counts in zip(sv.groups, sv._counts, strict=True)
        )
        self.indexed = tuple(enumerate(self.groups))
        # The runner's tensors the views below were built from (None: not bound yet, so the first step binds).
        self._pos_t: Any = None
        self._sl_t: Any = None
        self._qsl_t: Any = None
        self._pos: _Prefixes | None = None
        self._sl: _Prefixes | None = None
        self._qsl: _Prefixes | None = None

    def _bind(self, runner: Any) -> bool:
        """Bind the views to the runner's current buffers. Returns False: the phase that binds takes the exact
        path."""
        self._pos_t, self._sl_t, self._qsl_t = runner.positions, runner.seq_lens, runner.query_start_loc.gpu
        self._pos, self._sl, self._qsl = (_host_view(t) for t in (self._pos_t, self._sl_t, self._qsl_t))
        ok = self._pos is not None and self._sl is not None and self._qsl is not None
        for g in self.groups:
            ok = g.bind() and ok  # every group binds, so the next step can skip
        if not ok:
            self._pos_t = None  # a buffer the views cannot read: left unbound, so every step binds and is exact
        return False

    def inputs(self, runner: Any, num_reqs: int, num_tokens: int) -> bool:
        """True when the step's positions and ``query_start_loc`` are clean by the validator's own test."""
        # The runner's buffers are the ones bound (attribute loads, written out here: a helper's call would cost
        # as much as one rule's test).
        if (
            runner.positions is not self._pos_t
            or runner.seq_lens is not self._sl_t
            or runner.query_start_loc.gpu is not self._qsl_t
        ):
            return self._bind(runner)
        # Kept prefixes of bound views and tolist() of a few entries (no torch op, no tensor allocated), tested by
        # the validator's own host clean test (tripwire.validate._rules): one plain function call per rule.
        if not entries_clean(self._pos[num_tokens].tolist(), self.pos_lo, self.pos_hi):  # type: ignore[index]
            return False
        return indptr_clean(self._qsl[num_reqs + 1].tolist(), num_tokens)  # type: ignore[index]

    def outputs(self, runner: Any, num_reqs: int, num_tokens: int, slot_mappings: dict[int, torch.Tensor]) -> bool:
        """True when the step's slot mappings, block tables, per-row counts and ``seq_lens`` are clean by the
        validator's own test."""
        # The runner's buffers are the ones bound (attribute loads, written out here: a helper's call would cost
        # as much as one rule's test).
        if (
            runner.positions is not self._pos_t
            or runner.seq_lens is not self._sl_t
            or runner.query_start_loc.gpu is not self._qsl_t
        ):
            return self._bind(runner)
        if not entries_clean(self._sl[num_reqs].tolist(), self.sl_lo, self.sl_hi):  # type: ignore[index]
            return False
        # (index, group) pairs built once: iterating them makes no enumerate object per step.
        for i, g in self.indexed:
            table = g.table
            if table.slot_mapping.gpu is not g.slot_t or table.block_table.gpu is not g.table_t:
                return self._bind(runner)
            sm = slot_mappings[i]
            if sm.data_ptr() != g.ptr:
                return False  # a slot mapping that is not a view of the runner's slot buffer: validated
            # numel, not shape[0] or len(): the cheapest of torch's reads of the length (no Size object). vLLM's
            # slot mapping is a prefix slice of that buffer (gpu[:n]), so its numel entries are the ones read here.
            if not entries_clean(g.slots[sm.numel()].tolist(), g.s_lo, g.s_hi, g.pad):  # type: ignore[index]
                return False
            width = g.width
            if not entries_clean(g.blocks[num_reqs * width].tolist(), g.b_lo, g.b_hi):  # type: ignore[index]
                return False
            if not lengths_clean(g.counts[num_reqs].tolist(), width):  # type: ignore[index]
                return False
        return True
