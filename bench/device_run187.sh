#!/bin/bash
# Fifty-seventh session, first: 1) the mma.sync WARPS 4 GPU bit test (never run on a GPU) and choose_narrow's
# (2-16 rows on the wgmma build: each row's bits alone); 2) whether the wgmma
# build with the one-row split of K gives the one-row path's bits at 2-64 rows (bench/wgmma_bits.py), and its
# time against the mma.sync rule (auto) and the wgmma rule (wide). Up to END (default 560) s.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 150 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py tests/test_gemv_cuda_wide.py -p no:cacheprovider \
  -k 'four_warps or narrow or kernel_matches_reference' > $OUT/test187.log 2>&1
echo "test exit $? at ${SECONDS}s"; tail -3 $OUT/test187.log
timeout 250 python3 bench/wgmma_bits.py --out $OUT/bits187.json > $OUT/bits187.log 2>&1
echo "bits exit $? at ${SECONDS}s"; grep -c ' us ' $OUT/bits187.log; grep FAILED $OUT/bits187.log | head -5
# out of sample: Qwen3-4B, Qwen3-14B, Qwen3-30B-A3B's attention
[ $((${END:-560} - SECONDS)) -gt 120 ] || exit 0
timeout 150 python3 bench/wgmma_bits.py --rows 4,8,16 --out $OUT/bits187b.json \
  --shapes 6144x2560,2560x4096,19456x2560,2560x9728,7168x5120,5120x5120,5120x2048,2048x4096 > $OUT/bits187b.log 2>&1
echo "bits b exit $? at ${SECONDS}s"; grep -c ' us ' $OUT/bits187b.log; grep FAILED $OUT/bits187b.log | head -5
