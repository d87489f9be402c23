"""The out-of-line fault path keeps the caller's shared memory (tripwire.triton, CALLEE_SMEM_SAFE).

Before Triton 3.9 a noinline function's shared memory starts at the kernel's offset 0 instead of the offset the
caller reserved for the call (triton-lang/triton#11267), so a callee that uses shared memory overwrites what its
caller keeps there across the call: a dot operand, a pipelined load's buffer. The helpers' out-of-line functions
must then use none. Two proofs, each with the control that re-creates the hazard (``_callee_smem.py``: a noinline
function using Triton's own compare-and-swap, whose result is handed to the other threads through shared memory):

* built for sm_90 on the CPU (no GPU needed): every out-of-line function either touches no shared memory or is
  handed its shared-memory base by its caller; the control's function breaks that exactly where Triton does not
  hand one over;
* on the GPU: a dot whose operands are in shared memory across a recorded hit gives the torch result; the control
  corrupts it exactly where Triton does not hand the base over.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tripwire.layout import decode
from tripwire.triton import CALLEE_SMEM_SAFE

HERE = Path(__file__).parent

_PROBE = f"""
import json, re, sys
sys.path.insert(0, {str(HERE)!r})
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.errors import CompilationError
from _callee_smem import dot_across_a_record as k

TYPES = {{"a_ptr": "*fp16", "b_ptr": "*fp16", "out_ptr": "*fp32", "ctr_ptr": "*i64", "flag_ptr": "*i32", "n": "i32"}}
try:
    out = {{}}
    for control in (False, True):
        sig = {{a: TYPES.get(a, "constexpr") for a in k.arg_names}}
        src = ASTSource(k, sig, constexprs={{(k.arg_names.index("CONTROL"),): control}})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
        out[str(control)] = ptx
except CompilationError:
    raise  # a kernel that does not compile is a failure, never a skip
except Exception as e:
    if type(e).__name__ == "PTXASError":
        raise  # ptxas ran and refused the PTX (the claims' inline assembly): a failure, never a skip
    out = {{"error": f"{{type(e).__name__}}: {{str(e)[:300]}}"}}
print(json.dumps(out))
"""

# Every kernel the library ships (the register rule's cases): whether it keeps a shared-memory buffer of its own
# (a local allocation or an asynchronous copy, live across its code) and which of its called functions touch
# shared memory.
_KERNELS_PROBE = f"""
import json, re, sys
sys.path.insert(0, {str(HERE.parent)!r})
from triton.compiler.errors import CompilationError
import _register_rule_probe as P
rs = P.rs
try:
    out = {{}}
    cases = dict(P.shipped(True))
    cases.update(P.instruments())
    for case, fn in cases.items():
        for launch in rs.capture_launches(fn):
            c = rs._compile(launch)  # as tripwire.resources.triton_usage compiles it
            ttgir = c.asm["ttgir"]
            buffers = "ttg.local_alloc" in ttgir or "async_copy" in ttgir
            out[case + "/" + launch.name] = {{"buffers": buffers, "ptx": c.asm["ptx"]}}
except CompilationError:
    raise
except Exception as e:
    if type(e).__name__ == "PTXASError":
        raise
    out = {{"error": f"{{type(e).__name__}}: {{str(e)[:300]}}"}}
print(json.dumps(out))
"""


def _callees(ptx: str) -> dict[str, bool]:
    """Each ``.func`` defined in ``ptx``: whether it touches shared memory."""
    out = {}
    for m in re.finditer(
        r"^\.func\s+(?:\([^)]*\)\s*)?(\S+?)\([^)]*\)[^\n]*\n(?:\s*//[^\n]*\n)*\{(.*?)^\}", ptx, re.M | re.S
    ):
        name, body = m.group(1), m.group(2)
        out[name.split("_$_")[-1].split("__")[0]] = re.search(r"\b(st|ld|atom|red)\.shared", body) is not None
    return out


def test_out_of_line_functions_keep_the_callers_shared_memory(build_probe):
    """Before Triton 3.9, no out-of-line function of the helpers touches shared memory. From 3.9 on, Triton hands a
    callee the offset its call reserved (LLVM may fold it to the kernel's base where every call is at offset 0, so
    the PTX alone cannot tell a safe callee from an unsafe one there): the helpers keep Triton's own atomics and
    reductions, and this build checks only that they compile and the control."""
    r = build_probe(_PROBE)
    helpers, control = _callees(r["False"]), _callees(r["True"])
    assert {"_record_one", "_record_words", "_offender_block", "_offenders_done"} <= set(helpers), helpers
    if not CALLEE_SMEM_SAFE:
        assert not any(helpers.values()), f"out-of-line functions using shared memory at the kernel's 0: {helpers}"
    # The control: Triton's own compare-and-swap in a noinline function uses shared memory, so the check can fail.
    assert control == {"_cas_callee": True}, control


def test_no_shipped_kernel_keeps_shared_memory_across_a_call_that_uses_it(build_probe):
    """Every kernel the library ships, built for sm_90: before Triton 3.9, none that keeps a shared-memory buffer
    of its own (decode attention's dot operands and pipelined loads) calls a function that touches shared memory;
    the kernels whose own noinline functions do (the non-finite counter's re-read, the validator's fault paths)
    keep no buffer across them, only the scratch of single operations. The control: decode attention is seen to
    keep buffers, and the non-finite counter's and the validator's callees are seen to touch shared memory."""
    r = build_probe(_KERNELS_PROBE)
    seen = {name: (k["buffers"], sorted(n for n, t in _callees(k["ptx"]).items() if t)) for name, k in r.items()}
    assert seen["decode_attention/_decode_split"][0], seen
    assert seen["nonfinite/_nonfinite_kernel"][1] and seen["validator/_validate"][1], seen
    if not CALLEE_SMEM_SAFE:
        exposed = {name: callees for name, (buffers, callees) in seen.items() if buffers and callees}
        assert not exposed, f"kernels keeping shared memory across a callee that uses it: {exposed}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)")
def test_gpu_a_recorded_hit_leaves_the_dot_operands_alone():
    import sys

    sys.path.insert(0, str(HERE))
    from _callee_smem import dot_across_a_record

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=g).half().cuda() for _ in range(2))
    n = 3
    ref = n * (a.float() @ b.float())
    results = {}
    for control in (False, True):
        ctr = torch.zeros(8, dtype=torch.int64, device="cuda")
        out = torch.empty(16, 16, device="cuda")
        flag = torch.tensor([7], dtype=torch.int32, device="cuda")
        dot_across_a_record[(1,)](a, b, out, ctr, flag, n, CONTROL=control, num_warps=4)
        torch.cuda.synchronize()
        assert int(ctr[0]) == 1, ctr  # the hit was recorded (the branch with the call ran)
        if not control:
            # The first pair, claimed by the first-pair claim (PTX before Triton 3.9). The offender walk needs an
            # arena row: decode attention's GPU tests (offenders with their requests) run it.
            assert (decode(int(ctr[4])), decode(int(ctr[5]))) == (7, 7), ctr
        results[control] = (out - ref).abs().max().item()
    assert results[False] < 1e-2, results
    # The control corrupts the operands exactly where Triton does not hand the callee its base.
    assert (results[True] > 1e-2) == (not CALLEE_SMEM_SAFE), results
