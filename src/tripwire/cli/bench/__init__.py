"""The benchmark harness behind ``tripwire bench`` (:mod:`.run`): one module per question (:mod:`.questions` names
them), their shared measurement helpers (:mod:`.common`), the record's Markdown (:mod:`.results_md`) and plot
(:mod:`.plot`). It ships in the package, so an installed tripwire benchmarks itself; the repository's
``benchmarks/`` holds the further measurements run by hand (and imports :mod:`.common`)."""
