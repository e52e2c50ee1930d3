#!/bin/bash
# Prepared in the thirty-eighth session (no device lent). FP4RL_DENSE_NORM=1: the residual add + RMSNorm before a
# dense W4A16 q/k/v or gate/up inside that GEMM's mma16 launch (gemv_cuda.launch_prenorm, the .cu's PRENORM build;
# x staged whole: one row, 2-4 rows where the in-CTA split fits): two launches fewer a Qwen3-8B layer (72 a step;
# add_rmsnorm's ~2.8 us of advance each in the thirtieth session's chain: up to ~0.2 ms of the ~2.1 ms step at
# batch 1), none in the 30B (its input norm folds the MoE combine; its post-attention one is ROUTER_NORM's).
# It also folds an MoE layer's input norm with the previous layer's combine (PRENORM 2; the 30B: device_run115).
# First the GPU tests (both builds against prenorm.reference + launch bit for bit, the engine under graphs), then
# Qwen3-8B at batch 1 / 8: the defaults, DENSE_NORM, DENSE_NORM with ATTN_ROPE, and BF16 for the ratios if the
# time is there; each arm a fresh process with its graph-vs-eager check. Up to ~590 s. A flag that wins at batch
# 1 and does not lose at 8: the default.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 150 python3 -m pytest -q -m "gpu or not gpu" tests/test_gemv_cuda.py tests/test_gpu_decode_fused.py \
  tests/test_prenorm.py tests/test_moe_route.py tests/test_fused_kernels.py -k "prenorm or dense_norm or norm_router" \
  > $OUT/tests114.log 2>&1
echo "tests exit $? at ${SECONDS}s"; tail -5 $OUT/tests114.log
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler114
arm defaults 110 1,8 "--profile-batch=" X=0
arm norm 110 1,8 "--profile-batch=" FP4RL_DENSE_NORM=1
arm norm_rope 110 1,8 "--profile-batch=" FP4RL_DENSE_NORM=1 FP4RL_ATTN_ROPE=1
if [ $SECONDS -lt 480 ]; then
  arm bf16 $((588 - SECONDS)) 1,8 "--profile-batch= --presets bf16" X=0
fi
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler114_*.json
