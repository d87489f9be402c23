"""The confirmation state machine: which rises of which rows are seen, pending, confirmed, per device.

Kernels bump a row's count before they write its extremes and its first offender, so the copy that first shows a
rise may not hold the rest of that hit. A rise first seen in copy k is therefore confirmed from copy k+1, with
that copy's row; it waits (a bounded number of extra copies) while the first-offender pair has not landed or while
the count is still rising. A read that is complete (drain's synchronous read, a lost reader's last rows) confirms
at once.

A row's "progress" is the sum of its kind's count slots (a guard row: its count; a clip row: K and V clipped), as
the kind's reporter declares them. Rows of a kind without a reporter are read and never confirmed (logged once per
registry size). A progress that went down was zeroed behind the machine's back (a reset of another kind): it is
followed, and nothing is reported.

:class:`Confirmer` holds the state of every device; it decides, it does not report: :meth:`Confirmer.process`
returns the rows to report, and the monitor hands them to their reporters. It is not thread-safe: the monitor
calls it under its lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ..layout import COUNT, E_KEY, E_ROW, E_VALUE, FIRST_ROW, FIRST_VALUE, OFF_DONE, OFF_ENTRY, OFF_HEADER, SLOTS
from ..sites import GUARD_KINDS, Site, SiteRegistry

log = logging.getLogger("tripwire")

# A confirmation waits at most this many extra copies for a first-offender pair that has not landed yet.
MAX_EXTRA_CONFIRM_COPIES = 3
# ... and, for a row's offenders (which the fault path writes after the pair: a longer path, and a slow one in the
# Triton interpreter), at least this many seconds since the rise was seen. Only a counter whose kernel records no
# offenders waits this long (its report then comes without them).
OFFENDERS_WAIT_S = 0.25
# Re-poll delay while a confirmation is pending (a D2H copy of the arena lands in tens of microseconds), read by the
# reader loop each tick.
CONFIRM_REPOLL_S = 0.001

# A confirmed rise: the site and the row (this copy's) that confirms it; a guard row read with its offender block
# carries the block after its SLOTS words (tripwire._runtime.hit.Hit.from_row decodes it).
Confirmed = tuple[Site, np.ndarray]


def offenders_landed(block: np.ndarray, count: int) -> bool:
    """The offenders of a row's ``count`` hits are all in ``block``: its recorded-hits word has reached the count, and
    every claimed entry has its owner's words (a key is claimed before they are written)."""
    entries = block[OFF_HEADER:].reshape(-1, OFF_ENTRY)
    claimed = entries[:, E_KEY] != 0
    return bool(
        int(block[OFF_DONE]) >= count
        and np.all(entries[claimed, E_ROW] != 0)
        and np.all(entries[claimed, E_VALUE] != 0)
    )


@dataclass
class _Device:
    reported: np.ndarray  # per row: the progress already reported
    # Rows seen rising and not yet confirmed: row -> [extra copies waited, progress in the newest copy, time seen].
    pending: dict[int, list] = field(default_factory=dict)
    latest: np.ndarray | None = None  # the rows processed last
    # Per row: the progress a complete read confirmed ahead of the reader (confirm_now), until a copy reaches it. A
    # copy below it landed before that read's kernels ran (stale), not after a zeroing: it must not lower ``reported``
    # (the next copy would report the same rise again).
    floor: dict[int, int] = field(default_factory=dict)


class Confirmer:
    """The per-device confirmation state of one monitor.

    ``count_slots(kind)``: the slots whose sum is a row's progress for rows of ``kind``, or None when no reporter
    handles that kind (its rows are then never confirmed). ``max_extra_copies`` bounds the wait for a first
    offender that has not landed (default :data:`MAX_EXTRA_CONFIRM_COPIES`); ``offenders_wait_s`` the wait for a
    row's offenders (default :data:`OFFENDERS_WAIT_S`).
    """

    def __init__(
        self,
        registry: SiteRegistry,
        capacity: int,
        count_slots: Callable[[str], tuple[int, ...] | None],
        *,
        max_extra_copies: int = MAX_EXTRA_CONFIRM_COPIES,
    ) -> None:
        self.registry = registry
        self.capacity = capacity
        self.max_extra_copies = max_extra_copies
        self.offenders_wait_s = OFFENDERS_WAIT_S
        self._count_slots = count_slots
        self._devices: dict[str, _Device] = {}
        # Per registry size: the kinds present, the rows a reporter handles, and the progress plan (slot, 0/1 mask
        # or None = every row counts that slot).
        self._plan: tuple[int, tuple[str, ...], np.ndarray, tuple[tuple[int, np.ndarray | None], ...]] | None = None
        self.decoded = 0  # copies that went through process() (a quiet tick never does)

    # ------------------------------------------------------------------ reading the state
    def reported(self, device: str, row: int) -> int:
        """The progress already confirmed (and so reported) for ``row`` on ``device``; 0 before its first decode."""
        d = self._devices.get(device)
        return 0 if d is None or row >= d.reported.shape[0] else int(d.reported[row])

    def reported_rows(self, device: str) -> np.ndarray | None:
        """Every row's confirmed progress on ``device`` (a read-only view), or None before its first decode."""
        d = self._devices.get(device)
        if d is None:
            return None
        view = d.reported.view()
        view.flags.writeable = False
        return view

    def pending(self, device: str) -> tuple[int, ...]:
        """The rows of ``device`` seen rising and waiting for their confirming copy, in row order."""
        d = self._devices.get(device)
        return () if d is None else tuple(sorted(d.pending))

    def any_pending(self) -> bool:
        return any(d.pending for d in self._devices.values())

    def latest(self, device: str) -> np.ndarray | None:
        """The rows of ``device`` processed last (None before the first)."""
        d = self._devices.get(device)
        return None if d is None else d.latest

    def all_latest(self) -> dict[str, np.ndarray]:
        return {name: d.latest for name, d in self._devices.items() if d.latest is not None}

    def devices(self) -> tuple[str, ...]:
        return tuple(self._devices)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds with a reporter among the rows decoded last."""
        return () if self._plan is None else self._plan[1]

    def quiet_reference(self, device: str) -> np.ndarray | None:
        """The rows a landed copy may be compared with to skip its decode (the quiet-tick fast path), or None.

        Rows identical to the last processed ones change nothing here (no rise, no fall, same registry size),
        unless a confirmation is waiting: those count copies (and give up after a few), so then every landed copy
        must reach :meth:`process`."""
        d = self._devices.get(device)
        return None if d is None or d.pending else d.latest

    # ------------------------------------------------------------------ changing it
    def process(
        self,
        device: str,
        rows: np.ndarray,
        *,
        final: bool,
        offenders: Mapping[int, np.ndarray] | None = None,
        now: float | None = None,
    ) -> list[Confirmed]:
        """Take one landed copy of ``device``'s rows; return the rises it confirms, in row order (pending ones first,
        then, when ``final``, the new ones). With ``final`` (a complete, synchronous read) nothing waits.

        ``offenders``: the offender blocks that came with this copy, by row (None where the arena keeps none). A
        guard row then confirms only with its block, landed (:func:`offenders_landed`), which it carries. ``now``
        (monotonic seconds, default: the clock) times the wait for offenders."""
        now = time.monotonic() if now is None else now
        self.decoded += 1
        n = rows.shape[0]
        d = self._device(device)
        d.latest = rows
        reported, pending = d.reported, d.pending
        handled, plan = self._plan_for(n)
        # progress = the sum of each row's count slots, one whole-column operation per slot in use (_plan_for).
        progress = np.zeros(n, dtype=np.int64)
        for slot, mask in plan:
            progress += rows[:, slot] if mask is None else rows[:, slot] * mask
        down = progress < reported[:n]
        if d.floor:
            for rid, low in list(d.floor.items()):
                if rid < n and progress[rid] < low:
                    down[rid] = False  # a stale copy of a row a complete read confirmed: keep what was reported
                else:
                    del d.floor[rid]  # a copy has caught up with the complete read
        reported[:n][down] = progress[down]
        out: list[Confirmed] = []
        # 1) Confirm what an earlier copy saw rise, with THIS copy's row (it has the extremes). Wait (a bounded number
        #    of extra copies) while the first-offender pair has not landed, or while the count is still rising: a hit
        #    counted in this copy may not have its extremes in it yet, and confirming now would mark it reported.
        for rid in sorted(pending):
            site = self.registry.by_id(rid)
            row = rows[rid]
            waited, seen, since = pending[rid]
            guard = site.kind in GUARD_KINDS
            not_landed = guard and (row[FIRST_ROW] == 0 or row[FIRST_VALUE] == 0)
            wait_offenders = False
            block = None
            if guard and offenders is not None:
                # The blocks travel with the copy after the one that saw the rise (the reader is asked for them
                # then): until they are here and landed, wait (a few copies, and some time: see OFFENDERS_WAIT_S).
                block = offenders.get(rid)
                wait_offenders = block is None or not offenders_landed(block, int(row[COUNT]))
            more = waited < self.max_extra_copies or (wait_offenders and now - since < self.offenders_wait_s)
            if not final and (not_landed or wait_offenders or progress[rid] > seen) and more:
                pending[rid] = [waited + 1, int(progress[rid]), since]
                continue
            del pending[rid]
            reported[rid] = progress[rid]
            out.append((site, row if block is None else np.concatenate([row, block])))
        # 2) New rises: pending now, confirmed from the next copy (or at once when this read is final).
        for rid in np.nonzero((progress > reported[:n]) & handled)[0].tolist():
            if final:
                reported[rid] = progress[rid]
                site = self.registry.by_id(rid)
                block = offenders.get(rid) if offenders is not None and site.kind in GUARD_KINDS else None
                out.append((site, rows[rid] if block is None else np.concatenate([rows[rid], block])))
            elif rid not in pending:
                pending[rid] = [0, int(progress[rid]), now]
        return out

    def _device(self, device: str) -> _Device:
        """``device``'s state, made at its first read and grown to the capacity (a registry grown since)."""
        d = self._devices.get(device)
        if d is None:
            d = self._devices[device] = _Device(np.zeros(self.capacity, dtype=np.int64))
        elif d.reported.shape[0] < self.capacity:
            grown = np.zeros(self.capacity, dtype=np.int64)
            grown[: d.reported.shape[0]] = d.reported
            d.reported = grown
        return d

    def confirm_now(self, device: str, rows: Mapping[int, np.ndarray]) -> list[Confirmed]:
        """Confirm at once the rises of a complete read of some rows (row id -> its words, a guard row's offender
        block after them: a verdict's copy, which landed after the step's kernels in stream order): each row whose
        progress passed what was reported is confirmed with that row (and no longer pending). Rows of a kind without
        a reporter are left alone."""
        d = self._device(device)
        out: list[Confirmed] = []
        for rid, row in rows.items():
            site = self.registry.by_id(rid)
            slots = self._count_slots(site.kind)
            if slots is None:
                continue
            progress = int(sum(int(row[s]) for s in slots))
            if progress > d.reported[rid]:
                d.reported[rid] = progress
                d.floor[rid] = progress
                d.pending.pop(rid, None)
                out.append((site, row))
        return out

    def lose(self, device: str) -> list[Confirmed]:
        """``device``'s reader is lost: confirm what its last rows showed rising (nobody will poll it again), and
        drop its pending rows so the reader stops re-polling fast."""
        d = self._devices.get(device)
        if d is None:
            return []
        out = self.process(device, d.latest, final=True) if d.latest is not None and d.pending else []
        d.pending.clear()
        return out

    def forget_latest(self, device: str | None = None) -> None:
        """Forget the rows processed last (one device's, or every device's): the next landed copy is decoded in
        full. Confirmed progress is kept, so nothing is reported twice."""
        for name, d in self._devices.items():
            if device is None or name == device:
                d.latest = None

    def clear(self) -> None:
        """Forget everything: reported progress, pending rises, the last rows, and the plan (so the next decode
        asks for every kind's count slots again, which re-makes reporters dropped with it)."""
        self._devices.clear()
        self._plan = None

    # ------------------------------------------------------------------ the progress plan
    def _plan_for(self, n: int) -> tuple[np.ndarray, tuple[tuple[int, np.ndarray | None], ...]]:
        """Which rows a reporter handles, and how to compute every row's progress as a few whole-column numpy
        operations: ``(slot, mask)`` pairs, mask None when every row counts that slot. Built once per registry size:
        the tick then does no fancy indexing (a cost per row, on every tick, under the engine's GIL)."""
        cached = self._plan
        if cached is not None and cached[0] == n:
            return cached[2], cached[3]
        groups: dict[str, list[int]] = {}
        slots_of: dict[str, tuple[int, ...]] = {}
        for site in self.registry.all()[:n]:
            if site.kind not in slots_of:
                slots = self._count_slots(site.kind)
                if slots is None:
                    # Logged once per registry change, not every tick; such rows are read but never reported.
                    log.error(
                        "no reporter for rows of kind %r (site %r): import the module that defines it",
                        site.kind,
                        site.name,
                    )
                    slots_of[site.kind] = ()
                    continue
                slots_of[site.kind] = slots
            if slots_of[site.kind]:
                groups.setdefault(site.kind, []).append(site.id)
        counts = np.zeros((n, SLOTS), dtype=bool)
        counts[:, COUNT] = True  # rows without a reporter: slot 0, like guard rows (read, never reported)
        handled = np.zeros(n, dtype=bool)
        for kind, ids in groups.items():
            counts[ids] = False
            handled[ids] = True
            for slot in slots_of[kind]:
                counts[ids, slot] = True
        plan = tuple(
            (slot, None if counts[:, slot].all() else counts[:, slot].astype(np.int64))
            for slot in range(SLOTS)
            if counts[:, slot].any()
        )
        self._plan = (n, tuple(groups), handled, plan)
        return handled, plan
