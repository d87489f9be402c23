"""The native quiet tick: building ``tick.c`` and driving its thread (see the C file for why it exists).

The library is compiled on first use with the C compiler Triton itself needs on a GPU machine (``$CC``, else
``cc``/``gcc``/``clang``), into ``$XDG_CACHE_HOME/tripwire`` (else ``~/.cache/tripwire``, else the temp dir), keyed by
the source's hash; later processes load the cached file. It needs no CUDA headers or libraries and no Python
headers: the driver's entry points are handed over as addresses of the ``libcuda.so.1`` the reader already loaded.

Nothing here runs at import: :func:`library` builds or loads on the first ``Monitor.start()`` that wants it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..reader import DeviceReader

__all__ = ["NativeTicker", "NativeUnavailable", "library"]

log = logging.getLogger("tripwire")

_SRC = Path(__file__).with_name("tick.c")
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
        ("reason", _i64),
        ("changed_dev", _i64),
        ("trace_on", _i64),
        ("trace_n", _i64),
        ("trace", _i64 * (2 * _TRACE)),
    ]


class NativeUnavailable(RuntimeError):
    """The native tick cannot be built or loaded here (the message says why)."""


_lib_lock = threading.Lock()
_lib: ctypes.CDLL | NativeUnavailable | None = None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for d in (Path(base) / "tripwire", Path(tempfile.gettempdir()) / f"tripwire-{os.getuid()}"):
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise NativeUnavailable("no writable cache directory for the native tick library")


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise NativeUnavailable("no C compiler found ($CC, cc, gcc, clang)")
    return cc


def _build() -> ctypes.CDLL:
    src = _SRC.read_bytes()
    key = hashlib.sha256(src + platform.machine().encode()).hexdigest()[:16]
    so = _cache_dir() / f"tick-{key}.so"
    if not so.exists():
        cc = _compiler()
        # Written under a private name and renamed: a concurrent process (one per rank) never loads half a file.
        tmp = so.with_name(f"{so.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        cmd = [cc, "-O2", "-shared", "-fPIC", "-pthread", str(_SRC), "-o", str(tmp)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeUnavailable(f"compiling the native tick failed ({' '.join(cmd)}): {e}") from None
        if res.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise NativeUnavailable(f"compiling the native tick failed ({' '.join(cmd)}): {res.stderr.strip()[-800:]}")
        os.replace(tmp, so)
    try:
        lib = ctypes.CDLL(str(so))  # CDLL: every call releases the GIL (tw_wait and tw_pause wait)
    except OSError as e:
        raise NativeUnavailable(f"loading {so} failed: {e}") from None
    lib.tw_new.argtypes, lib.tw_new.restype = [ctypes.POINTER(_Cfg)], _vp
    for name in ("tw_engage", "tw_kick", "tw_stop", "tw_free"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [_vp], None
    lib.tw_pause.argtypes, lib.tw_pause.restype = [_vp], ctypes.c_int
    lib.tw_wait.argtypes, lib.tw_wait.restype = [_vp, _i64], _i64
    lib.tw_cpu_ns.argtypes, lib.tw_cpu_ns.restype = [_vp], _i64
    lib.tw_sizes.argtypes, lib.tw_sizes.restype = [ctypes.POINTER(_i64), ctypes.POINTER(_i64)], None
    dev_size, cfg_size = _i64(), _i64()
    lib.tw_sizes(ctypes.byref(dev_size), ctypes.byref(cfg_size))
    if (dev_size.value, cfg_size.value) != (ctypes.sizeof(_Dev), ctypes.sizeof(_Cfg)):
        raise NativeUnavailable(
            f"{so}: struct sizes {dev_size.value}/{cfg_size.value} differ from the loader's "
            f"{ctypes.sizeof(_Dev)}/{ctypes.sizeof(_Cfg)}"
        )
    return lib


def library() -> ctypes.CDLL:
    """The loaded native tick library, built on first use. Raises :class:`NativeUnavailable` (every call after a
    failure raises the same, without retrying the build)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                _lib = _build()
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
        self.cfg.interval_ns = max(1, round(interval * 1e9))
        self.cfg.idle_tail_ns = round(idle_tail * 1e9)
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
        for i, (reader, ref) in enumerate(zip(readers, refs, strict=True)):
            d = self.devs[i]
            (d.query, d.copy, d.record, d.push, d.pop, d.ctx, d.stream, d.event, d.src, d.mirror) = (
                reader.native_fields()
            )
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
            d.pending = reader.take_pending()
            d.copies = d.bytes = d.quiet = d.err = d.err_call = 0
            reader.native_dev = d
        self._attached = list(readers)
        self.cfg.ndev = len(readers)
        self.cfg.n_rows = n_rows
        self.cfg.last_active_ns = round(last_active * 1e9)
        self.cfg.relax = relax
        self._lib.tw_engage(self._handle)

    def wait(self, timeout: float) -> int:
        """Block (GIL released) until the engagement ends (CHANGED, ERROR), :meth:`kick`, or ``timeout`` seconds
        (TIMEOUT, still engaged)."""
        return int(self._lib.tw_wait(self._handle, max(0, round(timeout * 1e9))))

    def kick(self) -> None:
        self._lib.tw_kick(self._handle)

    def pause(self) -> None:
        """End the engagement (waits for a tick in progress: microseconds, never the GPU)."""
        self._lib.tw_pause(self._handle)

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
        ns = -1 if self._closed else int(self._lib.tw_cpu_ns(self._handle))
        return None if ns < 0 else ns / 1e9

    def stop(self) -> None:
        """Stop and join the native thread (idempotent); the readers' state is left as it is."""
        if not self._closed:
            self._lib.tw_stop(self._handle)

    def close(self) -> None:
        """Stop the thread and free it. Only once no thread can be in :meth:`wait`."""
        if not self._closed:
            self._closed = True
            self._lib.tw_free(self._handle)
            self._handle = None
