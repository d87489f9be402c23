"""The suite's guard against tests that leave a non-daemon thread running (tests/_thread_leaks.py): such a test
fails with the thread's name, and the session exits instead of waiting for the thread forever."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

_LEAK = textwrap.dedent(
    """
    import threading

    STOP = threading.Event()

    def test_leaves_a_thread_running():
        threading.Thread(target=STOP.wait, name="left-running").start()

    def test_clean():
        pass
    """
)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "control"])
def test_a_leaked_thread_fails_the_module_and_ends_the_session(tmp_path, guarded):
    (tmp_path / "test_leak.py").write_text(_LEAK)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_leak.py")]
    if guarded:
        args[3:3] = ["-p", "_thread_leaks"]
    env = {"PYTHONPATH": str(HERE), "PATH": "/usr/bin:/bin"}
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=60 if guarded else 20, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        assert not guarded, "the guarded session must end by itself"
        return  # the control: without the guard, the interpreter waits for the thread at exit
    assert guarded, "the control must hang at exit (the thread is never stopped)"
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "test_leak left 1 non-daemon thread(s) running: left-running" in out, out
    assert "still running at the end of the session (left-running)" in out, out
