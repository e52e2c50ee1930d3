#!/bin/bash
# Prepared in the thirty-eighth session (no device lent): the first call to make when a device is lent again, if
# only one comes. Qwen3-30B-A3B at batch 1 / 8: the defaults, then all three launch folds (FP4RL_ATTN_ROPE,
# FP4RL_MOE_ROUTER_NORM, FP4RL_DENSE_NORM: three launches fewer a layer at batch 1; with the norm flags every
# add_rmsnorm sums in the PRENORM order), then BF16 for the ratios in the same call; each arm a fresh process with
# its graph-vs-eager check, and any "disabled" warning (a fold that fell back) printed. Then, with the time left,
# the GPU tests of everything the three flags run (kernels against their references bit for bit, the engine under
# graphs). Up to ~590 s. If all three win at batch 1 and do not lose at 8: the defaults (then device_run112's
# chain with them); else device_run111 / 114 / 115 split them.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler116
arm defaults 130 1,8 "--profile-batch=" X=0
arm all3 130 1,8 "--profile-batch=" FP4RL_ATTN_ROPE=1 FP4RL_MOE_ROUTER_NORM=1 FP4RL_DENSE_NORM=1
grep -i "disabled\|failed" $OUT/sampler116_all3.log | sort | uniq -c | head
arm bf16 140 1,8 "--profile-batch= --presets bf16" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler116_*.json
if [ $SECONDS -lt 560 ]; then
  timeout $((585 - SECONDS)) python3 -m pytest -q -m "gpu or not gpu" tests/test_gemv_cuda_prenorm.py \
    tests/test_gpu_decode_fused.py tests/test_moe_route_cuda.py tests/test_fused_kernels.py tests/test_attention_rope.py \
    -k "prenorm or dense_norm or norm_router or router_norm or one_launch or repeated or bad_inputs" \
    > $OUT/tests116.log 2>&1
  echo "tests exit $? at ${SECONDS}s"; grep -E "passed|failed|FAILED|Error" $OUT/tests116.log | tail -12
fi
