#!/bin/bash
# Prepared in the eleventh session (no device time left to run it): an A/B of that session's MoE decode defaults
# at full depth (one process per setting: the combine fold, the SiLU build, the BF16-cache attention kernel each
# switched off alone), then the Qwen3-8B table with the sampling kernel and the BF16-cache attention (owed since
# the tenth session). Three calls (each under the 600 s limit; a 48-layer process takes ~100-150 s with its
# build): `bash bench/device_run51.sh ab1` (defaults, no fold, the fold at every batch), `... ab2` (no SiLU
# build, SDPA), `... 8b`.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
run() {  # name, env..., then the preset list
  local name=$1; shift
  env "$@" timeout 170 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 \
    --batch 1,8,32 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' --out $OUT/sampler51_$name.json \
    > $OUT/sampler51_$name.log 2>&1
  echo "$name exit $?"; grep '^|' $OUT/sampler51_$name.log | cut -c1-300 | tail -3
}
if [ "$1" = ab1 ]; then
  run defaults FP4RL_NOTHING=1
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
