"""The ``tripwire`` command line: ``sites`` into a closed pipe, ``bench`` outside a checkout, ``doctor``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tripwire
from tripwire.cli import main
from tripwire.cli.text import format_table, help_text

REPO = Path(__file__).resolve().parents[2]


def _into_closed_pipe(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` with its stdout a pipe whose reader is already gone (what ``| head`` leaves behind)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(cmd, stdout=w, stderr=subprocess.PIPE, text=True, timeout=300, check=False)
    finally:
        os.close(w)


def test_sites_into_a_closed_pipe_ends_quietly():
    out = _into_closed_pipe([sys.executable, "-m", "tripwire", "sites"])
    assert out.returncode == 0 and "BrokenPipeError" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_control_a_plain_print_into_a_closed_pipe_raises():
    out = _into_closed_pipe([sys.executable, "-c", "print('x' * 100_000)"])
    assert "BrokenPipeError" in out.stderr


def test_sites_lists_the_sites():
    out = subprocess.run([sys.executable, "-m", "tripwire", "sites"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "numerics.fp8_cache.slot" in out.stdout and "FATAL" in out.stdout


# ---------------------------------------------------------------------------------------------------- bench
def test_the_bench_runs_from_an_installed_copy(tmp_path):
    """The self-check ships in the package: a copy of it alone (no checkout, no benchmarks/ folder anywhere) runs a
    question and writes the record."""
    site = tmp_path / "site-packages"
    shutil.copytree(REPO / "src" / "tripwire", site / "tripwire", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIPWIRE_")}
    env["PYTHONPATH"] = str(site)
    out = subprocess.run(
        [sys.executable, "-m", "tripwire", "bench", "--quick", "--only", "q2", "--out", "out"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert record["questions"]["q2"]["status"] == "ok"
    where = subprocess.run(
        [sys.executable, "-c", "import tripwire; print(tripwire.__file__)"], capture_output=True, text=True, env=env
    )
    assert where.stdout.strip() == str(site / "tripwire" / "__init__.py")  # control: the copy ran, not a checkout


# ---------------------------------------------------------------------------------------------------- doctor
def doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TRIPWIRE_")}
    e.update(env)
    return subprocess.run(
        [sys.executable, "-m", "tripwire", "doctor", *args], capture_output=True, text=True, env=e, timeout=300
    )


def checks(out: subprocess.CompletedProcess) -> dict[str, dict]:
    return {c["name"]: c for c in json.loads(out.stdout)}


def test_doctor_runs_here_and_says_what_would_not_work():
    out = doctor()
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    names = ("versions", "settings", "CUDA", "capture-mode relax", "native tick", "compute-sanitizer", "sinks", "vLLM")
    for name in names:
        assert f"] {name}" in text, name
    c = checks(doctor("--json"))
    assert c["native tick"]["status"] == "ok" and "engaged" in c["native tick"]["found"]
    import torch

    if not torch.cuda.is_available():
        assert c["CUDA"]["status"] == "warn" and "TRITON_INTERPRET" in c["CUDA"]["consequence"]


def test_doctor_fails_on_a_broken_setting():
    out = doctor(TRIPWIRE_MODE="loud")
    assert out.returncode == 1 and "[FAIL] settings: TRIPWIRE_MODE='loud' is not a mode" in out.stdout


def test_doctor_says_when_the_native_tick_cannot_be_built(tmp_path):
    c = checks(doctor("--json", CC=str(tmp_path / "no-cc"), XDG_CACHE_HOME=str(tmp_path)))
    nt = c["native tick"]
    assert (
        nt["status"] == "warn" and "cannot be built" in nt["found"] and "holding the engine's GIL" in nt["consequence"]
    )


def test_doctor_fails_on_an_unwritable_event_log(tmp_path):
    (tmp_path / "plain").write_text("")
    c = checks(doctor("--json", TRIPWIRE_EVENT_LOG=str(tmp_path / "plain" / "e.jsonl")))
    assert c["sinks"]["status"] == "fail" and "event log cannot be opened" in c["sinks"]["consequence"]


@pytest.mark.gpu
def test_doctor_on_a_gpu_finds_cuda_the_relax_and_the_native_tick():
    c = checks(doctor("--json"))
    assert c["CUDA"]["status"] == "ok" and "fast path" in c["CUDA"]["found"]
    assert c["capture-mode relax"]["status"] == "ok"
    assert c["native tick"]["status"] == "ok"


# ---------------------------------------------------------------------------------------------------- broken settings
@pytest.mark.parametrize(
    "cmd", [["demo"], ["demo", "--mode", "raise"], ["demo", "--engine", "transformers"], ["bench"], ["sites"]]
)
def test_a_bad_setting_value_is_one_line_and_status_2(cmd, monkeypatch, capsys):
    monkeypatch.setenv("TRIPWIRE_MODE", "rasie")
    assert main(cmd) == 2
    err = capsys.readouterr().err
    assert err == f"tripwire {cmd[0]}: error: TRIPWIRE_MODE='rasie' is not a mode; expected one of raise, warn, off\n"


def test_a_misspelt_setting_name_stops_the_command(monkeypatch, capsys):
    monkeypatch.setenv("TRIPWIRE_MDOE", "raise")
    assert main(["sites"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "tripwire sites: error: TRIPWIRE_MDOE is not a tripwire setting (did you mean TRIPWIRE_MODE?)"
    )
    assert err.count("\n") == 1


def test_a_bad_setting_keyword_of_the_demo_is_one_line_too(capsys):
    # The process's own device (--device cpu on a GPU machine is refused in-process: see below).
    assert main(["demo", "--steps", "1", "--interval", "-1"]) == 2
    err = capsys.readouterr().err
    assert "tripwire demo: error: " in err and "expected a finite number of seconds > 0" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------------------------------------------- Triton's mode
# A fresh process: Triton fixes a kernel's mode when its module is imported, so the commands' mode check passes there
# on any machine. An import hook (stdlib) records TRITON_INTERPRET when each command's own module is imported, that
# is inside the command; both commands then stop at a bad option, before any work.
_SEEN_BY_THE_COMMANDS = """
import importlib.abc, json, os, sys

seen = []

class Seen(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in ("tripwire.cli.demo", "tripwire.cli.bench.run"):
            seen.append(os.environ.get("TRITON_INTERPRET"))
        return None

sys.meta_path.insert(0, Seen())
if sys.argv[1] == "never-restored":
    # The control: the command's switch as it would be without its restore. Putting back an unset variable is a
    # pop of it; dropped here, the variable stays set, never restored.
    pop = os.environ.pop
    os.environ.pop = lambda key, *default: None if key == "TRITON_INTERPRET" else pop(key, *default)
import torch
from tripwire.cli import main

rcs = [main(["demo", "--device", "cpu", "--interval", "-1"])]
rcs.append(main(["bench", "--quick", "--only", "nosuch"]))
print(json.dumps({"rcs": rcs, "seen": seen, "after": os.environ.get("TRITON_INTERPRET"),
                  "cuda": torch.cuda.is_available()}))
"""


def _seen_by_the_commands(before: str | None, how: str = "as-is") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if before is not None:
        env["TRITON_INTERPRET"] = before
    out = subprocess.run(
        [sys.executable, "-c", _SEEN_BY_THE_COMMANDS, how], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("before", [None, "0"])
def test_an_in_process_command_leaves_triton_interpret_as_it_was(before):
    """A command run in-process (``main``) that wants the interpreter (the demo on the CPU; bench without CUDA) sets
    TRITON_INTERPRET for itself only: left set, every kernel module a later import brings into the process would be
    interpreted."""
    got = _seen_by_the_commands(before)
    assert got["rcs"] == [2, 2], got
    bench = before if got["cuda"] else ("1" if before is None else before)  # bench wants compiled kernels on CUDA
    assert got["seen"] == ["1" if before is None else before, bench], got  # setdefault: a user's value is kept
    assert got["after"] == before, got


def test_control_without_the_restore_the_variable_leaks():
    """The control: the command's interpreter switch without its restore (set, never put back) leaves the variable
    behind, so the restore check above can fail."""
    got = _seen_by_the_commands(None, "never-restored")
    assert got["rcs"] == [2, 2] and got["seen"][0] == "1", got
    assert got["after"] == "1", got


def test_a_command_needing_the_other_triton_mode_is_refused():
    """Triton makes a kernel interpreted or compiled when its module is imported: once a process holds tripwire's
    kernels in one mode, a command that needs the other one is refused with what to do, instead of running compiled
    kernels on CPU tensors (or interpreted ones on GPU tensors). Control: the same command in the mode the kernels
    were imported in is not refused for it."""
    code = (
        "import sys, tripwire.triton; from tripwire.cli import main; "
        "sys.exit(main(['demo', '--device', sys.argv[1], '--interval', '-1']))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # the kernels imported interpreted, on any machine
    for device, refused in (("cuda", True), ("cpu", False)):
        out = subprocess.run([sys.executable, "-c", code, device], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        said = "already imported tripwire's Triton kernels" in out.stderr and "run it in a new process" in out.stderr
        assert said == refused, (device, out.stderr)
        assert ("expected a finite number of seconds > 0" in out.stderr) == (not refused), (device, out.stderr)


def test_a_bad_setting_through_the_command_line_has_no_traceback():
    e = {k: v for k, v in os.environ.items() if not k.startswith("TRIPWIRE_")}
    e["TRIPWIRE_MODE"] = "rasie"
    out = subprocess.run(
        [sys.executable, "-m", "tripwire", "demo", "--mode", "raise"],
        capture_output=True,
        text=True,
        env=e,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr


def test_doctor_checks_the_vllm_plugin_setting():
    """``TRIPWIRE_VLLM=on`` (which vLLM's plugin load refuses) fails the doctor's vLLM check; control: ``contain``
    and unset pass it."""
    out = doctor("--json", TRIPWIRE_VLLM="on")
    c = checks(out)["vLLM plugin"]
    assert out.returncode == 1 and c["status"] == "fail" and "'on' is not a tripwire vLLM mode" in c["found"]
    for env in ({"TRIPWIRE_VLLM": "contain"}, {}):
        c = checks(doctor("--json", **env))["vLLM plugin"]
        assert c["status"] == "ok", c


def test_doctor_fails_on_a_misspelt_setting_name():
    """A misspelt name is the settings check's one FAIL: said once, and the native tick (a check of the machine)
    still runs and passes; the closing line counts ok, warn and fail apart, exactly as the lines above say."""
    out = doctor(TRIPWIRE_MDOE="raise")
    assert out.returncode == 1, out.stdout
    assert "[FAIL] settings: TRIPWIRE_MDOE is not a tripwire setting (did you mean TRIPWIRE_MODE?)" in out.stdout
    assert out.stdout.count("TRIPWIRE_MDOE") == 1, out.stdout
    statuses = [ln[1:5].strip().lower() for ln in out.stdout.splitlines() if ln.startswith("[")]
    assert statuses.count("fail") == 1 and len(statuses) == 8, out.stdout
    assert "[OK  ] native tick: built" in out.stdout, out.stdout
    n = {s: statuses.count(s) for s in ("ok", "warn", "fail")}
    assert out.stdout.splitlines()[-1] == (
        f"8 checks: {n['ok']} ok, {n['warn']} warn, 1 fail (tripwire would refuse to run as configured: see the FAIL "
        f"lines above)"
    )


def test_control_a_monitor_built_from_the_environment_trips_on_a_misspelt_name(monkeypatch):
    """Control: a monitor that reads the environment (as the native tick check's once did) raises for the misspelt
    name, so that check failed with the whole message again; one given its own environment does not."""
    from tripwire.errors import SettingError

    monkeypatch.setenv("TRIPWIRE_MDOE", "raise")
    with pytest.raises(SettingError, match="TRIPWIRE_MDOE"):
        tripwire.Monitor(registry=tripwire.SiteRegistry(capacity=2), capacity=2)
    tripwire.Monitor(registry=tripwire.SiteRegistry(capacity=2), capacity=2, env={})


def test_doctor_summary_counts_each_status_apart():
    """Warnings are not problems: 1 ok and 2 warn read so, and only a FAIL says tripwire would refuse. Control: the
    count of what is not ok (what the line once said were problems) is 2 for the warn-only list."""
    from tripwire.cli.doctor import FAIL, OK, WARN, Check, summary

    warned = [Check("a", OK, "x"), Check("b", WARN, "y", "z"), Check("c", WARN, "y", "z")]
    assert summary(warned) == (
        "3 checks: 1 ok, 2 warn, 0 fail (tripwire runs; the WARN lines above say what would not work or would cost "
        "more here)"
    )
    assert sum(c.status != OK for c in warned) == 2
    assert summary([Check("a", OK, "x")]) == "1 check: 1 ok, 0 warn, 0 fail"
    assert summary([*warned, Check("d", FAIL, "w", "v")]).startswith("4 checks: 1 ok, 2 warn, 1 fail (tripwire would")


def test_doctor_reports_a_check_tripping_on_a_broken_setting_as_not_run(monkeypatch):
    """A check other than settings that raises SettingError says it did not run (WARN), not a FAIL repeating the
    settings check's message; any other exception is still a FAIL."""
    from tripwire.cli import doctor as doc
    from tripwire.errors import SettingError

    def trips() -> doc.Check:
        raise SettingError("TRIPWIRE_MDOE is not a tripwire setting")

    def breaks() -> doc.Check:
        raise RuntimeError("boom")

    monkeypatch.setattr(doc, "CHECKS", (trips, breaks))
    got = doc.run_checks()
    assert [(c.name, c.status) for c in got] == [("trips", "warn"), ("breaks", "fail")]
    assert "MDOE" not in got[0].found and "RuntimeError: boom" in got[1].found


# ---------------------------------------------------------------------------------------------------- help, version
def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"tripwire {tripwire.__version__}\n"


def test_help_is_plain_text_and_whole(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out and ":class:" not in out
    for cmd in ("demo", "bench", "sites", "doctor", "resources", "--version"):
        assert cmd in out
    description = out.split("\n\n")[1]
    assert description.rstrip().endswith("."), description  # a sentence, not a cut-off line


@pytest.mark.parametrize(
    "cmd", [["demo"], ["demo", "--engine", "transformers"], ["demo", "--engine", "vllm"], ["doctor"], ["bench"]]
)
def test_every_commands_help_is_plain_and_whole(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]
    assert e.value.code == 0 and description.startswith(f"tripwire {cmd[0]}"), out
    assert "``" not in description and ":func:" not in description and description.rstrip().endswith("."), out


def test_control_help_text_makes_a_docstring_plain():
    doc = """``tripwire x``: reads :func:`tripwire.check` and
    ``y``.

    Not this paragraph."""
    assert help_text(doc) == "tripwire x: reads tripwire.check and y."


def test_demo_help_lists_the_engines(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "--engine {transformers,vllm}" in out and "--steps" in out


# ---------------------------------------------------------------------------------------------------- tables
def test_sites_has_a_header_and_aligned_columns(capsys):
    assert main(["sites"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "KIND", "FATAL", "NAME", "DESCRIPTION"]
    name_at = lines[0].index("NAME")
    desc_at = lines[0].index("DESCRIPTION")
    for ln in lines[1:]:
        assert ln[name_at - 1] == " " and ln[name_at] != " ", ln
        assert ln[desc_at - 2 : desc_at] == "  " and ln[desc_at] != " ", ln  # every site has a description
    assert any(" FATAL " in ln for ln in lines[1:])


def test_control_a_table_is_as_wide_as_its_widest_cell():
    text = format_table([("a", "n", "b"), ("x" * 12, "7", "y"), ("z", "1234", "w")], right=(1,))
    assert text.splitlines() == ["a                n  b", "xxxxxxxxxxxx     7  y", "z             1234  w"]


def test_bench_into_head_writes_its_lines_and_ends_quietly(tmp_path):
    """`tripwire bench | head -3`: the three lines arrive, the question running when head leaves is not recorded as
    a failure with a traceback, and the command ends with status 0 (the control: the same run uncut has more)."""
    cmd = f"{sys.executable} -m tripwire bench --only q2 --quick --out {tmp_path}"
    cut = subprocess.run(
        ["bash", "-c", f"{cmd} | head -3; exit ${{PIPESTATUS[0]}}"], capture_output=True, text=True, timeout=600
    )
    assert cut.returncode == 0 and "Traceback" not in cut.stderr and "Broken pipe" not in cut.stderr, cut.stderr
    lines = cut.stdout.splitlines()
    # The header, then q2's own lines (how many header lines precede them differs between the CPU and the GPU).
    assert len(lines) == 3 and lines[0].startswith("tripwire bench: ") and any(ln.startswith("[q2] ") for ln in lines)
    whole = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0 and len(whole.stdout.splitlines()) > 3
