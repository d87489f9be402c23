"""tripwire.integrations.vllm on the CPU, installed into a stand-in vLLM: the V1 step validator's host clean test
never skips a step the rules would count or repair, and the plugin's wrappers are on only while they have work.

No vLLM needed: the fixture ``vllm`` puts a stand-in ``vllm`` package in ``sys.modules`` (version 0.32.0, the V1
runner, its block table, the scheduler and the engine core at the paths the plugin imports them from; no V2 runner,
as in vLLM's CPU build), and :func:`tripwire.integrations.vllm.install` patches it as it would patch vLLM. The
stand-in runner carries the V1 runner's buffers (the attributes the step validator reads, with vLLM's dtypes and
layouts) and runs a step as vLLM's does: its block table's ``compute_slot_mapping``, then
``_build_attention_metadata``, then ``sample_tokens``. Everything is observed from outside: the arena's counts
(``Monitor.snapshot()``), the events a sink receives, the buffers, the scheduler's error set, and which methods are
wrapped (the classes' and the runner's ``__dict__``). On the CPU a step whose validator ran (the host clean test
failed) takes a verdict, so under ``contain`` its runner's ``sample_tokens`` is wrapped for the next call: that is
how a test sees which steps took the exact path.
"""

from __future__ import annotations

import inspect
import os
import pickle
import random
import sys
import types
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tripwire import Event, Monitor, SiteRegistry
from tripwire.integrations import vllm as tw_vllm

MAX_REQS, WIDTH, BLOCK, NUM_BLOCKS, MAX_LEN, MAX_TOKENS = 8, 4, 32, 64, 128, 64
SITES = (
    tw_vllm.SITE_POSITIONS,
    tw_vllm.SITE_QUERY_START_LOC,
    tw_vllm.SITE_SLOT_MAPPING,
    tw_vllm.SITE_BLOCK_TABLE,
    tw_vllm.SITE_BLOCK_COUNTS,
    tw_vllm.SITE_SEQ_LENS,
)


# ------------------------------------------------------------------------------------------------ the stand-in vLLM
class MultiGroupBlockTable:
    """V1's ``MultiGroupBlockTable`` as far as the plugin wraps it (``compute_slot_mapping``: vLLM's slot-mapping
    kernel; the stand-in's computes nothing, the step writes its slot mapping itself)."""

    def __init__(self, tables: list[SimpleNamespace]) -> None:
        self.block_tables = tables

    def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
        pass


class GPUModelRunner:
    """V1's ``GPUModelRunner`` as far as the plugin reads and wraps it (its CPU build: every ``.gpu`` buffer is a
    host tensor). A step's metadata comes from its scheduler output's ``write`` (the test's); ``asynchronous``:
    ``sample_tokens`` returns an asynchronous output (async scheduling), whose ``get_output`` gives the tokens."""

    def __init__(self, world_size: int = 1, asynchronous: bool = False) -> None:
        table = SimpleNamespace(
            block_size=BLOCK,
            num_blocks_per_row=np.zeros(MAX_REQS, dtype=np.int32),
            block_table=SimpleNamespace(gpu=torch.zeros(MAX_REQS, WIDTH, dtype=torch.int32)),
            slot_mapping=SimpleNamespace(gpu=torch.zeros(MAX_TOKENS, dtype=torch.int64)),
        )
        self.device = "cpu"
        self.max_model_len = MAX_LEN
        self.input_batch = SimpleNamespace(
            block_table=MultiGroupBlockTable([table]), max_num_reqs=MAX_REQS, req_ids=[], num_reqs=0
        )
        self.query_start_loc = SimpleNamespace(gpu=torch.zeros(MAX_REQS + 1, dtype=torch.int32))
        self.positions = torch.zeros(MAX_TOKENS, dtype=torch.int64)
        self.seq_lens = torch.zeros(MAX_REQS, dtype=torch.int32)
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=world_size))
        self.asynchronous = asynchronous
        self.own_slots: torch.Tensor | None = None  # a step's slot mapping that is not the runner's buffer

    def initialize_kv_cache(self, kv_cache_config, is_profiling=False):
        self.kv_cache_config = kv_cache_config

    def capture_model(self):
        pass

    def _build_attention_metadata(  # vLLM 0.32's signature
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
        reqs, tokens, padded = scheduler_output.write(self)
        self.input_batch.num_reqs = reqs
        self.input_batch.block_table.compute_slot_mapping(
            reqs, self.query_start_loc.gpu[: reqs + 1], self.positions[:tokens]
        )
        slots = self.input_batch.block_table.block_tables[0].slot_mapping.gpu[:padded]
        if self.own_slots is not None:
            slots = self.own_slots
        meta = self._build_attention_metadata(
            num_reqs=reqs, num_tokens=tokens, max_query_len=1, slot_mappings={0: slots}
        )
        assert meta == (None, False)  # the plugin's wrapper passed vLLM's defaults on

    def sample_tokens(self, grammar_output):
        ids = self.input_batch.req_ids
        out = SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[7] for _ in ids])
        return AsyncOutput(out) if self.asynchronous else out


class AsyncOutput:
    """vLLM's asynchronous model runner output: the engine core calls ``get_output`` before the scheduler sees the
    step (and vLLM's warm-up drops some unread)."""

    def __init__(self, out: SimpleNamespace) -> None:
        self.out = out

    def get_output(self):
        return self.out


class Request:
    def __init__(self) -> None:
        self.finished = False

    def is_finished(self) -> bool:
        return self.finished


class Scheduler:
    """vLLM's scheduler as far as the plugin reads it: its update fails the requests of its per-request error set
    (``grammar_compile_error_reqs``: a set of ids in 0.26-0.32, a dict of ``RequestError`` from 0.33) with
    FINISHED_ERROR and drains the set (the names ``contain`` checks the source for); ``updates`` records what each
    update failed and the output it was given, ``evicted`` the blocks kept out of the prefix cache."""

    errors_type: type = set

    def __init__(self, requests=("req-a", "req-b", "req-c", "req-d")) -> None:
        self.grammar_compile_error_reqs = type(self).errors_type()
        self.requests = {r: Request() for r in requests}
        self.updates: list[tuple[object, object]] = []
        self.evicted: list[set[int]] = []
        self.kv_cache_manager = SimpleNamespace(
            get_block_ids=lambda r: [[0, 10 + sorted(self.requests).index(r)]],
            block_pool=SimpleNamespace(evict_blocks=self.evicted.append),
        )

    def update_from_output(self, scheduler_output, model_runner_output):
        failed = self.grammar_compile_error_reqs
        self.grammar_compile_error_reqs = type(failed)()
        for r in failed:
            self.requests[r].finished = True  # RequestStatus.FINISHED_ERROR
        self.updates.append((failed, model_runner_output))
        return "updated"

    def finish_requests(self):
        pass


class EngineCore:
    def shutdown(self):
        pass


class RequestError:
    """``vllm.outputs.RequestError`` (0.33 and later)."""

    def __init__(self, code, message, retryable=False):
        self.code, self.message = code, message


EMPTY_MODEL_RUNNER_OUTPUT = SimpleNamespace(req_id_to_index={}, sampled_token_ids=[])
OWN = {
    (c, n): f
    for c in (GPUModelRunner, MultiGroupBlockTable, Scheduler, EngineCore)
    for n, f in vars(c).items()
    if inspect.isfunction(f)
}


@pytest.fixture
def vllm(monkeypatch) -> Iterator[None]:
    """A stand-in ``vllm`` 0.32.0 in ``sys.modules``, the classes above at the paths the plugin imports; after the
    test the plugin is uninstalled, and every method it wrapped is the class's own again."""
    modules = {
        "vllm": {"__version__": "0.32.0"},
        "vllm.v1": {},
        "vllm.v1.worker": {},
        "vllm.v1.worker.gpu_model_runner": {"GPUModelRunner": GPUModelRunner},
        "vllm.v1.worker.block_table": {"MultiGroupBlockTable": MultiGroupBlockTable},
        "vllm.v1.core": {},
        "vllm.v1.core.sched": {},
        "vllm.v1.core.sched.scheduler": {"Scheduler": Scheduler},
        "vllm.v1.engine": {},
        "vllm.v1.engine.core": {"EngineCore": EngineCore},
        "vllm.v1.outputs": {"EMPTY_MODEL_RUNNER_OUTPUT": EMPTY_MODEL_RUNNER_OUTPUT},
        "vllm.outputs": {"RequestError": RequestError},
    }
    for name, attrs in modules.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, mod)
    try:
        yield
    finally:
        tw_vllm.uninstall()
        while STARTED:
            STARTED.pop().stop()  # the reader the plugin started at the runner's captures
    assert all(vars(c)[n] is f for (c, n), f in OWN.items())  # uninstall restored every method


STARTED: list[Monitor] = []


def monitor(**kw) -> Monitor:
    return Monitor(registry=SiteRegistry(capacity=32), capacity=32, **kw)


KV_CACHE_CONFIG = SimpleNamespace(
    kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=BLOCK))], num_blocks=NUM_BLOCKS
)


def engine(mode: str, m: Monitor | None = None, **runner) -> tuple[Monitor, GPUModelRunner]:
    """Install the plugin in ``mode`` on the stand-in vLLM and build a runner as vLLM does (its KV cache, then its
    captures)."""
    m = monitor() if m is None else m
    tw_vllm.install(mode, monitor=m, logits=False)
    r = GPUModelRunner(**runner)
    r.initialize_kv_cache(KV_CACHE_CONFIG)
    r.capture_model()
    STARTED.append(m)
    return m, r


def step(r: GPUModelRunner, write: Callable) -> tuple[bool, object]:
    """One engine step on ``r`` with the metadata ``write`` puts in its buffers. Returns whether the step's
    validator ran (its verdict wraps the runner's next ``sample_tokens``) and the step's output."""

    def scheduled(runner: GPUModelRunner) -> tuple[int, int, int]:
        reqs, tokens, padded = write(runner)
        so.num_scheduled_tokens = dict.fromkeys(runner.input_batch.req_ids[:reqs], 1)
        return reqs, tokens, padded

    so = SimpleNamespace(write=scheduled, num_scheduled_tokens={})
    assert r.execute_model(so) is None
    exact = "sample_tokens" in vars(r)
    return exact, r.sample_tokens(None)


def counts(m: Monitor) -> dict[str, int]:
    return {site: hit.count for (_dev, site), hit in m.snapshot().items()}


class Events(list):
    """A sink: every event the monitor hands out (a step's verdict hands its events out before it is acted on)."""

    def __call__(self, event: Event) -> None:
        self.append(event)


def _table(r: GPUModelRunner) -> SimpleNamespace:
    return r.input_batch.block_table.block_tables[0]


# ------------------------------------------------------------------------- the host clean test against the rules
def edge(rng: random.Random, lo: int, hi: int, extra: tuple[int, ...] = ()) -> int:
    """Mostly in range; one time in 32 an edge: ``lo - 1``, ``lo``, ``hi - 1``, ``hi`` or one of ``extra``."""
    if rng.random() < 31 / 32:
        return rng.randrange(lo, hi)
    return rng.choice((lo - 1, lo, hi - 1, hi, *extra))


def fill(r: GPUModelRunner, rng: random.Random) -> tuple[int, int, int]:
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
    table = _table(r)
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


def buffers(r: GPUModelRunner) -> list[torch.Tensor]:
    table = _table(r)
    return [
        r.positions.clone(),
        r.query_start_loc.gpu.clone(),
        table.slot_mapping.gpu.clone(),
        table.block_table.gpu.clone(),
        torch.from_numpy(table.num_blocks_per_row.copy()),
        r.seq_lens.clone(),
    ]


def reference(
    before: list[torch.Tensor], shape: tuple[int, int, int], policy: str, loosen: str | None = None
) -> tuple[dict[str, int], dict[str, set], list[torch.Tensor]]:
    """The V1 step's rules (docs/vllm.md, "What it checks, and where"), written in torch: each
    site's count of bad entries, its bad entries as (row, value) (a table's row: its batch row) and the buffers as
    the policy leaves them. ``loosen`` (the controls): ``"hi"`` every
    range one past its end, ``"width"`` per-row counts one past the width, ``"indptr"`` the indptr's order untested.
    """
    reqs, tokens, padded = shape
    pos, cu, slots, table, nblocks, seq = (t.clone() for t in before)
    mask = policy == "mask"
    up = 1 if loosen == "hi" else 0
    got = dict.fromkeys(SITES, 0)
    where: dict[str, set] = {s: set() for s in SITES}

    def note(site: str, bad: torch.Tensor, values: torch.Tensor, width: int = 1) -> None:
        got[site] += int(bad.sum())
        where[site] |= {(int(i) // width, int(values.view(-1)[i])) for i in bad.view(-1).nonzero().view(-1)}

    # query_start_loc: entry 0 is 0; each later one in [0, tokens] and not below the largest in-range one before it
    # (the last good entry, which mask writes); positions below max_model_len up to the largest in-range end.
    last = end = 0
    for k in range(reqs + 1):
        v = int(cu[k])
        ok = v == 0 if k == 0 else 0 <= v <= tokens and (v >= last or loosen == "indptr")
        if k > 0 and 0 <= v <= tokens:
            last = end = max(last, v)
        if not ok:
            got[tw_vllm.SITE_QUERY_START_LOC] += 1
            where[tw_vllm.SITE_QUERY_START_LOC].add((k, v))
            if mask:
                cu[k] = 0 if k == 0 else last
    bad = ~((pos[:end] >= 0) & (pos[:end] < MAX_LEN + up))
    note(tw_vllm.SITE_POSITIONS, bad, pos[:end])
    if mask:
        pos[:end][bad] = 0
    # Slot mapping (padded tokens included): [0, blocks * block size) or PAD_SLOT_ID -1; masked to -1.
    sm = slots[:padded]
    bad = ~(((sm >= 0) & (sm < NUM_BLOCKS * BLOCK + up)) | (sm == -1))
    note(tw_vllm.SITE_SLOT_MAPPING, bad, sm)
    if mask:
        sm[bad] = -1
    # Per-row block counts in [0, width] (clamped under mask); each row's used columns in [0, blocks), masked to 0.
    n = nblocks[:reqs].long()
    bad = (n < 0) | (n > WIDTH + (1 if loosen == "width" else 0))
    note(tw_vllm.SITE_BLOCK_COUNTS, bad, n)
    used = torch.arange(WIDTH) < n.clamp(0, WIDTH)[:, None]
    bt = table[:reqs]
    bad = used & ~((bt >= 0) & (bt < NUM_BLOCKS + up))
    note(tw_vllm.SITE_BLOCK_TABLE, bad, bt, WIDTH)
    if mask:
        nblocks[:reqs] = n.clamp(0, WIDTH).to(nblocks.dtype)
        bt[bad] = 0
    # seq_lens in [1, max_model_len]; masked to 1.
    sl = seq[:reqs]
    bad = ~((sl >= 1) & (sl <= MAX_LEN + up))
    note(tw_vllm.SITE_SEQ_LENS, bad, sl)
    if mask:
        sl[bad] = 1
    return (
        {s: c for s, c in got.items() if c},
        {s: w for s, w in where.items() if w},
        [pos, cu, slots, table, nblocks, seq],
    )


def run_steps(seed: int, steps: int, policy: str) -> list[tuple]:
    """``steps`` steps of edge-laden metadata through the installed plugin (``contain``: the validators' mask
    policy; ``flag``: flag). Per step: its shape, the buffers before and after it, each site's new counts, whether
    its validator ran, and its offenders by site as (row, value, request) from the step's verdict's events (the
    last two observable under ``contain`` only: None under flag, whose events come from the reader, not the step)."""
    events = Events()
    m = monitor()
    m.add_sink(events)
    m, r = engine("contain" if policy == "mask" else "flag", m)
    rng = random.Random(seed)
    seen, prev = [], {}
    for _ in range(steps):
        shape: list = []
        before: list = []

        def write(runner: GPUModelRunner, shape: list = shape, before: list = before) -> tuple[int, int, int]:
            shape[:] = fill(runner, rng)
            before[:] = buffers(runner)
            return shape[0], shape[1], shape[2]

        events.clear()
        exact, _out = step(r, write)
        now = counts(m)
        new = {s: c - prev.get(s, 0) for s, c in now.items() if c != prev.get(s, 0)}
        prev = now
        offenders: dict[str, set] = {}
        for e in events:
            offenders.setdefault(e.site, set()).update(e.offenders)
        mask = policy == "mask"
        seen.append((tuple(shape), before, buffers(r), new, exact if mask else None, offenders if mask else None))
    return seen


def agreement(seen: list[tuple], policy: str, loosen: str | None = None) -> list[bool]:
    """Per step: its counts and buffers are the reference's, and (under ``contain``) its verdict's offenders are
    bad entries the reference found, this step's among them. The first ``TRIPWIRE_OFFENDERS`` (8) distinct
    offenders of a site are kept for the monitor's life: once a site keeps 8, a step's new ones are not added."""
    found: dict[str, set] = {site: set() for site in SITES}
    out = []
    for shape, before, after, new, _exact, offenders in seen:
        want, where, bufs = reference(before, shape, policy, loosen)
        for site, entries in where.items():
            found[site] |= entries
        ok = new == want and all(map(torch.equal, after, bufs))
        if offenders is not None:
            ok = ok and where.keys() <= offenders.keys()
            for site, got in offenders.items():
                kept = {(o.row, o.value) for o in got}
                ok = ok and kept <= found[site] and (len(kept) == 8 or where.get(site, set()) <= kept)
        out.append(ok)
    return out


RUNS: dict[str, list[tuple]] = {}


def steps300(policy: str) -> list[tuple]:
    """The same 300 steps per policy, run once for the test and its controls (inside a test: the stand-in vLLM is
    the fixture's)."""
    if policy not in RUNS:
        RUNS[policy] = run_steps(7, 300, policy)
    return RUNS[policy]


@pytest.mark.parametrize("policy", ["mask", "flag"])
def test_host_clean_test_skips_only_what_the_rules_would_not_count(vllm, policy):
    """300 steps of edge-laden metadata through the installed plugin: after every step each site's new count and
    every buffer equal the rules' reference (a skipped step that should have counted or masked shows as a count
    short, or a bad entry left in place), and under ``contain`` its verdict's offenders are entries the reference
    found bad. Under ``contain`` more than 50 steps skip the validator (the test is not vacuous) and more than 50 run
    it; under ``flag`` which steps skip is not observable, and more than 50 steps count."""
    seen = steps300(policy)
    assert agreement(seen, policy) == [True] * 300
    faulty = sum(bool(s[3]) for s in seen)
    assert faulty > 50, faulty
    if policy == "mask":
        exact = sum(s[4] for s in seen)
        assert 50 < exact < 250 and exact >= faulty, (exact, faulty)


@pytest.mark.parametrize("loosen", ["hi", "width", "indptr"])
def test_the_comparison_can_fail(vllm, loosen):
    """Control: the reference loosened one rule at a time (a range one past its end, counts one past the width, an
    indptr whose order is not tested) disagrees with what the plugin did on some of the same 300 steps, so the
    comparison above sees a rule the fast path would let through."""
    assert not all(agreement(steps300("mask"), "mask", loosen))


def test_first_step_and_a_replaced_buffer_take_the_exact_path(vllm):
    """The first step, and the step after the runner replaces a buffer, call the validator (its argument checks
    see the buffer): a replaced positions buffer of the wrong dtype is refused with the validator's error. A slot
    mapping that is not a view of the runner's slot buffer is validated, not read from that buffer."""
    m, r = engine("contain")
    table = _table(r)

    def one(runner: GPUModelRunner) -> tuple[int, int, int]:
        runner.query_start_loc.gpu[:2] = torch.tensor([0, 1], dtype=torch.int32)
        runner.seq_lens[:1] = 1
        runner.positions[:1] = 0
        table.slot_mapping.gpu[:1] = 0
        runner.input_batch.req_ids = ["req-a"]
        return 1, 1, 1

    assert [step(r, one)[0] for _ in range(3)] == [True, False, False]
    r.positions = torch.zeros(MAX_TOKENS, dtype=torch.float32)
    with pytest.raises(TypeError, match="'positions' must be int32 or int64"):
        step(r, one)
    r.positions = torch.zeros(MAX_TOKENS, dtype=torch.int64)
    assert [step(r, one)[0] for _ in range(2)] == [True, False]
    # A slot mapping of its own (not a view of the runner's slot buffer), one past the end: counted once and masked
    # in place; the next step's (that same tensor, clean now) still goes through the validator.
    r.own_slots = torch.tensor([NUM_BLOCKS * BLOCK])
    assert [step(r, one)[0] for _ in range(2)] == [True, True]
    assert counts(m) == {tw_vllm.SITE_SLOT_MAPPING: 1} and r.own_slots.tolist() == [-1]


# --------------------------------------------------------------------------------- one bad entry at each rule
def decode_step(r: GPUModelRunner) -> tuple[int, int, int]:
    """A clean decode step in ``r``'s buffers: 4 requests of one token each (position 40, length 41, two used
    blocks of the table's 4 columns)."""
    n = 4
    table = _table(r)
    r.query_start_loc.gpu[: n + 1] = torch.arange(n + 1, dtype=torch.int32)
    r.positions[:n] = 40
    r.seq_lens[:n] = 41
    table.slot_mapping.gpu[:n] = torch.arange(n) * BLOCK + 8
    table.block_table.gpu[:n] = torch.arange(1, n * WIDTH + 1, dtype=torch.int32).view(n, WIDTH)
    table.num_blocks_per_row[:n] = 2
    r.input_batch.req_ids = ["req-a", "req-b", "req-c", "req-d"]
    return n, n, n


def with_bad(*writes: Callable[[GPUModelRunner], object]) -> Callable[[GPUModelRunner], tuple[int, int, int]]:
    """A clean decode step with bad entries written into it."""

    def write(r: GPUModelRunner) -> tuple[int, int, int]:
        shape = decode_step(r)
        for w in writes:
            w(r)
        return shape

    return write


def bad_seq_len(row: int) -> Callable[[GPUModelRunner], None]:
    return lambda r: r.seq_lens.__setitem__(row, 0)


def bad_position(row: int) -> Callable[[GPUModelRunner], None]:
    return lambda r: r.positions.__setitem__(row, MAX_LEN)


# Per rule: one bad entry written into a clean decode step (request row 1, "req-b", where a row is attributed), the
# site it counts at, and how to read the entry back (to see it masked) with its safe value.
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
    "positions": (bad_position(1), tw_vllm.SITE_POSITIONS, lambda r: int(r.positions[1]), 0),
    "query_start_loc": (
        lambda r: r.query_start_loc.gpu.__setitem__(2, 0),
        tw_vllm.SITE_QUERY_START_LOC,
        lambda r: int(r.query_start_loc.gpu[2]),
        1,
    ),
    "seq_lens": (bad_seq_len(1), tw_vllm.SITE_SEQ_LENS, lambda r: int(r.seq_lens[1]), 1),
}


def one_bad_entry(rule: str, *, off_for_the_bad_step: bool = False) -> tuple[list[bool], dict, int, Events, Scheduler]:
    """Under ``contain``: two clean decode steps, one with a bad entry at ``rule``, one clean again, each handed to
    the scheduler. Returns whether each step's validator ran, each site's count, the entry as read back after the
    bad step, the events and the scheduler. ``off_for_the_bad_step`` (the control): the plugin's step path is off
    from the bad step on (uninstalled: vLLM's own methods), as a fast path that passes every step would leave it."""
    write, _site, read, _safe = BAD[rule]
    m = monitor()
    events = Events()
    m.add_sink(events)
    m, r = engine("contain", m)
    sched = Scheduler()
    exact, after = [], 0
    for i in range(4):
        if i == 2 and off_for_the_bad_step:
            tw_vllm.uninstall()
        ran, out = step(r, with_bad(write) if i == 2 else decode_step)
        exact.append(ran)
        if i == 2:
            after = read(r)
        sched.update_from_output(None, out)
    return exact, counts(m), after, events, sched


@pytest.mark.parametrize("rule", sorted(BAD))
def test_a_bad_entry_at_each_rule_takes_the_exact_path(vllm, rule):
    """The host clean test skips the clean steps around it (the first step binds the buffers: exact), and a step
    with ONE bad entry at any rule goes through the validator: counted exactly once, at its site only, masked,
    attributed to vLLM's request id, and that request (all four where an indptr entry, which belongs to none, is
    bad) failed by the scheduler in that step's update."""
    _write, site, _read, safe = BAD[rule]
    exact, seen, after, events, sched = one_bad_entry(rule)
    assert exact == [True, False, True, False]
    assert seen == {site: 1}
    assert after == safe  # masked before any kernel reads it
    hit = [e for e in events if e.site == site]
    assert [e.delta for e in hit] == [1]
    victims = {"req-a", "req-b", "req-c", "req-d"} if rule == "query_start_loc" else {"req-b"}
    if rule != "query_start_loc":  # an indptr entry belongs to no request (the kernel's attribution too)
        assert [o.request for o in hit[0].offenders] == ["req-b"]
    assert [failed for failed, _out in sched.updates] == [set(), set(), victims, set()]


@pytest.mark.parametrize("rule", sorted(BAD))
def test_a_step_path_that_skips_the_validator_misses_each_rule(vllm, rule):
    """Control: with the validator skipped for the bad step (the plugin's step path off, as a fast path that
    passes every step leaves it), the same bad entry is never counted, masked or failed, so the exact counts
    asserted above are what catches a fast path that lets a rule through."""
    _write, _site, _read, safe = BAD[rule]
    exact, seen, after, _events, sched = one_bad_entry(rule, off_for_the_bad_step=True)
    assert exact == [True, False, False, False]
    assert seen == {}
    assert after != safe
    assert all(failed == set() for failed, _out in sched.updates)


# ---------------------------------------------------------------- the plugin's wrappers: on only while they have work
def test_scheduler_wrapper_is_on_only_while_taints_are_due(vllm):
    """A clean step's output reaches vLLM's own update_from_output (nothing of the plugin on the class); an output
    with taints puts the wrapper on where it is made (the in-process engine core) and again where it is unpickled
    (the engine core's own process), the wrapper fails its victims and comes off after; two tainted outputs made or
    unpickled before their updates keep it on for both. Control: an output whose taints were flattened to a plain
    dict on the way (not armed on unpickling) reaches vLLM's method unwrapped, and its victim is never failed."""
    orig = OWN[(Scheduler, "update_from_output")]

    def on() -> bool:
        return vars(Scheduler)["update_from_output"] is not orig

    _m, r = engine("contain")
    s = Scheduler()
    _ran, clean = step(r, decode_step)
    assert not on()  # installed, yet vLLM's own method on a clean step
    assert s.update_from_output(None, clean) == "updated" and s.updates[-1] == (set(), clean)
    _ran, a = step(r, with_bad(bad_seq_len(0)))
    assert on()  # armed when the output got its taints, before the scheduler sees it
    _ran, b = step(r, with_bad(bad_seq_len(1)))
    sent_a, sent_b = pickle.dumps(a), pickle.dumps(b)  # as a worker process sends them
    assert s.update_from_output(None, a) == "updated" and s.updates[-1][0] == {"req-a"}
    assert a.sampled_token_ids == [[], [7], [7], [7]]  # the victim's token of this step dropped
    assert on()  # b's update is still to come
    assert s.update_from_output(None, b) == "updated" and s.updates[-1][0] == {"req-b"}
    assert not on()  # off again: the next clean step is vLLM's alone
    # The engine core in a process of its own: the same outputs arm its scheduler where they are unpickled.
    core = Scheduler()
    got_a = pickle.loads(sent_a)
    assert on()
    got_b = pickle.loads(sent_b)
    core.update_from_output(None, got_a)
    assert core.updates[-1][0] == {"req-a"} and on()
    core.update_from_output(None, got_b)
    assert core.updates[-1][0] == {"req-b"} and not on()
    # Control: taints that do not arm on arrival reach an unwrapped scheduler and are lost.
    flat = SimpleNamespace(**{k: dict(v) if isinstance(v, dict) else v for k, v in vars(got_a).items()})
    lost = pickle.loads(pickle.dumps(flat))
    assert not on()
    other = Scheduler()
    other.update_from_output(None, lost)
    assert other.updates == [(set(), lost)]
    # Uninstalled: an output with taints arms nothing.
    tw_vllm.uninstall()
    pickle.loads(sent_a)
    assert not on()


def test_a_masked_request_keeps_the_scheduler_wrapper_on_until_it_finishes(vllm):
    """Under ``mask`` a tainted request runs on (failed by nobody) with its blocks kept out of the prefix cache at
    every update until it finishes: the wrapper stays on for clean steps meanwhile, and comes off at the first
    update after it finished. Control: the clean steps before the fault leave the class's own method on."""
    orig = OWN[(Scheduler, "update_from_output")]
    _m, r = engine("mask")
    s = Scheduler()
    s.update_from_output(None, step(r, decode_step)[1])
    assert vars(Scheduler)["update_from_output"] is orig and s.evicted == []
    # The step's output first, then the update is looked up (as vLLM's engine core does): the output arms it.
    _ran, out = step(r, with_bad(bad_position(2)))
    s.update_from_output(None, out)  # req-c: its blocks are 0 and 12
    assert s.updates[-1][0] == set() and s.evicted == [{12}, {12}]  # before vLLM's update, and after it
    for _ in range(2):
        _ran, out = step(r, decode_step)
        s.update_from_output(None, out)
        assert vars(Scheduler)["update_from_output"] is not orig
    assert s.evicted == [{12}] * 4
    s.requests["req-c"].finished = True
    _ran, out = step(r, decode_step)
    s.update_from_output(None, out)
    assert vars(Scheduler)["update_from_output"] is orig and len(s.evicted) == 4


def test_sample_tokens_is_wrapped_only_after_a_step_with_a_verdict(vllm):
    """A clean step calls vLLM's own sample_tokens (the class's method is never wrapped, and nothing is put on the
    runner); a step whose validator ran wraps the runner's next sample_tokens call, which takes the verdict once
    (its victim fails at the scheduler) and unwraps. Control: the same step with the instance wrapper removed before
    sampling takes no verdict, and its victim runs on."""
    own = OWN[(GPUModelRunner, "sample_tokens")]
    _m, r = engine("contain")
    s = Scheduler()
    assert [step(r, decode_step)[0] for _ in range(2)] == [True, False]  # the first step binds the buffers
    ran, out = step(r, with_bad(bad_seq_len(1)))
    assert ran and "sample_tokens" not in vars(r)
    s.update_from_output(None, out)
    assert s.updates[-1][0] == {"req-b"}
    ran, out = step(r, decode_step)
    assert not ran and "sample_tokens" not in vars(r)
    s.update_from_output(None, out)
    assert s.updates[-1][0] == set()
    assert vars(GPUModelRunner)["sample_tokens"] is own
    # Control: without the runner's one-call wrapper, a step whose validator ran has its verdict left untaken.
    so = SimpleNamespace(write=with_bad(bad_seq_len(2)), num_scheduled_tokens={})
    r.execute_model(so)
    assert "sample_tokens" in vars(r)
    del r.sample_tokens
    s.update_from_output(None, r.sample_tokens(None))
    assert s.updates[-1][0] == set() and not s.requests["req-c"].finished


@pytest.mark.parametrize("mode", ["contain", "mask", "flag"])
def test_parallelism_is_refused_under_contain_only(vllm, mode):
    """Tensor, pipeline or context parallelism (a world of several workers): each rank's verdict covers only its own
    arena, so ``contain`` refuses to build, naming the way out, and the runner is left unguarded; ``mask`` and
    ``flag`` build (the control), and a bad entry counts."""
    m = monitor()
    tw_vllm.install(mode, monitor=m, logits=False)
    r = GPUModelRunner(world_size=2)
    if mode == "contain":
        with pytest.raises(
            RuntimeError, match=r"TRIPWIRE_VLLM=contain needs one worker.*has 2.*Use TRIPWIRE_VLLM=mask"
        ):
            r.initialize_kv_cache(KV_CACHE_CONFIG)
    else:
        r.initialize_kv_cache(KV_CACHE_CONFIG)
        r.capture_model()
        STARTED.append(m)
    step(r, with_bad(bad_seq_len(1)))
    assert counts(m) == ({} if mode == "contain" else {tw_vllm.SITE_SEQ_LENS: 1})


@pytest.mark.parametrize("hold", ["one", "all"])
def test_verdicts_of_outputs_vllm_drops_are_released(vllm, hold):
    """V2's warm-up runs real steps and drops their outputs unread: their verdicts must not hold the ring (four
    dropped outputs filled it, and the next step's enqueue killed a clean engine). Six faulty steps whose
    asynchronous outputs are dropped all run; the one output still held (vLLM reads it within two steps) keeps its
    verdict: its victim fails when vLLM reads it. Control: with every output held (none can be released), the
    fifth faulty step finds no free slot."""
    m, r = engine("contain", asynchronous=True)
    s = Scheduler()
    assert step(r, decode_step)[0]  # the first step binds the buffers: a verdict, its output dropped
    held = []
    for i in range(6):
        write = with_bad(bad_position(i % 4))
        if hold == "all" and i == 4:
            with pytest.raises(RuntimeError, match="none is free"):
                step(r, write)
            break
        ran, out = step(r, write)
        assert ran
        if hold == "all" or i == 3:
            held.append(out)
        del out
    if hold == "one":
        assert counts(m) == {tw_vllm.SITE_POSITIONS: 6}
        out = held[0].get_output()  # the engine core's, before the scheduler's update is looked up
        s.update_from_output(None, out)
        assert s.updates[-1][0] == {"req-d"}
        assert step(r, with_bad(bad_position(0)))[0]  # the ring goes on


def test_the_plugin_switches_containment_through_the_monitors_one_setting(vllm, monkeypatch):
    """vLLM loads the plugin in every process; each switches its own monitor's containment through
    ``Monitor.set_contain`` (whether the monitor was built before the plugin or not), and no environment variable is
    set for it. Control: under ``mask`` and ``flag`` the setting stays off, and a monitor set to contain is refused
    (an explicit setting is never dropped silently)."""
    monkeypatch.delenv("TRIPWIRE_CONTAIN", raising=False)
    built_before = monitor()
    assert built_before.contain is False
    assert tw_vllm.install("contain", monitor=built_before, logits=False).monitor is built_before
    assert built_before.contain is True
    assert "TRIPWIRE_CONTAIN" not in os.environ
    tw_vllm.uninstall()
    for mode in ("mask", "flag"):
        plain = monitor()
        tw_vllm.install(mode, monitor=plain, logits=False)
        assert plain.contain is False
        tw_vllm.uninstall()
        with pytest.raises(RuntimeError, match=rf"TRIPWIRE_VLLM={mode} needs a monitor with containment off"):
            tw_vllm.install(mode, monitor=monitor(contain=True), logits=False)
        assert tw_vllm.installed() is None


@pytest.mark.parametrize("errors", [set, dict])
def test_contain_fails_through_the_error_set_of_each_release(vllm, monkeypatch, errors):
    """vLLM 0.26-0.32 keep the scheduler's per-request error set as a set of ids, 0.33 and later as a dict of
    ``vllm.outputs.RequestError`` (whose message reaches the API client): the victim is put in either, with
    tripwire's message in the dict, and its token of the step dropped. Control: a request the step's bad entries
    also name that is already finished is not put in, and keeps its token."""
    monkeypatch.setattr(Scheduler, "errors_type", errors)
    if errors is dict:
        monkeypatch.setattr(sys.modules["vllm"], "__version__", "0.33.0")
    _m, r = engine("contain")
    s = Scheduler()
    s.requests["req-b"].finished = True
    _ran, out = step(r, with_bad(bad_seq_len(0), bad_seq_len(1)))
    s.update_from_output(None, out)
    failed = s.updates[-1][0]
    assert out.sampled_token_ids == [[], [7], [7], [7]]
    assert list(failed) == ["req-a"]
    if errors is dict:
        assert isinstance(failed["req-a"], RequestError) and tw_vllm.SITE_SEQ_LENS in failed["req-a"].message
