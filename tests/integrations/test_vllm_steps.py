"""tripwire.integrations.vllm._steps on the CPU: the step validator's host clean test never skips a step the
validator would have counted or repaired.

No vLLM needed: a stand-in runner carries the V1 runner's buffers (the attributes the step validator reads, with
vLLM's dtypes and layouts). Each step's metadata mixes in-range entries with the edges of every rule (the range's
ends, one past them, the padding, one below it, a broken ``query_start_loc``), and two step validators, one with
its host clean test and one that always calls the validator, run the same steps on twin runners: every arena word,
every offender word and every buffer stay equal, step after step.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tripwire import Monitor, SiteRegistry
from tripwire.integrations import vllm as tw_vllm
from tripwire.integrations.vllm import _runner, _steps
from tripwire.integrations.vllm._steps import StepValidator
from tripwire.layout import OFF_HEADER, OFFENDERS
from tripwire.verdict import _offenders

MAX_REQS, WIDTH, BLOCK, NUM_BLOCKS, MAX_LEN, MAX_TOKENS = 8, 4, 32, 64, 128, 64


def runner() -> SimpleNamespace:
    """The V1 runner's attributes the step validator reads (its CPU build: every ``.gpu`` buffer is a host tensor)."""
    table = SimpleNamespace(
        block_size=BLOCK,
        num_blocks_per_row=np.zeros(MAX_REQS, dtype=np.int32),
        block_table=SimpleNamespace(gpu=torch.zeros(MAX_REQS, WIDTH, dtype=torch.int32)),
        slot_mapping=SimpleNamespace(gpu=torch.zeros(MAX_TOKENS, dtype=torch.int64)),
    )
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=BLOCK))
    return SimpleNamespace(
        device="cpu",
        max_model_len=MAX_LEN,
        kv_cache_config=SimpleNamespace(kv_cache_groups=[group], num_blocks=NUM_BLOCKS),
        input_batch=SimpleNamespace(
            block_table=SimpleNamespace(block_tables=[table]), max_num_reqs=MAX_REQS, req_ids=[]
        ),
        query_start_loc=SimpleNamespace(gpu=torch.zeros(MAX_REQS + 1, dtype=torch.int32)),
        positions=torch.zeros(MAX_TOKENS, dtype=torch.int64),
        seq_lens=torch.zeros(MAX_REQS, dtype=torch.int32),
    )


def edge(rng: random.Random, lo: int, hi: int, extra: tuple[int, ...] = ()) -> int:
    """Mostly in range; one time in 32 an edge: ``lo - 1``, ``lo``, ``hi - 1``, ``hi`` or one of ``extra``."""
    if rng.random() < 31 / 32:
        return rng.randrange(lo, hi)
    return rng.choice((lo - 1, lo, hi - 1, hi, *extra))


def fill(r: SimpleNamespace, rng: random.Random) -> tuple[int, int, int]:
    """Write one step's metadata into ``r``'s buffers; returns (num_reqs, num_tokens, padded tokens)."""
    reqs = rng.randint(1, MAX_REQS)
    per = [rng.choice((1, 1, 1, rng.randint(1, 5))) for _ in range(reqs)]
    tokens = sum(per)
    cu = [0]
    for n in per:
        cu.append(cu[-1] + n)
    if rng.random() < 0.1:
        k = rng.randrange(len(cu))
        cu[k] = rng.choice((cu[k] - 1, cu[k] + 1, tokens + 1, -1))
    elif reqs >= 2 and rng.random() < 0.05:
        k = rng.randrange(2, reqs + 1)
        cu[k] = cu[k - 1] - 1  # one step back, still within [0, tokens]: only the order is wrong
    r.query_start_loc.gpu[: reqs + 1] = torch.tensor(cu, dtype=torch.int32)
    r.positions[:tokens] = torch.tensor([edge(rng, 0, MAX_LEN) for _ in range(tokens)])
    r.seq_lens[:reqs] = torch.tensor([edge(rng, 1, MAX_LEN + 1) for _ in range(reqs)], dtype=torch.int32)
    table = r.input_batch.block_table.block_tables[0]
    padded = tokens + rng.choice((0, 0, 2))
    slots = [edge(rng, 0, NUM_BLOCKS * BLOCK, (-1, -2)) for _ in range(padded)]
    slots[tokens:] = [-1] * (padded - tokens)  # vLLM's padded tokens
    table.slot_mapping.gpu[:padded] = torch.tensor(slots)
    table.block_table.gpu[:reqs] = torch.tensor(
        [[edge(rng, 0, NUM_BLOCKS) for _ in range(WIDTH)] for _ in range(reqs)], dtype=torch.int32
    )
    table.num_blocks_per_row[:reqs] = [edge(rng, 0, WIDTH + 1) for _ in range(reqs)]
    r.input_batch.req_ids = [f"req-{rng.randrange(100)}" for _ in range(reqs)]
    return reqs, tokens, padded


def twin_steps(seed: int, steps: int, policy: str, *, host: bool = True):
    """Run ``steps`` steps on twin runners: one step validator as built (its host clean test on), one whose every
    step calls the validator. Yields per step what each left: (skipped, arena rows, offender blocks, buffers)."""
    pair = []
    for with_host in (host, False):
        m = Monitor(registry=SiteRegistry(capacity=32), capacity=32)
        r = runner()
        sv = StepValidator(r, policy, m)
        if not with_host:
            sv._host = None
        pair.append((m, r, sv))
    rngs = [random.Random(seed), random.Random(seed)]
    for _ in range(steps):
        out = []
        for (m, r, sv), rng in zip(pair, rngs, strict=True):
            reqs, tokens, padded = fill(r, rng)
            table = r.input_batch.block_table.block_tables[0]
            rose = sv(r, reqs, tokens, {0: table.slot_mapping.gpu[:padded]})
            rows = m.arena.get(torch.device("cpu")).clone()
            rows[:, OFFENDERS] = 0  # the offender block's address: each monitor's own
            bufs = [
                r.positions.clone(),
                r.seq_lens.clone(),
                r.query_start_loc.gpu.clone(),
                table.slot_mapping.gpu.clone(),
                table.block_table.gpu.clone(),
                torch.from_numpy(table.num_blocks_per_row.copy()),
            ]
            out.append((not rose, rows, offenders(m), bufs))
        yield out


def offenders(m: Monitor) -> list[tuple]:
    """Each offender block's header words and its entries as (row, value, vLLM request id): the request NUMBERS
    differ between the twins (a skipped step numbers none of its requests), the ids they stand for may not."""
    blocks = m.arena.offenders(torch.device("cpu")).numpy()
    return [(tuple(b[:OFF_HEADER].tolist()), _offenders(b, m.requests)) for b in blocks]


def _equal(a, b) -> bool:
    return torch.equal(a[1], b[1]) and a[2] == b[2] and all(map(torch.equal, a[3], b[3]))


@pytest.mark.parametrize("policy", ["mask", "flag"])
def test_host_clean_test_skips_only_what_the_validator_would_not_count(policy):
    """300 steps of edge-laden metadata: arena, offenders and buffers equal to always validating, after every
    step; most steps skip (the test is not vacuous), and some do not (faults were there to count)."""
    skipped = counted = 0
    for mine, always in twin_steps(7, 300, policy):
        assert _equal(mine, always)
        skipped += mine[0]
        counted += not mine[0]
        assert not always[0]  # the twin always validates
    assert skipped > 50 and counted > 50, (skipped, counted)


@pytest.mark.parametrize("loosened", ["entries_clean", "lengths_clean", "indptr_clean"])
def test_host_clean_test_can_fail(monkeypatch, loosened):
    """Control: the step check's rule tests loosened one at a time (a range one past its end, counts one past the
    width, an indptr whose order is not tested) let a bad entry through: a step the validator counts is skipped, and
    the comparison above catches it."""
    real = getattr(_steps, loosened)
    loose = {
        "entries_clean": lambda vals, lo, hi, pad=None: real(vals, lo, hi + 1, pad),
        "lengths_clean": lambda vals, width: real(vals, width + 1),
        "indptr_clean": lambda vals, end: real(sorted(vals), end),
    }[loosened]
    monkeypatch.setattr(_steps, loosened, loose)
    assert not all(_equal(a, b) for a, b in twin_steps(7, 300, "mask"))


def test_first_step_and_a_replaced_buffer_take_the_exact_path():
    """The first step, and the step after the runner replaces a buffer, call the validator (its argument checks
    see the buffer): a replaced positions buffer of the wrong dtype is refused with the validator's error."""
    m = Monitor(registry=SiteRegistry(capacity=32), capacity=32)
    r = runner()
    sv = StepValidator(r, "mask", m)
    table = r.input_batch.block_table.block_tables[0]
    r.query_start_loc.gpu[:2] = torch.tensor([0, 1], dtype=torch.int32)
    r.seq_lens[:1] = 1
    r.input_batch.req_ids = ["a"]
    args = (r, 1, 1, {0: table.slot_mapping.gpu[:1]})
    assert [sv(*args), sv(*args), sv(*args)] == [True, False, False]
    r.positions = torch.zeros(MAX_TOKENS, dtype=torch.float32)
    with pytest.raises(TypeError, match="'positions' must be int32 or int64"):
        sv(*args)
    # A slot mapping that is not a view of the runner's slot buffer is validated, not read from that buffer.
    r.positions = torch.zeros(MAX_TOKENS, dtype=torch.int64)
    assert sv(*args) is True and sv(*args) is False
    assert sv(r, 1, 1, {0: torch.tensor([NUM_BLOCKS * BLOCK])}) is True
    assert m.snapshot()[("cpu", tw_vllm.SITE_SLOT_MAPPING)].count == 1


def decode_step(r: SimpleNamespace) -> tuple:
    """A clean decode step in ``r``'s buffers: 4 requests of one token each (position 40, length 41, two used
    blocks of the table's 4 columns). Returns the step validator's call arguments."""
    n = 4
    table = r.input_batch.block_table.block_tables[0]
    r.query_start_loc.gpu[: n + 1] = torch.arange(n + 1, dtype=torch.int32)
    r.positions[:n] = 40
    r.seq_lens[:n] = 41
    table.slot_mapping.gpu[:n] = torch.arange(n) * BLOCK + 8
    table.block_table.gpu[:n] = torch.arange(1, n * WIDTH + 1, dtype=torch.int32).view(n, WIDTH)
    table.num_blocks_per_row[:n] = 2
    r.input_batch.req_ids = ["req-a", "req-b", "req-c", "req-d"]
    return (r, n, n, {0: table.slot_mapping.gpu[:n]})


def _table(r: SimpleNamespace) -> SimpleNamespace:
    return r.input_batch.block_table.block_tables[0]


# Per rule: one bad entry written into a clean decode step (request row 1, "req-b", where a row is attributed), the
# site it counts at, and how to read the entry back (to see it masked).
BAD = {
    "slot_mapping": (
        lambda r: _table(r).slot_mapping.gpu.__setitem__(1, NUM_BLOCKS * BLOCK),
        tw_vllm.SITE_SLOT_MAPPING,
        lambda r: int(_table(r).slot_mapping.gpu[1]),
        -1,
    ),
    "block_table": (
        lambda r: _table(r).block_table.gpu.__setitem__((1, 1), NUM_BLOCKS),
        tw_vllm.SITE_BLOCK_TABLE,
        lambda r: int(_table(r).block_table.gpu[1, 1]),
        0,
    ),
    "block_counts": (
        lambda r: _table(r).num_blocks_per_row.__setitem__(1, WIDTH + 1),
        tw_vllm.SITE_BLOCK_COUNTS,
        lambda r: int(_table(r).num_blocks_per_row[1]),
        WIDTH,
    ),
    "positions": (
        lambda r: r.positions.__setitem__(1, MAX_LEN),
        tw_vllm.SITE_POSITIONS,
        lambda r: int(r.positions[1]),
        0,
    ),
    "query_start_loc": (
        lambda r: r.query_start_loc.gpu.__setitem__(2, 0),
        tw_vllm.SITE_QUERY_START_LOC,
        lambda r: int(r.query_start_loc.gpu[2]),
        1,
    ),
    "seq_lens": (
        lambda r: r.seq_lens.__setitem__(1, 0),
        tw_vllm.SITE_SEQ_LENS,
        lambda r: int(r.seq_lens[1]),
        1,
    ),
}


def one_bad_entry(rule: str, *, broken_fast_path: bool = False) -> tuple[list[bool], dict, int]:
    """Clean decode steps, then one with a bad entry at ``rule``, then clean again. Returns what each call
    returned (True: the validator ran), each site's count, and the entry as read back after the bad step.
    ``broken_fast_path``: the host clean test replaced by one that passes every step (the control)."""
    write, _site, read, _safe = BAD[rule]
    m = Monitor(registry=SiteRegistry(capacity=32), capacity=32)
    r = runner()
    sv = StepValidator(r, "mask", m)
    args = decode_step(r)
    calls = [sv(*args), sv(*args)]  # the first step binds the host views (exact path), the second is skipped
    if broken_fast_path:
        sv._host = SimpleNamespace(inputs=lambda *a: True, outputs=lambda *a: True)  # type: ignore[assignment]
    write(r)
    calls.append(sv(*args))
    after = read(r)
    decode_step(r)
    calls.append(sv(*args))
    counts = {site: hit.count for (_dev, site), hit in m.snapshot().items()}
    return calls, {"counts": counts, "hits": m.snapshot()}, after


@pytest.mark.parametrize("rule", sorted(BAD))
def test_a_bad_entry_at_each_rule_takes_the_exact_path(rule):
    """The host clean test skips the clean steps around it, and a step with ONE bad entry at any rule goes through
    the validator: counted exactly once, at its site only, masked, and attributed to vLLM's request id."""
    _write, site, _read, safe = BAD[rule]
    calls, seen, after = one_bad_entry(rule)
    assert calls == [True, False, True, False]
    assert seen["counts"] == {site: 1}
    assert after == safe  # masked before any kernel reads it
    hit = seen["hits"][("cpu", site)]
    if rule != "query_start_loc":  # an indptr entry belongs to no request (the kernel's attribution too)
        assert [o.request for o in hit.offenders] == ["req-b"]


@pytest.mark.parametrize("rule", sorted(BAD))
def test_a_fast_path_that_passes_everything_misses_each_rule(rule):
    """Control: with the host clean test broken (it passes every step), the same bad entry is never counted or
    masked, so the exact counts asserted above are what catches a fast path that lets a rule through."""
    _write, _site, _read, safe = BAD[rule]
    calls, seen, after = one_bad_entry(rule, broken_fast_path=True)
    assert calls == [True, False, False, False]
    assert seen["counts"] == {}
    assert after != safe


# ---------------------------------------------------------------- the plugin's wrappers: on only while they have work
class _Runner:
    """The V1 runner's methods the plugin wraps, as stand-ins: a step builds its metadata (the hook validates it)
    and returns None; sample_tokens returns the step's output."""

    _tripwire: object

    def initialize_kv_cache(self, kv_cache_config, is_profiling=False):
        pass

    def capture_model(self):
        pass

    def _build_attention_metadata(  # vLLM 0.32's signature: the plugin's wrapper of the same signature is used
        self,
        num_tokens,
        num_reqs,
        max_query_len,
        num_tokens_padded=None,
        num_reqs_padded=None,
        ubatch_slices=None,
        logits_indices=None,
        max_num_sampled_tokens=None,
        use_spec_decode=False,
        for_cudagraph_capture=False,
        num_scheduled_tokens=None,
        slot_mappings=None,
    ):
        return num_tokens_padded, for_cudagraph_capture

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        meta = self._build_attention_metadata(num_reqs=1, num_tokens=1, max_query_len=1, slot_mappings={})
        assert meta == (None, False)  # the wrapper passed vLLM's defaults on

    def sample_tokens(self, grammar_output):
        return SimpleNamespace(step=grammar_output)


class _Sched:
    """vLLM's scheduler as far as the plugin reads it (its update fails requests through grammar_compile_error_reqs
    with FINISHED_ERROR: the names the contain mode checks the source for)."""

    def __init__(self):
        self.grammar_compile_error_reqs: set[str] = set()

    def update_from_output(self, scheduler_output, model_runner_output):
        self.seen = (self.grammar_compile_error_reqs, "FINISHED_ERROR", model_runner_output)
        return "updated"

    def finish_requests(self):
        pass


class _Core:
    def shutdown(self):
        pass


class _Table:
    """V1's MultiGroupBlockTable as far as the plugin wraps it."""

    def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
        pass


@pytest.fixture
def stand_in_plugin(monkeypatch):
    """The plugin's wrappers (contain) on the stand-in classes above, installed as install() does; uninstalled after."""
    from tripwire.integrations.vllm import _contain
    from tripwire.integrations.vllm import _hooks as tw

    for name, cls in (
        ("_runner_class", _Runner),
        ("_scheduler_class", _Sched),
        ("_engine_core_class", _Core),
        ("_v1_table_class", _Table),
    ):
        monkeypatch.setattr(tw, name, lambda cls=cls: cls)
    monkeypatch.setattr(tw, "_v2_runner_class", lambda version: None)
    own = {(c, n): c.__dict__[n] for c in (_Runner, _Sched, _Table) for n in c.__dict__ if callable(c.__dict__[n])}
    plugin = tw._Plugin("contain", Monitor(registry=SiteRegistry(capacity=32), capacity=32), "0.32.0")
    updates: list[dict] = []
    monkeypatch.setattr(plugin.contain, "before_update", lambda sched, out: updates.append(dict(out.t)))
    monkeypatch.setattr(
        plugin.contain, "after_update", lambda sched: updates.append({"after": len(plugin.contain.masked)})
    )
    monkeypatch.setattr(_contain, "ATTR", "t")
    monkeypatch.setattr(tw, "ATTR", "t")
    tw._patch(plugin)
    monkeypatch.setattr(tw_vllm, "_plugin", plugin)
    try:
        yield plugin, own, updates
    finally:
        tw_vllm.uninstall()
    assert all(c.__dict__[n] is f for (c, n), f in own.items())  # uninstall restored every method
    assert _contain.ON_TAINT is None


def _sched() -> _Sched:
    return _Sched()


def test_scheduler_wrapper_is_on_only_while_taints_are_due(stand_in_plugin, monkeypatch):
    """A clean step's output reaches vLLM's own update_from_output (nothing of the plugin on the class); an output
    with taints puts the wrapper on where it is unpickled (the engine core's process), the wrapper acts on it and
    comes off after; two tainted outputs unpickled before their updates keep it on for both. Control: an output
    whose taints are a plain dict (not armed on unpickling) reaches vLLM's method unwrapped, and its taints are
    never acted on."""
    import pickle

    from tripwire.integrations.vllm import _contain

    plugin, own, updates = stand_in_plugin
    orig = own[(_Sched, "update_from_output")]
    assert _Sched.__dict__["update_from_output"] is orig  # installed, yet vLLM's own method on a clean step
    s = _sched()
    assert s.update_from_output(None, SimpleNamespace()) == "updated" and updates == []

    def worker_output(req: str, taints=_contain.arrived):  # type: ignore[no-untyped-def]
        # Made in "another process": this one's arming is off while the worker attaches its taints.
        with monkeypatch.context() as m:
            m.setattr(_contain, "ON_TAINT", None)
            out = SimpleNamespace(t=taints({req: "why"}))
        assert _Sched.__dict__["update_from_output"] is orig
        return pickle.dumps(out)

    a, b = worker_output("req-a"), worker_output("req-b")
    got_a = pickle.loads(a)
    assert _Sched.__dict__["update_from_output"] is not orig  # armed on arrival, before the scheduler sees it
    got_b = pickle.loads(b)
    assert s.update_from_output(None, got_a) == "updated" and updates == [{"req-a": "why"}]
    assert _Sched.__dict__["update_from_output"] is not orig  # req-b's output is still to come
    assert s.update_from_output(None, got_b) == "updated" and updates[-1] == {"req-b": "why"}
    assert _Sched.__dict__["update_from_output"] is orig  # off again: the next clean step is vLLM's alone
    # A masked request running on (mask mode) keeps the wrapper on until it is gone.
    plugin.contain.masked["req-c"] = "masked"
    got_c = pickle.loads(worker_output("req-c"))  # unpickled before the update is looked up, as in vLLM
    s.update_from_output(None, got_c)
    assert updates[-2:] == [{"req-c": "why"}, {"after": 1}]
    assert _Sched.__dict__["update_from_output"] is not orig
    s.update_from_output(None, SimpleNamespace())  # a clean step while req-c runs on: the masked side still runs
    assert updates[-1] == {"after": 1} and _Sched.__dict__["update_from_output"] is not orig
    plugin.contain.masked.clear()  # req-c finished
    s.update_from_output(None, SimpleNamespace())
    assert _Sched.__dict__["update_from_output"] is orig
    # Control: taints that do not arm on arrival reach an unwrapped scheduler and are lost.
    n = len(updates)
    lost = pickle.loads(worker_output("req-d", taints=dict))
    assert _Sched.__dict__["update_from_output"] is orig
    s.update_from_output(None, lost)
    assert len(updates) == n and s.seen[2] is lost


def test_sample_tokens_is_wrapped_only_after_a_step_with_a_verdict(stand_in_plugin, monkeypatch):
    """A clean step calls vLLM's own sample_tokens (the class's method is never wrapped, and nothing is put on the
    runner); a step whose validator ran wraps the runner's next sample_tokens call, which takes the verdict once
    and unwraps. Control: the same step with the instance wrapper removed before sampling takes no verdict."""

    plugin, own, _updates = stand_in_plugin
    taken: list[object] = []

    def after_step(ring, ticket, step, out, wait=False):  # type: ignore[no-untyped-def]
        taken.append(ticket)
        return out

    monkeypatch.setattr(plugin.contain, "after_step", after_step)
    clean = [True]
    validator = SimpleNamespace(begin=lambda: None, inputs=lambda *a: False, outputs=lambda *a: not clean[0])
    ring = SimpleNamespace(enqueue=lambda: f"ticket-{len(taken)}")
    r = _Runner()
    r._tripwire = _runner.RunnerState(validator, ring)  # type: ignore[arg-type]
    plugin.started = True  # the stand-in has no reader to start
    assert _Runner.__dict__["sample_tokens"] is own[(_Runner, "sample_tokens")]

    def step(i: int, drop: bool = False):  # type: ignore[no-untyped-def]
        assert r.execute_model(f"step-{i}") is None
        wrapped = "sample_tokens" in r.__dict__
        if drop:
            del r.sample_tokens
        return wrapped, r.sample_tokens(i).step

    assert step(0) == (False, 0) and taken == []
    clean[0] = False
    assert step(1) == (True, 1) and taken == ["ticket-0"]
    assert "sample_tokens" not in r.__dict__
    clean[0] = True
    assert step(2) == (False, 2) and taken == ["ticket-0"]
    # Control: without the runner's one-call wrapper, a step whose validator ran has its verdict left untaken.
    clean[0] = False
    assert step(3, drop=True) == (True, 3) and taken == ["ticket-0"]


@pytest.mark.parametrize("mode", ["contain", "mask", "flag"])
def test_parallelism_is_refused_under_contain_only(mode):
    """Tensor, pipeline or context parallelism (a world of several workers): each rank's verdict covers only its own
    arena, so ``contain`` refuses to build, naming the way out; ``mask`` and ``flag`` build (the control)."""
    from tripwire.integrations.vllm import _hooks as tw

    m = Monitor(registry=SiteRegistry(capacity=32), capacity=32)
    r = runner()
    r.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=2))
    plugin = tw._Plugin(mode, m, "0.32.0")
    if mode == "contain":
        with pytest.raises(
            RuntimeError, match=r"TRIPWIRE_VLLM=contain needs one worker.*has 2.*Use TRIPWIRE_VLLM=mask"
        ):
            plugin.build(r)
        assert getattr(r, "_tripwire", None) is None
    else:
        plugin.build(r)
        assert isinstance(r._tripwire.validator, StepValidator)


def test_verdicts_of_outputs_vllm_drops_are_released(kernel_device):
    """V2's warm-up runs real steps and drops their outputs unread: their verdicts must not hold the ring (four
    dropped outputs filled it, and the next step's enqueue killed a clean engine). The next step releases them, and
    an output still held keeps its verdict. Control: without the release, the fifth enqueue finds no free slot."""
    import gc

    from tripwire.integrations.vllm import _contain

    class Out:  # an asynchronous output: vLLM calls get_output() before the scheduler sees the step
        def get_output(self):
            return "tokens"

    for release in (True, False):
        m = Monitor(registry=SiteRegistry(capacity=32), capacity=32, contain=True)
        site = m.registry.register("s.x")
        ring = m.verdicts("cpu", [site], depth=4)
        plugin = SimpleNamespace(contain=_contain.VerdictChannel("contain", m))
        st = _runner.RunnerState(SimpleNamespace(), ring)
        held = None
        for step in range(6):
            if release and st.open:
                _runner._release_dropped(st)
            if not release and step == 4:
                with pytest.raises(RuntimeError, match="none is free"):
                    ring.enqueue()
                break
            st.ticket = ring.enqueue()
            out = _runner.take_verdict(plugin, st, Out())
            if step == 3:
                held = out  # this one's output is kept (vLLM will read it)
            del out
            gc.collect()
        if release:
            _runner._release_dropped(st)  # the next step's
            assert [t.taken for t, _ in st.open] == [False] and held.get_output() == "tokens"
            assert st.open[0][0].taken  # taken by its output's get_output


def test_contain_fails_through_the_error_set_of_each_release(monkeypatch):
    """vLLM 0.26-0.32 keep the scheduler's per-request error set as a set of ids, 0.33 and later as a dict of
    ``vllm.outputs.RequestError`` (whose message reaches the API client): the victim is put in either, with
    tripwire's message in the dict. Control: a request that is already finished is not put in."""
    import sys
    import types

    from tripwire.integrations.vllm import _contain

    class RequestError:
        def __init__(self, code, message, retryable=False):
            self.code, self.message = code, message

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.outputs", types.SimpleNamespace(RequestError=RequestError))
    m = Monitor(registry=SiteRegistry(capacity=32), capacity=32, contain=True)
    c = _contain.VerdictChannel("contain", m)
    monkeypatch.setattr(_contain, "_evict", lambda sched, ids: None)
    for errors in (set(), {}):
        req = {r: SimpleNamespace(is_finished=lambda done=(r == "done"): done) for r in ("v", "done", "other")}
        sched = SimpleNamespace(requests=req, grammar_compile_error_reqs=errors)
        out = SimpleNamespace(
            _tripwire_tainted={"v": "why v", "done": "why done"},
            req_id_to_index={"v": 0, "done": 1, "other": 2},
            sampled_token_ids=[[5], [6], [7]],
        )
        c.before_update(sched, out)
        assert out.sampled_token_ids == [[], [6], [7]]  # the victim's token of this step dropped
        if isinstance(errors, set):
            assert errors == {"v"}
        else:
            assert list(errors) == ["v"] and errors["v"].message == "why v"


def test_the_plugin_switches_containment_through_the_monitors_one_setting(monkeypatch):
    """vLLM loads the plugin in every process; each switches its own monitor's containment through
    ``Monitor.set_contain`` (whether the monitor was built before the plugin or not), and no environment variable is
    set for it. Control: under ``mask`` and ``flag`` the setting stays off, and a monitor set to contain is refused
    (an explicit setting is never dropped silently)."""
    monkeypatch.delenv("TRIPWIRE_CONTAIN", raising=False)
    built_before = Monitor(registry=SiteRegistry(capacity=32), capacity=32)
    assert built_before.contain is False
    assert tw_vllm._monitor_for("contain", built_before) is built_before
    assert built_before.contain is True
    assert "TRIPWIRE_CONTAIN" not in os.environ
    for mode in ("mask", "flag"):
        plain = Monitor(registry=SiteRegistry(capacity=32), capacity=32)
        assert tw_vllm._monitor_for(mode, plain).contain is False
        with pytest.raises(RuntimeError, match=rf"TRIPWIRE_VLLM={mode} needs a monitor with containment off"):
            tw_vllm._monitor_for(mode, Monitor(registry=SiteRegistry(capacity=32), capacity=32, contain=True))
