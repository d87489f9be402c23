"""The metadata validator on CPU tensors: plain torch, with the Triton kernel's counts, offenders and masking.

:class:`tripwire.validate.Validator` runs this for CPU tensors (CPU engines such as vLLM's CPU build: no Triton
interpreter, no triton import) and :mod:`tripwire.validate._triton` for CUDA tensors. Both write the same arena words
for the same call: the count, the extremes, the first pair and the offender blocks (:mod:`tripwire.layout`), and the
same repaired tensors; ``tests/validate/test_validate.py`` runs the kernel under the interpreter beside this path
and compares every word.

What "the same" takes, beyond the rules' semantics (see the kernel's docstring):

* The kernel's programs run in grid order (the interpreter runs them one after the other; on a GPU their order is
  the hardware's, which only changes which offenders win when more than K are distinct). Each program's fault path is
  one group here: entries in blocks of ``BLOCK`` (a 2-D table's row can straddle two), an owner program's lengths or
  indptr in chunks of ``ABLOCK``. A group claims the first pair if it is still free (its lowest row, then that row's
  lowest value) and its distinct offenders lowest (row, value, request) first, and adds its hits to the block's
  recorded-hits word last.
* Rows, values and requests are saturated into the encodable range like the kernel's; the requests are looked up
  with the kernel's own bisection (a segments tensor that is not sorted gives the kernel's wrong segment, not
  another one).

Cost: the clean path is the host clean test (:mod:`tripwire.validate._rules`: all entries, used or not, inside the
rule's range or its padding means no entry is bad; per-row counts within the width; an indptr non-decreasing from 0
within its indices) on a list read of each small tensor, one ``aminmax`` (or, for an indptr, three tensor reads) for
larger ones; the exact path (masks, lookups, writes) runs only when that test fails. The scalar reads are host reads
of host tensors: this module is never given a CUDA tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain

import torch

from .._runtime.arena import _IMMORTAL
from ..layout import (
    COUNT,
    E_KEY,
    E_REQ,
    E_ROW,
    E_VALUE,
    FIRST_ROW,
    FIRST_VALUE,
    GUARD_BIAS,
    MAX_ROW,
    MAX_VALUE,
    NEG_MIN,
    OFF_DONE,
    OFF_ENTRY,
    OFF_HEADER,
    OFFENDERS,
    SLOTS,
    VALUE_MAX,
    VALUE_MIN,
    offender_key,
)
from . import _rules as _r
from ._rules import ABLOCK, BLOCK, CSR, Rules, entries_clean, indptr_clean, lengths_clean

__all__ = ["launch", "offenders_of"]

# A site's arena row and its offender block (None: a counter that keeps none).
_Row = tuple[torch.Tensor, "torch.Tensor | None"]
# Entries up to which the clean path reads a tensor as a Python list instead of reducing it with a torch op.
_SMALL = 128
# The kernel's bisection depth (_segment_of): enough for any int64 offsets tensor.
_BISECT = 40


def offenders_of(arena: torch.Tensor) -> torch.Tensor | None:
    """The offender blocks of the arena whose rows are ``arena`` (the ``[capacity, SLOTS]`` rows of an allocation
    kept by :mod:`tripwire._runtime.arena`), found through the address in slot 7 of row 0 like the kernel finds them; None
    when ``arena`` is not an arena's rows (a counter tensor of a caller's own keeps no offenders)."""
    if arena.dim() != 2 or arena.shape[0] == 0 or arena.shape[1] != SLOTS:
        return None
    addr = int(arena[0, OFFENDERS])
    if addr == 0:
        return None
    cap = arena.shape[0]
    for flat in _IMMORTAL:
        if flat.device.type == "cpu" and flat.numel() > cap * SLOTS:
            off = flat[cap * SLOTS :]
            if off.data_ptr() == addr:
                return off.view(cap, -1)
    return None


def offender_block(ctr: torch.Tensor) -> torch.Tensor | None:
    """The offender block of one CPU arena row ``ctr`` (a view of a kept arena's ``[SLOTS]`` row), found through the
    address in its slot 7 like the kernel finds it; None for a counter that keeps none."""
    addr = int(ctr[OFFENDERS])
    if addr == 0:
        return None
    for flat in _IMMORTAL:
        if flat.device.type != "cpu":
            continue
        lo = flat.data_ptr()
        if lo <= addr < lo + flat.numel() * flat.element_size():
            start = (addr - lo) // flat.element_size()
            k = int(flat[start + 1])
            return flat[start : start + OFF_HEADER + k * OFF_ENTRY]
    return None


def _sat(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).clamp(VALUE_MIN, VALUE_MAX)


def _segment_of(pos: torch.Tensor, sg: torch.Tensor) -> torch.Tensor:
    """The kernel's ``_segment_of``: for each of ``pos``, ``b`` with ``sg[b] <= pos < sg[b + 1]``, else -1."""
    n = sg.numel()
    if n == 0:
        return torch.full_like(pos, -1)
    s = sg.to(torch.int64)
    lo = torch.zeros_like(pos)
    hi = torch.full_like(pos, n - 1)
    for _ in range(_BISECT):
        live = lo < hi
        if not bool(live.any()):
            break
        mid = (lo + hi + 1) // 2
        go = s[torch.where(live, mid, 0)] <= pos
        lo = torch.where(live & go, mid, lo)
        hi = torch.where(live & ~go, mid - 1, hi)
    inside = (pos >= s[0]) & (pos < s[n - 1]) & (lo < n - 1)
    return torch.where(inside, lo, -1)


def _request_words(rows: torch.Tensor, kind: int, rq: torch.Tensor, sg: torch.Tensor) -> torch.Tensor:
    """Biased request words of the bad lanes at ``rows`` (0 = not known): ``kind`` 1 = ``rq[row]``, 2 =
    ``rq[segment of row in sg]``, 0 = none."""
    if kind == 0:
        return torch.zeros_like(rows)
    idx = rows if kind == 1 else _segment_of(rows, sg)
    ok = (idx >= 0) & (idx < rq.numel())
    if rq.numel() == 0:
        return torch.zeros_like(rows)
    r = torch.where(ok, rq.to(torch.int64)[torch.where(ok, idx, 0)], -1)
    return torch.where(r < 0, 0, _sat(r) + GUARD_BIAS)


def _fault(
    ctr: torch.Tensor, block: torch.Tensor | None, groups: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor, q
) -> None:
    """The kernel's fault path (tripwire.triton ``_fault``), once per group of lanes in group order: ``rows``/``vals``
    saturated, ``q`` biased request words, ``groups`` the program (or chunk) of each lane, non-decreasing."""
    rb_all = (rows + GUARD_BIAS).tolist()  # fault path only: host lists of host tensors
    vb_all = (vals + GUARD_BIAS).tolist()
    q_all = q.tolist()
    g_all = groups.tolist()
    start = 0
    n_all = len(g_all)
    while start < n_all:
        end = start
        while end < n_all and g_all[end] == g_all[start]:
            end += 1
        rb, vb, qb = rb_all[start:end], vb_all[start:end], q_all[start:end]
        n = end - start
        # Count first, extremes after it, the first pair by "compare-and-swap" from 0 (the reader's order).
        ctr[COUNT] += n
        ctr[MAX_ROW] = max(int(ctr[MAX_ROW]), max(rb))
        ctr[MAX_VALUE] = max(int(ctr[MAX_VALUE]), max(vb))
        ctr[NEG_MIN] = max(int(ctr[NEG_MIN]), max(2 * GUARD_BIAS - v for v in vb))
        if int(ctr[FIRST_ROW]) == 0:
            fr = min(rb)
            ctr[FIRST_ROW] = fr
            ctr[FIRST_VALUE] = min(v for r, v in zip(rb, vb, strict=True) if r == fr)
        if block is not None:
            _claim(block, sorted(set(zip(rb, vb, qb, strict=True))))
            block[OFF_DONE] += n  # last: these hits' offenders are in
        start = end


def _claim(block: torch.Tensor, candidates: list[tuple[int, int, int]]) -> None:
    """The kernel's ``_claim_offenders`` over one program's distinct candidates, lowest first: a candidate takes the
    first empty entry unless its key is kept already; a full block (its last entry claimed) takes nothing."""
    k = int(block[1])
    if k <= 0 or int(block[OFF_HEADER + (k - 1) * OFF_ENTRY + E_KEY]) != 0:
        return
    keys = block[OFF_HEADER + E_KEY :: OFF_ENTRY][:k].tolist()
    for rb, vb, qb in candidates[: 2 * k]:
        key = offender_key(rb, vb, qb)
        if key in keys:
            continue
        if 0 not in keys:
            return
        j = keys.index(0)
        keys[j] = key
        base = OFF_HEADER + j * OFF_ENTRY
        # KEY, then REQ and VALUE, ROW last: a reader takes an entry as complete once its ROW is non-zero.
        block[base + E_KEY] = key
        block[base + E_REQ] = qb
        block[base + E_VALUE] = vb
        block[base + E_ROW] = rb


def _fill(t: torch.Tensor, value: int) -> torch.Tensor:
    # The kernel stores the value converted to the tensor's type (int32 truncates), not an overflow error.
    return torch.tensor(value, dtype=torch.int64).to(t.dtype)


def _entries(
    at: Callable[[int], _Row],
    row: int,
    t: torch.Tensor,
    used: torch.Tensor | None,
    width: int,
    lo: int,
    hi: int,
    pad: int | None,
    safe: int,
    mask: bool,
    req: int,
    rq: torch.Tensor,
    sg: torch.Tensor,
) -> None:
    """One rule's entries (flattened ``t``; ``used``: the checked lanes, None = all): count, attribute, repair."""
    flat = t.view(-1)
    v = flat.to(torch.int64)
    bad = (v < lo) | (v >= hi)
    if pad is not None:
        bad &= v != pad
    if used is not None:
        bad &= used
    pos = bad.nonzero().view(-1)
    if pos.numel() == 0:
        return
    rows = pos // width
    _fault(*at(row), pos // BLOCK, _sat(rows), _sat(v[pos]), _request_words(rows, req, rq, sg))
    if mask:
        flat[pos] = _fill(flat, safe)


def _lengths(
    ctr: torch.Tensor,
    block: torch.Tensor | None,
    a: torch.Tensor,
    width: int,
    mask: bool,
    req: int = 0,
    rq: torch.Tensor | None = None,
    sg: torch.Tensor | None = None,
) -> None:
    """The owner program's lengths check: a count outside ``[0, width]`` is bad (row = the table row, with the table
    rule's request of that row, like the kernel's); mask clamps."""
    ln = a.to(torch.int64)
    bad = (ln < 0) | (ln > width)
    k = bad.nonzero().view(-1)
    if k.numel() == 0:
        return
    q = torch.zeros_like(k) if rq is None or sg is None else _request_words(k, req, rq, sg)
    _fault(ctr, block, k // ABLOCK, k, _sat(ln[k]), q)
    if mask:
        a[k] = ln[k].clamp(0, width).to(a.dtype)


def _indptr(ctr: torch.Tensor, block: torch.Tensor | None, a: torch.Tensor, ni: int, mask: bool) -> None:
    """The owner program's indptr check (the kernel's ``_indptr_check``): entry 0 must be 0; entry ``k >= 1`` must be
    in ``[0, ni]`` and not below the last good entry before it, which is the prefix max of the in-range entries from
    1 on (0 before any); mask writes that last good entry (0 at ``k == 0``)."""
    v = a.to(torch.int64)
    n = v.numel()
    idx = torch.arange(n)
    in_range = (v >= 0) & (v <= ni)
    w = torch.where(in_range & (idx >= 1), v, -1)
    prev = torch.zeros(n, dtype=torch.int64)
    if n > 1:
        prev[1:] = torch.cummax(w[:-1], 0).values.clamp_min(0)
    bad = torch.where(idx == 0, v != 0, ~in_range | (v < prev))
    k = bad.nonzero().view(-1)
    if k.numel() == 0:
        return
    _fault(ctr, block, k // ABLOCK, k, _sat(v[k]), torch.zeros_like(k))
    if mask:
        a[k] = prev[k].to(a.dtype)


def _in_range(t: torch.Tensor, lo: int, hi: int, pad: int | None = None) -> bool:
    """Every entry of ``t`` is in ``[lo, hi)`` or is ``pad`` (an empty tensor: yes), by the host clean test
    (:func:`tripwire.validate._rules.entries_clean`). A small tensor (a decode step's metadata) is read as a list,
    which costs less than a torch op's dispatch (a 2-D one row by row, joined in Python: a flattening ``view`` would
    be one more dispatch). A larger one stays a tensor (a list would be a Python object per entry): one ``aminmax``,
    whose extremes take the same test without the padding (an extreme that is the padding says nothing of the
    entries between it and the range, so such a tensor takes the exact path, which counts no padding)."""
    n = t.numel()
    if n == 0:
        return True
    if n <= _SMALL:
        vals = t.tolist()
        return entries_clean(list(chain.from_iterable(vals)) if t.dim() == 2 else vals, lo, hi, pad)
    mn, mx = torch.aminmax(t)
    return entries_clean([int(mn), int(mx)], lo, hi)


def _lengths_in_range(a: torch.Tensor, width: int) -> bool:
    """Every per-row count of ``a`` is in ``[0, width]``, by :func:`tripwire.validate._rules.lengths_clean`: on the
    list of a small tensor, on the extremes of a larger one (exact for a range)."""
    if a.numel() <= _SMALL:
        return lengths_clean(a.tolist(), width)
    mn, mx = torch.aminmax(a)
    return lengths_clean([int(mn), int(mx)], width)


def _indptr_in_range(a: torch.Tensor, ni: int) -> bool:
    """The indptr ``a`` starts at 0, never decreases and ends within ``ni``: no entry is bad. A small one is
    :func:`tripwire.validate._rules.indptr_clean` on its list; a larger one is the same rule in three tensor reads
    (its order is what is tested, which a pair of extremes cannot show, and a list would be a Python object per
    entry)."""
    n = a.numel()
    if n <= _SMALL:
        return indptr_clean(a.tolist(), ni)
    if int(a[0]) != 0:
        return False
    return int(a[n - 1]) <= ni and bool((a[1:] >= a[:-1]).all())


# Per rule, the fields launch() reads, in one tuple: (kind, tensor, aux, requests, segments, lo, hi, pad or None,
# safe, row, aux_row, req, has_len, own_aux).
_Fields = tuple[int, int, int, int, int, int, int, "int | None", int, int, int, int, bool, bool]
# Rules -> its fields, keyed by identity (a validator keeps one Rules for its life; the custom op builds one per
# call, hence the bound).
_FIELDS_OF: dict[int, tuple[_r.Rules, tuple[_Fields, ...]]] = {}
_FIELDS_KEEP = 64


def _fields(rules: _r.Rules) -> tuple[_Fields, ...]:
    hit = _FIELDS_OF.get(id(rules))
    if hit is not None and hit[0] is rules:
        return hit[1]
    out = tuple(
        (
            rules.kind[i],
            rules.tensor[i],
            rules.aux[i],
            rules.requests[i],
            rules.segments[i],
            rules.lo[i],
            rules.hi[i],
            rules.pad[i] if rules.has_pad[i] else None,
            rules.safe[i],
            rules.row[i],
            rules.aux_row[i],
            rules.req[i],
            rules.has_len[i],
            rules.own_aux[i],
        )
        for i in range(len(rules.kind))
    )
    if len(_FIELDS_OF) >= _FIELDS_KEEP:
        _FIELDS_OF.clear()
    _FIELDS_OF[id(rules)] = (rules, out)
    return out


def launch(
    arena: torch.Tensor,
    rules: Rules,
    tensors: Sequence[torch.Tensor],
    *,
    mask: bool,
    offenders: torch.Tensor | None = None,
) -> None:
    """Check (and with ``mask`` repair) the call's CPU ``tensors`` under ``rules``, recording into ``arena`` (the
    CPU arena's rows, ``int64 [capacity, 8]``) and its offender blocks (``offenders``; found from the arena when
    None). The preconditions are the kernel's (``tripwire.validate._triton.launch``), checked by the Validator."""
    if offenders is None:
        offenders = offenders_of(arena)

    def at(row: int) -> _Row:
        # Resolved on the fault path only: the clean path touches no arena word.
        ctr = arena[row]
        return ctr, (offenders[row] if offenders is not None and int(ctr[OFFENDERS]) != 0 else None)

    for kind, ti, ai, ri, si, lo, hi, pad, safe, row, aux_row, req, has_len, own_aux in _fields(rules):
        t = tensors[ti]
        if kind == CSR:
            a = tensors[ai]
            ni = t.numel()
            if not _in_range(t, lo, hi, pad):
                # The used end: the largest in-range indptr entry past the first (what the repaired indptr ends at).
                tail = a[1:].to(torch.int64)
                ok = tail[(tail >= 0) & (tail <= ni)]
                end = int(ok.max()) if ok.numel() else 0
                used = torch.arange(ni) < end
                _entries(at, row, t, used, 1, lo, hi, pad, safe, mask, req, tensors[ri], a)
            if own_aux and not _indptr_in_range(a, ni):
                _indptr(*at(aux_row), a, ni, mask)
        else:
            width = t.shape[1] if t.dim() == 2 else 1
            if not _in_range(t, lo, hi, pad):
                used = None
                if has_len:
                    # Clamped on read like the kernel: a length past the width checks the whole row, a negative one
                    # checks nothing.
                    ln = tensors[ai].to(torch.int64).clamp(0, width)
                    used = (torch.arange(width).unsqueeze(0) < ln.unsqueeze(1)).view(-1)
                _entries(at, row, t, used, width, lo, hi, pad, safe, mask, req, tensors[ri], tensors[si])
            if own_aux and not _lengths_in_range(tensors[ai], width):
                _lengths(*at(aux_row), tensors[ai], width, mask, req, tensors[ri], tensors[si])
