"""The native quiet tick (tripwire._runtime.native) on CPU arenas: the same C loop the GPU runs, with memcpy "drivers".

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
import threading
import time
from pathlib import Path

import pytest

import tripwire._runtime.native as native
from test_monitor import hit, warnings
from tripwire import Monitor
from tripwire._runtime.native import NativeTicker, NativeUnavailable
from tripwire._runtime.reader import DeviceReader


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
    return _wait_for(lambda: m.native_tick == "engaged" and bool(m.confirmer.all_latest()))


def _python_ticks(m: Monitor) -> int:
    """The Python ticks so far (the reader thread's: these tests never call poll())."""
    return m.health()["python_ticks"]


def _native_ticks(m: Monitor) -> int:
    return m.health()["native_ticks"]


def _wait_for(cond, timeout: float = 2.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.002)
    return cond()


def _reported(m: Monitor, device: str, row: int) -> int:
    """The count the monitor has confirmed (decoded and reported) for ``row``; 0 before its first decode."""
    return m.confirmer.reported(device, row)


def _quiet_monitor(registry, **kw) -> Monitor:
    # report_every and heartbeat at an hour: the reader thread has no Python duty for 15 minutes.
    args = dict(registry=registry, capacity=64, interval=0.001, idle_tail=3600, report_every=3600, heartbeat=3600)
    args.update(kw)
    return Monitor(**args)


def test_library_builds_with_the_loader_layout():
    lib = native.library()
    out = (ctypes.c_int64 * 6)()
    lib.tw_layout(out)
    assert list(out) == native.layout()  # sizes and offsets of both structs, as the loader's ctypes mirror has them


def test_a_cached_library_with_another_layout_is_rebuilt(monkeypatch, tmp_path):
    """A cached file whose structs differ from the loader's (damaged, or built by other code) is never used: it is
    rebuilt once from the source. The control: that file, loaded as it is, is refused for its layout."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    so = native.cached_path()
    real = native.SRC
    bad = tmp_path / "bad.c"
    bad.write_text(real.read_text().replace("out[0] = (int64_t)sizeof(tw_dev);", "out[0] = 1;"))
    monkeypatch.setattr(native, "SRC", bad)
    native.compile_library(so)  # planted under the name the real source would use
    monkeypatch.setattr(native, "SRC", real)
    with pytest.raises(NativeUnavailable, match="struct layout"):
        native.load(so)
    lib = native.build()  # refuses it, rebuilds it (and loads the rebuilt file under a private name)
    out = (ctypes.c_int64 * 6)()
    lib.tw_layout(out)
    assert list(out) == native.layout()
    assert list((tmp_path / "tripwire").iterdir()) == [so]  # rebuilt in place, nothing left behind


def test_cc_with_arguments_builds(monkeypatch, tmp_path):
    import shutil

    gcc = shutil.which("gcc") or shutil.which("cc")
    assert gcc is not None, "no compiler here"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", f"{gcc} -O0")  # CC with arguments, as ccache setups have it
    native.build()
    assert list((tmp_path / "tripwire").glob("tick-*.so"))


def test_a_cache_dir_others_can_write_is_not_used(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    assert not native.private_dir(d)
    d.chmod(0o700)
    assert native.private_dir(d)


def test_no_compiler_is_unavailable_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached there: it must compile
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(NativeUnavailable, match=r"compiling the native tick failed .*no-such-cc"):
        native.build()
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NativeUnavailable, match=r"no C compiler found \(\$CC, cc, gcc, clang\)"):
        native.build()


def _no_native(monkeypatch) -> None:
    """This process cannot build the native tick (what a machine without a C compiler sees)."""

    def unavailable():
        raise NativeUnavailable("no C compiler found ($CC, cc, gcc, clang)")

    monkeypatch.setattr(native, "library", unavailable)


def test_native_tick_on_raises_where_it_cannot_be_built(registry, monkeypatch):
    _no_native(monkeypatch)
    m = _quiet_monitor(registry, native_tick="on")
    m.prealloc("cpu")
    with pytest.raises(NativeUnavailable, match=r"native_tick=on \(TRIPWIRE_NATIVE_TICK\) but no C compiler"):
        m.start()
    m.stop()


def test_auto_falls_back_to_python_ticks_and_counts_exactly(registry, monkeypatch, caplog):
    _no_native(monkeypatch)
    m = _quiet_monitor(registry)
    ctr = m.counter(registry.register("n.fallback"), "cpu")
    m.start()
    try:
        hit(ctr, 5, 77, n=4)
        assert _wait_for(lambda: any("MASKED" in w for w in warnings(caplog)))
        time.sleep(0.1)
        (line,) = [w for w in warnings(caplog) if "MASKED" in w]
        assert "4 new out-of-range accesses masked (4 total)" in line
        assert m.native_tick == "no C compiler found ($CC, cc, gcc, clang)"
        assert any("no native quiet tick (no C compiler found" in w for w in warnings(caplog))
        assert _python_ticks(m) > 10 and _native_ticks(m) == 0  # every tick was Python's
    finally:
        m.stop()


@pytest.mark.parametrize("native_tick", ["auto", "off"])
def test_quiet_ticks_run_no_python(registry, native_tick):
    """The point of the native tick: while nothing changes, the engine's GIL is never taken by the reader. With
    native_tick=off (the control), every tick is a Python tick."""
    m = _quiet_monitor(registry, native_tick=native_tick)
    m.counter(registry.register("n.quiet"), "cpu")
    m.start()
    try:
        time.sleep(0.3)
        m.check()
        ticks = m.ticks
    finally:
        m.stop()
    assert ticks > 100
    py = _python_ticks(m)
    if native_tick == "auto":
        assert py <= 2, f"{py} Python ticks out of {ticks}"  # the first read (no reference yet), once
        assert _native_ticks(m) >= ticks - py - 1
    else:
        assert py >= ticks - 1 and _native_ticks(m) == 0


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
        resumed = _wait_for(lambda: r.copies - c1 > 3, timeout=0.04)  # a check() resumes them (within a tail)
        assert m.native_tick == "engaged"
    finally:
        m.stop()
    if idle_tail < 1:
        assert idle_copies == 0 and skips > 20
    else:
        assert idle_copies > 20 and skips == 0
    assert resumed


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


@pytest.mark.parametrize("close", [True, False])
def test_stop_joins_the_native_thread(registry, monkeypatch, close):
    before = _native_threads()
    joined: list[bool] = []
    if close:
        real_close = NativeTicker.close

        def spied(self, timeout=None):  # type: ignore[no-untyped-def]
            joined.append(real_close(self, timeout))  # True once tw_stop joined the thread
            return joined[-1]

        monkeypatch.setattr(NativeTicker, "close", spied)
    else:  # the control: a stop() that leaves the native thread running
        monkeypatch.setattr(NativeTicker, "close", lambda self, timeout=None: True)
        monkeypatch.setattr(NativeTicker, "__del__", lambda self: None)  # nor frees it when it is collected
    m = _quiet_monitor(registry)
    m.counter(registry.register("n.stop"), "cpu")
    m.start()
    assert _native_threads() == before + 1
    m.stop()
    assert m.native_tick == "stopped"
    # A joined thread's /proc entry can outlive the join by a moment (the kernel wakes the joiner before it reaps the
    # task; the exit test below waits for the same reason): the count is waited for. The control's thread, never
    # told to stop, stays.
    gone = _wait_for(lambda: _native_threads() == before, timeout=1.0 if close else 0.2)
    assert gone == close, _native_threads() - before
    assert joined == ([True] if close else [])  # stop() closed the ticker once, and the join succeeded


_EXIT_SCRIPT = textwrap.dedent(
    """
    import atexit, sys, time
    from pathlib import Path
    import tripwire._runtime.native.engage as engage
    from tripwire import Monitor, SiteRegistry

    def comm(t):
        try:
            return (t / "comm").read_text().strip()
        except OSError:
            return ""

    def native_threads():
        return sum(1 for t in Path("/proc/self/task").iterdir() if comm(t) == "tripwire-native")

    def at_exit():
        # A joined thread's /proc entry can outlive the join by a moment (the kernel wakes the joiner before it
        # reaps the task): wait for it a little. A thread left running (the control) is still there after.
        deadline = time.monotonic() + 2.0
        n = native_threads()
        while n and time.monotonic() < deadline:
            time.sleep(0.01)
            n = native_threads()
        print("at-exit native threads:", n, flush=True)

    # Registered before tripwire's hook, so it runs after it (atexit is last in, first out).
    atexit.register(at_exit)
    if sys.argv[1] == "control":
        engage.register_exit_hook = lambda: None
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
    assert "stuck in a driver call" not in out.stderr  # the hook joined the thread: it did not leave it behind


@pytest.fixture
def ownership(monkeypatch):
    """Records every Python access to a reader's copy state made while the native thread owns it."""
    bad: list[str] = []
    for name in ("poll", "read_now", "discard"):
        orig = getattr(DeviceReader, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):
            if self.native_dev is not None:
                bad.append(f"{_name} on {threading.current_thread().name}")
            return _orig(self, *a, **k)

        monkeypatch.setattr(DeviceReader, name, wrapped)
    return bad


def _widen_after_pause(m: Monitor, seconds: float = 0.05) -> None:
    """Sleep right after a native pause made on the main thread: the reader thread (woken by the pause) then has time
    to tick and re-engage before the caller takes the lock."""
    orig = m.native.pause
    main = threading.main_thread()

    def slow(timeout=None):
        done = orig(timeout)
        if threading.current_thread() is main:
            time.sleep(seconds)
        return done

    m.native.pause = slow  # type: ignore[method-assign]


def _started_widened(registry, site: str) -> Monitor:
    """A quiet monitor with one CPU counter at ``site``, its pause widened, started, its reader engaged (stopped
    again, and the test failed, if it does not engage)."""
    m = _quiet_monitor(registry)
    m.counter(registry.register(site), "cpu")
    _widen_after_pause(m)
    m.start()
    if not _engaged_with_reference(m):
        m.stop()
        raise AssertionError(f"the native tick did not engage: {m.native_tick}")
    return m


# --------------------------------------------------------------------------------------- ownership: poll(), drain()
@pytest.mark.parametrize("entry", ["poll", "drain", "reset"])
def test_python_never_touches_a_reader_the_native_thread_owns(registry, ownership, entry):
    m = _started_widened(registry, "o.x")
    try:
        for _ in range(3):
            m.check()
            getattr(m, entry)()
            assert _wait_for(lambda: m.native_tick == "engaged")
    finally:
        m.stop()
    assert ownership == []


def test_control_a_pause_outside_the_lock_lets_python_poll_an_engaged_reader(registry, ownership):
    """The control: poll() with the pause taken outside the lock (that order re-created explicitly, so the control
    does not depend on poll()'s own) drives a reader the native thread owns."""
    m = _started_widened(registry, "o.ctl")  # the same setup as the test above: only _poll's order differs
    try:
        widened = m.native.pause
        main = threading.main_thread()
        for _ in range(3):
            m.check()
            widened()
            # poll()'s own pause under the lock skipped on this thread only: the pause happens outside it
            m.native.pause = lambda timeout=None: (  # type: ignore[method-assign]
                True if threading.current_thread() is main else widened(timeout)
            )
            try:
                m.poll()
            finally:
                m.native.pause = widened  # type: ignore[method-assign]
            assert _wait_for(lambda: m.native_tick == "engaged")
    finally:
        m.stop()
    assert ownership


# --------------------------------------------------------------------------------------- tick hooks
def test_tick_hook_added_while_engaged_runs_every_tick(registry):
    m = _quiet_monitor(registry)
    m.counter(registry.register("h.x"), "cpu")
    m.start()
    try:
        assert _engaged_with_reference(m)
        calls: list[float] = []
        m.add_tick_hook(lambda _m: calls.append(time.monotonic()))
        assert _wait_for(lambda: len(calls) >= 20)
        assert m.native_tick == "ready"
    finally:
        m.stop()


def test_tick_hook_added_while_the_reader_engages_still_runs(registry, monkeypatch):
    entered, once = threading.Event(), [False]
    orig = NativeTicker.engage

    def slow_engage(self, *a, **k):
        if once[0] and threading.current_thread().name == "tripwire-reader":
            once[0] = False
            entered.set()
            time.sleep(0.05)
        return orig(self, *a, **k)

    m = _quiet_monitor(registry)
    ctr = m.counter(registry.register("h.race"), "cpu")
    monkeypatch.setattr(NativeTicker, "engage", slow_engage)
    m.start()
    try:
        # Not the first engagement (it has no reference rows, so its first copy hands back at once and hides the
        # race): one made after a change was confirmed.
        assert _engaged_with_reference(m)
        once[0] = True
        ctr[0] += 1
        assert entered.wait(2)
        calls: list[float] = []
        m.add_tick_hook(lambda _m: calls.append(time.monotonic()))
        assert _wait_for(lambda: len(calls) >= 20, timeout=1.0), (len(calls), m.native_tick)
    finally:
        m.stop()


# --------------------------------------------------------------------------------------- registry growth
def test_racing_registrations_never_shrink_the_native_row_count(registry, monkeypatch):
    m = _quiet_monitor(registry)
    m.counter(registry.register("r.first"), "cpu")
    m.start()
    try:
        assert _wait_for(lambda: m.native_tick == "engaged")
        orig, first, b_done = NativeTicker.set_rows, [True], threading.Event()

        def set_rows(self, n):
            if first[0]:
                first[0] = False
                b_done.wait(0.5)  # a GIL switch between reading the size and storing it
            orig(self, n)

        monkeypatch.setattr(NativeTicker, "set_rows", set_rows)
        a = threading.Thread(target=lambda: registry.register("r.a"))
        a.start()
        time.sleep(0.05)
        registry.register("r.b")
        b_done.set()
        a.join()
        assert m.native.ticker.cfg.n_rows == len(registry) == 3
    finally:
        m.stop()


# --------------------------------------------------------------------------------------- settings that overflow int64 ns
def test_a_huge_idle_tail_never_idles_the_native_tick(registry):
    m = _quiet_monitor(registry, idle_tail=1e10)
    ctr = m.counter(registry.register("i.huge"), "cpu")
    m.start()
    try:
        assert _engaged_with_reference(m)
        ctr[0] += 1
        assert _wait_for(lambda: bool(m.confirmer.pending("cpu")) or _reported(m, "cpu", 0) == 1, timeout=0.5)
        assert m.idle_skips == 0
    finally:
        m.stop()


# --------------------------------------------------------------------------------------- lifetime
_KICK_AFTER_CLOSE = textwrap.dedent(
    """
    from tripwire import Monitor, SiteRegistry
    reg = SiteRegistry(capacity=8)
    m = Monitor(registry=reg, capacity=8, interval=0.001, idle_tail=3600)
    m.counter(reg.register("x"), "cpu")
    m.start()
    t = m.native.ticker  # what a second, concurrent stop() read before the first one closed the ticker
    m.stop()
    t.kick(); t.pause(); t.wait(0.0); t.stop(); t.close()
    print("ok")
    """
)


def test_a_closed_ticker_is_inert():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", _KICK_AFTER_CLOSE], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0 and "ok" in out.stdout, (out.returncode, out.stderr[-500:])


_FORK = textwrap.dedent(
    """
    import os, sys, time
    from tripwire import Monitor, SiteRegistry
    reg = SiteRegistry(capacity=8)
    m = Monitor(registry=reg, capacity=8, interval=0.01, idle_tail=3600, heartbeat=8, report_every=3600)
    site = reg.register("x")
    ctr = m.counter(site, "cpu")
    m.start()
    time.sleep(0.2)
    pid = os.fork()
    if pid == 0:
        m.start()                       # Python threads do not survive fork: the child starts its reader again
        time.sleep(0.2)
        t0 = time.monotonic()
        ctr[0] += 1
        while time.monotonic() - t0 < 1.0 and not m.confirmer.pending("cpu") and not m.confirmer.reported("cpu", site.id):
            m.check()
            time.sleep(0.002)
        os._exit(0 if time.monotonic() - t0 < 1.0 else 3)
    _, status = os.waitpid(pid, 0)
    m.stop()
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


def test_a_forked_child_that_starts_again_reads_at_its_interval():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", _FORK], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, (out.returncode, out.stderr[-500:])


_BLOCKED_EXIT = textwrap.dedent(
    """
    import ctypes, sys, time
    import tripwire._runtime.native.engage as engage
    from tripwire import Monitor, SiteRegistry
    from tripwire._runtime.reader import DeviceReader

    # The native thread's "copy" is libc's sleep(), which reads the mirror's address as seconds: an enqueue that
    # blocks (behind a hung compute stream) without the GIL, like the real one.
    sleep_addr = ctypes.cast(ctypes.CDLL(None).sleep, ctypes.c_void_p).value
    fields = DeviceReader.native_fields
    DeviceReader.native_fields = lambda self: (lambda f: (f[0], sleep_addr, *f[2:]))(fields(self))
    if sys.argv[1] == "control":  # an exit hook that waits for the native thread without a limit
        engage.EXIT_JOIN_S = None
    reg = SiteRegistry(capacity=8)
    m = Monitor(registry=reg, capacity=8, interval=0.01, idle_tail=3600)
    m.counter(reg.register("x"), "cpu")
    m.start()
    time.sleep(0.3)
    print("blocked in a driver call:", m.native_tick, flush=True)
    if sys.argv[2] == "stop":
        m.stop(timeout=0.5)
        print("stop returned:", m.native_tick, flush=True)
    """
)


@pytest.mark.parametrize(("how", "variant"), [("exit", "limit"), ("exit", "control"), ("stop", "limit")])
def test_a_native_tick_stuck_in_a_driver_call_never_hangs_stop_or_exit(how, variant):
    """A native tick blocked in an enqueue must not hang stop() (which honours its timeout) or interpreter exit
    (the exit hook waits 1 s, then leaves the thread behind). The control waits without a limit at exit: the
    process hangs (killed by the test's timeout)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    try:
        out = subprocess.run(
            [sys.executable, "-c", _BLOCKED_EXIT, variant, how],
            capture_output=True,
            text=True,
            timeout=8 if variant == "control" else 60,  # the control hangs; a normal exit takes ~3 s
            env=env,
        )
    except subprocess.TimeoutExpired:
        assert variant == "control", "the process hung"
        return
    assert variant == "limit", f"the control exited: {out.stdout}"
    assert out.returncode == 0, out.stderr[-800:]
    assert "blocked in a driver call: engaged" in out.stdout
    if how == "stop":
        assert "stop returned: stuck in a driver call at stop()" in out.stdout
    assert "stuck in a driver call" in out.stderr


# ---------------------------------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("native_tick", ["auto", "off"])
def test_cuda_native_tick_reads_graph_replays_exactly(registry, native_tick):
    """The driver path: graph replays bump a guard row while the native thread runs the quiet ticks; every rise is
    handed to Python and confirmed with its exact count, and the quiet ticks between them run no Python. With
    native_tick=off (the control) every tick is Python's."""
    from test_reader import _captured_gather

    m = _quiet_monitor(registry, native_tick=native_tick)
    m.prealloc("cuda")
    s = registry.register("gpu.native")
    ctr = m.counter(s, "cuda")
    g, *_ = _captured_gather(m, ctr, 3)
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
        py_ticks, ticks = _python_ticks(m), m.ticks
        snap = m.drain()
    finally:
        m.stop()
    assert snap[("cuda:0", "gpu.native")].count == 165
    if native_tick == "auto":
        assert _native_ticks(m) > 150 and py_ticks < 40, (_native_ticks(m), py_ticks, ticks)
    else:
        assert _native_ticks(m) == 0 and py_ticks > 150
