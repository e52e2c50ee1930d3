#!/bin/bash
# Measured at commit 5c93122 (the expert prefetch, sampler_gpu --expert-prefetch); both were taken out after
# device_run87 measured the prefetch slower (bench/gpu_kernels.md, twenty-ninth session).
# Twenty-ninth session. Mode a: the expert prefetch (gemv_cuda.EXPERT_PREFETCH: the MoE down projection guessing
# its expert before the PDL wait, the gate / up GEMM triggering after its own wait): its GPU bits test with the
# grouped GPU tests, the twenty-eighth session's untested RELOAD NaN / Inf test, then Qwen3-30B-A3B at batch 1
# and 8 with the prefetch off / on (choose_grouped's depth) / 3 steps ahead, against BF16 in the same process.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "${1:-a}" in
a)
  timeout 60 python3 -m pytest -q -m "gpu or not slow" \
    "tests/test_quant_cuda.py::test_gpu_cuda_nonfinite_unchecked_matches_triton" > $OUT/tests85q.log 2>&1
  echo "quant tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests85q.log | tail -4
  timeout 150 python3 -m pytest -q -m "gpu or not slow" tests/test_gemv_cuda_grouped.py > $OUT/tests85a.log 2>&1
  rc=$?; echo "grouped tests exit $rc"; grep -E 'passed|failed|Error|assert' $OUT/tests85a.log | tail -8
  [ $rc = 0 ] || exit 1
  timeout 420 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 1,8 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' \
    --expert-prefetch off,on,d3 --offload-trainer on --out $OUT/sampler85a_30b.json > $OUT/sampler85a_30b.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler85a_30b.log | cut -c1-250 | tail -12
  ;;
*) echo "mode a"; exit 2 ;;
esac
