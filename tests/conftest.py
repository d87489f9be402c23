"""Test setup shared by every test module.

Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must be set before triton is imported, so it
is set here, at collection, and only when CUDA is absent (on the H200 the same tests compile and run on the GPU).

Fixtures:
* ``kernel_device``: where kernels run in this process: "cpu" under the interpreter, else "cuda".
* ``registry``/``monitor``: a private SiteRegistry and a Monitor on it, so tests never share counts or rows.
* ``make_monitor``: ``make_monitor(**settings)`` builds more such Monitors (``offenders=4``: K offenders per row),
  each on its own registry, stopped at the end of the test.
* ``hit_of``: ``hit_of(monitor, site_name)`` is the site's ``Hit`` from ``monitor.snapshot()`` (None when its count
  is 0), whatever device it is on.
* ``guard_row``: ``guard_row(row, hits, first=None)`` checks a guard counter row (a tensor or its 8 words) against
  the (row, value) hits a kernel should have recorded: the count, the extremes (values saturated like the kernels
  do), a first-offender pair that is one of the hits (or exactly ``first``), the spare slot 6 untouched (slot 7 is
  the offender block's address: layout, not checked here).
* ``captured``: ``captured(fn, monitor)`` runs ``fn`` once (compiles, loads), resets ``monitor``, captures ``fn`` in a
  CUDA graph and checks the capture counted nothing; returns the graph.
* ``triton_interpret``: ``triton_interpret(on)`` sets Triton's own setting of whether kernels run in its interpreter
  (``triton.knobs.runtime.interpret`` from Triton 3.4, else ``TRITON_INTERPRET``), put back at the end of the test;
  ``triton_interpret()`` reads it. tripwire reads it at each launch (the launchers' refusal of CPU tensors, the
  register budget's search), so a test can show what a compiling process does there without compiling anything;
  kernels already imported stay in the mode they were imported in.
* ``one_call_then_three(device, passes, **validator_kw)`` (a function): a validator's three rules in one launch or
  pass, counted by the caller into ``passes``; the control, three validators, three more.
* ``triton_launches()`` (a context manager): every Triton kernel launch made inside it, as ``(name, kwargs)``, seen
  where Triton itself sees a launch: on a GPU through a ``triton.knobs.runtime.launch_enter_hook`` (how a profiler
  counts launches; the hook is given the launch's metadata, not its arguments, so ``kwargs`` is ``{}``), under the
  interpreter (which calls no launch hook) at its ``InterpretedFunction.run`` (``kwargs``: the launch's keyword
  arguments, its constexprs among them).
* ``build_probe``: runs a script that compiles kernels ahead of time for a GPU target (no GPU needed) and prints one
  JSON line; returns it parsed, skipping the test when the script reports ``{"error": ...}`` (no bundled ptxas). The
  script may call ``sm90_usage(compiled, warps)`` (registers, shared memory, programs per SM). A script must let a
  kernel's own CompilationError escape (the run then fails): a kernel that does not compile is a failure, never a
  skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# pytester: tests/test_tripwire_pytest.py runs pytest sessions with tripwire's plugin.
pytest_plugins = ["pytester", "_thread_leaks"]

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def kernel_device() -> str:
    return "cpu" if INTERPRET or not HAS_CUDA else "cuda"


@pytest.fixture
def triton_interpret(monkeypatch):
    import triton

    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; older ones read the variable at each call

    def setting(on: bool | None = None) -> bool:
        if on is not None and knobs is not None:
            monkeypatch.setattr(knobs.runtime, "interpret", on)
        elif on is not None:
            monkeypatch.setenv("TRITON_INTERPRET", "1" if on else "0")
        return bool(knobs.runtime.interpret) if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"

    return setting


@pytest.fixture
def registry():
    from tripwire import SiteRegistry

    return SiteRegistry(capacity=64)


@pytest.fixture
def monitor(registry):
    from tripwire import Monitor

    m = Monitor(registry=registry, capacity=64, mode="warn", interval=0.01, report_every=10.0)
    yield m
    m.stop()


@pytest.fixture
def make_monitor():
    from tripwire import Monitor, SiteRegistry

    made = []

    def make(**settings):  # type: ignore[no-untyped-def]
        opts = dict(capacity=64, mode="warn", interval=0.01, report_every=10.0)
        opts.update(settings)
        m = Monitor(registry=SiteRegistry(capacity=opts["capacity"]), **opts)
        made.append(m)
        return m

    yield make
    for m in made:
        m.stop()


@pytest.fixture(scope="session")
def hit_of():
    def get(monitor, name):  # type: ignore[no-untyped-def]
        hits = [h for (_, site), h in monitor.snapshot().items() if site == name]
        assert len(hits) <= 1, f"{name} has counts on several devices: {hits}"
        return hits[0] if hits else None

    return get


# Given to every build probe: what a kernel compiled for sm_90 occupies (registers read back from its cubin).
_SM90_PRELUDE = r"""
def sm90_usage(compiled, warps):
    import os, re, subprocess, tempfile
    import triton
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    smem = compiled.metadata.shared
    # Programs per SM on an H100/H200 (sm_90): 64K registers (allocated per warp in units of 8 per thread),
    # 228 KiB of shared memory (plus 1 KiB reserved per block), 2048 threads.
    by_regs = 65536 // (warps * 32 * (-(-regs // 8) * 8))
    by_smem = 233472 // (smem + 1024)
    return {"regs": regs, "smem": smem, "programs_per_sm": min(by_regs, by_smem, 2048 // (warps * 32), 32)}
"""


def _cuda_tool(name: str) -> str | None:
    for base in filter(None, (os.environ.get("CUDA_HOME"), "/usr/local/cuda")):
        cand = Path(base) / "bin" / name
        if cand.is_file():
            return str(cand)
    return shutil.which(name)


@pytest.fixture(scope="session")
def cuda_tool():
    """The lookup of a CUDA toolkit program by name (nvcc, cuobjdump): CUDA_HOME's, /usr/local/cuda's, else the one
    on PATH; None where there is none (the tests that need it skip)."""
    return _cuda_tool


# The guarded copy of vLLM's CUDA reshape_and_cache_flash (benchmarks/adopted_vllm), the instantiation cuda_ext builds
# (bf16 K/V and cache): at both of its test placements, and the vote control.
_CUDA_ADOPTED = r"""
#include <cuda_bf16.h>
#include "vote_variant.cuh"
using T = __nv_bfloat16;
constexpr auto A = vllm_guarded::Fp8KVCacheDataType::kAuto;
#define GUARDED(FIRST) \
  template __global__ void vllm_guarded::reshape_and_cache_flash_kernel<T, T, A, FIRST>( \
      const T*, const T*, T*, T*, const int64_t*, int64_t, int64_t*, const int64_t*, int64_t, int64_t, int64_t, \
      int64_t, int64_t, int, int, int, const float*, const float*, int);
GUARDED(true)
GUARDED(false)
template __global__ void vllm_guarded::reshape_and_cache_flash_kernel_vote<T, T, A>(
    const T*, const T*, T*, T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int,
    const float*, const float*, int, int64_t*, const int64_t*, int64_t);
"""


@pytest.fixture(scope="session")
def adopted_cuda_usage(cuda_tool, tmp_path_factory):
    """The guarded copy of vLLM's CUDA reshape_and_cache_flash compiled for sm_90 with cuda_ext's flags and read back
    with cuobjdump (tripwire.resources.cuda_usage) at vLLM's launch of 512 threads per block: ``{variant: usage}``,
    variants named by ``cuda_ext.variant_of`` (guarded_first, guarded_late, vote), and ``original``, vLLM's kernel
    read from the installed GPU vLLM's library, where there is one (cuda_ext.vllm_library_path). Skips without
    nvcc."""
    nvcc = cuda_tool("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here")
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        from adopted_vllm import NoVllm, cuda_ext
    finally:
        sys.path.remove(str(bench))
    import tripwire
    from tripwire import resources as rs

    out = tmp_path_factory.mktemp("adopted_cuda")
    src, cubin = out / "adopted.cu", out / "adopted.cubin"
    src.write_text(_CUDA_ADOPTED)
    inc = ["-I", tripwire.include_dir(), "-I", str(bench / "adopted_vllm")]
    p = subprocess.run([nvcc, *cuda_ext.FLAGS, "-arch=sm_90", "-cubin", *inc, str(src), "-o", str(cubin)],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    usage = rs.cuda_usage(str(cubin), block_threads=512, match="reshape_and_cache_flash")
    found = {cuda_ext.variant_of(u.kernel): u for u in usage}
    assert len(found) == len(usage), [u.kernel for u in usage]  # one kernel per variant
    try:
        lib = cuda_ext.vllm_library_path()
    except NoVllm:
        return found
    (vllm_kernel,) = rs.cuda_usage(lib, block_threads=512, match=cuda_ext.VLLM_KERNEL_MATCH)
    found[cuda_ext.variant_of(vllm_kernel.kernel)] = vllm_kernel
    return found


@pytest.fixture
def build_probe(tmp_path):
    def run(source: str, timeout: float = 900, private_cache: bool = True) -> dict:
        # A file (@triton.jit reads its function's source) run without TRITON_INTERPRET: compiling needs the real
        # compiler, which the interpreter replaces in this process.
        probe = tmp_path / "build_probe.py"
        probe.write_text(_SM90_PRELUDE + source)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if private_cache:
            # Its own Triton cache: a probe that swaps one of tripwire's helpers (a control's fault path) compiles
            # the shipped kernel's cache key into other code (Triton keys a kernel by its helpers' source when first
            # hashed, not by what a module name holds at compile time), and that entry must never reach a cache a
            # later process reads (~/.triton: the user's own launches would run the control).
            env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
        p = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=env, timeout=timeout)
        assert p.returncode == 0, p.stderr[-2000:]
        r = json.loads(p.stdout.strip().splitlines()[-1])
        if "error" in r:
            pytest.skip(f"cannot compile for the GPU target here (no bundled ptxas?): {r['error']}")
        return r

    return run


@pytest.fixture(scope="session")
def guard_row():
    from tripwire.layout import VALUE_MAX, VALUE_MIN, decode, decode_neg

    def sat(v: int) -> int:
        return max(VALUE_MIN, min(VALUE_MAX, v))

    def check(row, hits, *, first=None) -> None:  # type: ignore[no-untyped-def]
        # Slot 7 is layout, not a count: an arena row's offender-block address (0 in a plain counter tensor).
        words = (row.cpu().tolist() if isinstance(row, torch.Tensor) else list(row))[:7]
        hits = [(sat(r), sat(v)) for r, v in hits]
        assert words[0] == len(hits), f"count {words[0]} != {len(hits)} expected hits {hits}"
        if not hits:
            assert words == [0] * 7, words
            return
        assert decode(words[1]) == max(r for r, _ in hits)
        assert decode(words[2]) == max(v for _, v in hits)
        assert decode_neg(words[3]) == min(v for _, v in hits)
        pair = (decode(words[4]), decode(words[5]))
        assert pair in set(hits), (pair, hits)
        if first is not None:
            assert pair == first, (pair, first)
        assert words[6] == 0

    return check


def offenders_recorded(ctr: torch.Tensor, n: int) -> None:
    """What a kernel's fault path does last on a CPU arena row (tripwire.layout): add ``n`` to its offender block's
    recorded-hits word, through the address in slot 7 (tests that write a row's words by hand)."""
    import ctypes

    from tripwire.layout import OFF_DONE, OFFENDERS

    addr = int(ctr[OFFENDERS])
    if addr:
        word = ctypes.c_int64.from_address(addr + OFF_DONE * 8)
        word.value += n


def one_call_then_three(device: str, passes: list, **validator_kw) -> None:
    """The one-launch design of a validator call, on whatever the caller counts into ``passes`` (one entry per launch
    of the kernel or per pass of the torch path): three rules of one validator are ONE entry; the control, the same
    rules as three validators, three more."""
    from tripwire import Monitor, SiteRegistry
    from tripwire.validate import Validator

    mon = Monitor(registry=SiteRegistry(capacity=16), capacity=16)
    v = Validator("one", device, monitor=mon, **validator_kw)
    v.index("a", hi=10, padding=-1)
    v.index("b", hi=10, safe=0, lengths="n")
    v.csr("c", indptr="p", hi=10, safe=0)
    t = torch.tensor([1, 2, 30], device=device)
    n, p = torch.tensor([3], device=device), torch.tensor([0, 3], device=device)
    v(a=t, b=t.reshape(1, 3).clone(), n=n, c=t.clone(), p=p)
    assert len(passes) == 1
    assert mon.snapshot()[(str(v.device), "one.a")].count == 1
    for name in ("x", "y", "z"):
        w = Validator("three", device, monitor=mon, **validator_kw)
        w.index(name, hi=10, padding=-1)
        w(**{name: t})
    assert len(passes) == 4


@contextlib.contextmanager
def triton_launches() -> Iterator[list[tuple[str, dict]]]:
    """Every Triton kernel launch inside the block (the module docstring says where each is seen)."""
    import triton

    seen: list[tuple[str, dict]] = []
    if INTERPRET:
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run

        def counted(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
            if not warmup:
                seen.append((self.__name__, dict(kwargs)))
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = counted  # type: ignore[method-assign]
        try:
            yield seen
        finally:
            InterpretedFunction.run = run  # type: ignore[method-assign]
        return

    def hook(metadata) -> None:  # type: ignore[no-untyped-def]
        seen.append((metadata.data["name"], {}))

    chain = triton.knobs.runtime.launch_enter_hook
    chain.add(hook)
    try:
        yield seen
    finally:
        chain.remove(hook)


@pytest.fixture
def captured():
    def capture(fn, monitor) -> torch.cuda.CUDAGraph:  # type: ignore[no-untyped-def]
        fn()  # compile / load outside the capture
        torch.cuda.synchronize()
        monitor.reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        rows = monitor.read_rows("cuda")
        assert int(rows[:, 0].sum()) == 0, "a capture does not execute: nothing may count"
        return graph

    return capture
