"""Importing tripwire (and its subpackages) must not read settings, initialise CUDA, start a thread or allocate.

Each check runs in a fresh interpreter, and each has a control: the same probe after a call that DOES the thing
(start a reader, allocate an arena, initialise CUDA) shows the probe can see it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROBE = r"""
import json, os, sys, threading
import torch
mods = sys.argv[1].split(",")
for m in mods:
    __import__(m)
import tripwire, tripwire._runtime.arena, tripwire._runtime.driver
exec(sys.argv[2])
print(json.dumps({
    "threads": sorted(t.name for t in threading.enumerate()),
    "driver_bound": tripwire._runtime.driver.Driver._instance is not False,
    "cuda_initialized": torch.cuda.is_initialized(),
    "arenas": tripwire._runtime.arena.arenas_made(),
}))
"""


def probe(mods: list[str], after: str = "", env_extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(env_extra or {})
    out = subprocess.run(
        [sys.executable, "-c", PROBE, ",".join(mods), after],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def available_modules() -> list[str]:
    mods = ["tripwire", "tripwire.triton", "tripwire.report"]
    for m in ("tripwire.kernels", "tripwire.numerics", "tripwire.distributed"):
        try:
            __import__(m)
        except ImportError:
            continue
        mods.append(m)
    return mods


def test_import_is_lean():
    # A broken setting in the environment must not break the import: settings are read, and the default monitor
    # built, on first use (a monitor built at import would have raised on this mode: the control below).
    r = probe(available_modules(), env_extra={"TRIPWIRE_MODE": "loud", "TRITON_INTERPRET": "1"})
    assert r == {"threads": ["MainThread"], "driver_bound": False, "cuda_initialized": False, "arenas": 0}


def test_control_probe_sees_the_default_monitor_built():
    """The broken mode that the import leaves unread is refused the moment the default monitor is built."""
    env = {**os.environ, "TRIPWIRE_MODE": "loud", "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "tripwire", "tripwire.default_monitor()"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode != 0 and "TRIPWIRE_MODE" in out.stderr and "loud" in out.stderr, out.stderr[-2000:]


def test_control_probe_sees_threads_and_arenas():
    r = probe(["tripwire"], "tripwire.counter(tripwire.register_site('x'), 'cpu'); tripwire.start()")
    assert "tripwire-reader" in r["threads"] and r["arenas"] == 1


def test_control_probe_sees_the_driver_bound():
    """libcuda is bound on first use (tripwire._runtime.driver), never at import: the probe sees a lookup made."""
    r = probe(["tripwire"], "tripwire._runtime.driver.Driver.get()")
    assert r["driver_bound"] is True


@pytest.mark.gpu
def test_control_probe_sees_cuda_init():
    assert torch.cuda.is_available()
    r = probe(["tripwire"], "tripwire.prealloc('cuda')")
    assert r["cuda_initialized"] and r["arenas"] == 1


@pytest.mark.gpu
def test_import_is_lean_on_a_gpu_machine():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = probe(available_modules(), env_extra=env)
    assert r["cuda_initialized"] is False and r["threads"] == ["MainThread"] and r["arenas"] == 0
    assert r["driver_bound"] is False


def _versions(root: Path) -> dict[str, str]:
    """The version as the package, pyproject.toml and the changelog's newest entry state it."""
    import re

    import tripwire

    pyproject = re.search(r'^version = "([^"]+)"', (root / "pyproject.toml").read_text(), re.M)
    changelog = re.search(r"^## (\S+)", (root / "CHANGELOG.md").read_text(), re.M)
    return {
        "tripwire.__version__": tripwire.__version__,
        "pyproject.toml": pyproject.group(1) if pyproject else "",
        "CHANGELOG.md": changelog.group(1) if changelog else "",
    }


def test_version_is_one_number_everywhere(tmp_path):
    """``tripwire.__version__``, pyproject.toml and the changelog's newest entry name one version, 0.4.0. Control: a
    changelog whose newest entry names another version is seen."""
    root = Path(__file__).resolve().parents[1]
    assert set(_versions(root).values()) == {"0.4.0"}, _versions(root)
    (tmp_path / "pyproject.toml").write_text((root / "pyproject.toml").read_text())
    (tmp_path / "CHANGELOG.md").write_text("# Changelog\n\n## 0.5.0\n\n## 0.4.0\n")
    assert _versions(tmp_path)["CHANGELOG.md"] == "0.5.0"
