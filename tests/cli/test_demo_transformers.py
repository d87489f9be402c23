"""``tripwire demo --engine transformers``: the engine demo's story holds end to end (the real engine on the CPU)."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from tripwire import GuardTripped
from tripwire.cli import main
from tripwire.cli.demo_transformers import quiet_engine_logs


def test_engine_demo_passes_every_scenario():
    # As a user runs it, in a process of its own: the demo's logging set-up is what shows, not pytest's capture.
    p = subprocess.run(
        [sys.executable, "-m", "tripwire", "demo", "--engine", "transformers", "--tokens", "12"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out, err = p.stdout, p.stderr
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    # The expected stop is the engine's one error line, not its traceback; a repeated engine complaint shows once.
    assert "Traceback" not in err and "Error in generation loop: tripwire: MASKED FAULT" in err, err[-3000:]
    assert all(err.count(line) == 1 for line in err.splitlines() if "psutil" in line), err[-3000:]
    if importlib.util.find_spec("psutil") is not None:  # the dev extra has it: the engine has nothing to complain of
        assert "psutil" not in err, err[-3000:]
    # tripwire's lines name tripwire once, through the logger (the demo's format shows it): a contained request's
    # line, and the stop's one short line.
    assert "tripwire: tripwire" not in err, err[-3000:]
    contained = [ln for ln in err.splitlines() if "contained a masked fault in request" in ln]
    assert len(contained) == 2 and all(ln.startswith("WARNING tripwire: contained a masked") for ln in contained)
    stops = [ln for ln in err.splitlines() if "stop ARMED" in ln]
    assert len(stops) == 1 and stops[0].startswith("ERROR tripwire: stop ARMED: site 'transformers.write_index'")
    assert len(stops[0]) <= 200 and "Lifetime extremes" not in stops[0], stops[0]
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


def _emit(logger: logging.Logger, exc: BaseException) -> None:
    try:
        raise exc
    except BaseException as e:
        logger.exception(f"Error in generation loop: {e}")  # what the engine logs


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _restoring(undo, logger: logging.Logger, level: int):
    def run() -> None:
        undo()
        logger.setLevel(level)  # setLevel, not the attribute: it also clears the logger's enabled-for cache

    return run


def test_the_demo_filter_drops_only_an_expected_stops_traceback_and_repeats(monkeypatch):
    engine = logging.getLogger("ContinuousBatchingLogger")
    got = Records()
    monkeypatch.setattr(engine, "handlers", [got])  # only ours (the engine's own holds the stderr of its import)
    monkeypatch.setattr(engine, "propagate", False)
    # Other test modules quiet this logger (CRITICAL); this test needs its errors through.
    level = engine.level
    engine.setLevel(logging.DEBUG)
    monkeypatch.setattr(engine, "level", logging.DEBUG)
    monkeypatch.undo = _restoring(monkeypatch.undo, engine, level)  # type: ignore[method-assign]
    with quiet_engine_logs():
        _emit(engine, GuardTripped("tripwire: MASKED FAULT at a test's site", site="s", device="cpu", count=1))
        _emit(engine, RuntimeError("a real engine bug"))  # the control: a real error keeps its traceback
        for _ in range(5):
            engine.error("Cannot get memory breakdown on CPU without psutil: please install psutil.")
    stop, real = got.records[0], got.records[1]
    assert stop.exc_info is None and "MASKED FAULT" in stop.getMessage()
    assert real.exc_info is not None and isinstance(real.exc_info[1], RuntimeError)
    assert sum("psutil" in r.getMessage() for r in got.records) == 1
    # Outside the demo nothing is filtered.
    got.records.clear()
    for _ in range(2):
        engine.error("Cannot get memory breakdown on CPU without psutil: please install psutil.")
    _emit(engine, GuardTripped("tripwire: a stop", site="s", device="cpu", count=1))
    assert len(got.records) == 3 and got.records[2].exc_info is not None
