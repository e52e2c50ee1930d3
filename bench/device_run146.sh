#!/bin/bash
# Forty-seventh session: the full 48-layer Qwen3-30B-A3B on an 80 GB card. The benchmark's trainer now waits in
# host memory while every sampler is built (--offload-trainer on): the NVFP4 sampler quantizes each weight on the
# GPU, a weight at a time (qat.NVFP4Linear.quantized_weight(device=)), and the BF16 copy no longer holds the
# unfused tensors beside the fused ones while it fuses (packed.build_sampler_model). 1) The GPU test of the
# first (bytes equal to the trainer's own Q(W)) and the engine's generate + weight sync test. 2) BF16 / the defaults / an
# NVFP4 lm_head at batch 1 / 8 / 32, each arm a fresh process, as long as the call allows. Up to ~590 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 90 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_packed.py \
    tests/test_gpu_decode.py -k "host_trainer or generate_compaction" 2>&1 | tail -3
echo "tests at ${SECONDS}s"
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler146_30b48
arm bf16 200 1,8,32 "--profile-batch= --presets bf16" X=0
arm defaults 200 1,8,32 "--profile-batch= --lm-head bf16" X=0
left=$((588 - SECONDS)); [ $left -gt 60 ] && arm head $left 1,8,32 "--profile-batch= --lm-head w4a16" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler146_30b48_*.json
