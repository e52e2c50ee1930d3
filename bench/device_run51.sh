#!/bin/bash
# Prepared in the eleventh and twelfth sessions (no device time left in either to run it). One mode per call
# (each under the 600 s limit; a 48-layer process takes ~100-150 s with its build, the BF16 one ~150 s more),
# in order of need:
#   base  the current defaults (fold <= 8 rows, SiLU build <= 8, BF16-cache attention kernel, router kernel off)
#         against BF16 in the same process: the ratio the defaults give, never timed as a whole; W4A16 with every
#         linear 4-bit and with the recipe's BF16 last layers (7 of 48), three repeats per point
#   ab1   the combine fold off, and on at every batch (is it what made batch 32 slower?)
#   tests the GPU tests cut short in the eleventh session (fold, router) or fixed since (the SILU test)
#   ab2   the SiLU build off, SDPA for the BF16 cache
#   8b    the Qwen3-8B table with the sampling kernel and the BF16-cache attention (owed since the tenth session)
# e.g. `bash bench/device_run51.sh base`; the ab modes compare W4A16 settings with `base`'s W4A16 row.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
run() {  # name, env..., then the preset list
  local name=$1; shift
  env "$@" timeout 170 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 \
    --batch 1,8,32 --kv bf16 --repeats 3 --tokens 8,40 --profile-batch '' --out $OUT/sampler51_$name.json \
    > $OUT/sampler51_$name.log 2>&1
  echo "$name exit $?"; grep '^|' $OUT/sampler51_$name.log | cut -c1-300 | tail -3
}
if [ "$1" = tests ]; then  # the GPU tests the eleventh session's calls cut short (fold, router) or that were
  # fixed after their last GPU run (the SILU test, twelfth session: it patched a function that had gone)
  timeout 500 python3 -m pytest -q -m gpu tests/test_moe_route.py tests/test_fused_kernels.py tests/test_gemv_cuda.py \
    tests/test_gpu_decode.py tests/test_triton_attention.py -rf --durations=8 2>&1 | tail -25
  exit 0
fi
if [ "$1" = base ]; then
  timeout 540 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0,0.15 --batch 1,8,32 --kv bf16 --repeats 3 --tokens 8,40 --profile-batch '' --out $OUT/sampler51_base.json \
    > $OUT/sampler51_base.log 2>&1
  echo "base exit $?"; grep '^|\|rror\|arn' $OUT/sampler51_base.log | cut -c1-300 | tail -10
  exit 0
fi
if [ "$1" = ab1 ]; then
  run nocombine FP4RL_MOE_COMBINE=0
  run combine64 FP4RL_MOE_COMBINE_MAX=64  # the fold at batch 32 too: is it what made batch 32 slower?
  exit 0
fi
if [ "$1" = ab2 ]; then
  run nosilu FP4RL_MOE_SILU=0
  run sdpa FP4RL_BF16_ATTENTION=0
  exit 0
fi
timeout 200 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 --batch 1,8,32 \
  --kv bf16 --repeats 3 --tokens 8,40 --profile-batch '' --out $OUT/sampler51_8b.json > $OUT/sampler51_8b.log 2>&1
echo "8b exit $?"; grep '^|\|rror' $OUT/sampler51_8b.log | cut -c1-300 | tail -8
