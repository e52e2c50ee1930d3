#!/bin/bash
# Twenty-fourth session (prepared in the twenty-third). Mode a: the GPU tests of the tuner after its move to
# kernels/gemm_tune.py, the dense copy and the decode copy (never run with the gpu marker), the grouped paths;
# then the GEMM / experts tables at HEAD (8 experts of 2048x768 now take 16-32-row chunks at 128-256 rows).
# Mode b: the experts above 32 rows per expert: 64-row chunks (MG 8; gate/up's K=2048 fits shared memory only
# with the split, mg8+s2x; plain mg8 prints FAILED there) against the Triton grouped GEMM
# (bench/grouped_sweep.py's triton variant), Qwen3-30B-A3B's experts at 256-1024 tokens.
# Mode c: the one-program MoE route past 512 pairs (device_run68.sh c).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "${1:-a}" in
a)
  timeout 240 python3 -m pytest -q -m "gpu or not slow" tests/test_triton_gemm.py tests/test_tune_cache.py \
    tests/test_gemv_cuda.py tests/test_gemv_cuda_grouped.py tests/test_gpu_decode.py \
    -k "tuner or dense_copy or decode_copy or keeps_its_picks or grouped or wide" > $OUT/tests70a.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests70a.log | tail -8
  export FP4RL_TUNE_CACHE=/tmp/fp4rl_tune70a
  timeout 300 python3 -m fp4rl.benchmarks.gpu_kernels --sections gemm,moe --rows 1,16,64,128,256,512 \
    --shapes 4096x14336 --out $OUT/kernels70a.json > $OUT/kernels70a.log 2>&1
  echo "kernels exit $?"; grep -v '^\[' $OUT/kernels70a.log | cut -c1-220 | tail -30
  ;;
b)
  timeout 400 python3 bench/grouped_sweep.py --tokens 256,512,1024 --variants auto,mg2,mg4,mg8,mg8+s2x,triton \
    --out $OUT/grouped70b.json > $OUT/grouped70b.log 2>&1
  echo "sweep exit $?"; grep -v '^\[' $OUT/grouped70b.log | cut -c1-170 | tail -40
  ;;
c)
  bash bench/device_run68.sh c
  ;;
esac
