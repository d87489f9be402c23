"""tripwire.distributed: one rank's stop reaches every rank through the job's store; store trouble never kills a
reader; the process groups are aborted after the stop is armed.

Two layers:
* in-process: several Monitors in this process play ranks over one TCPStore (or a fake store that fails or hangs);
  their reader threads or ``poll()`` drive the coordination.
* multi-process (the CI proof): 2 and 4 worker processes (``python tests/distributed/test_coordinator.py --worker``), gloo
  over a TCPStore on 127.0.0.1 whose master lives in a separate "store owner" process on a random free port, so a
  test can kill the store mid-run. Hits are simulated by writing a CPU arena's counter row exactly as a guarded
  kernel would (count, first offender, extremes); the monitor's own reader thread confirms them.

Every worker and store owner is joined with a timeout and killed on failure; the tests assert none outlives them.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from conftest import offenders_recorded
from tripwire import GuardTripped, Monitor
from tripwire.distributed import COORDINATION_SITE, coordinate
from tripwire.layout import COUNT, FIRST_ROW, FIRST_VALUE, MAX_ROW, MAX_VALUE, NEG_MIN, encode, encode_neg

# Multi-process runs: the reader interval, and the bound the design sets (every rank raises within 3 intervals).
INTERVAL = 0.2
BOUND = 3 * INTERVAL


def write_hit(ctr: torch.Tensor, row: int, value: int) -> None:
    """Write one hit into a guard row the way tripwire.triton.record_hit does (count first, then the rest)."""
    ctr[COUNT] += 1
    ctr[MAX_ROW] = max(int(ctr[MAX_ROW]), encode(row))
    ctr[MAX_VALUE] = max(int(ctr[MAX_VALUE]), encode(value))
    ctr[NEG_MIN] = max(int(ctr[NEG_MIN]), encode_neg(value))
    if int(ctr[FIRST_ROW]) == 0:
        ctr[FIRST_ROW] = encode(row)
        ctr[FIRST_VALUE] = encode(value)
    offenders_recorded(ctr, 1)  # last, as the fault path does (tripwire.layout)


def wait_until(pred, timeout: float, step: float = 0.005, drive=()) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in drive:
            m.poll()
        if pred():
            return True
        time.sleep(step)
    return pred()


# ====================================================================== in-process
@pytest.fixture
def store():
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield s
    del s


@pytest.fixture
def ranks(registry):
    """A factory of (monitor, coordinator) pairs sharing ``registry``; everything is closed and stopped after."""
    made: list = []

    def make(store, rank, **kw):
        mon_kw = {k: kw.pop(k) for k in ("mode", "interval") if k in kw}
        m = Monitor(registry=registry, capacity=64, report_every=10.0, **{"interval": 0.01, **mon_kw})
        m.prealloc("cpu")
        c = coordinate(store, rank=rank, monitor=m, **{"abort": False, "store_poll": 0.01, **kw})
        made.append((m, c))
        return m, c

    yield make
    for m, c in made:
        c.close()
        m.stop()


def test_no_process_group_and_no_store_is_a_clear_error(monitor):
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match=r"no store was given and no torch\.distributed process group"):
        coordinate(monitor=monitor)


def test_bad_arguments_are_rejected(monitor, store):
    with pytest.raises(ValueError, match="max_store_failures"):
        coordinate(store, rank=0, monitor=monitor, max_store_failures=0)
    with pytest.raises(ValueError, match="store_timeout"):
        coordinate(store, rank=0, monitor=monitor, store_timeout=float("nan"))
    with pytest.raises(ValueError, match="rank"):
        coordinate(store, rank=-1, monitor=monitor)
    with pytest.raises(TypeError, match="Store"):
        coordinate(object(), rank=0, monitor=monitor)


def test_a_monitor_is_coordinated_once(monitor, store):
    c = coordinate(store, rank=0, monitor=monitor)
    try:
        with pytest.raises(RuntimeError, match="already coordinated"):
            coordinate(store, rank=0, monitor=monitor)
    finally:
        c.close()
    coordinate(store, rank=0, monitor=monitor).close()  # after close(), allowed again


def test_fatal_hit_on_one_rank_arms_its_peers_naming_it(registry, store, ranks):
    fatal = registry.register("dist.fatal", fatal=True)
    (m0, c0), (m1, c1), (m2, _) = (ranks(store, r) for r in range(3))
    write_hit(m1.counter(fatal, "cpu"), row=5, value=77)
    assert wait_until(lambda: m0.armed is not None and m2.armed is not None, 5.0, drive=(m1, m0, m2))
    local = m1.armed
    assert local is not None and local.rank is None and local.site == "dist.fatal"
    for m in (m0, m2):
        exc = m.armed
        assert exc.rank == 1 and exc.site == "dist.fatal" and exc.device == "cpu" and exc.fatal
        assert (exc.count, exc.first_row, exc.first_value) == (1, 5, 77)
        assert "rank 1" in str(exc) and "MASKED FAULT" in str(exc)
        with pytest.raises(GuardTripped) as info:
            m.check()
        assert info.value.rank == 1
    assert c1.published is not None and c1.publish_won and c1.published["rank"] == 1
    assert c0.published is None and c0.peer["rank"] == 1


def test_without_coordination_peers_never_arm(registry, store, ranks):
    """Control for the test above: the same hit, the peer's monitor not coordinated, stays unarmed."""
    fatal = registry.register("dist.fatal", fatal=True)
    m1, _ = ranks(store, 1)
    m0 = Monitor(registry=registry, capacity=64, interval=0.01)
    m0.prealloc("cpu")
    write_hit(m1.counter(fatal, "cpu"), row=5, value=77)
    assert wait_until(lambda: m1.armed is not None, 5.0, drive=(m1, m0))
    for _ in range(20):
        m0.poll()
        time.sleep(0.005)
    assert m0.armed is None


def test_first_publisher_wins_and_learned_stops_are_not_republished(registry, store, ranks):
    (m0, c0), (m1, c1), (m2, c2) = (ranks(store, r) for r in range(3))
    m0.arm(GuardTripped("first", site="a", device="cpu", count=1))
    first = store.get("tripwire/stop")
    m1.arm(GuardTripped("second", site="b", device="cpu", count=1))  # both publish on this thread (they wait)
    assert c0.publish_won is True and c1.publish_won is False
    assert store.get("tripwire/stop") == first, "a later publisher overwrote the first record"
    assert wait_until(lambda: m2.armed is not None, 5.0, drive=(m2,))
    assert m2.armed.rank == 0 and m2.armed.site == "a"
    assert c2.published is None, "a stop learned from a peer was published again"
    assert store.get("tripwire/stop") == first
    # The ranks that published keep their own stop (m1 stopped for its own reason, never re-armed by rank 0's).
    assert m1.armed.site == "b" and m1.armed.rank is None


def test_drain_publishes_a_fatal_hit_found_at_shutdown(registry, store, ranks):
    fatal = registry.register("dist.fatal", fatal=True)
    soft = registry.register("dist.soft")
    m, c = ranks(store, 3)
    # Control: a non-fatal hit in warn mode, drained, publishes nothing.
    write_hit(m.counter(soft, "cpu"), row=1, value=2)
    m.drain()
    assert m.armed is None and not store.check(["tripwire/stop"])
    # No reader tick ever ran: the fatal hit is confirmed by drain itself, which arms, which publishes.
    write_hit(m.counter(fatal, "cpu"), row=9, value=-4)
    with pytest.raises(GuardTripped):
        m.drain(raise_on_fatal=True)
    assert m.ticks == 0
    assert store.check(["tripwire/stop"]), "drain's fatal hit was not published before drain returned"
    rec = json.loads(store.get("tripwire/stop"))
    assert (rec["rank"], rec["site"], rec["first_row"], rec["first_value"]) == (3, "dist.fatal", 9, -4)
    assert c.published == rec


def test_warn_mode_non_fatal_hits_stay_local(registry, store, ranks):
    soft = registry.register("dist.soft")
    (m0, _), (m1, c1) = ranks(store, 0, mode="warn"), ranks(store, 1, mode="warn")
    write_hit(m1.counter(soft, "cpu"), row=1, value=2)
    for _ in range(20):
        m1.poll()
        m0.poll()
    assert m1.confirmer.reported("cpu", soft.id) == 1  # seen and reported by rank 1 ...
    assert m1.armed is None and m0.armed is None and c1.published is None  # ... and nobody stops
    assert not store.check(["tripwire/stop"])


class FailingStore:
    """A store whose every call raises (a TCPStore whose master died answers like this: broken pipe)."""

    def __init__(self, fail_first: int | None = None) -> None:
        self.calls = 0
        self.fail_first = fail_first  # None: fail forever
        self.data: dict[str, bytes] = {}

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.fail_first is None or self.calls <= self.fail_first:
            raise RuntimeError("Broken pipe")

    def check(self, keys):
        self._maybe_fail()
        return all(k in self.data for k in keys)

    def get(self, key):
        self._maybe_fail()
        return self.data[key]

    def compare_set(self, key, expected, desired):
        self._maybe_fail()
        return self.data.setdefault(key, desired)


class HangingStore(FailingStore):
    """A store whose calls block (a TCPStore master that is alive but stalled: its client's timeout does not help)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def check(self, keys):
        self.release.wait(30)
        return False


def test_store_failures_are_counted_and_then_coordination_is_lost(registry, ranks):
    m, c = ranks(FailingStore(), 0, max_store_failures=5)
    m.start()
    assert wait_until(lambda: m.armed is not None, 5.0)
    exc = m.armed
    assert exc.site == COORDINATION_SITE and "coordination lost" in str(exc) and exc.rank is None
    assert c.store_failures >= 5 and c.consecutive_failures >= 5
    assert m.reader_alive and m.loop_errors == 0
    ticks = m.ticks
    assert wait_until(lambda: m.ticks > ticks + 3, 2.0), "the reader stopped ticking"


def test_store_failures_below_the_threshold_do_not_stop_the_rank(registry, ranks):
    """Control: the same failing store with a threshold never reached keeps failing, and the rank keeps going."""
    m, c = ranks(FailingStore(), 0, max_store_failures=10**6)
    m.start()
    assert wait_until(lambda: c.store_failures >= 10, 5.0)
    assert m.armed is None and m.reader_alive and m.loop_errors == 0


def test_a_store_that_recovers_resets_the_consecutive_count(registry, ranks):
    m, c = ranks(FailingStore(fail_first=3), 0, max_store_failures=5)
    m.start()
    assert wait_until(lambda: c.polls >= 10, 5.0)
    assert c.store_failures == 3 and c.consecutive_failures == 0 and m.armed is None


def test_a_hung_store_never_stalls_the_reader(registry, ranks):
    store = HangingStore()
    # Control: the hang is real -- a direct call does not return.
    probe = threading.Thread(target=store.check, args=(["k"],), daemon=True)
    probe.start()
    probe.join(0.2)
    assert probe.is_alive()
    try:
        m, c = ranks(store, 0, max_store_failures=5, store_timeout=0.2)
        m.start()
        t0 = time.monotonic()
        assert wait_until(lambda: m.armed is not None, 5.0)
        assert m.armed.site == COORDINATION_SITE and "coordination lost" in str(m.armed)
        # Overdue from 0.2 s, then one failure per 10 ms poll slot: armed long before the 30 s hang would end.
        assert time.monotonic() - t0 < 3.0
        assert c.polls == 1 and c.store_failures >= 5  # one call, stuck; the failures are overdue poll slots
        ticks = m.ticks
        assert wait_until(lambda: m.ticks > ticks + 3, 2.0), "the reader stopped ticking"
    finally:
        store.release.set()


class FakeGroup:
    """Stands in for a ProcessGroup: records each abort and whether the stop was already armed at that moment."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.aborts: list[bool] = []
        self.group_name = "fake"

    def abort(self) -> None:
        self.aborts.append(self.monitor.armed is not None)


def test_a_peer_stop_aborts_the_group_after_arming(registry, store, ranks):
    m0, _ = ranks(store, 0)
    m1 = Monitor(registry=registry, capacity=64, interval=0.01)
    m1.prealloc("cpu")
    group = FakeGroup(m1)
    c1 = coordinate(store, rank=1, monitor=m1, group=group, abort=True)
    try:
        m0.arm(GuardTripped("boom", site="s", device="cpu", count=1))
        assert wait_until(lambda: c1.abort_done.is_set(), 5.0, drive=(m1,))
        assert group.aborts == [True], "the group must be aborted once, after the stop was armed"
        assert c1.aborted == ["fake"] and c1.abort_errors == []
        assert m1.armed.rank == 0
    finally:
        c1.close()


def test_abort_false_leaves_the_group_alone(registry, store, ranks):
    """Control for the test above."""
    m0, _ = ranks(store, 0)
    m1 = Monitor(registry=registry, capacity=64, interval=0.01)
    m1.prealloc("cpu")
    group = FakeGroup(m1)
    c1 = coordinate(store, rank=1, monitor=m1, group=group, abort=False)
    try:
        m0.arm(GuardTripped("boom", site="s", device="cpu", count=1))
        assert wait_until(lambda: m1.armed is not None, 5.0, drive=(m1,))
        time.sleep(0.05)
        assert group.aborts == [] and not c1.abort_done.is_set()
    finally:
        c1.close()


def test_a_group_without_abort_is_logged_not_fatal(registry, store, ranks, caplog):
    m, _ = ranks(store, 0)
    m1 = Monitor(registry=registry, capacity=64, interval=0.01)
    c1 = coordinate(store, rank=1, monitor=m1, group=object(), abort=True)
    try:
        with caplog.at_level(logging.WARNING, logger="tripwire"):
            m.arm(GuardTripped("boom", site="s", device="cpu", count=1))
            assert wait_until(lambda: c1.abort_done.is_set(), 5.0, drive=(m1,))
        assert m1.armed.rank == 0 and c1.aborted == [] and len(c1.abort_errors) == 1
        assert "could not abort" in caplog.text
    finally:
        c1.close()


def test_guarded_turns_a_collective_error_into_the_armed_stop(registry, store, ranks):
    m, c = ranks(store, 0)
    with pytest.raises(ValueError):  # not armed: the error passes through unchanged
        with c.guarded():
            raise ValueError("unrelated")
    m.arm(GuardTripped("boom", site="s", device="cpu", count=1))
    with pytest.raises(GuardTripped) as info:
        with c.guarded():
            raise RuntimeError("NCCL communicator was aborted")
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(GuardTripped):
        c.raise_if_stopped()


def test_close_detaches_from_the_monitor(registry, store, ranks):
    (m0, _), (m1, c1) = ranks(store, 0), ranks(store, 1)
    c1.close()
    m0.arm(GuardTripped("boom", site="s", device="cpu", count=1))
    for _ in range(20):
        m1.poll()
    time.sleep(0.05)
    assert m1.armed is None
    m1.arm(GuardTripped("local", site="t", device="cpu", count=1))
    assert c1.published is None and json.loads(store.get("tripwire/stop"))["rank"] == 0


# ---------------------------------------------------------------------- the store poll's own cadence
def _quiet_coordinated(registry, store, *, hook: bool) -> tuple[Monitor, object]:
    """A monitor whose reader would be native (nothing changes), coordinated at a 20 ms store poll; ``hook``: also
    a tick hook, the other way to poll a store from the reader (every tick a Python tick)."""
    m = Monitor(registry=registry, capacity=64, interval=0.005, idle_tail=3600, report_every=3600, heartbeat=3600)
    m.counter(registry.register("dist.quiet"), "cpu")
    c = coordinate(store, rank=0, monitor=m, abort=False, store_poll=0.02)
    if hook:
        m.add_tick_hook(lambda _m: None)
    return m, c


@pytest.mark.parametrize("hook", [False, True])
def test_coordination_keeps_the_native_tick(registry, store, hook):
    """With coordinate() on, the quiet ticks stay native (the store is polled on the coordinator's own thread, at
    its own cadence). The control adds a tick hook (polling from the reader's ticks): every tick becomes Python's."""
    m, c = _quiet_coordinated(registry, store, hook=hook)
    try:
        m.start()
        time.sleep(0.4)
        m.check()
        h = m.health()
    finally:
        c.close()
        m.stop()
    assert c.polls >= 5 and c.store_failures == 0  # the store was polled all along
    assert h["ticks"] > 30
    if hook:
        assert h["native_tick"] == "ready" and h["native_ticks"] == 0 and h["python_ticks"] >= h["ticks"] - 1
    else:
        assert h["native_tick"] == "engaged" and h["python_ticks"] <= 2, h
        assert h["native_ticks"] >= h["ticks"] - 3


@pytest.mark.parametrize("poll", [0.05, 0.5])
def test_the_store_is_polled_at_its_cadence(registry, store, poll):
    """store_poll sets how often the store is polled (one check per poll), whatever the reader's interval."""
    m = Monitor(registry=registry, capacity=64, interval=0.005)
    c = coordinate(store, rank=0, monitor=m, abort=False, store_poll=poll)
    try:
        time.sleep(1.0)
        polls = c.polls
    finally:
        c.close()
    assert c.store_poll == poll
    if poll < 0.1:
        assert 8 <= polls <= 25, polls  # ~20 polls in 1 s, whatever the machine's load
    else:
        assert 1 <= polls <= 3, polls  # ~2


def test_store_poll_is_a_validated_setting(registry, store, monkeypatch):
    m = Monitor(registry=registry, capacity=64, store_poll=0.25)
    c = coordinate(store, rank=0, monitor=m, abort=False)  # the monitor's setting is the default
    c.close()
    assert c.store_poll == 0.25
    for bad in (0, -1, float("nan"), "abc", True):
        with pytest.raises(ValueError, match="store_poll"):
            coordinate(store, rank=0, monitor=m, abort=False, store_poll=bad)
    monkeypatch.setenv("TRIPWIRE_STORE_POLL", "0")
    with pytest.raises(ValueError, match="TRIPWIRE_STORE_POLL"):
        Monitor(registry=registry, capacity=64)


# ====================================================================== multi-process
HERE = Path(__file__).resolve()

_STORE_OWNER = """
import sys
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(s.port, flush=True)
sys.stdin.read()  # lives until the test closes our stdin (or kills us)
"""


class Job:
    """A store owner and N workers; everything is killed and reaped by close()."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.owner: subprocess.Popen | None = None
        self.port = 0

    def start_store(self) -> int:
        self.owner = subprocess.Popen(
            [sys.executable, "-c", _STORE_OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.procs.append(self.owner)
        self.port = int(self.owner.stdout.readline())
        return self.port

    def start_workers(self, world: int, scenario: str, **opts) -> list[subprocess.Popen]:
        # The worker runs this file as a script: tests/ (its conftest, imported above) goes on its path.
        path = os.pathsep.join(p for p in (str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONPATH": path}
        workers = []
        for rank in range(world):
            cfg = json.dumps({"rank": rank, "world": world, "port": self.port, "scenario": scenario, **opts})
            p = subprocess.Popen(
                [sys.executable, str(HERE), "--worker", cfg],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            self.procs.append(p)
            workers.append(p)
        return workers

    def results(self, workers: list[subprocess.Popen], timeout: float) -> list[dict]:
        out = []
        deadline = time.monotonic() + timeout
        for p in workers:
            try:
                stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {p.args[-1]} did not finish within {timeout} s")
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            assert p.returncode == 0 and lines, f"worker failed (rc {p.returncode}):\n{stdout}\n{stderr[-3000:]}"
            out.append(json.loads(lines[-1][len("RESULT ") :]))
        return out

    def close(self) -> list[int]:
        """End the store owner (close its stdin), give every process 5 s to exit on its own, then kill the rest.
        Returns the pids that had to be killed."""
        if self.owner is not None and self.owner.stdin is not None and not self.owner.stdin.closed:
            self.owner.stdin.close()
        killed = []
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                killed.append(p.pid)
                p.kill()
                p.wait(5)
        for p in self.procs:
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None and not f.closed:
                    f.close()
        return killed


@pytest.fixture
def job():
    j = Job()
    yield j
    killed = j.close()
    assert all(p.poll() is not None for p in j.procs)
    assert not killed, f"processes did not exit on their own and were killed: {killed}"


@pytest.mark.parametrize("world", [2, 4])
def test_fatal_hit_on_rank_1_stops_every_rank_within_3_intervals(job, world):
    job.start_store()
    res = job.results(job.start_workers(world, "hit"), timeout=50)
    by_rank = {r["rank"]: r for r in res}
    # Phase A, the control inside the same processes: a warn-mode non-fatal hit on rank 1 is reported there and
    # stops nobody (for 8 intervals, enough for a coordinated stop to have arrived 3 times over).
    assert by_rank[1]["phase_a_warned"]
    assert all(r["phase_a_armed"] is None for r in res), [r["phase_a_armed"] for r in res]
    # Phase B: the fatal hit on rank 1 stops every rank, each naming rank 1, within 3 intervals.
    t_hit = by_rank[1]["t_hit"]
    lat = {r["rank"]: r["t_raise"] - t_hit for r in res}
    print(f"\nworld {world}: hit-to-raise latency per rank (s): " + ", ".join(f"{k}: {v:.3f}" for k, v in lat.items()))
    for r in res:
        assert r["raised"] and r["site"] == "dist.fatal" and r["first"] == [7, 123456], r
        assert r["exc_rank"] == (None if r["rank"] == 1 else 1), r
        if r["rank"] != 1:
            assert "rank 1" in r["message"]
        assert lat[r["rank"]] <= BOUND, f"rank {r['rank']} raised {lat[r['rank']]:.3f} s after the hit (> {BOUND})"
        assert r["reader_alive"] and r["loop_errors"] == 0
        assert r["aborted"] and not r["abort_errors"], r  # abort=True: every rank aborted its gloo group
    assert by_rank[1]["published_won"] and all(by_rank[k]["published_won"] is None for k in by_rank if k != 1)


def test_without_coordinate_a_fatal_hit_stays_on_its_rank(job):
    """Control for the test above: the same workers without coordinate(); rank 1 stops, rank 0 never does."""
    job.start_store()
    res = {r["rank"]: r for r in job.results(job.start_workers(2, "hit", coordinate=False), timeout=50)}
    assert res[1]["raised"] and res[1]["exc_rank"] is None
    assert not res[0]["raised"], res[0]
    assert res[0]["waited"] >= 10 * INTERVAL


def test_a_store_that_disappears_mid_run_crashes_no_reader(job):
    port = job.start_store()
    client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    workers = job.start_workers(2, "store_loss", max_store_failures=5)
    # Both ranks coordinated and polling; then the store owner dies.
    ready = wait_until(lambda: client.check(["ready/0", "ready/1"]), 40.0, step=0.05)
    client = None  # drop our connection before the kill
    assert ready
    job.owner.kill()
    job.owner.wait(5)
    t_kill = time.time()
    res = job.results(workers, timeout=30)
    for r in res:
        assert r["raised"] and r["site"] == COORDINATION_SITE and "coordination lost" in r["message"], r
        assert r["store_failures"] >= 5
        assert r["reader_alive"] and r["loop_errors"] == 0, r
        assert r["t_raise"] - t_kill < 5.0


# ====================================================================== the worker
def _worker(cfg: dict) -> dict:
    import datetime

    import torch.distributed as dist

    import tripwire
    from tripwire.distributed import coordinate

    rank, world = cfg["rank"], cfg["world"]
    handler_lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            handler_lines.append(record.getMessage())

    logging.getLogger("tripwire").addHandler(_Keep())
    logging.getLogger("tripwire").setLevel(logging.INFO)
    store = TCPStore("127.0.0.1", cfg["port"], is_master=False, timeout=datetime.timedelta(seconds=30))
    # A peer's latency is the firing rank's (up to two intervals in the worst alignment, which phase B makes: the
    # copy that holds the hit is compared a tick later) plus up to one store poll. Half an interval between polls
    # keeps the sum inside the 3-interval bound with room for the scheduling of four ranks on two cores.
    mon = tripwire.configure(mode="warn", interval=INTERVAL, capacity=64, report_every=60.0, store_poll=INTERVAL / 2)
    fatal = tripwire.register_site("dist.fatal", fatal=True)
    soft = tripwire.register_site("dist.soft")
    mon.prealloc("cpu")
    out: dict = {"rank": rank}

    def wait_for_stop(limit: float) -> None:
        t0 = time.monotonic()
        out["raised"] = False
        while time.monotonic() - t0 < limit:
            try:
                tripwire.check()  # the engine's step-top check
            except GuardTripped as e:
                out.update(raised=True, t_raise=time.time(), exc_rank=e.rank, site=e.site, message=str(e))
                out["first"] = [e.first_row, e.first_value]
                break
            time.sleep(0.001)  # a "step"
        out["waited"] = time.monotonic() - t0

    if cfg["scenario"] == "hit":
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
        )
        coord = coordinate(abort=True) if cfg.get("coordinate", True) else None  # the default group's store
        tripwire.start()
        dist.barrier()
        # Phase A: a non-fatal hit on rank 1 in warn mode.
        if rank == 1:
            write_hit(tripwire.counter(soft, "cpu"), row=3, value=4)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 8 * INTERVAL:
            tripwire.check()
            time.sleep(0.001)
        out["phase_a_armed"] = None if mon.armed is None else str(mon.armed)
        out["phase_a_warned"] = any("MASKED FAULT" in ln and "dist.soft" in ln for ln in handler_lines)
        dist.barrier()
        # Phase B: a fatal hit on rank 1. (The phases above start every reader right before a barrier and then
        # wait whole intervals, so the hit lands close to a tick of every rank: the slow alignment, where a peer's
        # tick has just passed when rank 1 publishes.)
        if rank == 1:
            out["t_hit"] = time.time()
            write_hit(tripwire.counter(fatal, "cpu"), row=7, value=123456)
        wait_for_stop(10 * INTERVAL if coord is None else 5.0)
        if coord is not None:
            coord.abort_done.wait(5.0)
            deadline = time.monotonic() + 5.0
            while rank == 1 and coord.published is None and time.monotonic() < deadline:
                time.sleep(0.01)  # rank 1's publish runs on the coordination thread, after its own stop armed
            out.update(aborted=coord.aborted, abort_errors=coord.abort_errors, published_won=coord.publish_won)
    elif cfg["scenario"] == "store_loss":
        coord = coordinate(store, rank=rank, max_store_failures=cfg["max_store_failures"], store_timeout=0.5)
        tripwire.start()
        store.set(f"ready/{rank}", "1")
        wait_for_stop(20.0)
        out["store_failures"] = coord.store_failures
    else:
        raise ValueError(cfg["scenario"])
    out.update(reader_alive=mon.reader_alive, loop_errors=mon.loop_errors)
    if coord is not None:
        coord.close()
    tripwire.stop()
    return out


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    result = _worker(json.loads(sys.argv[2]))
    print("RESULT " + json.dumps(result), flush=True)
    # The gloo group may have been aborted on purpose; skip interpreter teardown of torch.distributed state.
    os._exit(0)
