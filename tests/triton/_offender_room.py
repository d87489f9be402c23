"""Run by tests/triton/test_triton.py on the GPU, in a process of its own: the block helpers' fault path while
several programs claim offender entries at once, each launch on a fresh arena (an empty offender block, so the
claims run and the block fills during the launch). Prints one JSON line: {"runs", "wrong", "examples"}.

argv: "fixed" (tripwire.triton as shipped) or "racy" (the control: ``_room`` swapped for a plain scalar load of
the last key, each thread its own read, before anything compiles: the Triton cache is the test's own), then
"nonfinite" (record_hits, through count_nonfinite) or "slot_mapping" (record_tiles, at a bandwidth launch), then
the number of launches."""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

import tripwire.triton as tt
from tripwire import Monitor, SiteRegistry
from tripwire.layout import OFF_ENTRY, OFF_HEADER

_H = tl.constexpr(OFF_HEADER)
_E = tl.constexpr(OFF_ENTRY)


@triton.jit
def _racy_room(addr):
    blk = addr.to(tl.pointer_type(tl.int64))
    k = tl.load(blk + 1)
    return (k > 0) & (tl.load(blk + _H + (k - 1) * _E) == 0)


def nonfinite(m: Monitor) -> tuple[int, int]:
    from tripwire.numerics import count_nonfinite, register_nonfinite_site

    site = register_nonfinite_site("logits", monitor=m)
    count_nonfinite(LOGITS, site, monitor=m)
    return int(m.read_rows("cuda")[site.id][0]), int((~torch.isfinite(LOGITS)).sum())


def slot_mapping(m: Monitor) -> tuple[int, int]:
    from tripwire.kernels import counters
    from tripwire.kernels import slot_mapping as sm

    ctr = counters(sm.SITES, "cuda", m)
    sm.slot_mapping(POS, ROWS, TABLE, torch.empty_like(POS), 16, num_kv_blocks=4096, ctr=ctr)
    return int(ctr[0, 0]), int((ROWS >= TABLE.shape[0]).sum())


if __name__ == "__main__":
    variant, case, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if variant == "racy":
        tt._room = _racy_room
    g = torch.Generator(device="cuda").manual_seed(0)
    # One bad element per 256 (one per lane tile at 8 warps), over the first programs of the launch: every tile
    # records, and the programs claim the block's entries together while it fills.
    LOGITS = torch.randn(64, 152064, device="cuda", generator=g).to(torch.bfloat16)
    LOGITS.view(-1)[152064 + 17 : 152064 + 17 + 3 * 8192 : 256] = float("nan")
    T = 1 << 17
    POS = torch.randint(0, 64 * 16, (T,), device="cuda", generator=g)
    ROWS = torch.randint(0, 256, (T,), device="cuda", generator=g)
    ROWS[: 8 * 1024 : 256] = 256  # a row outside the table, one token per tile over the first eight programs
    TABLE = torch.randint(0, 4096, (256, 64), device="cuda", generator=g, dtype=torch.int32)
    fn = {"nonfinite": nonfinite, "slot_mapping": slot_mapping}[case]
    wrong, examples = 0, []
    for _ in range(runs):
        got, want = fn(Monitor(registry=SiteRegistry(capacity=16), capacity=16))
        if got != want:
            wrong += 1
            examples.append([got, want])
    print(json.dumps({"runs": runs, "wrong": wrong, "examples": examples[:4]}))
