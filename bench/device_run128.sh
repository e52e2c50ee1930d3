#!/bin/bash
# Forty-first session: the sampler's per-step ops folded into the engine's launches (the mask's new column and
# positions + 1 into the step-inputs launch, the routing record inside the step's graph, the logprob record
# into the sampling head's pick kernel: four launches fewer between two replays). 1) Their tests on CUDA (the
# kernels against torch, the engine's steps, graphs against eager, routing and logprobs against the eager
# sampler). 2) Qwen3-30B-A3B at batch 1, BF16 / defaults / NVFP4 lm_head, each a fresh process (48 layers on
# an H200, 24 on an H100), as long as END (seconds) allows. `--no-tests`: 2) only.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
[ "$1" != --no-tests ] && timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_step_inputs.py \
    tests/test_sample_head.py tests/test_gpu_decode.py \
    -k "step_inputs or one_launch or bad_inputs or record or routing or kernel_decode_steps or graphs_replay or compaction or sampler_with_kernels or same_tokens" \
    2>&1 | tail -4
echo "tests at ${SECONDS}s"
source bench/sampler_arm.sh
depth=24; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && depth=48
ARM_SHAPE=qwen3-30b-a3b:${DEPTH:-$depth} ARM_PREFIX=${PREFIX:-sampler128_30b}
end=${END:-585}
for a in "bf16 --presets bf16" "defaults --lm-head bf16" "head --lm-head w4a16"; do
  set -- $a
  left=$((end - SECONDS)); [ $left -lt 60 ] && { echo "no time for $1"; continue; }
  [ $left -gt 170 ] && left=170
  arm $1 $left 1 "--profile-batch= $2 $3" X=0
done
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/${ARM_PREFIX}_*.json
