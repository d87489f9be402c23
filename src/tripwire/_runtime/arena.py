"""The counter arena: one persistent, zero-initialised ``int64 [capacity, SLOTS]`` tensor per device, followed in the
same allocation by each row's offender block (:mod:`tripwire.layout`).

Capture rule: allocate it BEFORE any capture (``prealloc``) and never free or move it. A captured graph bakes in
the arena's address; if the tensor were freed, replaying that graph would fire its atomics into whatever the
caching allocator handed out next, silently corrupting a live tensor. So every arena ever made is also kept in a
module-level list that is never cleared, even after its Monitor is gone.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ..errors import CaptureError
from ..layout import OFF_DONE, OFF_ENTRY, OFF_HEADER, OFFENDERS, SLOTS, offender_block_words
from ..sites import Site, SiteRegistry
from .capture import is_capturing

# Every arena allocation of the process (rows and offender blocks in one), forever (see the module docstring). Never
# cleared.
_IMMORTAL: list[torch.Tensor] = []


def arenas_made() -> int:
    """How many arenas this process has allocated (every one is still alive: see the module docstring)."""
    return len(_IMMORTAL)


def is_kept(t: torch.Tensor) -> bool:
    """``t`` is one of the arenas kept alive for the process's lifetime (the allocation, or its rows)."""
    return any(a is t or a is t._base for a in _IMMORTAL)


def unindexed_cuda(device: object) -> bool:
    """True for ``"cuda"`` / ``torch.device("cuda")``: the CURRENT device, whatever it is at the call."""
    if isinstance(device, str):
        return device.strip() == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda" and device.index is None


def normalize_device(device: torch.device | str | int) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, ints -> ``cuda:<int>``; only CUDA and CPU devices are accepted."""
    if isinstance(device, bool):
        raise TypeError(f"expected a device, got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{device!r} is not a device: {e}") from None
    if dev.type == "cuda":
        if dev.index is None:
            if not torch.cuda.is_available():
                raise ValueError(f"device {device!r}: CUDA is not available in this process")
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    if dev.type == "cpu":
        return torch.device("cpu")
    raise ValueError(f"tripwire counts on CUDA and CPU devices only, got {device!r}")


class Arena:
    """Per-device counter tensors for one registry. Thread-safe; allocation only outside capture."""

    def __init__(self, registry: SiteRegistry, capacity: int, offenders: int = 8) -> None:
        self.registry = registry
        self.capacity = capacity
        self.offenders_per_row = offenders
        self._lock = threading.Lock()
        self._tensors: dict[torch.device, torch.Tensor] = {}
        self._offenders: dict[torch.device, torch.Tensor] = {}
        # (id(site), raw device argument) -> (site, row view). The hot path of a launcher is one dict lookup.
        self.views: dict[tuple[int, object], tuple[Site, torch.Tensor]] = {}

    def prealloc(self, device: torch.device | str | int) -> torch.Tensor:
        """Allocate (once) the arena of ``device`` and return it. Raises CaptureError inside a capture."""
        dev = normalize_device(device)
        with self._lock:
            t = self._tensors.get(dev)
            if t is not None:
                return t
            # Check before any CUDA call, so a refused call leaves the capture in progress usable.
            if is_capturing():
                raise CaptureError(
                    f"tripwire: the counter arena for {dev} would be allocated inside a CUDA-graph capture; "
                    f"call tripwire.prealloc({str(dev)!r}) before capturing"
                )
            cap, block = self.capacity, offender_block_words(self.offenders_per_row)
            flat = torch.zeros(cap * SLOTS + cap * block, dtype=torch.int64, device=dev)
            t = flat[: cap * SLOTS].view(cap, SLOTS)
            off = flat[cap * SLOTS :].view(cap, block)
            self._init_offenders(t, off)
            _IMMORTAL.append(flat)
            self._tensors[dev] = t
            self._offenders[dev] = off
            return t

    def _init_offenders(self, rows: torch.Tensor, off: torch.Tensor) -> None:
        # Slot 7 of row i: the ADDRESS of row i's block (not an offset: a copy of a row, e.g. the one torch.compile's
        # functionalization makes of a mutated counter argument, still reaches the arena's own block, whose words
        # only the device writes). Header word 1: K. Kernels read both only on their fault path.
        cap, block = self.capacity, off.shape[1]
        i = torch.arange(cap, dtype=torch.int64)
        rows[:, OFFENDERS].copy_(off.data_ptr() + i * block * off.element_size())
        off[:, 1].fill_(self.offenders_per_row)
        assert OFF_HEADER > OFF_DONE >= 2 and OFF_ENTRY == 4

    def read_offenders(self, device: torch.device, n: int) -> np.ndarray | None:
        """A synchronous copy of the first ``n`` rows' offender blocks (tools: it waits for the device)."""
        off = self._offenders.get(device)
        return None if off is None else off[:n].cpu().numpy()

    def offenders(self, device: torch.device) -> torch.Tensor | None:
        """``device``'s offender blocks, ``int64 [capacity, OFF_HEADER + K * OFF_ENTRY]`` (row ``i`` is site ``i``'s)."""
        return self._offenders.get(device)

    def get(self, device: torch.device) -> torch.Tensor | None:
        return self._tensors.get(device)

    def devices(self) -> list[torch.device]:
        with self._lock:
            return list(self._tensors)

    def items(self) -> list[tuple[torch.device, torch.Tensor]]:
        with self._lock:
            return list(self._tensors.items())

    def counter(self, site: Site, device: torch.device | str | int) -> torch.Tensor:
        """The ``[SLOTS]`` int64 row of ``site`` on ``device``, for a kernel argument.

        Allocates the arena on first use outside a capture; inside a capture with no arena it raises
        CaptureError. Repeated calls return the same cached view (no allocation, no CUDA call).
        """
        key = (id(site), device)
        hit = self.views.get(key)
        if hit is not None and hit[0] is site:
            return hit[1]
        site = self.registry.resolve(site)
        if site.id >= self.capacity:
            raise ValueError(
                f"site {site.name!r} owns row {site.id} but this arena has {self.capacity} rows; "
                f"raise the monitor's capacity (TRIPWIRE_CAPACITY)"
            )
        dev = normalize_device(device)
        t = self._tensors.get(dev)
        if t is None:
            if is_capturing():
                raise CaptureError(
                    f"tripwire: counter({site.name!r}, {str(dev)!r}) inside a CUDA-graph capture but no arena "
                    f"exists for {dev}; call tripwire.prealloc({str(dev)!r}) before capturing"
                )
            t = self.prealloc(dev)
        view = t[site.id]
        if not unindexed_cuda(device):
            # "cuda" without an index names the current device, which can change: never cache it as is.
            self.views[key] = (site, view)
        return view

    def zero_(self) -> None:
        """Zero every arena's counters and offenders (a tool's call: it enqueues fills on each device's current
        stream). Slot 7 and the offender headers are layout, not counts: they stay."""
        for dev, t in self.items():
            t[:, :OFFENDERS].zero_()
            self._offenders[dev][:, OFF_DONE:].zero_()  # the recorded-hits count and the entries; not K
