"""tripwire.resources and ``tripwire resources``: the occupancy arithmetic, a Triton kernel compiled for sm_90 on
the CPU beside its twin (and the control that the comparison can say "costs"), a CUDA binary read with cuobjdump
(where nvcc exists): vLLM's reshape_and_cache_flash, its guarded copy (same registers) and the vote control
(more registers, one block fewer per SM)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tripwire import resources as rs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "regs,smem,warps,programs,limit",
    [(96, 0, 4, 5, "regs"), (40, 0, 16, 3, "regs"), (41, 0, 16, 2, "regs"), (8, 0, 4, 16, "threads"),
     (16, 100_000, 4, 2, "smem"), (8, 0, 1, 32, "blocks")],
)  # fmt: skip
def test_programs_per_sm(regs, smem, warps, programs, limit):
    assert rs.programs_per_sm(regs, smem, warps) == (programs, limit)


def test_compare_is_the_register_rule():
    def u(regs, progs, spills=0):  # type: ignore[no-untyped-def]
        return rs.Usage("k", regs, spills, 0, 0, 4, progs, "regs")

    rows = rs.compare([u(40, 6), u(41, 6), u(40, 5), u(32, 6, 8)], [u(32, 6)] * 4)
    assert [ok for *_, ok in rows] == [True, False, False, False]
    assert "COSTS" in rs.format_table(rows)
    with pytest.raises(ValueError, match="pair them"):
        rs.compare([u(1, 1)], [])


KERNELS = """
import torch
import triton
import triton.language as tl
from tripwire.triton import record_hit, record_hits


@triton.jit
def _gather(ctr_ptr, ids_ptr, src_ptr, out_ptr, n, hi, GUARD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    i = tl.load(ids_ptr + offs, mask=m, other=0)
    if GUARD:
        ok = m & (i >= 0) & (i < hi)
        tl.store(out_ptr + offs, tl.load(src_ptr + i, mask=ok, other=0.0), mask=m)
        bad = m & (ok == 0)
        if tl.sum(bad.to(tl.int32), axis=None) > 0:
            record_hits(ctr_ptr, bad, offs, i)
    else:
        tl.store(out_ptr + offs, tl.load(src_ptr + i, mask=m, other=0.0), mask=m)


def _launch(guard):
    ids = torch.zeros(4096, dtype=torch.int32)
    _gather[(4,)](torch.zeros(8, dtype=torch.int64), ids, torch.zeros(100), torch.zeros(4096), 4096, 100,
                  GUARD=guard, BLOCK=1024, num_warps=4)


def guarded():
    _launch(True)


def twin():
    _launch(False)
"""


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "tripwire", "resources", *args], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip


def test_cli_triton_guarded_beside_twin(tmp_path):
    """A block-guarded gather beside its twin: the table, one row per kernel, and the inlined control."""
    f = tmp_path / "kernels.py"
    f.write_text(KERNELS)
    p = _cli("--guarded", f"{f}:guarded", "--twin", f"{f}:twin", "--inline-control")
    if "ptxas" in p.stderr and "Error" in p.stderr and "CompilationError" not in p.stderr:
        pytest.skip(f"cannot compile for sm_90 here: {p.stderr[-300:]}")
    assert "_gather" in p.stdout and "programs/SM" in p.stdout and "inlined" in p.stdout, p.stdout + p.stderr
    assert p.returncode in (0, 1)
    row = next(line for line in p.stdout.splitlines() if line.startswith("_gather"))
    assert row.endswith("ok") == (p.returncode == 0)


def test_cli_refuses_a_bad_spec():
    p = _cli("--guarded", "no_colon_here")
    assert p.returncode != 0 and "MODULE:FUNCTION" in p.stderr


def test_cuda_adopted_reshape_same_registers_vote_control_more(adopted_cuda_usage):
    """cuda_usage reads a real CUDA build (the guarded copy of vLLM's kernel, the conftest fixture): the guarded copy
    has the same registers and programs per SM at both test placements, and where a GPU vLLM is installed, vLLM's
    own build's; the vote control (every thread through guard_index, going on after it) needs more and fits one
    block fewer."""
    found = adopted_cuda_usage
    g, v = found["guarded_first"], found["vote"]
    refs = [found["guarded_late"]] + ([found["original"]] if "original" in found else [])
    for r in refs:
        assert (g.regs, g.programs_per_sm) == (r.regs, r.programs_per_sm), found
    assert v.regs > g.regs and v.programs_per_sm < g.programs_per_sm, found


def _spec_probe(x_ptr, T, N, M):  # the kernel whose signature is built: never compiled, never run
    pass


class _Handed(Exception):
    """Raised by the stand-in of ``triton.compile``: what the tools handed to Triton, nothing compiled."""


def _handed_to_triton(monkeypatch, launch):  # type: ignore[no-untyped-def]
    """(signature, constants, attributes) of the ``ASTSource`` that :func:`tripwire.resources.triton_usage` hands to
    Triton's public ``triton.compile`` for ``launch`` (stopped there: nothing is compiled)."""
    import triton

    def compile(src, **kwargs):  # type: ignore[no-untyped-def]
        raise _Handed(src.signature, src.constants, src.attrs)

    with monkeypatch.context() as mp:
        mp.setattr(triton, "compile", compile)
        with pytest.raises(_Handed) as e:
            rs.triton_usage(launch)
    return e.value.args


def test_signature_specialises_tuple_elements_as_triton_does(monkeypatch):
    """A tuple passed to a parameter that is ``do_not_specialize`` / ``do_not_specialize_on_alignment`` has its
    elements specialised anyway: Triton applies its defaults to each element (a 1 becomes a constant, a multiple of
    16 and a 16-byte aligned address are compiled as such), and the tools' signature must be the launch's, checked
    against Triton's own ``specialize_impl``. The control: the same flags on a parameter that is not a tuple
    (``M``) do apply, on both sides."""
    import torch
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction

    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    fn = JITFunction(_spec_probe, do_not_specialize=["N", "M"], do_not_specialize_on_alignment=["T"])
    buf = torch.zeros(8, dtype=torch.int64)
    tensors, sizes = (buf[:4], buf[1:5]), (1, 32, 7)
    sig, consts, attrs = _handed_to_triton(monkeypatch, rs.Launch(fn, (buf, tensors, sizes, 32), {}))
    assert sig == {"x_ptr": "*i64", "T": ("*i64", "*i64"), "N": ("constexpr", "i32", "i32"), "M": "i32"}
    assert consts == {(2, 0): 1}
    assert set(attrs) == {(0,), (1, 0), (2, 1)}
    # Triton's own: (types, keys), a key "D" where it compiles 16-divisibility, the value where it is a constant.
    assert native(BaseBackend, tensors, False, False, False) == (("*i64", "*i64"), ("D", ""))
    assert native(BaseBackend, sizes, False, False, False) == (("constexpr", "i32", "i32"), (1, "D", ""))
    assert native(BaseBackend, 32, False, False, False) == ("i32", None)
