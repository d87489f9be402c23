"""tripwire's vLLM plugin on vLLM's real GPU engine: controls, clean runs, contained faults and the fuzz, in one call.

Runs on the device with vLLM 0.26.0 from ``../shared/vllm-gpu`` on ``PYTHONPATH`` (``scripts/gpu_vllm.sh`` sets it
up). Every engine run is a process of its own (``tripwire.testing.vllm_proc``: an unguarded fault kills it), several at
once on the one GPU. A tiny random Llama (``tripwire.testing.vllm_run.make_model``), bf16, CUDA graphs and
torch.compile at vLLM's defaults, async scheduling on (vLLM's GPU default), unless a run says otherwise.

* ``controls``: no plugin, one fault per run (each kind, V1 and V2): does the engine die, or silently change tokens?
* ``clean``: no plugin and ``TRIPWIRE_VLLM=contain``, V1 and V2, graphs and eager: token-identical? Also a probe of
  vLLM's own batch sensitivity (the same prompts in a smaller batch).
* ``contain``: faults of every kind at chosen steps and requests (first and last step included), V1 and V2; the
  engine core in-process and in its own process; FULL graphs; the TRITON_ATTN backend; eager. Each victim must end
  ``error`` with the clean tokens before its step, each other request must equal the clean run, an event must name
  the victim's site and request id, and the process must live.
* ``mask``: a read under ``mask`` keeps the engine alive.
* ``fuzz``: ``scripts/fuzz_vllm.py``'s fuzz on V1 and V2, graphs and eager, 1 to 4 victims in one step.
* ``fp8``: ``kv_cache_dtype="fp8"``: a clean run with graphs (every layer's clip count 0, its max magnitude seen, the
  tokens those of the same engine without the plugin), and one victim's K in one layer set past the FP8 range at one
  step (eager: the injection is a Python wrapper of the cache write): that layer's K count is exactly the elements
  injected, every other count 0.

Usage: ``python scripts/gpu_vllm.py OUTDIR [--parts controls,clean,contain,mask,fuzz] [--fuzz-runs N]``; writes
``OUTDIR/vllm_gpu.json`` (every figure) and prints a summary.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fuzz_vllm

from tripwire.testing import vllm_proc as _vllm_proc

TOKENS = 16
SITES = {
    "read": "vllm.block_table",
    "write": "vllm.block_table",
    "slot": "vllm.slot_mapping",
    "position": "vllm.positions",
    "idx": "vllm.idx_mapping",
    "num_blocks": {"V1": "vllm.block_counts", "V2": "vllm.num_blocks"},
    "nan": "vllm.logits_nonfinite",
}
GPU = {"gpu_memory_utilization": 0.04}


def site(kind: str, runner: str) -> str:
    s = SITES[kind]
    return s[runner] if isinstance(s, dict) else s


def prompts(r: int) -> list[list[int]]:
    return fuzz_vllm.prompts(r)


def marker(r: int, i: int) -> list[int]:
    return prompts(r)[i][:3]


def env_for(runner: str) -> dict[str, str]:
    return {"VLLM_USE_V2_MODEL_RUNNER": "1" if runner == "V2" else "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def contain_faults(runner: str) -> tuple[list[list[list[int]]], list[dict[str, Any]]]:
    """Rounds 0.. (round 0 clean) and their faults: each kind three times (steps 0, 7 and 15; values end, far,
    negative; other requests), and a round with a victim of each of two kinds at one step."""
    kinds = fuzz_vllm.KINDS[runner]
    rounds = [prompts(0)]
    faults = []
    values: tuple[int | str, ...] = ("end", 10_000_000, -5)
    r = 1
    for kind in kinds:
        for j, step in enumerate((0, 7, 15)):
            rounds.append(prompts(r))
            value = ("nan", "inf", "nan")[j] if kind == "nan" else values[j]
            faults.append(
                {"marker": marker(r, (r + j) % 4), "step": step, "kind": kind, "value": value, "req": (r + j) % 4}
            )
            r += 1
    rounds.append(prompts(r))
    faults.append({"marker": marker(r, 0), "step": 4, "kind": kinds[0], "value": "end", "req": 0})
    faults.append({"marker": marker(r, 2), "step": 4, "kind": kinds[-1], "value": "end", "req": 2})
    return rounds, faults


def check(
    run: _vllm_proc.Run,
    clean: list[list[dict]],
    faults: list[dict],
    runner: str,
    rounds: list[list[list[int]]],
    *,
    mask: bool = False,
) -> dict[str, Any]:
    """Each victim ``error`` (under ``mask``: going on to ``length``) with the clean tokens before its step, each
    other request equal to the clean run, an event naming the victim's site and request id."""
    out: dict[str, Any] = {"rc": run.rc, "victims": 0, "contained": 0, "escapes": [], "changed": [], "unexplained": []}
    if run.result is None:
        out["died"] = run.stderr[-1500:]
        return out
    injected = {tuple(e["marker"]): e for e in run.injected}
    for k, got in enumerate(run.rounds()):
        if isinstance(got, dict):
            out["stopped"] = got
            break
        ref = clean[k]
        for i, (g, w) in enumerate(zip(got, ref, strict=True)):
            f = next((f for f in faults if f["marker"] == rounds[k][i][:3]), None)
            if f is None:
                if (g["tokens"], g["finish_reason"]) != (w["tokens"], w["finish_reason"]):
                    out["changed"].append({"round": k, "req": i, "got": g, "want": w})
                continue
            out["victims"] += 1
            if mask:
                ok = g["finish_reason"] == "length" and g["tokens"][: f["step"]] == w["tokens"][: f["step"]]
            else:
                ok = g["finish_reason"] == "error" and g["tokens"] == w["tokens"][: f["step"]]
            if not ok:
                out["escapes"].append({"round": k, "fault": f, "got": g, "want": w})
                continue
            out["contained"] += 1
            inj = injected.get(tuple(f["marker"]))
            want = site(f["kind"], runner)
            named = {e["site"] for e in run.events for o in e["offenders"] if inj and o["request"] == inj["request"]}
            if want not in named:
                out["unexplained"].append({"fault": f, "named": sorted(named), "injected": inj})
    out["totals"] = run.totals()
    out["injected"] = len(run.injected)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--parts", default="controls,clean,contain,mask,fp8,fuzz")
    ap.add_argument("--fuzz-runs", type=int, default=132, help="fuzz runs per configuration (four configurations)")
    ap.add_argument("--workers", type=int, default=8, help="engine processes at once")
    ap.add_argument("--cpu", action="store_true", help="vLLM's CPU build instead (V1 only, eager): the harness itself")
    args = ap.parse_args(argv)
    runners = ("V1",) if args.cpu else ("V2", "V1")
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    work = out / "work"
    t0 = time.time()
    specs: dict[str, dict[str, Any]] = {}
    plan: dict[str, Any] = {}
    for runner in runners:
        e = {} if args.cpu else env_for(runner)
        rounds, faults = contain_faults(runner)
        base: dict[str, Any] = {"rounds": rounds} if args.cpu else {"rounds": rounds, "gpu": GPU}
        if parts & {"clean", "contain", "mask"}:
            specs[f"clean-none-{runner}"] = {"config": base, "env": e}
        if "clean" in parts:
            probe = {**base, "rounds": [*rounds[:2], [rounds[1][0], *rounds[1][2:]]]}
            specs[f"clean-contain-{runner}"] = {"config": probe, "mode": "contain", "env": e}
            if not args.cpu:
                specs[f"clean-none-eager-{runner}"] = {"config": {**probe, "gpu": {**GPU, "eager": True}}, "env": e}
                specs[f"clean-contain-eager-{runner}"] = {
                    "config": {**probe, "gpu": {**GPU, "eager": True}},
                    "mode": "contain",
                    "env": e,
                }
        if "contain" in parts:
            f = [{k: v for k, v in x.items() if k != "req"} for x in faults]
            variants = {"": {}, "-mp": {"multiprocess": True}}
            if runner == "V2":
                variants.update(
                    {
                        "-full": {"gpu": {**GPU, "cudagraph_mode": "FULL"}},
                        "-triton": {"gpu": {**GPU, "backend": "TRITON_ATTN"}},
                    }
                )
            if not args.cpu:
                variants["-eager"] = {"gpu": {**GPU, "eager": True}}
            for name, v in variants.items():
                cfg = {**base, **({"gpu": v["gpu"]} if "gpu" in v else {})}
                specs[f"contain{name}-{runner}"] = {
                    "config": cfg,
                    "mode": "contain",
                    "faults": f,
                    "multiprocess": v.get("multiprocess", False),
                    "env": {**e, "TRIPWIRE_OFFENDERS": "64"},
                }
                ref = f"clean-none-{runner}"
                if "gpu" in v:
                    # Its own clean reference: another backend or graph mode computes other (valid) numbers.
                    ref = f"ref{name}-{runner}"
                    specs[ref] = {"config": cfg, "env": e}
                plan[f"contain{name}-{runner}"] = (runner, faults, rounds, ref)
        if "mask" in parts:
            read = next(x for x in faults if x["kind"] == "read" and x["step"] == 7)
            specs[f"mask-read-{runner}"] = {
                "config": {**base, "rounds": rounds[: 1 + faults.index(read) + 1]},
                "mode": "mask",
                "faults": [{k: v for k, v in read.items() if k != "req"}],
                "env": e,
            }
            plan[f"mask-read-{runner}"] = (runner, [read], rounds, f"clean-none-{runner}")
        if "fp8" in parts and not args.cpu:
            fp8 = {**GPU, "kv_cache_dtype": "fp8"}
            specs[f"fp8-ref-{runner}"] = {"config": {"rounds": rounds[:2], "gpu": fp8}, "env": e}
            specs[f"fp8-clean-{runner}"] = {"config": {"rounds": rounds[:2], "gpu": fp8}, "mode": "contain", "env": e}
            kv = {"marker": marker(1, 1), "step": 3, "kind": "kv", "value": 1000.0, "layer": 1}
            specs[f"fp8-kv-{runner}"] = {
                "config": {"rounds": rounds[:2], "gpu": {**fp8, "eager": True}},
                "mode": "contain",
                "faults": [kv],
                "env": e,
            }
        if "controls" in parts:
            for kind in fuzz_vllm.KINDS[runner]:
                value = {"slot": -7, "nan": "nan"}.get(kind, 10_000_000)
                fault = {"marker": marker(1, 1), "step": 5, "kind": kind, "value": value}
                ctl: dict[str, Any] = (
                    {"rounds": rounds[:2]} if args.cpu else {"rounds": rounds[:2], "gpu": {**GPU, "eager": True}}
                )
                specs[f"control-{kind}-{runner}"] = {
                    "config": ctl,
                    "faults": [fault],
                    "env": e,
                }
    results: dict[str, Any] = {"runs": {}}
    if specs:
        pool = _vllm_proc.EnginePool(work, specs, workers=args.workers)
        done = {}
        for name in specs:
            # One line per engine as it ends, with what killed one that died, and a dead engine's stderr written at
            # once (beside the JSON, not in its deeper work folder): a call cut short by its time limit still says
            # which engines ran and why one died.
            done[name] = run = pool.get(name)
            died = "" if run.result is not None else f": {_death(run.rc)}{_last_error(run.stderr)}"
            raced = f", {run.restarts} restarts (start-up race)" if run.restarts else ""
            print(f"{time.time() - t0:5.0f} s  {name}: rc {run.rc}, alive {run.result is not None}, "
                  f"{len(run.injected)} faults injected{died}{raced}", flush=True)  # fmt: skip
            if run.result is None:
                (out / f"{name}.stderr.txt").write_text(run.stderr[-20000:])
        pool.close()
        for name, run in done.items():
            results["runs"][name] = {
                "rc": run.rc,
                "alive": run.result is not None,
                "v2": None if run.result is None else run.result.get("v2"),
                "hooked": None if run.result is None else run.result.get("hooked"),
                "injected": run.injected,
                "restarts": run.restarts,
                "totals": run.totals(),
                "events": len(run.events),
                "stderr_tail": run.stderr[-600:] if run.result is None else "",
                "clip": None if run.result is None else run.result.get("clip"),
            }
        for runner in runners:
            # Each clean run against the run without the plugin in its own configuration (graphs or eager): vLLM's
            # eager and graph builds differ in the last bits of bf16, so a cross-configuration comparison would
            # measure vLLM, not the plugin.
            for name in [n for n in specs if n.startswith("clean-") and n.endswith(runner)]:
                ref = f"clean-none-eager-{runner}" if "-eager-" in name else f"clean-none-{runner}"
                run, ref_run = done.get(name), done.get(ref)
                if run is None or run.result is None:
                    continue
                got = run.rounds()
                if name != ref and ref_run is not None and ref_run.result is not None:
                    clean = ref_run.rounds()
                    results["runs"][name]["reference"] = ref
                    results["runs"][name]["identical_to_clean"] = [
                        [
                            (g["tokens"], g["finish_reason"]) == (w["tokens"], w["finish_reason"])
                            for g, w in zip(a, b, strict=True)
                        ]
                        for a, b in zip(got[:2], clean[:2], strict=True)
                    ]
                if name == f"clean-none-{runner}":  # the contain rounds' reference: it runs no probe round
                    continue
                # The probe: the same prompts less one, in a smaller batch (vLLM's own batch sensitivity).
                small = got[2]
                full = [c for i, c in enumerate(got[1]) if i != 1]
                results["runs"][name]["batch_probe_identical"] = [
                    s["tokens"] == f["tokens"] for s, f in zip(small, full, strict=True)
                ]
            for name, (r, faults, rounds, ref) in plan.items():
                if r != runner or name not in done or done[ref].result is None:
                    continue
                results["runs"][name]["check"] = check(
                    done[name], done[ref].rounds(), faults, runner, rounds, mask=name.startswith("mask-")
                )
                results["runs"][name]["reference"] = ref
            for kind in fuzz_vllm.KINDS[runner]:
                name = f"control-{kind}-{runner}"
                if name in done:
                    run = done[name]
                    res = results["runs"][name]
                    if run.result is None:
                        res["outcome"] = "died: " + _last_error(run.stderr)
                    else:
                        got = run.rounds()
                        if isinstance(got[1], dict):
                            res["outcome"] = "round failed: " + str(got[1])[:300]
                        else:
                            pairs = enumerate(zip(got[1], clean[1], strict=True))
                            changed = [i for i, (g, w) in pairs if g["tokens"] != w["tokens"]]
                            finish = [g["finish_reason"] for g in got[1]]
                            res["outcome"] = f"lived; requests with changed tokens: {changed}; finish {finish}"
        for runner in runners:
            fp8_check(results, done, runner)
    (out / "vllm_gpu.json").write_text(json.dumps(results, indent=1, default=str))
    if "fuzz" in parts:
        configs = {f"{r}-{'eager' if e else 'graphs'}": (r, e) for r in runners for e in (False, True)}

        def one(name: str, runner: str, eager: bool) -> dict[str, Any]:
            return fuzz_vllm.fuzz(
                args.fuzz_runs,
                seed=zlib.crc32(name.encode()) % 1000,  # the same seed in every process
                processes=2,
                workdir=str(work / f"fuzz-{name}"),
                runner=runner,
                most=4,
                gpu={**GPU, "eager": eager},
                env=env_for(runner),
                workers=3,
            )

        # The configurations at once (each its own three engine processes; the GPU holds all twelve at this
        # memory share): one call's time limit holds them only side by side.
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(configs)) as ex:
            futures = {name: ex.submit(one, name, r, e) for name, (r, e) in configs.items()}
            results["fuzz"] = {name: f.result() for name, f in futures.items()}
        (out / "vllm_gpu.json").write_text(json.dumps(results, indent=1, default=str))
    results["seconds"] = round(time.time() - t0, 1)
    (out / "vllm_gpu.json").write_text(json.dumps(results, indent=1, default=str))
    print(summary(results))
    return 0


def fp8_check(results: dict[str, Any], done: dict[str, _vllm_proc.Run], runner: str) -> None:
    """The fp8 runs' verdicts (see the module docstring), into their results."""
    ref, clean, kv = (done.get(f"fp8-{n}-{runner}") for n in ("ref", "clean", "kv"))
    if clean is not None and clean.result is not None:
        clip = clean.result.get("clip") or {}
        r = results["runs"][f"fp8-clean-{runner}"]
        r["fp8_layers"] = len(clip)
        r["fp8_all_zero"] = bool(clip) and all(c["k"] == 0 and c["v"] == 0 for c in clip.values())
        r["fp8_all_seen"] = bool(clip) and all(c["k_max"] > 0 and c["v_max"] > 0 for c in clip.values())
        if ref is not None and ref.result is not None:
            r["fp8_identical"] = clean.rounds() == ref.rounds()
    if kv is not None and kv.result is not None:
        clip = kv.result.get("clip") or {}
        r = results["runs"][f"fp8-kv-{runner}"]
        inj = kv.injected[0] if kv.injected else {}
        want = {name: (inj.get("elements", -1) if name.endswith("." + str(inj.get("layer"))) else 0) for name in clip}
        r["fp8_counts"] = {name: [c["k"], c["v"]] for name, c in clip.items()}
        r["fp8_exact"] = (
            bool(inj)
            and all(c["k"] == want[name] and c["v"] == 0 for name, c in clip.items())
            and any(w > 0 for w in want.values())
        )


def _death(rc: int) -> str:
    """A signal's name for an engine a signal killed (a negative exit status), else nothing."""
    if rc >= 0:
        return ""
    try:
        return f"{signal.Signals(-rc).name}; "
    except ValueError:
        return f"signal {-rc}; "


def _last_error(stderr: str) -> str:
    """What killed an engine, from its stderr: CUDA's error, a segfault, or the last error line."""
    lines = stderr.splitlines()
    for key in ("illegal memory access", "CUDA error", "Fatal Python error", "Segmentation fault", "Error"):
        hits = [x for x in lines if key in x]
        if hits:
            return hits[-1].strip()[:300]
    last = [x.strip() for x in lines if x.strip()]
    return last[-1][:300] if last else "(no stderr)"


def summary(results: dict[str, Any]) -> str:
    lines = []
    for name, r in results["runs"].items():
        bits = [f"rc={r['rc']}", f"v2={r['v2']}", f"hooked={r['hooked']}"]
        if "identical_to_clean" in r:
            bits.append(f"identical={r['identical_to_clean']}")
        if "batch_probe_identical" in r:
            bits.append(f"probe={r['batch_probe_identical']}")
        if "check" in r:
            c = r["check"]
            bits.append(
                f"victims={c.get('victims')} contained={c.get('contained')} escapes={len(c.get('escapes', []))} "
                f"changed={len(c.get('changed', []))} unexplained={len(c.get('unexplained', []))}"
                + (f" STOPPED={c['stopped']}" if "stopped" in c else "")
                + (" DIED" if "died" in c else "")
            )
        if "outcome" in r:
            bits.append(r["outcome"])
        for k in ("fp8_layers", "fp8_all_zero", "fp8_all_seen", "fp8_identical", "fp8_exact", "fp8_counts"):
            if k in r:
                bits.append(f"{k}={r[k]}")
        if not r["alive"]:
            bits.append("tail: " + r["stderr_tail"][-200:].replace("\n", " | "))
        lines.append(f"{name}: " + " ".join(bits))
    for name, f in results.get("fuzz", {}).items():
        lines.append(f"fuzz {name}: " + json.dumps({k: v for k, v in f.items() if k != "gpu"}))
    lines.append(f"seconds {results.get('seconds')}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
