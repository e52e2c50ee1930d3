#!/bin/bash
# Prepared in the thirty-seventh session (no device lent) for the next one. Two launches fewer per layer of
# Qwen3-30B-A3B's decode step, both off by default until timed here (2.5x BF16 at batch 1 needs ~2 us a layer
# less; the thirtieth session's replay chain: q/k-norm + RoPE 1.6 us of advance a layer, add_rmsnorm 2.8):
#  - FP4RL_ATTN_ROPE=1: q/k-norm + RoPE + the BF16 cache write inside the attention's launch
#    (kernels.attention.decode_attention_rope; PDL kind "triton", as the qk_norm_rope launch it replaces);
#  - FP4RL_MOE_ROUTER_NORM=1: the post-attention add + RMSNorm inside the CUDA router + route's launch
#    (moe_route_cuda.norm_router_route, up to gpu_experts.ROUTER_CUDA_MAX_TOKENS = 4 tokens).
# The 30B at batch 1 / 8 first: the defaults and both flags (each arm a fresh process with its graph-vs-eager
# check), then their GPU tests (each kernel against its reference / the two launches it replaces, the engine's
# fused step with them under graphs), then each flag alone at batch 1 if the time is there. Up to ~590 s. A flag
# that wins at batch 1 and does not lose at 8: the default; then device_run112 (BF16 in the same call, the chain).
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler111
arm defaults 130 1,8 "--profile-batch=" X=0
arm both 130 1,8 "--profile-batch=" FP4RL_ATTN_ROPE=1 FP4RL_MOE_ROUTER_NORM=1
timeout $((460 - SECONDS)) python3 -m pytest -q -m "gpu or not gpu" tests/test_attention_rope.py \
  tests/test_gpu_decode_fused.py tests/test_moe_route.py \
  -k "one_launch or repeated or bad_inputs or router_norm or norm_router or prenorm" > $OUT/tests111.log 2>&1
echo "tests exit $? at ${SECONDS}s"; tail -5 $OUT/tests111.log
if [ $SECONDS -lt 470 ]; then
  arm rope $((588 - SECONDS)) 1 "--profile-batch=" FP4RL_ATTN_ROPE=1
fi
if [ $SECONDS -lt 490 ]; then
  arm norm $((588 - SECONDS)) 1 "--profile-batch=" FP4RL_MOE_ROUTER_NORM=1
fi
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler111_*.json
