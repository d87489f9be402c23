"""The measurement lab: the research questions about tripwire's costs and behaviour (q1..q9, RESULTS.md's labels),
one module per question (:mod:`lab.questions` names them), their runner (:mod:`lab.run`), the record's Markdown
(:mod:`lab.results_md`) and plot (:mod:`lab.plot`), and the shared measurement helpers (:mod:`lab.common`).

It imports tripwire and nothing in tripwire imports it. The questions a user's own machine answers in a minute are
``tripwire bench``'s (:mod:`tripwire.cli.bench`); the lab runs those too, as part of its suite. From a checkout:

    PYTHONPATH=benchmarks python -m lab.run [--quick] [--only q3,q5] [--out DIR]
"""
