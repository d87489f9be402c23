"""The per-request non-finite logits check of :mod:`tripwire.integrations.transformers` (site
``transformers.logits_nonfinite``).

Where: a forward hook on the model, so it runs on the model's own logits, after the forward and BEFORE the engine
touches them (``ModelRunner._forward_process_and_sample`` in 5.17 to 5.25: the model forward, ``.float()``, the
logits processors, then ``_sample``). Not after the logits processors: top-k / top-p filters write ``-inf`` into rows on
purpose, which would read as faults. The model is called with ``logits_to_keep = logits_indices`` (every supported
version does so for a model that takes the keyword), so its logits are ``[1, rows, vocab]`` with one row per entry of
``logits_indices``: the requests of the batch that sample a token this step, in batch order (a request still in a
chunked prefill has none), then, in a padded batch (CUDA graphs, torch.compile), padding rows whose index is 0, i.e.
copies of the batch's first token's logits.

The row-to-request map (:class:`LogitsRows`) is built on the host before each step from the batch the engine
prepared: the sampled requests' numbers in order, then, for every padding row, the number of the batch's first
request (the owner of token 0: a padding row is that request's data, so a non-finite one is its fault). It goes to
the device on the compute stream with the integration's request table (one more small non-blocking copy from a
pinned ring), so the captured check reads this step's map.

CUDA graphs: the check is CAPTURED with the step (the hook runs inside the engine's captured forward), not run after
the graph: it must come before sampling, because under ``mask`` its repair is what the sampler reads, and because a
NaN row reaching ``torch.multinomial`` on a GPU is a device-side assert that poisons the CUDA context (on the CPU it
raises and the engine fails the whole batch). The check's per-row claim epoch is a device word its call increments
(:class:`tripwire.numerics.NonFiniteRows`), so a replayed check records a row bad in each replay each time.
torch.compile: the check is kept out of the traced graph (``torch.compiler.disable``: one graph break), so its host
checks run on every call instead of being traced as constants.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from ...monitor import Monitor
from ...numerics import NonFiniteRows, register_nonfinite_rows_site
from .._staging import Staged

log = logging.getLogger("tripwire")

SITE_LOGITS = "transformers.logits_nonfinite"
_DESC_LOGITS = (
    "transformers continuous batching: a logits row the engine samples from held NaN/Inf (row = the row among the "
    "step's sampled rows, value = one non-finite column); under mask its NaN/Inf were set to 0 before sampling"
)


def register_logits_site(monitor: Monitor) -> Any:
    return register_nonfinite_rows_site(SITE_LOGITS, description=_DESC_LOGITS, monitor=monitor)


def logits_layout_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s continuous-batching logits are not one row per sampled request (None: they are)."""
    supports = getattr(model, "_supports_logits_to_keep", None)
    if not callable(supports) or not supports():
        return (
            f"{type(model).__name__}.forward takes no logits_to_keep, so the engine's model logits are one row per "
            f"token of the step (it slices the sampled rows afterwards), not one per sampled request"
        )
    return None


class LogitsRows:
    """The step's logits-row-to-request map on the device (see the module docstring), ``max_rows`` entries,
    allocated at install (the captured checks hold its address), filled from a pinned ring (async batching may
    enqueue the next step before this one's copy ran)."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self._staged = Staged(max_rows, device, fill_value=-1)
        self.device = self._staged.tensor
        self.max_rows = max_rows

    def fill(self, numbers: np.ndarray | list[int], sampled: list[bool], rows: int, stream: Any) -> None:
        """``numbers``: the batch's request numbers in batch order; ``sampled``: whether each samples a token this
        step; ``rows``: how many logits rows the step may have (the engine pads up to its requests per batch)."""
        rows = min(rows, self.max_rows)
        values = [num for num, s in zip(numbers, sampled, strict=True) if s]
        # Padding rows repeat token 0's logits: the batch's first request's (numbers[0]).
        values += [numbers[0] if len(numbers) else -1] * (rows - len(values))
        self._staged.fill(rows, values[:rows], stream)


class LogitsCheck:
    """One :class:`NonFiniteRows` over the model's logits (site ``transformers.logits_nonfinite``), built at install.
    ``requests``: the device map of :class:`LogitsRows` (None: the rows name no request, a verdict fails the step
    closed). ``strict`` (containment): logits of an unexpected shape fail the step (RuntimeError) instead of being
    skipped with one WARNING."""

    def __init__(
        self,
        monitor: Monitor,
        device: torch.device,
        max_rows: int,
        *,
        mask: bool,
        requests: LogitsRows | None,
        strict: bool,
    ) -> None:
        self.site = register_logits_site(monitor)
        self.rows = NonFiniteRows(monitor.counter(self.site, device), max_rows)
        self.requests = requests
        self.mask = mask
        self.strict = strict
        self._warned = False
        self._cuda = device.type == "cuda"

    def __call__(self, output: Any, kwargs: dict[str, Any]) -> None:
        logits = getattr(output, "logits", None)
        index = kwargs.get("logits_indices")
        problem = _shape_problem(logits, index, "logits_to_keep" in kwargs, self.rows.max_rows)
        if problem is not None:
            self._unexpected(problem)
            return
        assert logits is not None
        _check(self.rows, logits[0], None if self.requests is None else self.requests.device, self.mask)

    def _unexpected(self, problem: str) -> None:
        text = (
            f"tripwire: the engine's logits are not one row per sampled request ({problem}); the non-finite logits "
            f"check (site {SITE_LOGITS!r}) cannot attribute their rows"
        )
        if self.strict:
            # Under containment a check that cannot attribute must not pass silently: the step fails (closed).
            raise RuntimeError(
                text + ": under containment the step fails (install with logits=False to serve unchecked)"
            )
        if not self._warned:
            self._warned = True
            log.warning("%s: skipped (this WARNING is given once)", text)


def _shape_problem(logits: Any, index: Any, kept: bool, max_rows: int) -> str | None:
    if not isinstance(logits, torch.Tensor) or not isinstance(index, torch.Tensor):
        return "the forward returned no logits tensor, or the engine passed no logits_indices"
    if not kept:
        return "the engine did not pass logits_to_keep: the logits are per token"
    if logits.dim() != 3 or logits.shape[0] != 1 or logits.shape[1] != index.shape[0]:
        return f"logits {tuple(logits.shape)} for {tuple(index.shape)} logits_indices, expected [1, rows, vocab]"
    if logits.shape[1] > max_rows:
        return f"{logits.shape[1]} rows, more than the {max_rows} the check was built for"
    if logits.stride(2) != 1:
        return f"logits strides {tuple(logits.stride())}: rows are not contiguous"
    return None


@torch.compiler.disable
def _check(rows: NonFiniteRows, x: torch.Tensor, requests: torch.Tensor | None, mask: bool) -> None:
    # Out of torch.compile's trace (module docstring): the epoch and the host checks run on every call.
    rows.check(x, requests, mask=mask)
