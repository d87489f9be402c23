"""The counter arena: one persistent, zero-initialised ``int64 [capacity, SLOTS]`` tensor per device.

Capture rule: allocate it BEFORE any capture (``prealloc``) and never free or move it. A captured graph bakes in
the arena's address; if the tensor were freed, replaying that graph would fire its atomics into whatever the
caching allocator handed out next, silently corrupting a live tensor. So every arena ever made is also kept in a
module-level list that is never cleared, even after its Monitor is gone.
"""

from __future__ import annotations

import threading

import torch

from .capture import is_capturing
from .errors import CaptureError
from .layout import SLOTS
from .sites import Site, SiteRegistry

__all__ = ["Arena", "arenas_made", "is_kept", "normalize_device", "unindexed_cuda"]

# Every arena of the process, forever (see the module docstring). Never cleared.
_IMMORTAL: list[torch.Tensor] = []


def arenas_made() -> int:
    """How many arenas this process has allocated (every one is still alive: see the module docstring)."""
    return len(_IMMORTAL)


def is_kept(t: torch.Tensor) -> bool:
    """``t`` is one of the arenas kept alive for the process's lifetime."""
    return any(a is t for a in _IMMORTAL)


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

    def __init__(self, registry: SiteRegistry, capacity: int) -> None:
        self.registry = registry
        self.capacity = capacity
        self._lock = threading.Lock()
        self._tensors: dict[torch.device, torch.Tensor] = {}
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
            t = torch.zeros((self.capacity, SLOTS), dtype=torch.int64, device=dev)
            _IMMORTAL.append(t)
            self._tensors[dev] = t
            return t

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
        """Zero every arena (a tool's call: it enqueues a fill on each device's current stream)."""
        for _, t in self.items():
            t.zero_()
