"""The one binding of the CUDA driver (``libcuda.so.1``) through ctypes: every driver entry point the machinery calls
from Python, typed once, and their raw addresses for the native tick.

Who calls what: the reader's tick (:mod:`tripwire._runtime.reader`: context push and pop, event query, the
device-to-host copy and event record, and at set-up the device, its primary context and a stream of its own), the
same-step verdict's eager enqueue (:mod:`tripwire.verdict`: graph launch, event record, event query) and the
capture-mode exchange (:mod:`tripwire._runtime.capture`, whose runtime ``libcudart`` fallback is its own).

The library is loaded twice over, as two views of the same code: functions taken from the ``ctypes.PyDLL`` view keep
the GIL for the call, those from the ``ctypes.CDLL`` view release it. A call that cannot block (a thread-local
context stack, an event's status) keeps it, so the tick is not handed to another thread mid-way; a call that
enqueues can block (a hardware queue shared with a busy or hung compute stream, a driver lock another thread holds)
and releases it, so a blocked enqueue never freezes the engine's Python (:mod:`tripwire._runtime.reader` says more).

Nothing is loaded at import: :meth:`Driver.get` loads the library at its first call (under a lock, once per process)
and hands back None where it cannot be loaded or lacks an entry point (callers then take torch's path).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

LIBRARY = "libcuda.so.1"
SUCCESS = 0  # CUDA_SUCCESS
NOT_READY = 600  # CUDA_ERROR_NOT_READY

# Entry points whose raw addresses the native quiet tick (tripwire._runtime.native) calls from its own thread.
NATIVE = ("cuEventQuery", "cuMemcpyDtoHAsync_v2", "cuEventRecord", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2")
# CUDA >= 10.1; without it the capture mode cannot be relaxed through the driver (never an error here).
CAPTURE_MODE_EXCHANGE = "cuThreadExchangeStreamCaptureMode"


def _bind(lib: Any, name: str, *argtypes: Any) -> Any:
    f = getattr(lib, name)
    f.argtypes = list(argtypes)
    f.restype = ctypes.c_int
    return f


class Driver:
    """The driver's entry points, typed. ``keeps_gil`` and ``releases_gil`` are the library's PyDLL and CDLL views
    (a test passes stand-ins); which view each call comes from is the module docstring's rule."""

    _lock = threading.Lock()
    _instance: Driver | bool | None = False  # False: not looked up yet

    def __init__(self, keeps_gil: ctypes.CDLL, releases_gil: ctypes.CDLL) -> None:
        vp, u64, sz, i = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int
        # Set-up calls (once per device, may initialise the context): release the GIL.
        self.device_get = _bind(releases_gil, "cuDeviceGet", ctypes.POINTER(i), i)
        self.stream_create = _bind(releases_gil, "cuStreamCreate", ctypes.POINTER(vp), ctypes.c_uint)
        self.primary_ctx_retain = _bind(releases_gil, "cuDevicePrimaryCtxRetain", ctypes.POINTER(vp), i)
        # The reader's tick, cannot block: keep the GIL.
        self.ctx_push = _bind(keeps_gil, "cuCtxPushCurrent_v2", vp)
        self.ctx_pop = _bind(keeps_gil, "cuCtxPopCurrent_v2", ctypes.POINTER(vp))
        self.event_query = _bind(keeps_gil, "cuEventQuery", vp)
        # Enqueues, can block: release the GIL (the reader's tick and the verdict's enqueue share the record).
        self.memcpy_dtoh_async = _bind(releases_gil, "cuMemcpyDtoHAsync_v2", vp, u64, sz, vp)
        self.event_record = _bind(releases_gil, "cuEventRecord", vp, vp)
        self.graph_launch = _bind(releases_gil, "cuGraphLaunch", vp, vp)
        # The verdict's poll of its slot's event releases the GIL, as the verdict's other driver calls do; each view
        # has its own function object, so this binding and the tick's never share argtypes.
        self.event_query_released = _bind(releases_gil, "cuEventQuery", vp)
        mode_fn = getattr(releases_gil, CAPTURE_MODE_EXCHANGE, None)
        # The capture-mode exchange (tripwire._runtime.capture), or None where the driver predates it.
        self.capture_mode_exchange = _bind(releases_gil, CAPTURE_MODE_EXCHANGE, ctypes.POINTER(i)) if mode_fn else None
        # The same entry points as raw addresses, for the native quiet tick, which calls them without Python.
        self.raw: dict[str, int | None] = {
            name: ctypes.cast(getattr(releases_gil, name), ctypes.c_void_p).value for name in NATIVE
        }
        self.raw[CAPTURE_MODE_EXCHANGE] = ctypes.cast(mode_fn, ctypes.c_void_p).value if mode_fn else None

    @classmethod
    def get(cls) -> Driver | None:
        """The process's driver, loaded at the first call; None where ``libcuda.so.1`` cannot be loaded or lacks an
        entry point above (the callers' torch paths then)."""
        with cls._lock:
            if cls._instance is False:
                try:
                    cls._instance = Driver(ctypes.PyDLL(LIBRARY), ctypes.CDLL(LIBRARY))
                except (OSError, AttributeError):
                    cls._instance = None
            return cls._instance  # type: ignore[return-value]
