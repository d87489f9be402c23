"""The native quiet tick (tripwire._native) on CPU arenas: the same C loop the GPU runs, with memcpy "drivers".

What it must hold: quiet ticks run no Python (so they cannot hold the GIL), every change still reaches Python's
decode exactly once per rise, sites registered while it runs are read, idle stops its copies, a failing native call
falls back to Python ticks without losing counts, and its thread is gone after stop() and at interpreter exit.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tripwire._native as native
from test_monitor import hit, warnings
from tripwire import Monitor
from tripwire._native import NativeTicker, NativeUnavailable
from tripwire.reader import DeviceReader


@pytest.fixture(autouse=True)
def _caplog_level(caplog):
    caplog.set_level(logging.INFO, logger="tripwire")


def _comm(task: Path) -> str:
    try:
        return (task / "comm").read_text().strip()
    except OSError:  # the thread exited while we looked
        return ""


def _native_threads() -> int:
    return sum(1 for t in Path("/proc/self/task").iterdir() if _comm(t) == "tripwire-native")


def _engaged_with_reference(m: Monitor) -> bool:
    """Engaged after a Python tick processed the rows (the first engagement has no reference rows yet)."""
    return _wait_for(lambda: m.native_tick == "engaged" and bool(m._latest))


def _python_ticks(m: Monitor) -> list[int]:
    """Count the reader thread's Python ticks (wraps the monitor's tick, as q3's trace does)."""
    n = [0]
    inner = m._poll

    def counted(*, on_reader_thread: bool) -> None:
        if on_reader_thread:
            n[0] += 1
        inner(on_reader_thread=on_reader_thread)

    m._poll = counted  # type: ignore[method-assign]
    return n


def _wait_for(cond, timeout: float = 2.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.002)
    return cond()


def _reported(m: Monitor, device: str, row: int) -> int:
    """The count the monitor has confirmed (decoded and reported) for ``row``; 0 before its first decode."""
    rep = m._reported.get(device)
    return 0 if rep is None else int(rep[row])


def _quiet_monitor(registry, **kw) -> Monitor:
    # report_every and heartbeat at an hour: the reader thread has no Python duty for 15 minutes.
    args = dict(registry=registry, capacity=64, interval=0.001, idle_tail=3600, report_every=3600, heartbeat=3600)
    args.update(kw)
    return Monitor(**args)


def test_library_builds_with_the_loader_layout():
    lib = native.library()
    dev, cfg = ctypes.c_int64(), ctypes.c_int64()
    lib.tw_sizes(ctypes.byref(dev), ctypes.byref(cfg))
    assert (dev.value, cfg.value) == (ctypes.sizeof(native._Dev), ctypes.sizeof(native._Cfg))


def test_no_compiler_is_unavailable_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached there: it must compile
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(NativeUnavailable, match=r"compiling the native tick failed .*no-such-cc"):
        native._build()
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NativeUnavailable, match=r"no C compiler found \(\$CC, cc, gcc, clang\)"):
        native._build()


def test_native_tick_on_raises_where_it_cannot_be_built(registry, monkeypatch):
    monkeypatch.setattr(native, "_lib", NativeUnavailable("no C compiler found ($CC, cc, gcc, clang)"))
    m = _quiet_monitor(registry, native_tick="on")
    m.prealloc("cpu")
    with pytest.raises(NativeUnavailable, match=r"native_tick=on \(TRIPWIRE_NATIVE_TICK\) but no C compiler"):
        m.start()
    m.stop()


def test_auto_falls_back_to_python_ticks_and_counts_exactly(registry, monkeypatch, caplog):
    monkeypatch.setattr(native, "_lib", NativeUnavailable("no C compiler found ($CC, cc, gcc, clang)"))
    m = _quiet_monitor(registry)
    ctr = m.counter(registry.register("n.fallback"), "cpu")
    py = _python_ticks(m)
    m.start()
    try:
        hit(ctr, 5, 77, n=4)
        assert _wait_for(lambda: len(warnings(caplog)) == 1)
        time.sleep(0.1)
        assert "4 new out-of-range accesses masked (4 total)" in warnings(caplog)[0]
        assert m.native_tick == "no C compiler found ($CC, cc, gcc, clang)"
        assert any("no native quiet tick" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
        assert py[0] > 10 and m._native_ticks == 0  # every tick was Python's
    finally:
        m.stop()


@pytest.mark.parametrize("native_tick", ["auto", "off"])
def test_quiet_ticks_run_no_python(registry, native_tick):
    """The point of the native tick: while nothing changes, the engine's GIL is never taken by the reader. With
    native_tick=off (the control), every tick is a Python tick."""
    m = _quiet_monitor(registry, native_tick=native_tick)
    m.counter(registry.register("n.quiet"), "cpu")
    py = _python_ticks(m)
    m.start()
    try:
        time.sleep(0.3)
        m.check()
        ticks = m.ticks
    finally:
        m.stop()
    assert ticks > 100
    if native_tick == "auto":
        assert py[0] <= 2, f"{py[0]} Python ticks out of {ticks}"  # the first read (no reference yet), once
        assert m._native_ticks >= ticks - py[0] - 1
    else:
        assert py[0] >= ticks - 1 and m._native_ticks == 0


def test_every_rise_reported_exactly_while_engaged(registry, caplog):
    m = _quiet_monitor(registry)
    ctr = m.counter(registry.register("n.rises"), "cpu")
    m.start()
    try:
        assert _engaged_with_reference(m)
        total = 0
        ctr_row = registry.get("n.rises").id
        for k in (1, 2, 3, 5, 8):
            hit(ctr, 10 + k, 1000 + k, n=k)
            total += k
            # Python's decode confirmed it (the native thread handed the changed copy back) ...
            assert _wait_for(lambda total=total: _reported(m, "cpu", ctr_row) == total)
            m.check()
            # ... and the quiet ticks went back to the native thread.
            assert _wait_for(lambda: m.native_tick == "engaged"), m.native_tick
        lines = warnings(caplog)
        assert len(lines) == 1  # aggregated: one line per report window, the rest deferred with their deltas
        snap = m.drain()  # drain while engaged: it takes the reader back and reads exactly
        assert snap[("cpu", "n.rises")].count == total == 19
    finally:
        m.stop()
    flushed = warnings(caplog)
    assert sum(int(line.split(" new ")[0].split()[-1]) for line in flushed) == 19  # deltas add up: nothing lost


def test_site_registered_while_engaged_is_read(registry, caplog, monkeypatch):
    _site_registered_while_engaged(registry, caplog, seen=True)


def test_control_without_the_registry_listener_a_new_site_goes_unseen(registry, caplog, monkeypatch):
    monkeypatch.setattr(NativeTicker, "set_rows", lambda self, n: None)
    _site_registered_while_engaged(registry, caplog, seen=False)


def _site_registered_while_engaged(registry, caplog, *, seen: bool) -> None:
    m = _quiet_monitor(registry)
    m.counter(registry.register("n.first"), "cpu")
    m.start()
    try:
        assert _engaged_with_reference(m)
        late = m.counter(registry.register("n.late"), "cpu")  # the native thread copies 1 row so far
        hit(late, 3, 9, n=6)
        got = _wait_for(lambda: any("'n.late'" in w for w in warnings(caplog)), timeout=0.5)
        assert got is seen
    finally:
        m.stop()


@pytest.mark.parametrize("idle_tail", [0.05, 3600.0])
def test_idle_stops_native_copies(registry, idle_tail):
    """No check() for idle_tail: the native thread stops copying; a check() resumes it. With a tail of an hour
    (the control) the copies never stop."""
    m = _quiet_monitor(registry, idle_tail=idle_tail)
    m.counter(registry.register("n.idle"), "cpu")
    r = m.prealloc("cpu") is not None and m.readers()["cpu"]
    m.start()
    try:
        m.check()
        time.sleep(0.25)  # past the tail
        c0, s0 = r.copies, m.idle_skips
        time.sleep(0.1)
        idle_copies, skips = r.copies - c0, m.idle_skips - s0
        m.check()
        c1 = r.copies
        time.sleep(0.05)
        resumed = r.copies - c1
        assert m.native_tick == "engaged"
    finally:
        m.stop()
    if idle_tail < 1:
        assert idle_copies == 0 and skips > 20
    else:
        assert idle_copies > 20 and skips == 0
    assert resumed > 10


def test_failing_native_call_falls_back_without_losing_counts(registry, caplog, monkeypatch):
    copy_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
    failing = copy_t(lambda dst, src, n, stream: 999)  # a driver error code
    fields = DeviceReader.native_fields

    def broken(self):
        q, _c, r, *rest = fields(self)
        return (q, ctypes.cast(failing, ctypes.c_void_p).value, r, *rest)

    monkeypatch.setattr(DeviceReader, "native_fields", broken)
    m = _quiet_monitor(registry)
    ctr = m.counter(registry.register("n.fail"), "cpu")
    hit(ctr, 1, 2, n=3)
    m.start()
    try:
        assert _wait_for(lambda: m.native_tick.startswith("failed"))
        assert m.native_tick == "failed: cuMemcpyDtoHAsync on cpu failed with CUDA driver error 999"
        assert _wait_for(lambda: any("3 new out-of-range" in w for w in warnings(caplog)))
        hit(ctr, 1, 2, n=2)  # Python ticks from now on, and still see everything
        assert _wait_for(lambda: m.drain()[("cpu", "n.fail")].count == 5)
    finally:
        m.stop()
    assert any("native quiet tick failed" in w for w in warnings(caplog))


def test_public_poll_while_engaged_takes_the_reader_back(registry, caplog):
    m = _quiet_monitor(registry)
    ctr = m.counter(registry.register("n.poll"), "cpu")
    m.start()
    try:
        assert _engaged_with_reference(m)
        hit(ctr, 4, 4, n=2)
        m.poll()
        m.poll()
        assert any("(2 total)" in w for w in warnings(caplog))
        assert _wait_for(lambda: m.native_tick == "engaged")  # the reader thread engaged it again
    finally:
        m.stop()


@pytest.mark.parametrize("close", [True, False])
def test_stop_joins_the_native_thread(registry, monkeypatch, close):
    before = _native_threads()
    if not close:  # the control: a stop() that leaves the native thread running
        monkeypatch.setattr(NativeTicker, "close", lambda self: None)
    m = _quiet_monitor(registry)
    m.counter(registry.register("n.stop"), "cpu")
    m.start()
    assert _native_threads() == before + 1
    m.stop()
    assert _native_threads() == before + (0 if close else 1)
    assert m.native_tick == "stopped"


_EXIT_SCRIPT = textwrap.dedent(
    """
    import atexit, sys, time
    from pathlib import Path
    import tripwire.monitor as mon
    from tripwire import Monitor, SiteRegistry

    def comm(t):
        try:
            return (t / "comm").read_text().strip()
        except OSError:
            return ""

    def native_threads():
        return sum(1 for t in Path("/proc/self/task").iterdir() if comm(t) == "tripwire-native")

    # Registered before tripwire's hook, so it runs after it (atexit is last in, first out).
    atexit.register(lambda: print("at-exit native threads:", native_threads(), flush=True))
    if sys.argv[1] == "control":
        mon._register_exit_hook = lambda: None
    reg = SiteRegistry(capacity=8)
    m = Monitor(registry=reg, capacity=8, interval=0.001, idle_tail=3600)
    m.counter(reg.register("x"), "cpu")
    m.start()
    time.sleep(0.1)
    print("running native threads:", native_threads(), m.native_tick, flush=True)
    """
)


@pytest.mark.parametrize("variant", ["hook", "control"])
def test_exit_without_stop_stops_the_native_thread_first(variant):
    """An engine that exits without tripwire.stop(): the native thread must be gone before torch frees the pinned
    mirror it reads (a daemon Python thread is frozen at exit; a native one would keep running)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, variant], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "running native threads: 1 engaged" in out.stdout
    assert f"at-exit native threads: {0 if variant == 'hook' else 1}" in out.stdout


# ---------------------------------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("native_tick", ["auto", "off"])
def test_cuda_native_tick_reads_graph_replays_exactly(registry, native_tick):
    """The driver path: graph replays bump a guard row while the native thread runs the quiet ticks; every rise is
    handed to Python and confirmed with its exact count, and the quiet ticks between them run no Python. With
    native_tick=off (the control) every tick is Python's."""
    import torch

    from gpu_kernels import launch_gather
    from test_reader import _gather_inputs

    m = _quiet_monitor(registry, native_tick=native_tick)
    m.prealloc("cuda")
    s = registry.register("gpu.native")
    ctr = m.counter(s, "cuda")
    idx, src, out, _ = _gather_inputs(3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch_gather(ctr, idx, src, out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    m.reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch_gather(ctr, idx, src, out)
    torch.cuda.synchronize()
    py = _python_ticks(m)
    m.start()
    try:
        if native_tick == "auto":
            assert _engaged_with_reference(m)
        expected = 0
        for _ in range(5):
            for _ in range(11):
                m.check()
                g.replay()
            expected += 33
            assert _wait_for(lambda expected=expected: _reported(m, "cuda:0", s.id) == expected)
            end = time.monotonic() + 0.05
            while time.monotonic() < end:  # quiet ticks, with the engine "alive"
                m.check()
                time.sleep(0.002)
        py_ticks, ticks = py[0], m.ticks
        snap = m.drain()
    finally:
        m.stop()
    assert snap[("cuda:0", "gpu.native")].count == 165
    if native_tick == "auto":
        assert m._native_ticks > 150 and py_ticks < 40, (m._native_ticks, py_ticks, ticks)
    else:
        assert m._native_ticks == 0 and py_ticks > 150
