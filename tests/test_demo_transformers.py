"""``tripwire demo --engine transformers``: the engine demo's story holds end to end (the real engine on the CPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tripwire.cli import main


def test_engine_demo_passes_every_scenario(capsys):
    assert main(["demo", "--engine", "transformers", "--tokens", "12"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0] + " " + line.split()[1]: line for line in out.splitlines() if line.endswith("PASS")}
    assert set(rows) == {
        "clean, installed",
        "read fault",
        "write fault",
        "clean after",
        "contained read",
        "contained write",
    }
    assert "stopped by tripwire" in rows["write fault"]
    # The contained read is in the step of the last token (12): the victim fails anyway, in that step.
    assert "at step 12" in rows["contained read"] and "1 request failed" in rows["contained read"]
    assert "transformers.write_index" in rows["contained write"]
    assert "1 request failed" in rows["contained write"]
    assert "transformers.read_index" in rows["read fault"] and "transformers.write_index" in rows["write fault"]
    assert "FAIL" not in out


def test_engine_demo_refuses_an_unknown_engine(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--engine", "sglang"])
