"""tripwire.integrations.vllm._numerics on vLLM's own engine (its CPU build, V1 runner; the GPU engine's V1 and V2
run in scripts/gpu_vllm.py on the device): a NaN or an Inf in one request's last hidden state at a chosen step
(tripwire.testing.vllm_faults ``nan``: the row its logits come from) is a fault of that request alone.

* ``contain``: the victim ends with vLLM's error finish reason in that step, with exactly the clean run's tokens
  before it; every other request is token-identical to the clean run; the engine goes on; an event names the site
  ``vllm.logits_nonfinite`` and the victim's vLLM request id; the victim's prompt served again afterwards gives the
  clean run's tokens (the prefix-cache check). The first step (the prefill's token) and the last are included.
* Control, no plugin: vLLM returns the victim as a success (finish reason ``length``), its token of the faulted step
  sampled from NaN logits.
* ``flag``: the same tokens as the control (counted, not repaired), one count per faulted row.
* ``TRIPWIRE_VLLM_LOGITS=0`` under contain: the check is off, and the victim is returned as in the control.
"""

from __future__ import annotations

import pytest

from tripwire.integrations import vllm as tw_vllm
from vllm_helpers import EnginePool, by_marker, fault, prompt, same, vllm_python

pytestmark = pytest.mark.slow

ROUNDS = [[prompt(r, i) for i in range(4)] for r in range(3)]
# Round 3: round 1's victim's prompt again, beside round 0's others (the prefix-cache check).
AGAIN = [prompt(1, 1), prompt(0, 0), prompt(0, 2), prompt(0, 3)]
CONFIG = {"rounds": [*ROUNDS, AGAIN], "prefix_caching": True}
FAULTS = [
    fault(1, 1, "nan", 0, "nan"),  # the prefill's token
    fault(2, 0, "nan", 7, "inf"),
    fault(2, 3, "nan", 15, "nan"),  # the last of 16
]
RUNS = {
    "clean": {"config": CONFIG},
    "contain": {"config": CONFIG, "mode": "contain", "faults": FAULTS},
    "control": {"config": CONFIG, "faults": FAULTS},
    "flag": {"config": CONFIG, "mode": "flag", "faults": FAULTS},
    "off": {"config": CONFIG, "mode": "contain", "faults": FAULTS, "env": {"TRIPWIRE_VLLM_LOGITS": "0"}},
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    vllm_python()
    pool = EnginePool(tmp_path_factory.mktemp("vllm_numerics"), RUNS)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def clean(engines):
    run = engines.get("clean")
    assert run.rc == 0, run.stderr[-3000:]
    return run.rounds()


def victims(rnd: int) -> dict[int, dict]:
    return {f["marker"]: f for f in FAULTS if (f["marker"] - 410) // 10 == rnd}


def test_contain_fails_only_the_victim(engines, clean):
    run = engines.get("contain")
    assert run.rc == 0, run.stderr[-3000:]
    assert "logits_nonfinite" in run.stderr  # the plugin's line names the site
    out = run.rounds()
    assert len(out) == len(CONFIG["rounds"])  # the engine went on after every fault
    for r in range(len(out)):
        got, ref = by_marker(out[r]), by_marker(clean[r])
        faulted = victims(r) if r < len(ROUNDS) else {}
        for m, req in got.items():
            if m in faulted:
                assert req["finish_reason"] == "error", (r, req)
                assert req["tokens"] == ref[m]["tokens"][: faulted[m]["step"]], (r, req)
            else:
                assert same(req) == same(ref[m]), (r, m)
    injected = {e["marker"]: e for e in run.injected}
    assert set(injected) == {f["marker"] for f in FAULTS}
    for m, e in injected.items():
        named = [ev for ev in run.events if any(o["request"] == e["request"] for o in ev["offenders"])]
        assert {ev["site"] for ev in named} == {tw_vllm.SITE_LOGITS}, (m, named)
        assert all(ev["kind"] == "nonfinite_rows" for ev in named)
    assert run.totals() == {tw_vllm.SITE_LOGITS: len(FAULTS)}


def test_without_the_check_the_victim_is_a_success(engines, clean):
    """The control: no plugin, and the plugin with its logits check off. vLLM hands the victim back as a success;
    its token of the faulted step is not the clean run's (sampled from NaN/Inf logits)."""
    for name in ("control", "off"):
        run = engines.get(name)
        assert run.rc == 0, run.stderr[-3000:]
        out = run.rounds()
        for r in range(len(ROUNDS)):
            got, ref = by_marker(out[r]), by_marker(clean[r])
            for m, f in victims(r).items():
                req, step = got[m], f["step"]
                assert req["finish_reason"] == "length" and len(req["tokens"]) == 16, (name, req)
                assert req["tokens"][:step] == ref[m]["tokens"][:step]
                assert req["tokens"][step] != ref[m]["tokens"][step], (name, req, ref[m])
        assert run.totals() == {}, name


def test_flag_counts_and_changes_nothing(engines):
    run, control = engines.get("flag"), engines.get("control")
    assert run.rc == 0, run.stderr[-3000:]
    assert [[same(r) for r in rnd] for rnd in run.rounds()] == [[same(r) for r in rnd] for rnd in control.rounds()]
    assert run.totals() == {tw_vllm.SITE_LOGITS: len(FAULTS)}
