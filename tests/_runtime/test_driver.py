"""The one libcuda binding (tripwire._runtime.driver), on the CPU: which driver calls keep the GIL (the reader's
tick, the verdict's enqueue, the capture-mode exchange), and that the callers take theirs from it."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from tripwire._runtime.driver import CAPTURE_MODE_EXCHANGE, NATIVE, Driver

# ctypes marks a foreign function that keeps the GIL (a PyDLL one) with this flag.
_KEEPS_GIL = ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]
ENQUEUE = ("memcpy_dtoh_async", "event_record", "graph_launch")
NON_BLOCKING = ("ctx_push", "ctx_pop", "event_query")


class _AnySymbol:
    """A stand-in for libcuda without a GPU: every driver symbol resolves to libc's ``getpid``, through the given
    library class, so the function objects carry that class's GIL flag."""

    def __init__(self, cls: type[ctypes.CDLL]) -> None:
        self._lib = cls(ctypes.util.find_library("c"))

    def __getattr__(self, name: str) -> object:
        return self._lib["getpid"]


@pytest.fixture
def drivers() -> tuple[Driver, Driver]:
    """(as built: PyDLL for the calls that cannot block, CDLL for the rest; control: everything through PyDLL)."""
    keeps, releases = _AnySymbol(ctypes.PyDLL), _AnySymbol(ctypes.CDLL)
    return Driver(keeps, releases), Driver(keeps, keeps)  # type: ignore[arg-type]


def test_enqueue_calls_release_the_gil_and_the_rest_keep_it(drivers) -> None:
    """An enqueue can block (a hardware queue shared with a hung compute stream, a driver lock): with the GIL held
    that would freeze every Python thread of the engine. The calls that cannot block keep it (no mid-tick hand-off).
    Control: the all-PyDLL driver holds the GIL in the enqueues too."""
    built, control = drivers
    for name in ENQUEUE:
        assert not getattr(built, name)._flags_ & _KEEPS_GIL, name
        assert getattr(control, name)._flags_ & _KEEPS_GIL, name
    for name in NON_BLOCKING:
        assert getattr(built, name)._flags_ & _KEEPS_GIL, name
    for name in ("device_get", "primary_ctx_retain", "stream_create", "event_query_released", "capture_mode_exchange"):
        assert not getattr(built, name)._flags_ & _KEEPS_GIL, name


def test_the_binding_types_each_call(drivers) -> None:
    """Every entry point returns a CUresult (int) and takes what the callers pass, the raw addresses include the
    native tick's five and the capture-mode exchange."""
    built, _ = drivers
    assert built.graph_launch.argtypes == [ctypes.c_void_p, ctypes.c_void_p]
    assert built.event_query_released.argtypes == built.event_query.argtypes == [ctypes.c_void_p]
    assert built.capture_mode_exchange.argtypes == [ctypes.POINTER(ctypes.c_int)]
    assert all(getattr(built, n).restype is ctypes.c_int for n in (*ENQUEUE, *NON_BLOCKING, "capture_mode_exchange"))
    assert set(built.raw) == {*NATIVE, CAPTURE_MODE_EXCHANGE} and all(isinstance(v, int) for v in built.raw.values())


def test_the_callers_share_one_driver(monkeypatch) -> None:
    """The verdict's graph driver and the capture-mode exchange are the process's Driver.get(): a stand-in set there
    is what both get. Control: a graph without a raw handle gets no driver (torch's calls then)."""
    import types

    from tripwire._runtime import capture, verdict_kernel

    keeps, releases = _AnySymbol(ctypes.PyDLL), _AnySymbol(ctypes.CDLL)
    stand_in = Driver(keeps, releases)  # type: ignore[arg-type]
    monkeypatch.setattr(Driver, "_instance", stand_in)
    monkeypatch.setattr(capture, "_exchange_fn", None)
    monkeypatch.setattr(capture, "_exchange_how", "")
    graph = types.SimpleNamespace(raw_cuda_graph_exec=lambda: 0)
    assert verdict_kernel.graph_driver([graph, graph]) is stand_in
    assert capture._lookup_exchange() is stand_in.capture_mode_exchange
    assert verdict_kernel.graph_driver([graph, object()]) is None
