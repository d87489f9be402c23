"""Run vLLM's engine on a tiny random Llama, in this process, and print what it returned (the vLLM demo, tests, fuzz
and benchmark drive vLLM through it, each run in a process of its own: an unguarded fault kills it).

``python -m tripwire.testing.vllm_run CONFIG_JSON`` with the vLLM environment's python. The config:

* ``model``: a folder; a tiny random Llama (2 layers, hidden 128) is saved there with ``save_pretrained`` when it
  holds none (no download: the weights are random, seeded).
* ``rounds``: a list of rounds, each a list of prompts (token id lists): one ``LLM.generate`` call per round, greedy,
  ``max_tokens`` new tokens each (default 16), ``ignore_eos``.
* ``prefix_caching`` (optional, default off): vLLM's prefix cache.
* ``gpu`` (optional): run on a GPU with vLLM's GPU defaults and these overrides (:func:`engine`).
* ``bench`` (optional): ``{"batches": [B, ...], "steps": N, "repeats": R, "block": K}``: instead of rounds, time
  the decode steps (``llm_engine.step()``) with the plugin on and off, interleaved in blocks of K steps (default
  1: step by step; see ``benchmarks/bench_vllm.py`` and ``benchmarks/bench_vllm_gpu.py``).

vLLM's own settings come from the environment (``VLLM_ENABLE_V1_MULTIPROCESSING``; ``TRIPWIRE_VLLM`` for the plugin;
:mod:`tripwire.testing.vllm_faults` for injected faults). The last line of stdout is one JSON object: per round, per
request, its vLLM request id, tokens and finish reason (a round the engine failed: ``{"raised": ...}``, and no
more rounds after it); whether the V1 runner was hooked in this process.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

MODEL_SEED = 0
KV_CACHE_BYTES = 32 << 20


def make_model(path: str) -> None:
    """Save the tiny random Llama to ``path`` unless a model is there already."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(MODEL_SEED)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,  # wide enough that every token's attention over the cache changes the output
    )
    LlamaForCausalLM(cfg).save_pretrained(path)


def engine(model: str, max_seqs: int = 8, prefix_caching: bool = False, gpu: dict[str, Any] | None = None) -> Any:
    """vLLM's engine on the tiny model. ``gpu``: run it on a GPU as vLLM's users do (CUDA graphs and torch.compile at
    vLLM's defaults, async scheduling on, bf16), with these overrides: ``eager`` (no graphs, no compile),
    ``cudagraph_mode`` (``"FULL"``, ``"FULL_AND_PIECEWISE"``, ...), ``backend`` (``"FLASH_ATTN"``,
    ``"TRITON_ATTN"``), ``async_scheduling``, ``gpu_memory_utilization``, ``kv_cache_dtype``; V1 or V2 by ``VLLM_USE_V2_MODEL_RUNNER``.
    Without it: vLLM's CPU build (eager, float32, a 32 MiB KV cache)."""
    from vllm import LLM

    common: dict[str, Any] = {
        "model": model,
        "skip_tokenizer_init": True,
        "max_model_len": 128,
        "max_num_seqs": max_seqs,
        "seed": MODEL_SEED,
        "enable_prefix_caching": prefix_caching,
    }
    if gpu is None:
        return LLM(
            **common,
            dtype="float32",
            enforce_eager=True,
            # Small blocks, so a request spans several (a context block apart from the newest token's), and a small
            # cache, so the engine starts in seconds, not in the time it takes to zero gigabytes.
            block_size=32,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
        )
    capture = gpu.get("capture_sizes") or [1, 2, 4, 8, 16][: max(1, max_seqs.bit_length())]
    kw: dict[str, Any] = {
        **common,
        "dtype": "bfloat16",
        "block_size": 16,
        "kv_cache_memory_bytes": int(gpu.get("kv_cache_bytes", KV_CACHE_BYTES)),
        "enforce_eager": bool(gpu.get("eager", False)),
        # A short capture list: the engine starts in seconds; every batch of the runs (up to max_seqs) is captured.
        "compilation_config": {"cudagraph_capture_sizes": list(capture)},
    }
    if gpu.get("max_model_len"):
        kw["max_model_len"] = int(gpu["max_model_len"])
    if gpu.get("load_format"):
        kw["load_format"] = gpu["load_format"]  # "dummy": random weights of the model's config (no download)
    if gpu.get("cudagraph_mode"):
        kw["compilation_config"]["cudagraph_mode"] = gpu["cudagraph_mode"]
    if gpu.get("backend"):
        kw["attention_config"] = {"backend": gpu["backend"]}
    if "async_scheduling" in gpu:
        kw["async_scheduling"] = bool(gpu["async_scheduling"])
    if gpu.get("kv_cache_dtype"):
        kw["kv_cache_dtype"] = gpu["kv_cache_dtype"]  # "fp8": the FP8 clip counter's runs
    if gpu.get("gpu_memory_utilization"):
        kw["gpu_memory_utilization"] = float(gpu["gpu_memory_utilization"])
    return LLM(**kw)


def _hooked() -> bool:
    """A model runner's execute_model is tripwire's wrapper (anywhere in its chain of wrappers): a function of the
    plugin's runner-step module (by its code's file: functools.wraps gives a wrapper vLLM's ``__module__``). V1's where
    vLLM has it, else V2's."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    fn: Any = GPUModelRunner.execute_model
    while fn is not None:
        if fn.__code__.co_filename.endswith(os.path.join("integrations", "vllm", "_runner.py")):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def run_rounds(llm: Any, rounds: list[list[list[int]]], max_tokens: int) -> list[list[dict[str, Any]]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
    out: list[Any] = []
    for prompts in rounds:
        try:
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        except Exception as e:  # the engine failed the round (a stop: GuardTripped): record it, run no more rounds
            out.append({"raised": f"{type(e).__name__}: {e}"})
            break
        out.append(
            [
                {
                    "request_id": r.request_id,
                    "marker": r.prompt_token_ids[0],
                    "tokens": list(r.outputs[0].token_ids),
                    "finish_reason": str(r.outputs[0].finish_reason),
                }
                for r in res
            ]
        )
    return out


def _decode_steps(
    llm: Any, prompts: list[list[int]], steps: int, tag: str, before: Any = None
) -> list[tuple[float, float]]:
    """Each decode step of one round (``llm_engine.step()``: scheduler, runner, outputs), the prefill step left out:
    ``len(prompts)`` requests of ``steps`` new tokens. Per step: its wall time and this process's CPU time (all its
    threads; what waiting for a shared machine's cores adds to the wall time is not in it). ``before(i)`` runs
    before decode step ``i`` (0 is the prefill), outside the timed span."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=steps, detokenize=False, ignore_eos=True)
    eng = llm.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, sp)
    times = []
    i = 0
    while eng.has_unfinished_requests():
        if before is not None:
            before(i)
        c0, t0 = time.process_time(), time.perf_counter()
        eng.step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i:
            times.append((dt, dc))
        i += 1
    return times


# The step kinds of one interleaving cycle, and of the next (mirrored, so neither kind always follows the other).
_CYCLES = (("on", "off", "off2"), ("off2", "off", "on"))


def run_bench(llm: Any, batches: list[int], steps: int, repeats: int, block: int = 1) -> dict[str, Any]:
    """The decode step with the plugin on and off, interleaved in this one engine: before each decode step every
    method the plugin wraps is set to its wrapper (on) or to vLLM's original (off, as after ``uninstall``), in
    cycles of three kinds (on, off, off2, then mirrored), so the machine's drift and the requests' growing lengths
    hit every kind alike. ``block``: steps of one kind in a row, the first of each block not timed. With 1 (step by
    step) a step's timing can carry the previous step's kind: under async scheduling a step's sampled tokens (and
    the verdict riding with them) are taken in the next ``step()`` call. A repeat is one round of ``steps`` decode
    steps; its figure per kind is the median of its timed steps of that kind. "off" against "off2" gives the noise
    floor."""
    from tripwire.integrations import vllm as tw

    plugin = tw.installed()
    if plugin is None:
        raise RuntimeError("the benchmark needs TRIPWIRE_VLLM set at start-up (the validator is built then)")
    wrapped = {key: key[0].__dict__[key[1]] for key in plugin.originals}
    states = {"on": list(wrapped.items()), "off": list(plugin.originals.items())}
    states["off2"] = states["off"]
    if block < 1 or steps < 3 * block:
        raise ValueError(f"block={block}: expected 1 to steps / 3 ({steps // 3}) steps per block")
    out: dict[str, Any] = {"mode": plugin.mode, "steps": steps, "interleave": "step" if block == 1 else block}
    seq = [k for c in _CYCLES for k in c]
    n = 0
    for b in batches:
        prompts = [[7 + i, *range(20, 40)] for i in range(b)]
        _decode_steps(llm, prompts, steps, f"warm{b}")
        fig: dict[str, list[float]] = {"on": [], "off": [], "off2": []}
        cpu: dict[str, list[float]] = {"on": [], "off": [], "off2": []}
        every: dict[str, list[float]] = {"on": [], "off": [], "off2": []}  # each step's wall time, per kind
        inside: list[float] = []
        for _ in range(repeats):
            n += 1
            kinds: list[str] = []

            def before(i: int, kinds: list[str] = kinds, phase: int = n) -> None:
                # The prefill step (i == 0) runs with the plugin on: it is not timed, and the validator's views
                # bind there. Every step sets every method (also to what it was), so each pays the same type-cache
                # invalidation. A block's first step is recorded as "" (not timed: it carries the step before it).
                kind = "on" if i == 0 else seq[((i - 1) // block + 3 * phase) % len(seq)]
                for (cls, name), fn in states[kind]:
                    setattr(cls, name, fn)
                if i:
                    kinds.append(kind if block == 1 or (i - 1) % block else "")

            times = _decode_steps(llm, prompts, steps, f"r{n}", before)
            for kind in fig:
                mine = [t for t, k in zip(times, kinds, strict=True) if k == kind]
                every[kind].extend(t for t, _ in mine)
                fig[kind].append(statistics.median(t for t, _ in mine))
                cpu[kind].append(statistics.median(c for _, c in mine))
        for (cls, name), fn in states["on"]:
            setattr(cls, name, fn)
        # The plugin's own work, timed in rounds of their own (every step on): the timers' cost stays out of the
        # interleaved steps above.
        for k in range(3):
            hook, restore = _time_hooks()
            try:
                _decode_steps(
                    llm, prompts, steps, f"hook{b}-{k}", lambda i, hook=hook: hook.clear() if i == 1 else None
                )
            finally:
                restore()
            inside.append(sum(hook) / steps)
        out[str(b)] = {**fig, "hook_s_per_step": inside, "cpu": cpu, "steps": every}
        if _on_cuda():
            # Every device operation of the step with the plugin off and on (one profiled round each, "on" last, so
            # the plugin stays on): the operations it adds and the device-busy time side by side, and from the "on"
            # round the GPU time of tripwire's own kernels.
            ops = {}
            for kind in ("off", "on"):
                for (cls, name), fn in states[kind]:
                    setattr(cls, name, fn)
                ops[kind] = _device_ops(llm, prompts, steps, f"ops{b}{kind}")
            out[str(b)]["gpu_us_per_step"] = _kernel_time(ops["on"])
            out[str(b)]["device_ops"] = ops
    return out


def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# The device kernels tripwire adds to a vLLM step (the validators, V2's row guard and fence, the verdict copy).
# tripwire's kernels by name (the profiler's), and which part of the plugin each is: the logits check and the FP8
# clip count reported apart from the metadata guard.
_OURS = {
    "_nonfinite_rows_kernel": "logits",
    "_clip_count_kernel": "fp8",
    "_validate": "guard",
    "_rows_kernel": "guard",
    "_fence_kernel": "guard",
    "_gather_consume": "guard",
}


def _kernel_time(round_: dict[str, Any]) -> dict[str, float]:
    """From a profiled round with the plugin on (:func:`_device_ops`): the GPU time per decode step of tripwire's
    kernels and of every device operation (CUPTI, through torch.profiler; kernels replayed inside a CUDA graph are
    traced with their names), in microseconds: what the plugin's launches cost on the device inside the step, beside
    the step's own device time."""
    ours = total = 0.0
    parts = dict.fromkeys(_OURS.values(), 0.0)
    for name, (_count, us) in round_["ops"].items():
        total += us
        part = next((p for k, p in _OURS.items() if k in name), None)  # the first match: the most specific name
        if part is not None:
            ours += us
            parts[part] += us
    return {"tripwire_us": ours, "all_us": total, **{f"{p}_us": v for p, v in parts.items()}}


def _device_ops(llm: Any, prompts: list[list[int]], steps: int, tag: str) -> dict[str, Any]:
    """One profiled round of decode steps: per device operation name (kernels, copies, memsets), its count and
    microseconds per step, and the device-busy time per step (the union of the operations' intervals; the time
    between steps, which the host's pace sets, is left out)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _decode_steps(llm, prompts, steps, tag)
    n = steps + 1
    names: dict[str, list[float]] = {}
    spans = []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        c = names.setdefault(e.name[:120], [0.0, 0.0])
        c[0] += 1 / n
        c[1] += float(e.device_time) / n
        spans.append((float(e.time_range.start), float(e.time_range.end)))
    spans.sort()
    busy, end = 0.0, float("-inf")
    for a, z in spans:
        if z > end:
            busy += z - max(a, end)
            end = z
    return {"busy_us": busy / n, "ops": names}


def _time_hooks() -> tuple[list[float], Any]:
    """Time spent inside the plugin's per-step work (the clean test or the validator call, the verdict, the
    scheduler's side), summed into the returned list while it is on: the plugin's own cost, apart from the machine's
    noise. Returns the list and a function that takes the timers out again."""
    from tripwire.integrations.vllm import _contain, _steps

    spent: list[float] = []
    saved: list[tuple[type, str, Any]] = []

    def timed(cls: type, name: str) -> None:
        fn = cls.__dict__[name]
        saved.append((cls, name, fn))

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - t0)

        setattr(cls, name, wrapper)

    from tripwire.integrations.vllm import _numerics, _v2

    timed(_numerics.LogitsCheck, "__call__")  # the logits check (V1's and V2's: both call the runner's LogitsCheck)
    timed(_steps._HostCheck, "inputs")
    timed(_steps._HostCheck, "outputs")
    timed(_steps.StepValidator, "exact")
    timed(_v2.V2StepValidator, "inputs")
    timed(_v2.V2StepValidator, "outputs")
    for name in ("after_step", "before_update", "after_update"):
        timed(_contain.VerdictChannel, name)

    def restore() -> None:
        for cls, name, fn in saved:
            setattr(cls, name, fn)

    return spent, restore


def _clip_totals() -> dict[str, dict[str, int | float]]:
    """The FP8 clip rows of this process's plugin (the engine core in-process): site -> K/V counts and maxima, read
    after the rounds (a synchronous read: the harness's, never the step path's)."""
    from tripwire.integrations import vllm as tw_vllm
    from tripwire.numerics.clip import clip_totals

    plugin = tw_vllm.installed()
    if plugin is None:
        return {}
    out: dict[str, dict[str, int | float]] = {}
    for device in plugin.monitor.arena.devices():
        rows = plugin.monitor.read_rows(device)
        for site in plugin.monitor.registry.all():
            if site.kind == "clip" and site.id < len(rows):
                out[site.name] = clip_totals(rows[site.id])
    return out


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[1]) if len(argv) > 1 else {}
    model = cfg.get("model") or os.path.join(os.environ.get("TMPDIR", "/tmp"), "tripwire-vllm-tiny-llama")
    make_model(model)
    llm = engine(model, int(cfg.get("max_seqs", 8)), bool(cfg.get("prefix_caching", False)), cfg.get("gpu"))
    result: dict[str, Any] = {"hooked": _hooked(), "pid": os.getpid()}
    if "bench" in cfg:
        b = cfg["bench"]
        batches, steps, repeats = [int(x) for x in b["batches"]], int(b["steps"]), int(b["repeats"])
        result["bench"] = run_bench(llm, batches, steps, repeats, int(b.get("block", 1)))
    else:
        result["rounds"] = run_rounds(llm, cfg.get("rounds", []), int(cfg.get("max_tokens", 16)))
    import vllm

    result["vllm"] = str(vllm.__version__)
    result["v2"] = bool(getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", False))
    result["clip"] = _clip_totals()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
