#!/usr/bin/env bash
# One device call for the same-step verdicts: the verdict and step-share benchmarks, their GPU tests, the transformers
# engine's tests (eager and CUDA graphs), and the escape fuzz over four configurations (eager / CUDA graphs x the default interval /
# 5 ms) run side by side. Usage on the H200: RUNS=250 bash scripts/gpu_verdict.sh; logs and JSON go to $OUT.
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
RUNS=${RUNS:-250}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys,torch,triton,transformers;print(sys.version.split()[0],torch.__version__,triton.__version__,transformers.__version__)"; } | tee "$OUT/env.txt"
rc=0
# The benchmarks first, alone on the GPU (the fuzz's engines would share it): the verdict's own cost, and tripwire's
# share of a captured Llama-3-8B-shaped step.
timeout 120 python3 benchmarks/bench_verdict.py --json "$OUT/bench_verdict.json" 2>&1 | tee "$OUT/bench_verdict.log" || rc=1
timeout "${SHARE_S:-200}" python3 benchmarks/bench_step_share.py --json "$OUT/step_share.json" 2>&1 | tee "$OUT/step_share.log" || rc=1
# The fuzz first, in the background (four processes; the host has 16 cores), while the tests and the bench run:
# reads, writes and page faults (a bad page id in the engine's block table), one or several victims.
WS=0.35
pids=()
for cfg in "eager 0.05" "graphs 0.05" "eager 0.005" "graphs 0.005"; do
  set -- $cfg
  flag=""; [ "$1" = graphs ] && flag=--cuda-graphs
  timeout "${FUZZ_S:-480}" python3 scripts/fuzz_transformers.py --runs "$RUNS" $flag --interval "$2" --seed "${SEED:-7}" --write-share "$WS" --page-share "${PS:-0.2}" \
    --json "$OUT/fuzz_$1_$2.json" >"$OUT/fuzz_$1_$2.log" 2>&1 &
  pids+=($!)
done
per_test=(); python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 240)
timeout "${TEST_S:-420}" python3 -m pytest -q -p no:cacheprovider ${per_test[@]+"${per_test[@]}"} -rs \
  tests/test_verdict.py tests/integrations/test_transformers.py tests/test_contain.py ${TESTS:-} 2>&1 \
  | tee "$OUT/pytest.log" | tail -25
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for f in "$OUT"/fuzz_*.log; do echo "== $f"; tail -3 "$f"; done
echo "gpu_verdict rc=$rc"
exit $rc
