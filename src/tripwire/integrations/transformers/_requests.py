"""The transformers integration's per-step request bookkeeping: the step's request numbers on the device (the
validators' and the logits check's attribution) and the request states remembered by identity (kept out of the
prefix cache, dropped from later updates)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from .._staging import Staged
from ._logits import LogitsRows

__all__ = ["MAX_REQUESTS", "RequestTable", "States"]

# Request numbers one step can hold (the device table of the step's requests is allocated at install, before any
# capture, at this size; an engine configured for more requests per batch is refused at its first step).
MAX_REQUESTS = 4096
# Requests kept out of the prefix cache / dropped from later updates, remembered for this many of the newest.
_KEEP = 1 << 16


class RequestTable:
    """The step's request numbers (:class:`tripwire.contain.RequestNames`) on the device, in batch order, for the
    validators' attribution: filled before each step from a pinned ring (the engine's next step may be enqueued before
    this one's copy ran, in async batching), with a non-blocking copy on the engine's compute stream, so the step's
    kernels (replayed graphs included) read this step's numbers. ``rows``: the logits check's row map, filled from
    the same numbers in the same call."""

    def __init__(self, device: torch.device, names: Any, rows: LogitsRows | None = None) -> None:
        # Allocated at install, before the engine captures anything: the validators' graphs hold its address.
        self._staged = Staged(MAX_REQUESTS, device, fill_value=-1)
        self.device = self._staged.tensor
        self.names = names
        self.rows = rows

    def fill(self, batch: list[Any], stream: Any, logits_rows: int) -> None:
        """``batch``: the step's future request states, in batch order; ``logits_rows``: how many logits rows the
        step may have (the engine pads a batch up to its requests per batch)."""
        k = len(batch)
        if k > MAX_REQUESTS:
            raise RuntimeError(f"tripwire: a step of {k} requests exceeds the request table ({MAX_REQUESTS})")
        numbers = [self.names.number(fs.state.request_id) for fs in batch]
        self._staged.fill(k, numbers, stream)  # into pinned memory, then to the device on the compute stream
        if self.rows is not None:
            self.rows.fill(numbers, [fs.has_new_token for fs in batch], logits_rows, stream)


class States(OrderedDict):  # type: ignore[type-arg]
    """A set of the newest ``_KEEP`` request STATES, by identity (older ones finished long ago). By the state, not the
    request id: engines reuse ids across runs (``generate_batch`` names its requests ``req_0``, ``req_1``, ...), and a
    new request under an old id must not inherit what happened to the old one. Holds the states, so their ids are not
    reused while kept."""

    def add(self, state: Any) -> None:
        self[id(state)] = state
        self.move_to_end(id(state))
        while len(self) > _KEEP:
            self.popitem(last=False)

    def has(self, state: Any) -> bool:
        return self.get(id(state)) is state
