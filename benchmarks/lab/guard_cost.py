"""q1 in the lab: ``tripwire bench``'s guard cost of the reference kernels (:mod:`tripwire.cli.bench.guard_cost`), with
the fused FP8 quantise-and-count kernel and the non-finite counter folded in from :mod:`lab.numerics` (its
``run(quick) -> dict``, through its own ``fold``, the one place that knows its result's shape; its ``--merge`` uses it
too). Its figures are medians over its own repeats.

Target: within 1 % for the reference kernels (5 % for the fused FP8 counter).
"""

from __future__ import annotations

from tripwire.cli.bench import guard_cost as reference

from . import numerics
from .common import Ctx, Result


def run(ctx: Ctx) -> dict:
    rec = reference.run(ctx)
    if rec["status"] != "ok" or not ctx.cuda:
        return rec
    res = Result(rec["id"], rec["title"], ctx)
    res.figures, res.targets, res.notes = rec["figures"], rec["targets"], rec["notes"]
    try:
        out = numerics.run(ctx.quick)
    except Exception as e:
        res.note(f"numerics.run failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    else:
        numerics.fold(res, out)
    return res.to_dict()
