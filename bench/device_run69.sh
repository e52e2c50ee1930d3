#!/bin/bash
# Twenty-third session, after device_run68.sh a (whose Qwen3-30B-A3B run stopped at 330 s, after batch 128).
# Mode a: the rows-per-expert test (its stub lacked the copy's scales) and Qwen3-30B-A3B batch 256/512 with the
# rows-per-expert rule. Mode b: device_run68.sh b (16- and 32-row expert chunks).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "${1:-a}" in
a)
  timeout 60 python3 -m pytest -q -m "gpu or not slow" tests/test_triton_gemm.py -k "few_rows_per_expert" \
    > $OUT/tests69a.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests69a.log | tail -5
  export FP4RL_TUNE_CACHE=/tmp/fp4rl_tune69a
  timeout 420 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 --tune \
    --w4a16-last 0 --batch 256,512 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' \
    --offload-trainer on --out $OUT/sampler69a_30b.json > $OUT/sampler69a_30b.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler69a_30b.log | cut -c1-250 | tail -10
  ;;
b)
  bash bench/device_run68.sh b
  ;;
c)  # after b: chunks of 8 x gemv_cuda.grouped_mg(m, E) rows, the CUDA kernel to 32 rows per expert
  timeout 120 python3 -m pytest -q -m "gpu or not slow" tests/test_gemv_cuda_grouped.py tests/test_triton_gemm.py \
    -k "grouped or moe" > $OUT/tests69c.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests69c.log | tail -5
  export FP4RL_TUNE_CACHE=/tmp/fp4rl_tune69c
  timeout 420 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 --tune \
    --w4a16-last 0 --batch 256,512 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' \
    --offload-trainer on --out $OUT/sampler69c_30b.json > $OUT/sampler69c_30b.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler69c_30b.log | cut -c1-250 | tail -10
  ;;
esac
