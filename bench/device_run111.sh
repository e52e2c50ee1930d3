#!/bin/bash
# Prepared in the thirty-seventh session (no device lent) for the next one. The one-launch q/k-norm + RoPE +
# BF16-cache write + attention (kernels.attention.decode_attention_rope, FP4RL_ATTN_ROPE=1, off by default):
# the thirtieth session's replay chain put q/k-norm + RoPE at 1.6 us a layer of the 30B's batch-1 step
# (2.5x needs ~2 us a layer less). Its GPU tests first (the kernel against qk_norm_rope + decode_attention, with
# PDL as in the step: kind "triton", that of the launch it replaces; the engine's fused step with it, graphs
# on), then Qwen3-30B-A3B at batch 1 / 8: the defaults and ATTN_ROPE, each in a fresh process, then BF16 at the
# same batches for the ratios if the time is there. Up to ~590 s. If ATTN_ROPE wins at both batches: make it
# the default (gpu_decode.ATTN_ROPE), then the 8B.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 150 python3 -m pytest -q -m "gpu or not gpu" tests/test_attention_rope.py \
  tests/test_gpu_decode_fused.py -k "one_launch or repeated or bad_inputs" > $OUT/tests111.log 2>&1
echo "tests exit $? at ${SECONDS}s"; tail -3 $OUT/tests111.log
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler111
arm defaults 140 1,8 "--profile-batch=" X=0
arm rope 140 1,8 "--profile-batch=" FP4RL_ATTN_ROPE=1
if [ $SECONDS -lt 440 ]; then
  arm bf16 $((585 - SECONDS)) 1,8 "--profile-batch= --presets bf16" X=0
fi
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler111_*.json
