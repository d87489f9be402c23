#!/usr/bin/env bash
# vLLM's real GPU engine on the device (vLLM 0.26.0, ../shared/vllm-gpu): one part per call. The bundle travels in
# two parts, .vx1 and .vx2 (bundle.sh), each with a copy of assemble.sh beside it (../shared does not travel):
#   call 1, carrying .vx1:   bash scripts/gpu_vllm.sh keep
#   call 2, carrying .vx2:   bash scripts/gpu_vllm.sh core       (assembles vLLM in /tmp, then the engine runs)
#   later calls, while warm: bash scripts/gpu_vllm.sh fuzz | bench    (nothing carried: vLLM is in /tmp already)
# Copy ../shared/vllm-gpu/assemble.sh into .vx1/ and .vx2/ first (both ignored in .git/info/exclude).
# Logs and JSON under $OUT (or ./gpu-out). Each part stays inside one call's 10 minutes.
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
part=${1:?usage: gpu_vllm.sh keep|core|fuzz|bench|tests}
shift
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
asm=$(ls .vx1/assemble.sh .vx2/assemble.sh 2>/dev/null | head -1)
if [ "$part" = keep ]; then bash "$asm" keep; exit $?; fi
# A later call on the same warm machine carries neither part: vLLM is assembled in /tmp already.
if [ -z "$asm" ] && [ -d /tmp/vllm-site/site/vllm ]; then site=/tmp/vllm-site/site
else site=$(bash "$asm") || { echo "assemble failed (rc $?): send .vx1 and .vx2 again"; exit 3; }; fi
export PYTHONPATH=$PWD/src:$site${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys,torch,triton,vllm;print(sys.version.split()[0],torch.__version__,triton.__version__,vllm.__version__)"; } >"$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
case "$part" in
  core) timeout 560 python3 scripts/gpu_vllm.py "$OUT/vllm" --parts controls,clean,contain,mask,fp8 "$@" 2>&1 | tail -80 ;;
  fuzz) timeout 560 python3 scripts/gpu_vllm.py "$OUT/vllm" --parts fuzz "$@" 2>&1 | tail -40 ;;
  bench) timeout 330 python3 benchmarks/bench_vllm_gpu.py "$OUT/bench" "$@" 2>&1 | tail -20
         timeout 240 python3 benchmarks/bench_vllm_gpu.py "$OUT/bench" --kv-cache-dtype fp8 --repeats 4 2>&1 | tail -12 ;;
  # The GPU tests of what the vLLM and numerics work touches (the whole GPU suite: scripts/gpu_check.sh).
  tests) timeout 560 python3 -m pytest -q -p no:cacheprovider tests/numerics tests/kernels/test_request_rows.py \
           tests/test_verdict.py tests/integrations/test_transformers.py tests/integrations/test_transformers_numerics.py \
           tests/test_contain.py tests/_runtime tests/validate/test_launcher.py tests/test_testing.py tests/test_import.py \
           tests/test_report_api.py "$@" 2>&1 | tail -40 ;;
  *) echo "unknown part $part (keep, core, fuzz, bench, tests)"; exit 2 ;;
esac
