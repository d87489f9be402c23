"""`tripwire demo` end to end (a subprocess, as a user runs it), its fault parsing and its progress bar.

The default run must show: WARNING lines naming the sites of the injected faults, the fatal rope site stopping the
loop at the next check, the last step's hit reported by the final drain, and a summary table. The control: with
mode off nothing is reported (no reader), yet the summary's snapshot shows the kernels still counted.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tripwire.cli import demo


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if "cuda" in args:
        env.pop("TRITON_INTERPRET", None)  # compiled kernels on the GPU
    else:
        env.setdefault("TRITON_INTERPRET", "1")
    for k in list(env):
        if k.startswith("TRIPWIRE_"):
            del env[k]
    return subprocess.run(
        [sys.executable, "-m", "tripwire", "demo", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


def _injected(out: str) -> list[tuple[int, str]]:
    """The summary's "faults injected" lines: (step, kind) as the demo parsed its --faults."""
    return [(int(ln.split()[1]), ln.split()[2]) for ln in out.splitlines() if ln.startswith("    step ")]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if os.environ.get("TRITON_INTERPRET") != "1" else []))
def test_demo_default_run(device):
    p = _run("--steps", "12", "--device", device)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout
    err, out = p.stderr, p.stdout
    # warnings name the exact sites and entries of the injected faults
    for site in (
        "kernels.paged_gather.page",
        "kernels.block_table.row",
        "kernels.block_table.count",
        "kernels.rope.position",
    ):
        assert f"MASKED FAULT at site '{site}'" in err, site
    assert "First offender: row" in err
    # the fatal rope site stops the loop at a later check (warn mode), and the demo says why a warn run stops
    assert "mode warn (hits are reported and the loop goes on; a FATAL site's hit still stops it)" in err
    assert "raised GuardTripped: site 'kernels.rope.position'" in err
    fatal = "a FATAL site (its masked write reached durable state) stops the loop in every mode, warn included"
    assert f"the loop STOPS here: {fatal}." in err
    stopped = next(ln for ln in out.splitlines() if "stopped at step" in ln)
    assert "by 'kernels.rope.position'" in stopped and stopped.endswith(fatal)
    # the stop's ERROR line is one short line (the WARNING before it holds the numbers), and no line names tripwire
    # twice
    stops = [ln for ln in err.splitlines() if "stop ARMED" in ln]
    assert len(stops) == 1 and len(stops[0]) <= 200, stops
    # the device as the arena names it: an index always (cuda:0), where the command line said "cuda"
    named = "cuda:0" if device == "cuda" else device
    assert stops[0].startswith(
        f"ERROR tripwire: stop ARMED: site 'kernels.rope.position' on {named} (FATAL: stops in every mode), first "
        f"offender row "
    )
    assert "tripwire: tripwire" not in err
    # the last step's hit is reported by the final drain, after the loop
    after_loop = err.split(">>> loop done", 1)[1]
    assert "MASKED FAULT at site 'kernels.kv_zero.block'" in after_loop
    kv_line = next(line for line in out.splitlines() if line.strip().startswith("kernels.kv_zero.block"))
    assert kv_line.rstrip().endswith("drain")
    assert "tripwire demo summary" in out
    assert "every injected fault that ran (5) was masked and counted" in out
    # The default --faults of a 12-step run as parsed: one of each kind spread over the run, 'last' on its last step.
    assert _injected(out) == [(2, "block"), (4, "row"), (6, "count"), (7, "rope"), (11, "last")]
    # The summary's columns hold every site's name, the longest included (decode attention's).
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.strip().startswith("site ") and "hits" in ln)
    hits_end = lines[head].index("hits") + len("hits")
    rows = [ln for ln in lines[head + 2 :] if ln.strip().startswith("kernels.")]
    assert any("decode_attention.seq_len" in r for r in rows) and len(rows) >= 10
    for r in rows:
        assert r[hits_end - 1].isdigit() and r[hits_end : hits_end + 1] in ("", " "), (lines[head], r)


def test_demo_control_mode_off_reports_nothing():
    p = _run("--steps", "6", "--mode", "off", "--faults", "block@1")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "MASKED FAULT" not in p.stderr  # off: no reader, nothing reported
    assert _injected(p.stdout) == [(1, "block")]
    line = next(ln for ln in p.stdout.splitlines() if ln.strip().startswith("kernels.paged_gather.page"))
    assert " 1  (" in line and "not read (mode off)" in line  # but the kernel still masked and counted


def test_demo_clean_run_reports_nothing():
    p = _run("--steps", "3", "--faults", "none")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "MASKED FAULT" not in p.stderr
    assert "every injected fault that ran (0)" in p.stdout
    assert _injected(p.stdout) == []  # 'none' parses to no fault


@pytest.mark.parametrize(
    "args, err",
    [
        (["--faults", "bogus@1"], "unknown fault 'bogus' in --faults; known: "),
        (["--steps", "10", "--faults", "row@10"], r"fault 'row@10': step must be in [0, 10)"),
        (["--faults", "block@2,row"], "fault 'row': expected KIND@STEP with an integer step"),
        (["--faults", "last@3"], "the 'last' fault takes no step"),
    ],
)
def test_bad_faults_exit_2_before_any_work(capsys, args, err):
    """The --faults parse errors, through the CLI as a user types them: argparse's status 2 and the message, before
    the demo touches a device (nothing on stdout, no monitor line on stderr)."""
    from tripwire.cli import main

    with pytest.raises(SystemExit) as e:
        main(["demo", *args])
    assert e.value.code == 2
    out, stderr = capsys.readouterr()
    assert out == ""
    assert stderr.splitlines()[-1].startswith("tripwire demo: error: ") and err in stderr, stderr


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--faults", "bogus@1"])
    assert e.value.code == 2
    assert "unknown fault" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--steps", "0"])


def test_progress_bar_lines_when_not_a_tty(capsys):
    bar = demo._Progress(50, enabled=True)
    for i in range(1, 51):
        bar.update(i)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 11  # one line per 10 % (0 % .. 100 %), not one per step
    assert err[-1] == "progress: [##########] 50/50 steps"
