#!/usr/bin/env bash
# One device call: every test (GPU ones compiled), the memcheck control, and the demo on the GPU.
# Usage on the H200: bash scripts/gpu_check.sh [pytest args...]; logs go to $OUT (or ./gpu-out).
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || export PYTHONPATH=$PWD/src
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys,torch,triton;print(sys.version.split()[0],torch.__version__,triton.__version__)"; } | tee "$OUT/env.txt"
rc=0
# A per-test limit needs pytest-timeout (the dev extra has it; this host may have no network to install it): without
# it, the outer `timeout` alone bounds the run.
per_test=(); python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 180) || echo "gpu_check: no pytest-timeout here: no per-test limit, only the run's 420 s"
timeout 420 python3 -m pytest -q -p no:cacheprovider ${per_test[@]+"${per_test[@]}"} -rs "$@" 2>&1 | tee "$OUT/pytest.log" | tail -60 || rc=1
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
if [ -z "${SKIP_MEMCHECK:-}" ]; then
  timeout 300 python3 scripts/memcheck.py 2>&1 | tee "$OUT/memcheck.log" | tail -15; [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ -z "${SKIP_DEMO:-}" ]; then
  timeout 120 tripwire demo >"$OUT/demo.log" 2>&1; d=$?; tail -25 "$OUT/demo.log"; [ $d = 0 ] || rc=1
fi
echo "gpu_check rc=$rc"
exit $rc
