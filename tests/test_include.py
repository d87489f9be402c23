"""The CUDA C++ header ``tripwire/guard.cuh`` (``tripwire.include_dir()``).

CPU (CI): the header compiles as plain C++ with its constants equal to ``tripwire.layout``'s (a wrong expectation
fails the compile: the control); where nvcc exists its device code builds for sm_90 (warnings as errors; the vote
and the atomics in the SASS); everywhere its device code compiles with g++ against a small CUDA shim
(tests/cuda_host) and RUNS on simulated warps -- one thread per lane, real atomics, several warps at once -- so counts,
extremes, saturation, the first-offender pair and guard_index's clamping are checked against a Python reference,
including warps with several bad lanes and partial warps; the built wheel and sdist both hold the header (control:
without the package-data entry neither does).

GPU (``gpu`` marks, the H200 with nvcc): the worked example ``examples/cuda_gather`` built with
``torch.utils.cpp_extension``: exact counts with several bad lanes in one warp, a real first-offender pair (the
extremes are not one), graph replay N x counting N x, the unguarded twin identical on valid indices.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tripwire
from tripwire import layout
from tripwire.layout import decode, decode_neg

ROOT = Path(__file__).resolve().parents[1]
HOST = Path(__file__).resolve().parent / "cuda_host"
CXX = shutil.which("g++") or shutil.which("c++")
needs_cxx = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler (g++)")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def test_include_dir_holds_the_header():
    d = Path(tripwire.include_dir())
    assert d.is_absolute() and (d / "tripwire" / "guard.cuh").is_file()
    assert "include_dir" in tripwire.__all__


def _syntax_check(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    src = tmp_path / "check.cpp"
    src.write_text(f"#include <tripwire/guard.cuh>\n{body}\nint main() {{ return 0; }}\n")
    cmd = [CXX, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-I", tripwire.include_dir(), str(src)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


@needs_cxx
def test_header_is_plain_cxx_with_the_layout_constants(tmp_path):
    """Outside nvcc the header defines the layout and the encoding only; they agree with tripwire.layout."""
    checks = "\n".join(
        [
            f'static_assert(tripwire::SLOTS == {layout.SLOTS}, "slots");',
            *(
                f'static_assert(tripwire::{n} == {getattr(layout, n)}, "{n}");'
                for n in ("COUNT", "MAX_ROW", "MAX_VALUE", "NEG_MIN", "FIRST_ROW", "FIRST_VALUE")
            ),
            f'static_assert(tripwire::GUARD_BIAS == {layout.GUARD_BIAS}LL, "bias");',
            f'static_assert(tripwire::VALUE_MAX == {layout.VALUE_MAX}LL, "max");',
            f'static_assert(tripwire::VALUE_MIN == {layout.VALUE_MIN}LL, "min");',
            f'static_assert(tripwire::encode(-5) == {layout.encode(-5)}LL, "encode");',
            f'static_assert(tripwire::encode_neg(-5) == {layout.encode_neg(-5)}LL, "encode_neg");',
            f'static_assert(tripwire::encode({INT64_MAX}LL) == {layout.encode(layout.VALUE_MAX)}LL, "saturate");',
            'static_assert(!TRIPWIRE_HAS_DEVICE, "no device code outside nvcc");',
        ]
    )
    p = _syntax_check(tmp_path, checks)
    assert p.returncode == 0, p.stderr
    # Control: a wrong expectation fails the compile, so the assertions above are really checked.
    p = _syntax_check(tmp_path, f'static_assert(tripwire::GUARD_BIAS == {layout.GUARD_BIAS + 1}LL, "bias");')
    assert p.returncode != 0 and "bias" in p.stderr


def _cuda_tool(name: str) -> str | None:
    import os

    for base in filter(None, (os.environ.get("CUDA_HOME"), "/usr/local/cuda")):
        cand = Path(base) / "bin" / name
        if cand.is_file():
            return str(cand)
    return shutil.which(name)


_DEVICE_USE = r"""
#include <tripwire/guard.cuh>
__global__ void use_all(const int* idx32, const long long* idx64, int* out, int n, long long size, int64_t* ctr) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const auto a = tripwire::guard_index(idx32[i], 0, size, ctr, i);
  const auto b = tripwire::guard_index(idx64[i], 0, size, ctr + 8, i, threadIdx.x % 4 == 0);
  if (idx32[i] == 7) tripwire::record_hit(ctr + 16, i, idx32[i]);
  tripwire::record_hits(ctr + 24, idx64[i] < 0, i, idx64[i]);
  out[i] = (a.ok ? a.index : -1) + (b.ok ? static_cast<int>(b.index) : -1);
}
"""


def test_header_compiles_with_nvcc(tmp_path):
    """Where nvcc exists (the H200; any machine with a CUDA toolkit): the device code builds for sm_90 with every
    warning an error, and the warp vote and the 64-bit atomics are in the SASS."""
    nvcc = _cuda_tool("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here: the g++ shim build below checks the device code instead")
    src = tmp_path / "use.cu"
    src.write_text(_DEVICE_USE)
    cubin = tmp_path / "use.cubin"
    cmd = [nvcc, "-std=c++17", "-arch=sm_90", "-cubin", "--Werror", "all-warnings", "-I", tripwire.include_dir()]
    p = subprocess.run([*cmd, str(src), "-o", str(cubin)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    import triton

    tool = _cuda_tool("cuobjdump") or str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=False).stdout
    if not sass:
        pytest.skip("no cuobjdump to read the SASS")
    assert "VOTE" in sass and "ATOMG.E.ADD.64" in sass and "ATOMG.E.CAS.64" in sass and "SHFL.IDX" in sass


@pytest.fixture(scope="module")
def warp_sim(tmp_path_factory):
    """The header's device code compiled with g++ and the shim (-Werror: CI catches a typo in device code)."""
    if CXX is None:
        pytest.skip("needs a C++ compiler (g++)")
    exe = tmp_path_factory.mktemp("warp_sim") / "warp_sim"
    cmd = [CXX, "-std=c++17", "-O1", "-pthread", "-Wall", "-Wextra", "-Werror", "-I", tripwire.include_dir()]
    cmd += ["-I", str(HOST), str(HOST / "warp_sim.cpp"), "-o", str(exe)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr

    def run(mode: str, warps: list[list[tuple[int, int, int, int]]], lo: int = 0, hi: int = 0):
        lines = [f"{mode} {len(warps)} {lo} {hi}"]
        for w in warps:
            lines.append(str(len(w)))
            lines += [" ".join(map(str, lane)) for lane in w]
        out = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        rows = out.stdout.split("\n")
        words = [int(x) for x in rows[0].split()]
        lanes = {(int(a), int(b)): (int(c), bool(int(d))) for a, b, c, d in (r.split() for r in rows[1:] if r)}
        return words, lanes

    return run


def sat(v: int) -> int:
    return max(layout.VALUE_MIN, min(layout.VALUE_MAX, v))


def test_several_bad_lanes_in_one_warp(warp_sim, guard_row):
    """A full warp with 5 bad lanes: count 5, one set of atomics; first = the lowest row, then its lowest value."""
    lanes = [(i, 0, 100 + i, i) for i in range(32)]
    for i, v in ((3, -7), (9, 500), (17, 2), (18, -1), (31, 40)):
        lanes[i] = (i, 1, 100 + i, v)
    lanes[17] = (17, 1, 103, 2)  # the same row as lane 3, a higher value
    words, _ = warp_sim("hits", [lanes])
    hits = [(r, v) for _, b, r, v in lanes if b]
    guard_row(words, hits, first=(103, -7))
    # Control: the extremes are independent, not a pair: (max row, max value) was never one hit.
    assert (decode(words[1]), decode(words[2])) not in set(hits)


def test_partial_warps_concurrently(warp_sim, guard_row):
    """Warps of 1, 4 and 32 lanes (lanes that exist: not 0..n-1 only), at once: exact counts across warps."""
    w1 = [(5, 1, 7, -2)]
    w2 = [(0, 0, 1, 1), (3, 1, 2, 9), (7, 1, 3, 9), (30, 0, 4, 4)]
    w3 = [(i, int(i % 3 == 0), 50 + i, i * 1000) for i in range(32)]
    words, _ = warp_sim("hits", [w1, w2, w3, []])
    guard_row(words, [(r, v) for w in (w1, w2, w3) for _, b, r, v in w if b])


def test_no_bad_lane_writes_nothing(warp_sim):
    words, _ = warp_sim("hits", [[(i, 0, i, -i) for i in range(32)]] * 3)
    assert words == [0] * 8


def test_junk_values_saturate(warp_sim, guard_row):
    lanes = [(0, 1, 0, INT64_MAX), (1, 1, 1, INT64_MIN), (2, 1, INT64_MAX, 2**62), (3, 0, 3, 3)]
    words, _ = warp_sim("hits", [lanes])
    guard_row(words, [(r, v) for _, b, r, v in lanes if b], first=(0, layout.VALUE_MAX))
    assert (decode(words[2]), decode_neg(words[3]), decode(words[1])) == (
        layout.VALUE_MAX,
        layout.VALUE_MIN,
        layout.VALUE_MAX,
    )


def test_record_hit_counts_each_calling_thread(warp_sim, guard_row):
    """record_hit under the kernel's `if (bad)`: the lanes that took the branch call it; each counts once."""
    callers = [(i, 0, i // 4, 1000 - i) for i in (2, 3, 11, 12, 29)]
    words, _ = warp_sim("hit", [callers, [(0, 0, 77, 5)]])
    guard_row(words, [(r, v) for _, _, r, v in callers] + [(77, 5)])


def test_guard_index_clamps_masks_and_counts(warp_sim, guard_row):
    """Per lane: the clamped index and ok; out-of-range lanes count only where count is set (one lane per entry)."""
    lo, hi = -2, 10
    idx = [0, 9, 10, -2, -3, INT64_MAX, INT64_MIN, 5, 11, 11]
    count = [1, 1, 1, 1, 1, 1, 1, 1, 1, 0]  # lane 9 re-reads lane 8's entry: masked, not counted
    lanes = [(i, x, 200 + i, c) for i, (x, c) in enumerate(zip(idx, count, strict=True))]
    words, got = warp_sim("guard", [lanes], lo, hi)
    for i, x in enumerate(idx):
        ok = lo <= x < hi
        assert got[(0, i)] == (min(max(x, lo), hi - 1), ok)
    hits = [(200 + i, x) for i, (x, c) in enumerate(zip(idx, count, strict=True)) if c and not lo <= x < hi]
    guard_row(words, hits, first=(202, 10))


_lane = st.tuples(st.booleans(), st.integers(-(2**40), 2**40), st.integers(INT64_MIN, INT64_MAX))


@settings(max_examples=25, deadline=None)
@given(warps=st.lists(st.dictionaries(st.integers(0, 31), _lane, max_size=32), min_size=1, max_size=4))
def test_property_against_reference(warp_sim, warps, guard_row):
    """Random warps (random lanes present, random bad lanes, rows and junk values), all at once."""
    spec = [[(lane, int(b), r, v) for lane, (b, r, v) in sorted(w.items())] for w in warps]
    words, _ = warp_sim("hits", spec)
    hits = [(r, v) for w in spec for _, b, r, v in w if b]
    firsts = {min((sat(r), sat(v)) for _, b, r, v in w if b) for w in spec if any(b for _, b, _, _ in w)}
    guard_row(words, hits)
    if hits:  # the winner is some warp's own first pair (the lowest row, then value, of that warp)
        assert (decode(words[4]), decode(words[5])) in firsts


# ---------------------------------------------------------------------------------------------- packaging
def _build(tmp_path: Path, drop_header: bool = False) -> tuple[list[str], list[str]]:
    """Build a wheel and an sdist from a copy of the source tree; return their file lists."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "README.md", tree / "README.md")
    pyproject = (ROOT / "pyproject.toml").read_text()
    if drop_header:
        pyproject = pyproject.replace(', "include/tripwire/*.cuh"', "")
    (tree / "pyproject.toml").write_text(pyproject)
    code = "from setuptools import build_meta as b; b.build_wheel('dist'); b.build_sdist('dist')"
    p = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    wheel = zipfile.ZipFile(next((tree / "dist").glob("*.whl"))).namelist()
    sdist = tarfile.open(next((tree / "dist").glob("*.tar.gz"))).getnames()
    return wheel, sdist


def test_header_in_wheel_and_sdist(tmp_path):
    pytest.importorskip("setuptools")
    wheel, sdist = _build(tmp_path / "a")
    assert "tripwire/include/tripwire/guard.cuh" in wheel
    assert any(n.endswith("/src/tripwire/include/tripwire/guard.cuh") for n in sdist)
    # Control: without its package-data entry the header is in neither, so the listing can tell.
    wheel, sdist = _build(tmp_path / "b", drop_header=True)
    assert not any(n.endswith("guard.cuh") for n in wheel + sdist)


# ---------------------------------------------------------------------------------------------- GPU: the example
def _load_example():
    if "cuda_gather" in sys.modules:  # loaded once per process: it registers a custom op
        return sys.modules["cuda_gather"]
    path = ROOT / "examples" / "cuda_gather" / "cuda_gather.py"
    spec = importlib.util.spec_from_file_location("cuda_gather", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cuda_gather"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def example():
    """The worked example, built once (nvcc through torch.utils.cpp_extension; cached across runs)."""
    mod = _load_example()
    mod.build()
    return mod


def _gather_case(n_src=4096, n=3000, width=256, dtype=torch.bfloat16, idx_dtype=torch.int32):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    src = torch.randn(n_src, width, device=dev, generator=g).to(dtype)
    idx = torch.randint(0, n_src, (n,), device=dev, generator=g, dtype=idx_dtype)
    return src, idx


def _corrupt_gather(idx: torch.Tensor, n_src: int) -> list[tuple[int, int]]:
    """Several bad lanes in the first warp, one in a later block, the extremes of the index dtype; returns the
    expected (row, value) hits."""
    big = torch.iinfo(idx.dtype)
    bad = {0: n_src, 3: -1, 4: n_src + 7, 30: big.max, 31: big.min, 1000: -5, 2999: n_src}
    for i, v in bad.items():
        idx[i] = v
    return sorted(bad.items())


@pytest.mark.gpu
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_gpu_example_exact_counts_and_real_first_pair(example, monitor, idx_dtype, guard_row):
    src, idx = _gather_case(idx_dtype=idx_dtype)
    hits = _corrupt_gather(idx, src.shape[0])
    monitor.prealloc("cuda")
    ctr = monitor.counter(monitor.registry.register(example.SITE.name, description=example.SITE.description), "cuda")
    out = torch.full((idx.shape[0], src.shape[1]), 3.0, device="cuda", dtype=src.dtype)
    example.gather(src, idx, out, ctr=ctr)
    torch.cuda.synchronize()
    words = ctr.cpu().tolist()
    guard_row(words, hits)
    assert (decode(words[1]), decode(words[2])) not in set(hits)  # control: the extremes are not one hit
    bad = torch.tensor([i for i, _ in hits], device="cuda")
    assert out[bad].abs().sum() == 0  # masked rows read nothing and are zeros
    good = torch.ones(idx.shape[0], dtype=torch.bool, device="cuda")
    good[bad] = False
    assert torch.equal(out[good], src[idx[good].long()])


@pytest.mark.gpu
def test_gpu_example_graph_replay_counts_n_times(example, monitor, captured):
    src, idx = _gather_case()
    hits = _corrupt_gather(idx, src.shape[0])
    monitor.prealloc("cuda")
    ctr = monitor.counter(monitor.registry.register(example.SITE.name, description=example.SITE.description), "cuda")
    out = torch.empty(idx.shape[0], src.shape[1], device="cuda", dtype=src.dtype)
    graph = captured(lambda: example.gather(src, idx, out, ctr=ctr), monitor)
    n = 30
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    assert ctr.cpu()[0] == n * len(hits)


@pytest.mark.gpu
def test_gpu_example_twin_identical_on_valid_indices(example, monitor):
    src, idx = _gather_case(width=1024)
    monitor.prealloc("cuda")
    ctr = monitor.counter(monitor.registry.register(example.SITE.name, description=example.SITE.description), "cuda")
    a = torch.empty(idx.shape[0], src.shape[1], device="cuda", dtype=src.dtype)
    b = torch.empty_like(a)
    example.gather(src, idx, a, ctr=ctr)
    example.gather(src, idx, b, guard=False)
    torch.cuda.synchronize()
    assert torch.equal(a, b) and torch.equal(a, src[idx.long()])
    assert ctr.cpu().abs().sum() == 0
