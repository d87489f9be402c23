"""vLLM releases' own source, read from the registry's wheels, and the hook points the vLLM plugin relies on checked
in it (tests/integrations/test_vllm_source.py).

The wheels are hundreds of MB; the plugin's checks need a dozen of their Python files. So a wheel is read as a zip
over HTTP range requests (the registry serves ``Accept-Ranges: bytes``): its central directory, then the members
wanted, each checked against the wheel's own RECORD (sha256) and cached under ``TRIPWIRE_VLLM_SOURCE_CACHE`` (default
``~/.cache/tripwire/vllm-source``), so a release is fetched once per machine.

:func:`check` reads the files with :mod:`ast` (no import: a release's dependencies need not be installed) and returns
what the plugin would refuse or break on: each runner's hook points and signatures, the step metadata each adapter
reads, the V1 block table's slot-mapping hook, the scheduler's per-request error set and the engine core's shutdown.
The names come from the plugin's own declaration of them (:data:`tripwire.integrations.vllm.HOOK_POINTS`, built
from the tables its hooks use), so the check and the plugin cannot drift apart.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import io
import json
import os
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

from tripwire.integrations.vllm import HOOK_POINTS

INDEX = "https://pypi.org/simple/vllm/"
# The files the checks read, by role (a release may lack the V1 runner's: 0.34 deleted it).
FILES = {
    "v2_runner": "vllm/v1/worker/gpu/model_runner.py",
    "v2_batch": "vllm/v1/worker/gpu/input_batch.py",
    "v2_tables": "vllm/v1/worker/gpu/block_table.py",
    "v2_states": "vllm/v1/worker/gpu/states.py",
    "v2_async": "vllm/v1/worker/gpu/async_utils.py",
    "v2_model_state": "vllm/v1/worker/gpu/model_states/interface.py",
    "v1_runner": "vllm/v1/worker/gpu_model_runner.py",
    "v1_tables": "vllm/v1/worker/block_table.py",
    "scheduler": "vllm/v1/core/sched/scheduler.py",
    "core": "vllm/v1/engine/core.py",
    "outputs": "vllm/outputs.py",
    "attn_layer": "vllm/model_executor/layers/attention/attention.py",
    "fa_backend": "vllm/v1/attention/backends/flash_attn.py",
    "triton_backend": "vllm/v1/attention/backends/triton_attn.py",
}


def cache_dir() -> Path:
    return Path(os.environ.get("TRIPWIRE_VLLM_SOURCE_CACHE", Path.home() / ".cache" / "tripwire" / "vllm-source"))


class _RangeFile(io.RawIOBase):
    """A remote file read through HTTP range requests, in 1 MiB blocks (the central directory and a member each
    take a request or two)."""

    BLOCK = 1 << 20

    def __init__(self, url: str) -> None:
        self.url = url
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as r:
            self.size = int(r.headers["Content-Length"])
        self.pos = 0
        self.blocks: dict[int, bytes] = {}

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def _block(self, k: int) -> bytes:
        if k not in self.blocks:
            lo, hi = k * self.BLOCK, min(self.size, (k + 1) * self.BLOCK) - 1
            req = urllib.request.Request(self.url, headers={"Range": f"bytes={lo}-{hi}"})
            with urllib.request.urlopen(req, timeout=120) as r:
                if r.status != 206:
                    raise OSError(f"{self.url}: the registry did not serve a range ({r.status})")
                self.blocks[k] = r.read()
        return self.blocks[k]

    def read(self, n: int = -1) -> bytes:
        end = self.size if n < 0 else min(self.size, self.pos + n)
        out = bytearray()
        while self.pos < end:
            k, off = divmod(self.pos, self.BLOCK)
            chunk = self._block(k)[off : off + end - self.pos]
            out += chunk
            self.pos += len(chunk)
        return bytes(out)

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def wheel_url(version: str) -> str:
    """The x86_64 manylinux wheel of vLLM ``version`` on the registry (its simple JSON index)."""
    req = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    for f in files:
        name = f["filename"]
        if name.startswith(f"vllm-{version}-") and name.endswith("x86_64.whl") and "manylinux" in name:
            return str(f["url"])
    raise LookupError(f"no x86_64 wheel of vllm {version} on {INDEX}")


def source(version: str) -> dict[str, str]:
    """The files of :data:`FILES` of vLLM ``version`` (role -> text; a file the release lacks is absent) and the
    wheel's METADATA (``"metadata"``), fetched once into the cache."""
    d = cache_dir() / version
    done = d / "complete.json"
    # The marker names the roles it fetched: a role added to FILES later makes the cached release stale (a marker of
    # the older shape, role -> path, too), so the new file is read instead of reported missing.
    marker = json.loads(done.read_text()) if done.exists() else {}
    if marker.get("wanted") != sorted(FILES):
        zf = zipfile.ZipFile(io.BufferedReader(_RangeFile(wheel_url(version)), buffer_size=1 << 16))
        names = set(zf.namelist())
        record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
        record = {}
        for line in zf.read(record_name).decode().splitlines():
            path, digest, _size = line.rsplit(",", 2)
            if digest.startswith("sha256="):
                record[path] = digest[len("sha256=") :]
        # The wheel's own metadata (its Version line: the release the files are of).
        wanted = {**FILES, "metadata": record_name.replace("/RECORD", "/METADATA")}
        present = {}
        for role, path in wanted.items():
            if path not in names:
                continue
            data = zf.read(path)
            got = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            if record.get(path) != got:
                raise OSError(f"vllm {version}: {path} does not match the wheel's RECORD")
            (d / path).parent.mkdir(parents=True, exist_ok=True)
            (d / path).write_bytes(data)
            present[role] = path
        marker = {"wanted": sorted(FILES), "present": present}
        done.write_text(json.dumps(marker))
    return {role: (d / path).read_text() for role, path in marker["present"].items()}


# ---------------------------------------------------------------------------------------------- the checks
def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}  # type: ignore[misc]


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def _self_attrs(cls: ast.ClassDef) -> set[str]:
    """Attributes a class assigns on ``self`` anywhere in its methods, and its annotated class-level fields."""
    out = set()
    for node in ast.walk(cls):
        targets: list[Any] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):  # type: ignore[misc]
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out


def _calls(fn: ast.AST, dotted: str) -> bool:
    """``fn`` calls ``dotted`` (e.g. ``self.prepare_attn``)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == dotted:
            return True
    return False


def _first_call(fn: ast.AST, names: tuple[str, ...]) -> int | None:
    """The line of ``fn``'s first call whose callee ends with one of ``names`` (e.g. ``.compute_logits``)."""
    lines = [
        node.lineno for node in ast.walk(fn) if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(names)
    ]
    return min(lines, default=None)


def _function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def check_numerics(files: dict[str, str]) -> list[str]:
    """What the numeric checks (``tripwire.integrations.vllm._numerics``) rely on and ``files`` lack: V2's ``sample`` computing the logits
    through the model's ``compute_logits`` before the grammar bitmask; V1 keeping them in ``ExecuteModelState.logits``
    for ``sample_tokens``, which applies the bitmask; the attention layer's cache-write op calling
    ``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)`` with the scales on the layer; and the
    backends' ``do_kv_cache_update`` signature."""
    problems: list[str] = []
    trees = {role: ast.parse(text) for role, text in files.items() if role in FILES}

    def need(cond: bool, what: str) -> None:
        if not cond:
            problems.append(what)

    logits_calls = (".compute_logits", ".compute_sample_logits")
    v2 = _class(trees["v2_runner"], "GPUModelRunner") if "v2_runner" in trees else None
    sample = _methods(v2).get("sample") if v2 is not None else None
    need(sample is not None, "V2 runner: no sample")
    if sample is not None:
        need(_params(sample)[:3] == ["self", "hidden_states", "input_batch"], "V2 sample's parameters")
        first = _first_call(sample, logits_calls)
        bitmask = _first_call(sample, ("apply_grammar_bitmask",))
        need(first is not None, "V2 sample: no compute_logits")
        need(first is None or bitmask is None or first < bitmask, "V2 sample: the grammar bitmask before the logits")
        if _first_call(sample, (".compute_sample_logits",)) is not None:
            # 0.34: through the model state, which must call the model's compute_logits (the one the plugin wraps).
            state = trees.get("v2_model_state")
            fn = next(
                (n for n in ast.walk(state) if isinstance(n, ast.FunctionDef) and n.name == "compute_sample_logits"),
                None,
            ) if state is not None else None  # fmt: skip
            need(
                fn is not None and _first_call(fn, (".compute_logits",)) is not None,
                "V2 model state: compute_sample_logits does not call the model's compute_logits",
            )
    if "v1_runner" in trees:
        state_cls = _class(trees["v1_runner"], "ExecuteModelState")
        need(state_cls is not None and "logits" in _self_attrs(state_cls), "V1 ExecuteModelState: no logits")
        v1 = _class(trees["v1_runner"], "GPUModelRunner")
        m = _methods(v1) if v1 is not None else {}
        need(
            "execute_model" in m and _first_call(m["execute_model"], ("ExecuteModelState",)) is not None,
            "V1 execute_model does not keep an ExecuteModelState",
        )
        need(
            "sample_tokens" in m and _first_call(m["sample_tokens"], ("apply_grammar_bitmask",)) is not None,
            "V1 sample_tokens does not apply the grammar bitmask (the check must run before it)",
        )
    layer = trees.get("attn_layer")
    op = _function(layer, "unified_kv_cache_update") if layer is not None else None
    need(op is not None, "attention layer: no unified_kv_cache_update")
    if op is not None:
        call = next(
            (
                n
                for n in ast.walk(op)
                if isinstance(n, ast.Call) and ast.unparse(n.func).endswith(".do_kv_cache_update")
            ),
            None,
        )
        need(call is not None and len(call.args) == 5, "unified_kv_cache_update: impl.do_kv_cache_update's 5 arguments")
    text = ast.unparse(layer) if layer is not None else ""  # unparse quotes strings with '
    need("register_buffer('_k_scale'" in text and "register_buffer('_v_scale'" in text,
         "attention layer: no _k_scale / _v_scale buffers")  # fmt: skip
    for role in ("fa_backend", "triton_backend"):
        impls = [
            fn
            for cls in ast.walk(trees[role]) if isinstance(cls, ast.ClassDef)
            for fn in cls.body if isinstance(fn, ast.FunctionDef) and fn.name == "do_kv_cache_update"
        ] if role in trees else []  # fmt: skip
        need(bool(impls), f"{FILES[role]}: no do_kv_cache_update")
        for fn in impls:
            need(
                _params(fn) == ["self", "layer", "key", "value", "kv_cache", "slot_mapping"],
                f"{FILES[role]}: do_kv_cache_update's parameters",
            )
    return problems


def check(files: dict[str, str]) -> list[str]:
    """What the vLLM plugin relies on and ``files`` (:func:`source`'s) lack, as messages; [] when all is there."""
    problems: list[str] = []
    trees = {role: ast.parse(text) for role, text in files.items() if role in FILES}

    def need(cond: bool, what: str) -> None:
        if not cond:
            problems.append(what)

    # The V2 runner (every release): hook points, the step's two phases around prepare_attn, the input batch.
    v2 = _class(trees["v2_runner"], "GPUModelRunner") if "v2_runner" in trees else None
    need(v2 is not None, "V2 runner: no GPUModelRunner in vllm/v1/worker/gpu/model_runner.py")
    if v2 is not None:
        m = _methods(v2)
        for hook in HOOK_POINTS.v2_runner:
            need(hook in m, f"V2 runner: no {hook}")
        if "prepare_attn" in m:
            need(_params(m["prepare_attn"]) == ["self", "input_batch"], "V2 prepare_attn(self, input_batch) changed")
            need(_calls(m["prepare_attn"], "self.block_tables.gather_block_tables"), "V2 prepare_attn: no gather")
            need(_calls(m["prepare_attn"], "self.block_tables.compute_slot_mappings"), "V2 prepare_attn: no slots")
        if "execute_model" in m:
            ps = _params(m["execute_model"])
            need(ps[:2] == ["self", "scheduler_output"] and "dummy_run" in ps, "V2 execute_model's parameters")
            need(_calls(m["execute_model"], "self.prepare_attn"), "V2 execute_model does not call self.prepare_attn")
        if "initialize_kv_cache" in m:
            need("kv_cache_config" in _params(m["initialize_kv_cache"]), "V2 initialize_kv_cache's parameters")
        need("req_states" in _self_attrs(v2) and "block_tables" in _self_attrs(v2), "V2 runner: state attributes")
        need({"max_num_reqs", "max_model_len"} <= _self_attrs(v2), "V2 runner: max_num_reqs, max_model_len")
    batch = _class(trees.get("v2_batch", ast.Module([], [])), "InputBatch")
    fields = _self_attrs(batch) if batch is not None else set()
    for f in HOOK_POINTS.v2_input_batch:
        need(f in fields, f"V2 InputBatch: no field {f}")
    tables = _class(trees.get("v2_tables", ast.Module([], [])), "BlockTables")
    t_attrs = (_self_attrs(tables) | set(_methods(tables))) if tables is not None else set()
    for a in HOOK_POINTS.v2_block_tables:
        need(a in t_attrs, f"V2 BlockTables: no {a}")
    states = _class(trees.get("v2_states", ast.Module([], [])), "RequestState")
    for a in HOOK_POINTS.v2_request_state:
        need(states is not None and a in _self_attrs(states), f"V2 RequestState: no {a}")
    out = _class(trees.get("v2_async", ast.Module([], [])), "AsyncOutput")
    need(out is not None and "get_output" in _methods(out), "V2 AsyncOutput: no get_output")

    # The V1 runner, where the release has it (0.26-0.33).
    if "v1_runner" in trees:
        v1 = _class(trees["v1_runner"], "GPUModelRunner")
        need(v1 is not None, "V1 runner: no GPUModelRunner")
        if v1 is not None:
            m = _methods(v1)
            for hook in HOOK_POINTS.v1_runner:
                need(hook in m, f"V1 runner: no {hook}")
            if "_build_attention_metadata" in m:
                ps = _params(m["_build_attention_metadata"])
                for p in ("num_reqs", "num_tokens", "slot_mappings", "for_cudagraph_capture"):
                    need(p in ps, f"V1 _build_attention_metadata: no parameter {p}")
            if "_prepare_inputs" in m:
                need(
                    _calls(m["_prepare_inputs"], "self.input_batch.block_table.compute_slot_mapping"),
                    "V1 _prepare_inputs does not compute the slot mapping through its block table",
                )
        mg = _class(trees.get("v1_tables", ast.Module([], [])), "MultiGroupBlockTable")
        hook = _methods(mg).get(HOOK_POINTS.v1_block_table) if mg is not None else None
        need(hook is not None, "V1 MultiGroupBlockTable: no compute_slot_mapping")
        if hook is not None:
            need(_params(hook) == ["self", "num_reqs", "query_start_loc", "positions"], "V1 compute_slot_mapping")

    # The scheduler's per-request error set, its update and the engine core's shutdown.
    sched = _class(trees["scheduler"], "Scheduler")
    sm = _methods(sched) if sched is not None else {}
    for name in ("update_from_output", "finish_requests", "__init__"):
        need(name in sm, f"Scheduler: no {name}")
    errors = HOOK_POINTS.scheduler_errors
    if "update_from_output" in sm and "__init__" in sm:
        upd = ast.unparse(sm["update_from_output"])
        need(errors in ast.unparse(sm["__init__"]) and errors in upd, f"Scheduler: no {errors}")
        need("FINISHED_ERROR" in upd, "Scheduler.update_from_output: no FINISHED_ERROR")
    core = _class(trees["core"], "EngineCore")
    need(core is not None and "shutdown" in _methods(core), "EngineCore: no shutdown")
    return problems


def uses_request_error(files: dict[str, str]) -> bool:
    """The release keeps ``grammar_compile_error_reqs`` as a dict of ``vllm.outputs.RequestError`` (0.33 and
    later): the contained request's error then carries tripwire's message."""
    sched = _class(ast.parse(files["scheduler"]), "Scheduler")
    init = ast.unparse(_methods(sched)["__init__"]) if sched is not None else ""
    return f"{HOOK_POINTS.scheduler_errors}: dict[str, RequestError]" in init
