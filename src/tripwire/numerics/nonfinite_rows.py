"""Non-finite rows: one hit per row of a 2-D tensor (a step's logits, one row per request) that holds a NaN or an
Inf, with the row's request among the offenders, so that a same-step verdict can fail exactly the requests whose
logits went bad (:mod:`tripwire.verdict`), and, under ``mask``, the row's non-finite values rewritten to 0 so that
whatever reads the row next (a sampler: softmax, argmax, top-k) draws a token id inside the vocabulary.

Row layout (kind ``"nonfinite_rows"``, the guard layout): slot 0 = rows that held a non-finite value, the first
offender = (row, one non-finite column of it), the request = ``requests[row]`` (not known for a row past the map's
end: a verdict then fails the step closed). Where :func:`tripwire.numerics.count_nonfinite` counts elements, this
counts rows: a row with a thousand NaNs is one fault of one request, and one offender entry (an element count would
fill the offender block with one request's columns and leave the rest of the step unattributed).

No sync, no allocation: programs of ``(row, chunk)``; a chunk that finds a non-finite value claims its row for this
call with one ``atomic_max`` of the call's epoch on a per-row word (so a row split over several chunks is recorded
once, with no buffer to zero between calls), then records and repairs out of line. The epoch is a device word the
call increments first (one in-place add on the stream, then the kernel reads it): a call captured into a CUDA graph
replays the increment too, where a host counter passed as an argument would replay its capture-time value and
record a row bad in two replays once. CPU tensors take a torch path with the same counts, offenders and repair.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl

from ..layout import GUARD_BIAS, VALUE_MAX
from ..monitor import Monitor
from ..report import GuardReporter, Hit, Wording, offenders_text, register_reporter, short_name
from ..sites import Site
from ..triton import record_hits
from .nonfinite import _BITS, _FLOAT_DTYPES

__all__ = ["NonFiniteRows", "NonFiniteRowsReporter", "nonfinite_rows_wording", "register_nonfinite_rows_site"]

KIND = "nonfinite_rows"
# Elements per program: a 128k-entry vocabulary is 8 chunks, so a batch of one still reads on 8 SMs.
_CHUNK = 16384
_BLOCK = 4096
_NUM_WARPS = 8


def register_nonfinite_rows_site(name: str, *, description: str = "", monitor: Monitor | None = None) -> Site:
    """Register (or look up) a non-finite rows site (kind ``"nonfinite_rows"``) in ``monitor``'s registry (the default
    monitor's when None). Never fatal: a non-finite row is a fault of its request, which a verdict can fail."""
    if monitor is None:
        from .._default import default_monitor

        monitor = default_monitor()
    return monitor.registry.register(name, description=description, kind=KIND)


@triton.jit(noinline=True)
def _record_row(x_ptr, ctr_ptr, req_ptr, nreq, r, c0, ncols, BITS: tl.constexpr, HAS_REQ: tl.constexpr,
                CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The fault path, out of line: the chunk read again for its first non-finite column, and the row recorded once,
    with request ``requests[r]`` (-1, not known, past the map's end)."""
    lanes = tl.arange(0, BLOCK)
    end = ncols.to(tl.int64) + 0
    first = end
    for c in range(0, CHUNK, BLOCK):
        o = c0 + c + lanes
        m = (o < ncols) & (c + lanes < CHUNK)
        x = tl.load(x_ptr + o, mask=m, other=0)
        bad = ((x & BITS) == BITS) & m
        first = tl.minimum(first, tl.min(tl.where(bad, o.to(tl.int64), end), axis=0))
    q = r.to(tl.int64) * 0 - 1
    if HAS_REQ:
        if r < nreq:
            q = tl.load(req_ptr + r).to(tl.int64)
    one = tl.full([1], 1, tl.int64)
    record_hits(ctr_ptr, one, r.to(tl.int64) * one, first * one, q * one)


@triton.jit(noinline=True)
def _repair_chunk(x_ptr, c0, ncols, BITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """The chunk's non-finite values set to 0 (finite: a sampler reading the row draws an id in the vocabulary)."""
    lanes = tl.arange(0, BLOCK)
    for c in range(0, CHUNK, BLOCK):
        o = c0 + c + lanes
        m = (o < ncols) & (c + lanes < CHUNK)
        x = tl.load(x_ptr + o, mask=m, other=0)
        tl.store(x_ptr + o, tl.zeros([BLOCK], x.dtype), mask=((x & BITS) == BITS) & m)


# nreq changes from call to call (a step's batch): not specialised on. The row stride and the width are the model's
# vocabulary, the same every call: specialised (16-divisible strides give vector loads).
@triton.jit(do_not_specialize=["nreq"])
def _nonfinite_rows_kernel(x_ptr, stride, ncols, ctr_ptr, req_ptr, nreq, seen_ptr, epoch_ptr, BITS: tl.constexpr,
                 HAS_REQ: tl.constexpr, REPAIR: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    c0 = tl.program_id(1) * CHUNK
    row = x_ptr + r.to(tl.int64) * stride
    lanes = tl.arange(0, BLOCK)
    vote = tl.zeros([BLOCK], tl.int32)
    # The hot loop: loads and one test per element, one reduction per program (as count_nonfinite's).
    for c in tl.static_range(0, CHUNK, BLOCK):
        o = c0 + c + lanes
        x = tl.load(row + o, mask=o < ncols, other=0)
        vote |= ((x & BITS) == BITS).to(tl.int32)
    if tl.max(vote, axis=0) > 0:
        # One chunk records the row: the first to raise the row's word to this call's epoch. Every chunk that saw a
        # non-finite value repairs its own (a row's other chunks do not know of it).
        epoch = tl.load(epoch_ptr)
        if tl.atomic_max(seen_ptr + r, epoch) < epoch:
            _record_row(row, ctr_ptr, req_ptr, nreq, r, c0, ncols, BITS, HAS_REQ, CHUNK, BLOCK)
        if REPAIR:
            _repair_chunk(row, c0, ncols, BITS, CHUNK, BLOCK)


class NonFiniteRows:
    """The per-row non-finite check of one site on one device, for rows up to ``max_rows`` (a step's batch), with its
    per-row claim words allocated here (call it before any capture). ``ctr``: the site's arena row
    (``monitor.counter(site, device)``), whose offender block keeps the requests.

    ``check(x, requests, mask=...)``: ``x`` a 2-D float tensor ``[rows, cols]`` on the device, rows contiguous (a
    row stride of its own is fine: a slice of a bigger buffer), ``rows <= max_rows``; ``requests`` an int64 tensor
    of request numbers by row (``Monitor.requests.number``), or None (the rows name no request: a verdict fails the
    step closed). A row past ``requests``' end names none either. Capture-safe and sync-free on CUDA (the epoch is a
    device word each call increments: a captured call counts every replay); on the CPU a torch path records the same
    words."""

    __slots__ = ("_epoch", "_seen", "ctr", "device", "max_rows")

    def __init__(self, ctr: torch.Tensor, max_rows: int) -> None:
        if not isinstance(ctr, torch.Tensor) or ctr.dtype != torch.int64 or ctr.shape != (8,):
            raise ValueError(f"ctr must be a site's int64 [8] counter row, got {getattr(ctr, 'shape', ctr)!r}")
        if not isinstance(max_rows, int) or max_rows <= 0:
            raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
        self.ctr = ctr
        self.device = ctr.device
        self.max_rows = max_rows
        # int64: 2**63 calls never wrap (a wrapped epoch would claim no row again).
        self._seen = torch.zeros(max_rows, dtype=torch.int64, device=ctr.device)
        self._epoch = torch.zeros(1, dtype=torch.int64, device=ctr.device)

    def check(self, x: torch.Tensor, requests: torch.Tensor | Callable[[], torch.Tensor] | None, *, mask: bool) -> bool:
        """Check ``x``'s rows (see the class docstring); ``requests`` may be a function returning the tensor, called
        on CUDA at every call and on the CPU only when a row is non-finite (an engine's CPU step builds no request
        map for a clean step). Returns whether the site's row may have risen: always on CUDA (the launch is
        asynchronous), on the CPU only when a row was non-finite."""
        # Host checks read sizes and dtypes only (no sync): this runs on an engine's step path.
        if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES or x.stride(1) != 1:
            raise ValueError(
                f"tripwire: the non-finite rows check takes a 2-D float tensor with contiguous rows, got "
                f"{x.dtype} {tuple(x.shape)} strides {tuple(x.stride())}"
            )
        rows, cols = x.shape
        if rows > self.max_rows:
            raise ValueError(f"tripwire: {rows} rows to check, more than the {self.max_rows} this check was built for")
        if x.device != self.device:
            raise ValueError(f"tripwire: the rows are on {x.device}, the check's counter on {self.device}")
        if rows == 0 or cols == 0:
            return False
        # The CPU's clean path (no request map built): see _clean_on_host.
        if not x.is_cuda and _clean_on_host(x):
            return False
        if callable(requests):
            requests = requests()
        if requests is not None and (
            not isinstance(requests, torch.Tensor) or requests.dtype != torch.int64 or requests.dim() != 1
        ):
            raise ValueError(f"tripwire: requests must be a 1-D int64 tensor, got {requests!r:.80}")
        if not x.is_cuda:
            _check_cpu(x, self.ctr, requests, mask)
            return True
        self._epoch.add_(1)  # on the stream, before the launch that reads it (captured: replayed with it)
        _launch(x, self.ctr, requests, self._seen, self._epoch, mask)
        return True


def _launch(
    x: torch.Tensor,
    ctr: torch.Tensor,
    requests: torch.Tensor | None,
    seen: torch.Tensor,
    epoch: torch.Tensor,
    mask: bool,
) -> None:
    """The kernel's launch (preconditions: :meth:`NonFiniteRows.check`'s; ``seen`` int64 per row, ``epoch`` a
    one-element int64 tensor holding a value above every earlier call's on ``seen``). Tests call it on CPU tensors
    under Triton's interpreter."""
    rows, cols = x.shape
    int_dtype, bits = _BITS[x.dtype]
    req = requests if requests is not None else seen  # HAS_REQ False: never read
    grid = (rows, triton.cdiv(cols, _CHUNK))
    _nonfinite_rows_kernel[grid](x.view(int_dtype), x.stride(0), cols, ctr, req, 0 if requests is None else requests.shape[0],
                       seen, epoch, BITS=bits, HAS_REQ=requests is not None, REPAIR=mask, CHUNK=_CHUNK, BLOCK=_BLOCK,
                       num_warps=_NUM_WARPS)  # fmt: skip


# Per float dtype: the integer type of its width and its exponent field (all ones: NaN or Inf).
_EXPONENT = {
    torch.float32: (torch.int32, 0x7F800000),
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}


def _clean_on_host(x: torch.Tensor) -> bool:
    """Every element of the CPU tensor ``x`` is finite (see ``check``), exactly.

    First one float32 sum: a NaN or an Inf anywhere makes it NaN or +-Inf, so a finite sum proves the tensor clean.
    It runs on an engine's CPU step right after the model's forward, where one torch reduction (torch's code is hot)
    costs a fraction of what numpy's ufuncs or ``isfinite().all()`` (a bool tensor as large as the logits) cost
    there (benchmarks/RESULTS.md, ``vllm-overhead``). A sum that is not finite is a fault or an overflow of finite
    values: the exponent field of every element, read through an integer view, decides which (NaN and Inf are
    exactly the all-ones field: no arithmetic on the values), so an overflow is never taken for a fault."""
    if x.dtype not in _EXPONENT:  # the fp8 formats: e4m3fn's all-ones exponent still holds finite values
        return bool(torch.isfinite(x.float()).all())
    if math.isfinite(x.sum(dtype=torch.float32).item()):  # .item() of a CPU tensor: no device, no sync
        return True
    itype, field = _EXPONENT[x.dtype]
    bits = x.detach().view(itype).numpy()
    return int(np.bitwise_and(bits, field).max()) != field


def _check_cpu(x: torch.Tensor, ctr: torch.Tensor, requests: torch.Tensor | None, mask: bool) -> None:
    """The kernel's words on the CPU: one hit per row holding a non-finite value (the row's first such column),
    recorded as one program per row (validate's torch fault path), and the values repaired under ``mask``."""
    from ..validate._torch import _fault, offender_block

    bad = ~torch.isfinite(x)
    rows = bad.any(dim=1).nonzero().view(-1)
    if rows.numel() == 0:
        return
    first = bad[rows].to(torch.int8).argmax(dim=1).to(torch.int64)
    if requests is None:
        q = torch.zeros_like(rows)
    else:
        n = requests.shape[0]
        known = rows < n
        r = torch.where(known, requests[torch.where(known, rows, 0)], -1)
        q = torch.where(r < 0, 0, r.clamp(max=VALUE_MAX) + GUARD_BIAS)
    _fault(ctr, offender_block(ctr), rows, rows, first, q)
    if mask:
        x[bad] = 0


def nonfinite_rows_wording(site: Site, device: str, hit: Hit, *, delta: int | None = None) -> Wording:
    """The words of a non-finite rows report: rows, and the first row with one of its non-finite columns."""
    new = f"{delta} new, {hit.count} total" if delta is not None else f"{hit.count} total"
    first = "-" if hit.first_row is None else f"row {hit.first_row}, column {hit.first_value}"
    line = short_name(
        lambda s: f"NON-FINITE ROWS at site {s} on {device}: {new} rows held NaN/Inf. First: {first}.", site.name
    )
    detail = f"Offenders: {offenders_text(hit.offenders)}." if hit.offenders else ""
    desc = f"[{site.description}] " if site.description else ""
    explanation = (
        f"{desc}Each row is one request's values (a step's logits): what was computed from that row is not correct. "
        f"Under mask the row's NaN/Inf were set to 0 before it was read on; a verdict fails the row's request."
    )
    return Wording(line, detail, explanation)


class NonFiniteRowsReporter(GuardReporter):
    """Reporter for ``"nonfinite_rows"`` rows: the guard reporter's aggregation and arming, in words about rows."""

    wording = staticmethod(nonfinite_rows_wording)


register_reporter(KIND, NonFiniteRowsReporter)
