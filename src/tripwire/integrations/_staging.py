"""A per-step int64 vector on an engine's device, the one way the integrations hand a step's host-side numbers
(request numbers, per-row counts, a row-to-request map) to the kernels that read them: the vLLM runners' validators
(:mod:`tripwire.integrations.vllm._steps`, :mod:`tripwire.integrations.vllm._v2`) and the transformers integration's
request table and logits rows."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["Staged"]


class Staged:
    """A per-step vector as a tensor on the engine's device, allocated here (before any capture: captured kernels
    hold its address), every entry ``fill_value`` until written. On the CPU: a view of the engine's own numpy array
    (``source``), or a preallocated tensor written through its numpy view (no copy, no allocation). On CUDA: a
    persistent device buffer filled from a pinned ring with a non-blocking copy (on ``stream`` when given, else the
    current one), so a step enqueued before the previous one's copy ran still reads its own values."""

    RING = 4

    def __init__(
        self, size: int, device: torch.device, source: np.ndarray | None = None, *, fill_value: int = 0
    ) -> None:
        self._source = source
        self._view: torch.Tensor | None = None
        if device.type == "cpu" and source is not None:
            self._view = torch.from_numpy(source)
            return
        self.tensor = torch.full((size,), fill_value, dtype=torch.int64, device=device)
        if device.type == "cpu":
            self._np = [self.tensor.numpy()]
            self._host = [self.tensor]
        else:
            self._host = [torch.full((size,), fill_value, dtype=torch.int64, pin_memory=True) for _ in range(self.RING)]
            self._np = [h.numpy() for h in self._host]
        self._turn = 0

    def _slot(self) -> tuple[np.ndarray, torch.Tensor]:
        buf, host = self._np[self._turn], self._host[self._turn]
        self._turn = (self._turn + 1) % len(self._np)
        return buf, host

    def _push(self, host: torch.Tensor, n: int | None, stream: Any) -> None:
        if host is self.tensor:
            return  # the CPU: written in place
        dst, src = (self.tensor, host) if n is None else (self.tensor[:n], host[:n])
        if stream is None:
            dst.copy_(src, non_blocking=True)
            return
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def fill(self, n: int, values: Any = None, stream: Any = None) -> torch.Tensor:
        """The first ``n`` entries: of the source array, or ``values`` (a sequence of ``n`` ints) when given."""
        if self._view is not None:
            return self._view[:n]
        buf, host = self._slot()
        if values is None:
            assert self._source is not None
            values = self._source[:n]
        buf[:n] = values  # numpy assignment: no torch allocation
        self._push(host, n, stream)
        return self.tensor[:n]

    def scatter_fill(self, at: np.ndarray, values: Any, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two vectors in ONE copy, for a Staged built with twice a vector's size: the first half ``values`` at the
        indices ``at`` and -1 (none) everywhere else, and the second half's first ``n`` entries ``values`` as
        :meth:`fill` makes them. Each host-to-device copy is an operation of its own on the engine's stream, between
        its kernels: a step that needs both vectors pays for one."""
        half = self.tensor.shape[0] // 2
        buf, host = self._slot()
        buf[:half].fill(-1)
        buf[at] = values  # numpy fancy assignment into the pinned slot: no torch allocation
        buf[half : half + n] = values
        self._push(host, half + n, None)
        return self.tensor[:half], self.tensor[half : half + n]
