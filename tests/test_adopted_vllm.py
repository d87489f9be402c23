"""vLLM's own kernels guarded by following the docs (benchmarks/adopted_vllm): against a torch reference, exact
counts (once per bad entry: across token splits that cut a page, head programs and tile programs), requests,
masking; against vLLM's originals on clean input, taken from the installed vLLM (adopted_vllm.compare, run in the
vLLM environment: CI's /opt/venv-vllm; without one it skips, and fails under CI=true); on the GPU also graph replays
and the CUDA reshape_and_cache extension (against vLLM's compiled op where a GPU vLLM is installed). The originals'
out-of-range accesses themselves (the control) are shown by compute-sanitizer (scripts/memcheck.py --kernels
adopted.*), not here: on the CPU they would read and write outside their tensors."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "integrations"))

from adopted_vllm import HERE as ADOPTED
from adopted_vllm import NoVllm, load
from tripwire.kernels import counters
from tripwire.layout import VALUE_MAX, VALUE_MIN
from vllm_helpers import python_in_vllm_env

BENCH = ADOPTED.parent


@pytest.fixture
def gpu_capability(monkeypatch, kernel_device):
    # vLLM's reshape launcher asks the device's capability; on the CPU (interpreter) answer for an H200.
    if kernel_device == "cpu":
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))


def _decode_ref(q, kb, vb, table, lens, num_pages, scale):  # type: ignore[no-untyped-def]
    """Attention over each sequence's in-range tokens (a bad page's tokens take no weight; none left: zeros)."""
    B, Hq, D = q.shape
    Hkv, PS = kb.shape[2], kb.shape[1]
    out = torch.zeros(B, Hq, D)
    for b in range(B):
        L = int(lens[b])
        if L < 0 or L > table.shape[1] * PS:
            continue
        toks = torch.arange(L)
        pages = table[b, toks // PS].long()
        ok = (pages >= 0) & (pages < num_pages)
        k = kb[pages.clamp(0, num_pages - 1), toks % PS].float()
        v = vb[pages.clamp(0, num_pages - 1), toks % PS].float()
        for h in range(Hq):
            s = (k[:, h // (Hq // Hkv)] @ q[b, h].float()) * scale
            s = torch.where(ok, s, float("-inf"))
            if ok.any():
                out[b, h] = torch.softmax(s, 0) @ v[:, h // (Hq // Hkv)]
    return out


def _decode(mod, q, kb, vb, table, lens, splits, **kw):  # type: ignore[no-untyped-def]
    B, Hq, D = q.shape
    o = torch.empty(B, Hq, D, device=q.device)
    lse = torch.empty(B, Hq, device=q.device)
    logits = torch.empty(B, Hq, splits, D + 1, device=q.device)
    mod.decode_attention_fwd(q, kb, vb, o, lse, table, lens, logits, splits, 0.3, kb.shape[1], **kw)
    return o


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_decode_attention_counts_each_bad_entry_once(make_monitor, hit_of, kernel_device, kv_heads):
    """Token splits of 10 tokens over pages of 4: page 2 of sequence 0 (tokens 8-11) is read by splits 0 and 1 and
    counts once; a bad length counts once and masks its sequence; a bad id past a sequence's length is padding
    (never read, not counted). The output is attention over the remaining tokens, finite; the offenders carry
    their sequences' requests."""
    mon = make_monitor(offenders=8)
    guard = load("guarded", "triton_decode_attention")
    dev, P, PS, W, S, D = kernel_device, 20, 4, 8, 3, 32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 4, D, generator=g).to(dev)
    kb, vb = (torch.randn(P, PS, kv_heads, D, generator=g).to(dev) for _ in range(2))
    table = torch.randint(0, P, (4, W), generator=g, dtype=torch.int32).to(dev)
    lens = torch.tensor([30, 17, 9, 12], dtype=torch.int32, device=dev)
    ctr = counters(guard.SITES, dev, mon)
    # On a GPU the grouped kernel's tl.dot runs in TF32 (10-bit mantissa): its error, not the masking's, sets the
    # bound there; a bad page's tokens left in would move outputs by O(0.1).
    tol = 1e-2 if q.is_cuda else 1e-4
    clean = _decode(guard, q, kb, vb, table, lens, S, ctr=ctr)
    ref = _decode_ref(q.cpu(), kb.cpu(), vb.cpu(), table.cpu(), lens.cpu(), P, 0.3)
    torch.testing.assert_close(clean.cpu(), ref, rtol=tol, atol=tol)
    assert ctr[:, 0].tolist() == [0, 0]
    table[0, 2] = 99  # tokens 8..11: split 0 is [0, 10), split 1 [10, 20): the page straddles them
    assert (2 * PS < 10 < 3 * PS) and -(-30 // S) == 10
    table[1, 1] = -3
    table[2, 5] = 1000  # past sequence 2's 9 tokens: padding
    lens[3] = 10_000  # past the table's 32 tokens
    req = torch.tensor([100, 101, 102, 103], dtype=torch.int64, device=dev)
    out = _decode(guard, q, kb, vb, table, lens, S, ctr=ctr, requests=req)
    page, length = hit_of(mon, guard.SITE_PAGE.name), hit_of(mon, guard.SITE_LEN.name)
    assert page.count == 2 and sorted(tuple(o) for o in page.offenders) == [(0, 99, 100), (1, -3, 101)]
    assert length.count == 1 and tuple(length.offenders[0]) == (3, 10_000, 103)
    assert torch.isfinite(out).all()
    ref = _decode_ref(q.cpu(), kb.cpu(), vb.cpu(), table.cpu(), lens.cpu(), P, 0.3)
    torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol)


def _reshape(mod, k, v, slots, nb, **kw):  # type: ignore[no-untyped-def]
    kc = torch.zeros(nb, 4, k.shape[1], k.shape[2], device=k.device)
    vc = torch.zeros_like(kc)
    one = torch.ones(1, device=k.device)
    mod.triton_reshape_and_cache_flash(k, v, kc, vc, slots, "auto", one, one, **kw)
    return kc, vc


def test_reshape_and_cache_masks_and_counts_bad_slots(make_monitor, hit_of, kernel_device, gpu_capability):
    """Padding (-1) is skipped and not counted; other negative slots and slots past the cache write nothing and
    count once per token (not per tile program: 4 tiles here), at a fatal site, with the token's request."""
    mon = make_monitor(offenders=8)
    guard = load("guarded", "triton_reshape_and_cache_flash")
    dev, T, H, D, NB = kernel_device, 6, 4, 32, 4
    k, v = torch.randn(T, H, D, device=dev), torch.randn(T, H, D, device=dev)
    ctr = mon.counter(
        mon.registry.register(guard.SITE_SLOT.name, fatal=True, description=guard.SITE_SLOT.description), dev
    )
    clean = torch.tensor([0, 5, -1, 15, 3, 7], device=dev)
    for got, src in zip(_reshape(guard, k, v, clean, NB, ctr=ctr), (k, v), strict=True):
        assert torch.equal(got.reshape(-1, H, D).cpu(), _cache_ref(src, clean, NB * 4))
    assert int(ctr[0]) == 0
    bad = torch.tensor([0, 16, -1, -5, 3, 7], device=dev)
    kc, vc = _reshape(guard, k, v, bad, NB, ctr=ctr, requests=torch.arange(10, 16, device=dev))
    hit = hit_of(mon, guard.SITE_SLOT.name)
    assert hit.count == 2 and sorted(tuple(o) for o in hit.offenders) == [(1, 16, 11), (3, -5, 13)]
    assert torch.equal(kc.reshape(-1, H, D).cpu(), _cache_ref(k, bad, NB * 4))
    assert torch.equal(vc.reshape(-1, H, D).cpu(), _cache_ref(v, bad, NB * 4))


def _cache_ref(src: torch.Tensor, slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The cache (flat: [slots, heads, dim], zeros first) after writing each token's row to its slot, where that slot
    is in range."""
    ref = torch.zeros(num_slots, *src.shape[1:], dtype=src.dtype)
    for t, s in enumerate(slots.tolist()):
        if 0 <= s < num_slots:
            ref[s] = src[t].cpu()
    return ref


@pytest.mark.slow
def test_guarded_matches_vllms_original_on_clean_input():
    """vLLM's own decode attention (GQA, MHA) and reshape_and_cache_flash, as the installed vLLM ships them, against
    the guarded copies on clean input: the same outputs (reshape bit for bit), in the vLLM environment under Triton's
    interpreter (adopted_vllm.compare). The control: the guarded side given one other page id and one other slot
    (both in range): every case disagrees, so the agreement is a measurement."""
    runs = {}
    for control in (False, True):
        code = (
            f"import sys; sys.path.insert(0, {str(BENCH)!r}); from adopted_vllm.compare import main; "
            f"sys.exit(main({['--control'] if control else []!r}))"
        )
        p = python_in_vllm_env(code, env={"TRITON_INTERPRET": "1"}, timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        runs[control] = json.loads(p.stdout.strip().splitlines()[-1])
    clean, control = runs[False], runs[True]
    assert set(clean["cases"]) == {"decode_gqa", "decode_mha", "reshape_triton"}
    assert all(c["agree"] for c in clean["cases"].values()), clean
    assert not any(c["agree"] for c in control["cases"].values()), control
    for name, src in clean["source"].items():
        # vLLM's own file of the installed release, not a copy of ours.
        assert src["module"] == f"vllm.v1.attention.ops.{name}" and "site-packages" in src["file"], src
        assert src["vllm"], src


def test_original_needs_an_installed_vllm():
    """Without vLLM, load("original") names what to install (NoVllm, an ImportError); load("guarded") loads with no
    vLLM, and leaves no vLLM module behind (its few vLLM names are the shim's, put back after). The control: a vLLM
    module put into sys.modules while a guarded copy loads comes back unchanged."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the original loads (test_guarded_matches_vllms_original_on_clean_input)")
    for name in ("triton_decode_attention", "triton_reshape_and_cache_flash"):
        with pytest.raises(NoVllm, match="pip install vllm"):
            load("original", name)
        with pytest.raises(ImportError, match="none is installed"):
            load("original", name, copy=2)
    load("guarded", "triton_reshape_and_cache_flash", copy=3)  # a fresh import of our copy, through the shim
    assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules), [m for m in sys.modules if "vllm" in m]
    import types

    from adopted_vllm import _shim

    mine = types.ModuleType("vllm.platforms")
    sys.modules["vllm.platforms"] = mine
    try:
        with _shim.installed():
            assert sys.modules["vllm.platforms"] is not mine  # the shim, while a guarded copy imports
        assert sys.modules["vllm.platforms"] is mine
    finally:
        sys.modules.pop("vllm.platforms")
    assert "vllm" not in sys.modules


@pytest.mark.gpu
def test_gpu_graph_replay_counts_n_times(make_monitor, hit_of, captured):
    """Captured in a CUDA graph and replayed N times, the guarded decode attention counts N x the bad entries."""
    mon = make_monitor(offenders=8)
    mon.prealloc("cuda")
    guard = load("guarded", "triton_decode_attention")
    q = torch.randn(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    kb, vb = (torch.randn(8 * 16, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.arange(8 * 16, dtype=torch.int32, device="cuda").reshape(8, 16)
    table[2, 3], table[5, 0] = 10_000, -1
    lens = torch.full((8,), 200, dtype=torch.int32, device="cuda")
    ctr = counters(guard.SITES, "cuda", mon)
    # The scales made before the capture, as an engine passes them: without them vLLM's launcher builds a tensor
    # from a Python float (a host-to-device copy, which a capture refuses).
    one = torch.ones((), device="cuda")
    graph = captured(lambda: _decode(guard, q, kb, vb, table, lens, 8, ctr=ctr, k_scale=one, v_scale=one), mon)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    assert hit_of(mon, guard.SITE_PAGE.name).count == 5 * 2


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [True, "first", "late", "vote"], ids=["guarded", "first", "late", "vote_control"])
def test_gpu_cuda_reshape_and_cache(make_monitor, hit_of, variant):
    """The CUDA extension: the guarded copy (as launched, and at each test placement forced) writes each token's row
    to its slot on clean slots, as vLLM's compiled kernel does where a GPU vLLM is installed; with bad ones the
    guarded copy (and the vote control) skip them and count once per token, with requests."""
    from adopted_vllm import cuda_ext

    cuda_ext.build()
    mon = make_monitor(offenders=8)
    mon.prealloc("cuda")
    T, H, D, NB = 64, 8, 128, 8
    k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = torch.randperm(NB * 16, device="cuda")[:T]
    one = torch.ones(1, device="cuda")
    ctr = mon.counter(
        mon.registry.register(cuda_ext.SITE.name, fatal=True, description=cuda_ext.SITE.description), "cuda"
    )

    def run(guard, s, **kw):  # type: ignore[no-untyped-def]
        kc, vc = (torch.zeros(NB, 16, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cuda_ext.reshape_and_cache_flash(k, v, kc, vc, s, one, one, guard=guard, **kw)
        return kc, vc

    clean = run(variant, slots, ctr=ctr)
    for got, src in zip(clean, (k, v), strict=True):
        assert torch.equal(got.reshape(-1, H, D).cpu(), _cache_ref(src, slots, NB * 16))
    try:
        vllms = run(False, slots)
    except NoVllm:
        vllms = None  # no GPU build of vLLM here: the torch reference above is the check
    if vllms is not None:
        for a, b in zip(vllms, clean, strict=True):
            assert torch.equal(a, b)
    bad = slots.clone()
    # Padding, one past the cache, a negative slot, and the int64 extremes (the guarded copy's one unsigned compare
    # must take both ends for bad); offenders keep saturated values.
    bad[3], bad[10], bad[20], bad[30], bad[31] = -1, NB * 16 + 3, -7, -(2**63), 2**63 - 1
    kc, vc = run(variant, bad, ctr=ctr, requests=torch.arange(100, 164, device="cuda"))
    torch.cuda.synchronize()
    hit = hit_of(mon, cuda_ext.SITE.name)
    assert hit.count == 4
    assert sorted(tuple(o) for o in hit.offenders) == [
        (10, NB * 16 + 3, 110),
        (20, -7, 120),
        (30, VALUE_MIN, 130),
        (31, VALUE_MAX, 131),
    ]
    assert torch.equal(kc.reshape(-1, H, D).cpu(), _cache_ref(k, bad, NB * 16))
    assert torch.equal(vc.reshape(-1, H, D).cpu(), _cache_ref(v, bad, NB * 16))


@pytest.mark.gpu
def test_gpu_cuda_reshape_picks_the_test_by_waves():
    """The guarded CUDA copy tests the slot first when the grid is one wave and after the index arithmetic over
    several (guarded/cache_kernels.cuh, TW_FIRST): the kernels the profiler sees, at 64 tokens and at one token more
    than 3 blocks per SM fit. The control: "first" forced at the large grid runs the first-test kernel there."""
    from torch.profiler import ProfilerActivity, profile

    from adopted_vllm import cuda_ext

    cuda_ext.build()
    one = torch.ones(1, device="cuda")
    ctr = torch.zeros(8, dtype=torch.int64, device="cuda")
    many = 3 * torch.cuda.get_device_properties(0).multi_processor_count + 1

    def launched(tokens: int, guard) -> list[str]:  # type: ignore[no-untyped-def]
        k = torch.randn(tokens, 8, 128, device="cuda", dtype=torch.bfloat16)
        kc = torch.zeros(-(-tokens // 16), 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        slots = torch.arange(tokens, device="cuda")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            cuda_ext.reshape_and_cache_flash(k, k, kc, kc.clone(), slots, one, one, guard=guard, ctr=ctr)
            torch.cuda.synchronize()
        return [cuda_ext.variant_of(e.key) for e in prof.key_averages() if "reshape_and_cache_flash" in e.key]

    assert launched(64, True) == ["guarded_first"]
    assert launched(many - 1, True) == ["guarded_first"]  # the largest grid of one wave
    assert launched(many, True) == ["guarded_late"]
    assert launched(many, "first") == ["guarded_first"]
    assert int(ctr[0]) == 0


def test_load_copy_is_the_same_code_loaded_again():
    """load(copy=i) imports the file again as a module of its own (the benchmark pools loads of each side's code):
    its kernels are other JITFunctions of the same Python functions, its sites the same rows. The control: the same
    copy asked twice is one module."""
    a = load("guarded", "triton_reshape_and_cache_flash")
    b = load("guarded", "triton_reshape_and_cache_flash", copy=1)
    assert b is not a and load("guarded", "triton_reshape_and_cache_flash", copy=1) is b
    assert load("guarded", "triton_reshape_and_cache_flash", copy=0) is a
    ka, kb = a.reshape_and_cache_kernel_flash, b.reshape_and_cache_kernel_flash
    assert ka is not kb and ka.fn.__code__.co_code == kb.fn.__code__.co_code
    assert a.SITE_SLOT is b.SITE_SLOT
    for bad in (-1, 1.0, "1"):
        with pytest.raises(ValueError, match="copy must be an int"):
            load("original", "triton_decode_attention", copy=bad)


@pytest.mark.gpu
def test_gpu_cuda_ext_copy_is_a_second_load():
    """build(copy=1) maps a copy of the built library a second time (its kernels registered again, at other
    addresses) and writes what copy 0 writes. The control: importing that copy as a module, the ordinary way,
    gives back copy 0's module object (pybind11 keeps one per name), whose calls would launch copy 0's kernels."""
    from adopted_vllm import cuda_ext

    first, again, second = cuda_ext.build(), cuda_ext.build(copy=0), cuda_ext.build(copy=1)
    assert again is first and second is not first
    assert second.__file__ != first.__file__
    assert Path(second.__file__).read_bytes() == Path(first.__file__).read_bytes()
    with open("/proc/self/maps") as f:
        assert second.__file__ in f.read()  # mapped from its own file
    assert cuda_ext._import(Path(second.__file__)) is first  # the control
    k = torch.randn(32, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64, device="cuda")[:32]
    one = torch.ones(1, device="cuda")
    ctr = torch.zeros(8, dtype=torch.int64, device="cuda")
    out = []
    for copy in (0, 1):
        kc = torch.zeros(4, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        cuda_ext.reshape_and_cache_flash(k, k, kc, kc.clone(), slots, one, one, guard=True, ctr=ctr, copy=copy)
        out.append(kc)
    assert torch.equal(out[0], out[1]) and out[0].abs().sum() > 0
    assert int(ctr[0]) == 0
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):  # the copy's checks are the module's
        second.reshape_and_cache_flash(k, k, out[0], out[0], slots.int(), one, one, 1, ctr, None)
    with pytest.raises(ValueError, match="copy must be an int"):
        cuda_ext.build(copy=-1)


def test_cuda_ext_names_and_guards(monkeypatch):
    """The kernel names map to their variants (bench_adopted and the register rule classify by them: vLLM's, in
    vLLM's library, and the extension's), and a guard it does not know is refused before anything is built or
    launched; without a GPU vLLM, vLLM's kernel (guard=False) raises NoVllm, naming what to install."""
    from adopted_vllm import cuda_ext

    monkeypatch.setattr(cuda_ext, "build", lambda **kw: pytest.fail("built for a refused guard"))
    names = {
        "_ZN4vllm30reshape_and_cache_flash_kernelI13__nv_bfloat16S1_LNS_18Fp8KVCacheDataTypeE0EEEvPKT_": "original",
        "_ZN12vllm_guarded30reshape_and_cache_flash_kernelI13__nv_bfloat16S1_LNS_18Fp8KVCacheDataTypeE0ELb1EEEv": (
            "guarded_first"
        ),
        "_ZN12vllm_guarded30reshape_and_cache_flash_kernelI13__nv_bfloat16S1_LNS_18Fp8KVCacheDataTypeE0ELb0EEEv": (
            "guarded_late"
        ),
        "_ZN12vllm_guarded35reshape_and_cache_flash_kernel_voteI13__nv_bfloat16S1_LNS_18Fp8KVCacheDataTypeE0EEEv": (
            "vote"
        ),
    }
    demangled = "void vllm_guarded::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm_guarded::Fp8KVCacheDataType)0, {}>(...)"
    names[demangled.format("true")] = "guarded_first"
    names[demangled.format("false")] = "guarded_late"
    assert {n: cuda_ext.variant_of(n) for n in names} == names
    t = torch.zeros(1)
    for bad in (1, 0, "early", None):
        with pytest.raises(ValueError, match="guard must be one of"):
            cuda_ext.reshape_and_cache_flash(t, t, t, t, t, t, t, guard=bad)
    # vLLM's kernel matched among the instantiations in vLLM's library: the bf16 kAuto one only.
    vllms = [n for n in names if re.search(cuda_ext.VLLM_KERNEL_MATCH, n)]
    assert vllms == [next(iter(names))], vllms
    assert not re.search(
        cuda_ext.VLLM_KERNEL_MATCH,
        "_ZN4vllm30reshape_and_cache_flash_kernelIN3c104HalfES2_LNS_18Fp8KVCacheDataTypeE0EEEv",
    )
    assert not re.search(
        cuda_ext.VLLM_KERNEL_MATCH,
        "_ZN4vllm30reshape_and_cache_flash_kernelI13__nv_bfloat16hLNS_18Fp8KVCacheDataTypeE1EEEv",
    )
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(NoVllm, match="pip install vllm"):
            cuda_ext.reshape_and_cache_flash(t, t, t, t, t, t, t, guard=False)
