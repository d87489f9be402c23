"""The statistics of q3 (``step_loop.py``): how a reader's cost on a step loop is estimated and judged.

Two estimators, both pure functions of recorded step times and tick spans (so ``tests/cli/test_bench.py`` checks them on
synthetic loops with planted costs and controls):

* run means: :func:`median_and_se` (the median of per-round paired overheads and its robust standard error) and
  :func:`judge`, which refuses a pass when the noise floor (two identical no-reader arms) exceeds the target;
* attribution: :func:`attribute` (the steps each tick touched against the same ticks moved half an interval either
  way), :func:`virtual_spans` (the null: ticks that did not happen), :func:`attributed_pct` (pooled, with a per-run
  standard error), :func:`split_run` (long runs cut into short-run units) and :func:`judge_attributed` (the mark).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from math import inf

import numpy as np

# The reader interval the attribution is made for (its control windows sit half of it away from each tick).
ATTR_INTERVAL_S = 0.05
# A tick's steps start with the one running this long before its traced start: the reader takes the GIL a little
# before (the return from its wait).
ATTR_MARGIN_S = 0.0005
# Steps charged to each tick (see attribute()): the one it lands in and the three after it, which together last longer
# than the validation control's GIL hold (step_loop.HEAVY_HOLD_S) at the bench's step time.
ATTR_STEPS = 4

Run = tuple[list[float], list[float], list[tuple[float, float]]]  # step starts, step durations, tick spans


def attribute(
    starts: list[float],
    durs: list[float],
    spans: list[tuple[float, float]],
    shift: float,
    margin: float,
    *,
    sides: tuple[int, ...] = (-1, 1),
    need_all_sides: bool = False,
) -> tuple[float, float, int]:
    """Time attributed to ticks: ``(time of the steps the ticks touched, the same for the control windows, ticks
    used)``, in seconds.

    A tick touches ATTR_STEPS steps: the one running ``margin`` before the tick's traced start (the reader takes
    the GIL a little before it: the return from its wait) and the ones after it, which hold whatever the tick cost
    the engine (waiting for the GIL, its own wake-up after the hand-off). A FIXED number of steps, not the steps
    overlapping a time window: a delayed step covers more of a window and pushes its neighbours out of it, which
    hides most of a cost. The control is the same tick moved ``shift`` (half an interval: between ticks, untouched by
    them) BOTH ways, averaged: steps selected in exactly the same way at a phase the reader does not act on, so the
    same selection bias (the step running at a random time is likelier to be a long one) and the same host phase,
    and, being symmetric, no bias from a trend in step time over the run (one side alone reads a steady speed-up as
    a cost). Near a run's ends only one side fits; that side alone is used, so the ticks there still count (dropping
    them understates a cost on short runs) and their one-sided biases cancel between the two ends.
    ``tests/cli/test_bench.py`` re-creates each of these failure modes as a control. The difference is the ticks' cost with the noise of a few steps per tick: the estimator that can resolve
    0.1 % where run means cannot. It sees only a cost local in time to the ticks; a spread-out cost is the run
    means' to bound. ``sides`` and ``need_all_sides`` exist for the tests' controls."""
    if not starts:
        return 0.0, 0.0, 0
    if shift <= margin:
        raise ValueError(f"the control shift ({shift} s) must exceed the margin ({margin} s)")
    s_arr = np.asarray(starts)
    d_arr = np.asarray(durs)

    def steps_at(t: float) -> float | None:
        i = int(np.searchsorted(s_arr, t - margin, side="right")) - 1
        if i < 0 or i + ATTR_STEPS > len(s_arr):  # before the first step, or too near the last
            return None
        return float(d_arr[i : i + ATTR_STEPS].sum())

    real = control = 0.0
    used = 0
    for a, _ in spans:
        touched = steps_at(a)
        if touched is None:
            continue
        ctrl = [c for c in (steps_at(a + side * shift) for side in sides) if c is not None]
        if not ctrl or (need_all_sides and len(ctrl) < len(sides)):
            continue
        used += 1
        real += touched
        control += sum(ctrl) / len(ctrl)
    return real, control, used


def virtual_spans(starts: list[float], durs: list[float], width: float, seed: int) -> list[tuple[float, float]]:
    """Ticks that did not happen: every ATTR_INTERVAL_S from a random phase, ``width`` long (no-reader runs' null)."""
    if not starts:
        return []
    t = starts[0] + random.Random(seed).uniform(0, ATTR_INTERVAL_S)
    end = starts[-1] + durs[-1]
    out = []
    while t + width < end:
        out.append((t, t + width))
        t += ATTR_INTERVAL_S
    return out


def attributed_pct(runs: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Pooled attributed overhead (%) over ``(real, control, total)`` runs, and its standard error (per-run spread)."""
    total = sum(r[2] for r in runs)
    if not runs or total <= 0:
        return float("nan"), float("inf")
    pooled = sum(r[0] - r[1] for r in runs) / total * 100
    per_run = [(r[0] - r[1]) / r[2] * 100 for r in runs]
    se = statistics.stdev(per_run) / len(per_run) ** 0.5 if len(per_run) > 1 else float("inf")
    return pooled, se


def split_run(run: Run, size: int) -> list[Run]:
    """A long run cut into consecutive pieces of ``size`` steps (the last absorbs the remainder), each with the
    ticks that start inside it: units like the short runs, so that the per-run standard error of the pooled
    attribution stays right when one run is a hundred times longer than the others."""
    starts, durs, spans = run
    if len(starts) < 2 * size:
        return [run]
    cuts = list(range(0, len(starts) - size + 1, size))
    out: list[Run] = []
    for k, lo in enumerate(cuts):
        hi = cuts[k + 1] if k + 1 < len(cuts) else len(starts)
        t_lo, t_hi = starts[lo], (starts[hi] if hi < len(starts) else inf)
        out.append((starts[lo:hi], durs[lo:hi], [sp for sp in spans if t_lo <= sp[0] < t_hi]))
    return out


@dataclass(frozen=True)
class Verdict:
    """A mark (True: PASS, False: SHORT, None: n/a), the floor it was judged against (%) and why."""

    passed: bool | None
    floor: float
    why: str


def judge_attributed(
    attr: tuple[float, float],
    null: tuple[float, float],
    heavy: tuple[float, float],
    heavy_direct: tuple[float, float],
    direct: tuple[bool | None, str],
    target_pct: float = 0.1,
    control: str = "the validation control",
) -> Verdict:
    """The mark for tripwire at 50 ms from the attribution (each argument a (value %, standard error) pair).

    Evidence only when: the attribution's floor (the null's offset, twice its SE and twice the reader's SE) is under
    the target; the attribution is validated, i.e. it sees the control's cost (``heavy``) above that floor and
    agrees with the run means' figure for it (``heavy_direct``) within two combined standard errors (so it captures
    what the run means measure); and the run means themselves (``direct``: :func:`judge`'s verdict) do not show a
    cost above their own floor, which a cost spread out in time, invisible to the attribution, would. Then the mark
    is the upper (pass) or lower (short) two-SE bound against the target, n/a in between. Limits: a pass certifies
    the cost local to the ticks; a cost spread out in time is bounded only by the run means' floor (the run's
    ``noise_floor_pct`` figure), and the agreement test is as wide as the run means' standard error on the control.
    ``control`` names the validation control in the verdict's words."""
    value, se = attr
    floor = max(abs(null[0]), 2 * null[1], 2 * se)
    h, h_se = heavy
    hd, hd_se = heavy_direct
    agree = abs(h - hd) <= 2 * (h_se**2 + hd_se**2) ** 0.5
    if not (h > floor and agree):
        return Verdict(
            None,
            floor,
            f"attribution not validated: {control} shows {h:.3f} +- "
            f"{h_se:.3f} % attributed vs {hd:.3f} +- {hd_se:.3f} % in the run means (floor {floor:.3f} %)",
        )
    checked = (
        f"attributed {value:.3f} +- {se:.3f} % (floor {floor:.3f} %, null {null[0]:.3f} %), validated by the control: "
        f"{h:.3f} % attributed vs {hd:.3f} % in the run means"
    )
    if direct[0] is False:
        return Verdict(False, floor, f"{checked}; but the run means show more: {direct[1]}")
    if floor > target_pct:
        return Verdict(None, floor, f"{checked}; the attribution's floor is above the {target_pct} % target")
    if value + 2 * se <= target_pct:
        return Verdict(True, floor, checked)
    if value - 2 * se > target_pct:
        return Verdict(False, floor, checked)
    return Verdict(None, floor, f"{checked}; undecided: the two-SE interval straddles the {target_pct} % target")


def median_and_se(xs: list[float]) -> tuple[float, float]:
    """The median and its robust standard error (1.253 x 1.4826 x MAD / sqrt(n): the normal-theory SE of a median,
    with the spread from the median absolute deviation so that a few phase-change rounds do not inflate it)."""
    med = statistics.median(xs)
    if len(xs) < 2:
        return med, float("inf")
    mad = statistics.median([abs(x - med) for x in xs])
    return med, 1.253 * 1.4826 * mad / len(xs) ** 0.5


def judge(overhead_pct: float, floor_pct: float, target_pct: float = 0.1) -> tuple[bool | None, str]:
    """The mark for an overhead figure, judged against the noise floor too: when two identical no-reader runs
    differ by more than the target, a figure under the target is luck, not evidence, so the mark is n/a (None)
    unless the overhead clearly exceeds the floor (then it is short)."""
    if floor_pct <= target_pct:
        if overhead_pct <= target_pct:
            return True, ""
        return False, f"overhead above target with a noise floor of {floor_pct:.3f} %"
    if overhead_pct > floor_pct:
        return False, f"overhead {overhead_pct:.3f} % exceeds even the noise floor ({floor_pct:.3f} %)"
    return None, (
        f"not resolvable here: the noise floor (two no-reader runs) is {floor_pct:.3f} %, above the "
        f"{target_pct} % target"
    )
