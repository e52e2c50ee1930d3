#!/bin/bash
# Thirty-third session, prepared for the next one (device time spent). At one token the experts' down
# projection spends 0.8 us finding its expert and ~2.5 us more until its first weights land, all after its
# release (device_run99 / 103 stamps), while its CTAs sit resident ~1 us before it. Its offsets were written by
# the route, two kernels back, and the gate / up before it lets it start only once past its own wait (TRIGGER
# 2), so they are final by then: FP4RL_MMA16_EARLY=1 reads them (from L2) and issues the first weight steps
# before griddepcontrol.wait, as the dense GEMMs do; FP4RL_MMA16_GTRIGGER=3 also has the gate / up let it start
# right after its wait, so the down weights stream while the gate / up still runs. The same bits.
# GPU tests first (EARLY under PDL in a graph with new offsets each replay, and behind a PDL writer of the
# offsets that writes late); then each arm in a fresh process
# (Qwen3-30B-A3B W4A16 at batch 1 / 8), then the best-looking arm's stamps at batch 1. Up to ~570 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu tests/test_gemv_cuda_grouped_switches.py tests/test_gemv_cuda_grouped.py \
  -k "early or silu_replays" > $OUT/tests106.log 2>&1; echo "tests exit $?"; tail -3 $OUT/tests106.log
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler106
arm defaults 175 1,8 "--profile-batch=" X=0
arm early 125 1,8 "--profile-batch=" FP4RL_MMA16_EARLY=1
arm early_gt3 125 1,8 "--profile-batch=" FP4RL_MMA16_EARLY=1 FP4RL_MMA16_GTRIGGER=3
if [ $SECONDS -lt 480 ]; then
  arm early_gt3_stamps $((580 - SECONDS)) 1 "--profile-batch=1 --mma16-stamps" FP4RL_MMA16_EARLY=1 \
    FP4RL_MMA16_GTRIGGER=3
fi
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler106_*.json
for f in $OUT/sampler106_*stamps*.json.gz; do [ -e "$f" ] && python3 -m fp4rl.benchmarks.stamps "$f"; done
