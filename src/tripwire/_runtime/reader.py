"""The non-blocking reader of one device's arena.

Per CUDA device: a pinned host mirror, a dedicated side stream and an event, all made at registration (before any
capture). :meth:`DeviceReader.poll` never waits on the GPU: if the previous copy's event has not completed it
returns None at once; otherwise it hands back that copy's rows and enqueues the next copy. The side stream has no
dependency on the compute stream, so a copy runs while compute kernels are still busy (the words it reads are
int64 counters written by atomics: each word is read whole). A synchronous ``.tolist()``/``.item()`` here would
queue behind the whole compute stream, which is what has deadlocked engines whose step waits on the reader's lock.

CPU arenas are read directly (a numpy copy under the GIL).

Fast path: the tick runs on a thread that shares the GIL with the engine, so every microsecond it holds the GIL is
taken from the engine's Python. Issuing the copy through torch (stream context + ``copy_``) runs far more Python per
tick than the same driver calls through ctypes (push context, query, ``cuMemcpyDtoHAsync``, record, pop), so the
tick uses those (bound once, for every caller, in :mod:`tripwire._runtime.driver`). Each ctypes call that releases the GIL hands it to the engine mid-tick, and the reader must then
take it back (CPython forces that switch only after its switch interval, ``sys.getswitchinterval()``): a tick whose
five calls all release waits for up to five switch intervals. So the calls that cannot block -- the event query and
the thread-local context push and pop -- keep the GIL (``ctypes.PyDLL``), like torch's own ``Event.query()``. The two that ENQUEUE
(the copy and the event record) release it (``ctypes.CDLL``): an enqueue can block, on a hardware queue shared
with a busy or hung compute stream (``CUDA_DEVICE_MAX_CONNECTIONS=1``) or on a driver lock another thread holds,
and blocked with the GIL it would freeze every Python thread of the engine -- or deadlock it, where the GPU's
progress waits on one of them. The one blocking wait the reader needs (``discard``) goes through torch, which
releases the GIL. The torch path is kept as the fallback where ``libcuda.so.1`` cannot be loaded.

A landed copy that is byte-for-byte the rows the monitor processed last (the common case: nothing happened since)
is not copied again: :meth:`DeviceReader.poll` hands back the monitor's own array, and the monitor skips the whole
decode, so a quiet tick touches as little code and memory as it can (the reader wakes on a cold core).

Most quiet ticks do not run here at all: the native quiet tick (:mod:`tripwire._runtime.native`) runs them on its own thread,
without the GIL, through the same mirror, stream, event and driver entry points (:meth:`DeviceReader.native_fields`);
a reader hands it its copy in flight (:meth:`DeviceReader.take_pending`) and takes it back on a change
(:meth:`DeviceReader.give_back`).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ..errors import CaptureError, GuardTripped
from .capture import install_capture_watch, is_capturing, relax_thread_capture_mode, visible_captures
from .driver import NOT_READY, SUCCESS, Driver

log = logging.getLogger("tripwire")


def _same_or_copy(fresh: np.ndarray, same_as: np.ndarray | None) -> np.ndarray:
    """``same_as`` itself when ``fresh`` holds the same rows byte for byte, else a private copy of ``fresh``.

    ``tobytes() ==`` is one memcmp of a few KB, cheaper than numpy's array_equal (several Python-level steps)."""
    if same_as is not None and same_as.shape == fresh.shape and same_as.tobytes() == fresh.tobytes():
        return same_as
    return fresh.copy()


def _ok(rc: int, what: str) -> None:
    if rc != SUCCESS:
        raise RuntimeError(f"{what} failed with CUDA driver error {rc}")


_CU_STREAM_NON_BLOCKING = 1


def _private_stream(device: torch.device, driver: Driver | None) -> torch.cuda.Stream:
    """The reader's side stream: a stream of its own, never one torch's pool hands out again.

    ``torch.cuda.Stream()`` takes streams round-robin from a small per-device pool, so an engine that creates
    streams (transformers makes new ones for each continuous-batching manager) eventually gets the reader's: its
    compute, graph captures included, then run on the stream the reader copies and records its event on, and the copy
    queues behind compute (and is captured, which invalidates the reader's event). A stream made with cuStreamCreate
    is nobody else's; it is never destroyed (like the arena, it lives as long as the process). Where the driver cannot
    be loaded, the pool's stream is the fallback, with a warning."""
    if driver is not None:
        handle = ctypes.c_void_p()
        _ok(driver.stream_create(ctypes.byref(handle), _CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        return torch.cuda.ExternalStream(handle.value, device=device)
    log.warning(
        "libcuda could not be loaded, so the reader's side stream comes from torch's stream pool; an "
        "engine that creates many streams may be handed the same one (the reader would then wait behind compute)"
    )
    return torch.cuda.Stream(device)


class DeviceReader:
    """Reads one arena. Not thread-safe by itself: the Monitor serialises calls under its lock."""

    def __init__(self, device: torch.device, arena: torch.Tensor, offenders: torch.Tensor | None = None) -> None:
        self.device = device
        self.name = str(device)
        self.arena = arena
        # The rows' offender blocks (tripwire.layout), copied only for rows a confirmation asks for: a quiet tick
        # copies the rows alone.
        self.offenders = offenders
        self._want: tuple[int, ...] = ()  # rows whose blocks the next copy takes too
        self._pending_off: tuple[int, ...] = ()  # rows whose blocks are in the copy in flight
        self.landed_offenders: dict[int, np.ndarray] = {}  # the blocks the last landed copy brought
        self._copies = 0  # copies started (CUDA) or reads made (CPU), by Python
        self._bytes = 0
        # The native ticker's row for this reader while it is engaged (it owns the copy state then), else None.
        self.native_dev: Any = None
        self._host_mirror: np.ndarray | None = None  # where the native tick's memcpy lands for a CPU arena
        self.lost: BaseException | None = None
        self._pending_rows = 0  # rows of the copy in flight; 0 when none
        self.is_cuda = device.type == "cuda"
        # The ctypes driver the ticks go through; None for a CPU arena, or for the torch fallback (where libcuda
        # cannot be loaded; a test may set it to None to drive that path).
        self.driver: Driver | None = None
        if self.is_cuda:
            if is_capturing():
                raise CaptureError(
                    f"tripwire: the reader for {device} would allocate its pinned mirror, stream and event inside a "
                    f"CUDA-graph capture; call tripwire.prealloc({str(device)!r}) before capturing"
                )
            with torch.cuda.device(device):
                self.mirror = torch.zeros(arena.shape, dtype=arena.dtype, pin_memory=True)
                self._off_mirror = (
                    torch.zeros(offenders.shape, dtype=offenders.dtype, pin_memory=True)
                    if offenders is not None
                    else None
                )
                self.driver = Driver.get()
                self.stream = _private_stream(device, self.driver)
                self.event = torch.cuda.Event()
                self.event.record(self.stream)  # materialise the event handle now, outside any capture
            # A view of the pinned mirror, made once: .numpy() per tick costs a dispatcher round trip.
            self._mirror_np = self.mirror.numpy()
            if self.driver is not None:
                dev_handle = ctypes.c_int()
                _ok(self.driver.device_get(ctypes.byref(dev_handle), device.index), "cuDeviceGet")
                ctx = ctypes.c_void_p()
                _ok(self.driver.primary_ctx_retain(ctypes.byref(ctx), dev_handle.value), "cuDevicePrimaryCtxRetain")
                self._ctx = ctx
                self._stream_h = ctypes.c_void_p(self.stream.cuda_stream)
                self._event_h = ctypes.c_void_p(self.event.cuda_event)
                self._src = self.arena.data_ptr()
                self._dst = self.mirror.data_ptr()
                self._row_bytes = arena.shape[1] * arena.element_size()
            self._off_mirror_np = self._off_mirror.numpy() if self._off_mirror is not None else None

    def status(self) -> dict[str, Any]:
        """``lost`` (why this reader was lost, or None) and ``reads`` (copies made), as plain JSON types."""
        lost = None if self.lost is None else f"{type(self.lost).__name__}: {self.lost}"
        return {"lost": lost, "reads": self.copies}

    @property
    def in_flight(self) -> bool:
        return self._pending_rows > 0

    @property
    def copies(self) -> int:
        """Copies started (CUDA) or reads made (CPU), by Python and the native tick (live while it is engaged)."""
        d = self.native_dev
        return self._copies + (int(d.copies) if d is not None else 0)

    @property
    def bytes_copied(self) -> int:
        d = self.native_dev
        return self._bytes + (int(d.bytes) if d is not None else 0)

    # ------------------------------------------------------------------ the native quiet tick (tripwire._runtime.native)
    @property
    def supports_native(self) -> bool:
        """The native tick can read this arena: a CPU arena (memcpy), or CUDA through the driver (not torch)."""
        return not self.is_cuda or self.driver is not None

    def native_fields(self) -> tuple[int | None, ...]:
        """(query, copy, record, push, pop, ctx, stream, event, src, mirror) for tick.c's tw_dev. A CPU arena has no
        driver: its query, copy and record are None, and the native tick fills in its own memcpy "driver" (this
        module never imports the native one: the dependency runs one way, from tripwire._runtime.native to here)."""
        if not self.is_cuda:
            if self._host_mirror is None:
                self._host_mirror = np.zeros(tuple(self.arena.shape), dtype=np.int64)
            return (
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                self.arena.data_ptr(),
                self._host_mirror.ctypes.data,
            )
        drv = self.driver
        assert drv is not None, "supports_native is False for the torch fallback"
        raw = drv.raw
        return (
            raw["cuEventQuery"],
            raw["cuMemcpyDtoHAsync_v2"],
            raw["cuEventRecord"],
            raw["cuCtxPushCurrent_v2"],
            raw["cuCtxPopCurrent_v2"],
            self._ctx.value,
            self._stream_h.value,
            self._event_h.value,
            self._src,
            self._dst,
        )

    def take_pending(self) -> int:
        """Hand the copy in flight (its row count) to the native tick, which owns it until :meth:`give_back`."""
        rows, self._pending_rows = self._pending_rows, 0
        self._pending_off = ()  # the native tick engages only while nothing waits for offenders
        return rows

    def want_offenders(self, rows: tuple[int, ...]) -> None:
        """Copy these rows' offender blocks with the next copy (a confirmation waits for them)."""
        self._want = rows if self.offenders is not None else ()

    def give_back(self, pending: int, copies: int, nbytes: int) -> None:
        """Take the copy state back from the native tick: its copy in flight (a CUDA copy that may have landed and
        changed: the next :meth:`poll` queries it), and the copies it made. A CPU arena's native copy is dropped:
        the next poll reads the arena itself, which is at least as new."""
        if self.is_cuda:
            self._pending_rows = int(pending)
        self._copies += int(copies)
        self._bytes += int(nbytes)

    def poll(self, n_rows: int, same_as: np.ndarray | None = None) -> np.ndarray | None:
        """The rows of the copy that landed since the last poll (a private numpy copy), or None if it has not
        landed yet; then start the next copy of the first ``n_rows`` rows. Never blocks on the GPU.

        ``same_as``: the rows the caller processed last. When the landed rows equal them byte for byte, that same
        object is returned (no copy made), so the caller can tell "nothing changed" by identity. It does not mean
        the caller may skip work it owes per copy (confirmations count copies): that is the caller's decision."""
        if not self.is_cuda:
            self._copies += 1
            self._bytes += n_rows * self.arena.shape[1] * 8
            if self._want:
                assert self.offenders is not None
                self.landed_offenders = {r: self.offenders[r].numpy().copy() for r in self._want}
            return _same_or_copy(self.arena[:n_rows].numpy(), same_as)
        rows = None
        if self._pending_rows:
            if not self._landed():  # an event query: returns at once, never waits
                return None
            rows = _same_or_copy(self._mirror_np[: self._pending_rows], same_as)
            if self._pending_off:
                assert self._off_mirror_np is not None
                self.landed_offenders = {r: self._off_mirror_np[r].copy() for r in self._pending_off}
            self._pending_rows = 0
        self._start(n_rows)
        return rows

    def _landed(self) -> bool:
        drv = self.driver
        if drv is None:
            return bool(self.event.query())
        rc = drv.event_query(self._event_h)
        if rc == NOT_READY:
            return False
        _ok(rc, "cuEventQuery")
        return True

    def _start(self, n_rows: int) -> None:
        if n_rows <= 0:
            return
        # Only the registered rows travel: bytes scale with what exists, and it is still one copy per device.
        # The side stream does not wait for the compute stream: the copy runs while compute kernels are busy.
        drv = self.driver
        if drv is None:
            with torch.cuda.stream(self.stream):
                self.mirror[:n_rows].copy_(self.arena[:n_rows], non_blocking=True)
                for r in self._want:
                    assert self.offenders is not None and self._off_mirror is not None
                    self._off_mirror[r].copy_(self.offenders[r], non_blocking=True)
                self.event.record(self.stream)
        else:
            _ok(drv.ctx_push(self._ctx), "cuCtxPushCurrent")
            try:
                nbytes = n_rows * self._row_bytes
                _ok(drv.memcpy_dtoh_async(self._dst, self._src, nbytes, self._stream_h), "cuMemcpyDtoHAsync")
                for r in self._want:  # only while a confirmation waits: a few small copies, same stream and event
                    assert self.offenders is not None and self._off_mirror is not None
                    b = self.offenders.shape[1] * 8
                    _ok(
                        drv.memcpy_dtoh_async(
                            self._off_mirror.data_ptr() + r * b, self.offenders.data_ptr() + r * b, b, self._stream_h
                        ),
                        "cuMemcpyDtoHAsync",
                    )
                _ok(drv.event_record(self._event_h, self._stream_h), "cuEventRecord")
            finally:
                drv.ctx_pop(ctypes.byref(ctypes.c_void_p()))
        self._pending_off, self._want = self._want, ()
        self._pending_rows = n_rows
        self._copies += 1
        self._bytes += n_rows * self.arena.shape[1] * 8

    def discard(self) -> None:
        """Wait for (and forget) a copy in flight. Blocking: only for drain and reset, never the step path."""
        if self.is_cuda and self._pending_rows:
            self.event.synchronize()  # same handle as the driver path records into
        self._pending_rows = 0
        self._pending_off, self.landed_offenders = (), {}

    def read_now(self, n_rows: int) -> np.ndarray:
        """A complete, blocking read: synchronise the device (so every kernel enqueued so far has run), then copy
        through the mirror. For drain only, never the step path. The offender blocks of the rows with a count come
        with it (:attr:`landed_offenders`)."""
        if not self.is_cuda:
            rows = self.arena[:n_rows].numpy().copy()
            if self.offenders is not None:
                self.landed_offenders = {
                    r: self.offenders[r].numpy().copy() for r in np.nonzero(rows[:, 0])[0].tolist()
                }
            return rows
        self.discard()
        torch.cuda.synchronize(self.device)
        self._start(n_rows)
        self.stream.synchronize()
        rows = self._mirror_np[:n_rows].copy()
        self._pending_rows = 0
        if self.offenders is not None:
            hit = np.nonzero(rows[:, 0])[0].tolist()  # host rows (numpy): no device read
            if hit:
                self._want = tuple(hit)
                self._start(n_rows)
                self.stream.synchronize()
                assert self._off_mirror_np is not None
                self.landed_offenders = {r: self._off_mirror_np[r].copy() for r in hit}
                self._pending_rows, self._pending_off = 0, ()
        return rows


class Readers:
    """A monitor's device readers, and how the reader thread relaxed its CUDA capture mode.

    The capture mode is per THREAD: each thread that reads (the reader thread, restarted after a stop; a tool's
    poll) relaxes its own once, before its first CUDA call. Where it cannot be relaxed, reads pause while a capture
    made through ``torch.cuda.CUDAGraph`` is in progress (:func:`tripwire._runtime.capture.install_capture_watch`)."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, DeviceReader] = {}
        self.relaxed: str | None = None  # how the latest reader thread's capture mode was relaxed
        self.relax_capture = True  # False only in tests' controls: a reader that keeps the global mode
        self._tls = threading.local()

    def __contains__(self, device: torch.device) -> bool:
        return device in self._by_device

    def add(self, device: torch.device, arena: torch.Tensor, offenders: torch.Tensor | None = None) -> DeviceReader:
        reader = self._by_device[device] = DeviceReader(device, arena, offenders)
        return reader

    def all(self) -> list[DeviceReader]:
        return list(self._by_device.values())

    def live(self) -> list[DeviceReader]:
        """The readers not lost."""
        return [r for r in self._by_device.values() if r.lost is None]

    def lose(self, reader: DeviceReader, e: BaseException) -> GuardTripped:
        """Stop polling ``reader`` (its arena is KEPT: captured graphs still write there); log it, and return the stop
        to arm (fatal-site hits there can no longer be seen)."""
        reader.lost = e
        what = f"{type(e).__name__}: {e}"
        log.error("reading the counters of %s failed (%s); no longer polling it", reader.name, what)
        return GuardTripped.internal(
            f"tripwire: lost the reader of {reader.name} ({what}); fatal-site hits there can no longer be seen, so "
            f"the engine is stopped",
            reader.name,
        )

    def read_now(self, n_rows: int) -> Iterator[tuple[DeviceReader, np.ndarray | BaseException]]:
        """A complete, blocking read of every live reader (drain and reset only): ``(reader, rows)``, or
        ``(reader, exc)`` for a read that failed. A reader lost earlier is skipped, and logged."""
        for reader in self.all():
            if reader.lost is not None:
                log.error("skipping %s, whose reader was lost (%s)", reader.name, reader.lost)
                continue
            try:
                rows = reader.read_now(n_rows)
            except Exception as e:
                yield reader, e
                continue
            yield reader, rows

    def relax_once(self) -> None:
        """Relax the calling thread's capture mode, once per thread, once CUDA is initialised."""
        if getattr(self._tls, "relax_tried", False) or not torch.cuda.is_initialized():
            return
        self._tls.relax_tried = True
        if not self.relax_capture:
            self.relaxed = "skipped (control)"
            return
        self.relaxed = relax_thread_capture_mode()
        if self.relaxed is None:
            install_capture_watch()

    def poll(
        self, n_rows: int, reference: Callable[[str], np.ndarray | None], *, on_reader_thread: bool
    ) -> Iterator[tuple[DeviceReader, np.ndarray | BaseException | None]]:
        """Poll every live reader (never waiting on the GPU). Yields ``(reader, rows)`` for a copy that landed and
        differs from ``reference(device)``, ``(reader, None)`` for one that landed unchanged (a quiet read), and
        ``(reader, exc)`` for a read that failed; nothing for a copy still in flight."""
        for reader in self.live():
            if reader.is_cuda and on_reader_thread:
                self.relax_once()  # CUDA may have been initialised since the top of the tick
                if self.relaxed is None and visible_captures() > 0:
                    continue  # fallback: pause while a capture we can see is in progress
            same_as = reference(reader.name)
            try:
                rows = reader.poll(n_rows, same_as)
            except Exception as e:
                yield reader, e
                continue
            if rows is not None:
                yield reader, None if rows is same_as else rows
