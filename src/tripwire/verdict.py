"""Same-step verdicts: a right answer or an error, never a masked result served as a success.

The reader's verdict comes about two intervals after a kernel ran: fine for a stop, too late for containment (a
request that finishes sooner is handed back with a masked result). A :class:`Verdicts` ring gives an engine the
verdict of ITS OWN step, before it hands any request of that step back::

    ring = monitor.verdicts(device, sites)      # before any capture: pinned ring slots, a device staging area
    loop:
        step()                                  # the step's kernels (validators, guarded kernels) on `stream`
        ticket = ring.enqueue(stream)           # one gather kernel + one small copy, in the step's stream order
        tokens = sampled.tolist()               # the engine's OWN per-step wait for that stream (no extra sync)
        verdict = ring.take(ticket)             # host decode, microseconds: fail verdict.tainted, then hand back

* ``enqueue`` copies the ring's sites' rows and offender blocks into a pinned slot and CONSUMES the offenders it
  copied (the entries are zeroed after the copy, in stream order), so offenders are per step: "more than K distinct
  offenders" means K in one step, and the next step's are attributed again. It never syncs and never allocates, so
  it can be captured into the step's graph (the graph then owns that slot: see :meth:`Verdicts.enqueue`).
* The engine already waits for the stream once per step to read its sampled tokens. Stream order puts the copy after
  every kernel of the step, so once that wait returned the copy has landed and is complete (a count and all its
  offenders): no confirmation copy is needed. ``take`` checks that it landed (an event query, never a wait) and
  refuses a copy that has not; ``take(wait=True)`` is for a loop that samples nothing: a bounded wait on that one
  copy's event (it costs the rest of the step's GPU time on the host, like any sync).
* A verdict names the requests the step's offenders belong to (``tainted``, by the engine's own ids where the
  kernels' request maps used :meth:`RequestNames.number`), ``fail_all`` when a rise cannot be attributed in full (an
  offender without a request, a full block whose count rose past its offenders, hits without offenders), and the stop
  it armed (``stop``): without containment a fatal site, or any rise in ``raise`` mode, arms the monitor's stop at
  once, in the same step. With containment (the monitor's ``contain`` setting: ``Monitor(contain=True)``,
  ``TRIPWIRE_CONTAIN=1`` or :meth:`tripwire.Monitor.set_contain`, read at each verdict that saw a rise) it arms
  nothing: the engine fails ``tainted`` (or, under ``fail_all``, every request of the step) and goes on; a fatal
  site's masked write is then contained too (the write went to a trash slot: the damage is the writer's own).
  Reading a verdict (``tainted``, ``taints``, ``failure``) changes no policy.
* A verdict that saw a rise reports it before ``take`` returns (the monitor's report, every sink included: an engine
  never fails a request its events do not yet explain); the reader reports every other rise (its reports carry the
  offenders the verdicts consumed) and, for the ring's sites under containment, leaves the verdict to the ring: it
  does not arm for them. The ring is the only containment path: a site no ring covers arms the stop under
  containment exactly as without it (:mod:`tripwire.contain`).

One ring per (device, site): a second ring over a site would find its offenders consumed. Kernels on another stream
that hit the ring's sites concurrently with an ``enqueue`` may lose offenders to its consumption: their rise then
fails closed (``fail_all``). CPU arenas are read directly (no copy, ``stream`` ignored).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._runtime.capture import is_capturing
from ._runtime.driver import NOT_READY
from ._runtime.report import offenders_text
from .contain import Taint
from .errors import CaptureError, GuardTripped
from .layout import COUNT, E_KEY, E_REQ, E_ROW, E_VALUE, OFF_ENTRY, OFF_HEADER, SLOTS, decode
from .sinks import Offender
from .sites import GUARD_KINDS, Site

if TYPE_CHECKING:
    from ._runtime.report import ReportContext

__all__ = ["Ticket", "Verdict", "VerdictHit", "Verdicts"]

log = logging.getLogger("tripwire")

# The bounded wait of take(wait=True), and its poll step: a verdict never blocks an engine forever.
WAIT_TIMEOUT_S = 10.0
_WAIT_POLL_S = 20e-6
_NULL = contextlib.nullcontext()


@dataclass(frozen=True)
class VerdictHit:
    """One site's rise in one step: ``delta`` hits, ``offenders`` the distinct ones its kernels kept (requests by
    the engine's ids where known), ``attributed`` whether every hit is accounted for by an offender that names a
    request."""

    site: str
    fatal: bool
    delta: int
    total: int
    offenders: tuple[Offender, ...]
    attributed: bool


@dataclass(frozen=True)
class Verdict:
    """The verdict of one step (see the module docstring). ``clean``: nothing rose at the ring's sites.

    ``tainted``: the requests the step's offenders name. ``fail_all``: some rise cannot be attributed in full; an
    engine under containment fails every request of the step, and without containment treats each as tainted (keeps
    its state out of any cache). ``stop``: the GuardTripped this verdict armed (None: it armed nothing; the monitor may
    be armed otherwise, :func:`tripwire.check` says). ``taints``: one :class:`tripwire.Taint` per offender, for the
    error an engine gives the failed request."""

    device: str
    hits: tuple[VerdictHit, ...] = ()
    tainted: frozenset[Any] = frozenset()
    fail_all: bool = False
    stop: GuardTripped | None = None
    taints: tuple[Taint, ...] = ()

    @property
    def clean(self) -> bool:
        return not self.hits

    def taint_of(self, request: Any) -> Taint | None:
        """The first taint naming ``request`` (None when the step's offenders do not name it)."""
        for t in self.taints:
            if t.request == request:
                return t
        return None

    def failure(self, request: Any) -> Taint | None:
        """Why ``request`` must fail under containment: its own taint, or, under ``fail_all``, the first unattributed
        hit's (a taint with ``request`` None); None when it may be handed back."""
        own = self.taint_of(request)
        if own is not None or not self.fail_all:
            return own
        for t in self.taints:
            if t.request is None:
                return t
        h = self.hits[0]
        return Taint(None, h.site, self.device, None, None)


@dataclass
class Ticket:
    """One enqueued verdict copy: its ring slot and sequence number. ``captured``: the copy was recorded into a CUDA
    graph, which owns the slot from then on (every replay rewrites it)."""

    slot: int
    seq: int
    captured: bool = False
    taken: bool = field(default=False, repr=False)


class Verdicts:
    """A ring of verdict slots over ``sites`` on one device (build it with :meth:`tripwire.Monitor.verdicts`).

    ``depth``: how many verdicts may be in flight (enqueued, not yet taken): an engine that runs its next step
    before it takes the previous step's verdict (async batching) needs 2. ``enqueue`` refuses to overwrite a slot
    whose verdict was not taken (a ring too small for the engine's queue depth): nothing is consumed then, so no
    count or offender is lost."""

    def __init__(
        self,
        ctx: ReportContext,
        device: torch.device,
        sites: Sequence[Site],
        depth: int,
        *,
        prealloc: Callable[[torch.device], torch.Tensor],
        offenders: Callable[[torch.device], torch.Tensor | None],
        report: Callable[[str, dict[int, np.ndarray]], None] | None = None,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= 64:
            raise ValueError(f"depth={depth!r}: expected a whole number of verdict slots in [1, 64]")
        if not sites:
            raise ValueError("a verdict ring needs at least one site")
        for s in sites:
            if s.kind not in GUARD_KINDS:
                raise ValueError(f"site {s.name!r} is a {s.kind!r} row; verdicts read guard-layout rows only")
            if s.id >= ctx.settings().capacity:
                raise ValueError(f"site {s.name!r} owns row {s.id}, past the arena's {ctx.settings().capacity} rows")
        self.context = ctx
        # The monitor's synchronous report of a verdict's rows (Pipeline.locked_report): a rise a verdict saw has
        # reached every sink before take() returns it, so an engine never fails a request its events do not explain.
        self._report = report
        self.device = device
        self.name = str(device)
        self.sites = tuple(sites)
        self.depth = depth
        self._rows_t = prealloc(device)
        off = offenders(device)
        assert off is not None
        self._off_t = off
        self.block_words = int(off.shape[1])
        self.k = ctx.settings().offenders
        self._ids = np.array([s.id for s in self.sites], dtype=np.int64)
        width = SLOTS + self.block_words
        n = len(self.sites)
        self._cuda = device.type == "cuda"
        # Per site: the count the last verdict accounted for (a reset's zeroing re-baselines it: see _decode).
        self._last = np.zeros(n, dtype=np.int64)
        self._seq = 0
        self._clean = Verdict(self.name)
        self._copy: Any = None
        self._driver: Any = None
        self._open: list[Ticket | None] = [None] * depth
        if self._cuda:
            from ._runtime import verdict_kernel as _vk

            # Allocated here, before any capture; the graph of a captured enqueue holds these addresses.
            self._host = torch.zeros((depth, n, width), dtype=torch.int64, pin_memory=True)
            self._np = self._host.numpy()
            self._dev_ids = torch.tensor(self._ids, dtype=torch.int64, device=device)
            self.zero_copy = _vk.zero_copy(device, n, width)
            if self.zero_copy:
                # The kernel writes the pinned slot itself: one kernel node per verdict.
                self._launch = _vk.bind(self._rows_t, self._off_t, self._dev_ids, self._host, width)
                self._copy = None
                scratch = torch.zeros((1, n, width), dtype=torch.int64, pin_memory=True)
            else:
                staging = torch.zeros((depth, n, width), dtype=torch.int64, device=device)
                self._launch = _vk.bind(self._rows_t, self._off_t, self._dev_ids, staging, width)
                pairs = [(self._host[i], staging[i]) for i in range(depth)]

                def copy(slot: int) -> None:
                    # Pinned destination, non_blocking: an async copy in stream order (capturable), never a wait.
                    pairs[slot][0].copy_(pairs[slot][1], non_blocking=True)

                self._copy = copy
                scratch = torch.zeros((1, n, width), dtype=torch.int64, device=device)
            self._graphs = _vk.slot_graphs(self._launch, depth, device, self._copy, scratch)
            self._events = [torch.cuda.Event() for _ in range(depth)]
            for e in self._events:
                e.record()  # creates the event now (torch creates it lazily), so the driver calls below have a handle
            torch.cuda.synchronize(device)
            self._driver = _vk.graph_driver(self._graphs)
            if self._driver is not None:
                self._execs = [ctypes.c_void_p(g.raw_cuda_graph_exec()) for g in self._graphs]
                self._cu_events = [ctypes.c_void_p(e.cuda_event) for e in self._events]
        else:
            self._np = np.zeros((depth, n, width), dtype=np.int64)

    # ------------------------------------------------------------------ the step path
    def enqueue(self, stream: Any = None) -> Ticket:
        """Copy the ring's rows and offender blocks into the next slot after everything enqueued so far on ``stream``
        (default: the current stream), and consume the offenders copied. No sync, no allocation.

        Inside a CUDA-graph capture the copy is recorded into the graph, which owns that slot from then on: take its
        ticket after each replay (and the engine's wait). Raises RuntimeError when the slot's previous verdict was not
        taken (the ring is too small for the engine's queue depth)."""
        slot = self._free_slot()
        if not self._cuda:
            # CPU: the kernels that ran are done; read the arena (views, no copy) and consume its offender entries.
            rows, off = self._rows_t.numpy(), self._off_t.numpy()
            self._np[slot, :, :SLOTS] = rows[self._ids]
            self._np[slot, :, SLOTS:] = off[self._ids]
            if self._np[slot, :, SLOTS + OFF_HEADER :].any():  # a clean step: one scan of a few zero words
                self._to_ledger(self._np[slot])
            off[self._ids, OFF_HEADER:] = 0
            return self._issue(slot, captured=False)
        # The ring's construction initialised CUDA: the capture query alone (is_capturing's init check is for callers
        # that may not have touched CUDA), one C call on the step path.
        captured = torch.cuda.is_current_stream_capturing()
        if captured:
            # Recorded into the caller's graph (on the stream it captures): the kernel, and on the staging path the
            # copy to the pinned slot.
            cur = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(stream) if stream is not None and stream != cur else _NULL:
                self._launch(slot)
                if self._copy is not None:
                    self._copy(slot)
            return self._issue(slot, captured=True)
        s = torch.cuda.current_stream(self.device) if stream is None else stream
        drv = self._driver
        if drv is not None:
            # The slot's graph and its event through the driver: two C calls, no Python stream switch.
            handle = s.cuda_stream  # an int: the argtypes (c_void_p) convert it in C, no ctypes object per step
            rc = drv.graph_launch(self._execs[slot], handle) or drv.event_record(self._cu_events[slot], handle)
            if rc != 0:
                raise RuntimeError(f"tripwire: the verdict's graph launch on {self.name} failed (CUDA error {rc})")
        else:
            with torch.cuda.stream(s):
                self._graphs[slot].replay()
                self._events[slot].record(s)
        return self._issue(slot, captured=captured)

    def take(
        self, ticket: Ticket, *, wait: bool = False, stream: Any = None, timeout: float = WAIT_TIMEOUT_S
    ) -> Verdict:
        """The verdict of ``ticket``'s step: decoded on the host, no GPU call but an event query (and, with ``wait``,
        a bounded wait on that copy's event, TimeoutError after ``timeout`` s). Call it after the engine's own wait
        for the step's stream. A copy that has not landed is refused (RuntimeError) and stays takeable.

        A captured ticket is read after each replay; with ``wait`` it needs the ``stream`` the graph was replayed
        on (an event is recorded there then). Not inside a capture (CaptureError)."""
        if torch.cuda.is_current_stream_capturing() if self._cuda else is_capturing():
            raise CaptureError("a verdict is read on the host and cannot be taken inside a CUDA-graph capture")
        if ticket.taken or self._open[ticket.slot] is not ticket:
            raise ValueError(f"{ticket!r} is not an open ticket of this ring (taken already, or another ring's)")
        if self._cuda:
            event = self._events[ticket.slot]
            if ticket.captured:
                if wait:
                    if stream is None:
                        raise ValueError("take(wait=True) of a captured ticket needs the stream the graph replayed on")
                    event.record(stream)
                    self._wait(event, timeout)
            elif not self._landed(ticket.slot):
                if not wait:
                    raise RuntimeError(
                        f"the verdict copy of {ticket!r} on {self.name} has not landed: take it after the engine's "
                        f"wait for the stream the step ran on (or take(wait=True), a bounded wait)"
                    )
                self._wait(event, timeout)
        slot = self._np[ticket.slot]
        verdict = self._decode(slot)
        if not ticket.captured:
            ticket.taken = True
            self._open[ticket.slot] = None
        if verdict.hits and self._report is not None:
            # Before the engine acts on the verdict (fails its requests): its rises reported now, each row with its
            # offender block, as one complete read (the copy landed in stream order after the step's kernels).
            hit = {h.site for h in verdict.hits}
            self._report(self.name, {s.id: slot[i].copy() for i, s in enumerate(self.sites) if s.name in hit})
        return verdict

    def absorb_untaken(self) -> None:
        """Put the offenders of every landed copy not yet taken into the ledger, the ticket staying open (the
        ledger keeps each offender once, so a later take adds nothing twice). For the monitor's final read: a CUDA
        enqueue consumed those offenders from the arena in stream order, so a report rendered from the arena alone
        would name an older request or none (the CPU enqueue ledgers them at once)."""
        if not self._cuda:
            return
        for t in self._open:
            if t is not None and not t.captured and self._landed(t.slot):
                slot = self._np[t.slot]
                if slot[:, SLOTS + OFF_HEADER :].any():
                    self._to_ledger(slot)

    # ------------------------------------------------------------------ internals
    def _free_slot(self) -> int:
        for i in range(self.depth):
            slot = (self._seq + i) % self.depth
            t = self._open[slot]
            if t is None:
                return slot
            if not t.captured:
                break
        raise RuntimeError(
            f"the verdict ring on {self.name} has {self.depth} slots and none is free: a verdict was not taken before "
            f"the next {self.depth} were enqueued (take every ticket, or build the ring with a larger depth for the "
            f"engine's queue depth); nothing was consumed"
        )

    def _issue(self, slot: int, *, captured: bool) -> Ticket:
        t = Ticket(slot, self._seq, captured)
        self._seq += 1
        self._open[slot] = t
        return t

    def _to_ledger(self, slot: np.ndarray) -> None:
        """The offenders a slot holds (consumed from the arena), into the ledger: on the CPU at the enqueue, before the
        block is cleared, and at the final read for a CUDA copy not taken (:meth:`absorb_untaken`). The reader reads
        the arena between this enqueue and its take, and a report rendered there would otherwise find them in
        neither the block nor the ledger. The take adds them again (the ledger keeps each once)."""
        ctx = self.context
        for i in np.nonzero(slot[:, SLOTS + OFF_HEADER :].any(axis=1))[0].tolist():
            offenders = _offenders(slot[i, SLOTS:], ctx.requests)
            ctx.ledger.add(self.name, self.sites[i].id, offenders)

    def _landed(self, slot: int) -> bool:
        drv = self._driver
        if drv is None:
            return bool(self._events[slot].query())
        rc = drv.event_query_released(self._cu_events[slot])
        if rc not in (0, NOT_READY):
            raise RuntimeError(f"tripwire: the verdict's event query on {self.name} failed (CUDA error {rc})")
        return rc == 0

    def _wait(self, event: Any, timeout: float) -> None:
        # A bounded poll, not event.synchronize(): a wedged device must not hang the engine's loop forever.
        deadline = time.monotonic() + timeout
        while not event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the verdict copy on {self.name} did not land within {timeout} s")
            time.sleep(_WAIT_POLL_S)

    def _decode(self, slot: np.ndarray) -> Verdict:
        counts = slot[:, COUNT]
        last = self._last
        if counts.tobytes() == last.tobytes():
            return self._clean  # the common step: one comparison of a few words, no allocation of a verdict
        ctx = self.context
        names = ctx.requests
        contain = ctx.settings().contain  # the monitor's one setting, read per dirty verdict
        hits: list[VerdictHit] = []
        taints: list[Taint] = []
        tainted: set[Any] = set()
        fail_all = False
        stop: GuardTripped | None = None
        for i in np.nonzero(counts != last)[0].tolist():
            site, total = self.sites[i], int(counts[i])
            # A count below the last verdict's: the counters were zeroed (reset) since; everything counts as new.
            delta = total - int(last[i]) if total >= last[i] else total
            last[i] = total
            if delta <= 0:
                continue
            offenders = _offenders(slot[i, SLOTS:], names)
            attributed = (
                bool(offenders)
                and all(o.request is not None for o in offenders)
                and (len(offenders) < self.k or delta <= len(offenders))
            )
            hits.append(VerdictHit(site.name, site.fatal, delta, total, offenders, attributed))
            for o in offenders:
                taints.append(Taint(o.request, site.name, self.name, o.row, o.value, site.kind))
                if o.request is not None:
                    tainted.add(o.request)
            if not attributed:
                fail_all = True
                first = offenders[0] if offenders else None
                row, value = (None, None) if first is None else (first.row, first.value)
                taints.append(Taint(None, site.name, self.name, row, value, site.kind))
            ctx.ledger.add(self.name, site.id, offenders)
            if not contain and (site.fatal or ctx.settings().mode == "raise"):
                exc = _tripped(site, self.name, total, delta, offenders)
                ctx.arm(exc)
                stop = stop or ctx.armed() or exc
        return Verdict(self.name, tuple(hits), frozenset(tainted), fail_all, stop, tuple(taints))

    def forget(self) -> None:
        """Re-baseline after the counters were zeroed (the monitor's reset calls it)."""
        self._last[:] = 0


def _offenders(block: np.ndarray, names: Any) -> tuple[Offender, ...]:
    out = []
    for entry in block[OFF_HEADER:].reshape(-1, OFF_ENTRY):
        if entry[E_KEY] == 0:
            break  # claimed in order: the first free entry ends the list
        row, value = decode(int(entry[E_ROW])), decode(int(entry[E_VALUE]))
        if row is None or value is None:
            continue  # cannot happen in stream order (the claim's words land before the kernel ends); skip, fail closed
        req = decode(int(entry[E_REQ]))
        out.append(Offender(row, value, None if req is None else names.name(req)))
    return tuple(out)


def _tripped(site: Site, device: str, total: int, delta: int, offenders: Iterable[Offender]) -> GuardTripped:
    offs = list(offenders)
    first = offs[0] if offs else None
    named = offenders_text(tuple(offs))
    fatal = " (FATAL site: the masked value was written somewhere durable)" if site.fatal else ""
    return GuardTripped(
        f"tripwire: MASKED FAULT at site {site.name!r} on {device}{fatal}: {delta} out-of-range access(es) masked in "
        f"this step ({total} total); offenders: {named or 'none recorded'}. The step's results are not correct, so "
        f"its requests are failed and the engine is stopped (the same-step verdict).",
        site=site.name,
        device=device,
        count=total,
        first_row=None if first is None else first.row,
        first_value=None if first is None else first.value,
        fatal=site.fatal,
    )
