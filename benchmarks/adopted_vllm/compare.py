"""The guarded Triton copies against vLLM's own kernels, as installed, on clean input (every id in range, so the
guarded copy must write and return what vLLM's does): decode attention grouped (GQA) and not (MHA), and
reshape_and_cache_flash. Prints one JSON object: which vLLM was compared against (``source``) and per case whether
the outputs agree. Run with the python of an environment that has vLLM (tests/test_adopted_vllm.py runs it in CI's
vLLM environment, on the CPU under Triton's interpreter):

    TRITON_INTERPRET=1 python -m adopted_vllm.compare [--device cpu] [--control]

``--control`` gives the guarded side other input than vLLM's side (one page id, one slot): every case must then
disagree, which shows the comparison can fail. Exit 0 when every case is as asked, 1 otherwise, 2 without vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from . import NoVllm, load, original_source

Case = Callable[[str, bool], tuple[torch.Tensor, torch.Tensor]]


@contextmanager
def _capability(device: str) -> Iterator[None]:
    # vLLM's reshape launcher asks the device's capability; on the CPU (the interpreter) answer for an H100.
    if device != "cpu":
        yield
        return
    saved = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved  # type: ignore[assignment]


def _decode(kv_heads: int) -> Case:
    def run(device: str, control: bool) -> tuple[torch.Tensor, torch.Tensor]:
        B, Hq, D, P, PS, W, S = 3, 4, 32, 24, 4, 6, 3
        g = torch.Generator().manual_seed(kv_heads)
        q = torch.randn(B, Hq, D, generator=g).to(device)
        kb, vb = (torch.randn(P, PS, kv_heads, D, generator=g).to(device) for _ in range(2))
        table = torch.randperm(P, generator=g)[: B * W].reshape(B, W).to(torch.int32).to(device)
        lens = torch.tensor([23, 9, 14], dtype=torch.int32, device=device)
        from tripwire.kernels import counters

        outs = []
        for which in ("original", "guarded"):
            mod = load(which, "triton_decode_attention")
            t = table.clone()
            if control and which == "guarded":
                t[0, 0] = int(table[B - 1, W - 1])  # another page, in range: other keys and values for sequence 0
            o = torch.empty(B, Hq, D, device=device)
            lse = torch.empty(B, Hq, device=device)
            logits = torch.empty(B, Hq, S, D + 1, device=device)
            kw = {"ctr": counters(mod.SITES, device)} if which == "guarded" else {}
            mod.decode_attention_fwd(q, kb, vb, o, lse, t, lens, logits, S, D**-0.5, PS, **kw)
            outs.append(o)
        return outs[0], outs[1]

    return run


def _reshape(device: str, control: bool) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, D, NB, PS = 6, 4, 32, 4, 4
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(T, H, D, generator=g).to(device) for _ in range(2))
    slots = torch.tensor([0, 5, -1, 15, 3, 7], device=device)  # -1: padding, skipped by both
    one = torch.ones(1, device=device)
    outs = []
    for which in ("original", "guarded"):
        mod = load(which, "triton_reshape_and_cache_flash")
        s = slots.clone()
        if control and which == "guarded":
            s[1] = 6  # another free slot, in range
        kc = torch.zeros(NB, PS, H, D, device=device)
        vc = torch.zeros_like(kc)
        kw: dict[str, Any] = {}
        if which == "guarded":
            from tripwire.kernels import counters

            kw["ctr"] = counters((mod.SITE_SLOT,), device)
        with _capability(device):
            mod.triton_reshape_and_cache_flash(k, v, kc, vc, s, "auto", one, one, **kw)
        outs.append(torch.cat([kc.flatten(), vc.flatten()]))
    return outs[0], outs[1]


CASES: dict[str, Case] = {"decode_gqa": _decode(2), "decode_mha": _decode(4), "reshape_triton": _reshape}


def compare(device: str = "cpu", control: bool = False) -> dict[str, Any]:
    """``{"source": {module: original_source}, "cases": {name: {"agree": bool, "max_abs_diff": float}}}``. Decode
    agrees within a tolerance (the guarded softmax may be scheduled differently; on a GPU tl.dot runs in TF32),
    reshape_and_cache bit for bit."""
    tol = 1e-2 if device != "cpu" else 1e-5
    cases = {}
    for name, case in CASES.items():
        ref, got = case(device, control)
        if name.startswith("reshape"):
            agree = torch.equal(ref, got)
        else:
            agree = bool(torch.allclose(got, ref, rtol=tol, atol=tol))
        cases[name] = {"agree": agree, "max_abs_diff": float((got - ref).abs().max())}
    from . import MODULES

    return {"source": {m: original_source(m) for m in MODULES}, "control": control, "cases": cases}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--control", action="store_true", help="other input on the guarded side: every case must differ")
    args = p.parse_args(argv)
    try:
        res = compare(args.device, args.control)
    except NoVllm as e:
        print(f"adopted_vllm.compare: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res))
    want = not args.control
    return 0 if all(c["agree"] == want for c in res["cases"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
