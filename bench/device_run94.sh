#!/bin/bash
# Thirty-first session. Deeper weight rings for the decode GEMMs inside the graph (device_run93's stamps: the
# one-row q/k/v GEMM's CTAs are resident 3.3 us before their release but issue only 2 of their warp's 4 steps
# before griddepcontrol.wait; the experts' GEMMs stream 2 steps per warp in flight at 1.4-2 TB/s).
# Arms, each in a fresh process, Qwen3-30B-A3B W4A16 at batch 1 and 8: the defaults; FP4RL_MMA16_DEPTH1=4
# (one-row dense launches); + FP4RL_MMA16_GDEPTH=4 / 6 (the routed experts). GPU tests of the same bits first.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py tests/test_gemv_cuda_grouped.py -k "deeper" \
  > $OUT/tests94.log 2>&1; echo "tests exit $?"; tail -3 $OUT/tests94.log
arm() {
  name=$1; shift
  env "$@" timeout 125 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 \
    --w4a16-last 0 --batch 1,8 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' --offload-trainer on \
    --out $OUT/sampler94_$name.json > $OUT/sampler94_$name.log 2>&1
  echo "$name exit $?"; grep '^| qwen' $OUT/sampler94_$name.log | cut -c1-160
}
arm base X=0
arm d1_4_g4 FP4RL_MMA16_DEPTH1=4 FP4RL_MMA16_GDEPTH=4
arm d1_4 FP4RL_MMA16_DEPTH1=4
arm d1_4_g6 FP4RL_MMA16_DEPTH1=4 FP4RL_MMA16_GDEPTH=6
