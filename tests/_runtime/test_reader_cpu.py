"""The reader's CPU-side contract (the rest of tests/_runtime/test_reader.py needs a GPU): which driver calls keep the GIL."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from tripwire._runtime.reader import Driver

# ctypes marks a foreign function that keeps the GIL (a PyDLL one) with this flag.
_KEEPS_GIL = ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]
ENQUEUE = ("memcpy_dtoh_async", "event_record")
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
    for name in ("device_get", "primary_ctx_retain"):
        assert not getattr(built, name)._flags_ & _KEEPS_GIL, name
