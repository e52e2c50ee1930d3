#!/bin/bash
# Prepared in the twenty-ninth session for the next one (not yet run). The MoE route's last program (router_route
# at 1-8 tokens: 6.7 us a layer of Qwen3-30B-A3B's 2.18 ms batch-1 step, most of it the last program alone, 35%
# of its stalls at CTA barriers in the sixteenth session's ncu) does its softmax and top-8 as shared-memory
# reductions across 4 warps: 52 barrier lines in the kernel's SASS at 4 warps, 15 at 1 (static counts at 1 token,
# compiled offline for sm_90 with the device's Triton 3.6; bench/gpu_kernels.md, twenty-ninth session). Mode a: the GPU route tests (the sort from registers, REGS, against the sort from idx), then
# `bench/moe_route_bench.py regs` (warps 1 / 2 / 4, REGS on / off, router_route and route at 1 / 8 tokens).
# Mode b WARPS REGS: Qwen3-30B-A3B W4A16 at batch 1 / 8 in fresh processes, the defaults against
# FP4RL_MOE_ROUTER_WARPS=WARPS with FP4RL_MOE_ROUTE_REGS=REGS (cells: 16 = 1-2 tokens of top-8, 0 = off;
# take both from mode a's table).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "${1:-a}" in
a)
  timeout 120 python3 -m pytest -q -m "gpu or not slow" tests/test_moe_route.py > $OUT/tests90a.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests90a.log | tail -4
  timeout 300 python3 bench/moe_route_bench.py regs 2>&1 | tee $OUT/route90a.txt | tail -8
  ;;
b)
  flags="--shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 --w4a16-last 0 --batch 1,8 --kv bf16 --repeats 2 --tokens 8,40"
  for v in default:4:0 new:${2:-1}:${3:-16}; do
    IFS=: read name warps regs <<< "$v"
    FP4RL_MOE_ROUTER_WARPS=$warps FP4RL_MOE_ROUTE_REGS=$regs timeout 150 python3 -m fp4rl.benchmarks.sampler_gpu \
      $flags --profile-batch '' --offload-trainer on --out $OUT/sampler90_$name.json > $OUT/sampler90_$name.log 2>&1
    echo "$name (warps $warps, regs $regs) exit $?"; grep '^| qwen\|rror' $OUT/sampler90_$name.log | cut -c1-200
  done
  ;;
*) echo "mode a or b WARPS REGS"; exit 2 ;;
esac
