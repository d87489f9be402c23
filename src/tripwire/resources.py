"""What a kernel occupies on the GPU, beside its unguarded twin: registers, spills, stack, shared memory and
programs per SM, known before anything is measured.

A guard whose fault path raises a kernel's registers or shared memory can cost a clean launch its occupancy, taken
or not (registers are allocated for the hungriest path). So before timing a guarded kernel, compare its resources
with its twin's:

* Triton kernels: :func:`capture_launches` runs a callable (a launcher called with CPU tensors, as an engine would
  call it) and records each ``kernel[grid](...)`` launch instead of running it; :func:`triton_usage` compiles a
  recorded launch ahead of time for a GPU target (default sm_90, an H100/H200) with the ptxas that ships inside
  Triton. No GPU is needed.
* CUDA extensions: :func:`cuda_usage` reads a built extension (``.so``) or cubin with ``cuobjdump -res-usage``.
* :func:`compare` pairs guarded and twin usages; :func:`format_table` prints them. ``tripwire resources`` is the
  command for both (``tripwire resources --help``).

Limits: occupancy is computed for sm_90 (64K registers per SM allocated per warp in units of 8 per thread, 228 KiB
of shared memory with 1 KiB reserved per block, 2048 threads, 32 blocks); other targets compile, but their
``programs_per_sm`` uses the same table. Triton launches are specialised like a real launch for the usual cases
(16-byte aligned pointers and multiples of 16, integers equal to 1 as constants); a kernel that is autotuned must be
given one config (call the kernel the autotuner wraps). The process must not run Triton's interpreter
(``TRITON_INTERPRET=1`` replaces the compiler): the command clears it for itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = [
    "Launch",
    "Usage",
    "capture_launches",
    "compare",
    "fault_path",
    "cuda_usage",
    "format_table",
    "programs_per_sm",
    "triton_usage",
]

# sm_90 (H100/H200) per-SM limits.
_REGS_PER_SM = 65536
_REG_UNIT = 8  # registers per thread are allocated in units of 8 (256 per warp)
_SMEM_PER_SM = 233472  # 228 KiB
_SMEM_RESERVED = 1024  # per block
_THREADS_PER_SM = 2048
_BLOCKS_PER_SM = 32


@dataclasses.dataclass(frozen=True)
class Usage:
    """One compiled kernel's resources. ``spill_bytes``: ptxas's spill stores plus loads per thread of the entry
    function, less its calls' saved return addresses (None where it was not reported: a cuobjdump read);
    ``stack``: bytes of stack frame per thread; ``smem``: static plus Triton's dynamic shared memory per block;
    ``limit``: what bounds ``programs_per_sm`` ("regs", "smem", "threads", "blocks")."""

    kernel: str
    regs: int
    spill_bytes: int | None
    stack: int
    smem: int
    warps: int
    programs_per_sm: int
    limit: str

    @property
    def reg_units(self) -> int:
        """Registers per thread in allocation units (what occupancy sees)."""
        return -(-self.regs // _REG_UNIT)


def programs_per_sm(regs: int, smem: int, warps: int) -> tuple[int, str]:
    """``(programs, limit)``: how many blocks of ``warps`` warps using ``regs`` registers per thread and ``smem``
    bytes of shared memory fit on one sm_90 SM, and which resource bounds it."""
    threads = warps * 32
    per_block_regs = threads * (-(-max(regs, 1) // _REG_UNIT) * _REG_UNIT)
    bounds = {
        "regs": _REGS_PER_SM // per_block_regs,
        "smem": _SMEM_PER_SM // (smem + _SMEM_RESERVED),
        "threads": _THREADS_PER_SM // threads,
        "blocks": _BLOCKS_PER_SM,
    }
    limit = min(bounds, key=lambda k: bounds[k])
    return bounds[limit], limit


# ------------------------------------------------------------------------------------------------------ Triton
@dataclasses.dataclass
class Launch:
    """One recorded ``kernel[grid](*args, **kwargs)``: the JITFunction and what it was called with."""

    fn: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.fn.__name__)


@contextlib.contextmanager
def _recording(out: list[Launch]) -> Iterator[None]:
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("capture_launches needs Triton's compiler: unset TRITON_INTERPRET for this process")
    saved = JITFunction.run

    def record(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> None:
        out.append(Launch(self, args, kwargs))

    from .triton._callee import recorded_launches

    JITFunction.run = record  # type: ignore[method-assign]
    try:
        # The reference launchers take CPU tensors then (nothing is launched); one that compiles before it launches
        # (a register cap: tripwire.triton._budget) compiles as the tools here do, for sm_90.
        with recorded_launches(lambda fn, args, kwargs: _compile(Launch(fn, args, kwargs))):
            yield
    finally:
        JITFunction.run = saved  # type: ignore[method-assign]


def capture_launches(fn: Callable[[], object]) -> list[Launch]:
    """Run ``fn()`` with every Triton launch recorded instead of run (nothing executes on any device; pass CPU
    tensors of the real shapes and dtypes). Returns the launches in order."""
    out: list[Launch] = []
    with _recording(out):
        fn()
    return out


_DTYPES = {
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
    "bool": "i1",
    "float16": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float64": "fp64",
    "float8_e4m3fn": "fp8e4nv",
    "float8_e5m2": "fp8e5",
}


def _annotated(p: Any) -> str:
    """The type a parameter's annotation fixes (``x: tl.int64`` -> ``"i64"``), or ""."""
    return str(getattr(p, "annotation_type", "") or "")


def _signature(launch: Launch) -> tuple[dict[str, Any], dict[tuple[int, ...], Any], dict[tuple[int, ...], Any]]:
    fn = launch.fn
    sig: dict[str, Any] = {}
    consts: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for i, p in enumerate(fn.params):
        if i < len(launch.args):
            v = launch.args[i]
        elif p.name in launch.kwargs:
            v = launch.kwargs[p.name]
        else:
            v = p.default
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            consts[(i,)] = v
            continue
        spec = not getattr(p, "do_not_specialize", False)
        align = spec and not getattr(p, "do_not_specialize_on_alignment", False)
        sig[p.name] = _arg_type(launch, p, v, (i,), spec, align, consts, attrs)
    return sig, consts, attrs


def _arg_type(launch: Launch, p: Any, v: Any, path: tuple[int, ...], spec: bool, align: bool, consts: dict,
              attrs: dict) -> Any:  # fmt: skip
    """The signature entry of one (possibly tuple) argument, filling in its constants and attributes by path.

    ``spec`` and ``align`` are the parameter's ``do_not_specialize`` and ``do_not_specialize_on_alignment``
    negated; they apply to the parameter itself, not to the elements of a tuple passed to it: Triton specialises
    each element with its defaults (a 1 is a constant, a multiple of 16 and a 16-byte aligned address are compiled
    as such; its ``specialize_impl`` on a tuple, 3.6 to 3.9), so the elements are typed here that way too, or the
    tools would compile a kernel the launch never runs."""
    import torch

    if isinstance(v, tuple):
        return tuple(_arg_type(launch, p, x, (*path, j), True, True, consts, attrs) for j, x in enumerate(v))
    if v is None:
        consts[path] = None
        return "constexpr"
    if isinstance(v, torch.Tensor):
        if align and v.data_ptr() % 16 == 0:
            attrs[path] = [["tt.divisibility", 16]]
        return "*" + _DTYPES[str(v.dtype).removeprefix("torch.")]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        if _annotated(p) and len(path) == 1:
            typ = _annotated(p)  # `x: tl.int64`: that type, whatever the value
        elif spec and v == 1:
            consts[path] = 1
            return "constexpr"
        else:
            typ = "i32" if -(2**31) <= v < 2**31 else "i64"
        if spec and v % 16 == 0:
            attrs[path] = [["tt.divisibility", 16]]
        return typ
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"{launch.name}: argument {p.name!r} of type {type(v).__name__} is not supported")


def _tool(name: str) -> str:
    from .triton._budget import tool_path

    return tool_path(name)


def _res_usage(binary: str) -> dict[str, dict[str, int]]:
    """cuobjdump -res-usage of a cubin, fatbinary or shared library: ``{function: {REG, STACK, SHARED, LOCAL}}``."""
    out = subprocess.run([_tool("cuobjdump"), "-res-usage", binary], capture_output=True, text=True, check=True)
    res: dict[str, dict[str, int]] = {}
    name = None
    for line in out.stdout.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        if name is not None and "REG:" in line:
            res[name] = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}
            name = None
    return res


def _spills(ptx: str, arch: int) -> int | None:
    """Spill stores plus loads per thread of the kernel's entry function in ``ptx``, from ``ptxas -v`` (its
    out-of-line callees' spills are on their own paths, not counted, nor are its calls' saved return addresses:
    :func:`tripwire.triton.ptxas_report`; None if ptxas says nothing)."""
    from .triton._budget import ptxas_report

    try:
        return ptxas_report(ptx).spill_bytes
    except RuntimeError:
        return None


def _compile(launch: Launch, *, arch: int = 90) -> Any:
    """``launch`` compiled for ``sm_<arch>`` (no GPU needed): Triton's compiled kernel, its ``asm`` stages with it.
    A kernel that does not compile raises Triton's CompilationError."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, consts, attrs = _signature(launch)
    opts = {k: launch.kwargs[k] for k in ("num_warps", "num_stages", "num_ctas", "maxnreg") if k in launch.kwargs}
    return triton.compile(
        ASTSource(launch.fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", arch, 32), options=opts
    )


def triton_usage(launch: Launch, *, arch: int = 90) -> Usage:
    """Compile ``launch`` for ``sm_<arch>`` (no GPU needed) and read back what it occupies. A kernel that does not
    compile raises Triton's CompilationError."""
    compiled = _compile(launch, arch=arch)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        res = _res_usage(f.name)
    finally:
        os.unlink(f.name)
    name = compiled.metadata.name
    r = res.get(name) or next(iter(res.values()))
    warps = int(compiled.metadata.num_warps)
    # Triton's shared memory is dynamic (in the metadata); the cubin's static SHARED is the target's reservation.
    smem = int(compiled.metadata.shared)
    progs, limit = programs_per_sm(r["REG"], smem, warps)
    spills = _spills(compiled.asm["ptx"], arch)
    return Usage(launch.name, r["REG"], spills, r.get("STACK", 0), smem, warps, progs, limit)


# The helpers' out-of-line functions (tripwire.triton): what fault_path("inline") compiles inline.
_COLD = (
    "_record_words",
    "_offender_block",
    "_offenders_done",
    "_record_one",
    "_tile_first",
    "_tile_record",
    "_tile_next",
    "_tile_first_ool",
    "_tile_record_ool",
    "_tile_next_ool",
)


@contextlib.contextmanager
def fault_path(mode: str) -> Iterator[None]:
    """Compile (inside the block) kernels that use tripwire's Triton helpers with their fault path changed:

    * ``"stub"``: reduced to the count (one atomic add: no extremes, no first pair, no offenders). The twin of a
      kernel that has no ``GUARD`` switch of its own (the numeric counters, the validator): the same checks and
      vote, without the fault path.
    * ``"inline"``: inlined into the caller instead of called: the control that shows what the out-of-line fault
      path saves.

    For tests and tools, never for kernels that run: compiles inside the block go to a private cache and always
    recompile (a kernel's cache key does not see the helpers swapped), the launchers' register caps
    (tripwire.triton._budget) and their choices are found again for the swapped helpers, and all three are restored
    after it.
    """
    import triton
    import triton.language as tl

    from . import triton as tt
    from .triton import _budget

    if mode == "stub":
        # The count alone (one atomic): the vote and the data it reads stay live, as in a kernel that counts and
        # keeps nothing else; a stub doing nothing would let the compiler drop the checks with it.
        @triton.jit
        def _fault(ctr_ptr, n, b, r, v, qb, CALLS: tl.constexpr = True):  # type: ignore[no-untyped-def]
            tl.atomic_add(ctr_ptr, n)

        @triton.jit
        def _record_one(ctr_ptr, r, v, qb):  # type: ignore[no-untyped-def]
            tl.atomic_add(ctr_ptr, 1)

        @triton.jit
        def _fault_tiles(ctr_ptr, TILE: tl.constexpr, C: tl.constexpr, args, tiles, KEEPS_SMEM: tl.constexpr):  # type: ignore[no-untyped-def]
            for t in range(0, tiles):
                bad, _rows, _values, _reqs = TILE(C, args, t)
                tl.atomic_add(ctr_ptr, tl.sum(bad.to(tl.int64), axis=None))

        swap = {"_fault": _fault, "_record_one": _record_one, "_fault_tiles": _fault_tiles}
    elif mode == "inline":
        swap = {name: triton.jit(getattr(tt, name).fn) for name in _COLD}
    else:
        raise ValueError(f"fault_path mode must be 'stub' or 'inline', got {mode!r}")
    saved = {name: getattr(tt, name) for name in swap}
    caps, choices = dict(_budget._caps), dict(_budget._choices)
    _budget._caps.clear()
    _budget._choices.clear()
    env = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TRITON_ALWAYS_COMPILE")}
    with tempfile.TemporaryDirectory(prefix="tripwire-fault-path-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        os.environ["TRITON_ALWAYS_COMPILE"] = "1"
        for name, fn in swap.items():
            setattr(tt, name, fn)
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(tt, name, fn)
            _budget._caps.clear()
            _budget._caps.update(caps)
            _budget._choices.clear()
            _budget._choices.update(choices)
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


# ------------------------------------------------------------------------------------------------------ CUDA
def cuda_usage(binary: str, *, block_threads: int | dict[str, int] = 256, match: str | None = None) -> list[Usage]:
    """The kernels of a built CUDA extension (``.so``), fatbinary or cubin (``cuobjdump -res-usage``), one Usage
    per function whose (mangled) name matches the regex ``match``. ``block_threads``: the launch's threads per
    block (one number, or per function name substring), which occupancy needs and a binary does not hold; shared
    memory is the static part only (a launch's dynamic shared memory is not in the binary). ``spill_bytes`` is
    None (cuobjdump does not report spills; ``LOCAL`` bytes show as ``stack``)."""
    out = []
    for name, r in _res_usage(binary).items():
        if match is not None and not re.search(match, name):
            continue
        if isinstance(block_threads, dict):
            threads = next((t for k, t in block_threads.items() if k in name), 256)
        else:
            threads = block_threads
        warps = -(-threads // 32)
        progs, limit = programs_per_sm(r["REG"], r.get("SHARED", 0), warps)
        stack = max(r.get("STACK", 0), r.get("LOCAL", 0))
        out.append(Usage(name, r["REG"], None, stack, r.get("SHARED", 0), warps, progs, limit))
    return out


# ------------------------------------------------------------------------------------------------------ both
def compare(guarded: Sequence[Usage], twin: Sequence[Usage]) -> list[tuple[Usage, Usage, bool]]:
    """Pair guarded and twin usages in order, each with whether the guard is free by the register rule: within one
    allocation unit of the twin's registers, no more spills in the entry function (a call's saved return address
    is not one: :func:`tripwire.triton.return_address_saves`), and as many programs per SM. The stack is not
    compared: an out-of-line fault path's call frame is stack the clean path never touches."""
    if len(guarded) != len(twin):
        raise ValueError(f"{len(guarded)} guarded kernels against {len(twin)} twins: pair them one to one")
    rows = []
    for g, t in zip(guarded, twin, strict=True):
        free = (
            g.reg_units <= t.reg_units + 1
            and (g.spill_bytes or 0) <= (t.spill_bytes or 0)
            and g.programs_per_sm >= t.programs_per_sm
        )
        rows.append((g, t, free))
    return rows


def format_table(rows: Sequence[tuple[Usage, Usage, bool]]) -> str:
    """The comparison as a plain-text table (what ``tripwire resources`` prints)."""
    head = f"{'kernel':40s} {'regs':>9s} {'spills':>9s} {'stack':>9s} {'smem':>13s} {'programs/SM':>13s}  verdict"
    lines = [head, "-" * len(head)]
    for g, t, free in rows:

        def pair(a: object, b: object) -> str:
            return f"{a}/{b}"

        lines.append(
            f"{g.kernel[:40]:40s} {pair(g.regs, t.regs):>9s} {pair(g.spill_bytes, t.spill_bytes):>9s} "
            f"{pair(g.stack, t.stack):>9s} {pair(g.smem, t.smem):>13s} "
            f"{pair(g.programs_per_sm, t.programs_per_sm):>9s} ({g.limit})  "
            + ("ok" if free else "COSTS OCCUPANCY OR SPILLS")
        )
    lines.append("(guarded/twin; sm_90 occupancy; 'ok' = within one 8-register unit, no more spills, same programs)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ command
def _load_callable(spec: str) -> Callable[[], object]:
    """``module:function`` or ``path/to/file.py:function``: a zero-argument callable that launches the kernels."""
    import importlib
    import importlib.util

    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"{spec!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    if target.endswith(".py"):
        modname = "_tripwire_resources_" + os.path.basename(target)[:-3]
        loader = importlib.util.spec_from_file_location(modname, target)
        if loader is None or loader.loader is None:
            raise ValueError(f"cannot load {target}")
        mod = importlib.util.module_from_spec(loader)
        import sys

        sys.modules[modname] = mod  # @triton.jit reads its function's source through the module
        loader.loader.exec_module(mod)
    else:
        mod = importlib.import_module(target)
    fn = getattr(mod, name)
    if not callable(fn):
        raise TypeError(f"{spec!r} is not callable")
    return fn  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    """``tripwire resources``: see ``--help``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="tripwire resources",
        description="Registers, spills, shared memory and programs per SM of guarded kernels beside their twins, "
        "before measuring anything. Triton: each of --guarded/--twin is MODULE:FUNCTION or FILE.py:FUNCTION, a "
        "zero-argument callable that launches the kernels with CPU tensors of the real shapes (compiled for the "
        "target on this machine; no GPU). CUDA: --cuda LIB.so [--cuda-twin LIB2.so] (cuobjdump).",
    )
    p.add_argument("--guarded", help="Triton: the callable launching the guarded kernels")
    p.add_argument("--twin", help="Triton: the callable launching their unguarded twins (same order)")
    p.add_argument("--inline-control", action="store_true", help="Triton: also the guarded kernels, fault path inlined")
    p.add_argument("--arch", type=int, default=90, help="compute capability to compile for (default 90)")
    p.add_argument("--cuda", help="CUDA: a built extension (.so), fatbinary or cubin")
    p.add_argument("--cuda-twin", help="CUDA: the twins' binary (default: --cuda, with --match-twin)")
    p.add_argument("--match", default=None, help="CUDA: regex on the guarded kernels' (mangled) names")
    p.add_argument("--match-twin", default=None, help="CUDA: regex on the twins' names")
    p.add_argument("--threads", type=int, default=256, help="CUDA: threads per block of the launches (default 256)")
    a = p.parse_args(argv)
    if a.cuda:
        g = cuda_usage(a.cuda, block_threads=a.threads, match=a.match)
        if a.cuda_twin or a.match_twin:
            t = cuda_usage(a.cuda_twin or a.cuda, block_threads=a.threads, match=a.match_twin)
            print(format_table(compare(g, t)))
            return 0 if all(ok for *_, ok in compare(g, t)) else 1
        for u in g:
            print(f"{u.kernel}: {u.regs} registers, stack {u.stack} B, shared {u.smem} B, {u.programs_per_sm} "
                  f"programs/SM of {u.warps} warps ({u.limit})")  # fmt: skip
        return 0
    if not a.guarded:
        p.error("give --guarded (Triton) or --cuda")
    os.environ.pop("TRITON_INTERPRET", None)
    guarded = [triton_usage(x, arch=a.arch) for x in capture_launches(_load_callable(a.guarded))]
    if a.twin is None:
        for u in guarded:
            print(f"{u.kernel}: {u.regs} registers, {u.spill_bytes} B spilled, shared {u.smem} B, "
                  f"{u.programs_per_sm} programs/SM of {u.warps} warps ({u.limit})")  # fmt: skip
        return 0
    twin = [triton_usage(x, arch=a.arch) for x in capture_launches(_load_callable(a.twin))]
    rows = compare(guarded, twin)
    print(format_table(rows))
    if a.inline_control:
        with fault_path("inline"):
            inline = [triton_usage(x, arch=a.arch) for x in capture_launches(_load_callable(a.guarded))]
        print("\nwith the fault path inlined (the control):")
        print(format_table(compare(inline, twin)))
    return 0 if all(ok for *_, ok in rows) else 1
