"""A host-side metadata bug, injected into vLLM's own model runner (the vLLM demo, tests, fuzz and benchmark).

Not a tripwire feature: a tool that re-creates the bugs tripwire guards against, the way they happen in a real
engine, by writing bad entries into the runner's own persistent buffers for one step:

* ``read``: a bad block id in the victim's block-table column 0 (a context block attention reads), written after
  the step's inputs are prepared (the slot mapping was computed from the good table);
* ``write``: a bad block id in the column of the victim's newest token, written into the host table before the step
  commits it, so vLLM computes that token's KV-cache slot from it (the KV write goes through the bad block);
* ``slot``: a bad slot id in the victim's newest token's slot mapping, after it was computed.

The original entries are restored when the step ends (a one-step bug). A fault names its victim by the first
token of its prompt (``marker``; a list: its first tokens), its step by how many tokens the victim has generated (0: the prefill), and its
value as an int or ``"end"`` (the first id past the end: the KV cache's block count, or its slot count for
``slot``).

It is loaded as a vLLM general plugin from a distribution written at run time (:func:`plugin_dir`), so it runs in
every vLLM process, the engine core's own included; it does nothing unless ``TRIPWIRE_VLLM_FAULTS`` holds a JSON
list of faults (and, as a control, ``TRIPWIRE_VLLM_FAULTS_NO_EVICT=1`` switches containment's prefix-cache
eviction off). Each injection is appended as a JSON line to ``TRIPWIRE_VLLM_FAULTS_LOG`` when set.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["ENV", "KINDS", "LOG_ENV", "plugin_dir", "register"]

ENV = "TRIPWIRE_VLLM_FAULTS"
LOG_ENV = "TRIPWIRE_VLLM_FAULTS_LOG"
# A control for the tests: tripwire's containment with its prefix-cache eviction switched off (a victim's blocks
# then stay in vLLM's prefix cache, as they would without it).
NO_EVICT_ENV = "TRIPWIRE_VLLM_FAULTS_NO_EVICT"
KINDS = ("read", "write", "slot")
_DIST = "tripwire_vllm_faults-0.dist-info"


def plugin_dir(root: str | os.PathLike[str]) -> str:
    """Write (once) a distribution under ``root`` whose ``vllm.general_plugins`` entry point ``tripwire_faults`` is
    :func:`register`; put the returned folder on ``PYTHONPATH`` for vLLM's processes to load it."""
    d = Path(root) / _DIST
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: tripwire-vllm-faults\nVersion: 0\n")
    (d / "entry_points.txt").write_text(
        "[vllm.general_plugins]\ntripwire_faults = tripwire.cli._vllm_faults:register\n"
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
            raise ValueError(f"{ENV}: fault {f} needs an int step (the victim's generated tokens at the fault)")
    return faults


def _log(entry: dict[str, Any]) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


class _Injector:
    def __init__(self, faults: list[dict[str, Any]]) -> None:
        self.faults = faults
        self.done: set[int] = set()
        self.restore: list[tuple[Any, int, int, int]] = []  # (tensor, row, col, old value)

    def due(self, runner: Any, kinds: tuple[str, ...]) -> list[tuple[dict[str, Any], str, int]]:
        batch = runner.input_batch
        out = []
        for i, f in enumerate(self.faults):
            if i in self.done or f["kind"] not in kinds:
                continue
            for row, rid in enumerate(batch.req_ids[: batch.num_reqs]):
                state = runner.requests.get(rid)
                if state is None or not _matches(state.prompt_token_ids, f["marker"]):
                    continue
                if len(state.output_token_ids) == f["step"]:
                    self.done.add(i)
                    out.append((f, rid, row))
        return out

    def value(self, runner: Any, f: dict[str, Any], group: int) -> int:
        v = f["value"]
        if v == "end":
            table = runner.input_batch.block_table[group]
            spec = runner.kv_cache_config.kv_cache_groups[group].kv_cache_spec
            blocks = int(runner.kv_cache_config.num_blocks) * (int(spec.block_size) // int(table.block_size))
            return blocks * int(table.block_size) if f["kind"] == "slot" else blocks
        return int(v)

    def put(self, t: Any, row: int, col: int, v: int) -> None:
        self.restore.append((t, row, col, int(t[row, col])))
        t[row, col] = v

    def before_prepare(self, runner: Any) -> None:
        for f, rid, row in self.due(runner, ("write",)):
            batch = runner.input_batch
            table = batch.block_table[0]
            n_sched = runner._tripwire_faults_sched.get(rid, 1)
            pos = int(batch.num_computed_tokens_cpu[row]) + n_sched - 1  # the newest token's position
            col = pos // int(table.block_size)
            v = self.value(runner, f, 0)
            for t in {
                id(table.block_table.cpu): table.block_table.cpu,
                id(table.block_table.gpu): table.block_table.gpu,
            }.values():
                self.put(t, row, col, v)
            _log({"kind": "write", "request": rid, "row": row, "col": col, "position": pos, "value": v, **_meta(f)})

    def after_prepare(self, runner: Any) -> None:
        for f, rid, row in self.due(runner, ("read", "slot")):
            batch = runner.input_batch
            table = batch.block_table[0]
            v = self.value(runner, f, 0)
            if f["kind"] == "read":
                for t in {
                    id(table.block_table.cpu): table.block_table.cpu,
                    id(table.block_table.gpu): table.block_table.gpu,
                }.values():
                    self.put(t, row, 0, v)
                _log({"kind": "read", "request": rid, "row": row, "col": 0, "value": v, **_meta(f)})
            else:
                token = int(runner.query_start_loc.np[row + 1]) - 1
                sm = table.slot_mapping.gpu
                self.restore.append((sm.view(1, -1), 0, token, int(sm[token])))
                sm[token] = v
                _log({"kind": "slot", "request": rid, "row": row, "token": token, "value": v, **_meta(f)})

    def after_step(self) -> None:
        for t, row, col, old in reversed(self.restore):
            t[row, col] = old
        self.restore.clear()


def _matches(prompt: Any, marker: int | list[int]) -> bool:
    head = [marker] if isinstance(marker, int) else list(marker)
    return prompt is not None and list(prompt[: len(head)]) == head


def _meta(f: dict[str, Any]) -> dict[str, Any]:
    return {"marker": f["marker"], "step": f["step"], "spec": f.get("value")}


def register() -> None:
    """The plugin: wrap the V1 runner's ``execute_model`` and ``_prepare_inputs`` when faults are configured."""
    faults = _faults()
    if os.environ.get(NO_EVICT_ENV) == "1":
        from ..integrations import _vllm_contain

        _vllm_contain._evict = lambda sched, request_ids: None
    if not faults:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_tripwire_faults", None) is not None:
        return
    inj = _Injector(faults)
    prepare = GPUModelRunner._prepare_inputs
    execute = GPUModelRunner.execute_model

    @functools.wraps(prepare)
    def _prepare_inputs(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._tripwire_faults_sched = dict(scheduler_output.num_scheduled_tokens)
        inj.before_prepare(self)
        out = prepare(self, scheduler_output, *args, **kwargs)
        inj.after_prepare(self)
        return out

    @functools.wraps(execute)
    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return execute(self, *args, **kwargs)
        finally:
            inj.after_step()

    GPUModelRunner._prepare_inputs = _prepare_inputs  # type: ignore[method-assign]
    GPUModelRunner.execute_model = execute_model  # type: ignore[method-assign]
    GPUModelRunner._tripwire_faults = inj  # type: ignore[attr-defined]
