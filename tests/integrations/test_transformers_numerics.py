"""Non-finite logits contained per request (site transformers.logits_nonfinite) on the real engine: transformers'
continuous batching on a small random-initialised Llama (CPU here; on a GPU, eager and CUDA graphs).

The fault: NaN written into one request's rows of the last decoder layer's output at a chosen step
(tripwire.testing.transformers_engine.NanInjector), so that request's logits row is NaN in that step and nothing else
is touched. The controls serve the same fault without tripwire, with the check off, and under ``flag``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tripwire import Monitor  # noqa: E402
from tripwire.integrations import transformers as tw  # noqa: E402
from tripwire.testing.transformers_engine import (  # noqa: E402
    PROMPTS,
    NanInjector,
    PersistentEngine,
    cb_config,
    tiny_llama,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
TOKENS = 16
SITE = tw.SITE_LOGITS
logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # the engine logs every failed request


def _configs():
    if HAS_CUDA:
        return [pytest.param(False, id="eager"), pytest.param(True, id="cuda_graphs")]
    return [pytest.param(False, id="cpu")]


def _served(graphs: bool, mode: str = "raise", tripwire: bool = True, **install):
    """A small Llama with a NaN injector (before any capture), its clean reference run, then (with ``tripwire``) the
    integration installed with ``install`` on its own monitor (events collected), served by a persistent engine."""
    model = tiny_llama(DEVICE)
    inj = NanInjector(model)
    ref_engine = PersistentEngine(model, TOKENS, cb_config(cuda_graphs=graphs))
    ref = ref_engine.run(PROMPTS, tag="ref")
    ref_engine.close()
    mon = Monitor(interval=0.005, report_every=0.5, mode=mode)
    events: list = []
    mon.add_sink(events.append)
    handle = tw.install(model, monitor=mon, **install) if tripwire else None
    eng = PersistentEngine(model, TOKENS, cb_config(cuda_graphs=graphs))
    return SimpleNamespace(model=model, inj=inj, ref=ref, mon=mon, events=events, handle=handle, eng=eng)


def _close(s) -> None:
    s.eng.close()
    if s.handle is not None:
        s.handle.uninstall()
    s.inj.remove()
    s.mon.stop()


def _count(mon: Monitor, site: str) -> int:
    return sum(h.count for (_, name), h in mon.snapshot().items() if name == site)


def _nan_run(s, victim: int, step: int, tag: str):
    """Serve PROMPTS as ``<tag>-<i>`` with NaN in request ``victim``'s hidden state at ``step``: (outputs, the
    injection)."""
    s.mon.reset()
    s.events.clear()
    rid = f"{tag}-{victim}"
    with s.inj.active(rid, step):
        out = s.eng.run(PROMPTS, tag=tag)
    s.mon.drain()
    (done,) = s.inj.injected
    assert done.step == step and done.request == rid and done.row is not None
    return out, done


def _others_unchanged(out, ref, victim: int) -> None:
    for i, (o, r) in enumerate(zip(out, ref, strict=True)):
        if i != victim:
            assert o is not None and o.error is None, (i, o and o.error)
            assert o.generated_tokens == r.generated_tokens, f"request {i} changed"


@pytest.fixture(scope="class", params=_configs())
def contained(request):
    """The integration with ``contain=True`` on a monitor in ``raise`` mode (any uncontained hit stops)."""
    s = _served(request.param, mode="raise", contain=True)
    yield s
    _close(s)


# Step 1 is the prefill (every prompt fits one batch: its logits give the first token), step 2 the first decode
# step, step 16 the step of the last token.
STEPS = [1, 2, 9, TOKENS]


class TestContained:
    @pytest.mark.parametrize("step", STEPS)
    def test_a_nan_in_one_request_fails_only_it(self, contained, step):
        """The victim fails in the step of the NaN with an error naming the site and its request id, handed back with
        only its tokens from earlier steps; the row counts once; an event names the site and the request before
        the error; every other request is the clean run's; the engine goes on and serves the same prompts (the
        victim's included) as the clean run."""
        s = contained
        victim, tag = (step + 2) % len(PROMPTS), f"n{step}"
        rid = f"{tag}-{victim}"
        rebuilds = s.eng.rebuilds
        out, done = _nan_run(s, victim, step, tag)
        assert _count(s.mon, SITE) == 1
        hit = s.mon.snapshot()[(str(s.model.device), SITE)]
        assert [(o.row, o.request) for o in hit.offenders] == [(done.row, rid)]
        err = out[victim].error
        assert err is not None and "tripwire contained a numeric fault" in err, err
        assert SITE in err and repr(rid) in err, err
        assert out[victim].generated_tokens == s.ref[victim].generated_tokens[: step - 1], "a token of its step escaped"
        named = [t for r, t in s.handle.contained if r == rid]
        assert len(named) == 1 and named[0].site == SITE and named[0].row == done.row
        assert any(e.site == SITE and [o.request for o in e.offenders] == [rid] for e in s.events), s.events
        _others_unchanged(out, s.ref, victim)
        assert s.mon.armed is None and s.eng.rebuilds == rebuilds, "containment must not end the engine's loop"
        again = s.eng.run(PROMPTS, tag=f"{tag}-again")
        assert [o.generated_tokens for o in again] == [r.generated_tokens for r in s.ref]
        assert [o.error for o in again] == [None] * len(PROMPTS)

    def test_a_nan_twice_in_a_row_counts_each_time(self, contained):
        """The same row of the same step bad in two runs (under CUDA graphs: two replays of one graph) counts and
        fails each time: the check's per-row claim epoch is a device word each call increments."""
        s = contained
        for run in range(2):
            tag = f"twice{run}"
            out, _ = _nan_run(s, 3, 5, tag)
            assert _count(s.mon, SITE) == 1, run
            assert out[3].error is not None and SITE in out[3].error, run
            _others_unchanged(out, s.ref, 3)

    def test_clean_runs_count_nothing(self, contained):
        s = contained
        s.mon.reset()
        out = s.eng.run(PROMPTS, tag="clean")
        s.mon.drain()
        assert [o.generated_tokens for o in out] == [r.generated_tokens for r in s.ref]
        assert s.mon.snapshot() == {}
        assert SITE in s.handle.sites


# ---------------------------------------------------------------------------------------------- controls
@pytest.mark.parametrize("step", [2, TOKENS])
@pytest.mark.parametrize("variant", ["without_tripwire", "logits_off"])
def test_control_the_engine_serves_the_nan_row_as_a_success(variant, step):
    """The same NaN without the check (no tripwire, or ``install(contain=True, logits=False)``): transformers samples
    the victim's step from its NaN logits and returns it as a success. Greedy decoding's argmax of an all-NaN row is
    token 0 (torch treats NaN as the maximum and returns its first index), so the victim's token of that step is 0
    and its later tokens follow from it; every other request is unchanged; nothing is counted."""
    tripwire = variant == "logits_off"
    s = _served(False, mode="raise", tripwire=tripwire, contain=True, logits=False)
    try:
        victim = 4
        out, _done = _nan_run(s, victim, step, "ctl")
        assert out[victim].error is None, "the control: the engine hands the NaN-sampled request back as a success"
        toks, ref = out[victim].generated_tokens, s.ref[victim].generated_tokens
        assert len(toks) == TOKENS and toks[: step - 1] == ref[: step - 1]
        assert toks[step - 1] != ref[step - 1]
        if DEVICE == "cpu":
            assert toks[step - 1] == 0
        _others_unchanged(out, s.ref, victim)
        assert _count(s.mon, SITE) == 0
        if tripwire:
            assert SITE not in s.handle.sites and s.handle.contained == []
    finally:
        _close(s)


class _Probe:
    """A forward hook on the model registered AFTER tripwire's, so it sees the logits as the engine samples them:
    per forward, the rows holding a NaN and the rows of zeros."""

    def __init__(self, model) -> None:
        self.seen: list[tuple[list[int], list[int]]] = []
        self._hook = model.register_forward_hook(self._look, with_kwargs=True)

    def _look(self, module, args, kwargs, output) -> None:
        if kwargs.get("cache") is None:
            return
        rows = output.logits[0]
        self.seen.append(
            (rows.isnan().any(-1).nonzero().view(-1).tolist(), (rows == 0).all(-1).nonzero().view(-1).tolist())
        )

    def remove(self) -> None:
        self._hook.remove()


@pytest.mark.parametrize("policy", ["flag", "mask"])
def test_flag_counts_only_mask_repairs(policy):
    """Without containment: ``flag`` counts the row and leaves it NaN (the control of the repair); ``mask`` counts it
    and sets its NaN to 0 before sampling. Neither fails the request (served, counted, kept out of the prefix cache)."""
    s = _served(False, mode="warn", policy=policy)
    probe = _Probe(s.model)
    try:
        victim, step = 1, 3
        probe.seen.clear()
        out, done = _nan_run(s, victim, step, policy)
        assert _count(s.mon, SITE) == 1
        assert out[victim].error is None and s.handle.contained == []
        assert any(st.request_id == f"{policy}-{victim}" for st in s.handle.tainted.values())
        nan_rows, zero_rows = probe.seen[step - 1]
        if policy == "flag":
            assert nan_rows == [done.row] and zero_rows == []
        else:
            assert nan_rows == [] and zero_rows == [done.row]
        assert all(not nan for nan, _ in probe.seen[step:]), "the NaN was in one step only"
        _others_unchanged(out, s.ref, victim)
    finally:
        probe.remove()
        _close(s)


def _sampled(model, prompts):
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=8, do_sample=True, top_k=5, eos_token_id=-1, pad_token_id=0)
    torch.manual_seed(5)
    out = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb_config())
    return [out[f"req_{i}"] for i in range(len(prompts))]


def test_sampling_a_nan_row_fails_the_batch_without_tripwire_and_only_its_request_with_it():
    """Sampling (``do_sample=True``, top-k): the top-k filter writes -inf into every row on purpose, and a clean run
    counts nothing (the check reads the model's logits, before the logits processors). Control: without tripwire a
    NaN row reaches ``torch.multinomial``, which raises on the CPU (on a GPU it is a device-side assert), and the
    engine fails EVERY request of the batch. With ``install(contain=True)`` (mask: the row is repaired before
    sampling) only the victim fails; the others are served in full (their tokens differ from the clean run's from
    the fault on: sampling draws depend on the batch's rows)."""
    model = tiny_llama("cpu")
    inj = NanInjector(model)
    try:
        with inj.active("req_2", 3):
            out = _sampled(model, PROMPTS)
        assert len(inj.injected) == 1
        assert all(o.error is not None and "probability tensor contains" in o.error for o in out), out[0].error
        mon = Monitor(interval=0.005, report_every=0.5, mode="raise")
        handle = tw.install(model, monitor=mon, contain=True)
        try:
            ref = _sampled(model, PROMPTS)
            mon.drain()
            assert [o.error for o in ref] == [None] * len(PROMPTS) and mon.snapshot() == {}
            with inj.active("req_2", 3):
                out = _sampled(model, PROMPTS)
            mon.drain()
            assert _count(mon, SITE) == 1
            assert out[2].error is not None and SITE in out[2].error
            for i, o in enumerate(out):
                if i != 2:
                    assert o.error is None and len(o.generated_tokens) == 8, (i, o.error)
        finally:
            handle.uninstall()
            mon.stop()
    finally:
        inj.remove()


# ---------------------------------------------------------------------------------------------- the switch, bad input
def test_logits_false_installs_no_check():
    model = tiny_llama("cpu")
    mon = Monitor()
    h = tw.install(model, monitor=mon, logits=False)
    try:
        assert h.sites == (tw.SITE_WRITE_INDEX, tw.SITE_READ_INDEX, tw.SITE_BLOCK_TABLE)
        assert len(model._forward_hooks) == 0
    finally:
        h.uninstall()
    h = tw.install(model, monitor=mon)
    assert h.sites[-1] == SITE and len(model._forward_hooks) == 1
    h.uninstall()
    assert len(model._forward_hooks) == 0


def test_a_model_with_per_token_logits_is_refused_under_contain_and_skipped_otherwise(caplog):
    """A model whose forward takes no ``logits_to_keep`` gets one logits row per TOKEN from the engine, not one per
    sampled request: refused at install under containment, served without the check (one WARNING) otherwise."""
    model = tiny_llama("cpu")
    model._supports_logits_to_keep = lambda: False
    mon = Monitor()
    with pytest.raises(ValueError, match=r"logits_to_keep.*logits=False"):
        tw.install(model, monitor=mon, contain=True)
    assert len(model._forward_hooks) == 0 and len(model._forward_pre_hooks) == 0
    tw.install(model, monitor=mon, contain=True, logits=False).uninstall()
    with caplog.at_level(logging.WARNING, logger="tripwire"):
        h = tw.install(model, monitor=mon)
    try:
        assert SITE not in h.sites and len(model._forward_hooks) == 0
        assert sum("non-finite logits check is off" in r.getMessage() for r in caplog.records) == 1
    finally:
        h.uninstall()


@pytest.mark.parametrize("contain", [False, True])
def test_logits_of_an_unexpected_shape_fail_the_step_under_contain_and_warn_once_otherwise(contain, caplog):
    """At run time: logits with more rows than ``logits_indices`` (speculative decoding's shape) cannot be attributed.
    Under containment the hook raises (the engine fails the step: closed); otherwise one WARNING, then silence."""
    model = tiny_llama("cpu")
    mon = Monitor()
    h = tw.install(model, monitor=mon, contain=contain)
    try:
        kwargs = {"cache": object(), "logits_indices": torch.zeros(2, dtype=torch.int32), "logits_to_keep": None}
        output = SimpleNamespace(logits=torch.zeros(1, 3, 8))
        if contain:
            with pytest.raises(RuntimeError, match=r"logits \(1, 3, 8\) for \(2,\) logits_indices"):
                h._post_forward(model, (), kwargs, output)
        else:
            with caplog.at_level(logging.WARNING, logger="tripwire"):
                h._post_forward(model, (), kwargs, output)
                h._post_forward(model, (), kwargs, output)
            assert sum("cannot attribute their rows" in r.getMessage() for r in caplog.records) == 1
        assert mon.snapshot() == {}
    finally:
        h.uninstall()


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("step", [2, TOKENS])
def test_cuda_graphs_a_nan_fails_only_its_request_in_every_replay(step):
    """CUDA graphs: the check is captured with the step and replayed with it (the engine's padded batches included:
    the victim is not the batch's first request, whose token the padding rows repeat). The same NaN in three runs
    fails its request each time (the claim epoch is incremented by each replay), the rest are the clean run's,
    and the device stays healthy."""
    s = _served(True, mode="raise", contain=True)
    try:
        for run in range(3):
            tag, victim = f"g{step}-{run}", 5
            out, done = _nan_run(s, victim, step, tag)
            assert _count(s.mon, SITE) == 1, run
            (offender,) = s.mon.snapshot()[("cuda:0", SITE)].offenders
            assert (offender.row, offender.request) == (done.row, f"{tag}-{victim}")
            assert out[victim].error is not None and SITE in out[victim].error
            _others_unchanged(out, s.ref, victim)
        x = torch.ones(4, device="cuda") * 2
        torch.cuda.synchronize()
        assert float(x.sum()) == 8.0
    finally:
        _close(s)
