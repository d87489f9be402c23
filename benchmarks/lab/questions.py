"""The lab's questions, named once: each one's label (RESULTS.md's, the JSON records' keys and ``--only``'s), the
module that measures it (the lab's, or ``tripwire bench``'s for the checks it shares with a user's machine), and
whether it needs a GPU. The runner runs them in this order; each question's module takes its label from here
(:func:`label`)."""

from __future__ import annotations

# (id, module, needs a GPU). Order: cheap and central first; the soak and the sanitizer last.
QUESTIONS: list[tuple[str, str, bool]] = [
    ("q2", "tripwire.cli.bench.tick_latency", True),
    ("q5", "lab.tick_scaling", False),
    ("q6", "lab.idle", False),
    ("q4", "tripwire.cli.bench.detection", False),
    ("q3", "lab.step_loop", False),
    ("q1", "lab.guard_cost", True),
    ("validator", "tripwire.cli.bench.validator", True),
    ("q7", "lab.capture_safety", True),
    ("q9", "lab.soak", True),
    ("q8", "lab.versus_tools", True),  # last: compute-sanitizer's run time is the least predictable
]


def label(module: str) -> str:
    """The label of the question ``module`` measures (its dotted or its short name); KeyError for a module that
    measures none."""
    short = module.rsplit(".", 1)[-1]
    for qid, mod, _ in QUESTIONS:
        if mod.rsplit(".", 1)[-1] == short:
            return qid
    raise KeyError(f"{module!r} measures no benchmark question")


def selection(only: str) -> tuple[set[str], set[str]]:
    """``--only``'s text as (the question ids it selects, the names it does not know): ids or module names."""
    by_module = {mod.rsplit(".", 1)[-1]: q for q, mod, _ in QUESTIONS}
    ids = {q for q, _, _ in QUESTIONS}
    names = {n.strip() for n in only.split(",") if n.strip()}
    chosen = {by_module.get(n, n) for n in names}
    return chosen & ids, chosen - ids
