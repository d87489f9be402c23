"""tripwire.integrations.transformers against the real engine: transformers' continuous batching on a small
random-initialised Llama (CPU here, the H200 with and without CUDA graphs).

Faults are written into the engine's own prepared metadata at a chosen step (tripwire.testing.transformers_engine.
FaultInjector), the way a host-side bug would put them there. The controls run the same faults without the
integration and show the engine dying.
"""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tripwire  # noqa: E402
from tripwire import GuardTripped, Monitor  # noqa: E402
from tripwire.integrations import transformers as tw  # noqa: E402
from tripwire.testing.transformers_engine import (  # noqa: E402
    PROMPTS,
    FaultInjector,
    Injection,
    PersistentEngine,
    cb_config,
    tiny_llama,
)
from tripwire.validate import Validator  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
TOKENS = 16
logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # the engine logs every failed request


def _configs():
    if HAS_CUDA:
        return [pytest.param(False, id="eager"), pytest.param(True, id="cuda_graphs")]
    return [pytest.param(False, id="cpu")]


def _installed(graphs, mode="warn", **install):
    """A small Llama's clean reference run, then the model with tripwire installed (``install`` keywords) on its
    own monitor, served by a persistent engine: (model, reference outputs, engine, monitor, handle)."""
    model = tiny_llama("cuda" if HAS_CUDA else "cpu")
    ref_engine = PersistentEngine(model, TOKENS, cb_config(cuda_graphs=graphs))
    ref = ref_engine.run(PROMPTS, tag="ref")
    ref_engine.close()
    mon = Monitor(interval=0.005, report_every=0.5, mode=mode)
    handle = tw.install(model, monitor=mon, **install)
    return model, ref, PersistentEngine(model, TOKENS, cb_config(cuda_graphs=graphs)), mon, handle


@pytest.fixture(scope="class", params=_configs())
def engine(request):
    """(model, reference outputs, persistent engine with tripwire installed, its monitor, handle), per config."""
    graphs = request.param
    model, ref, eng, mon, handle = _installed(graphs)
    yield model, ref, eng, mon, handle, graphs
    eng.close()
    handle.uninstall()
    mon.stop()


def _healthy(device: torch.device) -> bool:
    x = torch.arange(16, device=device).float() @ torch.ones(16, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return float(x) == 120.0


def _count(mon: Monitor, site: str) -> int:
    return sum(h.count for (_, s), h in mon.snapshot().items() if s == site)


def _cache(eng):
    """The engine's cache (a clean run first when the last run ended its manager)."""
    if eng.manager is None or eng.manager.batch_processor is None:
        eng.run(PROMPTS, tag="warm")
    return eng.manager.batch_processor.cache


def _assert_stopped(eng, mon, out, tag):
    """A write fault without containment armed the stop IN ITS STEP (the same-step verdict): every request in flight
    failed with tripwire's error, none was handed back as a success; the stop is sticky until reset."""
    armed = mon.armed
    assert isinstance(armed, GuardTripped) and armed.site == tw.SITE_WRITE_INDEX and armed.fatal
    errors = [o.error if o is not None else "missing" for o in out]
    assert all(e is not None and tw.SITE_WRITE_INDEX in e for e in errors), errors[:2]
    refused = eng.run(PROMPTS[:2], tag=f"{tag}-refused")
    assert all(o.error is not None and tw.SITE_WRITE_INDEX in o.error for o in refused)
    return armed


def _serve(eng, mon, injections, tag):
    mon.reset()
    inj = FaultInjector(injections)
    with inj.active():
        out = eng.run(PROMPTS, tag=tag)
    mon.drain()
    return out, inj


class TestServing:
    """The engine fixture is per class: its installed handle is gone before the install/uninstall tests."""

    # ---------------------------------------------------------------------------------------------- clean runs
    def test_clean_run_is_identical(self, engine):
        _model, ref, eng, mon, _, _graphs = engine
        out, _ = _serve(eng, mon, [], "clean")
        assert [o.error for o in out] == [None] * len(PROMPTS)
        assert [o.generated_tokens for o in out] == [r.generated_tokens for r in ref]
        assert mon.snapshot() == {}

    # ---------------------------------------------------------------------------------------------- faults
    @pytest.mark.parametrize("value_kind", ["end", "far", "negative"])
    def test_read_fault_is_masked_counted_once_and_contained(self, engine, value_kind):
        model, ref, eng, mon, _, _graphs = engine
        tag = f"read-{value_kind}"
        victim = 5
        out, inj = _serve(eng, mon, [Injection("read", 3, f"{tag}-{victim}", value_kind, offset=1)], tag)
        assert len(inj.injected) == 1, f"nothing injected: {inj.pending}"
        assert _count(mon, tw.SITE_READ_INDEX) == 1  # once per step, not once per layer (the model has 2)
        hit = mon.snapshot()[(str(model.device), tw.SITE_READ_INDEX)]
        assert (hit.first_row, hit.first_value) == (inj.injected[0].position, inj.injected[0].value)
        assert [o.error for o in out] == [None] * len(PROMPTS), "a masked read must not fail any request"
        for i, (o, r) in enumerate(zip(out, ref, strict=True)):
            if i != victim:
                assert o.generated_tokens == r.generated_tokens, f"request {i} changed"
        assert _healthy(model.device)

    @pytest.mark.parametrize("value_kind", ["end", "far", "negative"])
    def test_write_fault_stops_the_engine_cleanly(self, engine, value_kind):
        model, ref, eng, mon, _, _graphs = engine
        tag = f"write-{value_kind}"
        out, inj = _serve(eng, mon, [Injection("write", 2, f"{tag}-2", value_kind)], tag)
        assert len(inj.injected) == 1
        assert _count(mon, tw.SITE_WRITE_INDEX) == 1
        # The engine's own failure path failed the batch with tripwire's error; nothing crashed.
        armed = _assert_stopped(eng, mon, out, tag)
        assert armed.first_value == inj.injected[0].value
        assert _healthy(model.device)
        # The stop is sticky until reset; after it, the same engine serves identical tokens again.
        mon.reset()
        again = eng.run(PROMPTS, tag=f"{tag}-after")
        assert [o.generated_tokens for o in again] == [r.generated_tokens for r in ref]

    def test_counted_once_per_step_not_per_layer(self, engine):
        """Control: validating the step's read index again in every decoder layer (what a validator inside each layer's
        attention call sees, before any masking) counts the one bad entry once per layer; the integration, validating
        once before the first layer, counts it once."""
        model, _ref, eng, mon, _, graphs = engine
        if graphs:
            pytest.skip("layer hooks do not run on graph replays; the eager configs run this control")
        layers = model.model.layers
        hi = tw._cache_groups(_cache(eng))[0].rows
        probe = Validator("per_layer", model.device, policy="flag", monitor=mon)
        probe.index("read", hi=hi)
        seen: list[torch.Tensor] = []

        def before_tripwire(mod, args, kwargs):  # runs before the integration's hook: the unmasked index
            seen[:] = [kwargs["read_index"][0].clone()] if kwargs.get("read_index") else []

        def in_layer(mod, args, kwargs):
            if seen and seen[0].numel():
                probe(read=seen[0])

        hooks = [model.register_forward_pre_hook(before_tripwire, with_kwargs=True, prepend=True)]
        hooks += [layer.register_forward_pre_hook(in_layer, with_kwargs=True) for layer in layers]
        try:
            out, inj = _serve(eng, mon, [Injection("read", 3, "layers-1", "far")], "layers")
        finally:
            for h in hooks:
                h.remove()
        assert len(inj.injected) == 1 and len(layers) == 2
        assert _count(mon, tw.SITE_READ_INDEX) == 1
        assert _count(mon, "per_layer.read") == len(layers)
        assert [o.error for o in out] == [None] * len(PROMPTS)

    def test_fuzz(self, engine):
        """Random fault kind, step, request, value and entry: every injected entry is counted exactly once at its site,
        reads never fail a request nor change another one, writes stop the engine cleanly, the device stays healthy."""
        model, ref, eng, mon, _, _graphs = engine
        rng = random.Random(1234)
        runs = 24
        for run in range(runs):
            kind = rng.choice(["read", "write"])
            step = rng.randrange(2, TOKENS - 2)
            victim = rng.randrange(len(PROMPTS))
            tag = f"fuzz{run}"
            inj = Injection(kind, step, f"{tag}-{victim}", rng.choice(["end", "far", "negative"]), rng.randrange(64))
            out, fi = _serve(eng, mon, [inj], tag)
            assert len(fi.injected) == 1, (run, inj)
            site = tw.SITE_READ_INDEX if kind == "read" else tw.SITE_WRITE_INDEX
            assert _count(mon, site) == 1, (run, inj, mon.snapshot())
            assert _healthy(model.device), (run, inj)
            if kind == "read":
                assert all(o.error is None for o in out), (run, inj)
                assert all(
                    o.generated_tokens == r.generated_tokens
                    for i, (o, r) in enumerate(zip(out, ref, strict=True))
                    if i != victim
                ), (run, inj)
            else:
                _assert_stopped(eng, mon, out, tag)
        mon.reset()

    # ---------------------------------------------------------------------------------------------- the block table
    def test_block_table_rules_on_the_real_cache(self, engine):
        """The decode fast path (a block table read by flash-attn's flash_attn_with_kvcache) needs flash-attn, which is
        not installable on these machines; the block-table rules are checked here on the engine's real cache, through the
        same pre-hook the engine calls, with a block table shaped like the engine's ([groups, batch, max blocks], -1
        padding)."""
        model, _ref, eng, mon, handle, _graphs = engine
        cache = _cache(eng)
        groups = tw._cache_groups(cache)
        pages = groups[0].pages
        assert pages is not None and groups[0].page_safe is not None and 0 <= groups[0].page_safe < pages
        table = torch.full((1, 4, 6), -1, dtype=torch.int32, device=model.device)
        table[0, :, :2] = torch.arange(8, dtype=torch.int32, device=model.device).reshape(4, 2) % pages
        table[0, 2, 1] = pages  # just past the end
        table[0, 3, 0] = -7  # negative, not the padding
        mon.reset()
        handle._pre_forward(model, (), {"cache": cache, "write_index": [], "read_index": [], "block_table": table})
        assert _count(mon, tw.SITE_BLOCK_TABLE) == 2
        assert int(table[0, 2, 1]) == groups[0].page_safe and int(table[0, 3, 0]) == groups[0].page_safe
        assert int((table == -1).sum()) == 4 * 4  # the padding columns are untouched
        mon.reset()


# ---------------------------------------------------------------------------------------------- containment
@pytest.fixture(scope="class", params=_configs())
def contained(request):
    """Like ``engine``, installed with ``contain=True`` on a monitor in ``raise`` mode (any uncontained hit stops)."""
    model, ref, eng, mon, handle = _installed(request.param, mode="raise", contain=True)
    yield model, ref, eng, mon, handle
    eng.close()
    handle.uninstall()
    mon.stop()


def _assert_contained(out, ref, victims, handle, site, tag, eng=None, rebuilds=None):
    """Exactly the victims failed, each with containment's error naming the site, in the step of the fault (the
    same-step verdict: none was handed back first); every other request is the clean run's; the engine goes on."""
    for i, (o, r) in enumerate(zip(out, ref, strict=True)):
        if i in victims:
            assert o is not None and o.error is not None, f"victim {i} was handed back as a success: an escape"
            assert "tripwire contained a masked fault" in o.error and site in o.error, o.error
            named = [t for rid, t in handle.contained if rid == f"{tag}-{i}"]
            assert len(named) == 1 and named[0].site == site
        else:
            assert o is not None and o.error is None, (i, o and o.error)
            assert o.generated_tokens == r.generated_tokens, f"request {i} changed"
    if eng is not None:
        assert eng.rebuilds == rebuilds, "containment must not end the engine's loop"


# Step 1 is the prefill (every prompt fits one batch), step 16 the last token's. The prefill has no past to read, so
# the engine passes it no read index: a read fault exists from step 2 on; a write fault at every step.
STEPS = list(range(1, TOKENS + 1))
READ_STEPS = STEPS[1:]


class TestContainment:
    @pytest.mark.parametrize("step", READ_STEPS)
    def test_a_read_fault_at_every_step_fails_only_its_request(self, contained, step):
        model, ref, eng, mon, handle = contained
        victim, tag = step % len(PROMPTS), f"cr{step}"
        rebuilds = eng.rebuilds
        out, inj = _serve(eng, mon, [Injection("read", step, f"{tag}-{victim}", "far", offset=step)], tag)
        assert [i.step for i in inj.injected] == [step]
        assert _count(mon, tw.SITE_READ_INDEX) == 1
        assert mon.armed is None, "an attributed hit must not arm the stop (raise mode)"
        _assert_contained(out, ref, {victim}, handle, tw.SITE_READ_INDEX, tag, eng, rebuilds)
        (offender,) = mon.snapshot()[(str(model.device), tw.SITE_READ_INDEX)].offenders
        assert offender.request == f"{tag}-{victim}", "offenders name the engine's request id"
        assert _healthy(model.device)

    @pytest.mark.parametrize("step", STEPS)
    def test_a_write_fault_at_every_step_fails_only_its_request(self, contained, step):
        """A masked write went to the trash slot: only its own request's token is missing, so under containment it
        fails that request alone (the site is fatal: without containment it stops, TestServing)."""
        model, ref, eng, mon, handle = contained
        victim, tag = (step + 3) % len(PROMPTS), f"cw{step}"
        rebuilds = eng.rebuilds
        out, inj = _serve(eng, mon, [Injection("write", step, f"{tag}-{victim}", "end", offset=step)], tag)
        assert [i.step for i in inj.injected] == [step]
        assert _count(mon, tw.SITE_WRITE_INDEX) == 1
        assert mon.armed is None
        _assert_contained(out, ref, {victim}, handle, tw.SITE_WRITE_INDEX, tag, eng, rebuilds)
        assert _healthy(model.device)

    @pytest.mark.parametrize(("step", "victim", "column"), [(2, 3, 0), (6, 5, 0), (TOKENS, 4, 1)])
    def test_a_bad_page_in_the_block_table_fails_only_its_request(self, contained, step, victim, column):
        """A bad page id in the engine's own block table: every read and write index the engine builds from that
        page is out of range (several entries, one request), each counted once, and only its request fails."""
        model, ref, eng, mon, handle = contained
        tag = f"cp{step}"
        rebuilds = eng.rebuilds
        out, inj = _serve(eng, mon, [Injection("page", step, f"{tag}-{victim}", "far", offset=column)], tag)
        (done,) = inj.injected
        assert done.step == step and done.entries["read"] >= 1
        assert _count(mon, tw.SITE_READ_INDEX) == done.entries["read"]
        assert _count(mon, tw.SITE_WRITE_INDEX) == done.entries["write"]
        # The request's error names its first taint: the write's where the page held the step's new token.
        site = tw.SITE_WRITE_INDEX if done.entries["write"] else tw.SITE_READ_INDEX
        _assert_contained(out, ref, {victim}, handle, site, tag, eng, rebuilds)
        assert mon.armed is None and _healthy(model.device)

    def test_several_victims_in_one_step(self, contained):
        _model, ref, eng, mon, _handle = contained
        tag, victims = "cs", {1, 4, 6}
        injections = [Injection("read", 7, f"{tag}-{v}", "negative", offset=v) for v in sorted(victims)]
        injections.append(Injection("write", 7, f"{tag}-4", "far"))
        rebuilds = eng.rebuilds
        out, inj = _serve(eng, mon, injections, tag)
        assert len(inj.injected) == len(injections) and {i.step for i in inj.injected} == {7}
        for i in (1, 6):
            assert tw.SITE_READ_INDEX in out[i].error
        assert tw.SITE_READ_INDEX in out[4].error or tw.SITE_WRITE_INDEX in out[4].error
        for i, (o, r) in enumerate(zip(out, ref, strict=True)):
            if i not in victims:
                assert o.error is None and o.generated_tokens == r.generated_tokens, i
        assert mon.armed is None and eng.rebuilds == rebuilds

    def test_more_than_k_offenders_in_one_step_fail_that_step_and_later_faults_are_attributed_again(self, contained):
        """Nine distinct bad entries in one step (K = 8 kept): the ninth may name another request, so every request
        of that step fails (fail closed) and the engine goes on; the next run's single fault fails only its victim,
        because the verdict consumed the step's offenders."""
        _model, ref, eng, mon, handle = contained
        assert mon.settings.offenders == 8
        injections = [Injection("read", 6, f"ck-{r}", "far", offset=o) for r in (0, 2, 4) for o in (0, 1, 2)]
        rebuilds = eng.rebuilds
        out, inj = _serve(eng, mon, injections, "ck")
        assert len(inj.injected) == 9 and _count(mon, tw.SITE_READ_INDEX) == 9
        assert all(o.error is not None and "tripwire contained" in o.error for o in out)
        assert mon.armed is None and eng.rebuilds == rebuilds
        out, _ = _serve(eng, mon, [Injection("read", 9, "ca-5", "far", offset=3)], "ca")
        _assert_contained(out, ref, {5}, handle, tw.SITE_READ_INDEX, "ca", eng, rebuilds)


@pytest.mark.parametrize("graphs", _configs())
def test_a_last_step_read_fault_is_served_masked_without_containment(graphs):
    """The control of TestContainment's last-step read: without containment (``mask``) the verdict marks the victim
    (kept out of the prefix cache) but the request is handed back as a success with its masked result, the very
    outcome containment's same-step verdict turns into an error (TestContainment fails it in its own step)."""
    _model, _ref, eng, mon, handle = _installed(graphs, attribute=True)
    try:
        out, inj = _serve(eng, mon, [Injection("read", TOKENS, "ce-2", "far", offset=5)], "ce")
        assert [i.step for i in inj.injected] == [TOKENS]
        assert _count(mon, tw.SITE_READ_INDEX) == 1
        assert out[2].error is None, "the control must show the masked result served as a success"
        assert handle.contained == [] and mon.armed is None and mon.contain is False
    finally:
        eng.close()
        handle.uninstall()
        mon.stop()


# ---------------------------------------------------------------------------------------------- shared state
def _hashed_blocks(cache) -> int:
    """Blocks the engine's prefix cache holds by content hash (what a later request with the same tokens adopts)."""
    allocators = getattr(cache, "cache_allocators", None)
    if allocators is not None:  # 5.18+
        return sum(len(a.ledger.hash_to_block) for a in allocators.values())
    return len(cache._block_manager._hash_to_id)  # 5.17


@pytest.mark.parametrize("contain", [False, True], ids=["mask", "contain"])
def test_a_victims_blocks_never_enter_the_prefix_cache(contain):
    """A masked read's victim completes its first block (prompt + generated tokens) with KV computed from a masked
    read; the prefix cache registers completed blocks by their TOKENS, so a later request with the same prompt would
    adopt that block (the engine's de-duplication) and read the masked KV. Every request's first block completes in
    this run: the victim's must not be registered, and the same prompts served again must equal the clean run.
    Control (under mask): the integration's keep-out switched off, as when nothing marks the victim before its block
    completes: its block is registered like the others. (Without attribution, ``attribute=False``, a step's hit
    taints every request of the step: fail closed.)"""
    graphs = HAS_CUDA
    injection = Injection("read", 6, "pc-0", "far", offset=2)
    hashed = {}
    for keep_out in (False, True):
        if contain and not keep_out:
            continue
        _model, ref, eng, mon, handle = _installed(graphs, contain=contain, attribute=True)
        if not keep_out:
            # The control: the handle never keeps a block out (the faulty behaviour the verdict's marking prevents).
            handle._keeps_out = lambda state: False
        try:
            _serve(eng, mon, [], "pc-clean")
            clean = _hashed_blocks(_cache(eng))
            eng.close()
            out, inj = _serve(eng, mon, [injection], "pc")
            assert len(inj.injected) == 1
            hashed[keep_out] = (clean, _hashed_blocks(_cache(eng)))
            again = eng.run(PROMPTS, tag="pc-again")
            changed = [
                i for i, (o, r) in enumerate(zip(again, ref, strict=True)) if o.generated_tokens != r.generated_tokens
            ]
            assert (out[0].error is not None) == contain
            hashed[keep_out] += (changed,)
        finally:
            eng.close()
            handle.uninstall()
            mon.stop()
    if not contain:
        clean, control, changed = hashed[False]
        assert control == clean, "the control: the victim's block registered like every other request's"
        assert changed == [0], "the control: the same prompt served again adopted the victim's block"
    clean, fixed, changed = hashed[True]
    assert fixed == clean - 1, f"the victim's first block must stay out of the prefix cache ({fixed} of {clean})"
    assert changed == [], f"requests {changed} changed after the victim"


# ---------------------------------------------------------------------------------------------- MLA (5.25)
def _tiny_mla(device: str):
    """A random-initialised DeepSeek-V3-shaped model small enough for the CPU: MLA attention (two cached latents per
    token), dense MLPs only."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=2,
        max_position_embeddings=512,
    )
    return DeepseekV3ForCausalLM(cfg).eval().to(device)


def test_an_mla_cache_is_bounded_and_a_read_fault_contained():
    """From 5.25 an MLA model's cache is carved by its own allocator (MLACacheAllocator: one row per token holding its
    two latents, no ``_kv_token_views``); its bounds are read from its latent views, a clean run is unchanged and a
    read fault fails only its request."""
    allocators = pytest.importorskip("transformers.generation.continuous_batching.cache_allocators")
    if not hasattr(allocators, "MLACacheAllocator"):
        pytest.skip("this transformers has no MLA cache allocator (5.25+)")
    model = _tiny_mla("cuda" if HAS_CUDA else "cpu")
    ref_engine = PersistentEngine(model, TOKENS, cb_config())
    ref = ref_engine.run(PROMPTS, tag="ref")
    ref_engine.close()
    mon = Monitor(interval=0.005, report_every=0.5, mode="raise")
    handle = tw.install(model, monitor=mon, contain=True)
    eng = PersistentEngine(model, TOKENS, cb_config())
    try:
        clean, _ = _serve(eng, mon, [], "mla-clean")
        assert [o.generated_tokens for o in clean] == [r.generated_tokens for r in ref] and mon.snapshot() == {}
        cache = _cache(eng)
        (alloc,) = cache.cache_allocators.values()
        assert type(alloc).__name__ == "MLACacheAllocator"
        (group,) = tw._cache_groups(cache)
        assert group.rows == min(int(t.shape[0]) for kv in alloc._latent_token_views.values() for t in kv)
        assert group.pages is None  # no page views: MLA has no block-table path
        out, inj = _serve(eng, mon, [Injection("read", 3, "mla-5", "far", offset=1)], "mla")
        assert len(inj.injected) == 1 and _count(mon, tw.SITE_READ_INDEX) == 1
        _assert_contained(out, ref, {5}, handle, tw.SITE_READ_INDEX, "mla")
    finally:
        eng.close()
        handle.uninstall()
        mon.stop()


# ---------------------------------------------------------------------------------------------- controls
_CONTROL = textwrap.dedent(
    """
    import logging, sys, torch
    from tripwire.testing.transformers_engine import PROMPTS, FaultInjector, Injection, PersistentEngine, cb_config, tiny_llama
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    device, graphs, kind = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    model = tiny_llama(device)
    eng = PersistentEngine(model, 16, cb_config(cuda_graphs=graphs))
    inj = FaultInjector([Injection(kind, 3, "c-1", "far")])
    try:
        with inj.active():
            out = eng.run(PROMPTS, tag="c", timeout=60)
        failed = sum(1 for o in out if o is None or o.error is not None)
    except Exception as e:  # a poisoned context can fail the engine's own shutdown (its empty_cache) too
        print("RUN_RAISED", type(e).__name__)
        failed = len(PROMPTS)
    print("INJECTED", len(inj.injected), "FAILED", failed, "OF", len(PROMPTS))
    try:
        x = torch.ones(4, device=device) * 2
        if device == "cuda":
            torch.cuda.synchronize()
        print("LATER_CUDA_CALL", "ok" if float(x.sum()) == 8.0 else "wrong")
    except Exception as e:
        print("LATER_CUDA_CALL", "failed", type(e).__name__)
    sys.exit(0)
    """
)


def _control(kind: str, graphs: bool) -> str:
    device = "cuda" if HAS_CUDA else "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", _CONTROL, device, "1" if graphs else "0", kind],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("kind", ["read", "write"])
def test_control_without_tripwire_the_engine_dies(kind):
    """The same one-entry fault, no integration: every request fails (on a GPU the context is poisoned too)."""
    out = _control(kind, graphs=False)
    assert "INJECTED 1" in out, out[-3000:]
    assert f"FAILED {len(PROMPTS)} OF {len(PROMPTS)}" in out, out[-3000:]
    if HAS_CUDA:
        assert "LATER_CUDA_CALL failed" in out, out[-3000:]


@pytest.mark.gpu
def test_control_without_tripwire_cuda_graphs_dies():
    out = _control("read", graphs=True)
    assert "INJECTED 1" in out and f"FAILED {len(PROMPTS)} OF {len(PROMPTS)}" in out, out[-3000:]
    assert "LATER_CUDA_CALL failed" in out, out[-3000:]


# ---------------------------------------------------------------------------------------------- install / uninstall
def test_install_uninstall_restores_exactly(monkeypatch):
    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchingManager,
        ContinuousBatchProcessor,
    )

    step = ContinuousBatchProcessor.__dict__["_generation_step"]
    prepare = ContinuousBatchProcessor.__dict__["prepare_next_batch"]
    loop = ContinuousBatchingManager.__dict__["_run_generation_loop"]
    model = tiny_llama("cpu")
    other = tiny_llama("cpu", seed=1)
    mon = Monitor()
    h1 = tw.install(model, monitor=mon)
    h2 = tw.install(other, monitor=mon)
    assert ContinuousBatchProcessor.__dict__["_generation_step"] is not step
    # The verdict is the one containment path: nothing hooks the building of the next batch.
    assert ContinuousBatchProcessor.__dict__["prepare_next_batch"] is prepare
    assert len(model._forward_pre_hooks) == 1
    with pytest.raises(RuntimeError, match="already installed"):
        tw.install(model, monitor=mon)
    h1.uninstall()
    assert len(model._forward_pre_hooks) == 0
    assert ContinuousBatchProcessor.__dict__["_generation_step"] is not step  # `other` is still installed
    h2.uninstall()
    h2.uninstall()  # idempotent
    assert ContinuousBatchProcessor.__dict__["_generation_step"] is step
    assert ContinuousBatchingManager.__dict__["_run_generation_loop"] is loop
    assert not h1.installed and not h2.installed


def test_install_refuses_bad_input(monkeypatch):
    model = tiny_llama("cpu")
    with pytest.raises(TypeError, match="can run continuous batching"):
        tw.install(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="LlamaModel"):
        tw.install(model.model)  # the bare decoder has no generate_batch
    with pytest.raises(ValueError, match="policy='drop'"):
        tw.install(model, policy="drop")
    # The version install() reads is the running transformers' own: ``__version__`` of the module an import gives
    # now (building a model can leave another module object in sys.modules than the one this file imported), set
    # here as a release outside SUPPORTED would have it; the good ones are the control.
    import transformers as running

    for bad in ("5.16.1", "5.26.0", "4.57.0", "6.0.0"):
        monkeypatch.setattr(running, "__version__", bad)
        with pytest.raises(RuntimeError, match=f"transformers {bad}"):
            tw.install(model)
    for good in ("5.17.0", "5.24.0", "5.25.0", "5.25.1.dev0"):
        monkeypatch.setattr(running, "__version__", good)
        tw.install(model, monitor=Monitor()).uninstall()
    for gone in (False, True):
        with pytest.raises(TypeError, match=rf"install\(verdicts={gone}\): the verdicts keyword is gone.*contain=True"):
            tw.install(model, monitor=Monitor(), verdicts=gone)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['polcy'\]"):
        tw.install(model, monitor=Monitor(), polcy="mask")
    assert len(model._forward_pre_hooks) == 0  # nothing was installed by a refused call


def test_install_contain_switches_the_monitors_one_setting():
    """``install(contain=True)`` switches containment on through the monitor's one call (``Monitor.set_contain``):
    the monitor reads ``contain`` True. Control: ``install()`` leaves a fresh monitor's setting off."""
    for contain in (False, True):
        model = tiny_llama("cpu")
        mon = Monitor()
        assert mon.contain is False
        h = tw.install(model, monitor=mon, contain=contain)
        try:
            assert mon.contain is contain
        finally:
            h.uninstall()


def test_an_ordinary_forward_is_not_touched():
    model = tiny_llama("cpu")
    mon = Monitor()
    h = tw.install(model, monitor=mon)
    try:
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            a = model(ids).logits
        h.uninstall()
        with torch.no_grad():
            b = model(ids).logits
        assert torch.equal(a, b)
        assert mon.snapshot() == {}
    finally:
        h.uninstall()


def test_default_monitor_path():
    """install() without a monitor uses the default one (prealloc at install, sites in the default registry)."""
    model = tiny_llama("cpu")
    h = tw.install(model)
    try:
        assert h.monitor is tripwire.default_monitor()
        assert tripwire.default_monitor().arena.get(torch.device("cpu")) is not None
    finally:
        h.uninstall()


# ---------------------------------------------------------------------------------------------- the unwritten slot
def _per_layer_cache(cache):
    if getattr(cache, "cache_allocators", None) is not None:
        pytest.skip("5.18+ builds its cache as zeros itself; the uninitialised per-layer cache is 5.17's (CI's venv)")
    return cache


@pytest.mark.parametrize("graphs", _configs())
def test_a_contained_write_needs_a_cache_without_nans(graphs):
    """The channel by which a contained write changed every other request on 5.17: the masked write leaves its slot
    unwritten, its request reads that slot into the step's packed attention, and a NaN there (uninitialised memory)
    times the other queries' zero softmax weights is NaN in every request. The control re-creates it (NaN in every
    slot but the read trash, after tripwire zeroed the cache): the other requests change; zeroed, they are the clean run's
    (TestContainment's write tests)."""
    _model, ref, eng, mon, handle = _installed(graphs, mode="raise", contain=True)
    try:
        cache = _per_layer_cache(_cache(eng))
        assert all(bool(torch.isfinite(t).all()) for t in (*cache.key_cache, *cache.value_cache)), "zeroed when built"
        bs, trash = int(cache.block_size), int(cache.read_trash_index)
        for t in (*cache.key_cache, *cache.value_cache):
            t[:trash].fill_(float("nan"))
            t[trash + bs :].fill_(float("nan"))
        out, _inj = _serve(eng, mon, [Injection("write", 3, "cn-1", "end")], "cn")
        assert out[1].error is not None and tw.SITE_WRITE_INDEX in out[1].error
        changed = [
            i
            for i, (o, r) in enumerate(zip(out, ref, strict=True))
            if i != 1 and o.generated_tokens != r.generated_tokens
        ]
        assert changed, "a NaN in the unwritten slot must reach the other requests (the channel the zeroing closes)"
    finally:
        eng.close()
        handle.uninstall()
        mon.stop()


def test_a_cache_built_before_install_keeps_the_write_stop():
    """A 5.17 cache built before tripwire was installed was not zeroed: a masked write cannot be contained there,
    so under containment the write site still stops (the step's requests fail with tripwire's error)."""
    model = tiny_llama("cuda" if HAS_CUDA else "cpu")
    eng = PersistentEngine(model, TOKENS, cb_config())
    # The engine's generation thread is not a daemon: every exit of this test (its skip on 5.18+ included) closes
    # it, or the interpreter waits for it forever at exit.
    try:
        ref = eng.run(PROMPTS, tag="ref")  # the engine and its cache exist before install
        _per_layer_cache(eng.manager.batch_processor.cache)
        mon = Monitor(interval=0.005, report_every=0.5, mode="raise", contain=True)
        handle = tw.install(model, monitor=mon, contain=True)
        try:
            out, _inj = _serve(eng, mon, [Injection("write", 3, "cb-1", "end")], "cb")
            _assert_stopped(eng, mon, out, "cb")
            assert ref[0].error is None
        finally:
            handle.uninstall()
            mon.stop()
    finally:
        eng.close()
