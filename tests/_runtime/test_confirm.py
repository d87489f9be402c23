"""The confirmation state machine (tripwire._runtime.confirm), driven directly with rows as a reader would land them;
then through a Monitor's reader: the bounded wait for offenders that never land, and the loop's fast re-poll."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from tripwire import Monitor, SiteRegistry
from tripwire._runtime import confirm
from tripwire._runtime.confirm import MAX_EXTRA_CONFIRM_COPIES, OFFENDERS_WAIT_S, Confirmer
from tripwire.layout import COUNT, FIRST_ROW, FIRST_VALUE, MAX_ROW, SLOTS, encode
from tripwire.testing import write_hit

SLOTS_OF = {"guard": (COUNT,), "nonfinite": (COUNT,), "clip": (0, 1)}


def make(*kinds: str, **kw) -> tuple[SiteRegistry, Confirmer, list[str]]:
    reg = SiteRegistry(capacity=16)
    for i, kind in enumerate(kinds):
        reg.register(f"s{i}", kind=kind)
    asked: list[str] = []

    def count_slots(kind: str):
        asked.append(kind)
        return SLOTS_OF.get(kind)

    return reg, Confirmer(reg, 16, count_slots, **kw), asked


def rows(n: int) -> np.ndarray:
    return np.zeros((n, SLOTS), dtype=np.int64)


def hit(r: np.ndarray, rid: int, n: int = 1, *, first: tuple[int, int] | None = (1, 2)) -> np.ndarray:
    """A copy of ``r`` with ``n`` more hits in row ``rid`` (and its first offender when ``first``)."""
    r = r.copy()
    r[rid, COUNT] += n
    if first is not None:
        r[rid, FIRST_ROW], r[rid, FIRST_VALUE] = encode(first[0]), encode(first[1])
    return r


def names(confirmed) -> list[str]:
    return [site.name for site, _ in confirmed]


def test_a_rise_is_confirmed_from_the_next_copy_with_that_copys_row():
    _, c, _ = make("guard")
    seen = hit(rows(1), 0, first=None)  # the count landed before the first offender
    assert c.process("cpu", seen, final=False) == []
    assert c.pending("cpu") == (0,) and c.reported("cpu", 0) == 0
    later = hit(seen, 0, 0, first=(7, 70))
    (site, row), *rest = c.process("cpu", later, final=False)
    assert rest == [] and site.name == "s0" and row[FIRST_ROW] == encode(7)  # the confirming copy's row
    assert c.pending("cpu") == () and c.reported("cpu", 0) == 1


def test_the_wait_for_a_first_offender_is_bounded():
    _, c, _ = make("guard")
    r = hit(rows(1), 0, first=None)
    c.process("cpu", r, final=False)
    out = [c.process("cpu", r, final=False) for _ in range(MAX_EXTRA_CONFIRM_COPIES + 1)]
    assert [len(o) for o in out] == [0] * MAX_EXTRA_CONFIRM_COPIES + [1]  # then confirmed with what there is


def test_control_without_the_wait_the_pair_is_lost():
    """Control: confirming at once (no extra copies) confirms the copy that has the count but not the pair."""
    _, c, _ = make("guard", max_extra_copies=0)
    r = hit(rows(1), 0, first=None)
    c.process("cpu", r, final=False)
    ((_, row),) = c.process("cpu", r, final=False)
    assert row[FIRST_ROW] == 0


def test_a_count_still_rising_waits_for_it_to_settle():
    _, c, _ = make("guard")
    r = hit(rows(1), 0)
    c.process("cpu", r, final=False)
    r = hit(r, 0, 2)  # still rising in the confirming copy: its newest hits may lack their extremes
    assert c.process("cpu", r, final=False) == []
    ((_, row),) = c.process("cpu", r, final=False)
    assert int(row[COUNT]) == 3 and c.reported("cpu", 0) == 3


def test_a_final_read_confirms_at_once():
    _, c, _ = make("guard", "guard")
    r = hit(hit(rows(2), 1, first=None), 0)
    assert names(c.process("cpu", r, final=True)) == ["s0", "s1"]
    assert c.pending("cpu") == () and c.reported("cpu", 1) == 1


def test_a_count_that_went_down_is_followed_silently():
    _, c, _ = make("guard")
    r = hit(rows(1), 0, 5)
    c.process("cpu", r, final=True)
    assert c.process("cpu", rows(1), final=False) == [] and c.reported("cpu", 0) == 0  # zeroed behind its back
    assert names(c.process("cpu", hit(rows(1), 0), final=True)) == ["s0"]  # the next hit is seen again


def test_each_kind_counts_its_own_slots():
    _, c, _ = make("guard", "clip")
    r = rows(2)
    r[0, MAX_ROW] = encode(9)  # a guard row's slot 1 is an extreme, not a count
    r[1, 1] = 4  # a clip row's slot 1 is its V count
    assert names(c.process("cpu", r, final=True)) == ["s1"] and c.reported("cpu", 1) == 4


def test_rows_of_a_kind_without_a_reporter_are_never_confirmed(caplog):
    _, c, asked = make("guard", "mystery")
    r = hit(hit(rows(2), 0), 1)
    with caplog.at_level(logging.ERROR, logger="tripwire"):
        for _ in range(3):
            out = c.process("cpu", r, final=True)
            r = hit(r, 1)
    assert names(out) == [] and c.reported("cpu", 1) == 0
    assert sum("no reporter for rows of kind 'mystery'" in m for m in caplog.messages) == 1  # once per plan
    assert asked == ["guard", "mystery"]


def test_quiet_reference_is_withheld_while_a_confirmation_waits():
    _, c, _ = make("guard")
    quiet = rows(1)
    c.process("cpu", quiet, final=False)
    assert c.quiet_reference("cpu") is quiet
    c.process("cpu", hit(quiet, 0), final=False)
    assert c.pending("cpu") and c.quiet_reference("cpu") is None  # every copy must reach process() now


def test_lose_confirms_what_the_last_rows_showed():
    _, c, _ = make("guard")
    c.process("cpu", hit(rows(1), 0), final=False)
    assert names(c.lose("cpu")) == ["s0"] and c.pending("cpu") == () and not c.any_pending()
    assert c.lose("cpu") == [] and c.lose("cuda:7") == []


def test_devices_are_independent():
    _, c, _ = make("guard")
    c.process("cpu", hit(rows(1), 0), final=False)
    c.process("cuda:0", rows(1), final=False)
    assert c.pending("cpu") == (0,) and c.pending("cuda:0") == () and c.devices() == ("cpu", "cuda:0")


def test_clear_forgets_everything_and_asks_for_the_slots_again():
    _, c, asked = make("guard")
    c.process("cpu", hit(rows(1), 0), final=True)
    c.clear()
    assert c.reported("cpu", 0) == 0 and c.latest("cpu") is None and c.devices() == ()
    assert names(c.process("cpu", hit(rows(1), 0), final=True)) == ["s0"]
    assert asked == ["guard", "guard"]


def test_a_grown_registry_is_decoded_with_a_new_plan():
    reg, c, asked = make("guard")
    c.process("cpu", hit(rows(1), 0), final=True)
    reg.register("later", kind="clip")
    r = rows(2)
    r[0, COUNT] = 1
    r[1, 0] = 2
    assert names(c.process("cpu", r, final=True)) == ["later"] and asked == ["guard", "guard", "clip"]
    assert c.kinds == ("guard", "clip") and c.decoded == 2


def test_forget_latest_keeps_the_confirmed_progress():
    _, c, _ = make("guard")
    c.process("cpu", hit(rows(1), 0), final=True)
    c.forget_latest()
    assert c.latest("cpu") is None and c.quiet_reference("cpu") is None and c.reported("cpu", 0) == 1
    assert c.process("cpu", hit(rows(1), 0), final=True) == []  # nothing reported twice


@pytest.mark.parametrize("final", [False, True])
def test_reported_rows_are_read_only(final):
    _, c, _ = make("guard")
    c.process("cpu", hit(rows(1), 0), final=final)
    view = c.reported_rows("cpu")
    assert view is not None and not view.flags.writeable and c.reported_rows("cuda:0") is None


# ------------------------------------------------------------------------------------- through a Monitor's reader
def test_confirmation_does_not_wait_forever(registry, monitor, caplog):
    """A counter whose kernel writes neither the pair nor offenders: confirmed after a few copies and
    OFFENDERS_WAIT_S, with what there is."""
    caplog.set_level(logging.INFO, logger="tripwire")
    s = registry.register("k.site")
    monitor.counter(s, "cpu")[COUNT] += 1  # the count alone: what a kernel writes first
    for _ in range(6):
        monitor.poll()
    time.sleep(OFFENDERS_WAIT_S)
    monitor.poll()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "tripwire" and r.levelno == logging.WARNING]
    assert "row -, value -" in line  # reported, with what there is


def _latency_after_a_tick(registry, interval: float) -> float:
    m = Monitor(registry=registry, capacity=64, interval=interval, mode="raise", idle_tail=60)
    s = registry.register("k.latency")
    ctr = m.counter(s, "cpu")
    ticked = threading.Event()
    m.add_tick_hook(lambda _m: ticked.set())
    m.start()
    try:
        ticked.clear()
        ticked.wait(5)  # a tick just happened: the next one is a whole interval away
        t0 = time.monotonic()
        write_hit(ctr, 1, 1)
        while m.armed is None and time.monotonic() - t0 < 5:
            time.sleep(0.0005)
        return time.monotonic() - t0
    finally:
        m.stop()


def test_confirmation_repolls_fast(registry):
    # seen at the next tick (one interval), confirmed CONFIRM_REPOLL_S later: not a second whole interval
    assert _latency_after_a_tick(registry, 0.2) < 0.3


def test_control_without_fast_repoll_takes_two_intervals(registry, monkeypatch):
    monkeypatch.setattr(confirm, "CONFIRM_REPOLL_S", 10.0)
    assert _latency_after_a_tick(registry, 0.2) > 0.35
