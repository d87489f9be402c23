"""The benchmark questions, named once: each one's label (RESULTS.md's, the JSON records' keys and ``--only``'s),
the module under :mod:`tripwire.cli.bench` that measures it, and whether it needs a GPU. The runner runs them in
this order; each question's module takes its label from here (:func:`label`)."""

from __future__ import annotations

# (id, module, needs a GPU). The ids are the questions' labels: RESULTS.md's, the JSON records' keys and --only's; the
# modules are named for what they measure. Order: cheap and central first; the soak and the sanitizer last.
QUESTIONS: list[tuple[str, str, bool]] = [
    ("q2", "tick_latency", True),
    ("q5", "tick_scaling", False),
    ("q6", "idle", False),
    ("q4", "detection", False),
    ("q3", "step_loop", False),
    ("q1", "guard_cost", True),
    ("q7", "capture_safety", True),
    ("q9", "soak", True),
    ("q8", "versus_tools", True),  # last: compute-sanitizer's run time is the least predictable
]


def label(module: str) -> str:
    """The label of the question ``module`` measures (its dotted or its short name); KeyError for a module that
    measures none."""
    short = module.rsplit(".", 1)[-1]
    for qid, mod, _ in QUESTIONS:
        if mod == short:
            return qid
    raise KeyError(f"{module!r} measures no benchmark question")


def selection(only: str) -> tuple[set[str], set[str]]:
    """``--only``'s text as (the question ids it selects, the names it does not know): ids or module names."""
    by_module = {mod: q for q, mod, _ in QUESTIONS}
    ids = {q for q, _, _ in QUESTIONS}
    names = {n.strip() for n in only.split(",") if n.strip()}
    chosen = {by_module.get(n, n) for n in names}
    return chosen & ids, chosen - ids
