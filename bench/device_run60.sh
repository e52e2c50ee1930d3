#!/bin/bash
# Seventeenth session. `a`: the GPU tests of the mma16 GEMM (the global scale read early, GSE, committed in the
# sixteenth session and not yet run; x staged by plain loads, XLD: the same bits), then both timed against the
# builds without them: dense 1-row launches with PDL (as the sampler launches them), 8 rows without, and the
# routed experts at 1 and 8 tokens. XLD was slower and was removed after this call (commit dfc3128 has it): `a`
# runs only on that commit. `b` / `c`: the decode step of Qwen3-30B-A3B / Qwen3-8B with the lm_head BF16 or
# NVFP4 (--lm-head), BF16 in the same process (`c` first runs the GSE GPU tests `a` did not reach).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ "$1" = a ]; then
  timeout 200 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py tests/test_gemv_cuda_grouped.py \
    > $OUT/tests_a_s17.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests_a_s17.log | tail -12
  timeout 110 python3 bench/mma16_sweep.py --shapes 5120x2048,2048x4096,6144x4096,4096x4096,4096x12288,24576x4096 \
    --rows 1 --variants pdl+gse0,pdl,pdl+xld1 --out $OUT/mma16_r1_s17.json > $OUT/mma16_r1_s17.log 2>&1
  echo "sweep 1 exit $?"; grep -v '^{' $OUT/mma16_r1_s17.log | cut -c1-150 | tail -24
  timeout 80 python3 bench/mma16_sweep.py --shapes 5120x2048,2048x4096,6144x4096,4096x4096 \
    --rows 8 --variants auto,xld1 --out $OUT/mma16_r8_s17.json > $OUT/mma16_r8_s17.log 2>&1
  echo "sweep 8 exit $?"; grep -v '^{' $OUT/mma16_r8_s17.log | cut -c1-150 | tail -12
  timeout 90 python3 bench/grouped_sweep.py --tokens 1,8 --variants pdl+gse0,pdl,pdl+xld1 \
    --out $OUT/grouped_s17.json > $OUT/grouped_s17.log 2>&1
  echo "grouped exit $?"; grep -v '^{' $OUT/grouped_s17.log | cut -c1-150 | tail -16
  exit 0
fi
if [ "$1" = b ]; then
  timeout 420 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 1,8 --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' \
    --lm-head bf16,w4a16 --out $OUT/sampler60_30b.json > $OUT/sampler60_30b.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler60_30b.log | cut -c1-300 | tail -16
  exit 0
fi
if [ "$1" = c ]; then
  timeout 150 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py tests/test_gemv_cuda_grouped.py \
    -k "global_scale or grouped_in_cta or silu_replays" > $OUT/tests_t_s17.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests_t_s17.log | tail -12
  timeout 400 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 1,8,32 --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' \
    --lm-head bf16,w4a16 --out $OUT/sampler60_8b.json > $OUT/sampler60_8b.log 2>&1
  echo "8b exit $?"; grep '^|\|rror' $OUT/sampler60_8b.log | cut -c1-300 | tail -20
  exit 0
fi
echo "usage: bash bench/device_run60.sh a|b|c"; exit 2
