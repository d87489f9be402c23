"""The native quiet tick: building ``tick.c`` and driving its thread (see the C file for why it exists).

The library is compiled on first use with the C compiler Triton itself needs on a GPU machine (``$CC``, else
``cc``/``gcc``/``clang``), into ``$XDG_CACHE_HOME/tripwire`` (else ``~/.cache/tripwire``, else a private temp dir),
keyed by the source, the loader's struct layout, the machine and the C library; later processes load the cached
file, and one that does not load or match the layout is rebuilt once. It needs no CUDA headers or libraries and no Python
headers: the driver's entry points are handed over as addresses of the ``libcuda.so.1`` the reader already loaded.

Nothing here runs at import: :func:`library` builds or loads on the first ``Monitor.start()`` that wants it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..reader import DeviceReader


log = logging.getLogger("tripwire")

SRC = Path(__file__).with_name("tick.c")
_MAX_DEVICES = 64
_TRACE = 8192

# Why an engagement ended (tick.c's TW_* reasons).
TIMEOUT, CHANGED, ERROR, KICKED = 0, 1, 2, 3
_CALLS = {1: "cuEventQuery", 2: "cuMemcpyDtoHAsync", 3: "cuEventRecord", 4: "cuCtxPushCurrent"}

_vp, _i64, _u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64


class _Dev(ctypes.Structure):
    """tick.c's tw_dev, field for field (the loader checks the sizes agree)."""

    _fields_ = [
        ("query", _vp),
        ("copy", _vp),
        ("record", _vp),
        ("push", _vp),
        ("pop", _vp),
        ("ctx", _vp),
        ("stream", _vp),
        ("event", _vp),
        ("src", _u64),
        ("mirror", _vp),
        ("ref", _vp),
        ("row_bytes", _i64),
        ("has_ref", _i64),
        ("pending", _i64),
        ("copies", _i64),
        ("bytes", _i64),
        ("quiet", _i64),
        ("err", _i64),
        ("err_call", _i64),
    ]


class _Cfg(ctypes.Structure):
    """tick.c's tw_cfg, field for field."""

    _fields_ = [
        ("interval_ns", _i64),
        ("idle_tail_ns", _i64),
        ("n_rows", _i64),
        ("active", _vp),
        ("last_active_ns", _i64),
        ("ndev", _i64),
        ("devs", _vp),
        ("relax", _vp),
        ("relax_err", _i64),
        ("ticks", _i64),
        ("idle_skips", _i64),
        ("last_tick_ns", _i64),
        ("reason", _i64),
        ("changed_dev", _i64),
        ("trace_on", _i64),
        ("trace_n", _i64),
        ("trace", _i64 * (2 * _TRACE)),
    ]


def _ns(seconds: float) -> int:
    """Seconds as int64 nanoseconds for tick.c, clamped: ctypes wraps a larger int silently (1e10 s would become a
    negative idle tail), and C adds them to CLOCK_MONOTONIC now (2**61 ns is 73 years)."""
    return max(1, min(round(seconds * 1e9), 1 << 61))


class NativeUnavailable(RuntimeError):
    """The native tick cannot be built or loaded here (the message says why)."""


_lib_lock = threading.Lock()
_lib: ctypes.CDLL | NativeUnavailable | None = None


def private_dir(d: Path) -> bool:
    """``d`` exists or was made, and is ours and writable by no one else (a shared temp dir could be planted)."""
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = d.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022 and os.access(d, os.W_OK)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for d in (Path(base) / "tripwire", Path(tempfile.gettempdir()) / f"tripwire-{os.getuid()}"):
        if private_dir(d):
            return d
    raise NativeUnavailable("no private, writable cache directory for the native tick library")


def _compiler() -> list[str]:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise NativeUnavailable("no C compiler found ($CC, cc, gcc, clang)")
    return shlex.split(cc)  # CC may carry arguments ("ccache gcc")


def layout() -> list[int]:
    """The loader's view of tick.c's layout: sizes, and offsets of the fields most likely to move."""
    return [
        ctypes.sizeof(_Dev),
        ctypes.sizeof(_Cfg),
        _Dev.pending.offset,
        _Dev.err_call.offset,
        _Cfg.relax.offset,
        _Cfg.trace.offset,
    ]


def compile_library(so: Path) -> None:
    cc = _compiler()
    # Written under a private temporary name and renamed: a concurrent process (one per rank, maybe on another host
    # sharing the home directory) never loads half a file.
    fd, tmp_name = tempfile.mkstemp(prefix=so.name + ".", suffix=".tmp", dir=so.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    cmd = [*cc, "-O2", "-shared", "-fPIC", "-pthread", str(SRC), "-o", str(tmp)]
    try:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeUnavailable(f"compiling the native tick failed ({' '.join(cmd)}): {e}") from None
        if res.returncode != 0:
            raise NativeUnavailable(f"compiling the native tick failed ({' '.join(cmd)}): {res.stderr.strip()[-800:]}")
        os.replace(tmp, so)
    finally:
        tmp.unlink(missing_ok=True)


def load(so: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(so))  # CDLL: every call releases the GIL (tw_wait, tw_pause and tw_stop wait)
    lib.tw_new.argtypes, lib.tw_new.restype = [ctypes.POINTER(_Cfg)], _vp
    for name in ("tw_engage", "tw_kick", "tw_free"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [_vp], None
    for name in ("tw_pause", "tw_stop"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [_vp, _i64], ctypes.c_int
    lib.tw_wait.argtypes, lib.tw_wait.restype = [_vp, _i64], _i64
    lib.tw_cpu_ns.argtypes, lib.tw_cpu_ns.restype = [_vp], _i64
    lib.tw_layout.argtypes, lib.tw_layout.restype = [ctypes.POINTER(_i64)], None
    out = (_i64 * 6)()
    lib.tw_layout(out)
    if list(out) != layout():
        raise NativeUnavailable(f"{so}: struct layout {list(out)} differs from the loader's {layout()}")
    return lib


def cached_path() -> Path:
    # The key covers what the file depends on: the source, the loader's layout, the machine and the C library (a
    # home directory shared by hosts with different glibc versions must not share one file).
    ident = repr((layout(), platform.machine(), platform.libc_ver())).encode()
    key = hashlib.sha256(SRC.read_bytes() + ident).hexdigest()[:16]
    return _cache_dir() / f"tick-{key}.so"


def build() -> ctypes.CDLL:
    so = cached_path()
    if not so.exists():
        compile_library(so)
    try:
        return load(so)
    except (OSError, NativeUnavailable) as first:
        # A cached file this host cannot use (damaged, or built elsewhere): build it again, once, here. This process
        # loads the new file under a private name: dlopen would hand back the library already mapped for `so`.
        fd, private = tempfile.mkstemp(prefix=so.stem + ".", suffix=".so", dir=so.parent)
        os.close(fd)
        try:
            compile_library(so)
            shutil.copyfile(so, private)
            return load(Path(private))
        except OSError as e:
            raise NativeUnavailable(f"loading {so} failed: {e} (first attempt: {first})") from None
        finally:
            os.unlink(private)  # a mapped library stays mapped


def library() -> ctypes.CDLL:
    """The loaded native tick library, built on first use. Raises :class:`NativeUnavailable` (every call after a
    failure raises the same, without retrying the build)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                _lib = build()
            except NativeUnavailable as e:
                _lib = e
        if isinstance(_lib, NativeUnavailable):
            raise _lib
        return _lib


def host_functions() -> tuple[int, int, int]:
    """The addresses of tick.c's memcpy "driver" (query, copy, record) for CPU arenas."""
    lib = library()
    return tuple(ctypes.cast(getattr(lib, f), _vp).value for f in ("tw_host_query", "tw_host_copy", "tw_host_record"))  # type: ignore[return-value]


class NativeTicker:
    """A native thread that runs quiet ticks over a set of readers while "engaged".

    Protocol (the Monitor's lock serialises the Python side): :meth:`engage` hands the readers' copy state to the
    thread; it ticks every ``interval`` until a landed copy differs from the reference rows (CHANGED), a driver call
    fails (ERROR), or :meth:`pause` takes the readers back. :meth:`wait` blocks the caller (GIL released) until
    one of those or a timeout. After the engagement ends, :meth:`detach` folds the thread's statistics into the
    readers and hands each reader's in-flight copy back to it; only then may Python touch the readers again.

    It does NOT decode, confirm or report anything (a changed copy goes back to Python untouched), and it never
    waits on the GPU.
    """

    def __init__(self, interval: float, idle_tail: float, active: bytearray, n_rows: int) -> None:
        self._lib = library()
        self.cfg = _Cfg()
        self.cfg.interval_ns = _ns(interval)
        self.cfg.idle_tail_ns = _ns(idle_tail)
        self.cfg.n_rows = n_rows
        # The bytearray check() writes: its buffer cannot move while this ctypes view exports it.
        self._active_view = (ctypes.c_uint8 * 1).from_buffer(active)
        self.cfg.active = ctypes.addressof(self._active_view)
        self.cfg.relax_err = -1
        self.devs = (_Dev * _MAX_DEVICES)()
        self.cfg.devs = ctypes.addressof(self.devs)
        self._refs: dict[int, np.ndarray] = {}  # id(reader) -> reference rows (capacity rows), kept alive here
        self._attached: list[DeviceReader] = []
        self._handle = self._lib.tw_new(ctypes.byref(self.cfg))
        if not self._handle:
            raise NativeUnavailable("tw_new failed (no memory, or pthread_create failed)")
        self._closed = False
        self.forked = False  # inherited by a forked child: never call into it there

    @property
    def attached(self) -> bool:
        return bool(self._attached)

    def set_rows(self, n_rows: int) -> None:
        """Rows to copy from the next tick on (sites registered while engaged). An aligned 8-byte store."""
        self.cfg.n_rows = n_rows

    def engage(
        self,
        readers: list[DeviceReader],
        refs: list[np.ndarray | None],
        *,
        n_rows: int,
        capacity: int,
        last_active: float,
        relax: int | None,
    ) -> None:
        if self.attached:
            raise RuntimeError("tripwire: the native ticker is already engaged")
        if len(readers) > _MAX_DEVICES:
            raise NativeUnavailable(f"{len(readers)} devices, more than the native tick's {_MAX_DEVICES}")
        try:
            for i, (reader, ref) in enumerate(zip(readers, refs, strict=True)):
                self._attach(i, reader, ref, capacity)
        except BaseException:
            self.detach()  # the readers set up so far get their copy state back
            raise
        self.cfg.ndev = len(readers)
        self.cfg.n_rows = n_rows
        self.cfg.last_active_ns = round(last_active * 1e9)
        self.cfg.relax = relax
        self._lib.tw_engage(self._handle)

    def _attach(self, i: int, reader: DeviceReader, ref: np.ndarray | None, capacity: int) -> None:
        """Set up device row ``i`` for ``reader`` and take its copy in flight (the last step: nothing can fail after
        the reader's state moved here)."""
        d = self.devs[i]
        q, c, r, *rest = reader.native_fields()
        if q is None or c is None or r is None:  # a CPU arena: this library's memcpy "driver" for what it leaves out
            hq, hc, hr = host_functions()
            q, c, r = q or hq, c or hc, r or hr
        (d.query, d.copy, d.record, d.push, d.pop, d.ctx, d.stream, d.event, d.src, d.mirror) = (q, c, r, *rest)
        buf = self._refs.get(id(reader))
        if buf is None or buf.shape[0] < capacity:
            buf = self._refs[id(reader)] = np.zeros((capacity, reader.arena.shape[1]), dtype=np.int64)
        if ref is None:
            d.has_ref = 0
        else:
            # The rows Python processed last; zero past them (rows registered later start at zero).
            buf[: ref.shape[0]] = ref
            buf[ref.shape[0] :] = 0
            d.has_ref = 1
        d.ref = buf.ctypes.data
        d.row_bytes = reader.arena.shape[1] * reader.arena.element_size()
        d.copies = d.bytes = d.quiet = d.err = d.err_call = 0
        d.pending = reader.take_pending()
        reader.native_dev = d
        self._attached.append(reader)

    def wait(self, timeout: float) -> int:
        """Block (GIL released) until the engagement ends (CHANGED, ERROR), :meth:`kick`, or ``timeout`` seconds
        (TIMEOUT, still engaged)."""
        return int(self._lib.tw_wait(self._handle, _ns(timeout) if timeout > 0 else 0))

    def kick(self) -> None:
        self._lib.tw_kick(self._handle)

    def pause(self, timeout: float | None = None) -> bool:
        """End the engagement and wait until no native tick runs (microseconds, never the GPU: a tick only queries
        and enqueues). With ``timeout``, give up after that many seconds. True when no tick runs (the readers may
        be detached), False when one is still in a driver call that blocks (they must not be)."""
        return self._lib.tw_pause(self._handle, -1 if timeout is None else _ns(timeout)) == 0

    def detach(self) -> tuple[int, int, int, str | None]:
        """After the engagement ended: give each reader its in-flight copy and statistics back. Returns (ticks,
        idle skips, quiet reads) made natively since engage, and the error that ended it (None if none)."""
        error = None
        if self.cfg.reason == ERROR:
            i = self.cfg.changed_dev
            if i < 0:
                error = f"cuThreadExchangeStreamCaptureMode failed with CUDA driver error {self.cfg.relax_err}"
            else:
                d = self.devs[i]
                what = _CALLS.get(d.err_call, "a driver call")
                error = f"{what} on {self._attached[i].name} failed with CUDA driver error {d.err}"
        quiet = 0
        for i, reader in enumerate(self._attached):
            d = self.devs[i]
            reader.native_dev = None
            reader.give_back(d.pending, d.copies, d.bytes)
            quiet += d.quiet
            d.pending = d.copies = d.bytes = d.quiet = 0
        ticks, idle = self.cfg.ticks, self.cfg.idle_skips
        self.cfg.ticks = self.cfg.idle_skips = 0
        self.cfg.reason = TIMEOUT
        self._attached = []
        return ticks, idle, quiet, error

    @property
    def last_active(self) -> float:
        return float(self.cfg.last_active_ns) / 1e9

    def last_tick(self) -> float | None:
        """When the native thread last ticked (monotonic seconds, the clock of ``time.monotonic``), None before its
        first tick. Read racily: an aligned 8-byte load."""
        ns = int(self.cfg.last_tick_ns)
        return ns / 1e9 if ns else None

    def live(self) -> tuple[int, int, int]:
        """(ticks, idle skips, quiet reads) since engage, read racily while the thread may be ticking."""
        quiet = sum(self.devs[i].quiet for i in range(len(self._attached)))
        return int(self.cfg.ticks), int(self.cfg.idle_skips), quiet

    def trace(self, on: bool | None = None) -> np.ndarray:
        """The tick spans kept in the ring (``[k, 2]`` CLOCK_MONOTONIC ns: start, end), oldest first; ``on``
        switches recording (benchmarks only)."""
        if on is not None:
            self.cfg.trace_on = int(on)
        n = int(self.cfg.trace_n)
        ring = np.ctypeslib.as_array(self.cfg.trace).reshape(_TRACE, 2)
        if n <= _TRACE:
            return ring[:n].copy()
        k = n % _TRACE
        return np.concatenate([ring[k:], ring[:k]])

    def cpu_s(self) -> float | None:
        """The native thread's CPU time so far (s), or None (benchmarks)."""
        ns = -1 if self._closed or not self._handle else int(self._lib.tw_cpu_ns(self._handle))
        return None if ns < 0 else ns / 1e9

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the native thread and join it, waiting at most ``timeout`` seconds; the readers' state is left as
        it is. False when the thread is still in a driver call past the limit (it is left to finish on its own)."""
        return self._lib.tw_stop(self._handle, -1 if timeout is None else _ns(timeout)) == 0

    def close(self, timeout: float | None = None) -> bool:
        """:meth:`stop`, and mark the ticker closed. The C struct stays valid (kick, pause and wait are then
        no-ops) until this object is collected: a concurrent stop() may still hold it; :meth:`__del__` frees it
        (tw_free keeps a thread that never joined)."""
        self._closed = True
        return self.stop(timeout)

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle and not getattr(self, "forked", False):
            self._lib.tw_free(handle)
