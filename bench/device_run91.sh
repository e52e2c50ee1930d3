#!/bin/bash
# Measured at commit 6cb48f1 (device_run91 a, thirtieth session): the fused add + RMSNorm was no faster at batch 1
# and 26% slower at batch 8, and was taken out (bench/gpu_kernels.md, thirtieth session).
# Thirtieth session. The residual add + RMSNorm before each MoE MLP inside its router's launch
# (moe_route.add_rmsnorm_router_route, KernelMoeBlock.add_norm_routed_parts; FP4RL_MOE_ADD_NORM=0 turns it off)
# and the route's sort from registers at 1-2 tokens (FP4RL_MOE_ROUTE_REGS=16; device_run90 a: router_route at
# 1 token 5.96 -> 5.75 us at 4 warps, slower at 8 tokens).
# Mode a: the GPU tests (the fused launch's bits against add_rmsnorm then router_route; the fused step's
# logits with and without it), then Qwen3-30B-A3B W4A16 at batch 1 / 8, each arm in a fresh process.
# Mode b: BF16 and W4A16 in one process with ARMS' settings (the ratio of the same run).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
flags="--shapes qwen3-30b-a3b:48 --w4a16-last 0 --batch 1,8 --kv bf16 --repeats 2 --tokens 8,40"
flags="$flags --offload-trainer on"
case "${1:-a}" in
a)
  timeout 180 python3 -m pytest -q -m "gpu or not slow" tests/test_moe_route.py tests/test_gpu_decode_fused.py \
    -k "add_rmsnorm or router_route or folds or gpu_fused_step" \
    > $OUT/tests91a.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests91a.log | tail -8
  for v in old:0:0 add:1:0 addregs:1:16; do
    IFS=: read name add regs <<< "$v"
    FP4RL_MOE_ADD_NORM=$add FP4RL_MOE_ROUTE_REGS=$regs timeout 140 python3 -m fp4rl.benchmarks.sampler_gpu \
      $flags --profile-batch '' --presets nvfp4-w4a16 --out $OUT/sampler91_$name.json > $OUT/sampler91_$name.log 2>&1
    echo "$name (add-norm $add, regs $regs) exit $?"; grep '^| qwen\|rror' $OUT/sampler91_$name.log | cut -c1-200
  done
  ;;
b)
  IFS=: read add regs <<< "${2:-1:16}"
  FP4RL_MOE_ADD_NORM=$add FP4RL_MOE_ROUTE_REGS=$regs timeout 400 python3 -m fp4rl.benchmarks.sampler_gpu \
    $flags --profile-batch '' --presets bf16,nvfp4-w4a16 --out $OUT/sampler91b.json > $OUT/sampler91b.log 2>&1
  echo "exit $?"; grep '^| qwen\|rror' $OUT/sampler91b.log | cut -c1-220
  ;;
*) echo "mode a or b ADD:REGS"; exit 2 ;;
esac
