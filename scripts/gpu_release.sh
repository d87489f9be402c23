#!/usr/bin/env bash
# The H200 jobs of a release, in device calls of under ten minutes each (logs and JSON land in $OUT):
#   bash scripts/gpu_release.sh checks   # every gpu-marked test, the engine-facing modules' tests compiled, the memory
#                                        # checker, the engine demo
#   bash scripts/gpu_release.sh bench    # the fuzz, the validator, the engine end to end, decode attention, the gather
#   bash scripts/gpu_release.sh reader   # the reader's step-loop cost with coordinate() on (q3), the tick scaling (q5)
# Each step has its own time limit, so one that hangs cannot eat the call; the summary at the end says what passed.
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}
summary=()
step() {  # step NAME SECONDS CMD...: run CMD with a limit, log to $OUT/NAME.log, record its status
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name rc=$rc $((SECONDS - t0))s")
  tail -4 "$OUT/$name.log"
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys,torch,triton,transformers;print(sys.version.split()[0],torch.__version__,triton.__version__,transformers.__version__)"
} | tee "$OUT/env.txt"
case "${1:-checks}" in
  checks)
    step pytest_gpu 240 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/
    step pytest_engine 150 python3 -m pytest -q -p no:cacheprovider -rs tests/validate/test_validate.py \
      tests/integrations/test_transformers.py tests/test_contain.py tests/cli/test_demo_transformers.py
    step memcheck 150 python3 scripts/memcheck.py
    step demo_engine 45 python3 -m tripwire demo --engine transformers
    ;;
  bench)
    step fuzz 150 python3 scripts/fuzz_transformers.py --runs 200 --cuda-graphs --contain --json "$OUT/fuzz.json"
    step bench_validate 60 python3 benchmarks/bench_validate.py --json "$OUT/bench_validate.json"
    step bench_transformers 240 python3 benchmarks/bench_transformers.py --contain --rounds 4 \
      --json "$OUT/bench_transformers.json"
    step bench_decode 100 python3 benchmarks/bench_decode_attention.py --no-sweep --out "$OUT/decode_attention.json"
    step bench_gather 60 python3 benchmarks/bench_cuda_gather.py --out "$OUT/cuda_gather.json"
    ;;
  reader)
    step q3_coordinate 330 env PYTHONPATH="benchmarks${PYTHONPATH:+:$PYTHONPATH}" python3 -m lab.run --only q3 --coordinate --out "$OUT/q3c"
    step q5 120 env PYTHONPATH="benchmarks${PYTHONPATH:+:$PYTHONPATH}" python3 -m lab.run --only q5 --quick --out "$OUT/q5"
    ;;
  *) echo "usage: $0 checks|bench|reader" >&2; exit 2 ;;
esac
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
