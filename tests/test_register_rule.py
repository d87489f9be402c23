"""The register rule (issue 27): a guard must not cost a clean launch its occupancy. Registers are allocated for a
kernel's hungriest path, taken or not, so a compiled-in fault path can slow every launch.

For every shipped kernel (tripwire.kernels, the validator, the non-finite counter) and vLLM's adopted Triton kernels
(benchmarks/adopted_vllm), compiled for sm_90 on the CPU (tests/_register_rule_probe.py, in its own process: no
interpreter): the guarded kernel needs at most one allocation unit (8 registers per thread) more than its twin, no
more spills, and fits as many programs per SM. The twin: the kernel's GUARD=False build, vLLM's original (from the
installed vLLM: the probe's ``--adopted-twins`` run with the vLLM environment's python, compiled by the same Triton
release; without that environment those cases skip, and fail under CI=true), or, for kernels without a switch, the
same launch with the fault path reduced to its count (``resources.fault_path("stub")``).

vLLM's adopted CUDA reshape_and_cache_flash too, where nvcc exists (compiled for sm_90, read with cuobjdump), with
its vote variant as its control.

The control: the issue's, a guarded kernel compiled with its fault path inlined (``resources.fault_path("inline")``):
slot_mapping's inlined build costs registers and programs against its twin, so the rule can fail, and fails where
the fault path is not out of line. The probe compiles every kernel inlined too, reported beside the out-of-line
build.

KNOWN: the cases that do not meet the rule yet on a Triton version, each marked xfail (strict: a case that starts
passing must be taken off the list). They are reported by ``tripwire resources`` too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent / "integrations"))
from vllm_helpers import vllm_python

PROBE = Path(__file__).with_name("_register_rule_probe.py")
VERSION = ".".join(triton.__version__.split(".")[:2])
# (case, kernel name prefix) -> why, per Triton version, for a case that does not meet the rule there; empty when
# every case meets it.
KNOWN: dict[str, dict[tuple[str, str], str]] = {}
# A kernel whose fault path, inlined, costs registers and programs per SM beyond the rule (out of line, and within
# its twin's registers, it is within it): the rule's comparison must flag the inlined build.
COSTLY = ("slot_mapping", "_slot_mapping")


@pytest.fixture(scope="module")
def usage(tmp_path_factory) -> dict:
    cache = tmp_path_factory.getbasetemp().parent / "tripwire-register-rule-cache"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(PROBE.parents[1] / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_CACHE_DIR", str(cache))  # compiles cached across the module's tests and runs
    p = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0 and ("ptxas" in p.stderr or "cuobjdump" in p.stderr) and "CompilationError" not in p.stderr:
        pytest.skip(f"cannot compile for sm_90 here: {p.stderr[-300:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["adopted_twins"] = _adopted_twins(env)
    if isinstance(out["adopted_twins"], dict):
        for case, rows in out["adopted_twins"]["cases"].items():
            out[case]["twin"] = rows
    return out


def _adopted_twins(env: dict[str, str]) -> dict | str:
    """vLLM's originals compiled by the probe in the vLLM environment; a string (why not) where there is none
    (vllm_python fails instead under CI=true)."""
    try:
        py = vllm_python()
    except pytest.skip.Exception as e:
        return str(e)
    twin_env = dict(env, TRITON_CACHE_DIR=env["TRITON_CACHE_DIR"] + "-vllm")
    p = subprocess.run([py, str(PROBE), "--adopted-twins"], capture_output=True, text=True, env=twin_env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    twins = json.loads(p.stdout.strip().splitlines()[-1])
    # One compiler on both sides: a register count is a compiler's.
    assert twins["triton"] == triton.__version__, (
        f"the vLLM environment compiles with Triton {twins['triton']}, this one with {triton.__version__}"
    )
    return twins


def _twin_of_vllm(usage: dict, case: str) -> None:
    """Skip an adopted case whose twin (vLLM's original) could not be compiled here: no vLLM environment."""
    if case.startswith("vllm_") and not isinstance(usage["adopted_twins"], dict):
        pytest.skip(f"vLLM's original is the twin: {usage['adopted_twins']}")


def _units(regs: int) -> int:
    return -(-regs // 8)


def _free(g: list, t: list) -> bool:
    """The rule, on [kernel, regs, spill_bytes, programs_per_sm] rows."""
    return _units(g[1]) <= _units(t[1]) + 1 and (g[2] or 0) <= (t[2] or 0) and g[3] >= t[3]


CASES = [
    ("block_table", "_block_table_gather"),
    ("slot_mapping", "_slot_mapping"),
    ("slot_mapping_step", "_slot_mapping"),
    ("slot_mapping_step_req", "_slot_mapping"),
    ("slot_mapping_step_req_i64", "_slot_mapping"),
    ("kv_zero", "_kv_zero"),
    ("paged_gather", "_paged_gather"),
    ("state_copy", "_state_copy"),
    ("rope", "_rope"),
    ("decode_attention", "_decode_split"),
    ("validator", "_validate"),
    ("validator_one", "_validate"),
    ("nonfinite", "_nonfinite_kernel"),
    ("vllm_decode_gqa", "_fwd_grouped_kernel_stage1"),
    ("vllm_decode_gqa", "_fwd_kernel_stage2"),
    ("vllm_decode_mha", "_fwd_kernel_stage1"),
    ("vllm_decode_mha", "_fwd_kernel_stage2"),
    ("vllm_reshape", "reshape_and_cache_kernel_flash"),
]


def _rows(usage: dict, case: str, kernel: str, variant: str) -> list:
    rows = [r for r in usage[case][variant] if r[0].startswith(kernel)]
    assert rows, (case, kernel, variant, usage[case])
    return rows[0]


@pytest.mark.parametrize(
    "case,kernel",
    [
        pytest.param(c, k, marks=pytest.mark.xfail(strict=True, reason=KNOWN[VERSION][(c, k)]))
        if (c, k) in KNOWN.get(VERSION, {})
        else (c, k)
        for c, k in CASES
    ],
)
def test_guarded_costs_no_occupancy(usage, case, kernel):
    _twin_of_vllm(usage, case)
    g, t = _rows(usage, case, kernel, "guarded"), _rows(usage, case, kernel, "twin")
    assert _free(g, t), f"{case}/{kernel}: guarded {g} vs twin {t}"


def test_control_the_rule_flags_a_costly_guard(usage):
    """The control (the issue's): the rule fails slot_mapping's guarded kernel compiled with its fault path inlined
    (its tiles, reductions and claims scheduled with the hot code), against its GUARD=False twin, so a pass above
    is a measurement, not a comparison that cannot fail, and the pass is the out-of-line fault path's doing."""
    case, kernel = COSTLY
    g, t = _rows(usage, case, kernel, "inline"), _rows(usage, case, kernel, "twin")
    assert not _free(g, t) and g[3] < t[3], (g, t)
    assert _free(t, t)


def test_slot_mapping_step_has_no_vote(usage: dict) -> None:
    """slot_mapping at an engine step's size has no reduction at all: each bad token records itself
    (tripwire.triton.record_lanes), so a clean program waits for nothing after its table load. The control, the same
    launch with the vote and record_tiles (what a bandwidth launch runs): reductions."""
    n = usage["step_reductions"]
    assert n["lanes"] == 0, n
    assert n["vote"] > 0, n


def test_any_outside_waits_for_no_other_warp(usage: dict) -> None:
    """tripwire.triton.any_outside on int32 and int64 entries (page ids, slots), compiled at 4 warps: one warp vote
    and no barrier, so a program's loop starts when its own warp has decided. The control, int16 entries (the block
    reduction it falls back to): barriers. Twice around a store into the range: two votes."""
    n = usage["precheck_reductions"]
    for dtype in ("int32", "int64"):
        assert n[dtype]["bar"] == 0 and n[dtype]["vote"] == 1, n
    assert n["int16"]["bar"] > 0 and n["int16"]["vote"] == 0, n
    # The asm reads memory Triton cannot see: the check after a store into its range is a check of its own, not the
    # first one's result (a pure asm is merged with it across the store).
    assert n["twice"]["vote"] == 2, n


def test_nonfinite_within_its_twins_registers(usage: dict) -> None:
    """The non-finite counter is launched within its twin's register allocation (tripwire.triton._budget): at three
    shapes of its sweep the launch never has fewer programs per SM than the compiler's own allocation gives, nor
    spills in its entry function beyond the twin's, and at the default shape it meets the rule. The control: the same
    launches without their ``maxnreg`` fail the rule at a shape where the launched build meets it (the default shape:
    48 registers on Triton 3.6, 40 on 3.9, against the twin's 27), so the cap is what keeps the occupancy."""
    shapes = usage["nonfinite_budget"]
    for shape, v in shapes.items():
        g, u, t = v["launched"], v["uncapped"], v["twin"]
        assert g[3] >= u[3], (shape, v)
        assert (g[2] or 0) <= (t[2] or 0), (shape, v)
        assert g[4] is None or g[1] <= g[4], (shape, v)
    assert _free(shapes["2048x4/w8"]["launched"], shapes["2048x4/w8"]["twin"]), shapes["2048x4/w8"]
    flipped = [s for s, v in shapes.items() if _free(v["launched"], v["twin"]) and not _free(v["uncapped"], v["twin"])]
    assert flipped, shapes


def test_ptxas_report_reads_the_cubin_triton_builds(usage: dict) -> None:
    """The register caps and the tools read ptxas's report of a kernel's PTX (tripwire.triton.ptxas_report):
    it must be the allocation of the cubin Triton builds from it, so ptxas runs with the allocation options Triton's
    own command passes. The control: where Triton passes any (3.9: ``--regAllocOptLevel=2``), ptxas without them
    reports another allocation for some of these kernels (3.9: the validator's twin, 56 registers where the cubin
    has 72), which is what a cap found that way would have gone by."""
    found = usage["ptxas_agreement"]
    for kernel, (cubin, report, plain, options) in found.items():
        assert report == cubin, (kernel, cubin, report)
        if not options:
            assert plain == cubin, (kernel, plain)
    if any(options for *_, options in found.values()):
        assert any(plain != cubin for cubin, _, plain, _ in found.values()), found


def test_a_saved_return_address_is_not_a_spill(usage: dict) -> None:
    """A guarded kernel whose out-of-line fault path needs every register it is allocated saves the call's return
    address to its stack before the call, and ptxas counts that store as a spill of the kernel; it runs only with
    the call, so the rule does not count it (tripwire.triton.return_address_saves). On Triton 3.9 vLLM's
    adopted MHA decode stage 1 is such a kernel: it meets the rule (test_guarded_costs_no_occupancy), and the
    control, its save counted as ptxas counts it, fails the rule. On 3.6 no adopted kernel saves one."""
    saves = {(case, k): (spills, saved) for case, rows in usage["return_saves"].items() for k, spills, saved in rows}
    saving = {key: v for key, v in saves.items() if v[1]}
    if VERSION != "3.9":
        assert not saving, saving
        pytest.skip(f"no adopted kernel saves a return address on Triton {VERSION}: the case and its control are 3.9's")
    assert set(saving) == {("vllm_decode_mha", "_fwd_kernel_stage1")}, saving
    _twin_of_vllm(usage, "vllm_decode_mha")
    g = _rows(usage, "vllm_decode_mha", "_fwd_kernel_stage1", "guarded")
    t = _rows(usage, "vllm_decode_mha", "_fwd_kernel_stage1", "twin")
    spills, saved = saving[("vllm_decode_mha", "_fwd_kernel_stage1")]
    assert g[2] == spills == 0 and _free(g, t), (g, t)
    assert not _free([g[0], g[1], spills + saved, g[3]], t), (g, t, saved)


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=KNOWN[VERSION][(s, "_validate")]))
        if (s, "_validate") in KNOWN.get(VERSION, {})
        else s
        for s in ("validator", "validator_one")
    ],
)
def test_validator_within_its_twins_registers(usage: dict, spec: str) -> None:
    """The validator is launched within its twin's register allocation (its fault paths out of line and capped:
    tripwire.validate._triton._with_cap; the twin is ``FAULT=False``, each bad block only counted) at each kernel
    Triton compiles for its rules (the cap is found per specialisation: full sizes, and one-entry sizes at
    misaligned addresses): the rule holds against the twin, with no more spills in the kernel's own function, and
    where the compiler's own allocation fails the rule the launch is capped.

    Of its two builds (the fault functions calling the record's atomics, or inlining them: ``CALLS``) the launch is
    the calling one where it fits the twin's allocation, else the one allocated fewer register units among those
    spilling no more than the twin (ties: calling). The controls, where one build fails the rule and the choice is
    what passes: on Triton 3.9 the one-entry build calling (a program per SM fewer than its twin: the nested calls'
    registers; benchmarks/RESULTS.md, "The register tools"); on 3.6 the full-size build uncapped (the cap's doing)
    and its inlining build (more registers than calling, capped)."""
    v = usage["validator_budget"][spec]
    g, u, t = v["launched"], v["uncapped"], v["twin"]
    assert _free(g, t), v
    assert g[3] >= u[3], v
    if not _free(u, t):
        assert g[4] is not None and g[1] <= g[4], v
    # budget_choice's rule, restated: the first build that fits the twin's allocation, else the lowest of (spills
    # more than the twin, register units), ties to the earlier (calling).
    builds = [v["calls"], v["inlined"]]
    scores = [((b[2] or 0) > (t[2] or 0), _units(b[1])) for b in builds]
    fit = [i for i, sc in enumerate(scores) if sc <= (False, _units(t[1]))]
    want = builds[fit[0] if fit else min(range(len(builds)), key=lambda i: scores[i])]
    assert g[1:6] == want[1:6], v
    if VERSION == "3.9" and spec == "validator_one":
        assert not _free(v["calls"], t), v
    if VERSION == "3.6" and spec == "validator":
        assert not _free(u, t), v
        assert _units(v["inlined"][1]) > _units(v["calls"][1]), v


def test_adopted_cuda_reshape_vote_control_fails_the_rule(adopted_cuda_usage):
    """The guarded copy of vLLM's CUDA reshape_and_cache_flash (benchmarks/adopted_vllm/guarded/cache_kernels.cuh),
    compiled for sm_90 with cuda_ext's flags and read back with cuobjdump at vLLM's launch of 512 threads per block
    (the conftest fixture): its two test placements cost the same. The control: the vote variant (every thread votes
    through guard_index and goes on with the copy) costs registers and a block per SM against it, and the rule flags
    it, so the rule can fail on this kernel (the comparison with vLLM's own build: the next test)."""
    from tripwire import resources as rs

    found = adopted_cuda_usage
    assert {"guarded_first", "guarded_late", "vote"} <= set(found), found
    ((g, t, free),) = rs.compare([found["guarded_late"]], [found["guarded_first"]])
    assert free, rs.format_table([(g, t, free)])
    for placement in ("guarded_first", "guarded_late"):
        ((v, t, free),) = rs.compare([found["vote"]], [found[placement]])
        assert not free and v.programs_per_sm < t.programs_per_sm, rs.format_table([(v, t, free)])


def test_adopted_cuda_reshape_costs_no_occupancy(adopted_cuda_usage):
    """The rule holds for the guarded CUDA copy against vLLM's own kernel as the installed GPU vLLM built it (read
    from vLLM's library), at both test placements. Only where a GPU build of vLLM is installed: this folder keeps no
    copy of vLLM's kernel to build."""
    from tripwire import resources as rs

    found = adopted_cuda_usage
    if "original" not in found:
        pytest.skip("no GPU build of vLLM here: vLLM's compiled reshape_and_cache_flash is the twin")
    for placement in ("guarded_first", "guarded_late"):
        ((g, t, free),) = rs.compare([found[placement]], [found["original"]])
        assert free, rs.format_table([(g, t, free)])
