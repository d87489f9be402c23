"""The register budget of a guarded launch (tripwire.triton._budget): ptxas's report read per function, the cap
left alone where there is nothing to compile, and the choice between builds (compiles replaced by reports). What
the cap does to a real kernel (the non-finite counter, compiled for sm_90) is tests/test_register_rule.py's; that
its fault path still counts exactly under the cap is tests/numerics/test_nonfinite.py's (GPU)."""

from __future__ import annotations

import pytest

from tripwire.triton import _budget

# ptxas -v over the non-finite counter capped at 32 registers (sm_90a): the entry keeps its registers and spills
# nothing; its out-of-line fault path spills on its own path.
REPORT = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_nonfinite_kernel' for 'sm_90a'
ptxas info    : Function properties for _nonfinite_kernel
    24 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 24 bytes cumulative stack size
ptxas info    : Compile time = 162.896 ms
ptxas info    : Function properties for tripwire_$_numerics_$_nonfinite_$__record_nonfinite__Pi16_Pi64_i32_i32_i64_
    0 bytes stack frame, 24 bytes spill stores, 28 bytes spill loads
ptxas info    : Function properties for tripwire_$_triton_$__record_words__Pi64_i64_i64_i64_i64_i64_i64__
    0 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
"""


def test_entry_spills_apart_from_its_callees():
    r = _budget.parse_ptxas(REPORT)
    assert r == _budget.PtxasReport(regs=32, spill_bytes=0, callee_spill_bytes=60)
    # Control: the entry's own spills are read as its own, with a callee listed before it.
    callee_first = """ptxas info    : Function properties for helper
    0 bytes stack frame, 40 bytes spill stores, 40 bytes spill loads
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    48 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 48 bytes cumulative stack size
"""
    assert _budget.parse_ptxas(callee_first) == _budget.PtxasReport(regs=40, spill_bytes=20, callee_spill_bytes=80)


# cuobjdump -sass of a kernel calling an out-of-line function that needs every register it is allocated (vLLM's
# MHA decode stage 1, guarded, on Triton 3.9), cut to the call and a callee, which here follows at once (the
# callee's address and the block after the call shortened): the caller saves the call's return address (0x780) to
# its stack, the callee loads it back to return.
SASS = """
        code for sm_90a
                Function : k
        .headerflags    @"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                 /* 0x00000a00ff017b82 */
                                                                                          /* 0x000fe40000000800 */
        /*0730*/              @!P3 BRA 0x7a0 ;                                            /* 0x000000000018b947 */
        /*0740*/                   MOV R0, 0x780 ;                                        /* 0x0000078000007802 */
        /*0750*/                   BSSY B0, 0x790 ;                                       /* 0x0000003000007945 */
        /*0760*/                   STL [R1+0x8], R0 ;                                     /* 0x0000080001007387 */
        /*0770*/                   CALL.REL.NOINC 0x800 ;                                 /* 0x0000004400447944 */
        /*0780*/                   BSYNC B0 ;                                             /* 0x0000000000007941 */
        /*0790*/                   EXIT ;                                                 /* 0x000000000000794d */
        /*0800*/                   STL [R1], R5 ;                                         /* 0x0000000501007387 */
        /*0810*/                   LDL R20, [R1+0x8] ;                                    /* 0x00000800010147983 */
        /*0820*/                   RET.REL.NODEC R20 0x0 ;                                /* 0xfffff7b014007950 */
"""


def test_a_calls_saved_return_address_is_told_from_a_spill():
    """ptxas counts a call's saved return address as a spill of the kernel (4 bytes), but it runs only where the call
    does: it is told apart by the SASS, where it stores the register a MOV set to the address after the call. The
    controls: a store of another register before the call, or of a constant that is not the return address, is a
    spill; a store in the callee (from the first call target on) is the callee's."""
    assert _budget.return_address_saves(SASS) == 4
    other_reg = SASS.replace("STL [R1+0x8], R0", "STL [R1+0x8], R2")
    assert _budget.return_address_saves(other_reg) == 0
    other_value = SASS.replace("MOV R0, 0x780", "MOV R0, 0x790")
    assert _budget.return_address_saves(other_value) == 0
    in_callee = SASS.replace("CALL.REL.NOINC 0x800", "CALL.REL.NOINC 0x700")
    assert _budget.return_address_saves(in_callee) == 0
    assert _budget.return_address_saves(SASS.replace("CALL.REL.NOINC 0x800", "NOP")) == 0


def test_ptxas_report_takes_the_saves_out_of_the_entrys_spills(monkeypatch, tmp_path):
    """ptxas_report: ptxas's count for the entry function, less the return-address saves the SASS shows (kept
    apart in ``return_save_bytes``); where the SASS cannot be read (no cuobjdump), ptxas's count as it is."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    report = _budget.PtxasReport(regs=80, spill_bytes=4, callee_spill_bytes=20)
    cubin = str(tmp_path / "k.cubin")

    class Done:
        stdout = SASS

    monkeypatch.setattr(_budget, "tool_path", lambda name: "/bin/cuobjdump")
    monkeypatch.setattr(_budget.subprocess, "run", lambda *a, **k: Done())
    assert _budget._without_return_saves(report, cubin) == report._replace(spill_bytes=0, return_save_bytes=4)
    # Never more than ptxas counted (a save ptxas did not count as a spill leaves the count alone).
    assert _budget._without_return_saves(report._replace(spill_bytes=0), cubin).spill_bytes == 0

    def missing(*a, **k):  # type: ignore[no-untyped-def]
        raise FileNotFoundError("no cuobjdump")

    monkeypatch.setattr(_budget.subprocess, "run", missing)
    assert _budget._without_return_saves(report, cubin) is None  # unread: ptxas's count stands, not cached
    # The SASS is read only for a kernel that calls: ptxas lists a function besides the entry (REPORT's callees);
    # the control, the entry's own properties alone.
    assert _budget._has_callees(REPORT)
    entry_only = REPORT.split("ptxas info    : Compile time")[0]
    assert not _budget._has_callees(entry_only)


def test_a_report_without_an_entry_is_an_error():
    with pytest.raises(RuntimeError, match="no entry function"):
        _budget.parse_ptxas("ptxas fatal   : Unresolved extern function 'f'\n")


def test_ptx_without_a_target_is_an_error():
    with pytest.raises(RuntimeError, match="target"):
        _budget.ptxas_report(".version 8.0\n.address_size 64\n")


def test_nothing_compiled_under_the_interpreter(triton_interpret):
    """Under Triton's interpreter the launch runs no compiled code: no cap, nothing compiled, and the answer is
    cached. The control: the search itself compiles (here it reaches the function handed in)."""

    class Unbuildable:
        def warmup(self, *a, **k):
            raise AssertionError("compiled")

    key = ("test_budget", object())
    triton_interpret(True)
    assert _budget.register_cap(key, Unbuildable(), (1,), (), {}, {"GUARD": False}) is None
    assert key in _budget._caps
    triton_interpret(False)
    assert _budget.register_cap(key, Unbuildable(), (1,), (), {}, {"GUARD": False}) is None  # cached
    with pytest.raises(AssertionError, match="compiled"):
        _budget._search(Unbuildable(), (1,), (), {}, {"GUARD": False})
    _budget._caps.pop(key)


class _Broken:
    """A kernel whose every compile fails."""

    __name__ = "broken_kernel"

    def warmup(self, *a, **k):  # type: ignore[no-untyped-def]
        raise ValueError("no target")


def test_a_failed_search_launches_uncapped_and_says_so(triton_interpret, caplog):
    """Compiled (not interpreted) and the compile fails: no cap, a warning naming the kernel and the error, and the
    answer cached (one warning, not one per launch). The control: the error reaches the caller without the guard."""
    triton_interpret(False)
    key = ("test_budget_broken", object())
    with caplog.at_level("WARNING", logger="tripwire"):
        assert _budget.register_cap(key, _Broken(), (1,), (), {}, {"GUARD": False}) is None
        assert _budget.register_cap(key, _Broken(), (1,), (), {}, {"GUARD": False}) is None
    warned = [r.getMessage() for r in caplog.records if "register cap" in r.getMessage()]
    assert len(warned) == 1 and "broken_kernel" in warned[0] and "ValueError: no target" in warned[0], warned
    _budget._caps.pop(key)
    with pytest.raises(ValueError, match="no target"):
        _budget._search(_Broken(), (1,), (), {}, {"GUARD": False})


def _fake_builds(monkeypatch, triton_interpret, report):
    """Compiles replaced: ``report(kwargs)`` is ptxas's report of the build with those keyword arguments; returns
    the list of the keyword arguments compiled, in order."""
    compiled: list[dict] = []

    def compile_(fn, grid, args, kw):  # type: ignore[no-untyped-def]
        compiled.append(dict(kw))
        return len(compiled) - 1

    triton_interpret(False)
    monkeypatch.setattr(_budget, "_compiled_ptx", compile_)
    monkeypatch.setattr(_budget, "ptxas_report", lambda i: report(compiled[i]))
    return compiled


def _report(regs, spills=0):
    return _budget.PtxasReport(regs=regs, spill_bytes=spills, callee_spill_bytes=0)


OPTIONS = [{"CALLS": True}, {"CALLS": False}]


def _calls_costs(kw):
    # The twin 64 registers; calling: 72, and capped at 64 its entry spills; inlining: 64 as compiled.
    if kw.get("FAULT") is False:
        return _report(64)
    if kw["CALLS"]:
        return _report(72) if "maxnreg" not in kw else _report(kw["maxnreg"], 24)
    return _report(64)


def test_budget_choice_takes_the_build_that_fits_the_twin(monkeypatch, triton_interpret):
    """Calling costs a register unit the cap cannot take back without a spill in the entry; inlining fits the
    twin's 64: the launch inlines, uncapped. The control: calling alone is what the launch would be otherwise."""
    compiled = _fake_builds(monkeypatch, triton_interpret, _calls_costs)
    key = ("test_budget_choice", object())
    assert _budget.budget_choice(key, None, (1,), (), {}, {"FAULT": False}, OPTIONS) == {"CALLS": False}
    assert [k.get("CALLS") for k in compiled] == [True, True, True, False]  # twin, calling, calling at 64, inlining
    assert _budget.budget_choice(key, None, (1,), (), {}, {"FAULT": False}, OPTIONS) == {"CALLS": False}
    assert len(compiled) == 4  # cached
    _budget._choices.pop(key)
    alone = ("test_budget_choice_alone", object())
    assert _budget.budget_choice(alone, None, (1,), (), {}, {"FAULT": False}, OPTIONS[:1]) == {"CALLS": True}
    _budget._choices.pop(alone)


def test_budget_choice_stops_at_the_first_build_that_fits(monkeypatch, triton_interpret):
    """Calling fits the twin's allocation once capped (no spill at 64): it launches capped, and the inlining build
    is never compiled."""
    compiled = _fake_builds(monkeypatch, triton_interpret, lambda kw: _report(kw.get("maxnreg", 72) if kw.get("FAULT") is not False
                                                           else 64))  # fmt: skip
    key = ("test_budget_first", object())
    assert _budget.budget_choice(key, None, (1,), (), {}, {"FAULT": False}, OPTIONS) == {"CALLS": True, "maxnreg": 64}
    assert all(k["CALLS"] for k in compiled)
    _budget._choices.pop(key)


def test_budget_choice_never_takes_a_build_that_spills_more(monkeypatch, triton_interpret):
    """Where neither fits, the fewest register units among builds spilling no more than the twin: inlining's 72
    registers spill 16 bytes in the entry, so the launch calls at 80 (the control: with the spill gone it would
    inline)."""

    def costs(spill):  # type: ignore[no-untyped-def]
        def report(kw):  # type: ignore[no-untyped-def]
            if kw.get("FAULT") is False:
                return _report(64)
            if "maxnreg" in kw:
                return _report(kw["maxnreg"], 8)
            return _report(80) if kw["CALLS"] else _report(72, spill)

        return report

    for spill, want in ((16, True), (0, False)):
        _fake_builds(monkeypatch, triton_interpret, costs(spill))
        key = ("test_budget_spill", spill, object())
        assert _budget.budget_choice(key, None, (1,), (), {}, {"FAULT": False}, OPTIONS)["CALLS"] is want
        _budget._choices.pop(key)


def test_budget_choice_leaves_out_a_build_that_fails(monkeypatch, triton_interpret, caplog):
    """Calling does not fit and the inlining build fails to compile: the launch calls with the cap its search found
    (not uncapped), and the failure is logged naming the build. The control: with the inlining build compiling,
    it is the one launched."""

    def report(kw):  # type: ignore[no-untyped-def]
        # The twin 64; calling 88 uncapped, spilling at a cap of 64, not at 72; inlining 64, or a failed compile.
        if kw.get("FAULT") is False:
            return _report(64)
        if not kw["CALLS"]:
            if fail:
                raise RuntimeError("ptxas died")
            return _report(64)
        return _report(88) if "maxnreg" not in kw else _report(kw["maxnreg"], 0 if kw["maxnreg"] > 64 else 24)

    for fail, want in ((True, {"CALLS": True, "maxnreg": 72}), (False, {"CALLS": False})):
        _fake_builds(monkeypatch, triton_interpret, report)
        key = ("test_budget_failed_build", fail, object())
        caplog.clear()
        with caplog.at_level("WARNING", logger="tripwire"):
            assert _budget.budget_choice(key, None, (1,), (), {}, {"FAULT": False}, OPTIONS) == want
        warned = [r.getMessage() for r in caplog.records if "budget choice" in r.getMessage()]
        assert len(warned) == fail and all("without the build {'CALLS': False}" in w for w in warned), warned
        _budget._choices.pop(key)


def test_budget_choice_under_the_interpreter_and_on_failure(triton_interpret, caplog):
    """Nothing compiled under the interpreter, and a failed search, both launch the first option uncapped; the
    failure says so once. No options at all is an error."""
    triton_interpret(True)
    key = ("test_budget_interp", object())
    assert _budget.budget_choice(key, _Broken(), (1,), (), {}, {"FAULT": False}, OPTIONS) == {"CALLS": True}
    _budget._choices.pop(key)
    triton_interpret(False)
    key = ("test_budget_broken_choice", object())
    with caplog.at_level("WARNING", logger="tripwire"):
        assert _budget.budget_choice(key, _Broken(), (1,), (), {}, {"FAULT": False}, OPTIONS) == {"CALLS": True}
    warned = [r.getMessage() for r in caplog.records if "budget choice" in r.getMessage()]
    assert len(warned) == 1 and "broken_kernel" in warned[0] and "ValueError: no target" in warned[0], warned
    _budget._choices.pop(key)
    with pytest.raises(ValueError, match="at least one option"):
        _budget.budget_choice(("test_budget_none",), _Broken(), (1,), (), {}, {}, [])


def _need_ptxas() -> None:
    try:
        _budget.ptxas_path(90)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _count_ptxas_runs(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every ptxas command the budget runs from here on, in order (each still runs)."""
    import subprocess

    runs: list = []
    real = subprocess.run

    def counted(cmd, *a, **k):  # type: ignore[no-untyped-def]
        runs.append(cmd)
        return real(cmd, *a, **k)

    monkeypatch.setattr(_budget.subprocess, "run", counted)
    return runs


# The smallest kernel ptxas reports on (an entry function that returns).
PTX = ".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry k()\n{\n\tret;\n}\n"


def test_a_report_comes_from_the_cache_the_next_time(monkeypatch, tmp_path):
    """ptxas runs once per PTX, options and binary: the next report of the same PTX is read from Triton's cache, so a
    process start pays no ptxas at a compiled variant's first call when Triton's compiles come from that cache too.
    Another PTX, other options, or another cache directory (the control: nothing kept there) run ptxas again."""
    _need_ptxas()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "a"))
    runs = _count_ptxas_runs(monkeypatch)
    first = _budget.ptxas_report(PTX)
    assert _budget.ptxas_report(PTX) == first and len(runs) == 1
    assert _budget.ptxas_report(PTX + "// another kernel's text\n") == first and len(runs) == 2
    other = () if _budget.triton_ptxas_options() else ("--regAllocOptLevel=2",)
    monkeypatch.setattr(_budget, "triton_ptxas_options", lambda: other)
    _budget.ptxas_report(PTX)
    assert len(runs) == 3 and ("--regAllocOptLevel=2" in runs[-1]) == bool(other)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "b"))
    _budget.ptxas_report(PTX)
    assert len(runs) == 4


def test_a_report_with_options_of_ones_own(monkeypatch, tmp_path):
    """The public face (tripwire.triton.ptxas_report): ``options`` passed to ptxas as given (``()``: none), and by
    default Triton's own, which are one of those two here: that report comes from the cache, ptxas not run again.
    Anything but a sequence of option strings is refused before ptxas runs (the control: a string, a number)."""
    import tripwire.triton as tt

    _need_ptxas()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    runs = _count_ptxas_runs(monkeypatch)
    assert tt.triton_ptxas_options() in ((), ("--regAllocOptLevel=2",))
    plain = tt.ptxas_report(PTX, options=())
    assert isinstance(plain, tt.PtxasReport) and runs[-1][1:3] == ["-v", "--gpu-name=sm_90a"]
    tt.ptxas_report(PTX, options=["--regAllocOptLevel=2"])
    assert runs[-1][1:3] == ["-v", "--regAllocOptLevel=2"] and len(runs) == 2
    tt.ptxas_report(PTX)
    assert len(runs) == 2
    for bad in ("--regAllocOptLevel=2", [2]):
        with pytest.raises(TypeError, match="options must be a sequence of ptxas option strings"):
            tt.ptxas_report(PTX, options=bad)  # type: ignore[arg-type]
    assert len(runs) == 2
