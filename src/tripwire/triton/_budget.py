"""The register budget of a guarded launch: compile the guarded kernel within its twin's register allocation.

A kernel is allocated registers for its hungriest path, and a noinline function's registers count as its caller's:
an out-of-line fault path that needs more registers than the hot loop raises the whole kernel's allocation and can
cost every clean launch programs per SM (Triton 3.6 inlines the tile records' block reductions into the out-of-line
function, which then needs more than a streaming loop). ``maxnreg`` (PTX ``.maxnreg``) caps the kernel and its
callees together; at the twin's allocation the hot loop keeps what it had and the fault path spills on its own
path instead, which runs only when something is wrong.

:func:`register_cap` finds that cap for one launch: the twin (the kernel's own ``GUARD=False`` build, or whatever
``twin`` overrides) and the guarded kernel are compiled, and ptxas's report of each is read (``ptxas -v``: the entry
function's registers and spills, its callees' spills apart, its calls' saved return addresses not counted as
spills: :func:`return_address_saves`). The cap is the twin's registers rounded up to the
allocation unit, raised a unit at a time while the capped entry function spills more than the twin's; none where
the guarded kernel already fits the twin's allocation spilling no more, or only fits uncapped (a build that spills
more uncapped is also tried capped at its own allocation, where ptxas may not spill). The cap is never a clean path
that spills: spills in the out-of-line functions are allowed, the entry function's only as far as the twin's.
ptxas runs with the allocation options Triton's own command passes (:func:`triton_ptxas_options`): what is read is
the cubin that runs. A search that fails (no ptxas, a compile error) is logged as a warning on the ``tripwire``
logger and the launch goes uncapped: the cap is an optimisation, the count is the same either way.

:func:`budget_choice` does the same for a kernel with several builds that record alike (its fault path's atomics
called or inlined into an out-of-line caller): it launches the first build that fits the twin's allocation, with
its cap, compiling the next only when one does not.

Where it compiles: on the current CUDA device (``JITFunction.warmup``: compiled, not loaded, not launched), or, while
launches are being recorded (:func:`tripwire.resources.capture_launches`), for sm_90 as ``tripwire resources``
compiles them, so that what the tools read is what a launch on an H100/H200 runs. Under Triton's interpreter there
is nothing to compile: ``None``. The result is cached per key: the first launch of a shape pays the compiles (as
Triton's first launch does); later ones a dict lookup. Do the first launch before any CUDA graph capture.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

from . import _callee

log = logging.getLogger("tripwire")
_REG_UNIT = 8  # registers per thread are allocated in units of 8
_MAX_REGS = 255
_caps: dict[Any, int | None] = {}
_choices: dict[Any, Mapping[str, Any]] = {}  # budget_choice's, per key


class PtxasReport(NamedTuple):
    """What ``ptxas -v`` said of one kernel: the entry function's registers (its callees' included: they run in
    its allocation) and spill bytes (stores plus loads per thread), and the spill bytes of its callees together.

    ``return_save_bytes``: what of ptxas's count for the entry function is its calls saving their return address
    to the stack (:func:`return_address_saves`), taken out of ``spill_bytes`` by :func:`ptxas_report`. ptxas
    counts that store as a spill, but it runs only where the call does and holds no value of the caller's. In a
    guarded kernel the calls are its out-of-line fault paths, so the clean path keeps every register it had; a
    kernel that calls a noinline function on its clean path runs that store there, once per call."""

    regs: int
    spill_bytes: int
    callee_spill_bytes: int
    return_save_bytes: int = 0


def tool_path(name: str) -> str:
    """A CUDA tool (ptxas, cuobjdump): the one bundled with Triton, else the one on PATH."""
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if os.path.isfile(bundled):
        return bundled
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"no {name}: neither Triton's bundled one ({bundled}) nor one on PATH")
    return found


def ptxas_path(arch: int) -> str:
    """The ptxas Triton itself compiles ``sm_<arch>`` with (Triton 3.9 picks its newer bundled one for sm_90 too)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return str(get_ptxas(arch).path)
    except (ImportError, AttributeError):
        return tool_path("ptxas")


@functools.lru_cache(maxsize=1)
def triton_ptxas_options() -> tuple[str, ...]:
    """The register-allocation options the installed Triton's own ptxas command passes (``make_cubin`` of its NVIDIA
    backend), so that what :func:`ptxas_report` reads is the allocation of the cubin Triton builds: Triton 3.9 adds
    ``--regAllocOptLevel=2`` (a ptxas 13 workaround), which changes registers and spills (a cap found without it
    can spill in the build that runs); 3.6 adds none. Read from the backend's source, the only place they are
    stated; none where it cannot be read. ``tests/test_register_rule.py`` checks the result against the registers
    of Triton's own cubin."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend

        src = inspect.getsource(CUDABackend.make_cubin)
    except (ImportError, AttributeError, OSError, TypeError):
        return ()
    return tuple(sorted(set(re.findall(r"--regAllocOptLevel=\d+", src))))


def ptxas_report(ptx: str, *, options: Sequence[str] | None = None) -> PtxasReport:
    """``ptxas -v`` over ``ptx`` (one kernel, as Triton emits it: its target and any ``.maxnreg`` are in the text),
    with the allocation options Triton's own command passes (:func:`triton_ptxas_options`), parsed: what the register
    budget and ``tripwire resources`` go by. ``options``: other ptxas options instead of Triton's (``()``: none; a
    report of a build Triton would not make). Needs a ptxas (Triton's bundled one, else one on PATH:
    FileNotFoundError without). Raises RuntimeError with ptxas's words if it fails or reports no entry function.

    Kept in Triton's cache (its ``TRITON_CACHE_DIR``), keyed by the PTX, the options and the ptxas binary: the
    report is a function of those alone, and ptxas over a large kernel takes a noticeable fraction of a second. A
    register cap is found at the first call of every compiled variant, so without it each process start would pay
    ptxas again at each variant's first call, though Triton's own compiles come from its cache."""
    m = re.search(r"^\s*\.target\s+sm_(\d+)(a?)", ptx, re.MULTILINE)
    if m is None:
        raise RuntimeError("ptxas_report: the PTX names no .target sm_NN")
    arch = int(m.group(1))
    if options is not None and (isinstance(options, str) or not all(isinstance(o, str) for o in options)):
        raise TypeError(f"ptxas_report: options must be a sequence of ptxas option strings, got {options!r}")
    opts = triton_ptxas_options() if options is None else tuple(options)
    ptxas, gpu = ptxas_path(arch), f"sm_{arch}{m.group(2)}"
    cache = _report_cache(ptxas, opts, gpu, ptx)
    if cache is not None and (found := cache.get_file(_REPORT_FILE)) is not None:
        with open(found) as f:
            return PtxasReport(*json.load(f))
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = os.path.join(d, "k.cubin")
        p = subprocess.run([ptxas, "-v", *opts, f"--gpu-name={gpu}", src, "-o", out], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"ptxas failed: {p.stderr[-2000:]}")
        report = parse_ptxas(p.stderr)
        keep = True
        if report.spill_bytes and _has_callees(p.stderr):
            # The entry spills and calls: some of it may be its calls' saved return addresses (SASS only).
            read = _without_return_saves(report, out)
            # Unread (no cuobjdump), ptxas's count stands for this call and is not kept: a later call may read it.
            keep = read is not None
            report = read or report
    if cache is not None and keep:
        try:
            cache.put(json.dumps(list(report)), _REPORT_FILE)
        except OSError as e:  # a read-only cache: the report is still right, only not kept
            log.debug("ptxas report not cached: %s", e)
    return report


_REPORT_FILE = "tripwire_ptxas_report.json"


# ptxas -v's lines naming the entry function and each function's properties (parse_ptxas and _has_callees).
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")


def _has_callees(ptxas_output: str) -> bool:
    """Whether ``ptxas -v`` reported a function besides the entry (a noinline callee)."""
    entry = _ENTRY.search(ptxas_output)
    return bool(set(_PROPERTIES.findall(ptxas_output)) - {entry.group(1) if entry else ""})


def _without_return_saves(report: PtxasReport, cubin: str) -> PtxasReport | None:
    """``report`` with its entry function's return-address saves (read from ``cubin``'s SASS) out of its spills;
    None where the SASS cannot be read (no cuobjdump): the caller keeps ptxas's count, the cautious reading."""
    try:
        sass = subprocess.run([tool_path("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        log.debug("no SASS to tell return-address saves from spills: %s", e)
        return None
    saved = min(return_address_saves(sass.stdout), report.spill_bytes)
    return report._replace(spill_bytes=report.spill_bytes - saved, return_save_bytes=saved)


_SASS = re.compile(r"/\*([0-9a-f]+)\*/\s+([^;]*?)\s*;")
_CALL = re.compile(r"CALL\.REL(?:\.NOINC)?\s+(?:`\()?0x([0-9a-f]+)")
_STL = re.compile(r"STL(\.64|\.128)?\s+\[R1(?:\+0x[0-9a-f]+)?\],\s*(R\d+)$")
_MOV_IMM = re.compile(r"(?:MOV|IMAD\.MOV\.U32)\s+(R\d+),\s*(?:RZ,\s*RZ,\s*)?0x([0-9a-f]+)$")
_BLOCK_END = re.compile(r"(?:@!?U?P\w+\s+)?(?:BRA|EXIT|RET)")


def return_address_saves(sass: str) -> int:
    """Bytes the entry function of one kernel's SASS (``cuobjdump -sass``) stores to its stack to save a call's
    return address: a ``STL [R1+k], Rn`` before a ``CALL.REL``, of a register that a ``MOV Rn, <address>`` set to
    the address of the instruction after that call. ptxas does that, and counts the store as a spill, where the
    callee needs every register the caller is allocated (its return-address register too); the callee loads it
    back before it returns. The entry function is the code before the first callee's (the lowest call target:
    Triton places the kernel first). Other stores to the stack are spills and are not counted here.

    ``sass``: ``cuobjdump -sass`` of a cubin of one kernel, as a kernel engineer reads it to tell what ptxas's
    spill count holds. 0 where the entry function makes no call.
    :func:`ptxas_report` takes the result out of the entry function's spills, never more than ptxas counted."""
    code = [(int(a, 16), text.strip()) for a, text in _SASS.findall(sass)]
    calls = [(i, int(m.group(1), 16)) for i, (_, t) in enumerate(code) if (m := _CALL.search(t))]
    if not calls:
        return 0
    end = min(target for _, target in calls)
    total = 0
    for i, _ in calls:
        if code[i][0] >= end or i + 1 >= len(code):
            continue
        ret = code[i + 1][0]
        # The save sits just before its call, in the call's own block: look back to the previous branch or call.
        for j in range(i - 1, max(-1, i - 9), -1):
            t = code[j][1]
            if _CALL.search(t) or _BLOCK_END.match(t):
                break
            st = _STL.match(t)
            if st is None:
                continue
            if any((mv := _MOV_IMM.match(code[k][1])) and mv.group(1) == st.group(2) and int(mv.group(2), 16) == ret
                   for k in range(max(0, j - 8), j)):  # fmt: skip
                total += {None: 4, ".64": 8, ".128": 16}[st.group(1)]
                break
    return total


def _report_cache(ptxas: str, options: tuple[str, ...], gpu: str, ptx: str) -> Any:
    """Triton's file cache for one ptxas report, or None where there is none (it cannot be made)."""
    try:
        from triton.runtime.cache import get_cache_manager

        st = os.stat(ptxas)
        # The prefix names how the report is read (the return-address saves taken out of the spills): a report
        # cached by another reading is not reused.
        ident = f"tripwire-ptxas-report-2|{ptxas}|{st.st_size}|{st.st_mtime_ns}|{' '.join(options)}|{gpu}\n{ptx}"
        return get_cache_manager(hashlib.sha256(ident.encode()).hexdigest())
    except (ImportError, OSError):
        return None


def parse_ptxas(text: str) -> PtxasReport:
    """``ptxas -v``'s report (what it writes to stderr) of one module with one entry function, parsed: the entry
    function's registers (``Used N registers``) and its own spill bytes (stores plus loads of its ``Function
    properties``), and the spill bytes of every other function listed (its noinline callees) summed, in whatever
    order ptxas lists them. For a kernel engineer's own ``ptxas -v`` output as much as for :func:`ptxas_report`,
    which runs ptxas and calls this.

    ``return_save_bytes`` is 0: the text cannot tell a call's saved return address from a spill (ptxas counts both
    as spill stores); :func:`ptxas_report` reads the SASS for that (:func:`return_address_saves`). One entry
    function: of a module with several, the first is read as the entry and the others' spills as its callees'.
    Raises RuntimeError, with the end of ``text``, where it names no entry function or no register count (a ptxas
    error's output)."""
    entry = _ENTRY.search(text)
    regs = re.search(r"Used (\d+) registers", text)
    if entry is None or regs is None:
        raise RuntimeError(f"ptxas reported no entry function: {text[-2000:]}")
    spills = {
        name: int(st) + int(ld)
        for name, st, ld in re.findall(
            r"Function properties for (\S+)\s*\n\s*\d+ bytes stack frame, (\d+) bytes spill stores, (\d+) bytes "
            r"spill loads",
            text,
        )
    }
    own = spills.pop(entry.group(1), 0)
    return PtxasReport(int(regs.group(1)), own, sum(spills.values()))


def _units(regs: int) -> int:
    return -(-regs // _REG_UNIT)


def _compiled_ptx(fn: Any, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    if _callee.recording():
        # Launches are being recorded (tripwire.resources): compile as the recorder does, for its target.
        compile = _callee.recorded_compile()
        if compile is None:
            raise RuntimeError("launches are being recorded with no compiler to find a register cap with")
        return str(compile(fn, args, kwargs).asm["ptx"])
    kernel = fn.warmup(*args, grid=grid, **kwargs)
    if hasattr(kernel, "result"):  # Triton's asynchronous compile mode hands back a future
        kernel = kernel.result()
    return str(kernel.asm["ptx"])


def register_cap(
    key: Any, fn: Any, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any], twin: dict[str, Any]
) -> int | None:
    """The ``maxnreg`` to launch ``fn[grid](*args, **kwargs)`` with, or None for none (see the module docstring).
    ``twin``: the keyword arguments that turn the launch into its twin (``{"GUARD": False}``). ``key`` names the
    launch's compiled variant (its constexprs, dtypes, specialisation, device), for the cache: the caller builds it
    from what it already has, so that a cached launch costs one dict lookup."""
    if key in _caps:
        return _caps[key]
    from ._callee import interpreting

    cap = None
    if not interpreting():
        try:
            cap = _search(fn, grid, args, kwargs, twin)
        except Exception as e:  # a cap is an optimisation: without one the launch is the compiler's own
            log.warning(
                "no register cap for %s (%s: %s); it launches with the compiler's own allocation",
                getattr(fn, "__name__", fn), type(e).__name__, str(e)[:300],
            )  # fmt: skip
    _caps[key] = cap
    return cap


def budget_choice(
    key: Any,
    fn: Any,
    grid: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    twin: dict[str, Any],
    options: Sequence[Mapping[str, Any]],
) -> Mapping[str, Any]:
    """The keyword arguments to add to ``fn[grid](*args, **kwargs)``: one of ``options`` (constexpr overrides, each
    a build of the same kernel that records the same, e.g. its fault paths' atomics called or inlined:
    ``tripwire.triton.record_hits``' ``CALLS``), plus ``maxnreg`` where that build is capped as
    :func:`register_cap` caps it. The option chosen is the first whose build, so capped, fits the twin's
    allocation (no more register units, its entry function spilling no more): the later options are compiled only
    when the earlier ones do not fit. Where none fits, the lowest of (spills more than the twin, register units),
    ties to the earlier: fewest units among the builds spilling no more, and among all where every one spills
    more. An option whose build fails to compile is logged (as register_cap logs a failed search) and left out;
    where every one fails, and where nothing is compiled (the interpreter), the first option, uncapped.

    ``key`` names the compiled variant (constexprs, dtypes, specialisation, device) and the call site, whose
    ``options`` and ``twin`` are fixed: they are not part of the cache's key. The mapping returned is the cached
    choice, read-only (a launch per call reads it; nothing is copied).

    Why compile both: which placement of a fault path costs a kernel less is the compiler's to say, not a rule. A
    nested call out of an out-of-line function adds the call's registers on one Triton and ptxas, inlining its
    atomics costs more on another (benchmarks/RESULTS.md, register rule). Cached per ``key``: the first launch of
    a compiled variant pays the compiles, later ones a dict lookup."""
    if not options:
        raise ValueError("budget_choice needs at least one option")
    found = _choices.get(key)
    if found is not None:
        return found
    from ._callee import interpreting

    choice = dict(options[0])
    if not interpreting():
        try:
            choice = _choose(fn, grid, args, kwargs, twin, options)
        except Exception as e:  # as register_cap: the choice is an optimisation, the records are the same
            _warn(fn, "its first option, uncapped", e)
    found = _choices[key] = MappingProxyType(choice)
    return found


def _warn(fn: Any, instead: str, e: Exception) -> None:
    log.warning(
        "no register budget choice for %s (%s: %s); it launches %s",
        getattr(fn, "__name__", fn), type(e).__name__, str(e)[:300], instead,
    )  # fmt: skip


def _choose(
    fn: Any,
    grid: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    twin: dict[str, Any],
    options: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    t = ptxas_report(_compiled_ptx(fn, grid, args, {**kwargs, **options[0], **twin}))
    best: tuple[tuple[bool, int], dict[str, Any]] | None = None
    failed: Exception | None = None
    for opt in options:
        try:
            cap, report = _search_against(fn, grid, args, {**kwargs, **opt}, t)
        except Exception as e:  # this build left out; the others may still be launched
            _warn(fn, f"without the build {opt}", e)
            failed = e
            continue
        score = (report.spill_bytes > t.spill_bytes, _units(report.regs))
        launch = {**opt, **({"maxnreg": cap} if cap is not None else {})}
        if score <= (False, _units(t.regs)):
            return launch  # within the twin's allocation: no later option can cost the clean path less
        if best is None or score < best[0]:
            best = (score, launch)
    if best is None:
        assert failed is not None
        raise failed
    return best[1]


def _search(fn: Any, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any], twin: dict[str, Any]) -> int | None:
    """The cap for the launch (None: none), its twin compiled with ``twin``."""
    return _search_against(fn, grid, args, kwargs, ptxas_report(_compiled_ptx(fn, grid, args, {**kwargs, **twin})))[0]


def _search_against(
    fn: Any, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any], t: PtxasReport
) -> tuple[int | None, PtxasReport]:
    """The cap for the launch against the twin's report ``t``, and the report of the build that runs (capped or
    not)."""
    g = ptxas_report(_compiled_ptx(fn, grid, args, kwargs))
    # Caps from the twin's allocation up, the lowest whose entry function spills no more than the twin's. Below the
    # guarded kernel's own allocation; up to it too where the uncapped build spills more than the twin: ptxas 13 at
    # Triton 3.9's --regAllocOptLevel=2 can spill in an uncapped build and not when capped at the same allocation.
    top = _units(g.regs) if g.spill_bytes > t.spill_bytes else _units(g.regs) - 1
    c = _units(t.regs) * _REG_UNIT
    while _units(c) <= top and c <= _MAX_REGS:
        capped = ptxas_report(_compiled_ptx(fn, grid, args, {**kwargs, "maxnreg": c}))
        if capped.spill_bytes <= t.spill_bytes and capped.regs <= c:
            return c, capped
        c += _REG_UNIT
    return None, g
