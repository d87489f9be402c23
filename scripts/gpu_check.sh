#!/usr/bin/env bash
# One device call: every test (GPU ones compiled), the memcheck control, and the demos on the GPU, side by side.
# Usage on the H200: [JOBS=N] [LIMIT=S] [MEMCHECK=k1,k2] bash scripts/gpu_check.sh [pytest args...]; logs go to $OUT
# (or ./gpu-out), with summary.txt: each part's exit status and the lines that matter.
# The parts run at once (the host has 16 cores, the GPU room for all): the tests spread over JOBS workers when
# pytest-xdist is importable (carry its wheel: docs/benchmarks.md), each part under LIMIT seconds. Nothing here is
# timed: run benchmarks in a call of their own.
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
LIMIT=${LIMIT:-420}; JOBS=${JOBS:-8}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
SUM="$OUT/summary.txt"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys,torch,triton;print(sys.version.split()[0],torch.__version__,triton.__version__)"; } >"$SUM" 2>&1
# A per-test limit needs pytest-timeout, workers need pytest-xdist (the dev extra has both; the host has no network:
# carry their wheels); without them, the part's LIMIT alone bounds the run, serially.
# -rsxfE (one -r: pytest keeps the last) names skips, xfails and failures in the closing summary; with workers, -v
# (instead of -q, which would cancel it) names each result as it lands too, so a part cut off by its LIMIT (no
# closing summary) still says which tests failed.
opts=(-p no:cacheprovider -rsxfE)
python3 -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout 240)
if python3 -c "import xdist" 2>/dev/null && [ "$JOBS" -gt 1 ]; then opts+=(-n "$JOBS" -v); else opts+=(-q); fi
timeout "$LIMIT" python3 -m pytest "${opts[@]}" "$@" >"$OUT/pytest.log" 2>&1 & tests=$!
parts=()
if [ -z "${SKIP_MEMCHECK:-}" ]; then
  timeout "$LIMIT" python3 scripts/memcheck.py ${MEMCHECK:+--kernels "$MEMCHECK"} >"$OUT/memcheck.log" 2>&1 & parts+=("memcheck:$!")
fi
if [ -z "${SKIP_DEMO:-}" ]; then
  timeout "$LIMIT" python3 -m tripwire demo >"$OUT/demo.log" 2>&1 & parts+=("demo:$!")
  timeout "$LIMIT" python3 -m tripwire demo --engine transformers >"$OUT/demo_transformers.log" 2>&1 & parts+=("demo_transformers:$!")
fi
rc=0
wait "$tests"; t=$?; [ $t = 0 ] || rc=1
echo "== pytest rc=$t" >>"$SUM"; tail -4 "$OUT/pytest.log" >>"$SUM"
grep -E "^(FAILED|ERROR) |\] (FAILED|ERROR) " "$OUT/pytest.log" | sort -u >>"$SUM"
grep -E "^E   " "$OUT/pytest.log" | head -40 >>"$SUM"  # what each failure asserted (the log stays on the host)
for p in "${parts[@]}"; do
  name=${p%%:*}; wait "${p#*:}"; s=$?; [ $s = 0 ] || rc=1
  echo "== $name rc=$s" >>"$SUM"; tail -6 "$OUT/$name.log" >>"$SUM"
done
echo "gpu_check rc=$rc" >>"$SUM"
cat "$SUM"
exit $rc
