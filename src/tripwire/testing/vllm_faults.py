"""A host-side metadata bug, injected into vLLM's own model runner (the vLLM demo, tests, fuzz and benchmark).

Not a tripwire feature: a tool that re-creates the bugs tripwire guards against, the way they happen in a real
engine, by writing bad entries into the runner's own persistent state for one step, upstream of tripwire's checks
(before the point where tripwire validates the step):

* ``read``: a bad block id in the victim's block-table column 0 (a context block attention reads). V1: written after
  the step's inputs are prepared (the slot mapping was computed from the good table); V2: into the request's row of
  the block table before ``prepare_attn`` gathers it (its slot mapping too, where the newest token is in column 0).
* ``write``: a bad block id in the column of the victim's newest token, before vLLM computes that token's KV-cache
  slot from it (the KV write goes through the bad block).
* ``slot``: a bad slot id in the victim's newest token's slot mapping, after vLLM computed it.
* ``position``: a bad position of the victim's newest token, before vLLM's slot-mapping kernel reads the table at
  ``position // block_size`` (``"end"``: the first position past the table's width).
* ``idx``: (V2) a bad request-state row in the victim's entry of ``idx_mapping``, before ``prepare_attn`` reads the
  tables through it (``"end"``: ``max_num_reqs``).
* ``num_blocks``: a bad block count for the victim's request, before V2's gather copies that many columns (V1: the
  per-row count vLLM keeps, which tripwire's validator reads; ``"end"``: one past the table's width).
* ``nan``: a NaN (``value`` ``"inf"``: an Inf) in the victim's last hidden state, the row vLLM computes the
  victim's logits from, as the step's sampled hidden states enter the model's ``compute_logits`` (a numeric fault
  of that request: its logits row is non-finite). There, not in a hook on the last decoder layer: that layer runs
  inside vLLM's compiled and captured forward, where a Python hook runs once at trace time and never at a graph's
  replay; ``compute_logits`` runs eagerly in both runners, so the injection lands at the chosen step under CUDA
  graphs too. The effect on the logits is the one a last-layer NaN has (the layer's own KV comes from its input).
* ``kv``: the victim's new K values in one attention layer (``layer``: its index in vLLM's forward context, default
  0) set to ``value`` (a float: past the FP8 range, for the clip counter) as they enter the layer's cache write
  (``impl.do_kv_cache_update``). A Python wrapper: it runs where the write runs eagerly (eager, piecewise graphs),
  not inside a FULL graph's replay.

The original entries are restored when the step ends (a one-step bug). A fault names its victim by the first
token of its prompt (``marker``; a list: its first tokens), its step by how many steps the victim has been scheduled
in before (0: the prefill), and its value as an int or ``"end"`` (the first id past the end: the KV cache's block
count, its slot count for ``slot``, and as above for the others).

It is loaded as a vLLM general plugin from a distribution written at run time (:func:`plugin_dir`), so it runs in
every vLLM process, the engine core's own included; it does nothing unless ``TRIPWIRE_VLLM_FAULTS`` holds a JSON
list of faults (and, as a control, ``TRIPWIRE_VLLM_FAULTS_NO_EVICT=1`` switches containment's prefix-cache
eviction off). Each injection is appended as a JSON line to ``TRIPWIRE_VLLM_FAULTS_LOG`` when set.
"""

from __future__ import annotations

import functools
import json
import os
import types
from pathlib import Path
from typing import Any

__all__ = ["ENV", "KINDS", "LOG_ENV", "plugin_dir", "register"]

ENV = "TRIPWIRE_VLLM_FAULTS"
LOG_ENV = "TRIPWIRE_VLLM_FAULTS_LOG"
# A control for the tests: tripwire's containment with its prefix-cache eviction switched off (a victim's blocks
# then stay in vLLM's prefix cache, as they would without it).
NO_EVICT_ENV = "TRIPWIRE_VLLM_FAULTS_NO_EVICT"
KINDS = ("read", "write", "slot", "position", "idx", "num_blocks", "nan", "kv")
_DIST = "tripwire_vllm_faults-0.dist-info"


def plugin_dir(root: str | os.PathLike[str]) -> str:
    """Write (once) a distribution under ``root`` whose ``vllm.general_plugins`` entry points are :func:`register`
    (``tripwire_faults``) and tripwire's own plugin (``tripwire_checkout``: a source checkout on the path, not
    installed into the engine's environment, as on a machine with no registry; where tripwire is installed too,
    vLLM calls both and the second install is a no-op); put the returned folder on ``PYTHONPATH`` for vLLM's
    processes to load them."""
    d = Path(root) / _DIST
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: tripwire-vllm-faults\nVersion: 0\n")
    (d / "entry_points.txt").write_text(
        "[vllm.general_plugins]\ntripwire_faults = tripwire.testing.vllm_faults:register\n"
        "tripwire_checkout = tripwire.integrations.vllm:register\n"
    )
    return str(Path(root))


def _faults() -> list[dict[str, Any]]:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return []
    faults = json.loads(raw)
    for f in faults:
        if f.get("kind") not in KINDS:
            raise ValueError(f"{ENV}: fault {f} has no kind in {KINDS}")
        m = f.get("marker")
        if not (isinstance(m, int) or (isinstance(m, list) and m and all(isinstance(x, int) for x in m))):
            raise ValueError(f"{ENV}: fault {f} needs a marker: the prompt's first token, or its first tokens")
        if not isinstance(f.get("step"), int):
            raise ValueError(f"{ENV}: fault {f} needs an int step (the victim's steps before the fault)")
    return faults


def _log(entry: dict[str, Any]) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _matches(prompt: Any, marker: int | list[int]) -> bool:
    head = [marker] if isinstance(marker, int) else list(marker)
    return prompt is not None and list(prompt[: len(head)]) == head


def _meta(f: dict[str, Any]) -> dict[str, Any]:
    return {"marker": f["marker"], "step": f["step"], "spec": f.get("value")}


class _Injector:
    """The faults of this process, by step: each request's prompt head (from its first scheduling) and how many steps
    it was scheduled in (the step of a fault)."""

    def __init__(self, faults: list[dict[str, Any]]) -> None:
        self.faults = faults
        self.done: set[int] = set()
        self.prompts: dict[str, list[int]] = {}
        self.steps: dict[str, int] = {}
        self.due: list[tuple[dict[str, Any], str]] = []  # this step's faults: (fault, request id)
        self.restore: list[tuple[Any, tuple[Any, ...], int]] = []  # (tensor or array, index, old value)
        # Restored after the step's sampling, not at the end of execute_model: V2's idx_mapping, which the sampler and
        # its post_update read too (a real bad entry would still be there).
        self.restore_late: list[tuple[Any, tuple[Any, ...], int]] = []
        # ``nan`` faults of this step, due when its logits are computed (V2: in sample_tokens, after execute_model),
        # and the step's batch (V2's input batch: its row order is the logits'; None: V1's runner batch).
        self.due_logits: list[tuple[dict[str, Any], str]] = []
        self.batch: Any = None

    def begin(self, scheduler_output: Any) -> None:
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()):
            self.prompts[new.req_id] = list(new.prompt_token_ids[:4]) if new.prompt_token_ids is not None else []
            self.steps.pop(new.req_id, None)  # a request id seen again (a resumed request) starts over
        self.due = []
        for rid in scheduler_output.num_scheduled_tokens:
            step = self.steps.get(rid, 0)
            self.steps[rid] = step + 1
            for i, f in enumerate(self.faults):
                if i not in self.done and f["step"] == step and _matches(self.prompts.get(rid), f["marker"]):
                    self.done.add(i)
                    (self.due_logits if f["kind"] == "nan" else self.due).append((f, rid))

    def take(self, kinds: tuple[str, ...]) -> list[tuple[dict[str, Any], str]]:
        out = [(f, rid) for f, rid in self.due if f["kind"] in kinds]
        self.due = [(f, rid) for f, rid in self.due if f["kind"] not in kinds]
        return out

    def put(self, t: Any, index: tuple[Any, ...], v: int, *, late: bool = False) -> None:
        (self.restore_late if late else self.restore).append((t, index, int(t[index])))
        t[index] = v

    def after_step(self) -> None:
        _undo(self.restore)
        self.due = []

    def after_sampling(self) -> None:
        _undo(self.restore_late)
        self.due_logits = []
        self.batch = None

    def logits_input(self, runner: Any, hidden: Any) -> None:
        """The step's ``nan`` faults, into the rows of the sampled hidden states ``compute_logits`` is given."""
        due, self.due_logits = self.due_logits, []
        for f, rid in due:
            ids = list(self.batch.req_ids if self.batch is not None else runner.input_batch.req_ids)
            b = ids.index(rid)
            value = float("inf") if f.get("value") == "inf" else float("nan")
            hidden[b] = value
            _log({"kind": "nan", "request": rid, "row": b, "value": str(value), **_meta(f)})


def _wrap_kv(inj: _Injector, runner: Any) -> None:
    """Wrap the cache write of each layer a ``kv`` fault names, once, on its impl instance (outside tripwire's)."""
    layers = list(runner.vllm_config.compilation_config.static_forward_context.items())
    for f in inj.faults:
        if f["kind"] != "kv":
            continue
        name, layer = layers[int(f.get("layer", 0))]
        impl = layer.impl
        if getattr(impl.do_kv_cache_update, "_tripwire_faults", False):
            continue
        inner = impl.do_kv_cache_update

        def write(
            lay: Any, key: Any, value: Any, kv_cache: Any, slots: Any, _inner: Any = inner, _name: str = name
        ) -> Any:
            for f2, rid in inj.take(("kv",)):
                if layers[int(f2.get("layer", 0))][0] != _name:
                    inj.due.append((f2, rid))
                    continue
                if inj.batch is not None:
                    b = list(inj.batch.req_ids).index(rid)
                    lo, hi = int(inj.batch.query_start_loc_np[b]), int(inj.batch.query_start_loc_np[b + 1])
                else:
                    b = runner.input_batch.req_ids.index(rid)
                    lo, hi = int(runner.query_start_loc.np[b]), int(runner.query_start_loc.np[b + 1])
                key[lo:hi] = float(f2["value"])
                _log({"kind": "kv", "request": rid, "row": b, "layer": _name, "tokens": hi - lo,
                      "elements": (hi - lo) * key.shape[1] * key.shape[2], "value": f2["value"], **_meta(f2)})  # fmt: skip
            return _inner(lay, key, value, kv_cache, slots)

        write._tripwire_faults = True  # type: ignore[attr-defined]
        impl.do_kv_cache_update = write


def _wrap_logits(inj: _Injector, runner: Any) -> None:
    """Wrap the runner's model's ``compute_logits`` on the instance, once, outside tripwire's own wrapper of it (V2),
    so the NaN is in its input, upstream of every check."""
    model = runner.model
    if getattr(model.compute_logits, "_tripwire_faults", False):
        return
    inner = model.compute_logits

    def compute_logits(hidden: Any, *args: Any, **kwargs: Any) -> Any:
        if inj.due_logits:
            inj.logits_input(runner, hidden)
        return inner(hidden, *args, **kwargs)

    compute_logits._tripwire_faults = True  # type: ignore[attr-defined]
    model.compute_logits = compute_logits


def _undo(restore: list[tuple[Any, tuple[Any, ...], int]]) -> None:
    for t, index, old in reversed(restore):
        t[index] = old
    restore.clear()


# ------------------------------------------------------------------------------------------------ the V1 runner
def _v1_value(runner: Any, f: dict[str, Any]) -> int:
    v = f["value"]
    if v != "end":
        return int(v)
    table = runner.input_batch.block_table[0]
    if f["kind"] == "position":
        return int(table.block_table.gpu.shape[1]) * int(table.block_size)
    if f["kind"] == "num_blocks":
        return int(table.block_table.gpu.shape[1]) + 1
    spec = runner.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    blocks = int(runner.kv_cache_config.num_blocks) * (int(spec.block_size) // int(table.block_size))
    return blocks * int(table.block_size) if f["kind"] == "slot" else blocks


def _v1_row(runner: Any, rid: str) -> int:
    return runner.input_batch.req_ids.index(rid)


def _v1_tables(table: Any) -> list[Any]:
    return list({id(t): t for t in (table.block_table.cpu, table.block_table.gpu)}.values())


def _v1_before_prepare(inj: _Injector, runner: Any, sched: Any) -> None:
    for f, rid in inj.take(("write", "num_blocks")):
        batch = runner.input_batch
        row = _v1_row(runner, rid)
        table = batch.block_table[0]
        v = _v1_value(runner, f)
        if f["kind"] == "num_blocks":
            inj.put(table.num_blocks_per_row, (row,), v)
            _log({"kind": "num_blocks", "request": rid, "row": row, "value": v, **_meta(f)})
            continue
        pos = int(batch.num_computed_tokens_cpu[row]) + int(sched.num_scheduled_tokens[rid]) - 1
        col = pos // int(table.block_size)
        for t in _v1_tables(table):
            inj.put(t, (row, col), v)
        _log({"kind": "write", "request": rid, "row": row, "col": col, "position": pos, "value": v, **_meta(f)})


def _v1_slot_mapping(inj: _Injector, runner: Any, table_obj: Any, args: tuple[Any, ...]) -> None:
    """Inside the step, before vLLM's slot-mapping kernel (and before tripwire's inputs phase)."""
    for f, rid in inj.take(("position",)):
        row = _v1_row(runner, rid)
        token = int(runner.query_start_loc.np[row + 1]) - 1
        v = _v1_value(runner, f)
        inj.put(runner.positions, (token,), v)
        _log({"kind": "position", "request": rid, "row": row, "token": token, "value": v, **_meta(f)})


def _v1_after_prepare(inj: _Injector, runner: Any) -> None:
    for f, rid in inj.take(("read", "slot")):
        row = _v1_row(runner, rid)
        table = runner.input_batch.block_table[0]
        v = _v1_value(runner, f)
        if f["kind"] == "read":
            for t in _v1_tables(table):
                inj.put(t, (row, 0), v)
            _log({"kind": "read", "request": rid, "row": row, "col": 0, "value": v, **_meta(f)})
        else:
            token = int(runner.query_start_loc.np[row + 1]) - 1
            inj.put(table.slot_mapping.gpu, (token,), v)
            _log({"kind": "slot", "request": rid, "row": row, "token": token, "value": v, **_meta(f)})


def _register_v1(inj: _Injector) -> None:
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return
    if getattr(GPUModelRunner, "_tripwire_faults", None) is not None:
        return
    prepare = GPUModelRunner._prepare_inputs
    execute = GPUModelRunner.execute_model

    @functools.wraps(prepare)
    def _prepare_inputs(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        _v1_before_prepare(inj, self, scheduler_output)
        table_obj = self.input_batch.block_table
        cls_fn = type(table_obj).compute_slot_mapping

        def compute_slot_mapping(tbl: Any, *a: Any, **k: Any) -> Any:
            _v1_slot_mapping(inj, self, tbl, a)
            return cls_fn(tbl, *a, **k)  # the class's (tripwire's wrapper, when installed)

        table_obj.compute_slot_mapping = types.MethodType(compute_slot_mapping, table_obj)
        try:
            out = prepare(self, scheduler_output, *args, **kwargs)
        finally:
            table_obj.__dict__.pop("compute_slot_mapping", None)
        _v1_after_prepare(inj, self)
        return out

    @functools.wraps(execute)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("dummy_run", False):
            inj.begin(scheduler_output)
            _wrap_logits(inj, self)
            _wrap_kv(inj, self)
        try:
            return execute(self, scheduler_output, *args, **kwargs)
        finally:
            inj.after_step()
            inj.after_sampling()  # V1 computes the step's logits in execute_model

    GPUModelRunner._prepare_inputs = _prepare_inputs  # type: ignore[method-assign]
    GPUModelRunner.execute_model = execute_model  # type: ignore[method-assign]
    GPUModelRunner._tripwire_faults = inj  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------ the V2 runner
def _v2_value(runner: Any, f: dict[str, Any]) -> int:
    v = f["value"]
    if v != "end":
        return int(v)
    tables = runner.block_tables
    width = int(tables.block_tables[0].gpu.shape[1])
    kbs = int(getattr(tables, "kernel_block_sizes", tables.block_sizes)[0])
    kind = f["kind"]
    if kind == "position":
        return width * kbs
    if kind == "idx":
        return int(runner.max_num_reqs)
    if kind == "num_blocks":
        return width + 1
    bs = int(tables.block_sizes[0])
    blocks = int(runner.kv_cache_config.num_blocks) * (bs // kbs)
    return blocks * kbs if kind == "slot" else blocks


def _v2_before_attn(inj: _Injector, runner: Any, batch: Any) -> None:
    """Before ``prepare_attn`` (and before tripwire's inputs phase)."""
    tables = runner.block_tables
    kbs = int(getattr(tables, "kernel_block_sizes", tables.block_sizes)[0])
    for f, rid in inj.take(("read", "write", "position", "idx", "num_blocks")):
        b = batch.req_ids.index(rid)
        state = int(batch.idx_mapping_np[b])
        token = int(batch.query_start_loc_np[b + 1]) - 1
        pos = int(batch.num_computed_tokens_np[b]) + int(batch.num_scheduled_tokens[b]) - 1
        v = _v2_value(runner, f)
        kind = f["kind"]
        entry: dict[str, Any] = {"kind": kind, "request": rid, "row": b, "state_row": state, "value": v, **_meta(f)}
        if kind in ("read", "write"):
            col = 0 if kind == "read" else pos // kbs
            inj.put(tables.block_tables[0].gpu, (state, col), v)
            entry.update(col=col, position=pos)
        elif kind == "position":
            inj.put(batch.positions, (token,), v)
            entry.update(token=token)
        elif kind == "idx":
            inj.put(batch.idx_mapping, (b,), v, late=True)
        else:
            inj.put(tables.num_blocks.gpu, (0, state), v)
        _log(entry)


def _v2_after_slots(inj: _Injector, runner: Any, batch: Any, slots: Any) -> None:
    for f, rid in inj.take(("slot",)):
        b = batch.req_ids.index(rid)
        token = int(batch.query_start_loc_np[b + 1]) - 1
        v = _v2_value(runner, f)
        inj.put(slots, (0, token), v)
        _log({"kind": "slot", "request": rid, "row": b, "token": token, "value": v, **_meta(f)})


def _register_v2(inj: _Injector) -> None:
    try:
        from vllm.v1.worker.gpu.block_table import BlockTables
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
    except Exception:
        return
    if getattr(V2, "_tripwire_faults", None) is not None:
        return
    execute = V2.execute_model
    slots_fn = BlockTables.compute_slot_mappings

    @functools.wraps(execute)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("dummy_run", False):
            return execute(self, scheduler_output, *args, **kwargs)
        inj.begin(scheduler_output)
        _wrap_logits(inj, self)
        _wrap_kv(inj, self)
        runner = self

        def prepare_attn(me: Any, input_batch: Any) -> Any:
            inj.batch = input_batch  # the logits' row order, for sample_tokens' nan faults
            _v2_before_attn(inj, runner, input_batch)
            tables = runner.block_tables

            def compute_slot_mappings(tbl: Any, *a: Any, **k: Any) -> Any:
                out = slots_fn(tbl, *a, **k)
                _v2_after_slots(inj, runner, input_batch, out)
                return out

            tables.compute_slot_mappings = types.MethodType(compute_slot_mappings, tables)
            try:
                return type(me).prepare_attn(me, input_batch)  # the class's (tripwire's wrapper, when installed)
            finally:
                tables.__dict__.pop("compute_slot_mappings", None)

        self.prepare_attn = types.MethodType(prepare_attn, self)
        try:
            return execute(self, scheduler_output, *args, **kwargs)
        finally:
            self.__dict__.pop("prepare_attn", None)
            inj.after_step()

    sample = V2.sample_tokens

    @functools.wraps(sample)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return sample(self, *args, **kwargs)
        finally:
            inj.after_sampling()

    V2.execute_model = execute_model  # type: ignore[method-assign]
    V2.sample_tokens = sample_tokens  # type: ignore[method-assign]
    V2._tripwire_faults = inj  # type: ignore[attr-defined]


def register() -> None:
    """The plugin: wrap the runners' steps when faults are configured."""
    faults = _faults()
    if os.environ.get(NO_EVICT_ENV) == "1":
        from ..integrations.vllm import _contain

        _contain._evict = lambda sched, request_ids: None
    if not faults:
        return
    inj = _Injector(faults)
    _register_v1(inj)
    _register_v2(inj)
