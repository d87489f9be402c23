"""CUDA-graph capture awareness: "is this stream capturing?" and the reader thread's capture interaction mode.

Why the reader relaxes its own mode: under the default ``cudaStreamCaptureModeGlobal`` (what ``torch.cuda.graph``
uses), while *any* thread captures, a "potentially unsafe" call from *any other* thread (``cudaEventQuery``,
``cudaMemcpyAsync`` to pageable memory, ``cudaMalloc``...) invalidates that capture. A reader polling events
during the engine's captures would break them. The mode is per thread: setting the reader thread's to relaxed makes
its calls exempt without touching the engine's capture semantics (benchmarks/RESULTS.md, q7, counts the captures a
plain reader thread breaks and tripwire's does not).

The mode lives in the driver (the runtime entry point forwards to it), so we call the driver's
``cuThreadExchangeStreamCaptureMode`` from ``libcuda.so.1`` (the one library every CUDA process shares, bound in
:mod:`tripwire._runtime.driver`); if that is missing we try the runtime ``libcudart`` that torch loaded; if neither
works, the caller falls back to pausing during captures it can see (:func:`install_capture_watch`).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from .driver import CAPTURE_MODE_EXCHANGE, LIBRARY, Driver

log = logging.getLogger("tripwire")

# cudaStreamCaptureMode / CUstreamCaptureMode values (identical in runtime and driver).
CAPTURE_MODE_GLOBAL = 0
CAPTURE_MODE_THREAD_LOCAL = 1
CAPTURE_MODE_RELAXED = 2


def is_capturing() -> bool:
    """True when the current CUDA stream is capturing a graph.

    Never initialises CUDA: a process that has not touched CUDA cannot be capturing. ``cudaStreamIsCapturing`` is
    legal during a capture, so this is safe to call anywhere.
    """
    if not torch.cuda.is_initialized():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


_lib_lock = threading.Lock()
_exchange_fn: object = None  # ctypes function, False when unavailable, None when not looked up yet
_exchange_how = ""


def _find_loaded(prefix: str) -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if prefix in line and "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if p.rsplit("/", 1)[-1].startswith(prefix))


def _lookup_exchange() -> object:
    global _exchange_fn, _exchange_how
    with _lib_lock:
        if _exchange_fn is not None:
            return _exchange_fn
        drv = Driver.get()
        if drv is not None and drv.capture_mode_exchange is not None:
            _exchange_fn, _exchange_how = drv.capture_mode_exchange, f"{CAPTURE_MODE_EXCHANGE} in {LIBRARY}"
            return _exchange_fn
        # The runtime's own entry point, from the libcudart this process loaded (the driver binding is libcuda's).
        for lib_name in _find_loaded("libcudart"):
            sym = "cudaThreadExchangeStreamCaptureMode"
            try:
                fn = getattr(ctypes.CDLL(lib_name), sym)
            except (OSError, AttributeError):
                continue
            fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
            fn.restype = ctypes.c_int
            _exchange_fn, _exchange_how = fn, f"{sym} in {lib_name}"
            return fn
        _exchange_fn = False
        return False


def exchange_capture_mode(mode: int) -> int:
    """Set the calling thread's capture interaction mode; return the previous one. RuntimeError if impossible."""
    fn = _lookup_exchange()
    if fn is False:
        raise RuntimeError("neither libcuda.so.1 nor a loaded libcudart offers the capture-mode exchange")
    value = ctypes.c_int(mode)
    rc = fn(ctypes.byref(value))  # type: ignore[operator]
    if rc != 0:
        raise RuntimeError(f"{_exchange_how} returned error {rc}")
    return value.value


def relax_thread_capture_mode() -> str | None:
    """Make the calling thread's CUDA calls exempt from other threads' global-mode captures.

    Returns how it was done, or None (and logs once) when it cannot be done; the caller must then pause during
    captures it can see. Call it on the thread, before that thread's first CUDA call.
    """
    try:
        exchange_capture_mode(CAPTURE_MODE_RELAXED)
    except RuntimeError as e:
        log.warning(
            "cannot relax the reader thread's CUDA capture mode (%s); the reader will pause during "
            "captures made through torch.cuda.CUDAGraph instead, and a capture made otherwise may be invalidated",
            e,
        )
        return None
    return _exchange_how


_watch_lock = threading.Lock()
_active_captures = 0
_watch_installed = False


def visible_captures() -> int:
    """Number of captures in progress that went through ``torch.cuda.CUDAGraph`` (only counted once the watch is
    installed)."""
    return _active_captures


def install_capture_watch() -> None:
    """Count captures begun and ended through ``torch.cuda.CUDAGraph`` (the fallback when the mode cannot be
    relaxed). Idempotent. Captures made by other means stay invisible; the warning above says so."""
    global _watch_installed
    with _watch_lock:
        if _watch_installed:
            return
        cls = torch.cuda.CUDAGraph
        begin, end = cls.capture_begin, cls.capture_end

        def capture_begin(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            global _active_captures
            with _watch_lock:
                _active_captures += 1
            try:
                return begin(self, *args, **kwargs)
            except BaseException:
                with _watch_lock:
                    _active_captures -= 1
                raise

        def capture_end(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            global _active_captures
            try:
                return end(self, *args, **kwargs)
            finally:
                with _watch_lock:
                    _active_captures -= 1

        cls.capture_begin = capture_begin  # type: ignore[method-assign]
        cls.capture_end = capture_end  # type: ignore[method-assign]
        _watch_installed = True


class PostCaptureHooks:
    """Functions to run once after warm-up and capture (at ``start()``), in registration order; one registered
    after that runs at once. A failing hook is logged and does not stop the others (nor the engine)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fns: list[Callable[[], Any]] = []
        self._ran = 0
        self.started = False

    def register(self, fn: Callable[[], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"a post-capture hook must be callable, got {fn!r}")
        with self._lock:
            self._fns.append(fn)
            run_now = self.started
        if run_now:
            self.run()

    def start(self) -> bool:
        """Mark the start (later hooks run at once); True the first time."""
        with self._lock:
            first, self.started = not self.started, True
        return first

    def run(self) -> None:
        """Run every hook that has not run yet, each once, in registration order."""
        while True:
            with self._lock:
                if self._ran >= len(self._fns):
                    return
                fn = self._fns[self._ran]
                self._ran += 1
            try:
                fn()
            except Exception:
                log.exception("post-capture hook %r failed; continuing with the others", fn)
