"""The register rule's probe (tests/test_register_rule.py runs it in a process of its own, without Triton's
interpreter): every shipped kernel and vLLM's adopted Triton kernels compiled for sm_90, guarded and twin, and
guarded with the fault path inlined (the control). Prints one JSON line: {case: {variant: [[kernel, regs, spills,
programs_per_sm], ...]}}. The adopted kernels' twins are vLLM's originals, from an installed vLLM:
``--adopted-twins``, run with the vLLM environment's python, prints those alone."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # vLLM's launcher asks; the probe compiles for sm_90

import tripwire  # noqa: E402
from tripwire import resources as rs  # noqa: E402
from tripwire.kernels import block_table as bt  # noqa: E402
from tripwire.kernels import counters  # noqa: E402
from tripwire.kernels import decode_attention as da  # noqa: E402
from tripwire.kernels import kv_zero as kz  # noqa: E402
from tripwire.kernels import paged_gather as pg  # noqa: E402
from tripwire.kernels import rope as rp  # noqa: E402
from tripwire.kernels import slot_mapping as sm  # noqa: E402
from tripwire.kernels import state_copy as sc  # noqa: E402
from tripwire.numerics import nonfinite as nf  # noqa: E402
from tripwire.triton import any_outside  # noqa: E402
from tripwire.validate import Validator  # noqa: E402

mon = tripwire.Monitor(registry=tripwire.SiteRegistry(capacity=64), capacity=64, mode="off")
i32, i64, bf = torch.int32, torch.int64, torch.bfloat16


def z(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


def shipped(guard: bool) -> dict:
    """The reference kernels at engine-like shapes, launched by their own launchers (guard on or off)."""
    q = z(64, 32, 128, dtype=bf)
    kv = z(64 * 128 + 16, 16, 8, 128, dtype=bf)
    table = z(64, 128, dtype=i32)
    ws = da.alloc_workspace(q, table, 16, 8)
    return {
        "block_table": lambda: bt.block_table_gather(
            z(256, 64, dtype=i32), z(64, dtype=i32), z(256, dtype=i32), z(64, 64, dtype=i32),
            ctr=counters(bt.SITES, "cpu", mon), guard=guard),
        # Both of the launcher's shapes: a bandwidth-sized launch and an engine step's (one warp per program).
        "slot_mapping": lambda: sm.slot_mapping(
            z(1 << 17, dtype=i32), z(1 << 17, dtype=i32), z(64, 64, dtype=i32), z(1 << 17, dtype=i64), 16,
            num_kv_blocks=8, ctr=counters(sm.SITES, "cpu", mon), guard=guard),
        "slot_mapping_step": lambda: sm.slot_mapping(
            z(4096, dtype=i32), z(4096, dtype=i32), z(64, 64, dtype=i32), z(4096, dtype=i64), 16, num_kv_blocks=8,
            ctr=counters(sm.SITES, "cpu", mon), guard=guard),
        # The same with a request map (each bad token's request kept with its offender).
        "slot_mapping_step_req": lambda: sm.slot_mapping(
            z(4096, dtype=i32), z(4096, dtype=i32), z(64, 64, dtype=i32), z(4096, dtype=i64), 16, num_kv_blocks=8,
            ctr=counters(sm.SITES, "cpu", mon), guard=guard, requests=z(4096, dtype=i64)),
        # vLLM's int64 positions (a 64-bit column for the column site's record).
        "slot_mapping_step_req_i64": lambda: sm.slot_mapping(
            z(4096, dtype=i64), z(4096, dtype=i32), z(64, 64, dtype=i32), z(4096, dtype=i64), 16, num_kv_blocks=8,
            ctr=counters(sm.SITES, "cpu", mon), guard=guard, requests=z(4096, dtype=i64)),
        "kv_zero": lambda: kz.kv_zero(z(64, 2, 16 * 128), z(32, dtype=i32), ctr=counters(kz.SITES, "cpu", mon),
                                      guard=guard),
        "paged_gather": lambda: pg.paged_gather(
            z(64, 16, 8, 128, dtype=bf), z(8, 8, dtype=i32), z(8, 8, 16, 8, 128, dtype=bf),
            ctr=counters(pg.SITES, "cpu", mon), guard=guard),
        "state_copy": lambda: sc.state_copy(
            z(64, 4096), z(8, 8, dtype=i32), z(8, dtype=i32), z(8, dtype=i32), z(8, dtype=i32),
            ctr=counters(sc.SITES, "cpu", mon), guard=guard),
        "rope": lambda: rp.rope(
            z(256, dtype=i64), z(256, 32, 128, dtype=bf), z(256, 8, 128, dtype=bf), z(4096, 128),
            z(256, 32, 128, dtype=bf), z(256, 8, 128, dtype=bf), ctr=counters(rp.SITES, "cpu", mon), guard=guard),
        "decode_attention": lambda: da.decode_attention(
            q, kv, kv, table, z(64, dtype=i32), torch.empty_like(q), workspace=ws, ctr=counters(da.SITES, "cpu", mon),
            guard=guard),
    }  # fmt: skip


def instruments(fault_calls: bool | None = None) -> dict:
    """Kernels without a GUARD switch: their twin is the same launch with the fault path stubbed out. The validator
    is built with ``fault_calls`` (None: the build the register budget picks)."""
    md = dict(slot_mapping=z(256, dtype=i64), block_table=z(256, 128, dtype=i32), blocks_per_req=z(256, dtype=i32),
              kv_indices=z(32768, dtype=i32), kv_indptr=z(257, dtype=i32))  # fmt: skip
    # Another kernel Triton compiles for the same rules (a one-token step: every size 1, a constant; the tensors
    # one element into their allocations, not 16-byte aligned): launched within its own twin's registers too.
    one = {n: z(t.numel() + 1, dtype=t.dtype)[1:2] for n, t in md.items()}
    one["block_table"] = one["block_table"].view(1, 1)
    one["kv_indptr"] = z(3, dtype=i32)[1:]
    logits = z(256, 152064, dtype=bf)
    nf_site = nf.register_nonfinite_site("probe.logits", monitor=mon)

    def validate(md: dict) -> None:
        # The kernel's launch with the validator's rules: a CPU validator of the Triton backend, built where its
        # launch is recorded (a CPU validator runs its torch path by default). The same sites at each build.
        v = Validator("probe", "cpu", policy="mask", monitor=mon, backend="triton", fault_calls=fault_calls)
        v.index("slot_mapping", hi=65536, padding=-1, fatal=True)
        v.index("block_table", hi=4096, safe=0, lengths="blocks_per_req")
        v.csr("kv_indices", indptr="kv_indptr", hi=4096, safe=0)
        v(**md)

    return {
        "validator": functools.partial(validate, md),
        "validator_one": functools.partial(validate, one),
        "nonfinite": lambda: nf.count_nonfinite(logits, nf_site, ctr=mon.counter(nf_site, "cpu")),
    }


def adopted(guarded: bool) -> dict:
    from adopted_vllm import load

    which = "guarded" if guarded else "original"
    da_mod = load(which, "triton_decode_attention")
    rc_mod = load(which, "triton_reshape_and_cache_flash")

    def decode(kv_heads: int):  # type: ignore[no-untyped-def]
        B, Hq, D, PS, W, S = 64, 32, 128, 16, 128, 8
        q = z(B, Hq, D, dtype=bf)
        kb = z(B * W, PS, kv_heads, D, dtype=bf)
        kw = dict(ctr=counters(da_mod.SITES, "cpu", mon)) if guarded else {}
        one = torch.ones(())
        return lambda: da_mod.decode_attention_fwd(
            q, kb, kb, torch.empty_like(q), z(B, Hq), z(B, W, dtype=i32), z(B, dtype=i32), z(B, Hq, S, D + 1), S, 0.1,
            PS, k_scale=one, v_scale=one, **kw)  # fmt: skip

    def reshape(tokens: int):  # type: ignore[no-untyped-def]
        k = z(tokens, 8, 128, dtype=bf)
        kc = z(4 * tokens // 16, 16, 8, 128, dtype=bf)
        kw = dict(ctr=mon.counter(mon.registry.register(rc_mod.SITE_SLOT.name), "cpu")) if guarded else {}
        one = torch.ones(1)
        return lambda: rc_mod.triton_reshape_and_cache_flash(k, k, kc, kc, z(tokens, dtype=i64), "auto", one, one, **kw)

    return {"vllm_decode_gqa": decode(8), "vllm_decode_mha": decode(32), "vllm_reshape": reshape(256)}


def _sass(launch) -> str:  # type: ignore[no-untyped-def]
    """The SASS of one captured launch compiled for sm_90 (cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(rs._compile(launch).asm["cubin"])
        f.flush()
        return subprocess.run([rs._tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout


def step_reductions() -> dict:
    """slot_mapping at an engine step's size, guarded: the reductions in its SASS (REDUX, or a barrier), as launched
    (bad tokens record themselves: tripwire.triton.record_lanes) and, the control, with the vote and record_tiles
    (LANES off)."""
    import dataclasses

    launch = rs.capture_launches(shipped(True)["slot_mapping_step"])[0]
    assert launch.kwargs["LANES"] is True
    out = {}
    for name, lanes in (("lanes", True), ("vote", False)):
        sass = _sass(dataclasses.replace(launch, kwargs={**launch.kwargs, "LANES": lanes}))
        out[name] = len(re.findall(r"\b(REDUX|BAR\.SYNC)", sass))
    return out


@triton.jit
def _precheck_kernel(x_ptr, out_ptr, start, end, hi):
    tl.store(out_ptr, any_outside(x_ptr, start, end, 0, hi, 128).to(tl.int32))


@triton.jit
def _precheck_twice_kernel(x_ptr, out_ptr, start, end, hi):
    # The same check before and after a store into the range: two checks, not one merged across the store.
    a = any_outside(x_ptr, start, end, 0, hi, 128)
    tl.store(x_ptr + start, hi)
    b = any_outside(x_ptr, start, end, 0, hi, 128)
    tl.store(out_ptr, a.to(tl.int32) + 2 * b.to(tl.int32))


def precheck_reductions() -> dict:
    """tripwire.triton.any_outside compiled at 4 warps, by entry type: its barriers (BAR) and warp votes (VOTE) in
    the SASS. int32 and int64 entries take the warp vote; int16 entries, the control, the block reduction; "twice",
    int32 entries checked before and after a store into the range."""
    out = {}
    for dtype in (i32, i64, torch.int16, "twice"):
        x = z(64, dtype=i32 if dtype == "twice" else dtype)
        kernel = _precheck_twice_kernel if dtype == "twice" else _precheck_kernel
        launch = rs.capture_launches(lambda x=x, k=kernel: k[(1,)](x, z(1, dtype=i32), 0, 64, 8, num_warps=4))[0]
        sass = _sass(launch)
        out[str(dtype).removeprefix("torch.")] = {
            "bar": len(re.findall(r"\bBAR\.", sass)),
            "vote": len(re.findall(r"\bVOTE\.", sass)),
        }
    return out


def nonfinite_budget() -> dict:
    """The non-finite counter at three launch shapes of its sweep (the default first): as launched (within its
    twin's register allocation: the register budget), the control (the same launch without its ``maxnreg``:
    the compiler's own allocation) and the twin (its GUARD=False build). {shape: {variant: [kernel, regs, spills,
    programs_per_sm, maxnreg]}}."""

    logits = z(256, 152064, dtype=bf)
    ctr = mon.counter(nf.register_nonfinite_site("probe.budget", monitor=mon), "cpu")
    out = {}
    for b, it, w in ((2048, 4, 8), (2048, 2, 8), (4096, 4, 8)):
        launched = rs.capture_launches(functools.partial(nf._launch, logits, ctr, b, w, it))[0]
        bare = _uncapped(launched)
        twin = rs.capture_launches(functools.partial(nf._launch, logits, ctr, b, w, it, guard=False))[0]
        out[f"{b}x{it}/w{w}"] = {
            name: [*usage_of(launch), launch.kwargs.get("maxnreg")]
            for name, launch in (("launched", launched), ("uncapped", bare), ("twin", twin))
        }
    return out


def validator_budget() -> dict:
    """The validator's launch (the instruments' rules) at two of the kernels Triton compiles for them (full sizes;
    one-entry sizes at misaligned addresses): as launched (within its twin's registers: the register budget), the
    control (the same launch without its ``maxnreg``) and the twin (``FAULT=False``: each bad block only counted);
    and each of the launcher's two builds as it would launch it alone (``Validator(fault_calls=...)``: ``calls``,
    the fault functions call the record's atomics; ``inlined``, they inline them; each with its own cap), of which
    the launch is the one the budget chose. {spec: {variant: [kernel, regs, spills, programs_per_sm, maxnreg,
    CALLS]}}."""
    import dataclasses

    def row(launch: rs.Launch) -> list:
        return [*usage_of(launch), launch.kwargs.get("maxnreg"), launch.kwargs.get("CALLS")]

    out = {}
    for spec in ("validator", "validator_one"):
        launched = rs.capture_launches(instruments()[spec])[0]
        bare = _uncapped(launched)
        twin = dataclasses.replace(bare, kwargs={**bare.kwargs, "FAULT": False})
        out[spec] = {name: row(launch) for name, launch in (("launched", launched), ("uncapped", bare), ("twin", twin))}
        for name, calls in (("calls", True), ("inlined", False)):
            out[spec][name] = row(rs.capture_launches(instruments(fault_calls=calls)[spec])[0])
    return out


def ptxas_agreement() -> dict:
    """The validator (both specialisations) and the non-finite counter compiled for sm_90 by Triton, uncapped, and
    their twins (``FAULT=False`` / ``GUARD=False``): per kernel, the registers of Triton's own cubin (cuobjdump),
    what tripwire.triton.ptxas_report reads from the same PTX (with Triton's ptxas options: what the
    register caps and the tools go by), ptxas's without those options (the control), and the options.
    {kernel: [cubin, report, plain, options]}."""
    import dataclasses

    out = {}
    for name in ("validator", "validator_one", "nonfinite"):
        launch = rs.capture_launches(instruments()[name])[0]
        launch = _uncapped(launch)
        twin = dataclasses.replace(
            launch, kwargs={**launch.kwargs, "FAULT" if "FAULT" in launch.kwargs else "GUARD": False}
        )
        out[name] = _agreement(launch)
        out[name + "_twin"] = _agreement(twin)
    return out


def _agreement(launch) -> list:  # type: ignore[no-untyped-def]
    from tripwire.triton import ptxas_report, triton_ptxas_options

    compiled = rs._compile(launch)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        cubin = rs._res_usage(f.name)[compiled.metadata.name]["REG"]
    report = ptxas_report(compiled.asm["ptx"]).regs
    plain = ptxas_report(compiled.asm["ptx"], options=()).regs
    return [cubin, report, plain, list(triton_ptxas_options())]


def return_saves() -> dict:
    """vLLM's adopted kernels, guarded: per kernel, ptxas's report of its entry function (spill bytes as the rule
    reads them, and the return-address saves taken out of ptxas's count: tripwire.triton.ptxas_report).
    {case: [[kernel, spill_bytes, return_save_bytes], ...]}."""
    from tripwire.triton import ptxas_report

    out = {}
    for name, fn in adopted(True).items():
        rows = []
        for launch in rs.capture_launches(fn):
            r = ptxas_report(rs._compile(launch).asm["ptx"])
            rows.append([launch.name, r.spill_bytes, r.return_save_bytes])
        out[name] = rows
    return out


def _uncapped(launch):  # type: ignore[no-untyped-def]
    """``launch`` without its ``maxnreg``: the compiler's own allocation."""
    import dataclasses

    return dataclasses.replace(launch, kwargs={k: v for k, v in launch.kwargs.items() if k != "maxnreg"})


def usage_of(launch) -> list:  # type: ignore[no-untyped-def]
    u = rs.triton_usage(launch)
    return [u.kernel, u.regs, u.spill_bytes, u.programs_per_sm]


def usage(fn) -> list:  # type: ignore[no-untyped-def]
    return [usage_of(launch) for launch in rs.capture_launches(fn)]


def main() -> None:
    out: dict = {}
    for name, fn in shipped(True).items():
        out[name] = {"guarded": usage(fn)}
        with rs.fault_path("inline"):
            out[name]["inline"] = usage(fn)
    for name, fn in shipped(False).items():
        out[name]["twin"] = usage(fn)
    for name, fn in instruments().items():
        out[name] = {"guarded": usage(fn)}
        with rs.fault_path("inline"):
            out[name]["inline"] = usage(fn)
        with rs.fault_path("stub"):
            out[name]["twin"] = usage(fn)
    for name, fn in adopted(True).items():  # their twins, vLLM's originals, come from adopted_twins()
        out[name] = {"guarded": usage(fn)}
        with rs.fault_path("inline"):
            out[name]["inline"] = usage(fn)
    out["step_reductions"] = step_reductions()
    out["precheck_reductions"] = precheck_reductions()
    out["nonfinite_budget"] = nonfinite_budget()
    out["validator_budget"] = validator_budget()
    out["ptxas_agreement"] = ptxas_agreement()
    out["return_saves"] = return_saves()
    print(json.dumps(out))


def adopted_twins() -> dict:
    """vLLM's original kernels of the adopted cases, as the installed vLLM ships them (run with a python that has
    vLLM): {"vllm": version, "triton": version, "cases": {case: usage}}."""
    from adopted_vllm import vllm_version

    return {
        "vllm": vllm_version(),
        "triton": triton.__version__,
        "cases": {name: usage(fn) for name, fn in adopted(False).items()},
    }


if __name__ == "__main__":
    if sys.argv[1:] == ["--adopted-twins"]:
        print(json.dumps(adopted_twins()))
    else:
        main()
