"""Run vLLM's engine on a tiny random Llama, in this process, and print what it returned (the vLLM demo, tests, fuzz
and benchmark drive vLLM through it, each run in a process of its own: an unguarded fault kills it).

``python -m tripwire._vllm_run CONFIG_JSON`` with the vLLM environment's python. The config:

* ``model``: a folder; a tiny random Llama (2 layers, hidden 128) is saved there with ``save_pretrained`` when it
  holds none (no download: the weights are random, seeded).
* ``rounds``: a list of rounds, each a list of prompts (token id lists): one ``LLM.generate`` call per round, greedy,
  ``max_tokens`` new tokens each (default 16), ``ignore_eos``.
* ``prefix_caching`` (optional, default off): vLLM's prefix cache.
* ``bench`` (optional): ``{"batches": [B, ...], "steps": N, "repeats": R}``: instead of rounds, time the decode
  steps (``llm_engine.step()``) with the plugin on and off, interleaved (see ``benchmarks/bench_vllm.py``).

vLLM's own settings come from the environment (``VLLM_ENABLE_V1_MULTIPROCESSING``; ``TRIPWIRE_VLLM`` for the plugin;
:mod:`tripwire._vllm_faults` for injected faults). The last line of stdout is one JSON object: per round, per
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


def engine(model: str, max_seqs: int = 8, prefix_caching: bool = False) -> Any:
    from vllm import LLM

    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=max_seqs,
        enforce_eager=True,
        seed=MODEL_SEED,
        enable_prefix_caching=prefix_caching,
        # Small blocks, so a request spans several (a context block apart from the newest token's), and a small
        # cache, so the engine starts in seconds, not in the time it takes to zero gigabytes.
        block_size=32,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )


def _hooked() -> bool:
    """The V1 runner's execute_model is tripwire's wrapper (anywhere in its chain of wrappers)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fn: Any = GPUModelRunner.execute_model
    while fn is not None:
        if fn.__code__.co_filename.endswith(os.path.join("integrations", "vllm.py")):
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
    llm: Any, prompts: list[list[int]], steps: int, tag: str, cpu: list[float] | None = None
) -> list[float]:
    """The wall time of each decode step of one round (``llm_engine.step()``: scheduler, runner, outputs), the
    prefill step left out: ``len(prompts)`` requests of ``steps`` new tokens. ``cpu``: each step's CPU time of this
    process (all its threads) is appended there, a figure that waiting for a shared machine's cores leaves out."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=steps, detokenize=False, ignore_eos=True)
    eng = llm.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, sp)
    times = []
    first = True
    while eng.has_unfinished_requests():
        c0, t0 = time.process_time(), time.perf_counter()
        eng.step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if not first:
            times.append(dt)
            if cpu is not None:
                cpu.append(dc)
        first = False
    return times


def run_bench(llm: Any, batches: list[int], steps: int, repeats: int) -> dict[str, Any]:
    """The decode step with the plugin on and off, interleaved in this one engine: the plugin is uninstalled (every
    wrapped method restored) and installed again between rounds, in alternating order, so drift hits both alike. A
    round's figure is its median decode step. Two "off" rounds per repeat give the noise floor (off against off)."""
    from tripwire.integrations import vllm as tw

    plugin = tw.installed()
    if plugin is None:
        raise RuntimeError("the benchmark needs TRIPWIRE_VLLM set at start-up (the validator is built then)")
    mode = plugin.mode
    out: dict[str, Any] = {"mode": mode, "steps": steps}
    hook = _time_hooks()
    n = 0
    for b in batches:
        prompts = [[7 + i, *range(20, 40)] for i in range(b)]
        _decode_steps(llm, prompts, steps, f"warm{b}")
        on: list[float] = []
        off: list[float] = []
        off2: list[float] = []
        inside: list[float] = []
        cpu: dict[str, list[float]] = {"on": [], "off": [], "off2": []}
        for k in range(repeats):
            order = ("on", "off", "off2") if k % 2 == 0 else ("off", "off2", "on")
            for which in order:
                n += 1
                if which == "on":
                    tw.install(mode)
                else:
                    tw.uninstall()
                hook.clear()
                step_cpu: list[float] = []
                fig = statistics.median(_decode_steps(llm, prompts, steps, f"r{n}", step_cpu))
                {"on": on, "off": off, "off2": off2}[which].append(fig)
                cpu[which].append(statistics.median(step_cpu))
                if which == "on":
                    inside.append(sum(hook) / max(steps, 1))
        tw.install(mode)
        out[str(b)] = {"on": on, "off": off, "off2": off2, "hook_s_per_step": inside, "cpu": cpu}
    return out


def _time_hooks() -> list[float]:
    """Time spent inside the plugin's per-step work (the validator call, the verdict, the scheduler's side), summed
    into the returned list while a round runs: the plugin's own cost, apart from the machine's noise."""
    from tripwire.integrations import _vllm_contain, _vllm_steps

    spent: list[float] = []

    def timed(cls: type, name: str) -> None:
        fn = getattr(cls, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - t0)

        setattr(cls, name, wrapper)

    timed(_vllm_steps.StepValidator, "__call__")
    for name in ("after_step", "before_update", "after_update"):
        timed(_vllm_contain.Containment, name)
    return spent


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[1]) if len(argv) > 1 else {}
    model = cfg.get("model") or os.path.join(os.environ.get("TMPDIR", "/tmp"), "tripwire-vllm-tiny-llama")
    make_model(model)
    llm = engine(model, int(cfg.get("max_seqs", 8)), bool(cfg.get("prefix_caching", False)))
    result: dict[str, Any] = {"hooked": _hooked(), "pid": os.getpid()}
    if "bench" in cfg:
        b = cfg["bench"]
        result["bench"] = run_bench(llm, [int(x) for x in b["batches"]], int(b["steps"]), int(b["repeats"]))
    else:
        result["rounds"] = run_rounds(llm, cfg.get("rounds", []), int(cfg.get("max_tokens", 16)))
    import vllm

    result["vllm"] = str(vllm.__version__)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
