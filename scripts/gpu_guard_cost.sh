#!/usr/bin/env bash
# Issue 27 on the H200 (about 13 minutes: two device calls, see STEPS): the GPU tests of the cold fault path and of
# vLLM's adopted kernels, the adopted-kernel benchmark, ncu on the CUDA reshape_and_cache (registers, occupancy: the
# cause of the guard's cost), compute-sanitizer over the adopted kernels, the validator's host cost, the numeric
# kernels. Usage: bash scripts/gpu_guard_cost.sh; everything goes to $OUT (or ./gpu-out): one log per step, JSON
# results, and summary.txt (each step's exit status and the lines that matter). STEPS picks steps by name (default
# all): STEPS="build_ext bench_adopted" in one call (about 7 minutes), then STEPS="build_ext bench_slot_mapping ncu
# bench_validate bench_numerics checks" (the checks: the GPU tests and compute-sanitizer).
# vLLM's side of every adopted-kernel comparison (its Triton modules, its compiled CUDA op) is the vLLM on the path:
# on the device, the GPU bundle (../shared/vllm-gpu/README.md: export PYTHONPATH=$(bash assemble.sh):$PYTHONPATH
# first). Without it those comparisons are skipped, each saying so, and memcheck's adopted runs end INCOMPLETE.
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# The extension build tree outside $OUT: build trees need not come back.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tripwire-torch-extensions}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || export PYTHONPATH=$PWD/src
SUM="$OUT/summary.txt"; : >"$SUM"
T0=$(date +%s)
want() { case " ${STEPS:-all} " in *" all "* | *" $1 "*) return 0 ;; *) return 1 ;; esac; }
step() {  # step NAME LIMIT_S CMD...: run with a time limit, log to $OUT/NAME.log, record the status
  local name=$1 limit=$2; shift 2
  want "$name" || return 0
  local t=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc ($(( $(date +%s) - t )) s, at $(( $(date +%s) - T0 )) s)" | tee -a "$SUM"
  return 0
}
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import sys,torch,triton;print(sys.version.split()[0],torch.__version__,torch.version.cuda,triton.__version__)"
  nvcc --version | tail -1; which ncu compute-sanitizer
  python3 -c "import vllm; print('vllm', vllm.__version__, vllm.__file__)" 2>&1 | tail -1; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt" >>"$SUM"

# 1. The CUDA extension (nvcc, about a minute), built once here so that no later step compiles it under a tool.
step build_ext 240 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from adopted_vllm import cuda_ext; cuda_ext.build(); print(cuda_ext.library_path())"

# 2. vLLM's kernels against their guarded copies (and the vote control of the CUDA kernel): graph replays,
#    interleaved rounds, the A/A noise floor, registers and programs per SM of each.
#    Six loads of each side's code, pooled (benchmarks/RESULTS.md, "Where the code lands").
step bench_adopted 420 python3 benchmarks/bench_adopted.py --rounds 41 --rep-ms 30 --out "$OUT/adopted.json"
want bench_adopted && grep -E "cost|ERROR" "$OUT/bench_adopted.log" | cut -c1-240 >>"$SUM"

# 2b. tripwire's slot_mapping at engine batch sizes (256 / 4096 / 32768 tokens): guarded against its twin.
step bench_slot_mapping 90 python3 benchmarks/bench_slot_mapping.py --out "$OUT/slot_mapping.json"
want bench_slot_mapping && grep -E "cost" "$OUT/bench_slot_mapping.log" >>"$SUM"

# 3. ncu on the CUDA reshape_and_cache at 4096 tokens: vLLM's compiled kernel, the guarded copy, the vote control; launch
#    registers, the occupancy limit and achieved occupancy, the time. Clocks not locked (--clock-control none).
cat >"$OUT/ncu_target.py" <<'EOF'
import sys
sys.path.insert(0, "benchmarks")
import torch, tripwire
from adopted_vllm import cuda_ext
cuda_ext.vllm_op()  # vLLM's compiled kernel is ncu's baseline: without a GPU vLLM, NoVllm says what to install
tripwire.prealloc("cuda")
T, H, D, PS = 4096, 8, 128, 16
NB = 4 * T // PS
k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
kc, vc = (torch.zeros(NB, PS, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
slots = torch.randperm(NB * PS, device="cuda")[:T]
one = torch.ones(1, device="cuda")
for _ in range(3):  # warm: the last round is what ncu's --launch-skip leaves
    for g in (False, True, "vote"):
        cuda_ext.reshape_and_cache_flash(k, v, kc, vc, slots, one, one, guard=g)
torch.cuda.synchronize()
EOF
if ! want ncu; then
  :
elif command -v ncu >/dev/null; then
  step ncu 120 ncu --clock-control none -k regex:reshape_and_cache_flash --launch-skip 6 --launch-count 3 \
    --metrics launch__registers_per_thread,launch__occupancy_limit_registers,launch__waves_per_multiprocessor,sm__warps_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum \
    python3 "$OUT/ncu_target.py"
  grep -E "reshape_and_cache_flash|registers_per_thread|occupancy_limit_registers|warps_active|time_duration|dram__|inst_executed|==ERROR|==WARNING" "$OUT/ncu.log" | sed 's/(int64_t[^)]*)//' | cut -c1-160 >>"$SUM"
else
  echo "== ncu: not found" | tee -a "$SUM"
fi

# 4. The validator's host cost per eager call (target <= 20 us) and its graph-replayed device time.
step bench_validate 90 python3 benchmarks/bench_validate.py --repeats 3 --json "$OUT/validate.json"
want bench_validate && grep -E "host|per call" "$OUT/bench_validate.log" >>"$SUM"

# 5. The numeric kernels: the non-finite counter's sweep against a copy (target >= 90 % everywhere) and the fused FP8
#    counter against count=False (target <= 2 % at 2048 tokens; six loads of each side's kernel, pooled). The launch
#    shapes' sweep of the fused kernel (benchmarks/sweep_fused.py: one load each) is a design record, not run here.
step bench_numerics 200 env PYTHONPATH="benchmarks${PYTHONPATH:+:$PYTHONPATH}" python3 -m lab.numerics --fused-tokens 2048 --out "$OUT/numerics.json"
want bench_numerics && grep -E "^(non-finite counter|  sweep|2048x8x128)" "$OUT/bench_numerics.log" >>"$SUM"

# Last, not timed, side by side: the GPU tests and compute-sanitizer (neither disturbs a measurement any more).
# The GPU tests: the adopted kernels (counts, masking, graph replay, the CUDA extension and its second loads), the
# helpers' cold path, the register rule and the resource check (compiled for sm_90 here too), the validator's launch
# path.
if want checks; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rs -rx tests/test_adopted_vllm.py tests/test_resources.py \
    tests/test_register_rule.py tests/validate/test_validate.py tests/triton/test_triton.py -k "gpu or adopted or resources or register or validate" \
    >"$OUT/pytest.log" 2>&1 & tpid=$!
  # compute-sanitizer memcheck over the adopted kernels: 0 errors guarded, errors for vLLM's originals (from the vLLM
  # on the path); the four in parallel (each driver runs its guarded and original child one after the other).
  pids=()
  for k in adopted.decode_gqa adopted.decode_mha adopted.reshape_triton adopted.reshape_cuda; do
    timeout 240 python3 scripts/memcheck.py --kernels "$k" >"$OUT/memcheck_$k.log" 2>&1 & pids+=($!)
  done
  mrc=0; for p in "${pids[@]}"; do wait "$p" || mrc=1; done
  echo "== memcheck rc=$mrc (at $(( $(date +%s) - T0 )) s)" | tee -a "$SUM"
  grep -h -E "^adopted\.|memcheck:" "$OUT"/memcheck_adopted.*.log >>"$SUM"
  wait "$tpid"; echo "== pytest rc=$? (at $(( $(date +%s) - T0 )) s)" | tee -a "$SUM"
  tail -3 "$OUT/pytest.log" >>"$SUM"
fi

echo "gpu_guard_cost done in $(( $(date +%s) - T0 )) s" | tee -a "$SUM"
cat "$SUM"
