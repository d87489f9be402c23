"""The CUDA C++ header ``tripwire/guard.cuh`` (``tripwire.include_dir()``).

CPU (CI): the header compiles as plain C++ with its constants (and its offender key) equal to ``tripwire.layout``'s
(a wrong expectation fails the compile: the control); where nvcc exists its device code builds for sm_90 (warnings as
errors; the vote, the atomics and the offenders' fence in the SASS); everywhere its device code compiles with g++
against a small CUDA shim (tests/cuda_host) and RUNS on simulated warps -- one thread per lane, real atomics, several
warps at once or one after another -- so counts, extremes, saturation, the first-offender pair and guard_index's
clamping are checked against a Python reference, including warps with several bad lanes and partial warps; and the
offenders: several bad lanes of a warp kept as distinct offenders, repeats claiming nothing, more than K distinct
keeping the first K with an exact count, a counter without an offender block keeping none, the request word stored,
and the header's key equal to the one the Triton helpers store for the same inputs. The built wheel and sdist both
hold the header (control: without the package-data entry neither does).

GPU (``gpu`` marks, the H200 with nvcc): the worked example ``examples/cuda_gather`` built with
``torch.utils.cpp_extension``: exact counts with several bad lanes in one warp, a real first-offender pair (the
extremes are not one), the offenders read through a Monitor's snapshot() (with and without a request map), graph
replay N x counting N x and keeping the distinct offenders once, the unguarded twin identical on valid indices.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

import tripwire
from tripwire import Hit, layout
from tripwire.layout import decode, decode_neg, encode, offender_key
from tripwire.triton import record_hits

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
            *(
                f'static_assert(tripwire::{n} == {getattr(layout, n)}, "{n}");'
                for n in ("OFFENDERS", "OFF_HEADER", "OFF_ENTRY", "OFF_DONE", "E_KEY", "E_ROW", "E_VALUE", "E_REQ")
            ),
            *(
                f'static_assert(tripwire::KEY_MIX{i + 1} == {m}ULL, "multiplier {i + 1}");'
                for i, m in enumerate(layout.KEY_MIX)
            ),
            *(
                f"static_assert(tripwire::offender_key({a}LL, {b}LL, {c}LL) == {offender_key(a, b, c) % 2**64}ULL,"
                f' "key");'
                for a, b, c in ((1, 2, 3), (layout.encode(-1), layout.encode(layout.VALUE_MAX), 0))
            ),
            'static_assert(!TRIPWIRE_HAS_DEVICE, "no device code outside nvcc");',
        ]
    )
    p = _syntax_check(tmp_path, checks)
    assert p.returncode == 0, p.stderr
    # Control: a wrong expectation fails the compile, so the assertions above are really checked.
    p = _syntax_check(tmp_path, f'static_assert(tripwire::GUARD_BIAS == {layout.GUARD_BIAS + 1}LL, "bias");')
    assert p.returncode != 0 and "bias" in p.stderr


_DEVICE_USE = r"""
#include <tripwire/guard.cuh>
__global__ void use_all(const int* idx32, const long long* idx64, int* out, int n, long long size, int64_t* ctr) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const auto a = tripwire::guard_index(idx32[i], 0, size, ctr, i);
  const auto b = tripwire::guard_index(idx64[i], 0, size, ctr + 8, i, threadIdx.x % 4 == 0);
  if (idx32[i] == 7) tripwire::record_hit(ctr + 16, i, idx32[i]);
  tripwire::record_hits(ctr + 24, idx64[i] < 0, i, idx64[i]);
  const auto c = tripwire::guard_index(idx32[i], 0, size, ctr + 32, i, true, 1000LL + i);
  if (idx64[i] == 9) tripwire::record_hit(ctr + 40, i, idx64[i], idx32[i]);
  tripwire::record_hits(ctr + 48, idx32[i] < 0, i, idx32[i], i / 4);
  out[i] = (a.ok ? a.index : -1) + (b.ok ? static_cast<int>(b.index) : -1) + (c.ok ? 1 : 0);
}
"""


def test_header_compiles_with_nvcc(tmp_path, cuda_tool):
    """Where nvcc exists (the H200; any machine with a CUDA toolkit): the device code builds for sm_90 with every
    warning an error, and the warp vote and the 64-bit atomics are in the SASS."""
    nvcc = cuda_tool("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here: the g++ shim build below checks the device code instead")
    src = tmp_path / "use.cu"
    src.write_text(_DEVICE_USE)
    cubin = tmp_path / "use.cubin"
    cmd = [nvcc, "-std=c++17", "-arch=sm_90", "-cubin", "--Werror", "all-warnings", "-I", tripwire.include_dir()]
    p = subprocess.run([*cmd, str(src), "-o", str(cubin)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    import triton

    tool = cuda_tool("cuobjdump") or str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=False).stdout
    if not sass:
        pytest.skip("no cuobjdump to read the SASS")
    assert "VOTE" in sass and "ATOMG.E.ADD.64" in sass and "ATOMG.E.CAS.64" in sass and "SHFL.IDX" in sass
    assert "MEMBAR" in sass and "WARPSYNC" in sass  # the offenders' fence and the wait for the leader's atomics


_ONE_PER_BLOCK = r"""
#include <tripwire/guard.cuh>
__global__ void copy_row(const long long* slots, const int4* src, int4* dst, long long n_slots, int64_t* ctr,
                         const long long* requests) {
  const long long slot = slots[blockIdx.x];
  if (static_cast<unsigned long long>(slot) >= static_cast<unsigned long long>(n_slots)) {
    if (threadIdx.x == 0) tripwire::record_hit(ctr, blockIdx.x, slot, requests[blockIdx.x]);
    return;
  }
  dst[slot * blockDim.x + threadIdx.x] = src[blockIdx.x * blockDim.x + threadIdx.x];
}
"""


def _inline_part(tmp_path: Path, cuda_tool: Callable[[str], str | None], *defines: str) -> str:
    """The SASS of _ONE_PER_BLOCK's kernel up to its first CALL (all of it when there is none): what the kernel
    itself holds of the fault path, beside the copy."""
    nvcc = cuda_tool("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here")
    tool = cuda_tool("cuobjdump") or str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    src, cubin = tmp_path / "one.cu", tmp_path / f"one{len(defines)}.cubin"
    src.write_text(_ONE_PER_BLOCK)
    cmd = [nvcc, "-std=c++17", "-O3", "-arch=sm_90", "-cubin", *defines, "-I", tripwire.include_dir()]
    p = subprocess.run([*cmd, str(src), "-o", str(cubin)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=False).stdout
    if not sass:
        pytest.skip("no cuobjdump to read the SASS")
    code = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    return "\n".join(code[: next((k for k, x in enumerate(code) if "CALL" in x), len(code))])


def test_record_hit_is_one_call_under_its_if(tmp_path, cuda_tool):
    """record_hit's whole record (the ballot, the saturation, the request's word) is out of line: nvcc lays the
    early-return fault block out before the copy, so whatever of it is inline the clean path jumps over. The kernel
    itself holds no vote, no atomic and no shuffle of it. The control: the fault path inlined
    (TRIPWIRE_FAULT_INLINE) puts them back in the kernel's own code."""
    inline = _inline_part(tmp_path, cuda_tool)
    assert not re.search(r"VOTE|ATOM|SHFL|RED\.", inline), inline
    control = _inline_part(tmp_path, cuda_tool, "-DTRIPWIRE_FAULT_INLINE")
    assert "VOTE" in control and "ATOMG" in control


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

    def run(mode: str, warps: list[list[tuple]], lo: int = 0, hi: int = 0, *, k: int = 8, seq: bool = False) -> Sim:
        """Lanes are ``(lane, a, row, b)`` or ``(lane, a, row, b, request)`` (request None or absent: the overload
        without one). ``k``: the offender block's entries (None: a counter that is not an arena row, no block).
        ``seq``: the warps run one after another instead of all at once."""
        lines = [f"{mode} {len(warps)} {lo} {hi} {-1 if k is None else k} {int(seq)}"]
        for w in warps:
            lines.append(str(len(w)))
            for lane, a, row, b, *q in w:
                req = q[0] if q else None
                lines.append(f"{lane} {a} {row} {b} {int(req is not None)} {0 if req is None else req}")
        out = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        rows = out.stdout.split("\n")
        words = [int(x) for x in rows[0].split()]
        block = None if k is None else np.array([int(x) for x in rows[1].split()], dtype=np.int64)
        rest = rows[1 if k is None else 2 :]
        lanes = {(int(a), int(b)): (int(c), bool(int(d))) for a, b, c, d in (r.split() for r in rest if r)}
        return Sim(words, lanes, block)

    run.exe = str(exe)  # type: ignore[attr-defined]
    return run


class Sim(NamedTuple):
    words: list[int]  # the counter row (slot 7 printed 0 while it holds the block's address)
    lanes: dict[tuple[int, int], tuple[int, bool]]  # guard mode: (warp, lane) -> (index, ok)
    block: np.ndarray | None  # the offender block's words

    def offenders(self) -> list[tuple[int, int, int | None]]:
        assert self.block is not None
        # A row read with its block carries it after the SLOTS words: Hit decodes it (the counter words are unused).
        row = np.concatenate([np.zeros(layout.SLOTS, dtype=np.int64), self.block])
        return [tuple(o) for o in Hit.from_row(row).offenders]


@pytest.fixture(scope="module")
def key_sim(warp_sim):
    """The header's offender_key() of biased (row, value, request) words, computed by the g++ build."""
    exe = warp_sim.exe

    def keys(words: list[tuple[int, int, int]]) -> list[int]:
        lines = [f"key {len(words)} 0 0 0 0"] + [f"{a} {b} {c}" for a, b, c in words]
        out = subprocess.run([exe], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return [int(x) for x in out.stdout.split()]

    return keys


def sat(v: int) -> int:
    return max(layout.VALUE_MIN, min(layout.VALUE_MAX, v))


def test_several_bad_lanes_in_one_warp(warp_sim, guard_row):
    """A full warp with 5 bad lanes: count 5, one set of atomics; first = the lowest row, then its lowest value."""
    lanes = [(i, 0, 100 + i, i) for i in range(32)]
    for i, v in ((3, -7), (9, 500), (17, 2), (18, -1), (31, 40)):
        lanes[i] = (i, 1, 100 + i, v)
    lanes[17] = (17, 1, 103, 2)  # the same row as lane 3, a higher value
    words = warp_sim("hits", [lanes]).words
    hits = [(r, v) for _, b, r, v in lanes if b]
    guard_row(words, hits, first=(103, -7))
    # Control: the extremes are independent, not a pair: (max row, max value) was never one hit.
    assert (decode(words[1]), decode(words[2])) not in set(hits)


def test_partial_warps_concurrently(warp_sim, guard_row):
    """Warps of 1, 4 and 32 lanes (lanes that exist: not 0..n-1 only), at once: exact counts across warps."""
    w1 = [(5, 1, 7, -2)]
    w2 = [(0, 0, 1, 1), (3, 1, 2, 9), (7, 1, 3, 9), (30, 0, 4, 4)]
    w3 = [(i, int(i % 3 == 0), 50 + i, i * 1000) for i in range(32)]
    words = warp_sim("hits", [w1, w2, w3, []]).words
    guard_row(words, [(r, v) for w in (w1, w2, w3) for _, b, r, v in w if b])


def test_no_bad_lane_writes_nothing(warp_sim):
    sim = warp_sim("hits", [[(i, 0, i, -i, 5) for i in range(32)]] * 3)
    assert sim.words == [0] * 8
    assert sim.block is not None and sim.block.tolist() == [0, 8] + [0] * (2 + 8 * 4)  # the block untouched too


def test_junk_values_saturate(warp_sim, guard_row):
    lanes = [(0, 1, 0, INT64_MAX), (1, 1, 1, INT64_MIN), (2, 1, INT64_MAX, 2**62), (3, 0, 3, 3)]
    words = warp_sim("hits", [lanes]).words
    guard_row(words, [(r, v) for _, b, r, v in lanes if b], first=(0, layout.VALUE_MAX))
    assert (decode(words[2]), decode_neg(words[3]), decode(words[1])) == (
        layout.VALUE_MAX,
        layout.VALUE_MIN,
        layout.VALUE_MAX,
    )


def test_record_hit_counts_each_calling_thread(warp_sim, guard_row):
    """record_hit under the kernel's `if (bad)`: the lanes that took the branch call it; each counts once."""
    callers = [(i, 0, i // 4, 1000 - i) for i in (2, 3, 11, 12, 29)]
    words = warp_sim("hit", [callers, [(0, 0, 77, 5)]]).words
    guard_row(words, [(r, v) for _, _, r, v in callers] + [(77, 5)])


def test_guard_index_clamps_masks_and_counts(warp_sim, guard_row):
    """Per lane: the clamped index and ok; out-of-range lanes count only where count is set (one lane per entry)."""
    lo, hi = -2, 10
    idx = [0, 9, 10, -2, -3, INT64_MAX, INT64_MIN, 5, 11, 11]
    count = [1, 1, 1, 1, 1, 1, 1, 1, 1, 0]  # lane 9 re-reads lane 8's entry: masked, not counted
    lanes = [(i, x, 200 + i, c) for i, (x, c) in enumerate(zip(idx, count, strict=True))]
    words, got, _ = warp_sim("guard", [lanes], lo, hi)
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
    words = warp_sim("hits", spec).words
    hits = [(r, v) for w in spec for _, b, r, v in w if b]
    firsts = {min((sat(r), sat(v)) for _, b, r, v in w if b) for w in spec if any(b for _, b, _, _ in w)}
    guard_row(words, hits)
    if hits:  # the winner is some warp's own first pair (the lowest row, then value, of that warp)
        assert (decode(words[4]), decode(words[5])) in firsts


# ---------------------------------------------------------------------------------------------- offenders
def _distinct(hits: list[tuple]) -> list[tuple]:
    out: list[tuple] = []
    for h in hits:
        if h not in out:
            out.append(h)
    return out


def _offender(row: int, value: int, req: int | None = None) -> tuple[int, int, int | None]:
    # A negative request id means "no request": kept as not known, like None (the Triton helpers' convention).
    return (sat(row), sat(value), None if req is None or req < 0 else sat(req))


def _check_kept(sim: Sim, hits: list[tuple], k: int) -> None:
    """The block keeps min(k, distinct) distinct offenders, all real, all of them when they fit."""
    distinct = _distinct(hits)
    kept = sim.offenders()
    assert sim.words[0] == len(hits)
    assert len(kept) == len(set(kept)) == min(k, len(distinct)), (kept, distinct)
    assert set(kept) <= set(distinct)
    if len(distinct) <= k:
        assert set(kept) == set(distinct)


def test_warp_keeps_its_bad_lanes_as_distinct_offenders(warp_sim):
    """One warp, 6 bad lanes holding 5 distinct (row, value, request) -- lanes 9 and 20 are one offender -- keep 5
    entries, each key ``layout.offender_key`` of its words; the count is 6. Control: a distinct value on lane 20
    makes it a sixth offender."""
    lanes = [(i, 0, i, i, 1) for i in range(32)]
    bad = {2: (2, -1, 7), 5: (5, 400, 7), 9: (9, 9, 8), 20: (9, 9, 8), 21: (21, 9, None), 30: (30, INT64_MAX, 9)}
    for i, (r, v, q) in bad.items():
        lanes[i] = (i, 1, r, v, q)
    sim = warp_sim("hits", [lanes])
    hits = [_offender(*h) for h in bad.values()]
    _check_kept(sim, hits, 8)
    assert len(sim.offenders()) == 5
    entries = sim.block[layout.OFF_HEADER :].reshape(-1, layout.OFF_ENTRY)[:5]
    for key, rb, vb, qb in entries.tolist():
        assert key == offender_key(rb, vb, qb) and key != 0
    lanes[20] = (20, 1, 9, 10, 8)
    assert len(warp_sim("hits", [lanes]).offenders()) == 6


def test_repeats_claim_nothing(warp_sim):
    """Warps one after another: the second repeats the first's 3 offenders (lanes 0 and 1 twice over) and the
    third repeats them again with record_hit: still 3 entries, the count is every bad lane. Control: the same
    lanes with other requests are new offenders."""
    first = [(0, 1, 4, 40, 1), (1, 1, 5, 50, 1), (2, 1, 6, 60, 2), (3, 0, 7, 70, 3)]
    second = [(0, 1, 4, 40, 1), (1, 1, 4, 40, 1), (7, 1, 5, 50, 1), (8, 1, 6, 60, 2), (9, 1, 5, 50, 1)]
    sim = warp_sim("hits", [first, second], seq=True)
    assert sim.words[0] == 8 and sorted(sim.offenders()) == [(4, 40, 1), (5, 50, 1), (6, 60, 2)]
    sim = warp_sim("hit", [[lane for lane in first if lane[1]]] * 3, seq=True)
    assert sim.words[0] == 9 and sorted(sim.offenders()) == [(4, 40, 1), (5, 50, 1), (6, 60, 2)]
    other = [(lane, b, r, v, q + 10) for lane, b, r, v, q in second]
    sim = warp_sim("hits", [first, other], seq=True)
    assert sim.words[0] == 8 and len(sim.offenders()) == 3 + 3


def test_more_than_k_keep_the_first_k_and_count_exactly(warp_sim, guard_row):
    """K = 4, warps one after another: 3 distinct, then 3 more, then 5 more: the first warp's 3 are kept, then one
    of the second's, and the third claims nothing (its count still counts: 11). All at once, racing: 4 of the 11
    kept, distinct, the count 11. Control: K = 16 keeps all 11."""
    w = [[(i, 1, 10 * g + i, -i, g) for i in range(n)] for g, n in enumerate((3, 3, 5))]
    hits = [_offender(r, v, q) for lanes in w for _, _, r, v, q in lanes]
    sim = warp_sim("hits", w, k=4, seq=True)
    guard_row(sim.words, [(r, v) for r, v, _ in hits])
    kept = sim.offenders()
    assert len(kept) == 4 and set(kept[:3]) == set(hits[:3]) and kept[3] in hits[3:6]
    _check_kept(warp_sim("hits", w, k=4), hits, 4)
    assert len(warp_sim("hits", w, k=16).offenders()) == 11


def test_counter_without_a_block_counts_and_keeps_none(warp_sim, guard_row):
    """A counter that is not an arena row (slot 7 = 0) counts exactly and keeps its first pair and extremes, and
    nothing else is written. Control: the same warp with a block keeps its 3 offenders."""
    lanes = [(0, 1, 3, 30, 5), (4, 1, 1, -3, 5), (6, 0, 2, 2, 5), (31, 1, 9, 90, None)]
    sim = warp_sim("hits", [lanes], k=None)
    assert sim.block is None and sim.words[7] == 0
    guard_row(sim.words, [(3, 30), (1, -3), (9, 90)], first=(1, -3))
    assert sorted(warp_sim("hits", [lanes]).offenders(), key=str) == sorted(
        [(3, 30, 5), (1, -3, 5), (9, 90, None)], key=str
    )


def test_request_word_is_stored(warp_sim):
    """record_hits, record_hit and guard_index, each with and without a request: REQ holds the biased request
    (saturated like values), 0 where none was given or the id is negative ("no request"; decoded None)."""
    big = [(0, 1, 0, 100, 7), (1, 1, 1, 101, -1), (2, 1, 2, 102, INT64_MAX), (3, 1, 3, 103, None)]
    want = {(0, 100, 7), (1, 101, None), (2, 102, layout.VALUE_MAX), (3, 103, None)}
    assert set(warp_sim("hits", [big]).offenders()) == want
    assert set(warp_sim("hit", [big]).offenders()) == want
    guard = [(lane, idx, row, 1, q) for lane, _, row, idx, q in big] + [(4, 5, 4, 1, 77)]  # lane 4 is in range
    assert set(warp_sim("guard", [guard], 0, 10).offenders()) == want
    sim = warp_sim("hits", [big])
    by_row = {int(e[1]): int(e[3]) for e in sim.block[layout.OFF_HEADER :].reshape(-1, layout.OFF_ENTRY)[:4]}
    assert by_row == {encode(0): encode(7), encode(1): 0, encode(2): encode(layout.VALUE_MAX), encode(3): 0}


_off_lane = st.tuples(
    st.booleans(), st.integers(0, 4), st.sampled_from([-1, 7, INT64_MAX]), st.sampled_from([None, 0, 3, INT64_MIN])
)


@settings(max_examples=25, deadline=None)
@given(
    warps=st.lists(st.dictionaries(st.integers(0, 31), _off_lane, max_size=32), min_size=1, max_size=4),
    k=st.sampled_from([1, 2, 8]),
    seq=st.booleans(),
)
def test_offenders_property(warp_sim, guard_row, warps, k, seq):
    """Random warps whose lanes draw from small pools (repeats within and across warps are common), at once or one
    after another: exact counts, and min(K, distinct) distinct real offenders kept (all of them when they fit);
    one after another, each warp's new offenders come after the previous warps' (first come, first kept)."""
    spec = [[(lane, int(b), r, v, q) for lane, (b, r, v, q) in sorted(w.items())] for w in warps]
    sim = warp_sim("hits", spec, k=k, seq=seq)
    hits = [_offender(r, v, q) for w in spec for _, b, r, v, q in w if b]
    guard_row(sim.words, [(r, v) for r, v, _ in hits])
    _check_kept(sim, hits, k)
    if seq:
        kept, seen = sim.offenders(), []
        for w in spec:  # the entries claimed by warp w follow every entry of the warps before it
            new = [h for h in _distinct([_offender(r, v, q) for _, b, r, v, q in w if b]) if h not in seen]
            take = new[: max(0, min(k, len(_distinct(hits))) - len(seen))]
            assert set(kept[len(seen) : len(seen) + len(take)]) <= set(new)
            seen += take


@triton.jit
def _record_for_keys(ctr, rows_ptr, vals_ptr, reqs_ptr, n, HAS_REQ: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    rows = tl.load(rows_ptr + offs, mask=m, other=0)
    vals = tl.load(vals_ptr + offs, mask=m, other=0)
    reqs = None
    if HAS_REQ:
        reqs = tl.load(reqs_ptr + offs, mask=m, other=0)
    record_hits(ctr, m, rows, vals, reqs)


def test_key_equals_the_triton_helpers(key_sim, make_monitor, kernel_device):
    """The header's offender_key() of the same words equals the key the Triton helpers stored (run here: the
    interpreter in CI), and layout.offender_key; with and without a request, values at the encoding's edges.
    Control: the same key with arithmetic shifts (Triton's `>>` on int64 without the masks) differs, so the
    comparison can fail."""
    rows = [0, 1, 2**40, 5, 6, 7]
    vals = [INT64_MAX, INT64_MIN, -1, 0, 2**62, 12345]
    reqs = [0, -1, INT64_MAX, 2**31, -(2**40), 3]
    mon = make_monitor(offenders=16)
    for has_req in (True, False):
        site = mon.registry.register(f"t.keys.{has_req}")
        ctr = mon.counter(site, kernel_device)
        t = [torch.tensor(x, dtype=torch.int64, device=kernel_device) for x in (rows, vals, reqs)]
        _record_for_keys[(1,)](ctr, *t, len(rows), HAS_REQ=has_req, BLOCK=8)
        block = mon.arena.offenders(torch.device(ctr.device))[site.id].cpu().numpy()
        entries = block[layout.OFF_HEADER :].reshape(-1, layout.OFF_ENTRY)[: len(rows)]
        words = [(int(rb), int(vb), int(qb)) for _, rb, vb, qb in entries]
        assert sorted(words) == sorted(
            (encode(sat(r)), encode(sat(v)), encode(sat(q)) if has_req and q >= 0 else 0)  # a negative id: none
            for r, v, q in zip(rows, vals, reqs, strict=True)
        )
        triton_keys = [int(e[0]) for e in entries]
        assert key_sim(words) == triton_keys == [offender_key(*w) for w in words]

        def signed(h: int) -> int:
            h %= 2**64
            return h - 2**64 if h >> 63 else h

        def fmix_arithmetic(h: int) -> int:  # Python's >> on a negative int is arithmetic, like Triton's on int64
            h = signed(h)
            h = signed(h ^ (h >> 33)) * layout.KEY_MIX[0]
            h = signed(signed(h) ^ (signed(h) >> 33)) * layout.KEY_MIX[1]
            return signed(signed(h) ^ (signed(h) >> 33))

        def arithmetic_key(rb: int, vb: int, qb: int) -> int:
            return signed(fmix_arithmetic(fmix_arithmetic(fmix_arithmetic(rb) ^ vb) ^ qb) | 1)

        assert [arithmetic_key(*w) for w in words] != triton_keys


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


def _example_ctr(example, monitor):
    monitor.prealloc("cuda")
    site = monitor.registry.register(example.SITE.name, description=example.SITE.description)
    return monitor.counter(site, "cuda")


def _request_map(n: int, dtype: torch.dtype | None) -> torch.Tensor | None:
    """Output row i -> request 3 * i - 100 (negative ones too), or no map."""
    return None if dtype is None else (torch.arange(n, device="cuda", dtype=torch.int64) * 3 - 100).to(dtype)


def _want_offenders(hits: list[tuple[int, int]], requests: torch.Tensor | None) -> list[tuple]:
    def req(r: int) -> int | None:  # a negative id means "no request": kept as None
        return None if requests is None or 3 * r - 100 < 0 else 3 * r - 100

    return sorted(((r, sat(v), req(r)) for r, v in hits), key=str)


@pytest.mark.gpu
@pytest.mark.parametrize("req_dtype", [None, torch.int32, torch.int64], ids=["no-requests", "req32", "req64"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_gpu_example_exact_counts_and_real_first_pair(example, monitor, hit_of, idx_dtype, req_dtype, guard_row):
    """7 bad rows (5 of them in the first warp): count 7, a real first pair, and the 7 offenders read through the
    monitor's snapshot(), each with its row's request (None without a map)."""
    src, idx = _gather_case(idx_dtype=idx_dtype)
    hits = _corrupt_gather(idx, src.shape[0])
    ctr = _example_ctr(example, monitor)
    requests = _request_map(idx.shape[0], req_dtype)
    out = torch.full((idx.shape[0], src.shape[1]), 3.0, device="cuda", dtype=src.dtype)
    example.gather(src, idx, out, ctr=ctr, requests=requests)
    torch.cuda.synchronize()
    words = ctr.cpu().tolist()
    guard_row(words, hits)
    assert (decode(words[1]), decode(words[2])) not in set(hits)  # control: the extremes are not one hit
    hit = hit_of(monitor, example.SITE.name)
    assert hit.count == len(hits) and sorted(map(tuple, hit.offenders), key=str) == _want_offenders(hits, requests)
    bad = torch.tensor([i for i, _ in hits], device="cuda")
    assert out[bad].abs().sum() == 0  # masked rows read nothing and are zeros
    good = torch.ones(idx.shape[0], dtype=torch.bool, device="cuda")
    good[bad] = False
    assert torch.equal(out[good], src[idx[good].long()])


@pytest.mark.gpu
def test_gpu_example_refuses_a_bad_request_map(example, monitor):
    src, idx = _gather_case()
    ctr = _example_ctr(example, monitor)
    out = torch.empty(idx.shape[0], src.shape[1], device="cuda", dtype=src.dtype)
    for bad in (
        torch.zeros(idx.shape[0] - 1, device="cuda", dtype=torch.int64),  # one short
        torch.zeros(idx.shape[0], device="cuda", dtype=torch.float32),
        torch.zeros(idx.shape[0], dtype=torch.int64),  # on the CPU
        torch.zeros(2 * idx.shape[0], device="cuda", dtype=torch.int64)[::2],  # strided
    ):
        with pytest.raises(RuntimeError, match="requests must be a contiguous int32 or int64 tensor"):
            example.gather(src, idx, out, ctr=ctr, requests=bad)


@pytest.mark.gpu
def test_gpu_example_graph_replay_counts_n_times(example, monitor, hit_of, captured):
    """Replayed N times: the count is N x the bad rows, the offenders the 7 distinct ones once each."""
    src, idx = _gather_case()
    hits = _corrupt_gather(idx, src.shape[0])
    ctr = _example_ctr(example, monitor)
    requests = _request_map(idx.shape[0], torch.int32)
    out = torch.empty(idx.shape[0], src.shape[1], device="cuda", dtype=src.dtype)
    graph = captured(lambda: example.gather(src, idx, out, ctr=ctr, requests=requests), monitor)
    n = 30
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    assert ctr.cpu()[0] == n * len(hits)
    hit = hit_of(monitor, example.SITE.name)
    assert hit.count == n * len(hits) and sorted(map(tuple, hit.offenders), key=str) == _want_offenders(hits, requests)


@pytest.mark.gpu
def test_gpu_example_twin_identical_on_valid_indices(example, monitor):
    src, idx = _gather_case(width=1024)
    ctr = _example_ctr(example, monitor)
    a = torch.empty(idx.shape[0], src.shape[1], device="cuda", dtype=src.dtype)
    b = torch.empty_like(a)
    example.gather(src, idx, a, ctr=ctr)
    example.gather(src, idx, b, guard=False)
    torch.cuda.synchronize()
    assert torch.equal(a, b) and torch.equal(a, src[idx.long()])
    assert ctr[:7].cpu().abs().sum() == 0  # slot 7 is the offender block's address
