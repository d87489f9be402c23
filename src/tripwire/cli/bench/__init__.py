"""``tripwire bench`` (:mod:`.run`): a self-check of this machine, one module per check (:mod:`.questions` names
them), with the record and statistics they share (:mod:`.common`). The research harness (the step loop, sweeps, the
soak, the other tools) is the measurement lab in the repository's ``benchmarks/lab``, outside the package."""
