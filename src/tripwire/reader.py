"""The non-blocking reader of one device's arena.

Per CUDA device: a pinned host mirror, a dedicated side stream and an event, all made at registration (before any
capture). :meth:`DeviceReader.poll` never waits on the GPU: if the previous copy's event has not completed it
returns None at once; otherwise it hands back that copy's rows and enqueues the next copy. The side stream has no
dependency on the compute stream, so a copy runs while compute kernels are still busy (the words it reads are
int64 counters written by atomics: each word is read whole). A synchronous ``.tolist()``/``.item()`` here would
queue behind the whole compute stream, which is what has deadlocked engines whose step waits on the reader's lock.

CPU arenas are read directly (a numpy copy under the GIL).
"""

from __future__ import annotations

import numpy as np
import torch

from .capture import is_capturing
from .errors import CaptureError

__all__ = ["DeviceReader"]


class DeviceReader:
    """Reads one arena. Not thread-safe by itself: the Monitor serialises calls under its lock."""

    def __init__(self, device: torch.device, arena: torch.Tensor) -> None:
        self.device = device
        self.name = str(device)
        self.arena = arena
        self.copies = 0  # copies started (CUDA) or reads made (CPU)
        self.bytes_copied = 0
        self.lost: BaseException | None = None
        self._pending_rows = 0  # rows of the copy in flight; 0 when none
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            if is_capturing():
                raise CaptureError(
                    f"tripwire: the reader for {device} would allocate its pinned mirror, stream and event inside a "
                    f"CUDA-graph capture; call tripwire.prealloc({str(device)!r}) before capturing"
                )
            with torch.cuda.device(device):
                self.mirror = torch.zeros(arena.shape, dtype=arena.dtype, pin_memory=True)
                self.stream = torch.cuda.Stream(device)
                self.event = torch.cuda.Event()

    @property
    def in_flight(self) -> bool:
        return self._pending_rows > 0

    def poll(self, n_rows: int) -> np.ndarray | None:
        """The rows of the copy that landed since the last poll (a private numpy copy), or None if it has not
        landed yet; then start the next copy of the first ``n_rows`` rows. Never blocks on the GPU."""
        if not self.is_cuda:
            self.copies += 1
            self.bytes_copied += n_rows * self.arena.shape[1] * 8
            return self.arena[:n_rows].numpy().copy()
        rows = None
        if self._pending_rows:
            if not self.event.query():  # cudaEventQuery: returns at once, never waits
                return None
            rows = self.mirror[: self._pending_rows].numpy().copy()
            self._pending_rows = 0
        self._start(n_rows)
        return rows

    def _start(self, n_rows: int) -> None:
        if n_rows <= 0:
            return
        # Only the registered rows travel: bytes scale with what exists, and it is still one copy per device.
        with torch.cuda.stream(self.stream):
            self.mirror[:n_rows].copy_(self.arena[:n_rows], non_blocking=True)
            self.event.record(self.stream)
        self._pending_rows = n_rows
        self.copies += 1
        self.bytes_copied += n_rows * self.arena.shape[1] * 8

    def discard(self) -> None:
        """Wait for (and forget) a copy in flight. Blocking: only for drain and reset, never the step path."""
        if self.is_cuda and self._pending_rows:
            self.event.synchronize()
        self._pending_rows = 0

    def read_now(self, n_rows: int) -> np.ndarray:
        """A complete, blocking read: synchronise the device (so every kernel enqueued so far has run), then copy
        through the mirror. For drain only, never the step path."""
        if not self.is_cuda:
            return self.arena[:n_rows].numpy().copy()
        self.discard()
        torch.cuda.synchronize(self.device)
        self._start(n_rows)
        self.stream.synchronize()
        rows = self.mirror[:n_rows].numpy().copy()
        self._pending_rows = 0
        return rows
