"""The register budget of a guarded launch (tripwire.triton's ptxas_report, register_cap, budget_choice and the
parsers they read with): ptxas's report read per function, the return-address saves read from SASS, the cap left
alone where there is nothing to compile, and the choice between builds. Compiles are fake kernels whose ``warmup``
(as the budget compiles a launch) yields PTX naming the build, and ptxas and cuobjdump are replaced where
``subprocess.run`` runs them; the caches are observed through those counts, each test with keys of its own. What
the cap does to a real kernel (the non-finite counter, compiled for sm_90) is tests/test_register_rule.py's; that
its fault path still counts exactly under the cap is tests/numerics/test_nonfinite.py's (GPU)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from tripwire.triton import (
    PtxasReport,
    budget_choice,
    parse_ptxas,
    ptxas_report,
    register_cap,
    return_address_saves,
    triton_ptxas_options,
)

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
    r = parse_ptxas(REPORT)
    assert r == PtxasReport(regs=32, spill_bytes=0, callee_spill_bytes=60)
    # Control: the entry's own spills are read as its own, with a callee listed before it.
    callee_first = """ptxas info    : Function properties for helper
    0 bytes stack frame, 40 bytes spill stores, 40 bytes spill loads
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    48 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 48 bytes cumulative stack size
"""
    assert parse_ptxas(callee_first) == PtxasReport(regs=40, spill_bytes=20, callee_spill_bytes=80)


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
    assert return_address_saves(SASS) == 4
    other_reg = SASS.replace("STL [R1+0x8], R0", "STL [R1+0x8], R2")
    assert return_address_saves(other_reg) == 0
    other_value = SASS.replace("MOV R0, 0x780", "MOV R0, 0x790")
    assert return_address_saves(other_value) == 0
    in_callee = SASS.replace("CALL.REL.NOINC 0x800", "CALL.REL.NOINC 0x700")
    assert return_address_saves(in_callee) == 0
    assert return_address_saves(SASS.replace("CALL.REL.NOINC 0x800", "NOP")) == 0


# The smallest kernel ptxas reports on (an entry function that returns).
PTX = ".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry k()\n{\n\tret;\n}\n"
_PROBE = PTX + "// probe\n"


def _ptxas_text(regs: int, stores: int = 0, loads: int = 0, callee: int | None = None) -> str:
    """``ptxas -v``'s text of a kernel ``k`` of ``regs`` registers spilling ``stores`` and ``loads`` bytes, and, with
    ``callee``, of an out-of-line function spilling that many."""
    text = (
        "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
        "ptxas info    : Function properties for k\n"
        f"    8 bytes stack frame, {stores} bytes spill stores, {loads} bytes spill loads\n"
        f"ptxas info    : Used {regs} registers, used 1 barriers, 8 bytes cumulative stack size\n"
    )
    if callee is not None:
        text += (
            "ptxas info    : Function properties for cold\n"
            f"    0 bytes stack frame, {callee} bytes spill stores, 0 bytes spill loads\n"
        )
    return text


class _Tools:
    """ptxas and cuobjdump replaced where the budget runs them (``subprocess.run``): ptxas answers ``answer(ptx)``
    (its ``-v`` text; None: it fails, saying "ptxas died"), cuobjdump answers ``sass`` (None: there is none).
    ``runs``: the tool of each command run, in order. Any other command (Triton's ``ptxas --version``, as it picks
    its ptxas) runs as it is."""

    def __init__(self, answer: Callable[[str], str | None], sass: str | None = None) -> None:
        self.answer, self.sass, self.runs = answer, sass, []
        self.real = subprocess.run

    def run(self, cmd, *a, **k):  # type: ignore[no-untyped-def]
        if "-sass" not in cmd and "-v" not in cmd:
            return self.real(cmd, *a, **k)
        if "cuobjdump" in os.path.basename(cmd[0]):
            self.runs.append("cuobjdump")
            if self.sass is None:
                raise FileNotFoundError(f"no such file: {cmd[0]}")
            return subprocess.CompletedProcess(cmd, 0, stdout=self.sass, stderr="")
        self.runs.append("ptxas")
        with open(cmd[cmd.index("-o") - 1]) as f:
            ptx = f.read()
        text = _ptxas_text(8) if ptx == _PROBE else self.answer(ptx)
        if text is None:
            return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ptxas died")
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr=text)


def _fake_tools(monkeypatch, tmp_path, answer, sass=None) -> _Tools:  # type: ignore[no-untyped-def]
    """ptxas and cuobjdump replaced (:class:`_Tools`), ptxas's reports kept in a cache of this test's own. Skips where
    there is no ptxas to name (the budget looks for one before running it)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    tools = _Tools(answer, sass)
    monkeypatch.setattr(subprocess, "run", tools.run)
    try:
        ptxas_report(_PROBE)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tools.runs.clear()
    return tools


def test_ptxas_report_takes_the_saves_out_of_the_entrys_spills(monkeypatch, tmp_path):
    """ptxas_report: ptxas's count for the entry function, less the return-address saves the SASS shows (kept
    apart in ``return_save_bytes``), never more than ptxas counted, and kept in the cache. The SASS is read only for
    an entry that spills and calls (ptxas lists a function besides it): the controls, an entry that does not spill
    and one with no callee, whose counts stand without cuobjdump. Where the SASS cannot be read (no cuobjdump),
    ptxas's count stands and is not kept: the next report runs ptxas again (the control: a read one is kept)."""
    cases = {
        "calls": _ptxas_text(80, stores=4, callee=20),
        "fewer": _ptxas_text(80, loads=2, callee=20),  # ptxas counted 2 bytes, the SASS shows a 4-byte save
        "clean": _ptxas_text(80, callee=20),
        "alone": _ptxas_text(80, stores=4),
    }
    tools = _fake_tools(monkeypatch, tmp_path, lambda ptx: cases[ptx.rsplit("// ", 1)[1].strip()], SASS)

    def report(case: str) -> PtxasReport:
        return ptxas_report(PTX + f"// {case}\n")

    assert report("calls") == PtxasReport(regs=80, spill_bytes=0, callee_spill_bytes=20, return_save_bytes=4)
    assert tools.runs == ["ptxas", "cuobjdump"]
    assert report("calls").return_save_bytes == 4 and tools.runs == ["ptxas", "cuobjdump"]  # kept
    assert report("fewer") == PtxasReport(regs=80, spill_bytes=0, callee_spill_bytes=20, return_save_bytes=2)
    tools.runs.clear()
    assert report("clean") == PtxasReport(regs=80, spill_bytes=0, callee_spill_bytes=20)
    assert report("alone") == PtxasReport(regs=80, spill_bytes=4, callee_spill_bytes=0)
    assert tools.runs == ["ptxas", "ptxas"]
    # No cuobjdump (a fresh cache, so that ptxas runs): the count as ptxas gave it, each time.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "unread"))
    tools.sass, tools.runs[:] = None, []
    for _ in range(2):
        assert report("calls") == PtxasReport(regs=80, spill_bytes=4, callee_spill_bytes=20)
    assert tools.runs == ["ptxas", "cuobjdump"] * 2
    tools.sass = SASS
    assert report("calls").spill_bytes == 0 and report("calls").spill_bytes == 0
    assert tools.runs == ["ptxas", "cuobjdump"] * 3


def test_a_report_without_an_entry_is_an_error():
    with pytest.raises(RuntimeError, match="no entry function"):
        parse_ptxas("ptxas fatal   : Unresolved extern function 'f'\n")


def test_ptx_without_a_target_is_an_error():
    with pytest.raises(RuntimeError, match="target"):
        ptxas_report(".version 8.0\n.address_size 64\n")


_salts = itertools.count()


class _Kernel:
    """A kernel as the budget compiles it (``warmup``): each build's PTX names this kernel and the keyword arguments
    it was built with (what :func:`_builds_cost` reads back), so that ptxas's cache never answers for another
    test's kernel. ``builds``: those keyword arguments, in order of compile."""

    __name__ = "fake_kernel"

    def __init__(self) -> None:
        self.builds: list[dict] = []
        self.salt = next(_salts)

    def warmup(self, *args, grid, **kw):  # type: ignore[no-untyped-def]
        self.builds.append(dict(kw))
        ptx = PTX + f"// {json.dumps([self.salt, kw], sort_keys=True)}\n"
        return SimpleNamespace(asm={"ptx": ptx})


def _builds_cost(monkeypatch, tmp_path, triton_interpret, cost) -> None:  # type: ignore[no-untyped-def]
    """Compiled (not interpreted), ptxas's report of a :class:`_Kernel`'s build is ``cost(kwargs)`` (None: ptxas
    fails)."""

    def answer(ptx: str) -> str | None:
        r = cost(json.loads(ptx.rsplit("// ", 1)[1])[1])
        return None if r is None else _ptxas_text(r.regs, stores=r.spill_bytes)

    triton_interpret(False)
    _fake_tools(monkeypatch, tmp_path, answer)


class _Broken:
    """A kernel whose every compile fails; ``compiles``: how many were tried."""

    __name__ = "broken_kernel"

    def __init__(self) -> None:
        self.compiles = 0

    def warmup(self, *a, **k):  # type: ignore[no-untyped-def]
        self.compiles += 1
        raise ValueError("no target")


def test_nothing_compiled_under_the_interpreter(triton_interpret, caplog):
    """Under Triton's interpreter the launch runs no compiled code: no cap, nothing compiled, and the answer is
    cached (compiling afterwards, the key still compiles nothing). The control: another key, compiling, reaches the
    kernel (once: its twin's compile fails, and the search stops there)."""
    kernel = _Broken()
    key = ("test_budget", object())
    triton_interpret(True)
    assert register_cap(key, kernel, (1,), (), {}, {"GUARD": False}) is None
    triton_interpret(False)
    assert register_cap(key, kernel, (1,), (), {}, {"GUARD": False}) is None  # cached
    assert kernel.compiles == 0
    with caplog.at_level("WARNING", logger="tripwire"):
        assert register_cap(("test_budget", object()), kernel, (1,), (), {}, {"GUARD": False}) is None
    assert kernel.compiles == 1


def _report(regs, spills=0):
    return PtxasReport(regs=regs, spill_bytes=spills, callee_spill_bytes=0)


def test_a_failed_search_launches_uncapped_and_says_so(monkeypatch, tmp_path, triton_interpret, caplog):
    """Compiled (not interpreted) and the compile fails: no cap, a warning naming the kernel and the error, and the
    answer cached (one compile, one warning, not one per launch; another key warns again). The control: the same
    launch of a kernel that compiles is capped (its twin 64 registers, it 72, capped at 64 spilling nothing),
    silently: the twin, the kernel, the kernel at 64 compiled."""
    triton_interpret(False)
    broken = _Broken()
    key = ("test_budget_broken", object())
    with caplog.at_level("WARNING", logger="tripwire"):
        assert register_cap(key, broken, (1,), (), {}, {"GUARD": False}) is None
        assert register_cap(key, broken, (1,), (), {}, {"GUARD": False}) is None
    warned = [r.getMessage() for r in caplog.records if "register cap" in r.getMessage()]
    assert len(warned) == 1 and "broken_kernel" in warned[0] and "ValueError: no target" in warned[0], warned
    assert broken.compiles == 1
    with caplog.at_level("WARNING", logger="tripwire"):
        assert register_cap(("test_budget_broken", object()), broken, (1,), (), {}, {"GUARD": False}) is None
    assert broken.compiles == 2 and len([r for r in caplog.records if "register cap" in r.getMessage()]) == 2
    caplog.clear()
    _builds_cost(monkeypatch, tmp_path, triton_interpret,
                 lambda kw: _report(64) if kw.get("GUARD") is False else _report(kw.get("maxnreg", 72)))  # fmt: skip
    kernel = _Kernel()
    with caplog.at_level("WARNING", logger="tripwire"):
        assert register_cap(("test_budget_fits", object()), kernel, (1,), (), {}, {"GUARD": False}) == 64
    assert kernel.builds == [{"GUARD": False}, {}, {"maxnreg": 64}] and not caplog.records


OPTIONS = [{"CALLS": True}, {"CALLS": False}]


def _calls_costs(kw):
    # The twin 64 registers; calling: 72, and capped at 64 its entry spills; inlining: 64 as compiled.
    if kw.get("FAULT") is False:
        return _report(64)
    if kw["CALLS"]:
        return _report(72) if "maxnreg" not in kw else _report(kw["maxnreg"], 24)
    return _report(64)


def test_budget_choice_takes_the_build_that_fits_the_twin(monkeypatch, tmp_path, triton_interpret):
    """Calling costs a register unit the cap cannot take back without a spill in the entry; inlining fits the
    twin's 64: the launch inlines, uncapped. The control: calling alone is what the launch would be otherwise."""
    _builds_cost(monkeypatch, tmp_path, triton_interpret, _calls_costs)
    kernel = _Kernel()
    key = ("test_budget_choice", object())
    assert budget_choice(key, kernel, (1,), (), {}, {"FAULT": False}, OPTIONS) == {"CALLS": False}
    assert [k.get("CALLS") for k in kernel.builds] == [True, True, True, False]  # twin, calling, at 64, inlining
    assert budget_choice(key, kernel, (1,), (), {}, {"FAULT": False}, OPTIONS) == {"CALLS": False}
    assert len(kernel.builds) == 4  # cached
    alone = ("test_budget_choice_alone", object())
    assert budget_choice(alone, kernel, (1,), (), {}, {"FAULT": False}, OPTIONS[:1]) == {"CALLS": True}


def test_budget_choice_stops_at_the_first_build_that_fits(monkeypatch, tmp_path, triton_interpret):
    """Calling fits the twin's allocation once capped (no spill at 64): it launches capped, and the inlining build
    is never compiled."""
    _builds_cost(monkeypatch, tmp_path, triton_interpret,
                 lambda kw: _report(kw.get("maxnreg", 72) if kw.get("FAULT") is not False else 64))  # fmt: skip
    kernel = _Kernel()
    key = ("test_budget_first", object())
    assert budget_choice(key, kernel, (1,), (), {}, {"FAULT": False}, OPTIONS) == {"CALLS": True, "maxnreg": 64}
    assert all(k["CALLS"] for k in kernel.builds) and len(kernel.builds) == 3  # twin, calling, calling at 64


def test_budget_choice_never_takes_a_build_that_spills_more(monkeypatch, tmp_path, triton_interpret):
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
        _builds_cost(monkeypatch, tmp_path, triton_interpret, costs(spill))
        key = ("test_budget_spill", spill, object())
        assert budget_choice(key, _Kernel(), (1,), (), {}, {"FAULT": False}, OPTIONS)["CALLS"] is want


def test_budget_choice_leaves_out_a_build_that_fails(monkeypatch, tmp_path, triton_interpret, caplog):
    """Calling does not fit and the inlining build fails in ptxas: the launch calls with the cap its search found
    (not uncapped), and the failure is logged naming the build. The control: with the inlining build compiling,
    it is the one launched."""

    def report(kw):  # type: ignore[no-untyped-def]
        # The twin 64; calling 88 uncapped, spilling at a cap of 64, not at 72; inlining 64, or ptxas failing.
        if kw.get("FAULT") is False:
            return _report(64)
        if not kw["CALLS"]:
            return None if fail else _report(64)
        return _report(88) if "maxnreg" not in kw else _report(kw["maxnreg"], 0 if kw["maxnreg"] > 64 else 24)

    for fail, want in ((True, {"CALLS": True, "maxnreg": 72}), (False, {"CALLS": False})):
        _builds_cost(monkeypatch, tmp_path, triton_interpret, report)
        key = ("test_budget_failed_build", fail, object())
        caplog.clear()
        with caplog.at_level("WARNING", logger="tripwire"):
            assert budget_choice(key, _Kernel(), (1,), (), {}, {"FAULT": False}, OPTIONS) == want
        warned = [r.getMessage() for r in caplog.records if "budget choice" in r.getMessage()]
        assert len(warned) == fail and all("without the build {'CALLS': False}" in w for w in warned), warned
        assert all("ptxas died" in w for w in warned), warned


def test_budget_choice_under_the_interpreter_and_on_failure(triton_interpret, caplog):
    """Nothing compiled under the interpreter, and a failed search, both launch the first option uncapped; the
    failure says so once (one compile tried). No options at all is an error."""
    triton_interpret(True)
    broken = _Broken()
    assert budget_choice(("test_budget_interp", object()), broken, (1,), (), {}, {"FAULT": False}, OPTIONS) == {
        "CALLS": True
    }
    assert broken.compiles == 0
    triton_interpret(False)
    key = ("test_budget_broken_choice", object())
    with caplog.at_level("WARNING", logger="tripwire"):
        assert budget_choice(key, broken, (1,), (), {}, {"FAULT": False}, OPTIONS) == {"CALLS": True}
        assert budget_choice(key, broken, (1,), (), {}, {"FAULT": False}, OPTIONS) == {"CALLS": True}
    warned = [r.getMessage() for r in caplog.records if "budget choice" in r.getMessage()]
    assert len(warned) == 1 and "broken_kernel" in warned[0] and "ValueError: no target" in warned[0], warned
    assert broken.compiles == 1
    with pytest.raises(ValueError, match="at least one option"):
        budget_choice(("test_budget_none",), broken, (1,), (), {}, {}, [])


def _need_ptxas(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Skips where there is no ptxas (running it once, in a cache of its own)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "probe"))
    try:
        ptxas_report(PTX)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _count_ptxas_runs(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every ptxas command the budget runs from here on, in order (each still runs)."""
    runs: list = []
    real = subprocess.run

    def counted(cmd, *a, **k):  # type: ignore[no-untyped-def]
        runs.append(cmd)
        return real(cmd, *a, **k)

    monkeypatch.setattr(subprocess, "run", counted)
    return runs


def test_a_report_comes_from_the_cache_the_next_time(monkeypatch, tmp_path):
    """ptxas runs once per PTX, options and binary: the next report of the same PTX is read from Triton's cache, so a
    process start pays no ptxas at a compiled variant's first call when Triton's compiles come from that cache too.
    Another PTX, other options, or another cache directory (the control: nothing kept there) run ptxas again."""
    _need_ptxas(monkeypatch, tmp_path)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "a"))
    runs = _count_ptxas_runs(monkeypatch)
    first = ptxas_report(PTX)
    assert ptxas_report(PTX) == first and len(runs) == 1
    assert ptxas_report(PTX + "// another kernel's text\n") == first and len(runs) == 2
    other = () if triton_ptxas_options() else ("--regAllocOptLevel=2",)
    ptxas_report(PTX, options=other)
    assert len(runs) == 3 and ("--regAllocOptLevel=2" in runs[-1]) == bool(other)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "b"))
    ptxas_report(PTX)
    assert len(runs) == 4


def test_a_report_with_options_of_ones_own(monkeypatch, tmp_path):
    """``options`` passed to ptxas as given (``()``: none), and by default Triton's own, which are one of those two
    here: that report comes from the cache, ptxas not run again. Anything but a sequence of option strings is
    refused before ptxas runs (the control: a string, a number)."""
    _need_ptxas(monkeypatch, tmp_path)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "own"))
    runs = _count_ptxas_runs(monkeypatch)
    assert triton_ptxas_options() in ((), ("--regAllocOptLevel=2",))
    plain = ptxas_report(PTX, options=())
    assert isinstance(plain, PtxasReport) and runs[-1][1:3] == ["-v", "--gpu-name=sm_90a"]
    ptxas_report(PTX, options=["--regAllocOptLevel=2"])
    assert runs[-1][1:3] == ["-v", "--regAllocOptLevel=2"] and len(runs) == 2
    ptxas_report(PTX)
    assert len(runs) == 2
    for bad in ("--regAllocOptLevel=2", [2]):
        with pytest.raises(TypeError, match="options must be a sequence of ptxas option strings"):
            ptxas_report(PTX, options=bad)  # type: ignore[arg-type]
    assert len(runs) == 2
