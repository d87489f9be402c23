"""Events and sinks (tripwire.sinks): JSON lines, Prometheus (multiprocess mode too), failing and bad sinks."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import tripwire
from test_monitor import hit
from tripwire import Event, Monitor, Offender
from tripwire.sinks import EVENT_FIELDS, JsonLines, Prometheus


def quiet(registry, **kw) -> Monitor:
    return Monitor(registry=registry, capacity=64, report_every=kw.pop("report_every", 3600), **kw)


def confirm(m: Monitor) -> None:
    m.poll()
    m.poll()


def lines(path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------- events
def test_an_event_has_the_design_fields_and_a_json_line_the_same_names():
    assert EVENT_FIELDS == (
        "kind", "site", "device", "rank", "delta", "total", "first_row", "first_value", "offenders", "time", "fatal"
    )  # fmt: skip
    ev = Event("guard", "s", "cuda:0", 3, 2, 5, 17, 4096, (Offender(17, 4096, "req-7"),), 12.5, True)
    d = json.loads(ev.to_json())
    assert tuple(d) == EVENT_FIELDS
    assert d["offenders"] == [{"row": 17, "value": 4096, "request": "req-7"}] and d["rank"] == 3 and d["fatal"]


# ---------------------------------------------------------------------------------------------------- JSON lines
def test_one_json_line_per_confirmed_report(registry, tmp_path):
    path = tmp_path / "events.jsonl"
    m = quiet(registry, event_log=str(path))
    a, b = registry.register("k.a"), registry.register("k.b", fatal=True)
    hit(m.counter(a, "cpu"), 17, 4096, n=2)
    confirm(m)
    hit(m.counter(b, "cpu"), 3, -1)
    confirm(m)
    got = lines(path)
    assert [(e["kind"], e["site"], e["device"], e["delta"], e["total"], e["first_row"], e["first_value"]) for e in got[:2]] == [
        ("guard", "k.a", "cpu", 2, 2, 17, 4096),
        ("guard", "k.b", "cpu", 1, 1, 3, -1),
    ]  # fmt: skip
    assert got[1]["fatal"] and got[2]["kind"] == "stop" and got[2]["site"] == "k.b"  # the fatal site armed the stop
    assert all(tuple(e) == EVENT_FIELDS for e in got)


def test_a_hot_site_is_aggregated_and_nothing_is_lost(registry, tmp_path):
    path = tmp_path / "events.jsonl"
    m = quiet(registry, event_log=str(path))
    ctr = m.counter(registry.register("k.hot"), "cpu")
    for i in range(50):
        hit(ctr, i, i)
        m.poll()
    m.drain()
    got = lines(path)
    assert len(got) == 2 and sum(e["delta"] for e in got) == 50 and got[-1]["total"] == 50


def test_the_event_log_is_read_from_the_environment(registry, tmp_path, monkeypatch):
    path = tmp_path / "env.jsonl"
    monkeypatch.setenv("TRIPWIRE_EVENT_LOG", str(path))
    m = quiet(registry)
    assert m.event_log == str(path) and any(isinstance(s, JsonLines) for s in m.sinks)
    hit(m.counter(registry.register("k.env"), "cpu"), 1, 1)
    m.drain()
    assert lines(path)[0]["site"] == "k.env"


@pytest.mark.parametrize("where", ["missing_dir", "a_directory", "under_a_file"])
def test_an_unwritable_event_log_fails_at_configuration(registry, tmp_path, where):
    if where == "missing_dir":
        path = tmp_path / "no" / "such" / "dir" / "e.jsonl"
    elif where == "a_directory":
        path = tmp_path
    else:  # not a directory: refused even to root
        (tmp_path / "plain").write_text("")
        path = tmp_path / "plain" / "e.jsonl"
    with pytest.raises(ValueError, match="event log"):
        quiet(registry, event_log=str(path))
    with pytest.raises(ValueError, match="event log"):
        tripwire.sinks.JsonLines(path)


@pytest.mark.parametrize("bad", ["", "   "])
def test_a_broken_event_log_variable_is_refused(registry, monkeypatch, bad):
    monkeypatch.setenv("TRIPWIRE_EVENT_LOG", bad)
    with pytest.raises(ValueError, match="TRIPWIRE_EVENT_LOG"):
        quiet(registry)


# ---------------------------------------------------------------------------------------------------- sinks
def test_bad_sinks_are_refused(registry):
    m = quiet(registry)
    with pytest.raises(TypeError, match="a sink must be callable"):
        m.add_sink("not a sink")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not a sink"):
        m.remove_sink(print)
    got: list[Event] = []
    m.add_sink(got.append)
    m.add_sink(got.append)  # once
    hit(m.counter(registry.register("k.once"), "cpu"), 1, 1)
    m.drain()
    assert len(got) == 1
    m.remove_sink(got.append)
    assert list(m.sinks) == []


def test_clip_and_nonfinite_instruments_produce_events(registry):
    from tripwire.numerics import ClipCounter, register_nonfinite_site

    m = quiet(registry)
    got: list[Event] = []
    m.add_sink(got.append)
    c = ClipCounter("layers.0.attn", "cpu", monitor=m)
    key = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    value = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    key.view(-1)[:3] = 900.0
    c.count(key, value, 1.0, 1.0)
    nf = register_nonfinite_site("logits", monitor=m)
    hit(m.counter(nf, "cpu"), 2, 7, n=4)
    m.drain()
    kinds = {(e.kind, e.site): (e.delta, e.total) for e in got}
    assert kinds == {("clip_k", "layers.0.attn"): (3, 3), ("nonfinite", "logits"): (4, 4)}  # V did not rise


def test_a_failing_sink_is_logged_once_per_window_counted_and_the_reader_goes_on(registry, caplog):
    m = Monitor(registry=registry, capacity=64, interval=0.005, report_every=0.05)
    good: list[Event] = []

    def broken(ev):
        raise OSError("disk full")

    m.add_sink(broken)
    m.add_sink(good.append)
    # Three sites: the report window lets one event per site out per window, so with three sites the broken sink
    # fails several times per window (one site alone would fail at most once per window whatever the load).
    ctrs = [m.counter(registry.register(f"k.sinks{j}"), "cpu") for j in range(3)]
    m.start()
    try:
        for i in range(20):
            hit(ctrs[i % 3], i, i)
            time.sleep(0.02)
        deadline = time.monotonic() + 5
        while sum(e.delta for e in good) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        h = m.health()
    finally:
        m.stop()
    assert sum(e.delta for e in good) == 20  # every event reached the good sink
    failed = [r for r in caplog.records if "sink" in r.getMessage() and "disk full" in r.getMessage()]
    assert h["sink_errors"] == len(good) and len(good) >= 3
    assert 1 <= len(failed) < len(good)  # at most once per window: fewer lines than failures
    assert m.reader_alive is False and h["reader_alive"] and h["loop_errors"] == 0 and m.armed is None


def test_control_a_window_shorter_than_the_events_logs_every_failure(registry, caplog):
    m = quiet(registry, report_every=1e-9)
    m.add_sink(lambda ev: 1 / 0)
    ctr = m.counter(registry.register("k.sinks"), "cpu")
    for i in range(4):
        hit(ctr, i, i)
        confirm(m)
    failed = [r for r in caplog.records if r.levelno == logging.ERROR and "ZeroDivisionError" in r.getMessage()]
    assert len(failed) == m.health()["sink_errors"] == 4


# ---------------------------------------------------------------------------------------------------- Prometheus
prometheus_client = pytest.importorskip("prometheus_client")


def value(reg, name: str, **labels) -> float:
    v = reg.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_prometheus_counters_equal_the_arena_after_a_soak_like_run(registry):
    from tripwire.numerics import ClipCounter, register_nonfinite_site

    preg = prometheus_client.CollectorRegistry()
    m = Monitor(registry=registry, capacity=64, interval=0.002, report_every=0.02)
    m.add_sink(Prometheus(preg))
    sites = [registry.register(f"soak.{i}", fatal=(i == 0)) for i in range(3)]
    nf = register_nonfinite_site("soak.logits", monitor=m)
    clip = ClipCounter("soak.layer", "cpu", monitor=m)
    key = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    key.view(-1)[:2] = 900.0
    m.start()
    try:
        for step in range(200):
            try:
                m.check()
            except tripwire.GuardTripped:
                pass  # the fatal site armed at step 120: the soak goes on counting
            for j, s in enumerate(sites[1:], 1):
                if step % j == 0:
                    hit(m.counter(s, "cpu"), step, step)
            if step % 7 == 0:
                hit(m.counter(nf, "cpu"), step, 1)
                clip.count(key, key, 1.0, 1.0)
            if step == 120:
                hit(m.counter(sites[0], "cpu"), 5, 5)
            time.sleep(0.001)
    finally:
        m.stop()
    snap = m.drain()
    for s in sites:
        assert (
            value(preg, "tripwire_masked_accesses_total", site=s.name, device="cpu", rank="")
            == snap[("cpu", s.name)].count
        )
    assert (
        value(preg, "tripwire_nonfinite_total", site="soak.logits", device="cpu", rank="")
        == snap[("cpu", "soak.logits")].count
    )
    t = clip.totals()
    assert value(preg, "tripwire_fp8_clipped_total", site="soak.layer", tensor="k", device="cpu", rank="") == t["k"]
    assert value(preg, "tripwire_fp8_clipped_total", site="soak.layer", tensor="v", device="cpu", rank="") == t["v"] > 0
    assert value(preg, "tripwire_stop_armed", device="cpu", rank="") == 1
    assert value(preg, "tripwire_reader_ticks_total", device="cpu", rank="") > 10
    m.reset()
    assert value(preg, "tripwire_stop_armed", device="cpu", rank="") == 0


def sample(reg, name: str, **labels) -> float | None:
    return reg.get_sample_value(name, labels)


def test_the_stop_gauge_is_0_from_the_start_then_1_then_0(registry):
    preg = prometheus_client.CollectorRegistry()
    m = quiet(registry)
    m.prealloc("cpu")
    m.add_sink(Prometheus(preg))
    assert sample(preg, "tripwire_stop_armed", device="cpu", rank="") == 0  # exported, not absent
    assert sample(preg, "tripwire_reader_ticks_total", device="cpu", rank="") == 0
    m.arm(tripwire.GuardTripped.internal("a test's stop", "cpu"))
    assert sample(preg, "tripwire_stop_armed", device="cpu", rank="") == 1
    m.reset()
    assert sample(preg, "tripwire_stop_armed", device="cpu", rank="") == 0


def test_the_tick_counter_moves_at_the_readers_cadence_while_the_native_tick_runs(registry):
    """With the native tick engaged the reader's Python ticks are seconds apart; a scrape still sees every tick."""
    preg = prometheus_client.CollectorRegistry()
    m = Monitor(registry=registry, capacity=8, interval=0.005, idle_tail=60, report_every=60, native_tick="on")
    m.counter(registry.register("ticks.site"), "cpu")
    m.add_sink(Prometheus(preg))
    m.start()
    try:
        end = time.monotonic() + 10
        while m.native_tick != "engaged" and time.monotonic() < end:
            m.check()
            time.sleep(0.005)
        assert m.native_tick == "engaged"
        h0, t0 = m.health(), sample(preg, "tripwire_reader_ticks_total", device="cpu", rank="")
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            m.check()
            time.sleep(0.005)
        h1, t1 = m.health(), sample(preg, "tripwire_reader_ticks_total", device="cpu", rank="")
    finally:
        m.stop()
    native, python = h1["native_ticks"] - h0["native_ticks"], h1["python_ticks"] - h0["python_ticks"]
    assert native >= 20 and python <= 2, (native, python)  # the native thread did the ticking
    assert t0 is not None and t1 is not None and t1 - t0 >= 20, (t0, t1, native)


def test_two_sinks_on_one_registry_share_its_metrics():
    preg = prometheus_client.CollectorRegistry()
    a, b = Prometheus(preg), Prometheus(preg)
    a(Event("guard", "s", "cpu", delta=2, total=2))
    b(Event("guard", "s", "cpu", delta=3, total=5))
    assert value(preg, "tripwire_masked_accesses_total", site="s", device="cpu", rank="") == 5


def test_without_prometheus_client_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"tripwire\[prometheus\]"):
        Prometheus()


def test_a_bad_multiprocess_dir_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="PROMETHEUS_MULTIPROC_DIR"):
        Prometheus(prometheus_client.CollectorRegistry())


_WORKER = textwrap.dedent(
    """
    import datetime, sys
    import torch.distributed as dist
    from tripwire import Monitor, SiteRegistry
    from tripwire.sinks import Prometheus
    from tripwire.layout import COUNT, FIRST_ROW, FIRST_VALUE, encode
    rank, port, hits = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)  # the rank label comes from here
    reg = SiteRegistry(capacity=8)
    m = Monitor(registry=reg, capacity=8, report_every=0.001)
    m.add_sink(Prometheus())
    ctr = m.counter(reg.register("mp.site"), "cpu")
    for i in range(hits):
        ctr[COUNT] += 1
        ctr[FIRST_ROW], ctr[FIRST_VALUE] = encode(i), encode(i)
        m.poll()
    m.drain()
    dist.destroy_process_group()
    print("done", flush=True)
    """
)


def test_prometheus_multiprocess_mode_adds_up_two_processes(tmp_path):
    """Two worker processes (ranks 0 and 1 of a gloo group) count into one PROMETHEUS_MULTIPROC_DIR; the serving
    process's MultiProcessCollector sees each rank's count under its own rank label."""
    from torch.distributed import TCPStore

    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp_dir), PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("RANK", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(rank), str(master.port), str(hits)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, hits in ((0, 7), (1, 11))
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 and "done" in o for p, (o, _) in zip(procs, outs, strict=True)), outs
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(mp_dir))
    assert value(reg, "tripwire_masked_accesses_total", site="mp.site", device="cpu", rank="0") == 7
    assert value(reg, "tripwire_masked_accesses_total", site="mp.site", device="cpu", rank="1") == 11
