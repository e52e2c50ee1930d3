#!/bin/bash
# Thirty-fourth session, prepared for the next one (no device machine was lent in this session). The MoE
# router + route at one token is ~6.2 us of a 30B layer's ~44 (thirtieth session's replay chain), ~4.5 us of it
# the Triton grid's last program routing alone. FP4RL_MOE_ROUTER_CUDA=1 takes the CUDA cluster kernel instead
# (fp4rl/kernels/moe_router_route.cu: router rows in shared memory before the PDL wait, logits to CTA 0 through
# distributed shared memory, warp-wide softmax / top-k / counting sort). GPU tests first (the kernel equal to
# its torch reference bit for bit, under PDL in a graph behind a fused add_rmsnorm, and in KernelMoeBlock),
# then the kernel alone against the Triton router_route (bench/moe_route_bench.py cuda), then Qwen3-30B-A3B
# W4A16 at batch 1 / 8, defaults and with it, each in a fresh process, and, if time is left, with it and
# device_run106's EARLY + GTRIGGER 3 (the two changes touch different kernels of the layer). Up to ~580 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu tests/test_moe_route.py -k "cuda" > $OUT/tests107.log 2>&1
echo "tests exit $?"; tail -3 $OUT/tests107.log
timeout 120 python3 bench/moe_route_bench.py cuda > $OUT/route107.log 2>&1; echo "bench exit $?"; cat $OUT/route107.log
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler107
arm defaults 175 1,8 "--profile-batch=" X=0
arm router_cuda 125 1,8 "--profile-batch=" FP4RL_MOE_ROUTER_CUDA=1
if [ $SECONDS -lt 460 ]; then
  arm router_cuda_early_gt3 $((580 - SECONDS)) 1,8 "--profile-batch=" FP4RL_MOE_ROUTER_CUDA=1 FP4RL_MMA16_EARLY=1 \
    FP4RL_MMA16_GTRIGGER=3
fi
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler107_*.json
