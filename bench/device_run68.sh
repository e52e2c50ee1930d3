#!/bin/bash
# Twenty-third session (prepared in the twenty-second). Mode a: the rows-per-expert rule for the grouped CUDA
# kernel (gemm.MMA16_GROUPED_ROWS_PER_EXPERT, set after the twenty-second session's last call) on the GPU: its
# tests and the grouped / MoE / dense-copy GPU tests, Qwen3-30B-A3B at batch 64-512 against BF16. Mode b: the
# grouped kernel with 16- and 32-row chunks (MG 2, 4) at 16-64 rows per expert (bench/grouped_sweep.py), where
# 8-row chunks re-read each expert's weights (bench/gpu_kernels.md, twenty-second session, Next 1).
# Mode c: the one-program MoE route past 512 pairs (FP4RL_MOE_ROUTE_PAIRS), Qwen3-30B-A3B at batch 128 / 256.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "${1:-a}" in
a)
  timeout 200 python3 -m pytest -q -m "gpu or not slow" tests/test_triton_gemm.py tests/test_gemv_cuda_grouped.py \
    tests/test_gpu_decode.py -k "grouped or moe or dense_copy or MOE" > $OUT/tests68a.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests68a.log | tail -10
  export FP4RL_TUNE_CACHE=/tmp/fp4rl_tune68a
  timeout 330 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 --tune \
    --w4a16-last 0 --batch 64,128,256,512 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' \
    --offload-trainer on --out $OUT/sampler68a_30b.json > $OUT/sampler68a_30b.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler68a_30b.log | cut -c1-250 | tail -10
  ;;
b)
  timeout 400 python3 bench/grouped_sweep.py --tokens 64,128,256,512 --variants auto,mg2,mg4,mg2+s2x \
    --out $OUT/grouped68b.json > $OUT/grouped68b.log 2>&1
  echo "sweep exit $?"; grep -v '^\[' $OUT/grouped68b.log | cut -c1-170 | tail -40
  ;;
c)  # the one-program MoE route past 64 tokens (FP4RL_MOE_ROUTE_PAIRS=2048: batch 128 and 256 of Qwen3-30B-A3B,
    # whose route is the torch route's ~15 launches per layer today); its tests with the bound raised first (less
    # the two that check the default bound's refusals)
  timeout 150 env FP4RL_MOE_ROUTE_PAIRS=2048 python3 -m pytest -q -m "gpu or not slow" tests/test_moe_route.py \
    -k "not refuses" > $OUT/tests68c.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests68c.log | tail -6
  export FP4RL_TUNE_CACHE=/tmp/fp4rl_tune68c
  for pairs in 512 2048; do
    timeout 200 env FP4RL_MOE_ROUTE_PAIRS=$pairs python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 \
      --presets nvfp4-w4a16 --tune --w4a16-last 0 --batch 128,256 --kv bf16 --repeats 2 --tokens 8,40 \
      --profile-batch '' --offload-trainer on --out $OUT/sampler68c_$pairs.json > $OUT/sampler68c_$pairs.log 2>&1
    echo "route pairs $pairs exit $?"; grep '^|' $OUT/sampler68c_$pairs.log | cut -c1-200 | tail -3
  done
  ;;
esac
