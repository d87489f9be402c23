"""``tripwire bench``'s checks, named once: each one's label (RESULTS.md's, the JSON record's keys and ``--only``'s),
the module under :mod:`tripwire.cli.bench` that measures it, and whether it needs a GPU; and the questions that moved
to the measurement lab (the repository's ``benchmarks/lab``), which ``--only`` refuses with where to run them. The
runner runs the checks in this order; each check's module takes its label from here (:func:`label`)."""

from __future__ import annotations

# (id, module, needs a GPU). Without a GPU every check runs on the CPU (Triton kernels interpreted) except q2's
# busy-stream part, which a CPU arena replaces.
QUESTIONS: list[tuple[str, str, bool]] = [
    ("q4", "detection", False),
    ("q2", "tick_latency", False),
    ("validator", "validator", False),
    ("q1", "guard_cost", False),
]

# The lab's questions, by label: what each measures.
LAB_QUESTIONS: dict[str, str] = {
    "q3": "step_loop",
    "q5": "tick_scaling",
    "q6": "idle",
    "q7": "capture_safety",
    "q8": "versus_tools",
    "q9": "soak",
}

# Where the lab runs from, for the refusals that name it.
LAB_COMMAND = "PYTHONPATH=benchmarks python -m lab.run (a checkout of the repository; benchmarks/lab)"


def label(module: str) -> str:
    """The label of the check ``module`` measures (its dotted or its short name); KeyError for a module that
    measures none."""
    short = module.rsplit(".", 1)[-1]
    for qid, mod, _ in QUESTIONS:
        if mod == short:
            return qid
    raise KeyError(f"{module!r} measures no benchmark check")


def selection(only: str) -> tuple[set[str], set[str], set[str]]:
    """``--only``'s text (ids or module names) as (the check ids it selects, the lab's questions it names, the names
    nothing knows)."""
    by_module = {mod: q for q, mod, _ in QUESTIONS} | {mod: q for q, mod in LAB_QUESTIONS.items()}
    ids = {q for q, _, _ in QUESTIONS}
    names = {n.strip() for n in only.split(",") if n.strip()}
    chosen = {by_module.get(n, n) for n in names}
    lab = chosen & set(LAB_QUESTIONS)
    return chosen & ids, lab, chosen - ids - lab
